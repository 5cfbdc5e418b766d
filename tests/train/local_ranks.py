"""Run a function once per rank, each rank a thread with its own runtime on one in-process fabric (no processes,
no sockets): enough to test what the training layer does with every rank's payloads, bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from gradsync.comm.local import LocalFabric
from gradsync.comm.runtime import Runtime

T = TypeVar("T")


def on_ranks(world: int, fn: Callable[[int, Runtime], T], timeout_s: float = 120.0, *, decide: bool = False) -> list[T]:
    """``fn(rank, runtime)`` on ``world`` threads; their results by rank. A rank that raises marks itself dead on the
    fabric (its peers' receives fail at once instead of at their timeout) and its error is raised here. ``decide``:
    the ranks share job-wide decisions (rank 0's), as ``compression="auto"`` needs."""
    fabric = LocalFabric(world, decide=decide)
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            rt = Runtime(fabric.transport(r), f"switch:{world}", "ring", timeout_s=30)
            try:
                results[r] = fn(r, rt)
            finally:
                rt.shutdown()
        except BaseException as exc:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(exc)
            fabric.fail(r)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        for r in range(world):  # their waits end with a PeerError: the threads finish instead of hanging on
            fabric.fail(r)
        raise AssertionError(f"{stuck} still running after {timeout_s} s")
    return [results[r] for r in range(world)]


