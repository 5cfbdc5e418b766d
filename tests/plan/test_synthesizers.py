"""The planner against independent expectations: the seed's closed forms and brute force on small graphs."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from gradsync.commands.demo import DEMO_TOPOLOGIES
from gradsync.errors import PlanError
from gradsync.plan import SYNTHESIZERS, PlanOptions, evaluate, limits, pack_trees, synthesize
from gradsync.sim.choose import synthesize as synthesize_any
from gradsync.topology import get_topology
from tests.conftest import random_topology, set_partitions


# ---- independent brute force ---------------------------------------------------------------------------
def nash_williams_optimum(topology) -> float:
    """max over partitions P of (|P| - 1) / sum of 1/c_e over links crossing P, by enumeration."""
    names = [d.name for d in topology.devices]
    best = 0.0
    for parts in set_partitions(names):
        if len(parts) < 2:
            continue
        where = {v: i for i, p in enumerate(parts) for v in p}
        cap = sum(1 / c for lk, c in zip(topology.links, topology.costs) if where[lk.a] != where[lk.b])
        best = max(best, (len(parts) - 1) / cap)
    return best


def all_trees_optimum(topology) -> float:
    """The seed's LP with every spanning tree as a column (no column generation)."""
    g = nx.Graph()
    for i, lk in enumerate(topology.links):
        g.add_edge(lk.a, lk.b, index=i)
    cols = []
    for tree in nx.SpanningTreeIterator(g):
        col = np.zeros(len(topology.links))
        for u, v in tree.edges:
            col[g.edges[u, v]["index"]] = 1
        cols.append(col * topology.costs)
    a = np.array(cols).T
    m, k = a.shape
    res = linprog(np.r_[np.zeros(k), 1], A_ub=np.hstack([a, -np.ones((m, 1))]), b_ub=np.zeros(m),
                  A_eq=np.r_[np.ones(k), 0][None], b_eq=[1], bounds=[(0, None)] * (k + 1), method="highs")
    return float(res.fun)


# ---- the seed's numbers ----------------------------------------------------------------------------------
def test_dgx1_lp_is_seven_twentyfourths():
    t = get_topology("p3.16xlarge")
    r = evaluate(synthesize("lp", t), t, 1e9)
    assert r.cost == pytest.approx(7 / 24, abs=1e-6)
    assert r.aggregation_cost == pytest.approx(7 / 24, abs=1e-6)
    assert r.lower_bound == pytest.approx(7 / 24, abs=1e-6)
    assert r.algbw_GBps == pytest.approx(25 * 24 / 7, rel=1e-6)  # 85.7 GB/s
    assert r.time_s == pytest.approx(7 / 24 * 1e9 / 25e9, rel=1e-6)


def test_dgx1_single_tree_is_one_half_and_p3_8xlarge_one_third():
    t = get_topology("p3.16xlarge")
    assert evaluate(synthesize("tree", t), t, 1e9).cost == pytest.approx(0.5, abs=1e-9)
    t8 = get_topology("p3.8xlarge")
    r = evaluate(synthesize("lp", t8), t8, 1e9)
    assert r.cost == pytest.approx(1 / 3, abs=1e-6) and r.algbw_GBps == pytest.approx(75.0, rel=1e-6)


def test_lemma_2_1_chain_on_switch_free_builtins():
    for spec in ["p3.16xlarge", "p3.8xlarge", "ring:6", "full:5", "p3.16xlarge[0,1,2,3,7]"]:
        b = limits(get_topology(spec))
        assert b.max_link_cost >= b.tree - 1e-12 >= b.optimum - 2e-12 >= b.sum_bound - 3e-12
        assert b.lower_bound == pytest.approx(b.optimum, rel=1e-8)


def test_ring_closed_form_on_a_cycle():
    # A cycle's spanning trees are paths; the uniform mix loads every link (n-1)/n.
    for n in [3, 5, 8]:
        t = get_topology(f"ring:{n}")
        assert pack_trees(t).cost == pytest.approx((n - 1) / n, rel=1e-9)
        assert evaluate(synthesize("ring", t), t, 1e6).cost == pytest.approx((n - 1) / n, rel=1e-9)


def test_switch_closed_form():
    # n hosts on a non-aggregating switch: each host link carries 2(n-1)/n (ring, PS and the optimum).
    for n in [2, 3, 6]:
        t = get_topology(f"switch:{n}")
        for alg in ["ring", "ps", "lp"]:
            assert evaluate(synthesize(alg, t), t, 1e6).cost == pytest.approx(2 * (n - 1) / n, rel=1e-9), alg
        assert limits(t).lower_bound == pytest.approx(2 * (n - 1) / n, rel=1e-9)


def test_p2_16xlarge_bottleneck_is_inside_the_cards():
    t = get_topology("p2.16xlarge")
    r = evaluate(synthesize("lp", t), t, 1e9)
    classes = r.link_classes
    # Each tree has 15 edges with two GPU-link hops each over 16 GPU links: 30/16 = 15/8 is forced.
    assert r.cost == pytest.approx(15 / 8, rel=1e-9) and r.lower_bound == pytest.approx(15 / 8, rel=1e-9)
    assert classes["pcie-card"]["max_busy_cost"] == pytest.approx(15 / 8, rel=1e-9)
    assert classes["pcie-central"]["max_busy_cost"] < 15 / 8 - 0.1  # not the link between the halves
    assert classes["pcie-central"]["max_utilisation"] < 1.0
    assert limits(t).aggregation_cut == pytest.approx(1.0)  # what an aggregating switch fabric could reach
    assert limits(t).cut == pytest.approx(15 / 8, rel=1e-12)  # the exact cut bound: each card link alone


# ---- exactness on small graphs (property tests) --------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 7), extra=st.integers(0, 12), seed=st.integers(0, 10**6))
def test_lp_equals_nash_williams_brute_force(n, extra, seed):
    t = random_topology(n, extra, seed)
    packing = pack_trees(t)
    expected = nash_williams_optimum(t)
    assert packing.cost == pytest.approx(expected, rel=1e-6)
    assert packing.lower_bound <= packing.cost + 1e-12
    assert packing.lower_bound == pytest.approx(expected, rel=1e-6)
    s = synthesize("lp", t)
    assert evaluate(s, t, 1e6).cost == pytest.approx(expected, rel=1e-6)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(3, 6), extra=st.integers(0, 6), seed=st.integers(0, 10**6))
def test_lp_equals_all_spanning_trees_lp(n, extra, seed):
    t = random_topology(n, extra, seed)
    assert pack_trees(t).cost == pytest.approx(all_trees_optimum(t), rel=1e-6)


def test_partition_enumeration_is_bell_numbers():
    assert [sum(1 for _ in set_partitions(list(range(k)))) for k in range(1, 7)] == [1, 2, 5, 15, 52, 203]


# ---- every synthesizer on every built-in -----------------------------------------------------------------
@pytest.mark.parametrize("spec", DEMO_TOPOLOGIES)
def test_lp_never_worse_and_all_schedules_check(spec):
    t = get_topology(spec)
    costs = {}
    for name in SYNTHESIZERS.names():
        if SYNTHESIZERS.get(name).applicable(t):  # bml, hierarchical: BCube / Fat-Tree only
            continue
        s = synthesize(name, t, PlanOptions(pipeline=2))  # synthesize() runs the self-check
        costs[name] = evaluate(s, t, 1e8).cost
    for other in ["ring", "ps", "tree"]:
        assert costs["lp"] <= costs[other] + 1e-9, (other, costs)
    assert costs["lp"] >= limits(t).lower_bound - 1e-9


@pytest.mark.parametrize("spec", ["p3.8xlarge", "ring:4", "switch:4"])
@pytest.mark.parametrize("size", [4096, 1e6, 1e8])
def test_auto_is_fastest_under_the_cost_model_by_brute_force(spec, size):
    """auto's (algorithm, pipeline) is the fastest of every applicable algorithm at every depth the model
    offers, each simulated as the runtime runs it: store-and-forward per sub-chunk, one message at a time per
    connection and per receiver, the model's per-message cost (no pruning here)."""
    from gradsync.sim import simulate
    from gradsync.sim.choose import PRUNE
    from gradsync.sim.cost import CostModel

    t = get_topology(spec)
    model = CostModel()
    auto = synthesize_any("auto", t, PlanOptions(size_bytes=size))
    brute = {}
    for name in SYNTHESIZERS.names():
        if SYNTHESIZERS.get(name).applicable(t):
            continue
        for p in model.pipelines:
            s = synthesize(name, t, PlanOptions(pipeline=p))
            brute[name, p] = simulate(s, t, float(size), streaming=False, fifo=True, message_s=model.message_s, progress=False).time_s
    got = simulate(auto, t, float(size), streaming=False, fifo=True, message_s=model.message_s, progress=False).time_s
    # exact but for PRUNE: a candidate that could win by less than 1% is not simulated
    assert min(brute.values()) <= got <= min(brute.values()) / (1 - PRUNE) + 1e-12, (auto.algorithm, auto.meta["auto"]["pipeline"], brute)


def test_duplex_model_vs_half_duplex():
    # Trees load both directions equally, so a half-duplex link would take twice as long.
    t = get_topology("p3.16xlarge")
    r = evaluate(synthesize("lp", t), t, 1e9)
    assert r.half_duplex_cost == pytest.approx(2 * r.cost, rel=1e-9)
    # A unidirectional ring uses one direction only: 2(n-1)/n there, nothing back.
    t2 = get_topology("full:2")
    assert evaluate(synthesize("ring", t2), t2, 1e9).cost == pytest.approx(1.0)


def test_latency_adds_per_step():
    t = get_topology("ring:4")
    s = synthesize("ring", t)
    base = evaluate(s, t, 1e6).time_s
    with_lat = evaluate(s, t, 1e6, latency_s=1e-3).time_s
    assert with_lat - base == pytest.approx(s.num_steps * 1e-3)
    assert s.num_steps == 2 * (4 - 1)  # reduce-scatter + allgather


def test_single_rank_is_trivial():
    t = get_topology("switch:1")
    for name in ["ring", "ps", "tree", "lp"]:
        s = synthesize(name, t)
        assert s.transfers == () and evaluate(s, t, 1e6).time_s == 0.0


def test_bad_options():
    with pytest.raises(PlanError, match="pipeline"):
        PlanOptions(pipeline=0)
    with pytest.raises(PlanError, match="unknown algorithm 'nope'; known: ring, multiring, ps"):
        synthesize("nope", get_topology("ring:3"))


def test_all_pairs_helper_sanity():
    # Guard the brute force itself: K4 with unit links has 16 spanning trees and optimum 3/6.
    t = get_topology("full:4")
    assert sum(1 for _ in nx.SpanningTreeIterator(t.graph)) == 16
    assert nash_williams_optimum(t) == pytest.approx(0.5) and all_trees_optimum(t) == pytest.approx(0.5)
    assert len(list(itertools.combinations(range(4), 2))) == len(t.links)


def test_large_topologies_fall_back_to_the_cut_bound():
    t = get_topology("switch:6")
    exact = limits(t)
    assert exact.method == "lp" and exact.lower_bound == pytest.approx(2 * 5 / 6)
    cheap = limits(t, max_lp_ranks=4)
    # The exact cut bound (every host alone) is tight on a switch; the singleton aggregation bound is not.
    assert cheap.method == "cut" and cheap.lower_bound == pytest.approx(2 * 5 / 6)
    assert cheap.aggregation_cut == pytest.approx(1.0)
    assert cheap.lower_bound <= exact.lower_bound


def test_hamiltonian_search_is_iterative_on_long_rings() -> None:
    """ring:3000 has one Hamiltonian cycle, 3000 deep: found without recursion (it hit RecursionError)."""
    from gradsync.plan.synthesizers import _hamiltonian_cycles

    cycles = _hamiltonian_cycles(get_topology("ring:3000"), seconds=30)
    assert cycles == [tuple(range(3000))]
    # and the search still enumerates: K5 has (5-1)!/2 = 12 undirected Hamiltonian cycles
    assert len(_hamiltonian_cycles(get_topology("full:5"))) == 12


@pytest.mark.parametrize("spec", ["switch:6", "ring:5", "p3.16xlarge", "p2.16xlarge", "fattree:4", "ring:2"])
def test_plan_bytes_is_a_floor_on_the_transfers_planned(spec: str) -> None:
    """The estimate counts what ring/multiring/ps/tree hold: explicit transfers (ps) or the routes of their
    compact blocks (exactly where there is one ring or one tree), never more than a real schedule holds."""
    from gradsync.plan.synthesizers import ROUTE_BYTES, TRANSFER_BYTES, plan_bytes

    topo = get_topology(spec)
    for algorithm in ("ring", "multiring", "ps", "tree", "lp"):
        for pipeline in (1, 3):
            options = PlanOptions(pipeline=pipeline)
            need, what = plan_bytes(algorithm, topo, options)
            s = synthesize(algorithm, topo, options)
            routes = sum(len(b.routes) for b in s.blocks if b.kind == "ring") + sum(len(tr.edges) for tr in s.trees)
            if "transfers" in what:
                assert not s.blocks and round(need / TRANSFER_BYTES) <= len(s.explicit), (algorithm, pipeline, what)
            elif "routes" in what:
                assert round(need / ROUTE_BYTES) <= routes, (algorithm, pipeline, what, routes)
            if algorithm == "ps":
                assert round(need / TRANSFER_BYTES) == len(s.transfers), (algorithm, pipeline, what)
            if algorithm in ("multiring", "tree") and "routes" in what:
                assert round(need / ROUTE_BYTES) == routes, (algorithm, pipeline, what, routes)


def test_planning_too_large_is_refused_before_allocating() -> None:
    """switch:100000 used to allocate a 74.5 GiB shortest-path table; now PlanError says what it would
    need and which algorithm fits (the compact ring), and on switch:3000 that ps's explicit transfers do not."""
    import time

    t0 = time.monotonic()
    with pytest.raises(PlanError, match=r"needs at least 112 GiB \(a 100000 x 100001 shortest-path table\).*"
                                        r"'ring' fits.*--algorithm ring"):
        synthesize("lp", get_topology("switch:100000"))
    assert time.monotonic() - t0 < 30
    with pytest.raises(PlanError, match=r"'ps' on 'switch:3000'.*1\.8e\+07 transfers.*fits.*--algorithm "):
        synthesize("ps", get_topology("switch:3000"))
    with pytest.raises(PlanError, match="over the 9.31e-07 GiB limit"):
        synthesize("ring", get_topology("switch:8"), max_bytes=1000)
    assert synthesize("ring", get_topology("switch:8")).transfers


def test_auto_lives_in_sim_and_plan_alone_says_so():
    """``auto`` prices schedules with the runtime's cost model (sim, a layer above plan): it is no synthesizer,
    whatever was imported before, and plan's ``synthesize`` says where it is; ``gradsync.sim.synthesize`` plans
    it and every synthesizer, the same schedules as plan's."""
    import subprocess
    import sys

    code = ("import gradsync.sim\nfrom gradsync.plan import synthesize, SYNTHESIZERS\n"
            "from gradsync.topology import get_topology\n"
            "from gradsync.errors import PlanError\nassert 'auto' not in SYNTHESIZERS\n"
            "try:\n    synthesize('auto', get_topology('switch:3'))\nexcept PlanError as e:\n    print(e)\n"
            "print(gradsync.sim.synthesize('auto', get_topology('switch:3')).meta['auto']['chosen'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "is not a synthesizer" in lines[0] and "gradsync.sim.synthesize('auto'" in lines[0]
    assert lines[1] in SYNTHESIZERS.names()
    from gradsync.sim import algorithm_names
    from gradsync.sim import synthesize as synthesize_any

    assert algorithm_names() == [*SYNTHESIZERS.names(), "auto"]
    topo = get_topology("ring:4")
    for name in SYNTHESIZERS.names():
        if not SYNTHESIZERS.get(name).applicable(topo):
            assert synthesize_any(name, topo).to_dict() == synthesize(name, topo).to_dict(), name


def test_multiring_interleaves_rings():
    topo = get_topology("switch:4")
    s = synthesize("multiring", topo, PlanOptions(rings=3))
    assert s.meta["num_rings"] == 3 and len(s.chunks) == 12
    # each ring moves 1/3 of the buffer: per directed ring link, 2(n-1)/n * 1/3 in total
    loads = s.link_loads(topo).directed
    assert np.isclose(loads.max(), 2 * 3 / 4)
    # rings are rotated: their chunks complete on different ranks
    roots = [[s.chunks[r * 4 + p].root for p in range(4)] for r in range(3)]
    assert roots[0] != roots[1] != roots[2]
