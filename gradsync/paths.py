"""Checks on the files a command will write, made before any work so a typo costs no planning time."""

from __future__ import annotations

import os
from pathlib import Path

from gradsync.errors import GradsyncError

__all__ = ["check_output", "write_text"]


def check_output(path: str | os.PathLike[str] | None, option: str) -> None:
    """Refuse ``path`` (given as ``option``) if it is a directory or its directory is missing or read-only."""
    if path is None or str(path) == "":
        return
    p = Path(path)
    if p.is_dir():
        raise GradsyncError(f"{option} {str(p)!r} is a directory; give a file name inside it, e.g. {p / 'out.json'}")
    parent = p.parent
    if not parent.is_dir():
        raise GradsyncError(f"{option} {str(p)!r}: directory {str(parent)!r} does not exist; create it first "
                            f"(mkdir -p {parent}) or write somewhere else")
    if not os.access(parent, os.W_OK):
        raise GradsyncError(f"{option} {str(p)!r}: directory {str(parent)!r} is not writable; write somewhere else")


def write_text(path: str | os.PathLike[str], text: str, what: str, error: type[GradsyncError] = GradsyncError) -> Path:
    """Write ``text`` to ``path``; an OS failure becomes ``error`` naming ``what`` the file is and the fix."""
    p = Path(path)
    try:
        p.write_text(text)
    except OSError as exc:
        raise error(f"cannot write {what} {str(p)!r}: {exc.strerror}; check that its directory exists and is "
                    f"writable") from None
    return p
