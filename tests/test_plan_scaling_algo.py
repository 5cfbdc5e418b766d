"""The scalable tree packing (issue 18 part 3) against independent expectations.

* :func:`torus_trees` gives ``k`` edge-disjoint spanning trees of the torus (checked with networkx).
* The fat-tree and BCube groups are automorphisms (checked link by link by name), regular on the servers.
* :func:`symmetric_packing` equals the exact column generation and the closed forms ``2 (N - 1) / N``
  (fat tree) and ``2 (N - 1) / (N k)`` (BCube), and its thinned packings cost exactly what they claim:
  loads recounted from the routes, gap ``1 / (N - 1)`` against the cut bound.
* The pricer's anchored Dijkstra equals the plain closure MST; the interior-point master, the simplex one
  and SciPy's ``linprog`` fallback agree.
"""

from __future__ import annotations

import importlib
import itertools
from fractions import Fraction

import networkx as nx
import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra, minimum_spanning_tree

from gradsync.plan import cut_bound, pack_trees, synthesize
from gradsync.plan.lp import optimal_packing, symmetric_packing
from gradsync.plan.symmetry import link_permutation, symmetry_of, torus_trees
from gradsync.plan.trees import TreePricer, tree_loads
from gradsync.topology import Device, Link, Topology, get_topology
from gradsync.topology.io import from_dict
from tests.conftest import random_fabric, random_topology

lp = importlib.import_module("gradsync.plan.lp")


# ---- the torus trees ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(2, 1), (5, 1), (2, 2), (3, 2), (4, 2), (2, 3), (3, 3), (4, 3), (3, 4), (2, 5)])
def test_torus_trees_are_edge_disjoint_spanning_trees(n: int, k: int) -> None:
    points = list(itertools.product(range(n), repeat=k))
    trees = torus_trees(n, k)
    used: set[tuple] = set()
    for tree in trees:
        g = nx.MultiGraph()
        g.add_nodes_from(points)
        g.add_edges_from(tree)
        assert len(tree) == n**k - 1 and nx.is_connected(g)
        for u, v in tree:
            diff = [i for i in range(k) if u[i] != v[i]]
            assert len(diff) == 1 and (u[diff[0]] + 1) % n == v[diff[0]]  # a torus edge, written upward
            used.add((diff[0], u))  # (dimension, lower end) names a torus edge, even the doubled ones of n = 2
    assert len(used) == k * (n**k - 1)  # disjoint: every tree edge is a different torus edge


# ---- the groups -------------------------------------------------------------------------------------------------
def _by_name(topology: Topology, perm: np.ndarray) -> dict[str, str]:
    names = [d.name for d in topology.devices]
    return {names[i]: names[j] for i, j in enumerate(perm)}


@pytest.mark.parametrize("spec", ["fattree:4", "fattree:6", "bcube:3,2", "bcube:2,3", "bcube:4,1"])
def test_groups_are_automorphisms_acting_regularly_on_the_servers(spec: str) -> None:
    t = get_topology(spec)
    sym = symmetry_of(t)
    assert sym is not None
    links = {frozenset((lk.a, lk.b)): lk.bandwidth_GBps for lk in t.links}
    for g, order in zip(sym.generators, sym.orders):
        image = _by_name(t, g)
        assert sorted(image.values()) == sorted(image)  # a permutation
        assert {image[a] for a in t.ranks} == set(t.ranks)
        for pair, bw in links.items():
            a, b = tuple(pair)
            assert links[frozenset((image[a], image[b]))] == bw
        power = np.arange(len(g))
        for _ in range(order):
            power = g[power]
        assert np.array_equal(power, np.arange(len(g)))
    # Regular on the servers: every group element moves rank 0 somewhere different (k N elements on a
    # BCube, k of them fixing the server [0..0]: the digit rotations).
    index = t.device_index
    zero = index[t.ranks[0]]
    hits = [int(p[zero]) for p in sym.elements()]
    expected = 1 if t.attrs["family"] == "fattree" else t.attrs["k"]
    assert sorted(set(hits)) == sorted(index[r] for r in t.ranks)
    assert all(hits.count(h) == expected for h in set(hits))


def test_lookalikes_get_no_symmetry() -> None:
    assert symmetry_of(get_topology("fattree:4[0,1,2]")) is None  # a selection keeps the attrs
    assert symmetry_of(get_topology("switch:6")) is None
    doc = get_topology("fattree:4").to_dict()
    doc["links"][-1]["bandwidth_GBps"] = 0.5  # one core link slower: no longer symmetric
    edited = from_dict(doc)
    assert symmetry_of(edited) is None
    assert optimal_packing(edited).method == "lp"


def test_link_permutation_refuses_a_non_automorphism() -> None:
    t = get_topology("fattree:4")
    perm = np.arange(len(t.devices))
    idx = t.device_index
    a, b = idx["h0.0.0"], idx["p0.edge0"]
    perm[a], perm[b] = b, a
    assert link_permutation(t, perm) is None


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


# ---- the exact path ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_pricer_matches_the_plain_closure_mst(seed: int) -> None:
    # Fabrics with switches and ranks of degree 1 (anchored at their neighbour) and of higher degree.
    t = random_fabric(seed, max_nodes=12, max_ranks=8, max_switches=5)
    leafy = Topology(t.name + "-leaves", t.devices + (Device("leaf", "gpu"),),
                     t.links + (Link("leaf", t.devices[-1].name, 3.0),))
    for topo in (t, leafy):
        pricer = TreePricer(topo)
        rng = np.random.default_rng(seed)
        for _ in range(4):
            w = rng.uniform(0.1, 2.0, len(topo.links))
            tree = pricer.cheapest(w)
            dist = dijkstra(pricer.graph(w), directed=False, indices=pricer.terminals)[:, pricer.terminals]
            best = minimum_spanning_tree(csr_matrix(np.triu(dist, 1))).sum()
            assert float(w @ tree.loads) == pytest.approx(best, rel=1e-12)
            assert np.array_equal(tree_loads(topo, tree.routes), tree.loads)


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


def test_orbits_are_the_closures_of_the_generators():
    """``symmetry.orbits`` against a brute-force closure: item i's orbit is every item reachable by applying the
    generators (a finite group: their inverses are powers of them), labelled by the smallest item first."""
    from gradsync.plan.symmetry import orbits

    rng = np.random.default_rng(5)
    for size in (1, 2, 7, 12):
        for count in (0, 1, 2, 3):
            gens = [rng.permutation(size) for _ in range(count)]
            label = orbits(size, gens)
            for i in range(size):
                seen, todo = {i}, [i]
                while todo:
                    x = todo.pop()
                    for g in gens:
                        y = int(g[x])
                        if y not in seen:
                            seen.add(y)
                            todo.append(y)
                assert {j for j in range(size) if label[j] == label[i]} == seen
            firsts = [min(j for j in range(size) if label[j] == c) for c in range(int(label.max()) + 1)] if size else []
            assert firsts == sorted(firsts)
