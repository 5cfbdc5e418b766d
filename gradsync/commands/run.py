"""``gradsync run -n N -- CMD``: N local workers with torchrun's environment, or under Open MPI's mpirun."""

from __future__ import annotations

import argparse
from typing import Any

from gradsync.errors import GradsyncError

__all__ = ["add_parser", "cmd_run"]


def cmd_run(args: argparse.Namespace) -> int:
    from gradsync.launch import check_command, end_on_signals, launch_local, run_launcher, worker_command

    cmd = worker_command(args.cmd, "nothing to run: gradsync run --workers 4 -- python train.py")
    if args.mpi:
        from gradsync.comm.mpi import mpi_available, mpirun_command

        reason = mpi_available()
        if reason:
            raise GradsyncError(f"--mpi: {reason}")
        check_command(cmd)
        with end_on_signals():
            return run_launcher(mpirun_command(args.workers, cmd), timeout=args.timeout)
    env = {"GRADSYNC_TOPOLOGY": args.topology} if args.topology else {}
    with end_on_signals():
        return launch_local(cmd, args.workers, env=env, timeout=args.timeout)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``run`` to the main CLI's subparsers."""
    rn = subparsers.add_parser("run", help="start N local workers with torchrun's environment (or under mpirun)")
    rn.add_argument("--workers", "-n", type=int, default=2, help="number of worker processes")
    rn.add_argument("--topology", help="sets GRADSYNC_TOPOLOGY, the default topology of gradsync.init()")
    rn.add_argument("--timeout", type=float, default=None, help="kill the workers after this many seconds (exit 124)")
    rn.add_argument("--mpi", action="store_true", help="launch with Open MPI's mpirun instead (for transport='mpi')")
    rn.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run, e.g. -- python train.py")
    rn.set_defaults(func=cmd_run)
    return rn
