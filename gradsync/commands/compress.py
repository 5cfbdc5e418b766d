"""``gradsync compress list``: the gradient compressors, with the payload each sends for a 4 MiB tensor."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "cmd_compress"]


def cmd_compress(args: argparse.Namespace) -> int:
    import torch

    from gradsync.compress import COMPRESSORS, create

    shape = (1024, 1024)  # a 4 MiB float32 matrix: the size the ratios are quoted for
    rows = []
    for name, cls in COMPRESSORS.items():
        comp = create(name)
        nbytes = comp.payload_bytes(shape, torch.float32)
        rows.append({"name": name, "aliases": COMPRESSORS.aliases_of(name), "communicator": comp.communicator,
                     "payload_bytes_1Mi_fp32": nbytes, "ratio": 4 * 1024 * 1024 / nbytes,
                     "summary": (cls.__doc__ or "").strip().splitlines()[0]})
    if args.json:
        print(json.dumps({"type": "gradsync.compressors", "rows": rows}, indent=2))
        return 0
    print(f"{'compressor':11s} {'communicator':12s} {'payload':>10s} {'ratio':>7s}  summary (payload for a 1024x1024 fp32 tensor)")
    for r in rows:
        print(f"{r['name']:11s} {r['communicator']:12s} {r['payload_bytes_1Mi_fp32']:10,d} {r['ratio']:7.1f}  {r['summary'][:70]}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``compress`` to the main CLI's subparsers."""
    cp = subparsers.add_parser("compress", help="list the gradient compressors (MergeComp)")
    cp.add_argument("action", choices=["list"])
    cp.add_argument("--json", action="store_true", help="print one JSON object")
    cp.set_defaults(func=cmd_compress)
    return cp
