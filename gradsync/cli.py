"""The ``gradsync`` command: topologies, plans and simulations (topo, plan, simulate, bench), runs (run, launch, testbed, demo), transfer ordering (order), compressors (compress) and models.

Choices come from the registries, so ``--help`` lists them. Bad input prints one line
``gradsync: error: ...`` naming the fix and exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from gradsync.commands._sizes import parse_size, parse_sizes
from gradsync.errors import GradsyncError
from gradsync.launch import Terminated

__all__ = ["COMMAND_NAMES", "EXAMPLES", "HelpFormatter", "build_parser", "command_module", "main", "parse_size",
           "parse_sizes"]

#: The subcommands, in the order ``gradsync --help`` lists them: each is the module ``gradsync.commands.<name>``,
#: whose ``add_parser(subparsers)`` adds it with the handler as ``func``. A command line that names one builds that
#: one's parser alone (:func:`main`): ``gradsync run`` does not import the planner that ``plan``'s choices list.
COMMAND_NAMES: tuple[str, ...] = ("topo", "plan", "simulate", "bench", "testbed", "launch", "order", "run",
                                  "compress", "models", "demo")


def command_module(name: str) -> ModuleType:
    """The module of subcommand ``name`` (one of :data:`COMMAND_NAMES`), imported now if it was not."""
    if name not in COMMAND_NAMES:
        raise ValueError(f"unknown gradsync command {name!r}; the commands are {', '.join(COMMAND_NAMES)}")
    return importlib.import_module(f"gradsync.commands.{name}")


#: Two examples per subcommand, shown at the end of its ``--help``.
EXAMPLES: dict[str, tuple[str, str]] = {
    "topo": ("gradsync topo list", "gradsync topo draw p3.16xlarge -o p3.png"),
    "plan": ("gradsync plan -t p3.16xlarge -a lp --size 100MB",
             "gradsync plan -t racks:2,2,2 -a auto --size 64MB --json"),
    "simulate": ("gradsync simulate -t switch:8 -a ring --size 64MB --timeline ring.png",
                 "gradsync simulate -t p3.16xlarge -a lp --trace plan.json   # open in ui.perfetto.dev"),
    "bench": ("gradsync bench", "gradsync bench sim-scaling --cases ps-switch16"),
    "testbed": ("sudo gradsync testbed up --topology switch:4", "sudo gradsync testbed run -- python train.py"),
    "launch": ("gradsync launch --workers 4 --servers 1 -- python train.py",
               "gradsync launch --workers 8 --servers 2 --checkpoint-dir ckpt -- python train.py"),
    "order": ("gradsync order resnet50 --method tic --workers 4", "gradsync order vgg16 --mode allreduce --json"),
    "run": ("gradsync run --workers 2 -- python train.py",
            "GRADSYNC_TRACE=run.json gradsync run --workers 4 --topology switch:4 -- python train.py"),
    "compress": ("gradsync compress list", "gradsync compress list --json"),
    "models": ("gradsync models", "gradsync models --json"),
    "demo": ("gradsync demo", "gradsync demo --workers 4 --steps 50 --no-train"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option's help (unless the help already says it, or there is none to show) and the
    description and examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or "%(default)" in text:
            return text
        return super()._get_help_string(action) or text


def _with_help(parser: argparse.ArgumentParser, examples: tuple[str, ...] = ()) -> None:
    """``parser`` and its own subcommands (``gradsync topo``'s actions...) show defaults; ``examples`` end its help."""
    parser.formatter_class = HelpFormatter
    if examples:
        parser.epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _with_help(child)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``gradsync`` parser with every subcommand, or with subcommand ``only`` alone (what parsing a command line
    that names it needs: its ``--help`` and its errors read the same)."""
    p = argparse.ArgumentParser(prog="gradsync", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_NAMES if only is None else (only,):
        _with_help(command_module(name).add_parser(sub), EXAMPLES.get(name, ()))
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
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in COMMAND_NAMES else None)
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
