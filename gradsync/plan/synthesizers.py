"""Schedule synthesizers: a registry from algorithm name to ``(topology, options) -> Schedule``.

Every synthesizer returns a schedule that passes :meth:`Schedule.check`; the simulator and the runtime
accept any of them. Later issues register more (``bml``, ``hierarchical``, ``multiring``) the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from gradsync.errors import PlanError
from gradsync.plan.collectives import allreduce_half, join_halves
from gradsync.plan.forest import Arborescence, arborescence_schedule, optimal_forest, reverse_schedule
from gradsync.plan.highs import linprog
from gradsync.plan.lp import bottleneck_tree, optimal_packing
from gradsync.plan.routing import router_for
from gradsync.plan.schedule import SHARDED, Chunk, RingBlock, Schedule, Transfer, Tree, TreeBlock, ring_transfers
from gradsync.plan.trees import RoutedTree, root_tree
from gradsync.registry import Registry
from gradsync.topology.model import Topology

__all__ = ["MAX_PLAN_BYTES", "PLANNED_COLLECTIVES", "PlanOptions", "Synthesizer", "SYNTHESIZERS", "plan_bytes", "ring_blocks", "ring_transfers", "split_chunks",
           "synthesize", "unless_raises"]

#: Memory one planned transfer holds (the Transfer, its route tuple, its list slots): measured for ring on
#: switch:1000 (peak memory over its transfers) and rounded down, so estimates are floors.
TRANSFER_BYTES = 500
#: Memory one route of a compact block holds (a tuple of a few device names), a floor as above.
ROUTE_BYTES = 100
#: Planning estimated to need more than this is refused before it allocates anything.
MAX_PLAN_BYTES = 8 * 2**30
#: Collectives a synthesizer can be asked for (``PlanOptions.collective``); allreduce is every synthesizer's.
PLANNED_COLLECTIVES = ("allreduce", *SHARDED)


@dataclass(frozen=True)
class PlanOptions:
    """Options every synthesizer accepts.

    ``pipeline``: sub-chunks per tree or ring chunk, so a tree streams (OMS §2) and the runtime can
    overlap hops. ``rings``: how many rings ``multiring`` splits the buffer over (MXNET-MPI Fig. 9).
    ``size_bytes`` and ``latency_s`` only steer ``auto``'s choice (predicted time; ``auto`` chooses among
    the synthesizers in :mod:`gradsync.sim.choose`). ``collective``: what to plan, one of :data:`PLANNED_COLLECTIVES`.
    ``straggler``: the rank that ``straggler`` lets join last (:mod:`gradsync.plan.straggler`; None: the last rank).
    """

    pipeline: int = 1
    size_bytes: float = 1e8
    latency_s: float | None = None
    rings: int = 2
    collective: str = "allreduce"
    straggler: int | None = None

    def __post_init__(self) -> None:
        if self.collective not in PLANNED_COLLECTIVES:
            raise PlanError(f"collective={self.collective!r} is not one the planner plans; use one of "
                            f"{', '.join(PLANNED_COLLECTIVES)}")
        if not isinstance(self.pipeline, int) or self.pipeline < 1:
            raise PlanError(f"pipeline={self.pipeline!r} must be an integer >= 1 (sub-chunks per tree)")
        if not self.size_bytes > 0:
            raise PlanError(f"size_bytes={self.size_bytes!r} must be positive")
        if not isinstance(self.rings, int) or self.rings < 1:
            raise PlanError(f"rings={self.rings!r} must be an integer >= 1 (rings multiring splits the buffer over)")
        if self.latency_s is not None and not self.latency_s >= 0:
            raise PlanError(f"latency_s={self.latency_s!r} must be >= 0 seconds")
        if self.straggler is not None and (isinstance(self.straggler, bool) or not isinstance(self.straggler, int)
                                           or self.straggler < 0):
            raise PlanError(f"straggler={self.straggler!r} must be a rank (an integer >= 0) or None")


Planner = Callable[[Topology, PlanOptions], Schedule]


@dataclass(frozen=True)
class Synthesizer:
    name: str
    fn: Planner
    summary: str
    #: Returns ``None`` when the synthesizer applies to the topology, else the reason it does not.
    applicable: Callable[[Topology], str | None]
    #: Planners of the other collectives it supports (``reduce_scatter``, ``allgather``).
    collectives: Mapping[str, Planner] = field(default_factory=dict)
    #: When ``auto`` may consider it, given the plan options (None: always). A schedule for a condition the
    #: topology does not show (a late rank) is a candidate only once something reports that condition.
    candidate_when: Callable[[PlanOptions], bool] | None = None

    def candidate(self, options: PlanOptions) -> bool:
        """Whether ``auto`` considers this synthesizer under ``options``."""
        return self.candidate_when is None or self.candidate_when(options)

    def planner(self, collective: str) -> Planner:
        """The planner of ``collective``, or :class:`PlanError` naming the algorithms that plan it."""
        if collective == "allreduce":
            return self.fn
        got = self.collectives.get(collective)
        if got is None:
            able = [n for n, e in SYNTHESIZERS.items() if collective in e.collectives]
            raise PlanError(f"algorithm {self.name!r} does not plan {collective}; use --algorithm with one of "
                            f"{', '.join(able)}")
        return got

    @property
    def supported(self) -> tuple[str, ...]:
        return ("allreduce", *self.collectives)


SYNTHESIZERS: Registry[Synthesizer] = Registry("algorithm", PlanError)


def _always(_: Topology) -> str | None:
    return None


def unless_raises(probe: Callable[[Topology], object]) -> Callable[[Topology], str | None]:
    """An ``applicable`` predicate from a function that raises :class:`PlanError` saying why not."""

    def applicable(topology: Topology) -> str | None:
        try:
            probe(topology)
        except PlanError as exc:
            return str(exc)
        return None

    return applicable


def synthesizer(name: str, applicable: Callable[[Topology], str | None] = _always, *, halves: bool = False,
                collectives: Mapping[str, Planner] | None = None,
                candidate_when: Callable[[PlanOptions], bool] | None = None) -> Callable:
    """Register an allreduce planner. ``halves``: its allreduce is a reduce-scatter then an allgather on equal
    rank-order shards, so those two are its halves (:func:`allreduce_half`); ``collectives`` adds others;
    ``candidate_when``: see :attr:`Synthesizer.candidate_when`."""

    def deco(fn: Planner) -> Planner:
        summary = (fn.__doc__ or "").strip().splitlines()[0]
        more: dict[str, Planner] = {}
        if halves:
            more = {c: functools.partial(_planned_half, fn, c) for c in SHARDED}
        more.update(collectives or {})
        SYNTHESIZERS.add(name, Synthesizer(name, fn, summary, applicable, more, candidate_when))
        return fn

    return deco


def _planned_half(fn: Planner, collective: str, topology: Topology, options: PlanOptions) -> Schedule:
    return allreduce_half(fn(topology, options), collective)


def plan_bytes(algorithm: str, topology: Topology, options: PlanOptions | None = None) -> tuple[float, str]:
    """A floor on the memory planning ``algorithm`` on ``topology`` takes, and what dominates it.

    PS schedules hold ~2n(n-1) explicit transfers, and so do the reduce-scatter and allgather halves of
    rings and the joined forests of ``forest``; an allreduce ring keeps one compact ring block (n routes) per ring and pipeline stage; trees
    hold n - 1 routed edges per tree (the reduce-scatter and allgather forests as many) but, with
    switches, route over a dense ranks x devices shortest-path table. ``(0, "")`` where there is no estimate (one rank; ``hierarchical`` and ``bml``, which plan per
    level)."""
    opts = options or PlanOptions()
    name = SYNTHESIZERS.canonical(algorithm)
    n, v, p = topology.world_size, len(topology.devices), opts.pipeline
    if n < 2:
        return 0.0, ""
    routes = {"ring": p * (2 if n > 2 else 1) * n, "multiring": p * opts.rings * n, "tree": n - 1, "lp": n - 1}.get(name)
    transfers = {"ring": 2 * (n - 1) * n * p * (2 if n > 2 else 1), "multiring": 2 * (n - 1) * n * p * opts.rings,
                 "ps": 2 * (n - 1) * n * p, "tree": 2 * (n - 1) * p, "lp": 2 * (n - 1) * p,
                 "forest": 2 * (n - 1) * n * p}.get(name)
    if routes is not None and (opts.collective == "allreduce" or name in ("tree", "lp")):
        need, what = float(routes * ROUTE_BYTES), f"{routes} routes in compact blocks"
    elif transfers is not None:
        need, what = float(transfers * TRANSFER_BYTES), f"{transfers:.3g} transfers"
    else:
        return 0.0, ""
    if name in ("tree", "lp", "forest") and topology.has_forwarders and 12.0 * n * v > need:
        need, what = 12.0 * n * v, f"a {n} x {v} shortest-path table"  # float64 distances + int32 predecessors
    return need, what


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def _too_large(name: str, topology: Topology, options: PlanOptions, need: float, what: str, limit: float) -> str:
    """Why planning is refused, and which applicable algorithm fits (or that none does, and what to do)."""
    fits = []
    for other in SYNTHESIZERS.names():
        if other == name or SYNTHESIZERS.get(other).applicable(topology):
            continue
        b, w = plan_bytes(other, topology, options)
        fits.append((b, other, w))
    head = (f"planning {name!r} on {topology.name!r} ({topology.world_size} ranks, {len(topology.devices)} devices) "
            f"needs at least {_gib(need)} ({what}), over the {_gib(limit)} limit")
    small = sorted((f for f in fits if f[0] <= limit), key=lambda f: (f[0] == 0, f[0]))  # estimated ones first
    if small:
        b, other, w = small[0]
        size = f"about {_gib(b)}" if b else "not estimated: it plans per switch level"
        return f"{head}; {other!r} fits ({size}): use --algorithm {other}"
    smallest = f"; the smallest, {sorted(fits)[0][1]!r}, needs {_gib(sorted(fits)[0][0])}" if fits else ""
    return (f"{head}, and no algorithm here plans it within the limit{smallest}; plan fewer ranks, or a "
            f"hierarchical topology ('racks:r,s,o', 'fattree:k', 'bcube:n,k') with --algorithm hierarchical")


def synthesize(algorithm: str, topology: Topology, options: PlanOptions | None = None, *, check: bool = True,
               max_bytes: float = MAX_PLAN_BYTES) -> Schedule:
    """Plan ``algorithm`` on ``topology``; the result has passed its self-check unless ``check=False``.

    Refused with :class:`PlanError` when :func:`plan_bytes` says it needs more than ``max_bytes``."""
    if algorithm == "auto":
        raise PlanError("algorithm 'auto' is not a synthesizer: it chooses among them by the runtime's cost model, "
                        "one layer up; call gradsync.sim.synthesize('auto', ...) (it takes every name this does)")
    entry = SYNTHESIZERS.get(algorithm)
    reason = entry.applicable(topology)
    if reason:
        raise PlanError(f"algorithm {entry.name!r} does not apply to {topology.name!r}: {reason}")
    opts = options or PlanOptions()
    need, what = plan_bytes(entry.name, topology, opts)
    if need > max_bytes:
        raise PlanError(_too_large(entry.name, topology, opts, need, what, max_bytes))
    schedule = entry.planner(opts.collective)(topology, opts)
    if check:
        schedule.check(topology)
    return schedule


# ---- helpers shared by synthesizers ------------------------------------------------------------------
def split_chunks(
    weights: Sequence[float], pipeline: int, roots: Sequence[int | None] | None = None
) -> tuple[list[Chunk], list[list[int]]]:
    """Chunks for consecutive shares of the buffer, each split into ``pipeline`` equal sub-chunks.

    Share ``i``'s sub-chunks get root ``roots[i]`` (the rank where its reduction completes). Returns the
    chunks and, per share, its chunk ids. The last chunk absorbs float drift so chunks tile [0, 1) exactly.
    """
    chunks: list[Chunk] = []
    ids: list[list[int]] = []
    offset = 0.0
    for i, w in enumerate(weights):
        root = roots[i] if roots is not None else None
        mine = []
        for _ in range(pipeline):
            mine.append(len(chunks))
            chunks.append(Chunk(offset, w / pipeline, root))
            offset += w / pipeline
        ids.append(mine)
    if chunks:
        last = chunks[-1]
        chunks[-1] = Chunk(last.offset, 1.0 - last.offset, last.root)
    return chunks, ids


def _tree_schedule(algorithm: str, topology: Topology, trees: Sequence[Tree], pipeline: int, meta: dict) -> Schedule:
    """Every tree reduces and broadcasts its share of the buffer, in ``pipeline`` sub-chunks (compact form)."""
    chunks, ids = split_chunks([t.weight for t in trees], pipeline, [t.root for t in trees])
    blocks = tuple(TreeBlock(k, tuple(chunk_ids)) for k, chunk_ids in enumerate(ids))
    return Schedule(algorithm, topology.name, topology.ranks, tuple(chunks), (), trees=tuple(trees), meta=meta, blocks=blocks)


def ring_blocks(orders: Sequence[Sequence[int]], chunk_ids: Sequence[Sequence[int]], routes: Sequence[Sequence[tuple[str, ...]]],
                chunks: Sequence[Chunk]) -> tuple[list[RingBlock], list[Chunk]]:
    """One :class:`RingBlock` per ring (``orders[k]`` carrying ``chunk_ids[k]`` over ``routes[k]``), and the
    chunks with the roots the rings give them."""
    blocks = [RingBlock(tuple(o), tuple(r), tuple(c)) for o, c, r in zip(orders, chunk_ids, routes, strict=True)]
    roots = {c: root for b in blocks for c, root in b.roots(None).items()}  # type: ignore[arg-type]
    return blocks, [Chunk(ch.offset, ch.size, roots.get(i, ch.root)) for i, ch in enumerate(chunks)]


def _hamiltonian_cycles(topology: Topology, limit: int = 2000, seconds: float = 1.0) -> list[tuple[int, ...]]:
    """Hamiltonian cycles over the ranks of a switch-free graph (each once, not its reverse), capped."""
    n = topology.world_size
    idx = topology.rank_index
    adj = [sorted(idx[v] for v in topology.graph[r]) for r in topology.ranks]
    found: list[tuple[int, ...]] = []
    deadline = time.perf_counter() + seconds
    path = [0]
    used = [False] * n
    used[0] = True
    # Depth-first with an explicit stack of neighbour iterators (one per vertex on the path): a recursive
    # search is as deep as the ring and hit Python's recursion limit at ~1000 ranks.
    stack = [iter(adj[0])]
    while stack:
        if len(found) >= limit or time.perf_counter() > deadline:
            break
        u = next(stack[-1], None)
        if u is None:  # every neighbour of the path's end tried: step back
            stack.pop()
            if len(path) > 1:
                used[path.pop()] = False
            continue
        if used[u]:
            continue
        if len(path) + 1 == n:
            if 0 in adj[u] and path[1] < u:
                found.append((*path, u))
            continue
        used[u] = True
        path.append(u)
        stack.append(iter(adj[u]))
    return found


def _dfs_order(topology: Topology) -> list[int]:
    """Ranks in depth-first order of the device graph, so ring neighbours are physically close."""
    idx = topology.rank_index
    order = [idx[v] for v in nx.dfs_preorder_nodes(topology.graph, topology.ranks[0]) if v in idx]
    return order


# ---- the synthesizers ----------------------------------------------------------------------------------
@synthesizer("ring", halves=True)
def plan_ring(topology: Topology, options: PlanOptions) -> Schedule:
    """Ring allreduce on the best ring(s): an LP mix of Hamiltonian cycles, each run in both directions."""
    n = topology.world_size
    if n == 1:
        return Schedule("ring", topology.name, topology.ranks, (Chunk(0.0, 1.0, 0),), ())
    cycles: list[tuple[int, ...]] = []
    if not topology.has_forwarders and n >= 3:
        cycles = _hamiltonian_cycles(topology)
    weights: list[float]
    if cycles:
        # min t  s.t.  for each link e: c_e * (n-1)/n * sum_{cycles H containing e} beta_H <= t,  sum beta = 1
        m = len(topology.links)
        a = np.zeros((m, len(cycles)))
        for k, cyc in enumerate(cycles):
            for i in range(n):
                e, _ = topology.directed_link(topology.ranks[cyc[i]], topology.ranks[cyc[(i + 1) % n]])
                a[e, k] = topology.costs[e] * (n - 1) / n
        c = np.r_[np.zeros(len(cycles)), 1.0]
        res = linprog(
            c, A_ub=np.hstack([a, -np.ones((m, 1))]), b_ub=np.zeros(m),
            A_eq=np.r_[np.ones(len(cycles)), 0.0][None, :], b_eq=[1.0], bounds=[(0, None)] * (len(cycles) + 1),
            method="highs",
        )
        if not res.success:  # pragma: no cover
            raise PlanError(f"HiGHS failed on the ring-mix LP: {res.message}")
        keep = [(float(b), cyc) for b, cyc in zip(res.x[:-1], cycles) if b > 1e-12]
        total = sum(b for b, _ in keep)
        rings = [(b / total, list(cyc)) for b, cyc in keep]
    else:
        rings = [(1.0, _dfs_order(topology))]
    directed: list[tuple[float, list[int]]] = []
    for beta, order in rings:
        if n == 2:
            directed.append((beta, order))
        else:
            directed += [(beta / 2, order), (beta / 2, [order[0], *reversed(order[1:])])]
    weights = [beta / n for beta, _ in directed for _ in range(n)]
    chunks, ids = split_chunks(weights, options.pipeline)
    route = router_for(topology)
    orders, chunk_ids, routes = [], [], []
    for k, (_, order) in enumerate(directed):
        names = [topology.ranks[v] for v in order]
        ring_routes = [route(names[i], names[(i + 1) % n]) for i in range(n)]
        for sub in range(options.pipeline):
            orders.append(order)
            chunk_ids.append([ids[k * n + p][sub] for p in range(n)])
            routes.append(ring_routes)
    blocks, chunks = ring_blocks(orders, chunk_ids, routes, chunks)
    meta = {"rings": [{"weight": b, "order": [topology.ranks[v] for v in o]} for b, o in directed]}
    return Schedule("ring", topology.name, topology.ranks, tuple(chunks), (), meta=meta, blocks=tuple(blocks))


@synthesizer("multiring", halves=True)
def plan_multiring(topology: Topology, options: PlanOptions) -> Schedule:
    """MXNET-MPI's multi-ring allreduce: the buffer split over ``rings`` rings whose reductions overlap.

    MXNET-MPI §6.3.2, Fig. 9: within one ring the next send waits for the previous reduction, so the
    buffer is split equally over several rings on the best ring order and the rings take turns: while
    ring r's arrival is being added, ring r+1's transfer is on the wire. Here ring r owns chunks
    ``r*n .. r*n+n-1`` and is rotated by r positions (its reductions complete on different ranks); the
    executor waits in (step, chunk) order, which interleaves the rings exactly as Fig. 9 does.
    """
    n = topology.world_size
    base = plan_ring(topology, PlanOptions(pipeline=1))
    if n == 1:
        return Schedule("multiring", topology.name, topology.ranks, base.chunks, ())
    heaviest = max(base.meta["rings"], key=lambda r: r["weight"])
    order = [topology.rank_index[d] for d in heaviest["order"]]
    route = router_for(topology)
    names = [topology.ranks[v] for v in order]
    routes = [route(names[i], names[(i + 1) % n]) for i in range(n)]
    rings = options.rings
    chunks, ids = split_chunks([1.0 / (rings * n)] * (rings * n), options.pipeline)
    keys = [(r, sub) for r in range(rings) for sub in range(options.pipeline)]
    blocks, chunks = ring_blocks([order] * len(keys), [[ids[r * n + (p + r) % n][sub] for p in range(n)] for r, sub in keys],
                                 [routes] * len(keys), chunks)
    meta = {"rings": [{"weight": 1.0 / rings, "order": names} for _ in range(rings)], "num_rings": rings}
    return Schedule("multiring", topology.name, topology.ranks, tuple(chunks), (), meta=meta, blocks=tuple(blocks))


@synthesizer("ps", halves=True)
def plan_ps(topology: Topology, options: PlanOptions) -> Schedule:
    """Co-located parameter server (BML's P2P PS): rank i aggregates 1/N of the buffer and sends it back."""
    n = topology.world_size
    chunks, ids = split_chunks([1.0 / n] * n, options.pipeline, range(n))
    transfers: list[Transfer] = []
    route = router_for(topology)
    for owner in range(n):
        for c in ids[owner]:
            for r in range(n):
                if r == owner:
                    continue
                up = route(topology.ranks[r], topology.ranks[owner])
                transfers.append(Transfer(c, r, owner, up, True, 0))
                transfers.append(Transfer(c, owner, r, tuple(reversed(up)), False, 1))
    return Schedule("ps", topology.name, topology.ranks, tuple(chunks), tuple(transfers))


def _best_tree(topology: Topology) -> RoutedTree:
    best = bottleneck_tree(topology)
    if topology.has_forwarders:
        # With switches a tree's cost depends on how many routes share a link; the MST is no longer
        # guaranteed best, so also try the LP's trees and keep the one with the smallest max load.
        candidates = [best] + [t for _, t in optimal_packing(topology).trees]
        best = min(candidates, key=lambda t: float((topology.costs * t.loads).max()))
    return best


def _out_trees(topology: Topology, tree: RoutedTree) -> list[tuple[float, Arborescence]]:
    """``tree`` oriented away from every rank in turn: each rank's whole shard goes down its own copy."""
    out = []
    for r in range(topology.world_size):
        rooted = root_tree(tree, 1.0, root=r)
        edges = tuple((p, c) for c, p in rooted.edges)
        routes = tuple(tuple(reversed(rt)) for rt in rooted.routes)
        loads = np.zeros((len(topology.links), 2))
        for route in routes:
            for e, d in topology.route_links(route):
                loads[e, d] += 1
        out.append((1.0, Arborescence(r, edges, routes, loads)))
    return out


def _tree_allgather(topology: Topology, options: PlanOptions) -> Schedule:
    """Every rank's shard copied down the one best spanning tree, rooted at that rank."""
    return arborescence_schedule("tree", topology, _out_trees(topology, _best_tree(topology)), options.pipeline)


def _tree_reduce_scatter(topology: Topology, options: PlanOptions) -> Schedule:
    """Every shard summed up the one best spanning tree toward its owner (the allgather reversed)."""
    return reverse_schedule(_tree_allgather(topology, options))


@synthesizer("tree", collectives={"allgather": _tree_allgather, "reduce_scatter": _tree_reduce_scatter})
def plan_tree(topology: Topology, options: PlanOptions) -> Schedule:
    """The best single spanning tree: the bottleneck (minimum-weight) spanning tree, C(T_MWST) of OMS."""
    tree = root_tree(_best_tree(topology), 1.0)
    return _tree_schedule("tree", topology, [tree], options.pipeline, {})


def _forest_meta(topology: Topology, reverse: bool) -> tuple[list[tuple[float, Arborescence]], dict]:
    packing = optimal_forest(topology, reverse)
    meta = {"lp_cost": packing.cost, "lp_lower_bound": packing.lower_bound, "lp_iterations": packing.iterations}
    return list(packing.trees), meta


def _lp_allgather(topology: Topology, options: PlanOptions) -> Schedule:
    """ForestColl's optimal allgather: out-trees per root, packed exactly (:mod:`gradsync.plan.forest`)."""
    trees, meta = _forest_meta(topology, False)
    return arborescence_schedule("lp", topology, trees, options.pipeline, meta)


def _lp_reduce_scatter(topology: Topology, options: PlanOptions) -> Schedule:
    """The optimal reduce-scatter: the allgather packed on the reversed link directions, run backwards."""
    trees, meta = _forest_meta(topology, True)
    return reverse_schedule(arborescence_schedule("lp", topology, trees, options.pipeline, meta))


@synthesizer("lp", collectives={"allgather": _lp_allgather, "reduce_scatter": _lp_reduce_scatter})
def plan_lp(topology: Topology, options: PlanOptions) -> Schedule:
    """OMS's optimal multi-tree schedule: min max_e c_e P_e over (routed) spanning trees, exact."""
    packing = optimal_packing(topology)
    trees = [root_tree(t, w) for w, t in packing.trees]
    meta = {"lp_cost": packing.cost, "lp_lower_bound": packing.lower_bound, "lp_iterations": packing.iterations}
    return _tree_schedule("lp", topology, trees, options.pipeline, meta)


@synthesizer("forest", collectives={"allgather": _lp_allgather, "reduce_scatter": _lp_reduce_scatter})
def plan_forest(topology: Topology, options: PlanOptions) -> Schedule:
    """ForestColl's allreduce: the optimal reduce-scatter forest, then the optimal allgather forest (a tree per root).

    Every rank roots ``1/N`` of the buffer, so each tree carries a small share and the ranks that relay and
    add change with the root: the same fluid cost as ``lp``'s few big trees (both meet the cut bound on
    switched fabrics) but a pipeline that fills ``N`` times faster, which is what ``hierarchical`` gains on
    racks, here for any graph.
    """
    if topology.world_size == 1:  # nothing to move: the one rank's buffer is the sum
        return Schedule("forest", topology.name, topology.ranks, (Chunk(0.0, 1.0, 0),), ())
    rs, ag = _lp_reduce_scatter(topology, options), _lp_allgather(topology, options)
    meta = {"reduce_scatter_lp_cost": rs.meta.get("lp_cost"), "allgather_lp_cost": ag.meta.get("lp_cost")}
    return dataclasses.replace(join_halves(rs, ag, "forest"), meta=meta)
