"""``gradsync models``: the model definitions (LeNet-5, ResNet, VGG, Inception)."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "cmd_models"]


def cmd_models(args: argparse.Namespace) -> int:
    from gradsync.models import describe  # imports torch: only when asked

    rows = describe()
    if args.json:
        print(json.dumps({"type": "gradsync.models", "models": rows}, indent=2))
        return 0
    print(f"{'model':10s} {'params':>12s} {'input':>12s} {'classes':>8s}  summary")
    for r in rows:
        shape = "x".join(str(d) for d in r["input_shape"])
        print(f"{r['name']:10s} {r['params']:12,d} {shape:>12s} {r['num_classes']:8d}  {r['summary']}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``models`` to the main CLI's subparsers."""
    md = subparsers.add_parser("models", help="list the model definitions (LeNet-5, ResNet, VGG, Inception)")
    md.add_argument("--json", action="store_true", help="print one JSON object")
    md.set_defaults(func=cmd_models)
    return md
