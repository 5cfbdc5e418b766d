"""An in-process transport: N ranks as threads exchanging tensors through mailboxes.

It follows the same matching rule as the real engines (a message is matched by source, destination and
tag, first in first out) and copies on send the way a network would, so the executor's correctness can
be checked for every synthesizer and many world sizes in one process, in milliseconds. It also lets a
test kill a rank (``fail(rank)``) and watch the survivors' errors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from gradsync.comm.transport import Capabilities, FailureBoard
from gradsync.errors import PeerError

__all__ = ["LocalFabric", "LocalTransport", "run_ranks"]

T = TypeVar("T")


class LocalFabric:
    """Mailboxes shared by the ranks of one in-process group."""

    def __init__(self, world_size: int, *, decide: bool = False) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        #: whether the ranks share job-wide decisions (rank 0 computes, the others wait for its bytes), as
        #: torch.distributed's store does; off: every rank computes its own, the point-to-point default
        self.shares_decisions = decide
        self._decisions: dict[str, bytes] = {}
        # Like the real engines, the n-th receive *posted* for (src, dst, tag) gets the n-th message sent with
        # it, whenever either side gets there: a receive posted twice by mistake steals a later message.
        self._boxes: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
        self._sent: dict[tuple[int, int, int], int] = {}
        self._posted: dict[tuple[int, int, int], int] = {}
        self._cv = threading.Condition()
        self._failed: set[int] = set()
        self.reports: dict[int, tuple[int, str]] = {}

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)

    def fail(self, rank: int) -> None:
        """Mark ``rank`` dead: its peers' pending receives from it raise :class:`PeerError`."""
        with self._cv:
            self._failed.add(rank)
            self._cv.notify_all()

    def _decide(self, rank: int, key: str, compute: Callable[[], bytes], timeout_s: float) -> bytes:
        """:data:`~gradsync.comm.transport.Decide` for ``rank``: rank 0's ``compute()``, the same bytes everywhere."""
        if rank == 0:
            value = compute()
            with self._cv:
                self._decisions[key] = value
                self._cv.notify_all()
            return value
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while key not in self._decisions:
                if 0 in self._failed:
                    raise PeerError(f"rank 0 failed before it published {key!r}", 0)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(f"rank 0 did not publish {key!r} within {timeout_s:g} s", 0)
                self._cv.wait(left)
            return self._decisions[key]

    def _put(self, src: int, dst: int, tag: int, payload: torch.Tensor) -> None:
        key = (src, dst, tag)
        with self._cv:
            seq = self._sent.get(key, 0)
            self._sent[key] = seq + 1
            self._boxes.setdefault(key, {})[seq] = payload
            self._cv.notify_all()

    def _ticket(self, src: int, dst: int, tag: int) -> int:
        key = (src, dst, tag)
        with self._cv:
            n = self._posted.get(key, 0)
            self._posted[key] = n + 1
            return n

    def _take(self, src: int, dst: int, tag: int, ticket: int, timeout_s: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                box = self._boxes.get((src, dst, tag))
                if box and ticket in box:
                    return box.pop(ticket)
                if src in self._failed:
                    raise PeerError(f"rank {src} closed its connection (marked failed)", src)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(f"rank {src} sent nothing for {timeout_s:g} s", src)
                self._cv.wait(left)


class _Done:
    def wait(self, timeout_s: float) -> None:
        return None


class _Recv:
    __slots__ = ("_fabric", "_key", "_out", "_ticket")

    def __init__(self, fabric: LocalFabric, key: tuple[int, int, int], out: torch.Tensor) -> None:
        self._fabric, self._key, self._out = fabric, key, out
        self._ticket = fabric._ticket(*key)

    def wait(self, timeout_s: float) -> None:
        payload = self._fabric._take(*self._key, self._ticket, timeout_s)
        if payload.numel() != self._out.numel():
            raise RuntimeError(f"message {self._key} has {payload.numel()} elements, the receive expects {self._out.numel()}")
        self._out.copy_(payload)


class _LocalBoard(FailureBoard):
    def __init__(self, fabric: LocalFabric) -> None:
        self._fabric = fabric

    def post(self, reporter: int, peer: int, message: str) -> None:
        self._fabric.reports[reporter] = (peer, message)

    def read(self) -> dict[int, tuple[int, str]]:
        return dict(self._fabric.reports)


class LocalTransport:
    """One rank's view of a :class:`LocalFabric`."""

    ordered = False

    def __init__(self, fabric: LocalFabric, rank: int) -> None:
        self.fabric = fabric
        self.rank = rank
        self.world_size = fabric.world_size
        self.name = "local"
        self.failures = _LocalBoard(fabric)
        # point to point only; failures shared in-process, and decisions where the fabric shares them
        decide = (lambda key, compute, timeout_s: fabric._decide(rank, key, compute, timeout_s)) \
            if fabric.shares_decisions else None
        self.capabilities = Capabilities(failures=self.failures, decide=decide)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> _Done:
        self.fabric._put(self.rank, peer, tag, tensor.detach().clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> _Recv:
        return _Recv(self.fabric, (peer, self.rank, tag), tensor)


def run_ranks(world_size: int, fn: Callable[[LocalTransport], T], timeout_s: float = 60.0) -> list[T | BaseException]:
    """Run ``fn(transport)`` for every rank in its own thread; return each rank's result or exception."""
    fabric = LocalFabric(world_size)
    results: list[T | BaseException] = [RuntimeError("rank did not finish")] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(fabric.transport(rank))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            results[rank] = exc
            fabric.fail(rank)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return results

