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
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from gradsync.errors import ScheduleError
from gradsync.paths import write_text
from gradsync.topology.model import Topology

__all__ = ["COLLECTIVES", "SHARDED", "Chunk", "shard_bounds", "Transfer", "Tree", "Schedule", "LinkLoads"]

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
    transfers: tuple[Transfer, ...]
    collective: str = "allreduce"
    trees: tuple[Tree, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ScheduleError(f"collective {self.collective!r} is not one of {COLLECTIVES}")
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "chunks", tuple(self.chunks))
        object.__setattr__(self, "transfers", tuple(self.transfers))
        object.__setattr__(self, "trees", tuple(self.trees))

    # ---- derived views ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_steps(self) -> int:
        return 1 + max((t.step for t in self.transfers), default=-1)

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """Column view of the transfers (chunk, src, dst, step, reduce) for vectorised consumers."""
        n = len(self.transfers)
        out = {
            "chunk": np.fromiter((t.chunk for t in self.transfers), np.int64, n),
            "src": np.fromiter((t.src for t in self.transfers), np.int64, n),
            "dst": np.fromiter((t.dst for t in self.transfers), np.int64, n),
            "step": np.fromiter((t.step for t in self.transfers), np.int64, n),
            "reduce": np.fromiter((t.reduce for t in self.transfers), bool, n),
        }
        return out

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
        for t in self.transfers:
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
        for i, t in enumerate(self.transfers):
            if self.collective == "allgather" and t.reduce:
                raise ScheduleError(f"transfer {i} (chunk {t.chunk}, rank {t.src} -> rank {t.dst}) reduces, but an "
                                    f"allgather only copies shards; make it a copy (reduce=False)")
            if not 0 <= t.chunk < c:
                raise ScheduleError(f"transfer {i} names chunk {t.chunk}; the schedule has chunks 0..{c - 1}")
            if not (0 <= t.src < n and 0 <= t.dst < n) or t.src == t.dst:
                raise ScheduleError(f"transfer {i} goes from rank {t.src} to rank {t.dst}; need two distinct ranks in 0..{n - 1}")
            if t.step < 0:
                raise ScheduleError(f"transfer {i} has step {t.step}; steps start at 0")
            if len(t.route) < 2 or t.route[0] != self.ranks[t.src] or t.route[-1] != self.ranks[t.dst]:
                raise ScheduleError(
                    f"transfer {i} (chunk {t.chunk}, rank {t.src} -> rank {t.dst}) has route {list(t.route)}; "
                    f"it must start at {self.ranks[t.src]!r} and end at {self.ranks[t.dst]!r}"
                )
            if topology is not None:
                for u, v in zip(t.route[:-1], t.route[1:]):
                    if not topology.has_link(u, v):
                        raise ScheduleError(
                            f"transfer {i} (chunk {t.chunk}, rank {t.src} -> rank {t.dst}) hops {u} -> {v}, "
                            f"but {topology.name!r} has no such link"
                        )

    def _check_hazards(self) -> None:
        if not self.transfers:
            return
        a = self.arrays
        c = len(self.chunks)
        read_key = (a["step"] * len(self.ranks) + a["src"]) * c + a["chunk"]
        write_key = (a["step"] * len(self.ranks) + a["dst"]) * c + a["chunk"]
        both = np.intersect1d(read_key, write_key)
        if both.size:
            i = int(np.flatnonzero(np.isin(write_key, both[:1]))[0])
            t = self.transfers[i]
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
            t = self.transfers[i]
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
        for t in sorted(self.transfers, key=lambda t: (t.chunk, t.step)):
            by_chunk.setdefault(t.chunk, []).append(t)
        for chunk in range(len(self.chunks)):
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
        """Tagged JSON form. Transfers are stored as columns to keep large schedules compact."""
        return {
            "type": "gradsync.schedule",
            "version": 1,
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
                "chunk": [t.chunk for t in self.transfers],
                "src": [t.src for t in self.transfers],
                "dst": [t.dst for t in self.transfers],
                "route": [list(t.route) for t in self.transfers],
                "reduce": [t.reduce for t in self.transfers],
                "step": [t.step for t in self.transfers],
                "priority": [t.priority for t in self.transfers],
            },
            "trees": [tr.to_dict(self.ranks) for tr in self.trees],
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
            return cls(
                str(data["algorithm"]), str(data["topology"]), ranks, chunks, transfers,
                collective=str(data.get("collective", "allreduce")), trees=trees, meta=dict(data.get("meta") or {}),
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


def _int64(x: Any) -> int:
    """An index, step or priority read from a file: an integer that the int64 arrays of a schedule hold."""
    v = int(x)
    if not -(1 << 63) <= v < (1 << 63):
        raise ScheduleError(f"malformed schedule data: {x!r} does not fit a 64-bit integer")
    return v


def _ranks_of(bits: int) -> list[int]:
    return [i for i in range(bits.bit_length()) if bits >> i & 1]


def tree_transfers(
    tree: Tree, chunk_ids: Iterable[int], ranks: Sequence[str]
) -> list[Transfer]:
    """Reduce up ``tree`` then broadcast down it, for each chunk in ``chunk_ids``.

    A rank sends up at step = its height (leaves 0), so it has every child's partial sum; the root's
    value goes down at step = height(root) + depth(parent). Every tree edge carries each chunk once in
    each direction, which is the seed's duplex model of reduce and broadcast at once.
    """
    children: dict[int, list[int]] = {}
    route_of: dict[tuple[int, int], tuple[str, ...]] = {}
    for (c, p), route in zip(tree.edges, tree.routes):
        children.setdefault(p, []).append(c)
        route_of[(c, p)] = route
    height: dict[int, int] = {}
    depth: dict[int, int] = {tree.root: 0}
    order = [tree.root]
    for v in order:  # BFS from the root
        for c in children.get(v, []):
            depth[c] = depth[v] + 1
            order.append(c)
    if len(order) != len(ranks):
        raise ScheduleError(f"tree rooted at rank {tree.root} reaches {len(order)} of {len(ranks)} ranks")
    for v in reversed(order):
        height[v] = 1 + max((height[c] for c in children.get(v, [])), default=-1)
    top = height[tree.root]
    out: list[Transfer] = []
    for chunk in chunk_ids:
        for (c, p), route in route_of.items():
            out.append(Transfer(chunk, c, p, route, True, height[c]))
            out.append(Transfer(chunk, p, c, tuple(reversed(route)), False, top + depth[p]))
    return out
