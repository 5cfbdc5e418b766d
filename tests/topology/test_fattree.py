"""Fat-Tree(k) (gradsync.topology.fattree): device and link counts by the closed forms, Fat-Tree(4)'s structure."""

from __future__ import annotations

import itertools

import pytest

from gradsync.topology import get_topology


# ---- Fat-Tree --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 4, 6, 8])
def test_fattree_counts(k):
    t = get_topology(f"fattree:{k}")
    c = t.counts()
    half = k // 2
    assert c["host"] == k**3 // 4 == t.world_size
    assert c["switch"] == 5 * k * k // 4  # k*half edge + k*half aggregation + half**2 core
    kinds = [lk.kind for lk in t.links]
    assert kinds.count("host") == k**3 // 4  # one NIC per server
    assert kinds.count("aggregation") == k * half * half and kinds.count("core") == k * half * half
    assert c["links"] == 3 * k**3 // 4
    layers = [d.attrs["layer"] for d in t.devices if d.kind == "switch"]
    assert (layers.count("edge"), layers.count("aggregation"), layers.count("core")) == (k * half, k * half, half * half)
    g = t.graph
    assert all(g.degree(d.name) == k for d in t.devices if d.kind == "switch")  # every port of every k-port switch
    assert all(lk.bandwidth_GBps == 1.25 for lk in t.links)  # non-blocking: one rate everywhere


def test_fattree_4_structure_and_attrs():
    t = get_topology("fattree:4")
    g = t.graph
    for r, name in enumerate(t.ranks):
        a = t.device(name).attrs
        assert r == a["pod"] * 4 + a["edge"] * 2 + a["index"]
        (edge,) = g[name]
        assert t.device(edge).attrs == {"pod": a["pod"], "edge": a["edge"], "layer": "edge"}
    # Every edge switch reaches every aggregation switch of its pod, every core switch reaches every pod once.
    for p in range(4):
        for e, a in itertools.product(range(2), range(2)):
            assert g.has_edge(f"p{p}.edge{e}", f"p{p}.agg{a}")
    for d in t.devices:
        if d.attrs.get("layer") == "core":
            assert sorted(t.device(v).attrs["pod"] for v in g[d.name]) == [0, 1, 2, 3]
            assert {t.device(v).attrs["agg"] for v in g[d.name]} == {d.attrs["group"]}
