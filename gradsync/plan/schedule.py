"""The one schedule representation that the planner writes and the simulator and runtime execute.

A :class:`Schedule` is plain data:

* ``chunks`` split the buffer into contiguous fractions ``[offset, offset + size)``; the same fractions
  apply to every tensor of a tensor list (seed 001 §4.1 per-layer pieces), so a schedule is size-agnostic.
* ``transfers`` move one chunk from a source rank to a destination rank along a ``route`` of devices
  (through switches and relays, seed 000 §3). ``reduce=True`` means the receiver adds what arrives into its
  own copy of the chunk; ``reduce=False`` means it overwrites it (broadcast / allgather).
* ``step`` orders transfers *per chunk*: a transfer at step ``s`` sends the sender's chunk as it is after
  every transfer of an earlier step into that (rank, chunk) has arrived. Different chunks never wait for
  each other, which is what lets chunks stream through a tree (seed 000 §2) and lets the simulator and
  the executor pipeline them. The dependency of a transfer is therefore derived, not listed:
  ``deps(t) = {u : u.chunk == t.chunk, u.dst == t.src, u.step < t.step}``.

:meth:`Schedule.check` replays the chunk movement (msccl-style) and fails naming the rank and chunk when a
rank does not end with the full reduction, counts a contribution twice, reads and writes one buffer in the
same step, or when a route leaves the topology.

Sharded collectives (``reduce_scatter``, ``allgather``) follow ``torch.distributed.reduce_scatter_tensor`` and
``all_gather_into_tensor``: the buffer is the *full* tensor (the reduce-scatter's input, the allgather's output)
and rank ``r`` owns the equal shard ``[r/N, (r+1)/N)`` in rank order. Every chunk lies inside one shard and
its ``root`` is that shard's owner. ``reduce_scatter``: rank ``r`` ends with every rank's contribution to each
chunk of its shard, each counted once (other ranks' copies of that shard end with partial sums).
``allgather``: rank ``r`` starts with the value of its shard only, and every rank ends with every shard;
transfers only copy. Costs stay in units of the full buffer, so an allgather of ``S`` output bytes takes
``cost * S / unit_bw``, the convention of nccl-tests' algorithm bandwidth.

Compact form. A ring or tree allreduce moves every chunk over every edge, so spelled out it holds O(N²)
transfers (2 M on a 1024-host fat tree). Such schedules keep their structure instead: ``blocks`` holds
:class:`TreeBlock` (reduce up a spanning tree of ``trees``, broadcast down it) and :class:`RingBlock` (ring
reduce-scatter then allgather), each with the chunks it carries, and ``explicit`` the transfers of any other
chunks. :attr:`Schedule.transfers` expands the blocks on first use, in the order the planners always
produced, so every consumer that needs single transfers (the executor, the event simulator, MSCCL export)
sees the same schedule. Consumers that only need sums — link loads, step latencies, counts, the self-check —
work per block in O(edges) (:meth:`Schedule.link_loads`, :meth:`Schedule.check`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from gradsync.errors import ScheduleError
from gradsync.paths import write_text
from gradsync.topology.model import Topology

__all__ = ["COLLECTIVES", "SHARDED", "Block", "Chunk", "shard_bounds", "Transfer", "Tree", "TreeBlock", "RingBlock", "Schedule",
           "LinkLoads", "ring_transfers", "tree_transfers"]

#: What a schedule computes. ``reduce``: each chunk's ``root`` ends with the sum; ``broadcast``: the
#: chunk's ``root`` starts with the value and every rank ends with it. ``reduce_scatter`` and ``allgather``
#: are ``reduce`` and ``broadcast`` whose roots are the owners of equal rank-order shards (module docstring).
COLLECTIVES = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather")
#: The collectives whose chunks belong to equal rank-order shards.
SHARDED = ("reduce_scatter", "allgather")
_TOL = 1e-9


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


@dataclass(frozen=True)
class _Shape:
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


def tree_shape(tree: Tree, world_size: int) -> _Shape:
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
    return _Shape(depth, np.array(hl, dtype=np.int64))


def _route_error(route: Sequence[str], src: int, dst: int, ranks: Sequence[str], topology: Topology | None, what: str) -> str | None:
    """Why ``route`` is not a path from rank ``src`` to rank ``dst`` over links of ``topology`` (None if it is)."""
    if len(route) < 2 or route[0] != ranks[src] or route[-1] != ranks[dst]:
        return f"{what} has route {list(route)}; it must start at {ranks[src]!r} and end at {ranks[dst]!r}"
    if topology is not None:
        for u, v in zip(route[:-1], route[1:]):
            if not topology.has_link(u, v):
                return f"{what} hops {u} -> {v}, but {topology.name!r} has no such link"
    return None


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
            why = _route_error(route, c, p, ranks, topology, f"tree {self.tree} edge rank {c} -> rank {p}")
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
        return cls(_int64(data["tree"]), tuple(_int64(c) for c in data["chunks"]))


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
            why = _route_error(route, a, b, schedule.ranks, topology, f"ring position {i} (rank {a} -> rank {b})")
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
                   tuple(_int64(c) for c in data["chunks"]))


Block = TreeBlock | RingBlock
#: Block kinds by their JSON tag.
BLOCKS: dict[str, type[TreeBlock] | type[RingBlock]] = {"tree": TreeBlock, "ring": RingBlock}


@dataclass(frozen=True)
class LinkLoads:
    """Fractions of the buffer crossing each link: ``directed[e, d]`` (d=0 is a->b) and reduce-phase only."""

    directed: np.ndarray
    reduce_directed: np.ndarray

    def cost(self, costs: np.ndarray) -> float:
        """Seed 000's C generalised to duplex links: max over link directions of load * c_e.

        ``costs`` is per link or per direction (``Topology.directed_costs``, for asymmetric links).
        """
        if self.directed.size == 0:
            return 0.0
        return float((self.directed * (costs if costs.ndim == 2 else costs[:, None])).max())

    def aggregation_cost(self, costs: np.ndarray) -> float:
        """The seed's own single-direction C (eq. 2): reduce phase only, each link one undirected channel.

        For tree schedules this is exactly max_e P_e c_e, and equals :meth:`cost`.
        """
        if self.reduce_directed.size == 0:
            return 0.0
        return float((self.reduce_directed.sum(axis=1) * costs).max())

    def half_duplex_cost(self, costs: np.ndarray) -> float:
        """Cost if a link could carry only one direction at a time (reduce, then broadcast)."""
        if self.directed.size == 0:
            return 0.0
        return float((self.directed.sum(axis=1) * costs).max())


@dataclass(frozen=True)
class Schedule:
    """Chunks and transfers for one collective on the ranks of a topology. See the module docstring."""

    algorithm: str
    topology: str
    ranks: tuple[str, ...]
    chunks: tuple[Chunk, ...]
    #: Transfers spelled out one by one (every chunk that no block carries).
    explicit: tuple[Transfer, ...]
    collective: str = "allreduce"
    trees: tuple[Tree, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: Compact tree and ring structure (module docstring); expanded into :attr:`transfers` on first use.
    blocks: tuple[Block, ...] = ()

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ScheduleError(f"collective {self.collective!r} is not one of {COLLECTIVES}")
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "chunks", tuple(self.chunks))
        object.__setattr__(self, "explicit", tuple(self.explicit))
        object.__setattr__(self, "trees", tuple(self.trees))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if self.blocks and self.collective != "allreduce":
            raise ScheduleError(f"tree and ring blocks compute an allreduce, not a {self.collective}; "
                                f"spell the transfers out (Schedule.expanded())")

    # ---- derived views ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer: the explicit ones, then each block's in the planners' order (module docstring)."""
        if not self.blocks:
            return self.explicit
        out = list(self.explicit)
        for b in self.blocks:
            out += b.expand(self)
        return tuple(out)

    def tree_shape(self, index: int) -> _Shape:
        """:func:`tree_shape` of ``trees[index]``, computed once per schedule (blocks ask for it repeatedly)."""
        cache = self.__dict__.setdefault("_shapes", {})
        shape = cache.get(index)
        if shape is None:
            shape = cache[index] = tree_shape(self.trees[index], self.world_size)
        return shape

    @property
    def num_transfers(self) -> int:
        """``len(self.transfers)`` without expanding the blocks."""
        return len(self.explicit) + sum(b.count(self) for b in self.blocks)

    @property
    def compact(self) -> bool:
        """Whether some transfers are kept as blocks (see the module docstring)."""
        return bool(self.blocks)

    def expanded(self) -> Schedule:
        """The same schedule with every transfer spelled out (no blocks): for tools that edit transfers."""
        if not self.blocks:
            return self
        return dataclasses.replace(self, explicit=self.transfers, blocks=())

    @property
    def num_steps(self) -> int:
        steps = max((t.step for t in self.explicit), default=-1) + 1
        return max([steps, *(b.num_steps(self) for b in self.blocks)])

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """Column view of the transfers (chunk, src, dst, step, reduce) for vectorised consumers."""
        return _columns(self.transfers)

    @cached_property
    def explicit_arrays(self) -> dict[str, np.ndarray]:
        """:attr:`arrays` of the explicit transfers only (the same object when there are no blocks)."""
        return self.arrays if not self.blocks else _columns(self.explicit)

    def chunk_bounds(self, numel: int) -> list[tuple[int, int]]:
        """Element ranges ``[start, end)`` of every chunk for a buffer of ``numel`` elements.

        Boundaries are rounded from the cumulative fractions, so chunks tile the buffer exactly whatever
        ``numel`` is (0, 1, a prime); a chunk may be empty on tiny buffers.
        """
        if numel < 0:
            raise ScheduleError(f"numel={numel} must be >= 0")
        edges = [round(c.offset * numel) for c in self.chunks] + [numel]
        return [(min(edges[i], numel), min(max(edges[i], edges[i + 1]), numel)) for i in range(len(self.chunks))]

    def shard(self, rank: int, numel: int) -> tuple[int, int]:
        """Element range ``[start, end)`` of ``rank``'s shard of a ``numel``-element buffer (module docstring)."""
        if not 0 <= rank < self.world_size:
            raise ScheduleError(f"rank {rank} is outside the schedule's ranks 0..{self.world_size - 1}")
        return shard_bounds(rank, self.world_size, numel)

    def pieces(self, numels: Sequence[int]) -> list[list[tuple[int, int, int]]]:
        """Per-layer splitting (seed 001 §4.1): chunk c of a tensor list is piece c of *every* tensor.

        Returns, for each chunk, the ``(tensor index, start, end)`` element ranges it covers. Splitting
        each layer into the algorithm's pieces (instead of placing whole layers) keeps every rank's share
        equal to the chunk fractions however uneven the layers are; a transfer of chunk c moves all of
        its pieces as one message.
        """
        per_tensor = [self.chunk_bounds(int(n)) for n in numels]
        return [
            [(i, *bounds[c]) for i, bounds in enumerate(per_tensor) if bounds[c][1] > bounds[c][0]]
            for c in range(len(self.chunks))
        ]

    def dependencies(self) -> list[list[int]]:
        """For every transfer, the transfers it waits for (derived from steps; see module docstring)."""
        arr = self.arrays
        into: dict[tuple[int, int], list[int]] = {}
        for i in range(len(self.transfers)):
            into.setdefault((int(arr["dst"][i]), int(arr["chunk"][i])), []).append(i)
        deps: list[list[int]] = []
        for t in self.transfers:
            deps.append([j for j in into.get((t.src, t.chunk), ()) if self.transfers[j].step < t.step])
        return deps

    def link_loads(self, topology: Topology) -> LinkLoads:
        """Fraction of the buffer crossing every link direction, summed over transfers and route hops."""
        m = len(topology.links)
        directed = np.zeros((m, 2))
        reduce_directed = np.zeros((m, 2))
        route_cache: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
        sizes = np.array([c.size for c in self.chunks])
        if self.blocks:  # per route, summed over the blocks' chunks: O(edges), not O(transfers)
            per_route: dict[tuple[tuple[str, ...], bool], float] = {}
            for b in self.blocks:
                for route, w, red in b.route_weights(self, sizes):
                    key = (route, red)
                    per_route[key] = per_route.get(key, 0.0) + w
            links: list[int] = []
            dirs: list[int] = []
            weights: list[float] = []
            reduces: list[bool] = []
            for (route, red), w in per_route.items():
                for e, d in topology.route_links(route):
                    links.append(e)
                    dirs.append(d)
                    weights.append(w)
                    reduces.append(red)
            ix = (np.array(links, int), np.array(dirs, int))
            w_arr = np.array(weights)
            np.add.at(directed, ix, w_arr)
            red_arr = np.array(reduces, bool)
            np.add.at(reduce_directed, (ix[0][red_arr], ix[1][red_arr]), w_arr[red_arr])
        for t in self.explicit:
            hops = route_cache.get(t.route)
            if hops is None:
                pairs = topology.route_links(t.route)
                hops = (np.array([p[0] for p in pairs], int), np.array([p[1] for p in pairs], int))
                route_cache[t.route] = hops
            w = sizes[t.chunk]
            np.add.at(directed, hops, w)
            if t.reduce:
                np.add.at(reduce_directed, hops, w)
        return LinkLoads(directed, reduce_directed)

    def require_topology(self, topology: Topology) -> None:
        """Raise unless ``topology`` has exactly the ranks (in order) this schedule was planned for."""
        if tuple(topology.ranks) != self.ranks:
            raise ScheduleError(
                f"schedule was planned for ranks {list(self.ranks)[:8]}... of {self.topology!r}, "
                f"not for {topology.name!r}; plan it again for this topology"
            )

    # ---- self-check ------------------------------------------------------------------------------
    def check(self, topology: Topology | None = None) -> None:
        """Replay the chunk movement; raise :class:`ScheduleError` naming the rank and chunk on failure.

        Checks, in order: chunks tile [0, 1); transfers name valid ranks, chunks and routes (that follow
        links of ``topology`` when given); no (rank, chunk) is read and written in one step or written by
        two copies in one step; no reduce adds a contribution the receiver already holds; sharded chunks lie
        in their root's shard and an allgather only copies; and at the end every rank (allreduce, broadcast,
        allgather) or every chunk's root (reduce, reduce_scatter) holds every contribution.
        """
        self._check_structure(topology)
        self._check_blocks(topology)
        self._check_hazards()
        self._replay()

    def _check_structure(self, topology: Topology | None) -> None:
        n, c = len(self.ranks), len(self.chunks)
        if n == 0:
            raise ScheduleError("schedule has no ranks")
        if topology is not None:
            self.require_topology(topology)
        pos = 0.0
        for i, ch in enumerate(self.chunks):
            if not (ch.size >= 0 and math.isfinite(ch.size)) or abs(ch.offset - pos) > 1e-6:
                raise ScheduleError(f"chunk {i} spans [{ch.offset}, {ch.offset + ch.size}); chunks must tile [0, 1) in order")
            if ch.root is not None and not 0 <= ch.root < n:
                raise ScheduleError(f"chunk {i} has root rank {ch.root}, outside 0..{n - 1}")
            pos += ch.size
        if abs(pos - 1.0) > 1e-6:
            raise ScheduleError(f"chunks cover {pos:.9f} of the buffer; they must cover exactly 1")
        if self.collective != "allreduce" and any(ch.root is None for ch in self.chunks):
            raise ScheduleError(f"a {self.collective} schedule needs a root for every chunk")
        if self.collective in SHARDED:
            for i, ch in enumerate(self.chunks):
                lo, hi = ch.root / n, (ch.root + 1) / n  # type: ignore[operator]
                if ch.size > 0 and (ch.offset < lo - 1e-9 or ch.offset + ch.size > hi + 1e-9):
                    raise ScheduleError(
                        f"{self.collective} chunk {i} spans [{ch.offset:.6g}, {ch.offset + ch.size:.6g}) but its root, rank "
                        f"{ch.root}, owns the shard [{lo:.6g}, {hi:.6g}); a chunk must lie in its owner's shard "
                        f"(rank r owns the r-th of {n} equal shards, as in torch.distributed.reduce_scatter_tensor)"
                    )
        for i, t in enumerate(self.explicit):
            if self.collective == "allgather" and t.reduce:
                raise ScheduleError(f"transfer {i} (chunk {t.chunk}, rank {t.src} -> rank {t.dst}) reduces, but an "
                                    f"allgather only copies shards; make it a copy (reduce=False)")
            if not 0 <= t.chunk < c:
                raise ScheduleError(f"transfer {i} names chunk {t.chunk}; the schedule has chunks 0..{c - 1}")
            if not (0 <= t.src < n and 0 <= t.dst < n) or t.src == t.dst:
                raise ScheduleError(f"transfer {i} goes from rank {t.src} to rank {t.dst}; need two distinct ranks in 0..{n - 1}")
            if t.step < 0:
                raise ScheduleError(f"transfer {i} has step {t.step}; steps start at 0")
            why = _route_error(t.route, t.src, t.dst, self.ranks, topology,
                               f"transfer {i} (chunk {t.chunk}, rank {t.src} -> rank {t.dst})")
            if why:
                raise ScheduleError(why)

    def _check_blocks(self, topology: Topology | None) -> None:
        """Each block's structure (its docstring proves the rest), chunks carried once, roots as the blocks say."""
        owner: dict[int, int] = {}
        for k, b in enumerate(self.blocks):
            b.verify(self, topology)
            for c, root in b.roots(self).items():
                if not 0 <= c < len(self.chunks):
                    raise ScheduleError(f"block {k} ({b.kind}) names chunk {c}; the schedule has chunks 0..{len(self.chunks) - 1}")
                if c in owner:
                    raise ScheduleError(f"chunk {c} is carried by blocks {owner[c]} and {k}; a chunk belongs to one block")
                owner[c] = k
                if self.chunks[c].root not in (None, root):
                    raise ScheduleError(f"chunk {c} has root rank {self.chunks[c].root}, but block {k} ({b.kind}) "
                                        f"completes its reduction on rank {root}")
        if owner:
            also = sorted({t.chunk for t in self.explicit} & owner.keys())
            if also:
                raise ScheduleError(f"chunk {also[0]} is carried by block {owner[also[0]]} and by explicit transfers; "
                                    f"a chunk belongs to one block or to the explicit transfers")

    def _block_chunks(self) -> set[int]:
        return {c for b in self.blocks for c in b.chunks}

    def _check_hazards(self) -> None:
        if not self.explicit:
            return
        a = self.explicit_arrays
        c = len(self.chunks)
        read_key = (a["step"] * len(self.ranks) + a["src"]) * c + a["chunk"]
        write_key = (a["step"] * len(self.ranks) + a["dst"]) * c + a["chunk"]
        both = np.intersect1d(read_key, write_key)
        if both.size:
            i = int(np.flatnonzero(np.isin(write_key, both[:1]))[0])
            t = self.explicit[i]
            raise ScheduleError(
                f"rank {t.dst} chunk {t.chunk} is both sent and received in step {t.step}; "
                f"move the receive to a later step so the send reads a defined value"
            )
        copies = write_key[~a["reduce"]]
        uniq, counts = np.unique(copies, return_counts=True)
        reduces = write_key[a["reduce"]]
        bad = uniq[(counts > 1) | np.isin(uniq, reduces)]
        if bad.size:
            i = int(np.flatnonzero(write_key == bad[0])[0])
            t = self.explicit[i]
            raise ScheduleError(
                f"rank {t.dst} chunk {t.chunk} is overwritten by a copy and written again in step {t.step}; "
                f"the result would depend on arrival order"
            )

    def _initial(self, chunk: int) -> list[int]:
        """Contribution bitsets (Python ints) per rank for one chunk before any transfer."""
        n = len(self.ranks)
        if self.collective in ("broadcast", "allgather"):
            full = (1 << n) - 1
            root = self.chunks[chunk].root
            return [full if r == root else 0 for r in range(n)]
        return [1 << r for r in range(n)]

    def _replay(self) -> None:
        """Exact replay with one bitset of contributing ranks per (rank, chunk)."""
        n = len(self.ranks)
        full = (1 << n) - 1
        by_chunk: dict[int, list[Transfer]] = {}
        for t in sorted(self.explicit, key=lambda t: (t.chunk, t.step)):
            by_chunk.setdefault(t.chunk, []).append(t)
        in_blocks = self._block_chunks()
        for chunk in range(len(self.chunks)):
            if chunk in in_blocks:
                continue
            state = self._initial(chunk)
            ts = by_chunk.get(chunk, [])
            i = 0
            while i < len(ts):
                step = ts[i].step
                j = i
                while j < len(ts) and ts[j].step == step:
                    j += 1
                payload = [state[t.src] for t in ts[i:j]]  # everyone in a step reads the pre-step state
                for t, p in zip(ts[i:j], payload):
                    if p == 0:
                        raise ScheduleError(
                            f"rank {t.src} sends chunk {chunk} to rank {t.dst} in step {step} before holding any data for it"
                        )
                    if t.reduce:
                        twice = state[t.dst] & p
                        if twice:
                            raise ScheduleError(
                                f"rank {t.dst} would count the contribution of rank(s) {_ranks_of(twice)} to chunk "
                                f"{chunk} twice (reduce from rank {t.src} in step {step})"
                            )
                        state[t.dst] |= p
                    else:
                        state[t.dst] = p
                i = j
            owners = [self.chunks[chunk].root] if self.collective in ("reduce", "reduce_scatter") else range(n)
            for r in owners:
                assert r is not None
                if state[r] != full:
                    missing = _ranks_of(full & ~state[r])
                    what = "full reduction" if self.collective != "allgather" else "owner's shard"
                    raise ScheduleError(
                        f"rank {r} does not end with the {what} of chunk {chunk}: "
                        f"missing the contribution of rank(s) {missing}"
                    )

    # ---- plain-data conversion -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Tagged JSON form. Transfers are stored as columns and blocks as structure (version 2), so large
        schedules stay small on disk."""
        return {
            "type": "gradsync.schedule",
            "version": 2 if self.blocks else 1,
            "algorithm": self.algorithm,
            "topology": self.topology,
            "collective": self.collective,
            "ranks": list(self.ranks),
            "chunks": {
                "offset": [c.offset for c in self.chunks],
                "size": [c.size for c in self.chunks],
                "root": [c.root for c in self.chunks],
            },
            "transfers": {
                "chunk": [t.chunk for t in self.explicit],
                "src": [t.src for t in self.explicit],
                "dst": [t.dst for t in self.explicit],
                "route": [list(t.route) for t in self.explicit],
                "reduce": [t.reduce for t in self.explicit],
                "step": [t.step for t in self.explicit],
                "priority": [t.priority for t in self.explicit],
            },
            "trees": [tr.to_dict(self.ranks) for tr in self.trees],
            **({"blocks": [b.to_dict(self.ranks) for b in self.blocks]} if self.blocks else {}),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Schedule:
        """Inverse of :meth:`to_dict`; validates shapes and types (the replay is :meth:`check`)."""
        if not isinstance(data, dict) or data.get("type") != "gradsync.schedule":
            raise ScheduleError("not a gradsync schedule: expected a JSON object with type 'gradsync.schedule'")
        try:
            ranks = tuple(str(r) for r in data["ranks"])
            idx = {r: i for i, r in enumerate(ranks)}
            ch = data["chunks"]
            chunks = tuple(
                Chunk(float(o), float(s), None if r is None else int(r))
                for o, s, r in zip(ch["offset"], ch["size"], ch["root"], strict=True)
            )
            tr = data["transfers"]
            cols = [tr[k] for k in ("chunk", "src", "dst", "route", "reduce", "step")]
            prio = tr.get("priority") or [0] * len(cols[0])
            transfers = tuple(
                Transfer(_int64(c), _int64(s), _int64(d), tuple(str(x) for x in r), bool(red), _int64(st), _int64(p))
                for c, s, d, r, red, st, p in zip(*cols, prio, strict=True)
            )
            trees = tuple(
                Tree(
                    float(t["weight"]),
                    idx[t["root"]],
                    tuple((idx[a], idx[b]) for a, b in t["edges"]),
                    tuple(tuple(r) for r in t["routes"]),
                )
                for t in data.get("trees", [])
            )
            blocks = []
            for b in data.get("blocks") or ():
                kind = BLOCKS.get(b["kind"])
                if kind is None:
                    raise ScheduleError(f"malformed schedule data: block kind {b['kind']!r} is not one of {sorted(BLOCKS)}")
                blocks.append(kind.from_dict(b, idx))
            return cls(
                str(data["algorithm"]), str(data["topology"]), ranks, chunks, transfers,
                collective=str(data.get("collective", "allreduce")), trees=trees, meta=dict(data.get("meta") or {}),
                blocks=tuple(blocks),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, ScheduleError):
                raise
            raise ScheduleError(f"malformed schedule data: {type(exc).__name__}: {exc}") from None

    def save(self, path: str | Path) -> Path:
        return write_text(path, json.dumps(self.to_dict()) + "\n", "schedule file", ScheduleError)

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        p = Path(path)
        try:
            data = json.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ScheduleError(f"schedule file {str(p)!r} is not a text file (byte {exc.object[exc.start]:#04x} "
                                f"at offset {exc.start} is not UTF-8); give a schedule written by "
                                f"'gradsync plan -o FILE.json'") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ScheduleError(f"cannot read schedule file {str(p)!r}: {exc}") from None
        return cls.from_dict(data)


def shard_bounds(rank: int, world_size: int, numel: int) -> tuple[int, int]:
    """Rank ``rank``'s equal shard of ``numel`` elements, rounded like :meth:`Schedule.chunk_bounds`, so the
    chunks of a sharded schedule tile it exactly (``numel`` a multiple of ``world_size``: ``numel / N`` each)."""
    return round(rank / world_size * numel), round((rank + 1) / world_size * numel)


def _columns(transfers: Sequence[Transfer]) -> dict[str, np.ndarray]:
    n = len(transfers)
    return {
        "chunk": np.fromiter((t.chunk for t in transfers), np.int64, n),
        "src": np.fromiter((t.src for t in transfers), np.int64, n),
        "dst": np.fromiter((t.dst for t in transfers), np.int64, n),
        "step": np.fromiter((t.step for t in transfers), np.int64, n),
        "reduce": np.fromiter((t.reduce for t in transfers), bool, n),
    }


def _int64(x: Any) -> int:
    """An index, step or priority read from a file: an integer that the int64 arrays of a schedule hold."""
    v = int(x)
    if not -(1 << 63) <= v < (1 << 63):
        raise ScheduleError(f"malformed schedule data: {x!r} does not fit a 64-bit integer")
    return v


def _ranks_of(bits: int) -> list[int]:
    return [i for i in range(bits.bit_length()) if bits >> i & 1]


def tree_transfers(
    tree: Tree, chunk_ids: Iterable[int], ranks: Sequence[str], shape: _Shape | None = None
) -> list[Transfer]:
    """Reduce up ``tree`` then broadcast down it, for each chunk in ``chunk_ids``.

    A rank sends up at step = its height (leaves 0), so it has every child's partial sum; the root's
    value goes down at step = height(root) + depth(parent). Every tree edge carries each chunk once in
    each direction, which is the seed's duplex model of reduce and broadcast at once. ``shape``: the tree's
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
