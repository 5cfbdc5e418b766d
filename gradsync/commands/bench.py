"""``gradsync bench [NAME [options]]``: list the named benchmarks or run one."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "cmd_bench"]


def cmd_bench(args: argparse.Namespace) -> int:
    from gradsync.sim.bench import BENCHMARKS, checkout_available

    if not args.name:
        for name, entry in BENCHMARKS.items():
            print(f"{name:16s} {'*' if entry.checkout else ' '} {entry.summary}")
        here = "found" if checkout_available() else "not found: these fail from a wheel install"
        print(f"\n* needs a gradsync source checkout (git clone, pip install -e .); {here}")
        print("Run one with 'gradsync bench NAME [its options]'; 'gradsync bench NAME --help' lists them.")
        return 0
    return BENCHMARKS.get(args.name).run(args.args)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to the main CLI's subparsers."""
    bn = subparsers.add_parser("bench", help="list or run a named benchmark", add_help=True)
    bn.add_argument("name", nargs="?", help="benchmark name; leave out to list them")
    bn.add_argument("args", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    bn.set_defaults(func=cmd_bench)
    return bn
