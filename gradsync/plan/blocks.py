"""Compact schedule blocks: a tree or ring allreduce kept as structure instead of O(N²) transfers.

:class:`TreeBlock` (reduce up a spanning tree, broadcast down it) and :class:`RingBlock` (ring reduce-scatter
then allgather) each carry some chunks of a :class:`gradsync.plan.schedule.Schedule`; they expand into the
transfers the planners always produced (:func:`tree_transfers`, :func:`ring_transfers`), and answer the
questions that only need sums (counts, route weights, step latencies, their own check) in O(edges). See the
schedule module's docstring, "Compact form".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradsync.errors import ScheduleError
from gradsync.plan.transfers import Transfer, Tree, read_int64, route_error
from gradsync.topology.model import Topology

if TYPE_CHECKING:
    from gradsync.plan.schedule import Schedule

__all__ = ["BLOCKS", "Block", "RingBlock", "TreeBlock", "TreeShape", "ring_transfers", "tree_shape", "tree_transfers"]


@dataclass(frozen=True)
class TreeShape:
    """A rooted spanning tree's depth and height per rank (see :func:`tree_shape`), as int64 arrays."""

    depth: np.ndarray
    height: np.ndarray

    @property
    def top(self) -> int:
        """Height of the root: the step at which the broadcast starts (the tree's depth)."""
        return self.max_depth

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())


def tree_shape(tree: Tree, world_size: int) -> TreeShape:
    """Check that ``tree.edges`` is a spanning tree of ranks ``0..world_size-1`` rooted at ``tree.root`` and
    return its shape; raise :class:`ScheduleError` naming the first rank that breaks it.

    A spanning tree here: ``world_size - 1`` edges, every rank but the root the child of exactly one edge,
    the root the child of none, and every rank reached from the root (so no cycle). Depths by pointer
    doubling (after ``2^k >= N`` parent jumps every rank must sit on the root), heights in one pass in
    decreasing depth; O(N log N) array work, no per-rank dictionaries (packings hold a million tree edges).
    """
    n = world_size
    root = tree.root
    if not 0 <= root < n:
        raise ScheduleError(f"tree root {root} is outside ranks 0..{n - 1}")
    if len(tree.routes) != len(tree.edges):
        raise ScheduleError(f"tree rooted at rank {root} has {len(tree.edges)} edges but {len(tree.routes)} routes")
    e = np.array(tree.edges, dtype=np.int64).reshape(-1, 2)
    child, par = e[:, 0], e[:, 1]
    bad = (child < 0) | (child >= n) | (par < 0) | (par >= n) | (child == par)
    if bad.any():
        c, p = (int(x) for x in e[int(np.argmax(bad))])
        raise ScheduleError(f"tree rooted at rank {root} has edge ({c}, {p}); need two distinct ranks in 0..{n - 1}")
    count = np.bincount(child, minlength=n)
    count[root] += 1  # the root may not be anyone's child
    if (count > 1).any():
        c = int(np.argmax(count > 1))
        raise ScheduleError(f"rank {c} has two parents (or is the root and has one) in the tree rooted at rank {root}")
    parent = np.arange(n)
    parent[child] = par
    depth = (parent != np.arange(n)).astype(np.int64)  # one hop for every rank that has a parent
    up = parent.copy()
    for _ in range(max(1, int(np.ceil(np.log2(max(n, 2)))) + 1)):
        depth = depth + depth[up] * (up != np.arange(n))
        up = up[up]
    lost = up != root
    if lost.any():
        missing = int(np.argmax(lost))
        raise ScheduleError(f"tree rooted at rank {root} reaches {int((~lost).sum())} of {n} ranks (not rank {missing})")
    height = np.zeros(n, dtype=np.int64)
    hl = height.tolist()
    pl = parent.tolist()
    for v in np.argsort(-depth, kind="stable").tolist():  # children before parents
        p = pl[v]
        if p != v and hl[v] + 1 > hl[p]:
            hl[p] = hl[v] + 1
    return TreeShape(depth, np.array(hl, dtype=np.int64))


@dataclass(frozen=True)
class TreeBlock:
    """``tree_transfers(schedule.trees[tree], chunks)`` kept as structure: reduce up the tree, broadcast down.

    Correct by construction whenever the tree spans the ranks (:func:`tree_shape`), which is all
    :meth:`verify` has to check besides the routes. Proof: a rank sends up at step ``height``, after its
    children sent at steps ``<= height - 1``, so its message holds its whole subtree exactly once (induction
    on height) and the root ends with everything; the broadcast reaches a rank at ``top + depth(parent)`` and
    leaves it one step later. No (rank, chunk) is read and written in one step: a rank receives reduces at
    steps below its height and sends at its height; it receives the broadcast one step before it forwards it.
    """

    tree: int
    chunks: tuple[int, ...]

    kind = "tree"

    def expand(self, schedule: Schedule) -> list[Transfer]:
        return tree_transfers(schedule.trees[self.tree], self.chunks, schedule.ranks, schedule.tree_shape(self.tree))

    def count(self, schedule: Schedule) -> int:
        return 2 * len(schedule.trees[self.tree].edges) * len(self.chunks)

    def roots(self, schedule: Schedule) -> dict[int, int]:
        root = schedule.trees[self.tree].root
        return dict.fromkeys(self.chunks, root)

    def verify(self, schedule: Schedule, topology: Topology | None) -> None:
        if not 0 <= self.tree < len(schedule.trees):
            raise ScheduleError(f"tree block names tree {self.tree}; the schedule has trees 0..{len(schedule.trees) - 1}")
        tree = schedule.trees[self.tree]
        schedule.tree_shape(self.tree)
        ranks = schedule.ranks
        # Fast path in C-level loops (a packing holds ~1e6 edges); the per-edge loop below names the culprit.
        ends_ok = all(len(r) >= 2 and r[0] == ranks[c] and r[-1] == ranks[p] for (c, p), r in zip(tree.edges, tree.routes))
        hops_ok = topology is None or not {h for r in tree.routes for h in zip(r, r[1:])}.difference(topology.link_pairs)
        if ends_ok and hops_ok:
            return
        for (c, p), route in zip(tree.edges, tree.routes):
            why = route_error(route, c, p, ranks, topology, f"tree {self.tree} edge rank {c} -> rank {p}")
            if why:
                raise ScheduleError(why)

    def route_weights(self, schedule: Schedule, sizes: np.ndarray) -> Iterable[tuple[tuple[str, ...], float, bool]]:
        """(route, fraction of the buffer, reduces) for every route the block uses, summed over its chunks."""
        w = float(sizes[list(self.chunks)].sum())
        for route in schedule.trees[self.tree].routes:
            yield route, w, True
            yield tuple(reversed(route)), w, False

    def step_latency(self, schedule: Schedule, latency: Callable[[tuple[str, ...]], float]) -> dict[int, float]:
        """Per step, the largest ``latency(route)`` of the routes used in it (the same for every chunk)."""
        tree = schedule.trees[self.tree]
        if not tree.edges:
            return {}
        shape = schedule.tree_shape(self.tree)
        e = np.array(tree.edges, dtype=np.int64).reshape(-1, 2)
        lat = np.fromiter(map(latency, tree.routes), float, len(tree.routes))
        steps = np.concatenate([shape.height[e[:, 0]], shape.top + shape.depth[e[:, 1]]])
        worst = np.zeros(int(steps.max()) + 1)
        np.maximum.at(worst, steps, np.concatenate([lat, lat]))
        used = np.zeros(len(worst), dtype=bool)
        used[steps] = True
        return {int(k): float(worst[k]) for k in np.flatnonzero(used)}

    def num_steps(self, schedule: Schedule) -> int:
        shape = schedule.tree_shape(self.tree)
        return shape.top + shape.max_depth if len(shape.depth) > 1 else 0

    def to_dict(self, ranks: Sequence[str]) -> dict[str, Any]:
        return {"kind": self.kind, "tree": self.tree, "chunks": list(self.chunks)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], idx: Mapping[str, int]) -> TreeBlock:
        return cls(read_int64(data["tree"]), tuple(read_int64(c) for c in data["chunks"]))


@dataclass(frozen=True)
class RingBlock:
    """``ring_transfers(order, chunks, routes)`` kept as structure: reduce-scatter then allgather on a ring.

    Correct by construction whenever ``order`` is a permutation of the ranks, ``chunks`` has one chunk per
    position and ``routes[i]`` leads from ``order[i]`` to ``order[i + 1]`` (:func:`ring_transfers`: chunk j
    collects positions j, j+1, … in N - 1 steps and completes at position j - 1, then travels N - 1 more).
    """

    order: tuple[int, ...]
    routes: tuple[tuple[str, ...], ...]
    chunks: tuple[int, ...]

    kind = "ring"

    def expand(self, schedule: Schedule) -> list[Transfer]:
        return ring_transfers(self.order, self.chunks, self.routes)[0]

    def count(self, schedule: Schedule) -> int:
        n = len(self.order)
        return 2 * (n - 1) * n

    def roots(self, schedule: Schedule) -> dict[int, int]:
        n = len(self.order)
        return {self.chunks[p]: self.order[(p - 1) % n] for p in range(n)}

    def verify(self, schedule: Schedule, topology: Topology | None) -> None:
        n = schedule.world_size
        if sorted(self.order) != list(range(n)):
            raise ScheduleError(f"ring order {list(self.order)[:8]}... is not a permutation of ranks 0..{n - 1}")
        if n < 2 or len(self.chunks) != n or len(self.routes) != n:
            raise ScheduleError(f"a ring over {n} ranks needs {n} chunks and {n} routes (and n >= 2); this one has "
                                f"{len(self.chunks)} chunks and {len(self.routes)} routes")
        for i, route in enumerate(self.routes):
            a, b = self.order[i], self.order[(i + 1) % n]
            why = route_error(route, a, b, schedule.ranks, topology, f"ring position {i} (rank {a} -> rank {b})")
            if why:
                raise ScheduleError(why)

    def route_weights(self, schedule: Schedule, sizes: np.ndarray) -> Iterable[tuple[tuple[str, ...], float, bool]]:
        # Position i sends every chunk but chunks[i+1] while reducing and every chunk but chunks[i+2]
        # while gathering (ring_transfers: chunk (i - s) mod n, resp. (i - s + 1) mod n, for s < n - 1).
        n = len(self.order)
        mine = sizes[list(self.chunks)]
        total = float(mine.sum())
        for i, route in enumerate(self.routes):
            yield route, total - float(mine[(i + 1) % n]), True
            yield route, total - float(mine[(i + 2) % n]), False

    def step_latency(self, schedule: Schedule, latency: Callable[[tuple[str, ...]], float]) -> dict[int, float]:
        """Every step uses every position's route once."""
        worst = max(latency(r) for r in self.routes)
        return dict.fromkeys(range(2 * (len(self.order) - 1)), worst)

    def num_steps(self, schedule: Schedule) -> int:
        return 2 * (len(self.order) - 1)

    def to_dict(self, ranks: Sequence[str]) -> dict[str, Any]:
        return {"kind": self.kind, "order": [ranks[v] for v in self.order], "routes": [list(r) for r in self.routes],
                "chunks": list(self.chunks)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], idx: Mapping[str, int]) -> RingBlock:
        return cls(tuple(idx[v] for v in data["order"]), tuple(tuple(str(x) for x in r) for r in data["routes"]),
                   tuple(read_int64(c) for c in data["chunks"]))


Block = TreeBlock | RingBlock
#: Block kinds by their JSON tag.
BLOCKS: dict[str, type[TreeBlock] | type[RingBlock]] = {"tree": TreeBlock, "ring": RingBlock}


def tree_transfers(
    tree: Tree, chunk_ids: Iterable[int], ranks: Sequence[str], shape: TreeShape | None = None
) -> list[Transfer]:
    """Reduce up ``tree`` then broadcast down it, for each chunk in ``chunk_ids``.

    A rank sends up at step = its height (leaves 0), so it has every child's partial sum; the root's
    value goes down at step = height(root) + depth(parent). Every tree edge carries each chunk once in
    each direction, which is OMS's duplex model of reduce and broadcast at once. ``shape``: the tree's
    :func:`tree_shape` when the caller already has it (a schedule caches one per tree).
    """
    shape = shape if shape is not None else tree_shape(tree, len(ranks))
    top = shape.top
    height, depth = shape.height.tolist(), shape.depth.tolist()
    out: list[Transfer] = []
    for chunk in chunk_ids:
        for (c, p), route in zip(tree.edges, tree.routes):
            out.append(Transfer(chunk, c, p, route, True, height[c]))
            out.append(Transfer(chunk, p, c, tuple(reversed(route)), False, top + depth[p]))
    return out


def ring_transfers(order: Sequence[int], chunk_ids: Sequence[int], routes: Sequence[tuple[str, ...]]) -> tuple[list[Transfer], dict[int, int]]:
    """Reduce-scatter then allgather around a directed ring (Baidu/Horovod ring allreduce).

    ``chunk_ids`` has one chunk per ring position; ``routes[i]`` is the path from ``order[i]`` to
    ``order[i + 1]``. At reduce-scatter step s position i sends chunk (i - s) to position i + 1, so chunk j
    completes at position j - 1 after N - 1 steps; allgather then forwards it N - 1 more hops. Returns the
    transfers and the root rank of each chunk.
    """
    n = len(order)
    out: list[Transfer] = []
    roots: dict[int, int] = {}
    for s in range(n - 1):
        for i in range(n):
            j = chunk_ids[(i - s) % n]
            out.append(Transfer(j, order[i], order[(i + 1) % n], routes[i], True, s))
    for s in range(n - 1):
        for i in range(n):
            j = chunk_ids[(i - s + 1) % n]
            out.append(Transfer(j, order[i], order[(i + 1) % n], routes[i], False, n - 1 + s))
    for p in range(n):
        roots[chunk_ids[p]] = order[(p - 1) % n]
    return out, roots
