from __future__ import annotations

import pytest

from gradsync.errors import TopologyError
from gradsync.topology import BUILDERS, DGX1_NVLINKS, get_topology


def test_dgx1_matches_nvidia_numbering():
    t = get_topology("dgx1")
    assert t.name == "p3.16xlarge" and t.world_size == 8
    for lk in t.links:
        i, j = int(lk.a[3:]), int(lk.b[3:])
        assert lk.bandwidth_GBps == 25.0 * DGX1_NVLINKS[i][j]
    # Every V100 has six NVLinks: 150 GB/s per direction in total.
    for g in t.ranks:
        assert sum(lk.bandwidth_GBps for lk in t.links if g in (lk.a, lk.b)) == 150.0
    assert len(t.links) == 16 and t.unit_bandwidth_GBps == 25.0


def test_p3_8xlarge_is_first_four_gpus():
    t = get_topology("p3.8xlarge")
    pairs = {(lk.a, lk.b): lk.bandwidth_GBps for lk in t.links}
    assert pairs == {
        ("gpu0", "gpu1"): 50.0, ("gpu0", "gpu2"): 25.0, ("gpu0", "gpu3"): 25.0,
        ("gpu1", "gpu2"): 25.0, ("gpu1", "gpu3"): 50.0, ("gpu2", "gpu3"): 50.0,
    }


def test_p2_16xlarge_structure():
    t = get_topology("p2.16xlarge")
    c = t.counts()
    assert c["gpu"] == 16 and c["switch"] == 10 and c["links"] == 25
    kinds = [lk.kind for lk in t.links]
    assert kinds.count("pcie-card") == 16 and kinds.count("pcie-board") == 8 and kinds.count("pcie-central") == 1
    assert all(lk.bandwidth_GBps == 12.0 for lk in t.links)
    half = get_topology("p2.8xlarge")
    assert half.counts()["gpu"] == 8 and "pcie-central" not in {lk.kind for lk in half.links}


def test_minsky_socket_is_nvlink_three_clique():
    t = get_topology("minsky:2")
    assert t.world_size == 8 and all(r.split(".")[1].startswith("gpu") for r in t.ranks)
    g = t.graph
    for node in range(2):
        for s in range(2):
            clique = [f"n{node}.cpu{s}", f"n{node}.gpu{2 * s}", f"n{node}.gpu{2 * s + 1}"]
            assert all(g.has_edge(a, b) for a in clique for b in clique if a < b)
    # GPUs never touch the network directly (seed 002 §6.3).
    assert not any(g.has_edge(r, "ib0") for r in t.ranks)


@pytest.mark.parametrize("spec, ranks, links", [("ring:5", 5, 5), ("full:6", 6, 15), ("switch:9", 9, 9), ("ring:2", 2, 1)])
def test_generic_builders(spec, ranks, links):
    t = get_topology(spec)
    assert t.name == spec and t.world_size == ranks and len(t.links) == links


def test_selection_keeps_names_and_prunes_dead_switches():
    t = get_topology("p3.16xlarge[0,1,2,3,7]")
    assert t.name == "p3.16xlarge[0,1,2,3,7]" and t.ranks == ("gpu0", "gpu1", "gpu2", "gpu3", "gpu7")
    p = get_topology("p2.16xlarge[0,1]")
    assert {d.name for d in p.devices} == {"gpu0", "gpu1", "plx_b0"}


def test_registry_lists_all_required_names():
    for name in ["p3.16xlarge", "dgx1", "p3.8xlarge", "p2.16xlarge", "p2.8xlarge", "ring", "full", "switch", "minsky"]:
        assert name in BUILDERS


def test_racks_two_tier_cluster():
    """racks:r,s,o: r*s hosts ranked rack by rack, 10 GbE to their rack switch, rack uplinks at 1/o of that;
    a rank-order ring crosses the uplinks while a rack-first plan crosses them once (planner's cost)."""
    from gradsync.plan import evaluate, synthesize

    t = get_topology("racks:2,3,4")
    assert t.ranks == tuple(f"host{i}" for i in range(6))
    assert sorted({(lk.kind, lk.bandwidth_GBps) for lk in t.links}) == [("network", 1.25), ("uplink", 1.25 / 4)]
    # per uplink direction: the ring carries 2(N-1)/N of the buffer, one tree the buffer once (at 1/4 rate)
    assert evaluate(synthesize("ring", t), t, 1e9).cost == pytest.approx(4 * 2 * 5 / 6, rel=1e-9)
    assert evaluate(synthesize("tree", t), t, 1e9).cost == pytest.approx(4.0, rel=1e-9)
    # rack first, then across racks by host index: the same optimal uplink load, spread over s flows
    hier = synthesize("hierarchical", t)
    assert evaluate(hier, t, 1e9).cost == pytest.approx(4.0, rel=1e-9)
    assert hier.meta["hierarchy"] == {"levels": ["rack", "across racks"], "radices": [3, 2]}
    assert get_topology("racks:1,3,4").counts()["switch"] == 1  # one rack: no core, no uplink
    with pytest.raises(TopologyError, match="racks needs o"):
        get_topology("racks:2,3,0")
