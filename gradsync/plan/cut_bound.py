"""The exact cut lower bound of allreduce on a fabric whose switches only forward.

Theorem (cut bound). Let ``R`` be the ranks, ``w_uv`` the capacity of the directed link ``u -> v`` in
buffers per cost unit (``w = 1 / c_e`` for a duplex link) and ``P_1, ..., P_q`` (``q >= 2``) vertex sets
whose rank sets ``A_i = P_i ∩ R`` partition ``R``; switches may lie in any number of the ``P_i`` or in
none. Then every allreduce of a buffer of size 1 in which switches (and non-rank devices) only forward
and every message is a function of one element (reductions, copies and partial sums; no coding across
elements) takes at least::

    T >= 2 (q - 1) / sum_i w_out(P_i)     and     T >= 2 (q - 1) / sum_i w_in(P_i),

where ``w_out(P)`` (``w_in(P)``) is the capacity of the links leaving (entering) ``P``. Maximising over
families gives the bound this module computes exactly::

    cut(G) = max over partitions {A_1..A_q} of R, q >= 2, of  2 (q - 1) / sum_i h(A_i),
    h(A) = min { w_out(X) : X ∩ R = A }   (a min cut between A and R \\ A; switches free),

and the same with ``w_in``; on duplex links both are equal.

Proof. Fix one element. Merge the ranks of each ``A_i`` into one node that adds and copies for free
(only helps the schedule). Each message is sent by one rank and received by another (switches forward
it along a route). One-way gossip among ``q`` nodes needs ``2 (q - 1)`` messages between different nodes:
let node ``z`` be the first to depend on every input, at message ``t``; each of the other ``q - 1`` nodes
must have sent a message at or before ``t`` (else ``z`` misses its inputs) and must receive one after
``t`` (only a message sent after ``z`` knows everything can complete it), and no message is both. A
message from ``A_i`` to ``A_j`` leaves ``P_i`` and enters ``P_j`` on its route, so it crosses the
out-boundary of some set once and the in-boundary of some set once; the out-boundaries carry at most
``T sum_i w_out(P_i)`` in time ``T`` (a link on several boundaries is counted once per boundary, as its
crossings are), which must be at least ``2 (q - 1)`` per unit of data. The restriction to forwarding
switches is what makes a message from ``A_i`` to ``A_j`` routed through a switch-only region count on
two boundaries; with aggregating switches only families covering every vertex are valid (the
``aggregation_cut`` of :mod:`gradsync.plan.limits`).

Consequences. On a switch-free graph the ``P_i`` cover the vertices and ``sum_i w(δ(P_i)) = 2 w(δ(P))``:
``cut`` is the Nash-Williams-Tutte optimum that the LP attains. ``h`` is submodular, so it is at least
the old partition bound (every family covering the vertices is admissible) and at most the LP optimum
(a mix of routed trees is such a schedule). Singletons give ``2 (N - 1) / (N deg)`` on regular fabrics
(``2 (N-1)/N`` on a fat tree with one NIC per host); the two-set family ``{box, rest}`` gives ``1 / h``.

Algorithm (exact, strongly polynomial apart from the integer max-flows). Dinkelbach on the ratio:
at ``lambda = H / (2 Q)`` (the ratio of the best family so far, ``H = sum h``, ``Q = q - 1``) minimise
``G(P) = Q sum_i h(A_i) - H (q - 1)`` over partitions; ``min G < 0`` gives a better family, ``min G = 0``
proves optimality. ``min_P sum_i (Q h(A_i) - H)`` is the Dilworth truncation of the submodular ``Q h - H``:
the greedy ``x_k = min { Q h(A) - H - x(A - r_k) : r_k ∈ A ⊆ {r_1..r_k} }`` attains it (each ``x_k`` is one
max-flow: ``r_k`` on the source side, later ranks on the sink side, earlier ranks priced by ``x_j``), and
the sets attaining each ``x_k``, merged where they intersect, are the minimising partition. Capacities
are scaled to integers exactly when they are commensurable (every built-in fabric), so every comparison
is exact; otherwise they are rounded and the family found is re-evaluated in floating point, which keeps
the bound valid (any family gives one) if possibly not maximal.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from gradsync.errors import PlanError
from gradsync.plan.unionfind import DisjointSets
from gradsync.topology.model import Topology

__all__ = ["CutBound", "cut_bound", "family_bound"]

#: scipy's max-flow works on int32 capacities; flows must stay below this.
_INT_LIMIT = 2**31 - 1
#: Largest common denominator tried for an exact integer scaling of the capacities.
_MAX_DENOMINATOR = 2**20


@dataclass(frozen=True)
class CutBound:
    """The bound, the rank partition attaining it and how it was found."""

    #: Lower bound on the allreduce cost (OMS units); 0 for a single rank.
    value: float
    #: Rank partition ``A_1..A_q`` attaining ``value`` (rank names).
    parts: tuple[tuple[str, ...], ...]
    #: ``"out"`` or ``"in"``: which boundary capacity binds (equal on duplex links; ``"out"`` then).
    direction: str
    #: Dinkelbach rounds and max-flows used.
    rounds: int
    flows: int
    #: True when capacities were scaled to integers exactly, so ``value`` is the exact maximum.
    exact: bool


class _Overflow(Exception):
    """An int32 capacity or flow would overflow: rescale and retry."""


class _Network:
    """The directed capacity graph with integer capacities, plus a source and a sink for the min cuts.

    Every min cut of the greedy joins the source ``s`` and the sink ``t`` to ranks only, so one sparse
    structure serves them all: the links' arcs, ``s -> r`` and ``r -> t`` for every rank, and every arc's
    reverse as an explicit zero. Each cut only writes capacities into it, and SciPy's max-flow returns its
    flow on the same structure, so the residual graph is one subtraction (the scipy.sparse constructors,
    not the flows, dominated the time of a fattree:16 bound: 1024 cuts).
    """

    def __init__(self, n: int, tails: np.ndarray, heads: np.ndarray, caps: np.ndarray, ranks: np.ndarray) -> None:
        keep = caps > 0
        self.n = n
        self.tails, self.heads, self.caps = tails[keep], heads[keep], caps[keep].astype(np.int64)
        self.ranks = ranks
        self.out_degree = np.bincount(self.tails, weights=self.caps, minlength=n).astype(np.int64)
        self.flows = 0
        s, t = n, n + 1
        width = n + 2
        from_s = s * width + ranks
        to_t = ranks * width + t
        arcs = self.tails * width + self.heads
        forward = np.concatenate([arcs, from_s, to_t])
        backward = np.concatenate([self.heads * width + self.tails, ranks * width + s, t * width + ranks])
        keys = np.unique(np.concatenate([forward, backward]))
        self.indices = (keys % width).astype(np.int32)
        self.indptr = np.searchsorted(keys // width, np.arange(width + 1)).astype(np.int32)
        self.nnz = len(keys)
        self.at_arc = np.searchsorted(keys, arcs)
        self.at_source = np.searchsorted(keys, from_s)
        self.at_sink = np.searchsorted(keys, to_t)
        self.rank_pos = np.full(n, -1, dtype=np.int64)
        self.rank_pos[ranks] = np.arange(len(ranks))

    def min_cut(self, scale: int, source: int, sinks: np.ndarray, gain_nodes: np.ndarray,
                gains: np.ndarray) -> tuple[int, np.ndarray]:
        """``min over X (source ∈ X, sinks ∉ X) of scale * w_out(X) - sum_{j ∈ X} gains_j`` (+ the positive gains).

        Returns the min-cut value ``scale * w_out(X) + sum_{j ∉ X, g_j > 0} g_j + sum_{j ∈ X, g_j < 0} -g_j``
        and the source side ``X`` as a boolean mask over the devices. ``source``, ``sinks`` and ``gain_nodes``
        must be disjoint sets of ranks.
        """
        n = self.n
        s, t = n, n + 1
        pos = gains > 0
        neg = gains < 0
        finite = scale * int(self.out_degree[source]) + int(gains[pos].sum())
        inf = finite + 1
        if inf >= _INT_LIMIT or scale * int(self.caps.max(initial=0)) >= _INT_LIMIT or int(np.abs(gains).max(initial=0)) >= _INT_LIMIT:
            raise _Overflow
        data = np.zeros(self.nnz, dtype=np.int64)
        data[self.at_arc] = self.caps * scale
        data[self.at_source[self.rank_pos[source]]] = inf
        data[self.at_sink[self.rank_pos[sinks]]] = inf
        data[self.at_source[self.rank_pos[gain_nodes[pos]]]] = gains[pos]
        data[self.at_sink[self.rank_pos[gain_nodes[neg]]]] = -gains[neg]
        data = data.astype(np.int32)
        graph = sp.csr_array((data, self.indices, self.indptr), shape=(n + 2, n + 2))
        graph.has_sorted_indices = True
        result = maximum_flow(graph, s, t)
        self.flows += 1
        flow = result.flow
        if flow.nnz == self.nnz and np.array_equal(flow.indices, self.indices):
            open_ = (data.astype(np.int64) - flow.data) > 0
        else:  # pragma: no cover - a SciPy whose flow has another structure: subtract as sparse matrices
            residual = (graph - flow).tocsr()
            residual.sort_indices()
            return int(result.flow_value), self._reachable(residual.data > 0, residual.indices, residual.indptr)[:n]
        return int(result.flow_value), self._reachable(open_, self.indices, self.indptr)[:n]

    def _reachable(self, open_: np.ndarray, indices: np.ndarray, indptr: np.ndarray) -> np.ndarray:
        """Vertices reachable from ``s`` along arcs with ``open_`` residual capacity."""
        counts = np.concatenate([[0], np.cumsum(open_)])
        residual = sp.csr_array((np.ones(int(open_.sum()), dtype=np.int8), indices[open_], counts[indptr]),
                                shape=(self.n + 2, self.n + 2))
        side = np.zeros(self.n + 2, dtype=bool)
        side[breadth_first_order(residual, self.n, directed=True, return_predecessors=False)] = True
        return side


def _integer_capacities(w: np.ndarray, budget: float) -> tuple[np.ndarray, int, bool]:
    """``(W, D, exact)`` with ``W = w * D`` integers: exact when ``w`` is commensurable within ``budget``."""
    positive = w[w > 0]
    denominator = 1
    exact = True
    for value in np.unique(positive):
        frac = Fraction(float(value)).limit_denominator(_MAX_DENOMINATOR)
        if abs(float(frac) - value) > 1e-12 * value:
            exact = False
            break
        denominator = math.lcm(denominator, frac.denominator)
        if denominator > _MAX_DENOMINATOR:
            exact = False
            break
    if exact:
        big = np.rint(w * denominator)
        if float(big.sum()) <= budget:
            return big.astype(np.int64), denominator, True
    scale = budget / float(w.sum())
    return np.where(w > 0, np.maximum(1, np.rint(w * scale)), 0).astype(np.int64), scale, False


def _dilworth(net: _Network, scale: int, offset: int) -> tuple[int, list[list[int]]]:
    """``min over partitions of R of sum_i (scale * h(A_i) - offset)`` by the greedy; returns it and the partition."""
    ranks = net.ranks
    n_ranks = len(ranks)
    x = np.zeros(n_ranks, dtype=np.int64)
    sets = DisjointSets(range(n_ranks))
    position = np.full(net.n, -1, dtype=np.int64)
    position[ranks] = np.arange(n_ranks)
    for k in range(n_ranks):
        earlier = ranks[:k]
        value, side = net.min_cut(scale, int(ranks[k]), ranks[k + 1:], earlier, x[:k])
        x[k] = value - int(x[:k][x[:k] > 0].sum()) - offset
        for j in position[side & (position >= 0)]:
            sets.union(int(j), k)
    groups: dict[int, list[int]] = {}
    for i in range(n_ranks):
        groups.setdefault(sets.find(i), []).append(i)
    return int(x.sum()), list(groups.values())


def _best_family(net: _Network) -> tuple[int, int, list[list[int]], int]:
    """Dinkelbach: the partition maximising ``2 Q / H``; returns ``H = sum h``, ``Q = q - 1``, parts, rounds."""
    n_ranks = len(net.ranks)
    # Start from the singletons {r} (a valid family whose boundaries are the ranks' own links).
    total = int(net.out_degree[net.ranks].sum())
    best_h, best_q = total, n_ranks - 1
    parts = [[i] for i in range(n_ranks)]
    rounds = 0
    while True:
        rounds += 1
        value, partition = _dilworth(net, best_q, best_h)
        # min over partitions of G = Q sum h - H (q - 1) equals value + H; the greedy's partition attains it.
        if value + best_h >= 0 or len(partition) < 2:
            return best_h, best_q, parts, rounds
        # Each part is tight: Q h(A) - H = x(A), so sum_i h(A_i) = (value + H q') / Q.
        q = len(partition)
        h_sum, rem = divmod(value + best_h * q, best_q)
        if rem:  # pragma: no cover - tight sets have integer cut values
            raise PlanError(f"cut bound: non-integer cut sum {value + best_h * q}/{best_q}; report this topology")
        if h_sum * best_q >= best_h * (q - 1):  # no strict improvement (cannot happen in exact arithmetic)
            return best_h, best_q, parts, rounds
        best_h, best_q, parts = h_sum, q - 1, partition


def _directed_weights(topology: Topology) -> np.ndarray:
    """``(m, 2)`` capacities of each link's directions ``a -> b`` and ``b -> a`` in buffers per cost unit."""
    return 1.0 / topology.directed_costs


def _network(topology: Topology, weights: np.ndarray, budget: float) -> tuple[_Network, float, bool]:
    index = topology.device_index
    a = np.array([index[lk.a] for lk in topology.links], dtype=np.int64)
    b = np.array([index[lk.b] for lk in topology.links], dtype=np.int64)
    caps, denominator, exact = _integer_capacities(weights.reshape(-1), budget)
    tails = np.stack([a, b], axis=1).reshape(-1)
    heads = np.stack([b, a], axis=1).reshape(-1)
    ranks = np.array([index[r] for r in topology.ranks], dtype=np.int64)
    return _Network(len(topology.devices), tails, heads, caps, ranks), denominator, exact


def family_bound(topology: Topology, sets: list[set[str]], weights: np.ndarray | None = None) -> float:
    """The theorem's bound ``2 (q - 1) / sum_i w_out(P_i)`` (and ``w_in``) for given vertex sets ``P_i``.

    Used to re-evaluate a family in floating point and by the tests; the rank sets of ``sets`` must
    partition the ranks.
    """
    weights = _directed_weights(topology) if weights is None else weights
    out_sum = in_sum = 0.0
    for members in sets:
        for lk, (ab, ba) in zip(topology.links, weights):
            if (lk.a in members) != (lk.b in members):
                out_sum += ab if lk.a in members else ba
                in_sum += ba if lk.a in members else ab
    q = len(sets)
    if q < 2:
        return 0.0
    return 2 * (q - 1) / min(out_sum, in_sum) if min(out_sum, in_sum) > 0 else math.inf


def _solve(topology: Topology, weights: np.ndarray, direction: str) -> CutBound:
    n_ranks = topology.world_size
    budget = _INT_LIMIT / (8.0 * n_ranks)  # keeps scale * capacities and the greedy's prices within int32
    while True:
        net, denominator, exact = _network(topology, weights, budget)
        try:
            h_sum, q_minus_1, parts, rounds = _best_family(net)
            break
        except _Overflow:
            budget /= 4
            if budget < 1:  # pragma: no cover - only absurd capacity spreads get here
                raise
    names = tuple(tuple(topology.ranks[i] for i in part) for part in parts)
    if exact:
        value = 2 * q_minus_1 * denominator / h_sum
    else:
        # Re-evaluate the family on the true capacities with each part's min-cut set.
        sets = []
        for part in parts:
            inside = np.zeros(n_ranks, dtype=bool)
            inside[part] = True
            members = [int(i) for i in net.ranks[inside]]
            if len(members) == 1:
                src = members[0]
                gains = np.zeros(0, dtype=np.int64)
                _, side = net.min_cut(1, src, net.ranks[~inside], net.ranks[:0], gains)
            else:
                # Tie the other members to the source with prices larger than any cut.
                big = np.full(len(members) - 1, int(net.caps.sum()) + 1, dtype=np.int64)
                _, side = net.min_cut(1, members[0], net.ranks[~inside], np.array(members[1:]), big)
            sets.append({topology.devices[i].name for i in np.flatnonzero(side)})
        value = family_bound(topology, sets, weights)
    return CutBound(value, names, direction, rounds, net.flows, exact)


@functools.lru_cache(maxsize=32)
def cut_bound(topology: Topology) -> CutBound:
    """The exact cut bound of the module docstring (max over the out- and in-boundary forms).

    Memoised per (immutable) topology: the tree packing stops on it and :func:`gradsync.plan.limits.limits`
    reports it, in the same ``gradsync plan``.
    """
    if topology.world_size < 2:
        return CutBound(0.0, (tuple(topology.ranks),), "out", 0, 0, True)
    weights = _directed_weights(topology)
    out = _solve(topology, weights, "out")
    if np.array_equal(weights[:, 0], weights[:, 1]):
        return out
    inward = _solve(topology, weights[:, ::-1].copy(), "in")
    return max(out, inward, key=lambda b: b.value)
