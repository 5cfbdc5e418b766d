"""Byte sizes as the subcommands read them: ``548MB``, ``1GiB``, ``4096``, or a comma-separated tensor list."""

from __future__ import annotations

import re

from gradsync.errors import GradsyncError

__all__ = ["parse_size", "parse_sizes"]

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> float:
    """``548MB``, ``1GiB``, ``4096``, ``1e9`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m[2].upper() not in _UNITS:
        raise GradsyncError(f"cannot read size {text!r}; write bytes like 4096, 548MB or 1GiB")
    value = float(m[1]) * _UNITS[m[2].upper()]
    if value <= 0:
        raise GradsyncError(f"size {text!r} must be positive")
    return value


def parse_sizes(text: str) -> list[float]:
    """``548MB`` -> one buffer; ``4MB,16MB,1MB`` -> a tensor list (per-layer pieces)."""
    parts = [p for p in str(text).split(",")]
    if any(not p.strip() for p in parts):
        raise GradsyncError(f"cannot read sizes {text!r}; write one size (548MB) or a comma-separated list (4MB,16MB)")
    return [parse_size(p) for p in parts]
