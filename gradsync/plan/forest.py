"""Allgather and reduce-scatter on any fabric: ForestColl's out-tree packing, exact (it meets the cut bound).

Units. The buffer is the full tensor (the allgather's output, the reduce-scatter's input), size 1; rank ``r``
owns the shard ``[r/N, (r+1)/N)``; ``w_uv = 1 / c_uv`` is the capacity of the directed link ``u -> v`` in
buffers per cost unit (:attr:`Topology.directed_costs`). A schedule's cost is ``max over link directions of
c * load``, as for allreduce, so ``S`` bytes take ``cost * S / unit_bw``.

Bound: :mod:`gradsync.plan.gather_bound` (the cut bound and its proof); :func:`gather_cut_bound` and the
rest of its public names are re-exported here.

Optimality. With every switch forwarding as much as enters it (duplex links), the bound is attained by
out-trees over the ranks whose edges are routed through switches (ForestColl Thm. 1: edge splitting at the
switches keeps every rank-to-rank connectivity, then Edmonds' branching theorem packs the trees). So
the LP below over routed out-arborescences has the bound as its optimum::

    min t  s.t.  sum_{T rooted at r} alpha_T = 1          for each root r   (dual mu_r)
                 (c_d / N) sum_T alpha_T L_dT <= t       for each link direction d  (dual y_d >= 0)

``L_dT`` = tree edges of ``T`` routed over direction ``d``; ``alpha_T`` = share of its root's shard on ``T``.
Column generation: the cheapest routed arborescence under prices ``p_d = y_d c_d / N`` is a minimum spanning
arborescence (Chu-Liu/Edmonds) of the shortest-path closure over the ranks (each edge's route is chosen
independently, so shortest paths are optimal); it enters when cheaper than ``mu_r``. For any ``y >= 0``
with ``sum y = 1``, ``t >= sum_d y_d c_d P_d >= sum_r min_T p·L_T`` (weak duality), a certified lower bound
at every round. Reduce-scatter packs the same LP on the reversed link directions and runs the trees
backwards (time-reversed, summing instead of copying), which loads each real direction exactly as the
reversed allgather does.

Symmetric fabrics (:func:`symmetric_arborescences`). The LP is invariant under every automorphism ``g``
of the topology (a device permutation mapping ranks to ranks and each link direction to one of equal
cost): ``alpha'_{gT} = alpha_T`` is feasible with the same ``t``, because ``g T`` is rooted at ``g(root)``
and loads ``g d`` as ``T`` loads ``d``. Let ``H`` be a group of automorphisms acting *regularly* on the
ranks (:func:`gradsync.plan.symmetry.regular_selection`: the whole fat-tree group, order ``N``; BCube's
digit additions, order ``n^k = N``), and ``g_r`` its one element with ``g_r(0) = r``. Averaging an optimum
over ``H`` keeps it optimal (the LP is convex), so some optimum is ``H``-invariant; its trees rooted at ``r``
are exactly ``g_r T`` for the trees ``T`` rooted at 0 (``g_r`` is the only element moving 0 to ``r``), with
``alpha_{g_r T} = alpha_T``. Direction ``d`` then carries::

    sum_r sum_{T at 0} alpha_T L_{d, g_r T} = sum_T alpha_T sum_{g in H} L_{g^-1 d, T}
                                            = sum_T alpha_T (N / |O|) L_O(T)

where ``O`` is the orbit of ``d`` under ``H`` and ``L_O(T) = |L_T ∩ O|`` counts the tree's routed edges
over the directions of ``O`` (``g^-1 d`` runs over ``O``, each direction ``|H| / |O| = N / |O|`` times).
All of ``O`` costs the same ``c_O``, so the LP reduces to the *orbit master* over trees rooted at 0::

    min t  s.t.  sum_T alpha_T = 1                                        (dual mu)
                 (c_O / N) sum_T alpha_T L_O(T) N / |O|  <= t   for each orbit O of directions (dual y_O)

(the coefficient of ``T`` in row ``O`` is ``c_O |L_T ∩ O| / |O|``; six rows on a fat tree, ``2 k`` on a
BCube). Pricing is one minimum arborescence rooted at 0 under ``p_d = y_O c_O / |O|`` for ``d`` in ``O``,
and weak duality again certifies ``t >= min_T p·L_T`` for any ``y >= 0`` summing to 1. The loop stops at
the cut bound; each master tree ``T`` is then copied to every root ``r`` as ``g_r T``. Any shortest-route
out-tree meets the bound on a fat tree (every route crosses each orbit at most once, so ``L_O(T) <= N - 1``,
and the bound is ``(N - 1) / N``), so there one tree per root suffices.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import dijkstra

from gradsync.errors import PlanError
from gradsync.plan.gather_bound import GatherBound, brute_force_gather_bound, gather_cut_bound
from gradsync.plan.highs import LAZY, highs_module, linprog, solve_optimal, warm_simplex
from gradsync.plan.schedule import Chunk, Schedule, Transfer, Tree
from gradsync.plan.symmetry import Symmetry, directed_link_permutation, orbits, regular_selection, symmetry_of
from gradsync.topology.model import Topology

_highs: Any = LAZY  # SciPy's highspy, imported at the first solve (tests set None: linprog only)

__all__ = [
    "Arborescence",
    "ForestPacking",
    "GatherBound",
    "arborescence_schedule",
    "brute_force_gather_bound",
    "forest_packing",
    "gather_cut_bound",
    "min_arborescence",
    "pack_arborescences",
    "reverse_schedule",
    "symmetric_arborescences",
]

# ---- minimum spanning arborescence (Chu-Liu/Edmonds, dense) ---------------------------------------------
def _cycles(parent: np.ndarray, root: int) -> list[np.ndarray]:
    """Every cycle of the functional graph ``v -> parent[v]`` (``root`` excluded), each as an array of nodes.

    By pointer doubling, no per-node Python: after ``2^k >= n`` steps every walk sits on a cycle (or the
    root), so the nodes on cycles are the image of ``parent^(2^k)``; a cycle is named by its smallest node,
    the minimum over ``2^k`` steps of the walk from any of its nodes.
    """
    n = len(parent)
    step = parent.copy()
    step[root] = root
    far = step.copy()
    lab = np.arange(n)
    jumps = max(1, int(np.ceil(np.log2(n))) + 1)
    for _ in range(jumps):
        lab = np.minimum(lab, lab[far])
        far = far[far]
    on = np.zeros(n, dtype=bool)
    on[far] = True
    on[root] = False
    nodes = np.flatnonzero(on)
    if not len(nodes):
        return []
    lab = lab[nodes]
    order = np.argsort(lab, kind="stable")
    nodes, lab = nodes[order], lab[order]
    cuts = np.flatnonzero(np.diff(lab)) + 1
    return np.split(nodes, cuts)


#: Up to this many nodes :func:`min_arborescence` runs on Python lists: on a few ranks (a DGX-1's 8) NumPy's
#: per-call overhead is most of the time, and a plan prices many trees.
SMALL_ARBORESCENCE = 12


def _min_arborescence_small(w: list[list[float]], root: int) -> list[int]:
    """Chu-Liu/Edmonds on a dense list-of-lists digraph, one cycle contracted per level (see the caller)."""
    n = len(w)
    inf = float("inf")
    parent = [-1] * n
    for v in range(n):
        if v != root:
            best, arg = inf, -1
            for u in range(n):
                if u != v and w[u][v] < best:
                    best, arg = w[u][v], u
            parent[v] = arg
    cycle: list[int] = []
    mark = [-1] * n  # the start of the walk that first visited each node
    for s in range(n):
        v = s
        while v != root and mark[v] < 0:
            mark[v] = s
            v = parent[v]
        if v != root and mark[v] == s:  # this walk closed a cycle through v
            cycle = [v]
            u = parent[v]
            while u != v:
                cycle.append(u)
                u = parent[u]
            break
    if not cycle:
        return parent
    on = set(cycle)
    rest = [v for v in range(n) if v not in on]
    label = [0] * n
    for i, v in enumerate(rest):
        label[v] = i
    c = len(rest)
    for v in cycle:
        label[v] = c
    m = c + 1
    w2 = [[inf] * m for _ in range(m)]
    arg: list[list[tuple[int, int]]] = [[(-1, -1)] * m for _ in range(m)]
    for u in range(n):
        a = label[u]
        row_u = w[u]
        for v in range(n):
            b = label[v]
            if a == b or u == v:
                continue
            cost = row_u[v] - w[parent[v]][v] if v in on else row_u[v]
            if cost < w2[a][b]:
                w2[a][b], arg[a][b] = cost, (u, v)
    p2 = _min_arborescence_small(w2, label[root])
    out = parent[:]
    for b in range(m):
        a = p2[b]
        if a >= 0:
            u, v = arg[a][b]
            out[v] = u  # into a contracted cycle: breaks it at v (its cycle edge into v goes)
    return out


def min_arborescence(weights: np.ndarray, root: int) -> np.ndarray:
    """``parent[v]`` of the minimum-weight spanning arborescence rooted at ``root`` (``parent[root] = -1``).

    ``weights[u, v]`` (finite) is the price of edge ``u -> v`` of a complete digraph. Chu-Liu/Edmonds: every
    node takes its cheapest entering edge; *all* cycles among them are contracted at once (an edge entering a
    cycle node v is priced ``w[u, v] - w[parent[v], v]``, the cycle edge it would replace) and the contracted
    problem's solution expanded: the edge chosen into a contracted cycle breaks it at its head. Contracting
    every cycle per level keeps the recursion shallow (a few levels instead of one per cycle), O(n²) each.
    """
    n = len(weights)
    w = np.array(weights, dtype=float)
    np.fill_diagonal(w, np.inf)
    w[:, root] = np.inf
    if n <= SMALL_ARBORESCENCE:
        return np.array(_min_arborescence_small(w.tolist(), root), dtype=np.int64)
    parent = np.argmin(w, axis=0)
    parent[root] = -1
    cycles = _cycles(parent, root)
    if not cycles:
        return parent
    in_cycle = np.zeros(n, dtype=bool)
    for c in cycles:
        in_cycle[c] = True
    rest = np.flatnonzero(~in_cycle)
    label = np.empty(n, dtype=np.int64)
    label[rest] = np.arange(len(rest))
    for k, c in enumerate(cycles):
        label[c] = len(rest) + k
    m = len(rest) + len(cycles)
    cyc_nodes = np.flatnonzero(in_cycle)
    adj = w.copy()
    adj[:, cyc_nodes] -= w[parent[cyc_nodes], cyc_nodes][None, :]
    # w2[a, b] = min over u in a, v in b (a != b) of adj[u, v]: columns of a cycle first, then rows.
    col = np.empty((n, m))
    col[:, : len(rest)] = adj[:, rest]
    for k, c in enumerate(cycles):
        col[:, len(rest) + k] = adj[:, c].min(axis=1)
    w2 = np.empty((m, m))
    w2[: len(rest)] = col[rest]
    row_arg = np.empty((m, m), dtype=np.int64)
    row_arg[: len(rest)] = rest[:, None]
    for k, c in enumerate(cycles):
        block = col[c]
        best = np.argmin(block, axis=0)
        w2[len(rest) + k] = block[best, np.arange(m)]
        row_arg[len(rest) + k] = c[best]
    np.fill_diagonal(w2, np.inf)
    p2 = min_arborescence(w2, int(label[root]))
    out = parent.copy()
    for b in range(m):
        a = int(p2[b])
        if a < 0:
            continue
        u = int(row_arg[a, b])
        if b < len(rest):
            out[rest[b]] = u
        else:
            c = cycles[b - len(rest)]
            v = int(c[np.argmin(adj[u, c])])  # the cycle node the chosen edge enters; its cycle edge goes
            out[v] = u
    return out


# ---- the packing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arborescence:
    """An out-tree over rank indices from ``root``; ``routes[i]`` is the device path of ``edges[i]`` (parent first)."""

    root: int
    edges: tuple[tuple[int, int], ...]
    routes: tuple[tuple[str, ...], ...]
    #: Tree edges routed over each link direction, ``(m, 2)``.
    loads: np.ndarray

    @property
    def key(self) -> tuple:
        return (self.root, tuple(sorted(self.routes)))


@dataclass(frozen=True)
class ForestPacking:
    """Weighted out-trees per root (weights of one root sum to 1), the cost and a certified lower bound."""

    cost: float
    lower_bound: float
    trees: tuple[tuple[float, Arborescence], ...]
    iterations: int
    columns: int
    #: True when planned on the reversed link directions (for a reduce-scatter).
    reversed: bool
    #: ``"lp"`` (one row per link direction, every root priced) or ``"symmetric"`` (orbit master, root 0).
    method: str = "lp"


class _Pricer:
    """Cheapest routed arborescence per root under directed link prices (one closure per price vector)."""

    def __init__(self, topology: Topology, reverse: bool) -> None:
        self.topology = topology
        idx = topology.device_index
        self.names = [d.name for d in topology.devices]
        self.a = np.array([idx[lk.a] for lk in topology.links], dtype=np.int64)
        self.b = np.array([idx[lk.b] for lk in topology.links], dtype=np.int64)
        self.term = np.array([idx[r] for r in topology.ranks], dtype=np.int64)
        self.reverse = reverse
        self._closure_id = -1
        self._routes: dict[tuple[int, int], tuple[tuple[str, ...], np.ndarray, np.ndarray]] = {}

    def closure(self, prices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rank-to-rank shortest distances and predecessors under ``prices`` ``(m, 2)`` (strictly positive)."""
        nd = len(self.names)
        rows = np.concatenate([self.a, self.b])
        cols = np.concatenate([self.b, self.a])
        graph = sp.csr_matrix((np.concatenate([prices[:, 0], prices[:, 1]]), (rows, cols)), shape=(nd, nd))
        dist, pred = dijkstra(graph, directed=True, indices=self.term, return_predecessors=True)
        return dist, pred

    def tree(self, root: int, dist: np.ndarray, pred: np.ndarray) -> Arborescence:
        """The cheapest tree from ``root`` under the closure ``(dist, pred)`` of :meth:`closure`."""
        if self._closure_id != id(pred):  # routes are per closure: a new one empties the cache
            self._closure_id, self._routes = id(pred), {}
        parent = min_arborescence(dist[:, self.term], root)
        edges, routes = [], []
        loads = np.zeros((len(self.topology.links), 2))
        for v in range(len(parent)):
            p = int(parent[v])
            if p < 0:
                continue
            got = self._routes.get((p, v))
            if got is None:
                path = [int(self.term[v])]
                while path[-1] != self.term[p]:
                    path.append(int(pred[p, path[-1]]))
                path.reverse()
                route = tuple(self.names[x] for x in path)
                hops = self.topology.route_links(route)
                got = self._routes[(p, v)] = (route, np.array([e for e, _ in hops]), np.array([d for _, d in hops]))
            route, es, ds = got
            edges.append((p, v))
            routes.append(route)
            np.add.at(loads, (es, ds), 1.0)
        return Arborescence(root, tuple(edges), tuple(routes), loads)


class _ForestMaster:
    """The restricted master of :func:`pack_arborescences` (module docstring), solved again after each batch of
    new columns: ``min t`` over ``[t, alpha]`` with one equality row per root and one ``<= 0`` row per link
    direction. One HiGHS instance keeps its optimal basis between solves (new columns enter at zero, so the
    basis stays primal feasible and primal simplex needs a few pivots): on a DGX-1's 8 ranks SciPy's
    ``linprog`` spent more time building and checking each of the 12 models than HiGHS spent solving them.
    Without SciPy's vendored ``highspy`` each solve is a fresh :func:`linprog`.
    """

    def __init__(self, n: int, flat_c: np.ndarray) -> None:
        self.n, self.flat_c = n, flat_c
        self.columns: list[Arborescence] = []
        self._pending: list[Arborescence] = []
        self._highs = warm_simplex(highs_module(_highs), self._build)

    def _build(self, h: Any) -> None:
        """The empty master in ``h``: the root and link rows, and the column ``t``."""
        n, rows = self.n, len(self.flat_c)
        inf = h.getInfinity()
        h.addRows(n, np.ones(n), np.ones(n), 0, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
        h.addRows(rows, np.full(rows, -inf), np.zeros(rows), 0, np.zeros(0, dtype=np.int32),
                  np.zeros(0, dtype=np.int32), np.zeros(0))
        # the column t: -1 in every link row
        h.addCols(1, np.ones(1), np.zeros(1), np.full(1, inf), rows, np.zeros(1, dtype=np.int32),
                  np.arange(n, n + rows, dtype=np.int32), -np.ones(rows))

    def add(self, tree: Arborescence) -> None:
        self.columns.append(tree)
        self._pending.append(tree)

    def solve(self) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
        """``(alpha, t, y, mu)``: tree weights, the cost, link-row duals (``>= 0``) and root-row duals."""
        n, rows = self.n, len(self.flat_c)
        if self._highs is None:
            k = len(self.columns)
            loads = np.stack([t.loads.reshape(-1) for t in self.columns], axis=1)  # (2m, k)
            a_ub = np.hstack([self.flat_c[:, None] * loads, -np.ones((rows, 1))])
            a_eq = np.zeros((n, k + 1))
            for j, t in enumerate(self.columns):
                a_eq[t.root, j] = 1.0
            res = linprog(np.r_[np.zeros(k), 1.0], A_ub=a_ub, b_ub=np.zeros(rows), A_eq=a_eq, b_eq=np.ones(n),
                          bounds=[(0, None)] * (k + 1), method="highs")
            if not res.success:  # pragma: no cover - always feasible: every root has a column
                raise PlanError(f"HiGHS failed on the out-tree packing master LP: {res.message}")
            return (np.asarray(res.x[:k]), float(res.x[k]), np.maximum(-np.asarray(res.ineqlin.marginals), 0.0),
                    np.asarray(res.eqlin.marginals))
        h = self._highs
        if self._pending:
            starts, idx, vals = [], [], []
            for t in self._pending:
                flat = t.loads.reshape(-1)
                nz = np.flatnonzero(flat)
                starts.append(len(idx))
                idx.extend([t.root, *(n + nz).tolist()])
                vals.extend([1.0, *(self.flat_c[nz] * flat[nz]).tolist()])
            k = len(self._pending)
            self._pending = []
            h.addCols(k, np.zeros(k), np.zeros(k), np.full(k, h.getInfinity()), len(idx),
                      np.array(starts, dtype=np.int32), np.array(idx, dtype=np.int32), np.array(vals))
        sol = solve_optimal(h, "out-tree packing master LP")
        x = np.asarray(sol.col_value, dtype=float)
        dual = np.asarray(sol.row_dual, dtype=float)
        return x[1:], float(x[0]), np.maximum(-dual[n:], 0.0), dual[:n]


def _unique_adder(columns: list[Arborescence]) -> Callable[[Arborescence], bool]:
    """``add(tree)``: append ``tree`` to ``columns`` unless an equal one (same root and routes) is there."""
    keys = {t.key for t in columns}

    def add(tree: Arborescence) -> bool:
        if tree.key in keys:
            return False
        keys.add(tree.key)
        columns.append(tree)
        return True

    return add


def _positive(prices: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Strictly positive prices; the tiny extra term prefers fast links and short routes on ties."""
    scale = float(prices.max()) if prices.size and prices.max() > 0 else 1.0
    return prices + 1e-9 * scale * costs / costs.max() + 1e-15


def pack_arborescences(topology: Topology, *, reverse: bool = False, tol: float = 1e-9,
                       max_iter: int = 2000) -> ForestPacking:
    """Solve the module docstring's LP by column generation; ``reverse`` plans on the reversed directions.

    Returns weighted arborescences whose allgather (or, reversed, reduce-scatter) cost is within ``tol``
    (relative) of the certified lower bound.
    """
    n = topology.world_size
    m = len(topology.links)
    if n < 2 or m == 0:
        return ForestPacking(0.0, 0.0, (), 0, 0, reverse)
    costs = topology.directed_costs[:, ::-1].copy() if reverse else topology.directed_costs.copy()
    pricer = _Pricer(topology, reverse)
    columns: list[Arborescence] = []
    add = _unique_adder(columns)

    # Warm start: every root's cheapest tree, then two greedy rounds that avoid the links already loaded.
    used = np.zeros((m, 2))
    for _ in range(3):
        dist, pred = pricer.closure(_positive(costs * (1.0 + costs * used), costs))
        for r in range(n):
            t = pricer.tree(r, dist, pred)
            used += t.loads / n
            add(t)
    flat_c = costs.reshape(-1) / n
    master = _ForestMaster(n, flat_c)
    lower, upper = 0.0, np.inf
    alpha = np.zeros(0)
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - reported after the loop
        for t in columns[len(master.columns):]:
            master.add(t)
        alpha, upper, y, mu = master.solve()
        y = y / y.sum() if y.sum() > 0 else np.full(2 * m, 1.0 / (2 * m))
        prices = (y * flat_c).reshape(m, 2)
        dist, pred = pricer.closure(_positive(prices, costs))
        bound = 0.0
        added = False
        for r in range(n):
            t = pricer.tree(r, dist, pred)
            value = float(prices.reshape(-1) @ t.loads.reshape(-1))
            bound += value
            if value < mu[r] - tol * max(abs(upper), 1e-300):
                added |= add(t)
        lower = max(lower, bound)
        if upper - lower <= tol * max(upper, 1e-300) or not added:
            break
    else:  # pragma: no cover
        raise PlanError(f"out-tree packing did not converge in {max_iter} iterations (gap {upper - lower:.3g})")
    keep = alpha > 1e-12
    trees: list[tuple[float, Arborescence]] = []
    for r in range(n):
        mine = [(float(a), t) for a, t, kp in zip(alpha, columns, keep) if kp and t.root == r]
        total = sum(a for a, _ in mine)
        trees += [(a / total, t) for a, t in mine]
    load = sum(a * t.loads for a, t in trees) / n
    cost = float((costs * load).max())
    return ForestPacking(cost, min(lower, cost), tuple(trees), it, len(columns), reverse)


# ---- symmetric fabrics ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    """The elements ``g_r`` (``g_r(rank 0) = rank r``) as device, rank and link-direction permutations."""

    devices: tuple[np.ndarray, ...]
    ranks: tuple[np.ndarray, ...]
    directions: tuple[np.ndarray, ...]
    #: Orbit of each link direction ``2 e + d`` under the group, and each orbit's size.
    orbit: np.ndarray
    size: np.ndarray


def _regular_group(topology: Topology, sym: Symmetry) -> _Group | None:
    """:func:`regular_selection`'s subgroup, indexed by the rank it moves rank 0 to; ``None`` if there is none."""
    steps = regular_selection(topology, sym)
    if steps is None:
        return None
    idx = topology.device_index
    term = np.array([idx[r] for r in topology.ranks], dtype=np.int64)
    rank_of = np.full(len(topology.devices), -1, dtype=np.int64)
    rank_of[term] = np.arange(len(term))
    devices, ranks, directions = {}, {}, {}
    for g in sym.elements(steps):
        mapped = directed_link_permutation(topology, g)
        if mapped is None:  # pragma: no cover - symmetry_of verified every generator
            return None
        rperm = rank_of[g[term]]
        r = int(rperm[0])
        devices[r], ranks[r], directions[r] = g, rperm, mapped
    orbit = orbits(2 * len(topology.links), list(directions.values()))  # of link directions
    order = range(topology.world_size)
    return _Group(tuple(devices[r] for r in order), tuple(ranks[r] for r in order),
                  tuple(directions[r] for r in order), orbit, np.bincount(orbit).astype(float))


def _images(tree: Arborescence, group: _Group, names: np.ndarray, idx: dict[str, int]) -> list[Arborescence]:
    """``g_r T`` for every root ``r``: routes mapped a route length at a time (one fancy index per length)."""
    order = sorted(range(len(tree.routes)), key=lambda i: len(tree.routes[i]))
    blocks = [np.array([[idx[d] for d in tree.routes[i]] for i in grp], dtype=np.int64)
              for _, grp in itertools.groupby(order, key=lambda i: len(tree.routes[i]))]
    parents = np.array([tree.edges[i][0] for i in order], dtype=np.int64)
    childs = np.array([tree.edges[i][1] for i in order], dtype=np.int64)
    flat = tree.loads.reshape(-1)
    out = []
    for dperm, rperm, lperm in zip(group.devices, group.ranks, group.directions):
        routes = tuple(itertools.chain.from_iterable(map(tuple, names[dperm[b]].tolist()) for b in blocks))
        edges = tuple(zip(rperm[parents].tolist(), rperm[childs].tolist()))
        loads = np.empty_like(flat)
        loads[lperm] = flat
        out.append(Arborescence(int(rperm[tree.root]), edges, routes, loads.reshape(tree.loads.shape)))
    return out


def symmetric_arborescences(topology: Topology, symmetry: Symmetry | None = None, *, reverse: bool = False,
                            target: float | None = None, tol: float = 1e-9, max_iter: int = 2000) -> ForestPacking:
    """The module docstring's LP on a fat tree or BCube through its automorphisms ("Symmetric fabrics").

    Column generation over out-trees rooted at rank 0 on the orbit master, stopping once the pricing bound or
    ``target`` meets the master (default target: :func:`gather_cut_bound`, computed only when the first pricing
    does not certify the master); every master tree is then copied to each root. Raises :class:`PlanError` when
    the topology has no verified symmetry acting regularly on its ranks (use :func:`pack_arborescences`).
    """
    sym = symmetry if symmetry is not None else symmetry_of(topology)
    group = _regular_group(topology, sym) if sym is not None and topology.links else None
    if group is None:
        raise PlanError(f"topology {topology.name!r} has no known symmetry acting regularly on its ranks (fat trees "
                        f"and BCubes only); use pack_arborescences")
    return _symmetric(topology, group, reverse=reverse, target=target, tol=tol, max_iter=max_iter)


def _symmetric(topology: Topology, group: _Group, *, reverse: bool, target: float | None, tol: float,
               max_iter: int) -> ForestPacking:
    n = topology.world_size
    m = len(topology.links)
    costs = topology.directed_costs[:, ::-1].copy() if reverse else topology.directed_costs.copy()
    flat = costs.reshape(-1)
    rows = len(group.size)
    c_orbit = np.zeros(rows)
    c_orbit[group.orbit] = flat
    if not np.allclose(c_orbit[group.orbit], flat, rtol=1e-12, atol=0.0):  # pragma: no cover - verified group
        raise PlanError(f"symmetry of {topology.name!r} maps a link direction onto one of another cost")
    pricer = _Pricer(topology, reverse)
    columns: list[Arborescence] = []
    add = _unique_adder(columns)

    def coefficients(tree: Arborescence) -> np.ndarray:
        """``c_O |L_T ∩ O| / |O|`` per orbit ``O``."""
        return c_orbit * np.bincount(group.orbit, weights=tree.loads.reshape(-1), minlength=rows) / group.size


    dist, pred = pricer.closure(_positive(costs.copy(), costs))
    add(pricer.tree(0, dist, pred))
    lower, upper = max(target or 0.0, 0.0), np.inf
    alpha = np.ones(1)
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - reported after the loop
        k = len(columns)
        a_ub = np.hstack([np.stack([coefficients(t) for t in columns], axis=1), -np.ones((rows, 1))])
        res = linprog(np.r_[np.zeros(k), 1.0], A_ub=a_ub, b_ub=np.zeros(rows), A_eq=np.r_[np.ones(k), 0.0][None, :],
                      b_eq=np.ones(1), bounds=[(0, None)] * (k + 1), method="highs")
        if not res.success:  # pragma: no cover - always feasible: one column and t free above
            raise PlanError(f"HiGHS failed on the symmetric out-tree packing master LP: {res.message}")
        alpha, upper = res.x[:k], float(res.x[k])
        if upper - lower <= tol * max(upper, 1e-300):
            break
        y = np.maximum(-np.asarray(res.ineqlin.marginals), 0.0)
        y = y / y.sum() if y.sum() > 0 else np.full(rows, 1.0 / rows)
        mu = float(np.asarray(res.eqlin.marginals)[0])
        prices = (y * c_orbit / group.size)[group.orbit].reshape(m, 2)
        dist, pred = pricer.closure(_positive(prices, costs))
        tree = pricer.tree(0, dist, pred)
        value = float(prices.reshape(-1) @ tree.loads.reshape(-1))
        lower = max(lower, value)
        if upper - lower <= tol * max(upper, 1e-300):
            break
        if target is None:  # the pricing did not certify the master; the cut bound may (on fat trees and BCubes
            # it is the optimum), so it is computed now rather than up front: N max-flows a round cost more than
            # the one pricing step that usually certifies the first master
            target = gather_cut_bound(topology, "reduce_scatter" if reverse else "allgather").value
            lower = max(lower, target)
            if upper - lower <= tol * max(upper, 1e-300):
                break
        if value >= mu - tol * max(abs(upper), 1e-300) or not add(tree):
            break
    else:  # pragma: no cover
        raise PlanError(f"symmetric out-tree packing did not converge in {max_iter} iterations "
                        f"(gap {upper - lower:.3g})")
    keep = alpha > 1e-12
    master = [(float(a), t) for a, t, kp in zip(alpha / alpha[keep].sum(), columns, keep) if kp]
    names = np.array(pricer.names, dtype=object)
    images = [(a, _images(t, group, names, topology.device_index)) for a, t in master]
    trees = tuple((a, copies[r]) for r in range(n) for a, copies in images)
    load = sum(a * t.loads for a, t in trees) / n
    cost = float((costs * load).max())
    return ForestPacking(cost, min(lower, cost), trees, it, len(columns), reverse, "symmetric")


def forest_packing(topology: Topology, reverse: bool = False) -> ForestPacking:
    """:func:`symmetric_arborescences` where a verified symmetry acts regularly on the ranks (fat trees and
    BCubes whose links are all as built), else :func:`pack_arborescences`."""
    sym = symmetry_of(topology) if topology.world_size >= 2 and topology.links else None
    group = _regular_group(topology, sym) if sym is not None else None
    if group is not None:
        return _symmetric(topology, group, reverse=reverse, target=None, tol=1e-9, max_iter=2000)
    return pack_arborescences(topology, reverse=reverse)


@functools.lru_cache(maxsize=32)
def optimal_forest(topology: Topology, reverse: bool = False) -> ForestPacking:
    """:func:`forest_packing` memoised per (immutable) topology and direction."""
    return forest_packing(topology, reverse)


# ---- schedules ------------------------------------------------------------------------------------------
def arborescence_schedule(algorithm: str, topology: Topology, trees: Sequence[tuple[float, Arborescence]],
                          pipeline: int, meta: dict | None = None) -> Schedule:
    """An allgather: root ``r``'s shard split over its trees by weight (each into ``pipeline`` sub-chunks),
    copied down every tree; a node sends at step = its depth, after its own copy arrived."""
    n = topology.world_size
    by_root: dict[int, list[tuple[float, Arborescence]]] = {r: [] for r in range(n)}
    for w, t in trees:
        by_root[t.root].append((w, t))
    chunks: list[Chunk] = []
    transfers: list[Transfer] = []
    provenance: list[Tree] = []
    for r in range(n):
        mine = [(w, t) for w, t in by_root[r] if w > 0]
        if not mine:
            raise PlanError(f"no out-tree for rank {r}: an allgather needs every rank's shard sent")
        offset = r / n
        for j, (w, t) in enumerate(mine):
            depth = {r: 0}
            children: dict[int, list[tuple[int, tuple[str, ...]]]] = {}
            for (p, c), route in zip(t.edges, t.routes):
                children.setdefault(p, []).append((c, route))
            order = [r]
            for v in order:
                for c, _ in children.get(v, []):
                    depth[c] = depth[v] + 1
                    order.append(c)
            if len(order) != n:
                raise PlanError(f"out-tree of rank {r} reaches {len(order)} of {n} ranks")
            for s in range(pipeline):
                last = j == len(mine) - 1 and s == pipeline - 1
                size = ((r + 1) / n - offset) if last else w / n / pipeline
                cid = len(chunks)
                chunks.append(Chunk(offset, size, r))
                offset += size
                for (p, c), route in zip(t.edges, t.routes):
                    transfers.append(Transfer(cid, p, c, route, False, depth[p]))
            provenance.append(Tree(w / n, r, tuple((c, p) for p, c in t.edges),
                                   tuple(tuple(reversed(rt)) for rt in t.routes)))
    return Schedule(algorithm, topology.name, topology.ranks, tuple(chunks), tuple(transfers),
                    collective="allgather", trees=tuple(provenance), meta=dict(meta or {}))


def reverse_schedule(schedule: Schedule) -> Schedule:
    """The reduce-scatter that runs an allgather backwards: every transfer reversed in time and direction,
    and summed instead of copied (each tree edge then carries a partial sum toward the shard's owner)."""
    if schedule.collective != "allgather":
        raise PlanError(f"only an allgather reverses into a reduce-scatter; this is a {schedule.collective!r}")
    top = schedule.num_steps - 1
    transfers = tuple(Transfer(t.chunk, t.dst, t.src, tuple(reversed(t.route)), True, top - t.step, t.priority)
                      for t in schedule.transfers)
    return Schedule(schedule.algorithm, schedule.topology, schedule.ranks, schedule.chunks, transfers,
                    collective="reduce_scatter", trees=schedule.trees, meta=dict(schedule.meta))
