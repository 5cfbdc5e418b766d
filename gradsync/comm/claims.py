"""Which runtime serves each transport, and how many have.

A runtime's job-wide decisions (:meth:`PlanCache.decide <gradsync.comm.plans.PlanCache.decide>`) are stored under
keys of the transport's group (rank 0 publishes, the others read), and its executors tag their messages per
schedule on that group. Two runtimes serving one transport at once would read each other's decisions and receive
each other's messages: a rank takes another runtime's answer to the same key and plans a different exchange than
its peers, which surfaces later as a size mismatch or a hang, far from its cause. So a transport serves one live
runtime at a time (:func:`claim` refuses a second with the fix), and each runtime a transport serves after the first
decides under keys of its own (:func:`claim` returns its serial), as every rank builds its runtimes in the same
order. A runtime gives its transport back at :meth:`Runtime.shutdown <gradsync.comm.runtime.Runtime.shutdown>`, once its
communication thread has ended (one still inside a collective keeps it).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradsync.comm.transport import Transport
from gradsync.errors import GradsyncError

__all__ = ["claim", "release"]


@dataclass
class _Claim:
    transport: Callable[[], Any] | None  # a weak reference where the transport takes one: its id may be reused later
    served: int = 0
    runtime: Callable[[], Any] | None = None  # a weak reference to the runtime serving it now


_lock = threading.Lock()
_claims: dict[int, _Claim] = {}


def _ref(obj: Any) -> Callable[[], Any] | None:
    try:
        return weakref.ref(obj)
    except TypeError:  # a transport without weak references: its entry stays for the process
        return None


def _entry(transport: Any) -> _Claim:
    """The transport's entry (a new one where a collected transport left its id behind); dead entries go."""
    for key in [k for k, c in _claims.items() if c.transport is not None and c.transport() is None]:
        del _claims[key]
    got = _claims.get(id(transport))
    if got is None or (got.transport is not None and got.transport() is not transport):
        got = _claims[id(transport)] = _Claim(_ref(transport))
    return got


def claim(transport: Transport, runtime: Any) -> int:
    """Let ``runtime`` serve ``transport``; how many runtimes served it before (the runtime's decisions are keyed by
    it). :class:`~gradsync.errors.GradsyncError` where a runtime not shut down serves it already."""
    with _lock:
        entry = _entry(transport)
        live = entry.runtime() if entry.runtime is not None else None
        if live is not None:
            raise GradsyncError(
                f"transport {transport.name!r} (rank {transport.rank}) already serves a runtime that was "
                f"not shut down; two runtimes on one transport would read each other's job-wide decisions and "
                f"messages. Call shutdown() on the first, or give the second a transport of its own "
                f"(gradsync.comm.create_transport('torch') makes a new process group)")
        entry.runtime = weakref.ref(runtime)
        entry.served += 1
        return entry.served - 1


def release(transport: Transport, runtime: Any) -> None:
    """``runtime`` no longer serves ``transport`` (shut down); another may."""
    with _lock:
        entry = _claims.get(id(transport))
        if entry is not None and entry.runtime is not None and entry.runtime() is runtime:
            entry.runtime = None
