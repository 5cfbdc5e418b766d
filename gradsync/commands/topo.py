"""``gradsync topo list|show|export|draw``: the topology registry on the command line."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from gradsync.commands._output import emit_json
from gradsync.errors import GradsyncError
from gradsync.paths import check_output
from gradsync.topology import BUILDERS, get_topology, save

__all__ = ["add_parser", "cmd_topo"]


def cmd_topo(args: argparse.Namespace) -> int:
    if args.action == "list":
        for name, entry in BUILDERS.items():
            alias = BUILDERS.aliases_of(name)
            label = entry.example + (f" (alias {', '.join(alias)})" if alias else "")
            print(f"{label:28s} {entry.summary}")
        print("\nAny of these accepts a rank selection, e.g. p3.16xlarge[0,1,2,3,7]; or give a .json/.yaml file.")
        return 0
    if not args.spec:
        raise GradsyncError(f"'gradsync topo {args.action}' needs a topology, e.g. 'gradsync topo {args.action} p3.16xlarge'")
    check_output(args.output, "-o/--output")
    topo = get_topology(args.spec)
    if args.action == "show":
        if args.json:
            emit_json(topo.to_dict())
        else:
            print(topo.summary())
            print("ranks: " + " ".join(topo.ranks))
            for lk in topo.links:
                print(f"  {lk.a:>10s} -- {lk.b:<10s} {lk.bandwidth_GBps:8.2f} GB/s  {lk.kind}")
        return 0
    if args.action == "export":
        out = Path(args.output or f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', topo.name)}.yaml")
        save(topo, out)
        print(f"wrote {out}")
        return 0
    if args.action == "draw":
        from gradsync.topology.draw import draw

        out = Path(args.output or f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', topo.name)}.png")
        draw(topo, out)
        print(f"wrote {out}")
        return 0
    raise GradsyncError(f"unknown topo action {args.action!r}")  # pragma: no cover - argparse restricts it


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``topo`` to the main CLI's subparsers."""
    t = subparsers.add_parser("topo", help="list, show, export or draw a topology")
    t.add_argument("action", choices=["list", "show", "export", "draw"])
    t.add_argument("spec", nargs="?", help="registry name (" + ", ".join(BUILDERS.names()) + ") or a .json/.yaml file")
    t.add_argument("-o", "--output", help="file to write (export: .json/.yaml; draw: .png/.svg)")
    t.add_argument("--json", action="store_true", help="show as JSON")
    t.set_defaults(func=cmd_topo)
    return t
