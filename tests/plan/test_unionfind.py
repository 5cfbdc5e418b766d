"""The planners' one union-find (gradsync.plan.unionfind) against networkx's connected components."""

from __future__ import annotations

import random

import networkx as nx
import pytest

from gradsync.plan.unionfind import DisjointSets


@pytest.mark.parametrize("seed", range(40))
def test_components_match_networkx_on_random_small_graphs(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    edges = [(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(0, 2 * n))]
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from(edges)
    sets = DisjointSets(range(n))
    for a, b in edges:
        root = sets.union(a, b)
        assert sets.find(a) == sets.find(b) == root
    got = {frozenset(v for v in range(n) if sets.find(v) == sets.find(u)) for u in range(n)}
    assert got == {frozenset(c) for c in nx.connected_components(graph)}
    for component in got:  # one root per component, and it belongs to it
        assert len({sets.find(v) for v in component}) == 1 and sets.find(next(iter(component))) in component


def test_union_keeps_the_second_argument_s_root() -> None:
    """``union(a, b)`` hangs a's root under b's: the roots, which callers number components by, follow the
    unions alone (no union by rank), whatever ``find`` calls came between."""
    sets = DisjointSets("abcde")
    assert sets.union("a", "b") == "b"
    assert sets.union("c", "d") == "d"
    assert sets.find("a") == "b"
    assert sets.union("d", "a") == "b"  # d's set (c, d) goes under b
    assert {sets.find(x) for x in "abcd"} == {"b"} and sets.find("e") == "e"
    assert sets.union("b", "c") == "b"  # already joined: nothing moves
