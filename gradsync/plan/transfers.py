"""The plain data a :class:`gradsync.plan.schedule.Schedule` is made of: what it computes, its chunks, its
transfers and the trees it came from, and the checks of a single route or a number read from a file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradsync.errors import ScheduleError
from gradsync.topology.model import Topology

__all__ = ["COLLECTIVES", "SHARDED", "Chunk", "Transfer", "Tree", "read_int64", "route_error", "shard_bounds"]

#: What a schedule computes. ``reduce``: each chunk's ``root`` ends with the sum; ``broadcast``: the
#: chunk's ``root`` starts with the value and every rank ends with it. ``reduce_scatter`` and ``allgather``
#: are ``reduce`` and ``broadcast`` whose roots are the owners of equal rank-order shards (:mod:`gradsync.plan.schedule`).
COLLECTIVES = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather")
#: The collectives whose chunks belong to equal rank-order shards.
SHARDED = ("reduce_scatter", "allgather")


@dataclass(frozen=True)
class Chunk:
    """A contiguous fraction of the buffer, and the rank where its reduction completes (if one does)."""

    offset: float
    size: float
    root: int | None = None


@dataclass(frozen=True)
class Transfer:
    """Send ``chunk`` from rank ``src`` to rank ``dst`` along ``route`` (device names, endpoints included)."""

    chunk: int
    src: int
    dst: int
    route: tuple[str, ...]
    reduce: bool
    step: int
    #: Lower runs first where transfers compete for a link (TicTac ordering fills this in).
    priority: int = 0


@dataclass(frozen=True)
class Tree:
    """Provenance of a tree-based schedule: a spanning tree over ranks carrying ``weight`` of the buffer.

    ``edges`` are (child, parent) rank pairs toward ``root``; ``routes[i]`` is the device path of edge i
    (child first), which crosses switches or relays on topologies that have them.
    """

    weight: float
    root: int
    edges: tuple[tuple[int, int], ...]
    routes: tuple[tuple[str, ...], ...]

    def to_dict(self, ranks: Sequence[str]) -> dict[str, Any]:
        return {
            "weight": self.weight,
            "root": ranks[self.root],
            "edges": [[ranks[c], ranks[p]] for c, p in self.edges],
            "routes": [list(r) for r in self.routes],
        }


def shard_bounds(rank: int, world_size: int, numel: int) -> tuple[int, int]:
    """Rank ``rank``'s equal shard of ``numel`` elements, rounded like :meth:`gradsync.plan.schedule.Schedule.chunk_bounds`, so the
    chunks of a sharded schedule tile it exactly (``numel`` a multiple of ``world_size``: ``numel / N`` each)."""
    return round(rank / world_size * numel), round((rank + 1) / world_size * numel)


def route_error(route: Sequence[str], src: int, dst: int, ranks: Sequence[str], topology: Topology | None, what: str) -> str | None:
    """Why ``route`` is not a path from rank ``src`` to rank ``dst`` over links of ``topology`` (None if it is)."""
    if len(route) < 2 or route[0] != ranks[src] or route[-1] != ranks[dst]:
        return f"{what} has route {list(route)}; it must start at {ranks[src]!r} and end at {ranks[dst]!r}"
    if topology is not None:
        for u, v in zip(route[:-1], route[1:]):
            if not topology.has_link(u, v):
                return f"{what} hops {u} -> {v}, but {topology.name!r} has no such link"
    return None


def read_int64(x: Any) -> int:
    """An index, step or priority read from a file: an integer that the int64 arrays of a schedule hold."""
    v = int(x)
    if not -(1 << 63) <= v < (1 << 63):
        raise ScheduleError(f"malformed schedule data: {x!r} does not fit a 64-bit integer")
    return v
