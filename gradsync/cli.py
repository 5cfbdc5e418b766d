"""The ``gradsync`` command: topologies, plans and simulations (topo, plan, simulate, bench), runs (run, launch, testbed, demo), transfer ordering (order), compressors (compress) and models.

Choices come from the registries, so ``--help`` lists them. Bad input prints one line
``gradsync: error: ...`` naming the fix and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from gradsync.commands import bench, compress, demo, launch, models, order, plan, run, simulate, testbed, topo
from gradsync.commands._sizes import parse_size, parse_sizes
from gradsync.commands.demo import DEMO_TOPOLOGIES
from gradsync.errors import GradsyncError
from gradsync.launch import Terminated

__all__ = ["COMMANDS", "DEMO_TOPOLOGIES", "build_parser", "main", "parse_size", "parse_sizes"]

#: One module per subcommand, in the order ``gradsync --help`` lists them; each has ``add_parser(subparsers)``,
#: which adds its subcommand with the handler as ``func``.
COMMANDS: tuple[ModuleType, ...] = (topo, plan, simulate, bench, testbed, launch, order, run, compress, models, demo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def _stdout_closed() -> int:
    """The reader of our output went away (``gradsync plan --json | head``): stop quietly, as a command
    killed by SIGPIPE would, instead of a BrokenPipeError traceback. stdout is pointed at /dev/null so the
    interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (captured in-process): nothing left to flush into
        pass
    return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except GradsyncError as exc:
        print(f"gradsync: error: {exc}", file=sys.stderr)
        return 2
    except Terminated as exc:  # raised by a launcher's signal handler once its children are ended
        print(f"gradsync: {exc}; every process it started was ended", file=sys.stderr)
        return 128 + exc.signum


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
