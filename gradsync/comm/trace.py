"""The runtime's collectives as a Chrome trace-event JSON (``GRADSYNC_TRACE=path`` or ``gradsync.init(trace=path)``).

One complete event per collective: its profiler name (``gradsync::allreduce::<algorithm>``, ``gradsync::<job>``),
``args`` with the collective, the algorithm, the bytes and the group size, on the thread that ran it (the
communication thread, or the caller's for an inline or native collective). Times are microseconds since the epoch,
so the ranks' files line up when merged, and the file opens beside ``gradsync simulate --trace``'s (same writer,
:mod:`gradsync.sim.trace`). Each rank writes its own file when the runtime shuts down (at exit too).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.autograd.profiler as _torch_profiler

from gradsync.sim.trace import complete_event, name_event, write_trace

__all__ = ["TraceRecorder", "profiled", "rank_trace_path"]

_NO_RANGE = contextlib.nullcontext()


def profiled(label: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.profiler.record_function(label)`` while a profiler runs, else nothing: the range is
    a dispatcher call on entry and on exit even with no profiler, host time a DDP hook pays per bucket on the
    critical path of backward (measured in docs/runtime.md)."""
    # torch's own fast check (set while any profiler runs, for every thread: ``profile_all_threads`` records the
    # communication thread), then the C++ one of this thread (a profiler started outside Python)
    if getattr(_torch_profiler, "_is_profiler_enabled", True) or torch.autograd._profiler_enabled():
        return torch.profiler.record_function(label)
    return _NO_RANGE


def rank_trace_path(path: str | Path, rank: int, world_size: int) -> Path:
    """Where ``rank`` writes: ``path`` with ``{rank}`` filled in, else ``name.rank<r>.json`` when several ranks
    share the path, else ``path`` itself."""
    text = str(path)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank)))
    p = Path(text)
    if p.suffix.lower() != ".json":
        raise ValueError(f"GRADSYNC_TRACE / trace={text!r} must end in .json (Chrome trace-event JSON)")
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}") if world_size > 1 else p


class TraceRecorder:
    """Collects one event per collective (thread-safe: collectives run on several threads) and writes them."""

    def __init__(self, path: str | Path, rank: int, world_size: int) -> None:
        self.path = rank_trace_path(path, rank, world_size)
        self.rank = rank
        self.world_size = world_size
        self._events: list[dict[str, Any]] = []
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def now_us() -> float:
        return time.time_ns() / 1e3

    def record(self, name: str, collective: str, algorithm: str | None, nbytes: int | None, start_us: float,
               end_us: float, thread: threading.Thread | None = None) -> None:
        """One collective that ran from ``start_us`` to ``end_us`` on ``thread`` (default: the caller's)."""
        thread = thread or threading.current_thread()
        tid = thread.native_id or thread.ident or 0
        args = {"collective": collective, "algorithm": algorithm, "bytes": nbytes, "group_size": self.world_size}
        event = complete_event(name, "gradsync", start_us, end_us - start_us, self.rank, tid, args)
        with self._lock:
            self._events.append(event)
            self._threads.setdefault(tid, thread.name)

    def __len__(self) -> int:
        return len(self._events)

    def write(self) -> Path:
        """Write every event so far (process ``rank <r>``, threads by name) to :attr:`path`."""
        with self._lock:
            meta = [name_event("process_name", f"rank {self.rank}", self.rank)]
            meta += [name_event("thread_name", name, self.rank, tid) for tid, name in self._threads.items()]
            events = meta + list(self._events)
        return write_trace(self.path, events, {"source": "gradsync runtime", "rank": self.rank,
                                               "world_size": self.world_size})
