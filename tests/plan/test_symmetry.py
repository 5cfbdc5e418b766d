"""Symmetry (gradsync.plan.symmetry): torus trees, automorphism groups acting regularly on the servers, orbits."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest

from gradsync.plan.lp import optimal_packing
from gradsync.plan.symmetry import link_permutation, symmetry_of, torus_trees
from gradsync.topology import Topology, get_topology
from gradsync.topology.io import from_dict


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
