"""A fake clock for ``AutoCompression(clock=...)``: what auto measures, independent of the machine's load."""

from __future__ import annotations

import sys
import threading
from typing import Any


class FakeClock:
    """Advances on the training thread only, by ``cost[codec]`` per call, ``codec`` being the launch's (``auto``'s
    ``current``; set ``auto`` after making it).

    A launch's timing callback (``record``) that runs at once on the training thread, because its exchange finished
    before the callback was attached (a busy machine), reads the clock without advancing it, as it would on the
    communication thread: else whether a launch cost one call more would depend on the machine's load."""

    def __init__(self, cost: dict[str, float]) -> None:
        self.cost, self.now = cost, 0.0
        self.auto: Any = None

    def __call__(self) -> float:
        if (threading.current_thread() is threading.main_thread() and self.auto is not None
                and sys._getframe(1).f_code.co_name != "record"):
            self.now += self.cost.get(self.auto.current, self.cost["other"])
        return self.now
