"""The scalable tree packing (issue 18 part 3) against independent expectations.

* :func:`symmetric_packing` equals the exact column generation and the closed forms ``2 (N - 1) / N``
  (fat tree) and ``2 (N - 1) / (N k)`` (BCube), and its thinned packings cost exactly what they claim:
  loads recounted from the routes, gap ``1 / (N - 1)`` against the cut bound.
* The interior-point master, the simplex one and SciPy's ``linprog`` fallback agree.

The torus trees and the groups are in test_symmetry.py, the pricer in test_trees.py.
"""

from __future__ import annotations

import importlib
from fractions import Fraction

import networkx as nx
import numpy as np
import pytest

from gradsync.plan import cut_bound, pack_trees, synthesize
from gradsync.plan.lp import optimal_packing, symmetric_packing
from gradsync.plan.trees import tree_loads
from gradsync.topology import Device, Link, Topology, get_topology
from tests.conftest import random_topology

lp = importlib.import_module("gradsync.plan.lp")


# ---- the symmetric packing against the exact LP and the closed forms -------------------------------------------
@pytest.mark.parametrize("spec", ["fattree:4", "fattree:6", "bcube:3,2", "bcube:4,1", "bcube:2,3", "bcube:4,2"])
def test_symmetric_packing_is_the_lp_optimum(spec: str) -> None:
    t = get_topology(spec)
    n = t.world_size
    k = t.attrs.get("k", 1) if t.attrs["family"] == "bcube" else 1
    closed = 2 * (n - 1) / (n * k)
    packing = symmetric_packing(t)
    assert packing.method == "symmetric"
    assert packing.cost == pytest.approx(closed, rel=1e-12)
    assert packing.lower_bound == pytest.approx(closed, rel=1e-12) and packing.gap <= 1e-12
    assert pack_trees(t).cost == pytest.approx(closed, rel=1e-9)
    assert cut_bound(t).value == pytest.approx(closed, rel=1e-12)
    assert sum(w for w, _ in packing.trees) == pytest.approx(1.0)
    _check_trees(t, packing)


@pytest.mark.parametrize("spec", ["fattree:4", "fattree:6", "fattree:8", "bcube:3,2", "bcube:4,2", "bcube:16,2",
                                  "bcube:2,3", "bcube:3,3"])
def test_symmetric_packing_uses_few_equal_weight_trees(spec: str) -> None:
    """s trees of weight 1/s give each server link an integer / s; the optimum 2(N-1)/(N k) is one only when
    s is a multiple of its denominator d. Fat trees reach s = d = N/2 (not |H| = N); BCubes a multiple of d
    no larger than |H| = k N (s = d = N on BCube(16, 2))."""
    t = get_topology(spec)
    n = t.world_size
    k = t.attrs["k"] if t.attrs["family"] == "bcube" else 1
    fewest = Fraction(2 * (n - 1), n * k).denominator
    packing = symmetric_packing(t)
    s = len(packing.trees)
    assert packing.gap <= 1e-12 and s % fewest == 0 and s <= k * n
    assert all(w == pytest.approx(1 / s) for w, _ in packing.trees)
    if t.attrs["family"] == "fattree" or spec == "bcube:16,2":
        assert s == fewest


def _check_trees(t: Topology, packing) -> None:
    """Every tree spans the ranks, its routes join its edges' devices, its loads are its routes' hops."""
    loads = np.zeros(len(t.links))
    for w, tree in packing.trees:
        g = nx.Graph(list(tree.edges))
        assert g.number_of_nodes() == t.world_size and nx.is_tree(g)
        for (u, v), route in zip(tree.edges, tree.routes):
            assert {route[0], route[-1]} == {t.ranks[u], t.ranks[v]}
        recount = tree_loads(t, tree.routes)
        assert np.array_equal(recount, tree.loads)
        loads += w * recount
    assert float((t.costs * loads).max()) == pytest.approx(packing.cost, rel=1e-12)


@pytest.mark.parametrize("spec,trees", [("fattree:4", 1), ("fattree:6", 1), ("bcube:3,2", 2), ("bcube:4,2", 2),
                                        ("bcube:3,3", 3)])
def test_thinned_packings_certify_a_gap_of_one_over_n_minus_one(spec: str, trees: int) -> None:
    """Too small a tree budget: one Hamiltonian path on a fat tree, the k torus trees on a BCube."""
    t = get_topology(spec)
    n = t.world_size
    packing = symmetric_packing(t, max_tree_edges=trees * (n - 1))
    assert len(packing.trees) == trees and packing.images == trees
    k = t.attrs["k"] if t.attrs["family"] == "bcube" else 1
    assert packing.cost == pytest.approx(2 / k, rel=1e-12)  # every server link carries at most 2 / k
    assert packing.lower_bound == pytest.approx(cut_bound(t).value, rel=1e-12)
    assert packing.gap == pytest.approx(1 / (n - 1), rel=1e-9)
    _check_trees(t, packing)
    if t.attrs["family"] == "fattree":
        (_, path), = packing.trees
        assert sorted(dict(nx.Graph(list(path.edges)).degree()).values()) == [1, 1] + [2] * (n - 2)


def test_optimal_packing_picks_the_method_and_plans_with_it() -> None:
    assert optimal_packing(get_topology("bcube:3,2")).method == "symmetric"
    assert optimal_packing(random_topology(8, 6, seed=3)).method == "lp"
    s = synthesize("lp", get_topology("fattree:4"))
    assert len(s.trees) == len(optimal_packing(get_topology("fattree:4")).trees)


@pytest.mark.parametrize("seed", range(6))
def test_master_backends_agree(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    t = random_topology(9, 14, seed)
    warm = pack_trees(t)
    monkeypatch.setattr(lp, "_highs", None)  # SciPy without its vendored highspy: linprog every solve
    cold = pack_trees(t)
    assert warm.cost == pytest.approx(cold.cost, rel=1e-9)
    assert warm.lower_bound == pytest.approx(warm.cost, rel=1e-9)


def test_random_regular_graph_meets_the_cut_bound() -> None:
    """Switch-free: the cut bound is the Nash-Williams-Tutte optimum and the column generation reaches it."""
    g = nx.random_regular_graph(6, 48, seed=5)
    rng = np.random.default_rng(5)
    t = Topology("reg6:48", tuple(Device(f"g{i}") for i in range(48)),
                 tuple(Link(f"g{a}", f"g{b}", float(rng.choice((10, 20, 25, 50)))) for a, b in sorted(g.edges)))
    packing = optimal_packing(t)
    assert packing.method == "lp"
    assert packing.cost == pytest.approx(cut_bound(t).value, rel=1e-9)
    assert packing.gap <= 1e-9
