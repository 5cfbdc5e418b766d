"""The one reader of numeric environment variables (limits, timeouts, counts), below every package that has some.

The parameter server and its workers, ``gradsync plan``'s limits and the input-file bounds of :mod:`gradsync.paths`
all read numbers from the environment; one reader means they accept the same values (blank is unset, ``VAR= cmd``)
and refuse a bad one alike, naming the variable and the fix rather than ``int()``'s bare ``ValueError``.
"""

from __future__ import annotations

import os
from typing import TypeVar

from gradsync.errors import GradsyncError

__all__ = ["env_number"]

N = TypeVar("N", int, float)


def env_number(name: str, default: N, kind: type[N], error: type[GradsyncError] = GradsyncError) -> N:
    """``name`` read as ``kind`` (int or float); unset, empty or blank means ``default``.

    A value that is not a ``kind`` raises ``error`` (the caller's own :class:`GradsyncError` subclass, so a loader
    keeps its error type) naming the variable and an example; ranges are the caller's to check.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        # an int example in full: 2e+06 is what ``:g`` writes for 2000000, and int() refuses it
        example = f"{default}" if kind is int else f"{default:g}"
        raise error(f"{name}={text!r} is not {what}; unset it or set e.g. {name}={example}") from None
