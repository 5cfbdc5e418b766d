"""The symmetric out-tree packing (issue 14's plan time on fat trees and BCubes) against independent expectations.

* Its cost equals the plain column generation's, ForestColl's cut bound, the brute-force bound over every
  vertex set (where small enough) and the closed form ``(N - 1) / N`` on a fat tree.
* Its trees are out-trees rooted at every rank (checked edge by edge), routed over real links, with loads
  recounted from the routes, the same number per root and weights summing to 1 per root.
* The group behind it acts regularly on the ranks and keeps link directions apart; a topology whose
  symmetry is broken (a degraded link) or that has none falls back to the plain LP.
"""

from __future__ import annotations

import importlib
from collections import Counter

import networkx as nx
import numpy as np
import pytest

from gradsync.errors import PlanError
from gradsync.plan import PlanOptions, synthesize
from gradsync.plan.forest import (
    forest_packing,
    gather_cut_bound,
    optimal_forest,
    pack_arborescences,
    symmetric_arborescences,
)
from gradsync.plan.symmetry import symmetry_of
from gradsync.topology import Topology, get_topology
from gradsync.topology.io import from_dict

from .test_collectives import brute_bound, cost

forest = importlib.import_module("gradsync.plan.forest")
SHARDED = ("reduce_scatter", "allgather")


def _check_trees(t: Topology, packing) -> None:
    """Every tree is an out-tree from its root over all ranks, routed hop by hop over links; loads recounted."""
    n = t.world_size
    per_root: dict[int, float] = Counter()
    count: dict[int, int] = Counter()
    load = np.zeros((len(t.links), 2))
    for w, tree in packing.trees:
        g = nx.DiGraph(list(tree.edges))
        assert g.number_of_nodes() == n and nx.is_arborescence(g)
        assert [v for v in g if g.in_degree(v) == 0] == [tree.root]
        recount = np.zeros((len(t.links), 2))
        for (p, c), route in zip(tree.edges, tree.routes):
            assert route[0] == t.ranks[p] and route[-1] == t.ranks[c]
            for e, d in t.route_links(route):  # raises if a hop is not a link
                recount[e, d] += 1
        assert np.array_equal(recount, tree.loads)
        per_root[tree.root] += w
        count[tree.root] += 1
        load += w * recount / n
    assert sorted(per_root) == list(range(n)) and all(v == pytest.approx(1.0) for v in per_root.values())
    assert len(set(count.values())) == 1  # every root gets the images of the same master trees
    costs = t.directed_costs[:, ::-1] if packing.reversed else t.directed_costs
    assert float((costs * load).max()) == pytest.approx(packing.cost, rel=1e-12)


@pytest.mark.parametrize("spec", ["fattree:4", "bcube:2,2", "bcube:3,2", "bcube:4,1"])
@pytest.mark.parametrize("collective", SHARDED)
def test_symmetric_packing_equals_the_lp_and_the_cut_bound(spec: str, collective: str) -> None:
    t = get_topology(spec)
    reverse = collective == "reduce_scatter"
    packing = symmetric_arborescences(t, reverse=reverse)
    plain = pack_arborescences(t, reverse=reverse)
    bound = gather_cut_bound(t, collective).value
    assert packing.method == "symmetric" and plain.method == "lp"
    assert packing.cost == pytest.approx(bound, rel=1e-12)
    assert packing.lower_bound == pytest.approx(bound, rel=1e-12)
    assert plain.cost == pytest.approx(bound, rel=1e-8)
    if len(t.devices) <= 16:  # brute force over every vertex set, written from the definition
        assert bound == pytest.approx(brute_bound(t, collective), rel=1e-12)
    if t.attrs["family"] == "fattree":  # every host must receive (send) the other N - 1 shards over one link
        n = t.world_size
        assert packing.cost == pytest.approx((n - 1) / n, rel=1e-12)
        assert len(packing.trees) == n  # one shortest-route out-tree per root is optimal (forest docstring)
    _check_trees(t, packing)


def test_bcube_closed_forms() -> None:
    """BCube(n, k): a server receives (N - 1) / N over k links, so the bound is (N - 1) / (N k)."""
    for spec, n, k in (("bcube:2,2", 2, 2), ("bcube:3,2", 3, 2), ("bcube:4,2", 4, 2), ("bcube:2,3", 2, 3)):
        t = get_topology(spec)
        nn = n**k
        for reverse in (False, True):
            p = symmetric_arborescences(t, reverse=reverse)
            assert p.cost == pytest.approx((nn - 1) / (nn * k), rel=1e-12), spec
            _check_trees(t, p)


def test_the_group_is_regular_on_the_ranks_and_keeps_directions_apart() -> None:
    for spec, rows in (("fattree:4", 6), ("fattree:6", 6), ("bcube:3,2", 4), ("bcube:2,3", 6)):
        t = get_topology(spec)
        group = forest._regular_group(t, symmetry_of(t))
        assert group is not None and len(group.devices) == t.world_size
        assert [int(r[0]) for r in group.ranks] == list(range(t.world_size))  # g_r(0) = r
        assert len(group.size) == rows, spec  # host/agg/core links x 2 directions; k levels x 2 directions
        orbit = group.orbit.reshape(-1, 2)
        assert not set(orbit[:, 0]) & set(orbit[:, 1])  # no orbit holds both directions of a link
        for dperm, lperm in zip(group.devices, group.directions):  # each direction maps as its hop does
            for e, lk in enumerate(t.links[:20]):
                a, b = t.device_index[lk.a], t.device_index[lk.b]
                f, d = divmod(int(lperm[2 * e]), 2)
                names = (t.devices[dperm[a]].name, t.devices[dperm[b]].name)
                assert t.directed_link(*names) == (f, d)


def _degraded(spec: str) -> Topology:
    doc = get_topology(spec).to_dict()
    doc["links"][-1]["bandwidth_GBps"] = doc["links"][-1]["bandwidth_GBps"] / 2  # one link slower
    return from_dict(doc)


@pytest.mark.parametrize("spec", ["bcube:3,2", "fattree:4"])
def test_a_degraded_link_falls_back_to_the_plain_lp(spec: str) -> None:
    t = _degraded(spec)
    assert t.attrs["family"] in ("bcube", "fattree")
    assert symmetry_of(t) is None
    with pytest.raises(PlanError, match="no known symmetry.*use pack_arborescences"):
        symmetric_arborescences(t)
    for collective in SHARDED:
        packing = forest_packing(t, reverse=collective == "reduce_scatter")
        assert packing.method == "lp"
        assert packing.cost == pytest.approx(gather_cut_bound(t, collective).value, rel=1e-8)
        if len(t.devices) <= 16:
            assert packing.cost == pytest.approx(brute_bound(t, collective), rel=1e-8)


def test_topologies_without_symmetry_use_the_plain_lp() -> None:
    for spec in ("p3.8xlarge", "switch:4", "fattree:4[0,1,2]"):
        assert forest_packing(get_topology(spec)).method == "lp"


def test_asymmetric_links_keep_the_symmetry_and_match_the_plain_lp() -> None:
    """Every switch-to-server direction at half speed: still an automorphism group (directions are kept apart),
    and each collective costs what the plain LP finds. Switches can only forward, and every routed tree edge
    enters a server from a switch: 8 of every shard's 9 copies (allgather), or of its 9 partial sums
    (reduce-scatter), cross the 18 half-speed directions, so both cost 8/9. The cut bound is 8/9 for the
    allgather but only 4/9 for the reduce-scatter (it needs switches that send as much as they receive)."""
    base = get_topology("bcube:3,2")
    doc = base.to_dict()
    for lk in doc["links"]:
        bw = lk.pop("bandwidth_GBps")
        server_first = lk["a"] in base.rank_index
        lk["bandwidth_up_GBps"], lk["bandwidth_down_GBps"] = (bw, bw / 2) if server_first else (bw / 2, bw)
    t = from_dict(doc)
    assert symmetry_of(t) is not None
    for collective in SHARDED:
        reverse = collective == "reduce_scatter"
        packing = forest_packing(t, reverse=reverse)
        assert packing.method == "symmetric"
        assert packing.cost == pytest.approx(8 / 9, rel=1e-12)
        assert packing.cost == pytest.approx(pack_arborescences(t, reverse=reverse).cost, rel=1e-8)
        assert packing.lower_bound == pytest.approx(8 / 9, rel=1e-9)  # certified by the pricing, not the cut
        assert brute_bound(t, collective) == pytest.approx(8 / 9 if collective == "allgather" else 4 / 9)
        _check_trees(t, packing)
        s = synthesize("lp", t, PlanOptions(collective=collective))
        assert cost(s, t) == pytest.approx(packing.cost, rel=1e-9)


def test_plan_uses_the_symmetric_packing() -> None:
    t = get_topology("fattree:4")
    for collective in SHARDED:
        assert optimal_forest(t, collective == "reduce_scatter").method == "symmetric"
        s = synthesize("lp", t, PlanOptions(collective=collective))
        assert cost(s, t) == pytest.approx(15 / 16, rel=1e-12)
        assert s.meta["lp_cost"] == pytest.approx(15 / 16, rel=1e-12)


def test_benchmark_times_the_packing_plan_uses() -> None:
    """benchmarks.plan_scaling --collectives: the method it records and the bound it meets, on a small BCube."""
    import benchmarks.plan_scaling as bench

    row = bench.measure_collectives("bcube:2,2", lambda: get_topology("bcube:2,2"), 60.0, repeats=2)
    assert all(len(row[c]["plan_samples_s"]) == len(row[c]["export_samples_s"]) == 2 for c in SHARDED)
    assert row["reduce_scatter"]["plan_s"] == pytest.approx(sum(row["reduce_scatter"]["plan_samples_s"]) / 2)
    # the goals read the medians: DGX-1 must be present and under 0.1 s, every case under 10 s
    fast = {"plan_s": 0.05, "export_s": 0.01}
    dgx = {"name": bench.DGX1, "reduce_scatter": fast, "allgather": dict(fast, plan_s=0.2)}
    assert bench.collective_goals_met([row]) == {"dgx1_s": False, "every_s": True}
    assert bench.collective_goals_met([row, dgx]) == {"dgx1_s": False, "every_s": True}
    assert bench.collective_goals_met([row, dict(dgx, allgather=fast)]) == {"dgx1_s": True, "every_s": True}
    assert bench.collective_goals_met([{"name": "x", "reduce_scatter": {"skipped": "over"}}]) == {"dgx1_s": False,
                                                                                                    "every_s": False}
    for collective in SHARDED:
        r = row[collective]
        assert r["method"] == "symmetric" and r["trees"] == 8  # two master trees, one image per rank each
        assert r["cost"] == pytest.approx(r["cut_bound"], rel=1e-12) == pytest.approx(3 / 8)
        assert "msccl_error" not in r and r["msccl_loss"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("name", ["p3.16xlarge", "p3.8xlarge", "bcube:3,1"])
def test_warm_highs_master_and_linprog_agree(monkeypatch, name):
    """The out-tree master kept in one HiGHS instance (warm basis) and SciPy's linprog from scratch reach the
    same optimum, the cut bound, with weights that sum to 1 per root."""
    from gradsync.plan import forest

    warm = forest.pack_arborescences(get_topology(name))
    monkeypatch.setattr(forest, "_highs", None)
    cold = forest.pack_arborescences(get_topology(name))
    bound = forest.gather_cut_bound(get_topology(name)).value
    assert warm.cost == pytest.approx(cold.cost, rel=1e-9) == pytest.approx(bound, rel=1e-9)
    for packing in (warm, cold):
        per_root: dict[int, float] = {}
        for w, t in packing.trees:
            per_root[t.root] = per_root.get(t.root, 0.0) + w
        assert sorted(per_root) == list(range(get_topology(name).world_size))
        assert all(v == pytest.approx(1.0) for v in per_root.values())
