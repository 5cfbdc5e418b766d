"""OMS's optimal multi-tree schedule: an LP over the spanning-tree polytope, solved exactly.

Problem (OMS eq. 2, extended to switches as in its §3)::

    C(G) = min_{alpha >= 0, sum_T alpha_T = 1}  max_e  c_e * P_e,      P_e = sum_T alpha_T * L_eT

where ``T`` ranges over routed spanning trees of the ranks (see :mod:`gradsync.plan.trees`), ``L_eT`` is
the number of tree edges routed across link ``e`` and ``c_e = unit_bw / bw_e``. On a switch-free graph
``L_eT`` is the 0/1 incidence vector and this is exactly OMS's LP on the spanning-tree polytope.

Column generation. The restricted master over a few trees is the LP

    min t   s.t.   sum_T c_e L_eT alpha_T - t <= 0   (dual y_e >= 0)      for every link e
                   sum_T alpha_T = 1                 (dual mu)

whose dual is ``max mu  s.t.  mu <= sum_e y_e c_e L_eT  for all T,  sum_e y_e = 1``. Given the master's
duals ``y``, the *pricing* problem ``min_T sum_e (y_e c_e) L_eT`` is a cheapest routed tree, solved exactly
(shortest paths + MST). If its value is below ``mu`` the tree enters the master; otherwise the master is
optimal. At every iteration the pricing value is a valid lower bound (weak duality: for any schedule,
``max_e c_e P_e >= sum_e y_e c_e P_e >= min_T sum_e y_e c_e L_eT`` because ``sum y = 1``), so the loop stops
with a certified gap ``(upper - lower) / upper <= tol``. The exact cut bound of :mod:`gradsync.plan.cut_bound`
is a lower bound too (it holds for every schedule whose switches only forward, mixes of routed trees
included) and equals the optimum on switch-free graphs, fat trees and BCubes, so the loop also stops
as soon as the master meets it.

The master is solved in packing form by one HiGHS instance kept across iterations (see :class:`_Master`).
Far from the optimum its interior-point solution is used: central duals price trees that improve the
master much more than a vertex's duals do (23 instead of 55 solves on a random 6-regular graph of 128
nodes); near it, primal simplex finishes from the previous basis at a vertex, which holds few trees.

Methods (:func:`optimal_packing` picks one; both report the bound they certify):

* ``lp`` (:func:`pack_trees`): the column generation above over one row per link. Exact
  (gap ``<= 1e-9``); used wherever no symmetry is known.
* ``symmetric`` (:func:`symmetric_packing`): fat trees and BCubes, whose automorphism group ``H`` (of
  order ``N`` or ``k N``, :mod:`gradsync.plan.symmetry`) reduces the master to one row per link orbit
  (three or one). Seed trees meet the cut bound at once; otherwise the same column generation runs on
  the orbit rows. The LP optimum is the orbit master's, attained by giving each image ``g T`` of each
  master tree the weight ``alpha_T / |H|``. Fewer images often do as well (``N / 2`` on a fat tree), so
  the images are taken over the smallest selection of powers of ``H``'s cyclic factors whose mix meets
  the lower bound, as long as its tree edges (``trees x (N - 1)``) fit :data:`MAX_TREE_EDGES`; past that,
  the cheapest selection that fits, its gap to the cut bound certified (fat trees: one Hamiltonian path,
  gap ``1 / (N - 1)``; BCube(n, k): ``k`` torus trees, the same gap).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradsync.errors import PlanError
from gradsync.plan.cut_bound import cut_bound
from gradsync.plan.highs import LAZY, highs_module, linprog, solve_optimal, warm_simplex
from gradsync.plan.symmetry import Symmetry, link_permutation, orbits, symmetry_of
from gradsync.plan.trees import RoutedTree, TreePricer
from gradsync.plan.unionfind import DisjointSets
from gradsync.topology.model import Topology

_highs: Any = LAZY  # SciPy's highspy, imported at the first solve (tests set None: linprog only)

__all__ = [
    "MAX_TREE_EDGES",
    "TreePacking",
    "bottleneck_tree",
    "optimal_packing",
    "pack_trees",
    "partition_bound",
    "symmetric_packing",
]

#: Relative gap below which column generation switches from interior-point to simplex masters.
_POLISH = 1e-6
#: Largest ``trees x (N - 1)`` (routed tree edges) a symmetric packing expands to; schedules hold as many.
#: fattree:16's 512 images of a 1023-edge path (0.52 M edges, ~90 MB of routes) fit; fattree:24's 1728
#: (6 M) do not, and one path (gap 1 / 3455) is planned instead.
MAX_TREE_EDGES = 1_500_000


@dataclass(frozen=True)
class TreePacking:
    """Result of :func:`pack_trees` or :func:`symmetric_packing`: weighted routed trees, their cost and a
    certified lower bound on the LP optimum (hence on every schedule whose switches only forward)."""

    cost: float
    lower_bound: float
    trees: tuple[tuple[float, RoutedTree], ...]
    iterations: int
    columns: int
    #: Final dual prices per link (sum 1): the LP certificate behind ``lower_bound`` (with the cut bound).
    duals: np.ndarray
    #: ``"lp"`` (column generation over links) or ``"symmetric"`` (over link orbits, trees expanded).
    method: str = "lp"
    #: How many images of each master tree the packing holds (1 for ``lp``; ``|H|`` when fully expanded).
    images: int = 1

    @property
    def loads(self) -> np.ndarray:
        """``P_e``: expected number of tree edges crossing each link."""
        out = np.zeros_like(self.duals)
        for w, t in self.trees:
            out += w * t.loads
        return out

    @property
    def gap(self) -> float:
        """``cost / lower_bound - 1``: how far from optimal the packing can be (0: provably optimal)."""
        return self.cost / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0


def _floor(weights: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Strictly positive prices; the tiny extra term breaks ties toward fast links and short routes."""
    if not costs.size:  # no links (a single rank): nothing to price
        return weights.copy()
    scale = float(weights.max()) if weights.size and weights.max() > 0 else 1.0
    return weights + 1e-9 * scale * costs / costs.max() + 1e-15


def partition_bound(topology: Topology, part_of: dict[str, int]) -> float:
    """Nash-Williams-Tutte bound of one partition of the devices: ``(p - 1) / sum_{e crossing} 1/c_e``.

    Every part must hold a rank. Any schedule, whatever switches can do, moves each element across the
    partition at least ``p - 1`` times in each direction (reduce out of every part but the root's, broadcast
    into every part but the root's), so ``max_e c_e P_e >= (p - 1) / sum_{crossing} c_e^-1``.
    """
    parts = {part_of[r] for r in topology.ranks}
    if parts != set(part_of.values()):
        raise PlanError("every part of a partition bound must contain a rank")
    # Each direction's crossings need p - 1 per element, so the two directions' mean capacity is what counts.
    mean = (1.0 / topology.directed_costs).mean(axis=1) if topology.links else np.zeros(0)
    cross = sum(w for lk, w in zip(topology.links, mean) if part_of[lk.a] != part_of[lk.b])
    return (len(parts) - 1) / cross if cross > 0 else 0.0


def _slack_partition_bound(topology: Topology, loads: np.ndarray, cost: float) -> float:
    """Bound of the partition into components of links that are *not* saturated at ``cost``.

    At an optimum every link crossing the optimal Nash-Williams-Tutte partition is saturated, so these
    components refine it and very often attain it; it costs one union-find, not a solve.
    """
    parts = DisjointSets(d.name for d in topology.devices)
    for lk, load, c in zip(topology.links, loads, topology.costs):
        if c * load < cost * (1 - 1e-7):
            parts.union(lk.a, lk.b)
    roots = {parts.find(d.name) for d in topology.devices}
    label = {r: i for i, r in enumerate(sorted(roots))}
    part_of = {d.name: label[parts.find(d.name)] for d in topology.devices}
    if {part_of[r] for r in topology.ranks} != set(part_of.values()):
        return 0.0
    return partition_bound(topology, part_of)


def bottleneck_tree(topology: Topology) -> RoutedTree:
    """The minimum-weight spanning tree by ``c_e``, which also minimises its slowest link (C(T_MWST)).

    MSTs are minimax: on a switch-free graph no spanning tree has a smaller maximum ``c_e``.
    """
    costs = topology.costs
    return TreePricer(topology).cheapest(_floor(costs.copy(), costs))


class _Master:
    """The restricted master in packing form: ``max sum_T a_T  s.t.  sum_T A_rT a_T <= b_r,  a >= 0``.

    Rows ``r`` are links (``A_rT = L_eT``, ``b_e = 1/c_e``) or link orbits (``A_OT = L_O(T) / |O|``).
    With ``lam`` its optimum, ``alpha = a / lam`` is the min-max master's optimum and ``t = 1 / lam``
    (several times faster than the min-max form: no dense ``t`` column, no equality row). Its duals
    ``u >= 0`` price a tree at ``sum_r u_r A_rT``: a column improves iff that is below 1, and the min-max
    duals are ``y_r = u_r b_r / lam`` (they sum to 1 by strong duality).

    One HiGHS instance keeps the optimal basis between solves: adding columns leaves it primal feasible,
    so each re-solve is a few primal simplex pivots. Without SciPy's vendored highspy each solve starts
    from scratch with :func:`scipy.optimize.linprog`.
    """

    def __init__(self, capacity: np.ndarray) -> None:
        self.capacity = np.asarray(capacity, dtype=float)
        self.columns: list[np.ndarray] = []
        self._pending: list[np.ndarray] = []
        self._highs = warm_simplex(highs_module(_highs), self._build)

    def _build(self, h: Any) -> None:
        """The empty master in ``h`` (rows only; columns come later)."""
        h.setOptionValue("run_crossover", "off")
        # A loose interior point is cheaper and its duals more central: 1e-6 took much less time than the
        # default 1e-8 on random 6-regular graphs of 64 to 256 nodes. Simplex polishes the end.
        h.setOptionValue("ipm_optimality_tolerance", 1e-6)
        rows = len(self.capacity)
        h.addRows(rows, np.full(rows, -h.getInfinity()), self.capacity, 0, np.zeros(0, dtype=np.int32),
                  np.zeros(0, dtype=np.int32), np.zeros(0))
        h.changeObjectiveSense(highs_module(_highs).ObjSense.kMaximize)

    def add(self, column: np.ndarray) -> None:
        self.columns.append(column)
        self._pending.append(column)

    def solve(self, exact: bool) -> tuple[np.ndarray, float, np.ndarray]:
        """``(a, lam, u)``: column values, objective and row duals; ``exact``: a simplex vertex, else the
        interior point method's solution (no crossover, optimal to ~1e-6), far cheaper here."""
        if self._highs is None:
            k = len(self.columns)
            res = linprog(-np.ones(k), A_ub=np.stack(self.columns, axis=1), b_ub=self.capacity, bounds=(0, None),
                          method="highs-ds" if exact else "highs-ipm", options={"presolve": False})
            if not res.success:  # pragma: no cover - the packing LP is always feasible and bounded
                raise PlanError(f"HiGHS failed on the tree-packing master LP: {res.message}")
            return np.asarray(res.x), -float(res.fun), np.maximum(-np.asarray(res.ineqlin.marginals), 0.0)
        h = self._highs
        if self._pending:
            block = np.stack(self._pending, axis=1)
            self._pending = []
            nz = block != 0
            starts = np.concatenate([[0], np.cumsum(nz.sum(axis=0))[:-1]]).astype(np.int32)
            rows = np.nonzero(nz.T)[1].astype(np.int32)
            values = block.T[nz.T]
            k = block.shape[1]
            h.addCols(k, np.ones(k), np.zeros(k), np.full(k, h.getInfinity()), len(values), starts, rows, values)
        h.setOptionValue("solver", "simplex" if exact else "ipm")
        sol = solve_optimal(h, "tree-packing master LP", simplex_retry=not exact)  # IPM may stall: then simplex
        return (np.asarray(sol.col_value, dtype=float), float(h.getInfo().objective_function_value),
                np.maximum(np.asarray(sol.row_dual, dtype=float), 0.0))


@dataclass(frozen=True)
class _Rows:
    """Rows of the master: ``row[e]`` is the row of link ``e``; ``size[r]`` links share row ``r``."""

    row: np.ndarray
    size: np.ndarray

    @classmethod
    def links(cls, m: int) -> _Rows:
        return cls(np.arange(m), np.ones(m))

    def column(self, loads: np.ndarray) -> np.ndarray:
        """``A_rT``: the tree's loads summed over each row's links, divided by their number."""
        return np.bincount(self.row, weights=loads, minlength=len(self.size)) / self.size

    def per_link(self, values: np.ndarray) -> np.ndarray:
        return values[self.row]


class _GreedyPacker:
    """Warm-start columns: each new tree avoids the links the earlier ones loaded (additive greedy packing).

    Column generation alone adds one tree per master solve and tails off on dense graphs (hundreds of
    solves on a 32-clique). A spread of trees that covers every link evenly lets HiGHS find the optimal
    mix in a few solves; the pricing step then only has to certify it.
    """

    def __init__(self, topology: Topology, pricer: TreePricer) -> None:
        self.topology = topology
        self.pricer = pricer
        self.loads = np.zeros(len(topology.links))

    def take(self, count: int) -> list[RoutedTree]:
        costs = self.topology.costs
        out = []
        for _ in range(count):
            tree = self.pricer.cheapest(_floor(costs * (1.0 + costs * self.loads), costs))
            self.loads += tree.loads
            out.append(tree)
        return out


@dataclass(frozen=True)
class _Solution:
    trees: list[tuple[float, RoutedTree]]
    upper: float
    lower: float
    duals: np.ndarray
    iterations: int
    columns: int


def _column_generation(topology: Topology, pricer: TreePricer, rows: _Rows, initial: Sequence[RoutedTree], *,
                       target: float, tol: float, max_iter: int, smoothing: float,
                       greedy: _GreedyPacker | None, batch: int, interior: bool) -> _Solution:
    """The loop of the module docstring on ``rows``; stops at gap ``tol`` or once the master meets ``target``.

    ``interior``: solve masters by the interior point method until the gap is below ``_POLISH`` (or the
    interior duals price no new tree), then by simplex; without it, simplex throughout (tiny orbit masters).

    ``smoothing`` is Wentges' dual stabilisation: each round also prices at ``s * best_duals + (1 - s) * y``,
    which damps the oscillation of ``y`` that makes plain column generation tail off.
    """
    costs = topology.costs
    capacity = 1.0 / np.bincount(rows.row, weights=costs, minlength=len(rows.size)) * rows.size
    master = _Master(capacity)
    columns: list[RoutedTree] = []
    keys: set[tuple] = set()

    def add(tree: RoutedTree) -> bool:
        if tree.key in keys:
            return False
        keys.add(tree.key)
        columns.append(tree)
        master.add(rows.column(tree.loads))
        return True

    for tree in initial:
        add(tree)
    lower = max(target, 0.0)
    upper = np.inf
    alpha = np.ones(1)
    y = np.full(len(costs), 1.0 / len(costs))
    centre = y
    it = 0
    # Interior duals are central: their trees improve the master much more than a vertex's (a third of the
    # solves on random graphs). Once close, or when they stop helping, simplex finishes at a vertex (few trees).
    exact = not interior
    for it in range(1, max_iter + 1):  # noqa: B007 - `it` is reported after the loop
        a, lam, u = master.solve(exact)
        alpha, upper = a / lam, 1.0 / lam
        # Per-link min-max duals: y_e = u_r b_r / (lam |r|) spreads row r's dual evenly over its links. They sum
        # to 1 at an exact optimum; an interior solution's only nearly, and the pricing bound needs exactly 1.
        y = rows.per_link(u * capacity / rows.size)
        y = y / y.sum() if y.sum() > 0 else np.full(len(costs), 1.0 / len(costs))
        if upper - lower > tol * upper:
            mix = rows.per_link(sum(w * rows.column(t.loads) for w, t in zip(alpha, columns) if w > 0))
            lower = max(lower, _slack_partition_bound(topology, mix, upper))
        if upper - lower <= tol * upper:
            if exact:
                break
            exact = True  # met the bound: only the vertex solution is missing
            continue
        if not exact and upper - lower <= _POLISH * upper:
            exact = True
            continue
        added = False
        for prices in (y, smoothing * centre + (1.0 - smoothing) * y):
            tree = pricer.cheapest(_floor(prices * costs, costs))
            value = float((prices * costs) @ tree.loads)  # a valid lower bound: prices >= 0 sum to 1
            if value > lower:
                lower, centre = value, prices
            if float((y * costs) @ tree.loads) < upper * (1 - tol):
                added |= add(tree)
        if not exact and not added:
            exact = True
            continue
        if upper - lower <= tol * upper or not added:
            break
        if greedy is not None:
            for tree in greedy.take(batch):
                add(tree)
    else:  # pragma: no cover
        raise PlanError(f"tree packing did not converge in {max_iter} iterations (gap {upper - lower:.3g})")
    keep = alpha > 1e-12
    weights = alpha[keep] / alpha[keep].sum()
    trees = list(zip(weights.tolist(), [t for t, k in zip(columns, keep) if k]))
    return _Solution(trees, float(upper), float(lower), y, it, len(columns))


def _trivial(topology: Topology) -> TreePacking:
    m = len(topology.links)
    return TreePacking(0.0, 0.0, ((1.0, RoutedTree((), (), np.zeros(m))),), 0, 1, np.zeros(m))


def pack_trees(topology: Topology, *, tol: float = 1e-9, max_iter: int = 10_000, smoothing: float = 0.5,
               target: float | None = None) -> TreePacking:
    """Solve the multi-tree LP exactly by column generation over one row per link (module docstring).

    ``tol`` is the relative gap between the schedule's cost and the certified lower bound at which to stop.
    ``target`` is a known lower bound (the cut bound): the loop stops as soon as the master meets it.
    """
    costs = topology.costs
    m = len(costs)
    n = topology.world_size
    if n == 1 or m == 0:
        return _trivial(topology)
    pricer = TreePricer(topology)
    greedy = _GreedyPacker(topology, pricer)
    batch = int(np.ceil(m / max(n - 1, 1)))  # trees needed to touch every link about once
    initial = [pricer.cheapest(_floor(costs.copy(), costs)), *greedy.take(4 * batch)]
    sol = _column_generation(topology, pricer, _Rows.links(m), initial, target=target or 0.0, tol=tol,
                             max_iter=max_iter, smoothing=smoothing, greedy=greedy, batch=batch, interior=True)
    # Recompute the cost of the renormalised mix so that `cost` is exactly what the trees achieve.
    loads = sum(w * t.loads for w, t in sol.trees)
    cost = float((costs * loads).max())
    return TreePacking(cost, min(sol.lower, cost), tuple(sol.trees), sol.iterations, sol.columns, sol.duals)


# ---- symmetric fabrics -------------------------------------------------------------------------------------------
def _orbits(topology: Topology, link_generators: Sequence[np.ndarray]) -> _Rows:
    """Link orbits of the group generated by ``link_generators``, one master row each."""
    row = orbits(len(topology.links), link_generators)
    return _Rows(row, np.bincount(row).astype(float))


class _Images:
    """Images ``g T`` of one routed tree under group elements given as device, rank and link permutations.

    The tree's edges are reordered by route length once, so an image's routes are a few fancy-indexing
    calls (one per length) rather than a Python loop over devices; rank ids come from one shared list, so
    a thousand images of a thousand-edge tree do not allocate a million int objects.
    """

    def __init__(self, topology: Topology, pricer: TreePricer, tree: RoutedTree) -> None:
        idx = topology.device_index
        self.names = pricer.names
        self.ranks = np.array(list(range(topology.world_size)), dtype=object)
        self.loads = tree.loads
        order = sorted(range(len(tree.routes)), key=lambda i: len(tree.routes[i]))
        self.u = np.array([tree.edges[i][0] for i in order], dtype=np.int64)
        self.v = np.array([tree.edges[i][1] for i in order], dtype=np.int64)
        self.groups: list[np.ndarray] = []
        for _, members in itertools.groupby(order, key=lambda i: len(tree.routes[i])):
            self.groups.append(np.array([[idx[d] for d in tree.routes[i]] for i in members], dtype=np.int64))

    def image_loads(self, lperm: np.ndarray) -> np.ndarray:
        out = np.empty_like(self.loads)
        out[lperm] = self.loads
        return out

    def image(self, dperm: np.ndarray, rperm: np.ndarray, lperm: np.ndarray) -> RoutedTree:
        routes = tuple(itertools.chain.from_iterable(map(tuple, self.names[dperm[g]].tolist()) for g in self.groups))
        edges = tuple(zip(self.ranks[rperm[self.u]].tolist(), self.ranks[rperm[self.v]].tolist()))
        return RoutedTree(edges, routes, self.image_loads(lperm))


def symmetric_packing(topology: Topology, symmetry: Symmetry | None = None, *, target: float | None = None,
                      tol: float = 1e-9, max_iter: int = 10_000,
                      max_tree_edges: int = MAX_TREE_EDGES) -> TreePacking:
    """The LP on a fat tree or BCube through its automorphism group (module docstring, ``symmetric``).

    Column generation runs on the orbit master, seeded with the group's seed trees, and stops as soon as
    it meets ``target`` (default: the exact cut bound). Each master tree ``T`` of weight ``alpha_T`` then
    becomes its images ``g T`` over a selection ``S`` of group elements (:meth:`Symmetry.selections`), each
    with weight ``alpha_T / |S|``: the smallest selection whose mix meets the lower bound, or, when none
    that fits ``max_tree_edges`` does (the identity alone always fits), the cheapest that fits. With
    ``S = H`` the cost is the LP optimum, so that selection meets the bound whenever it fits.
    """
    sym = symmetry if symmetry is not None else symmetry_of(topology)
    if sym is None:
        raise PlanError(f"topology {topology.name!r} has no known symmetry (fat trees and BCubes only); "
                        f"use pack_trees")
    costs = topology.costs
    n = topology.world_size
    if n == 1 or not len(costs):
        return _trivial(topology)
    if target is None:
        target = cut_bound(topology).value
    pricer = TreePricer(topology)
    link_gens = []
    for g in sym.generators:
        mapped = link_permutation(topology, g)
        if mapped is None:
            raise PlanError(f"symmetry {sym.name!r} does not map the links of {topology.name!r} onto themselves")
        link_gens.append(mapped[0])
    rank_gens = [pricer.rank_of[g[pricer.terminals]] for g in sym.generators]
    rows = _orbits(topology, link_gens)
    base = _floor(costs.copy(), costs)
    seeds = [pricer.shortest_tree(base, s) for s in sym.seeds] or [pricer.cheapest(base)]
    sol = _column_generation(topology, pricer, rows, seeds, target=target, tol=tol, max_iter=max_iter,
                             smoothing=0.5, greedy=None, batch=0, interior=False)
    images = [(w, _Images(topology, pricer, t)) for w, t in sol.trees]
    floor = max(sol.lower, target) * (1 + 1e-12)
    best: tuple[float, tuple[int, ...]] | None = None
    for steps in sym.selections():  # fewest images first: the first that meets the bound is the one
        count = len(images) * sym.size(steps)
        if best is not None and count * (n - 1) > max_tree_edges:
            break
        loads = np.zeros(len(costs))
        for lperm in sym.elements(steps, link_gens):
            for w, im in images:
                loads += w * im.image_loads(lperm)
        cost = float((costs * loads).max()) / sym.size(steps)
        if best is None or cost < best[0] * (1 - 1e-12):
            best = (cost, steps)
        if cost <= floor:
            break
    steps = best[1] if best is not None else sym.selections()[0]
    share = 1.0 / sym.size(steps)
    trees = []
    for dperm, rperm, lperm in zip(sym.elements(steps), sym.elements(steps, rank_gens),
                                   sym.elements(steps, link_gens)):
        for w, im in images:
            trees.append((w * share, im.image(dperm, rperm, lperm)))
    loads = sum(w * t.loads for w, t in trees)
    cost = float((costs * loads).max())
    return TreePacking(cost, min(sol.lower, cost), tuple(trees), sol.iterations, sol.columns, sol.duals,
                       method="symmetric", images=sym.size(steps))


@functools.lru_cache(maxsize=32)
def optimal_packing(topology: Topology) -> TreePacking:
    """The packing ``gradsync plan`` uses, memoised per (immutable) topology (module docstring, "Methods").

    ``symmetric`` where :func:`gradsync.plan.symmetry.symmetry_of` finds a verified group (fat trees,
    BCubes), else ``lp``; both stop once they meet the exact cut bound. The ``lp`` and ``tree``
    synthesizers and :func:`gradsync.plan.limits.limits` all need the same packing; one ``gradsync plan``
    would otherwise solve the LP two or three times.
    """
    if topology.world_size == 1 or not topology.links:
        return _trivial(topology)
    target = cut_bound(topology).value
    sym = symmetry_of(topology)
    if sym is not None:
        return symmetric_packing(topology, sym, target=target)
    return pack_trees(topology, target=target)
