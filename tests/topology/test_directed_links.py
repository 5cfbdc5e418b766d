"""Asymmetric links: the file format round-trips, the planner, bounds and simulator see each direction."""

from __future__ import annotations

import itertools
import random

import pytest

from gradsync.errors import TopologyError
from gradsync.plan import cut_bound, evaluate, limits, synthesize
from gradsync.sim import simulate
from gradsync.topology import Device, Link, Topology, from_dict, load, save
from tests.conftest import random_fabric, set_partitions


def triangle(down: float) -> Topology:
    """Three GPUs in a cycle of 1 GB/s links; g2 -> g0 runs at 1 and g0 -> g2 at ``down``."""
    links = (Link("g0", "g1", 1.0), Link("g1", "g2", 1.0), Link("g2", "g0", 1.0, bandwidth_down_GBps=down))
    return Topology("triangle", tuple(Device(f"g{i}") for i in range(3)), links, unit_bandwidth_GBps=1.0)


def test_file_round_trip(tmp_path):
    t = triangle(0.5)
    for suffix in (".json", ".yaml"):
        path = save(t, tmp_path / f"tri{suffix}")
        back = load(path)
        assert back.links == t.links and back.links[2].directed_GBps == (1.0, 0.5)
        assert back.directed_costs.tolist() == [[1, 1], [1, 1], [1, 2]]
    data = t.to_dict()["links"]
    assert "bandwidth_GBps" in data[0] and data[2]["bandwidth_up_GBps"] == 1.0 and data[2]["bandwidth_down_GBps"] == 0.5
    # equal directions collapse to a symmetric link
    assert Link("a", "b", 2.0, bandwidth_down_GBps=2.0).symmetric


def test_asymmetry_changes_the_plan_where_it_binds():
    sym = evaluate(synthesize("lp", triangle(1.0)), triangle(1.0), 1e9)
    assert sym.cost == pytest.approx(2 / 3)  # three paths, weight 1/3 each
    t = triangle(0.5)
    s = synthesize("lp", t)
    r = evaluate(s, t, 1e9)
    # A tree edge loads both directions alike, so trees see the link at 0.5: Nash-Williams 2 / (1 + 1 + 0.5).
    assert r.cost == pytest.approx(0.8, rel=1e-9)
    assert sorted(tr.weight for tr in s.trees) == pytest.approx([0.2, 0.2, 0.6])  # the path avoiding g0 -> g2: 0.6
    assert simulate(s, t, 1e9).gst_over_tf == pytest.approx(0.8, rel=1e-9)  # the simulator sees the slow direction
    # Cut bound on directed capacities: every GPU alone, out-capacity 1.5 + 2 + 2: 2 * 2 / 5.5.
    assert cut_bound(t).value == pytest.approx(8 / 11, rel=1e-12)
    b = limits(t)
    assert b.method == "cut" and b.lower_bound == pytest.approx(8 / 11) and b.lower_bound <= r.cost
    # the reverse direction degraded gives the same costs (the cycle's mirror image)
    assert evaluate(synthesize("lp", triangle(2.0)), triangle(2.0), 1e9).cost == pytest.approx(2 / 3)


def brute_directed_cut(t: Topology) -> float:
    names = [d.name for d in t.devices]
    w = 1.0 / t.directed_costs
    best_out: dict[frozenset[str], float] = {}
    best_in: dict[frozenset[str], float] = {}
    for size in range(len(names) + 1):
        for xs in itertools.combinations(names, size):
            inside = set(xs)
            out = sum(w[i, 0] if lk.a in inside else w[i, 1] for i, lk in enumerate(t.links) if (lk.a in inside) != (lk.b in inside))
            inn = sum(w[i, 1] if lk.a in inside else w[i, 0] for i, lk in enumerate(t.links) if (lk.a in inside) != (lk.b in inside))
            key = frozenset(inside & set(t.ranks))
            best_out[key] = min(best_out.get(key, float("inf")), out)
            best_in[key] = min(best_in.get(key, float("inf")), inn)
    best = 0.0
    for parts in set_partitions(list(t.ranks)):
        if len(parts) >= 2:
            for h in (best_out, best_in):
                best = max(best, 2 * (len(parts) - 1) / sum(h[frozenset(p)] for p in parts))
    return best


@pytest.mark.parametrize("seed", range(15))
def test_directed_cut_equals_brute_force(seed):
    rng = random.Random(seed)
    base = random_fabric(100 + seed, max_nodes=9)
    t = Topology(base.name, base.devices, tuple(
        Link(lk.a, lk.b, lk.bandwidth_GBps, bandwidth_down_GBps=float(rng.choice((1, 2, 3, 5)))) for lk in base.links))
    b = cut_bound(t)
    assert b.value == pytest.approx(brute_directed_cut(t), rel=1e-12)
    assert b.value <= evaluate(synthesize("lp", t), t, 1e6).cost * (1 + 1e-9)


@pytest.mark.parametrize("link, message", [
    ({"a": "g0", "b": "g1", "bandwidth_up_GBps": 1, "bandwidth_down_GBps": 0}, "bandwidth_down_GBps=0"),
    ({"a": "g0", "b": "g1", "bandwidth_up_GBps": -2, "bandwidth_down_GBps": 1}, "bandwidth_up_GBps=-2"),
    ({"a": "g0", "b": "g1", "bandwidth_up_GBps": 1}, "one-way links are not supported"),
    ({"a": "g0", "b": "g1", "bandwidth_GBps": 1, "bandwidth_down_GBps": 1}, "not both"),
    ({"a": "g0", "b": "g1"}, "missing 'bandwidth_GBps'"),
])
def test_bad_directed_capacities_are_clear_errors(link, message):
    data = {"name": "two", "devices": [{"name": "g0"}, {"name": "g1"}], "links": [link]}
    with pytest.raises(TopologyError, match=message):
        from_dict(data)


def test_testbed_refuses_asymmetric_links():
    from gradsync.testbed.build import build_plan
    from gradsync.testbed.errors import TestbedError

    with pytest.raises(TestbedError, match="different bandwidths per direction"):
        build_plan(triangle(0.5))
