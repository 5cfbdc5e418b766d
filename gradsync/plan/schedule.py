"""The one schedule representation that the planner writes and the simulator and runtime execute.

A :class:`Schedule` is plain data:

* ``chunks`` split the buffer into contiguous fractions ``[offset, offset + size)``; the same fractions
  apply to every tensor of a tensor list (BML §4.1 per-layer pieces), so a schedule is size-agnostic.
* ``transfers`` move one chunk from a source rank to a destination rank along a ``route`` of devices
  (through switches and relays, OMS §3). ``reduce=True`` means the receiver adds what arrives into its
  own copy of the chunk; ``reduce=False`` means it overwrites it (broadcast / allgather).
* ``step`` orders transfers *per chunk*: a transfer at step ``s`` sends the sender's chunk as it is after
  every transfer of an earlier step into that (rank, chunk) has arrived. Different chunks never wait for
  each other, which is what lets chunks stream through a tree (OMS §2) and lets the simulator and
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

Modules: the chunks, transfers and trees are :mod:`gradsync.plan.transfers`, the compact blocks
:mod:`gradsync.plan.blocks`, the self-check and replay :mod:`gradsync.plan.schedule_check`; this module is the
:class:`Schedule` that holds them, its derived views and its JSON form, and re-exports their public names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from gradsync.errors import ScheduleError
from gradsync.paths import parse_json, read_input, write_text
from gradsync.plan.blocks import (
    BLOCKS,
    Block,
    RingBlock,
    TreeBlock,
    TreeShape,
    ring_transfers,
    tree_shape,
    tree_transfers,
)
from gradsync.plan.schedule_check import check_schedule
from gradsync.plan.transfers import COLLECTIVES, SHARDED, Chunk, Transfer, Tree, read_int64, shard_bounds
from gradsync.topology.model import Topology

__all__ = ["COLLECTIVES", "SHARDED", "Block", "Chunk", "shard_bounds", "Transfer", "Tree", "TreeBlock", "RingBlock", "Schedule",
           "LinkLoads", "ring_transfers", "tree_transfers"]

#: Largest schedule file read (GRADSYNC_MAX_INPUT_BYTES overrides); large plans are stored compactly (blocks)
MAX_SCHEDULE_BYTES = 64 << 20


@dataclass(frozen=True)
class LinkLoads:
    """Fractions of the buffer crossing each link: ``directed[e, d]`` (d=0 is a->b) and reduce-phase only."""

    directed: np.ndarray
    reduce_directed: np.ndarray

    def cost(self, costs: np.ndarray) -> float:
        """OMS's C generalised to duplex links: max over link directions of load * c_e.

        ``costs`` is per link or per direction (``Topology.directed_costs``, for asymmetric links).
        """
        if self.directed.size == 0:
            return 0.0
        return float((self.directed * (costs if costs.ndim == 2 else costs[:, None])).max())

    def aggregation_cost(self, costs: np.ndarray) -> float:
        """OMS's own single-direction C (eq. 2): reduce phase only, each link one undirected channel.

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

    def tree_shape(self, index: int) -> TreeShape:
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
    def digest(self) -> str:
        """A hash of what moves: the collective, the ranks, every chunk and every transfer (routes and priorities
        included), not the algorithm's name or ``meta``. Two synthesizers that plan the same transfers (``tree`` and
        ``lp`` where the LP's optimum is one tree) give equal digests, so what depends only on the transfers (a
        simulation) is done once for both."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps([self.collective, list(self.ranks),
                             [[c.offset, c.size, c.root] for c in self.chunks]]).encode())
        for name, col in self.arrays.items():
            h.update(name.encode())
            h.update(np.ascontiguousarray(col).tobytes())
        routes: dict[tuple[str, ...], int] = {}
        h.update(np.fromiter((routes.setdefault(t.route, len(routes)) for t in self.transfers), np.int64,
                             len(self.transfers)).tobytes())
        h.update(json.dumps([list(r) for r in routes]).encode())
        h.update(np.fromiter((t.priority for t in self.transfers), np.int64, len(self.transfers)).tobytes())
        return h.hexdigest()

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
        """Per-layer splitting (BML §4.1): chunk c of a tensor list is piece c of *every* tensor.

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
        check_schedule(self, topology)

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
                Transfer(read_int64(c), read_int64(s), read_int64(d), tuple(str(x) for x in r), bool(red), read_int64(st), read_int64(p))
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
            text = read_input(p, "schedule file", ScheduleError, MAX_SCHEDULE_BYTES).decode("utf-8")
            data = parse_json(text, f"schedule file {str(p)!r}", ScheduleError)
        except UnicodeDecodeError as exc:
            raise ScheduleError(f"schedule file {str(p)!r} is not a text file (byte {exc.object[exc.start]:#04x} "
                                f"at offset {exc.start} is not UTF-8); give a schedule written by "
                                f"'gradsync plan -o FILE.json'") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ScheduleError(f"cannot read schedule file {str(p)!r}: {exc}") from None
        return cls.from_dict(data)


def _columns(transfers: Sequence[Transfer]) -> dict[str, np.ndarray]:
    n = len(transfers)
    return {
        "chunk": np.fromiter((t.chunk for t in transfers), np.int64, n),
        "src": np.fromiter((t.src for t in transfers), np.int64, n),
        "dst": np.fromiter((t.dst for t in transfers), np.int64, n),
        "step": np.fromiter((t.step for t in transfers), np.int64, n),
        "reduce": np.fromiter((t.reduce for t in transfers), bool, n),
    }
