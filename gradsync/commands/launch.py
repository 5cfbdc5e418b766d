"""``gradsync launch --workers W --servers S --clients C -- CMD``: a parameter-server job (:mod:`gradsync.ps.launch`)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "cmd_launch"]


def cmd_launch(args: argparse.Namespace) -> int:
    from gradsync.launch import end_on_signals, worker_command
    from gradsync.ps.launch import PSJob, launch

    cmd = worker_command(args.cmd, "nothing to run: gradsync launch --workers 4 --servers 1 -- python train.py")
    job = PSJob(workers=args.workers, servers=args.servers, clients=args.clients, checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=args.checkpoint_every, checkpoint_interval_s=args.checkpoint_interval,
                timeout_s=args.timeout, request_timeout_s=args.request_timeout, testbed=args.testbed,
                colocate=args.colocate)
    with end_on_signals():
        return launch(cmd, job)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``launch`` to the main CLI's subparsers."""
    p = subparsers.add_parser(
        "launch", help="start PS servers and workers on this machine (KVStore jobs, MXNET-MPI)",
        description="Start S parameter servers (ZeroMQ; on loopback, or with --testbed inside the emulated cluster), "
                    "then W workers grouped into C clients, with the "
                    "environment gradsync.kvstore.create() reads. Every frame is authenticated with a random per-job "
                    "secret (GRADSYNC_PS_SECRET, if set, is used instead) and carries a random job id.")
    p.add_argument("--workers", "-n", type=int, required=True, help="number of worker processes")
    p.add_argument("--servers", "-s", type=int, default=1, help="number of servers (0: collective, no servers)")
    p.add_argument("--clients", "-c", type=int, default=0, help="worker groups talking to the servers (default: W)")
    p.add_argument("--checkpoint-dir", default=None, help="servers checkpoint here and restore from here")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint after this many updates (0: off)")
    p.add_argument("--checkpoint-interval", type=float, default=0.0, help="checkpoint every S seconds (0: off)")
    p.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds (exit 124)")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds one KVStore request may take")
    p.add_argument("--testbed", action="store_true",
                   help="run servers and workers inside the emulated cluster (gradsync testbed up): workers on hosts "
                        "0..W-1, servers on the next S hosts")
    p.add_argument("--colocate", action="store_true", help="with --testbed: server i on worker i's host")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the worker command, e.g. -- python train.py")
    p.set_defaults(func=cmd_launch)
    return p
