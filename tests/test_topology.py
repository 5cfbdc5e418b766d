from __future__ import annotations

import json

import pytest

from gradsync.errors import TopologyError
from gradsync.topology import BUILDERS, DGX1_NVLINKS, Device, Link, Topology, from_dict, get_topology, load, save


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


def test_minimal_yaml_form_and_unit_default(tmp_path):
    f = tmp_path / "box.yaml"
    f.write_text(
        "name: my-box\n"
        "devices: [{name: gpu0, kind: gpu}, {name: gpu1, kind: gpu}, {name: plx0, kind: switch}]\n"
        "links: [{a: gpu0, b: plx0, bandwidth_GBps: 12, latency_s: 0.0}, {a: gpu1, b: plx0, bandwidth_GBps: 12}]\n"
    )
    t = get_topology(str(f))
    assert t.ranks == ("gpu0", "gpu1") and t.unit_bandwidth_GBps == 12 and t.has_forwarders


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_save_load_roundtrip(tmp_path, suffix):
    for spec in ["p2.16xlarge", "minsky:2", "dgx1"]:
        t = get_topology(spec)
        back = load(save(t, tmp_path / f"t{suffix}"))
        assert back == t and back.to_dict() == t.to_dict()


BAD = [
    ({"name": "x", "devices": [{"name": "a"}], "links": [{"a": "a", "b": "zz", "bandwidth_GBps": 1}]}, "unknown device 'zz'"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": 0}]}, "positive number"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": -3}]}, "positive"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "a"}], "links": []}, "appears twice"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": []}, "disconnected"),
    ({"name": "x", "devices": [{"name": "a", "kind": "tpu"}], "links": []}, "kind 'tpu'"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": 1, "bw": 2}]}, "unknown field"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": 1}, {"a": "b", "b": "a", "bandwidth_GBps": 1}]}, "summed bandwidth"),
    ({"name": "x", "devices": [{"name": "s", "kind": "switch"}], "links": []}, "no compute device"),
    ({"name": "x", "devices": [{"name": "a"}], "links": [], "ranks": ["q"]}, "not a declared device"),
    ({"devices": [], "links": []}, "missing the required field 'name'"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": 1, "latency_s": -1}]}, "latency_s"),
]


@pytest.mark.parametrize("data, message", BAD)
def test_bad_topologies_name_the_problem(data, message):
    with pytest.raises(TopologyError, match=message.replace("(", r"\(")):
        from_dict(data)


@pytest.mark.parametrize("spec, message", [
    ("nosuch", "unknown topology 'nosuch'; known:"),
    ("ring", "takes 1 argument"),
    ("ring:1", "n >= 2"),
    ("dgx1[0,9]", "out of range"),
    ("ring:4[1,1]", "names a rank twice"),
    ("ring:4:3", "cannot read topology spec"),
])
def test_bad_specs(spec, message):
    with pytest.raises(TopologyError, match=message.replace("[", r"\[")):
        get_topology(spec)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TopologyError, match="not valid JSON"):
        load(bad)
    with pytest.raises(TopologyError, match="does not exist"):
        load(tmp_path / "missing.yaml")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"type": "gradsync.schedule"}))
    with pytest.raises(TopologyError, match="expected 'gradsync.topology'"):
        load(other)


def test_rank_must_compute():
    with pytest.raises(TopologyError, match="cannot hold or add data"):
        Topology("t", (Device("a"), Device("s", "switch")), (Link("a", "s", 1.0),), ranks=("a", "s"))


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
