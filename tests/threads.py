"""The threads tests look for in this process."""

from __future__ import annotations

import threading

from gradsync.comm.runtime import COMM_THREAD


def comm_threads() -> list[threading.Thread]:
    """The communication threads of the runtimes alive in this process (one each)."""
    return [t for t in threading.enumerate() if t.name == COMM_THREAD and t.is_alive()]
