"""JSON output shared by the subcommands' ``--json``."""

from __future__ import annotations

import json
import math

__all__ = ["emit_json"]


def _finite(obj: object) -> object:
    """``obj`` with every infinite or NaN float as None: JSON has no Infinity (a one-rank plan's algbw)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def emit_json(obj: object) -> None:
    """Print ``obj`` as indented JSON, infinities and NaNs as null."""
    print(json.dumps(_finite(obj), indent=2, allow_nan=False))
