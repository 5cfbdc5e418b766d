"""The seed's optimal multi-tree schedule: an LP over the spanning-tree polytope, solved exactly.

Problem (seed 000 eq. 2, extended to switches as in its §3)::

    C(G) = min_{alpha >= 0, sum_T alpha_T = 1}  max_e  c_e * P_e,      P_e = sum_T alpha_T * L_eT

where ``T`` ranges over routed spanning trees of the ranks (see :mod:`gradsync.plan.trees`), ``L_eT`` is
the number of tree edges routed across link ``e`` and ``c_e = unit_bw / bw_e``. On a switch-free graph
``L_eT`` is the 0/1 incidence vector and this is exactly the seed's LP on the spanning-tree polytope.

Column generation. The restricted master over a few trees is the LP

    min t   s.t.   sum_T c_e L_eT alpha_T - t <= 0   (dual y_e >= 0)      for every link e
                   sum_T alpha_T = 1                 (dual mu)

whose dual is ``max mu  s.t.  mu <= sum_e y_e c_e L_eT  for all T,  sum_e y_e = 1``. Given the master's
duals ``y``, the *pricing* problem ``min_T sum_e (y_e c_e) L_eT`` is a cheapest routed tree, solved exactly
(shortest paths + MST). If its value is below ``mu`` the tree enters the master; otherwise the master is
optimal. At every iteration the pricing value is a valid lower bound (weak duality: for any schedule,
``max_e c_e P_e >= sum_e y_e c_e P_e >= min_T sum_e y_e c_e L_eT`` because ``sum y = 1``), so the loop stops
with a certified gap ``(upper - lower) / upper <= tol``. SciPy's HiGHS solves every master.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from gradsync.errors import PlanError
from gradsync.plan.trees import RoutedTree, cheapest_tree
from gradsync.topology.model import Topology

__all__ = ["TreePacking", "bottleneck_tree", "optimal_packing", "pack_trees", "partition_bound"]


@dataclass(frozen=True)
class TreePacking:
    """Result of :func:`pack_trees`: weighted routed trees, their cost and a certified lower bound."""

    cost: float
    lower_bound: float
    trees: tuple[tuple[float, RoutedTree], ...]
    iterations: int
    columns: int
    #: Final dual prices per link (sum 1): the certificate behind ``lower_bound``.
    duals: np.ndarray

    @property
    def loads(self) -> np.ndarray:
        """``P_e``: expected number of tree edges crossing each link."""
        out = np.zeros_like(self.duals)
        for w, t in self.trees:
            out += w * t.loads
        return out


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
    parent = {d.name: d.name for d in topology.devices}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for lk, load, c in zip(topology.links, loads, topology.costs):
        if c * load < cost * (1 - 1e-7):
            parent[find(lk.a)] = find(lk.b)
    roots = {find(d.name) for d in topology.devices}
    label = {r: i for i, r in enumerate(sorted(roots))}
    part_of = {d.name: label[find(d.name)] for d in topology.devices}
    if {part_of[r] for r in topology.ranks} != set(part_of.values()):
        return 0.0
    return partition_bound(topology, part_of)


def bottleneck_tree(topology: Topology) -> RoutedTree:
    """The minimum-weight spanning tree by ``c_e``, which also minimises its slowest link (C(T_MWST)).

    MSTs are minimax: on a switch-free graph no spanning tree has a smaller maximum ``c_e``.
    """
    costs = topology.costs
    return cheapest_tree(topology, _floor(costs.copy(), costs))


def _solve_master(loads: np.ndarray, capacity: np.ndarray) -> tuple[np.ndarray, float, np.ndarray, float]:
    """Master LP over columns ``loads`` (links x trees, entries L_eT). Returns alpha, t, y, mu.

    HiGHS solves the equivalent *packing* form ``max sum_T a_T  s.t.  sum_T L_eT a_T <= 1/c_e`` (several
    times faster than the min-max form: no dense ``t`` column, no equality row). With ``lam`` its optimum,
    ``alpha = a / lam`` and ``t = 1 / lam``. Its duals ``pi >= 0`` map to the min-max duals as
    ``y_e = pi_e / c_e / sum(pi / c)``, and ``mu = t`` (every basic tree prices at exactly ``t``).
    """
    k = loads.shape[1]
    res = linprog(-np.ones(k), A_ub=loads, b_ub=capacity, bounds=(0, None), method="highs",
                  options={"presolve": False})
    if not res.success:  # pragma: no cover - the packing LP is always feasible and bounded
        raise PlanError(f"HiGHS failed on the tree-packing master LP: {res.message}")
    lam = -float(res.fun)
    pi = np.maximum(-np.asarray(res.ineqlin.marginals), 0.0) * capacity
    total = pi.sum()
    y = pi / total if total > 0 else np.full(len(capacity), 1.0 / len(capacity))
    return res.x / lam, 1.0 / lam, y, 1.0 / lam


class _GreedyPacker:
    """Warm-start columns: each new tree avoids the links the earlier ones loaded (additive greedy packing).

    Column generation alone adds one tree per master solve and tails off on dense graphs (hundreds of
    solves on a 32-clique). A spread of trees that covers every link evenly lets HiGHS find the optimal
    mix in a few solves; the pricing step then only has to certify it.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.loads = np.zeros(len(topology.links))

    def take(self, count: int) -> list[RoutedTree]:
        costs = self.topology.costs
        out = []
        for _ in range(count):
            tree = cheapest_tree(self.topology, _floor(costs * (1.0 + costs * self.loads), costs))
            self.loads += tree.loads
            out.append(tree)
        return out


def pack_trees(topology: Topology, *, tol: float = 1e-9, max_iter: int = 10_000, smoothing: float = 0.5) -> TreePacking:
    """Solve the multi-tree LP exactly by column generation (see the module docstring).

    ``tol`` is the relative gap between the schedule's cost and the certified lower bound at which to stop.
    ``smoothing`` is Wentges' dual stabilisation: each round also prices at ``s * best_duals + (1 - s) * y``,
    which damps the oscillation of ``y`` that makes plain column generation tail off.
    """
    costs = topology.costs
    m = len(costs)
    n = topology.world_size
    if n == 1 or m == 0:
        empty = RoutedTree((), (), np.zeros(m))
        return TreePacking(0.0, 0.0, ((1.0, empty),), 0, 1, np.zeros(m))
    columns: list[RoutedTree] = []
    keys: set[tuple] = set()

    def add(tree: RoutedTree) -> bool:
        if tree.key in keys:
            return False
        keys.add(tree.key)
        columns.append(tree)
        return True

    add(bottleneck_tree(topology))
    greedy = _GreedyPacker(topology)
    batch = int(np.ceil(m / max(n - 1, 1)))  # trees needed to touch every link about once
    for tree in greedy.take(4 * batch):
        add(tree)
    lower = 0.0
    upper = np.inf
    alpha = np.ones(1)
    y = np.full(m, 1.0 / m)
    centre = y
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - `it` is reported after the loop
        loads = np.stack([t.loads for t in columns], axis=1)
        alpha, upper, y, mu = _solve_master(loads, 1.0 / costs)
        lower = max(lower, _slack_partition_bound(topology, loads @ alpha, upper))
        if upper - lower <= tol * max(upper, 1e-300):
            break
        added = False
        for prices in (y, smoothing * centre + (1.0 - smoothing) * y):
            tree = cheapest_tree(topology, _floor(prices * costs, costs))
            value = float((prices * costs) @ tree.loads)  # a valid lower bound: prices >= 0 sum to 1
            if value > lower:
                lower, centre = value, prices
            if float((y * costs) @ tree.loads) < mu - tol * max(abs(mu), 1e-300):
                added |= add(tree)
        if upper - lower <= tol * max(upper, 1e-300) or not added:
            break
        for tree in greedy.take(batch):
            add(tree)
    else:  # pragma: no cover
        raise PlanError(f"tree packing did not converge in {max_iter} iterations (gap {upper - lower:.3g})")
    keep = alpha > 1e-12
    weights = alpha[keep] / alpha[keep].sum()
    trees = tuple(zip(weights.tolist(), [t for t, k in zip(columns, keep) if k]))
    # Recompute the cost of the renormalised mix so that `cost` is exactly what the trees achieve.
    loads = sum(w * t.loads for w, t in trees)
    cost = float((costs * loads).max())
    return TreePacking(cost, min(lower, cost), trees, it, len(columns), y)


@functools.lru_cache(maxsize=32)
def optimal_packing(topology: Topology) -> TreePacking:
    """:func:`pack_trees` with default settings, memoised per (immutable) topology.

    The ``lp`` and ``tree`` synthesizers and :func:`gradsync.plan.limits.limits` all need the same packing;
    one ``gradsync plan`` would otherwise solve the LP two or three times.
    """
    return pack_trees(topology)
