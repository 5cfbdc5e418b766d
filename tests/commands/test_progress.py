"""The heartbeat stops with its block (issue 42)."""

from __future__ import annotations

import io
import threading
import time

from gradsync.commands._progress import heartbeat


def test_heartbeat_beats_then_stops_with_the_block():
    out = io.StringIO()
    with heartbeat("planning lp on 9 ranks", after_s=0.0, every_s=0.01, stream=out):
        deadline = time.monotonic() + 10
        while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2
    assert lines[0].startswith("... still planning lp on 9 ranks: ") and lines[0].endswith(" s elapsed")
    assert not any(t.name == "gradsync-heartbeat" for t in threading.enumerate())
    after = out.getvalue()
    time.sleep(0.05)
    assert out.getvalue() == after


def test_no_beat_before_after_s():
    out = io.StringIO()
    with heartbeat("x", after_s=60.0, stream=out):
        pass
    assert out.getvalue() == ""
