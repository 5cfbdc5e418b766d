"""A heartbeat on stderr while a long step runs, so a big ``gradsync plan`` does not look hung (issue 42)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["heartbeat"]


@contextmanager
def heartbeat(what: str, *, after_s: float = 3.0, every_s: float = 5.0, stream: TextIO | None = None) -> Iterator[None]:
    """Print ``"... still {what}: N s elapsed"`` every ``every_s`` seconds once ``after_s`` have passed.

    A daemon thread waits on an event, so it stops as soon as the block ends (joined with a bound)."""
    out = stream if stream is not None else sys.stderr
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        wait = after_s
        while not done.wait(wait):
            print(f"... still {what}: {time.monotonic() - start:.0f} s elapsed", file=out, flush=True)
            wait = every_s

    thread = threading.Thread(target=beat, name="gradsync-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)
