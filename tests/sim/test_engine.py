"""The flow-level simulator: closed forms, the planner's cost as a floor, latency, conservation, tensors, CLI."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest

import gradsync.sim.engine as engine
from gradsync.errors import GradsyncError, ScheduleError
from gradsync.plan import Chunk, PlanOptions, Schedule, Transfer, evaluate, predicted_time, synthesize
from gradsync.sim import SimResult, SimulationError, plot_timeline, schedule_dependencies, simulate
from gradsync.topology import Device, Link, Topology, get_topology
from tests.conftest import random_topology

GB = 1e9


@pytest.fixture
def debug_invariants(monkeypatch):
    """Assert capacities and x_t <= min_d x_d after every event of the simulations in the test."""
    monkeypatch.setattr(engine, "_DEBUG", True)


def planned(schedule: Schedule, topo: Topology) -> float:
    return evaluate(schedule, topo, GB).cost


def with_latency(topo: Topology, latency_s: float) -> Topology:
    """The same topology with every link's latency set (what ``latency_s=`` overrides per hop)."""
    return dataclasses.replace(topo, links=tuple(dataclasses.replace(lk, latency_s=latency_s) for lk in topo.links))


# ---- bandwidth-only closed forms -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("algorithm", ["ring", "ps"])
@pytest.mark.parametrize("streaming", [True, False])
def test_ring_and_ps_on_a_switch_take_2_n_minus_1_over_n(n, algorithm, streaming, debug_invariants):
    topo = get_topology(f"switch:{n}")
    r = simulate(synthesize(algorithm, topo), topo, GB, streaming=streaming)
    assert r.gst_over_tf == pytest.approx(2 * (n - 1) / n, rel=1e-6)
    assert r.time_s == pytest.approx(2 * (n - 1) / n * GB / (1.25 * GB), rel=1e-6)
    assert r.t_f_s == pytest.approx(GB / 1.25e9)


@pytest.mark.parametrize("spec", ["p3.16xlarge", "p3.8xlarge"])
@pytest.mark.parametrize("algorithm", ["lp", "tree"])
def test_trees_stream_at_exactly_their_planned_cost(spec, algorithm, debug_invariants):
    topo = get_topology(spec)
    schedule = synthesize(algorithm, topo)
    cost = planned(schedule, topo)
    streamed = simulate(schedule, topo, GB)
    assert streamed.gst_over_tf == pytest.approx(cost, rel=1e-9)
    if (spec, algorithm) == ("p3.16xlarge", "lp"):
        assert streamed.gst_over_tf == pytest.approx(7 / 24, rel=1e-9)
    # Store-and-forward serialises the tree's levels: strictly slower, but no step takes longer than the
    # whole planned cost (a step's load on any link is at most the schedule's), so <= cost * steps.
    saf = simulate(schedule, topo, GB, streaming=False)
    assert saf.gst_over_tf > cost * (1 + 1e-3)
    assert saf.gst_over_tf <= cost * schedule.num_steps * (1 + 1e-9)


def test_single_tree_store_and_forward_is_one_planned_cost_per_step():
    topo = get_topology("p3.16xlarge")
    schedule = synthesize("tree", topo)  # one flow per link direction per step, all on 50 GB/s links
    r = simulate(schedule, topo, GB, streaming=False)
    assert r.gst_over_tf == pytest.approx(0.5 * schedule.num_steps, rel=1e-9)


def test_per_flow_fairness_is_not_what_the_planner_assumes():
    """Trees of different weights share links; per-flow max-min gives them equal rates, so lp loses."""
    topo = get_topology("p3.16xlarge")
    schedule = synthesize("lp", topo)
    r = simulate(schedule, topo, GB, fairness="flow")
    assert r.gst_over_tf > 7 / 24 * (1 + 1e-3)
    assert r.gst_over_tf >= planned(schedule, topo) * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_any_schedule_respects_links_dependencies_and_conservation(seed, debug_invariants):
    topo = random_topology(4 + seed % 4, seed % 4, seed)
    for algorithm in ("lp", "ring", "tree", "ps"):
        schedule = synthesize(algorithm, topo, PlanOptions(pipeline=1 + seed % 3))
        cost = planned(schedule, topo)
        deps = schedule.dependencies()
        loads = schedule.link_loads(topo).directed
        for streaming in (True, False):
            for latency_s in (None, 1e-4):
                r = simulate(schedule, topo, GB, streaming=streaming, latency_s=latency_s)
                # Links can't beat their load; with size-weighted sharing streaming attains it (no latency).
                assert r.gst_over_tf >= cost * (1 - 1e-9)
                if streaming and latency_s is None:
                    assert r.gst_over_tf == pytest.approx(cost, rel=1e-9)
                # Conservation: busy time = load * bytes / bandwidth, for every link direction.
                expect = loads * GB / (r.link_bandwidth_GBps * 1e9)
                np.testing.assert_allclose(r.link_busy_s, expect, rtol=1e-9, atol=1e-15)
                np.testing.assert_allclose(r.link_bytes, loads * GB, rtol=1e-9, atol=1e-3)
                assert np.all(r.link_utilisation <= 1 + 1e-9)
                # The timeline honours the dependencies of the chosen mode.
                for t, ds in enumerate(deps):
                    for d in ds:
                        if streaming:
                            assert r.start_s[t] >= r.start_s[d] - 1e-12
                            assert r.sent_s[t] >= r.sent_s[d] * (1 - 1e-9)
                            assert r.finish_s[t] >= r.finish_s[d] - 1e-12
                        else:
                            assert r.start_s[t] >= r.finish_s[d] * (1 - 1e-12)
                assert r.time_s == pytest.approx(r.finish_s.max())


def _window_rates(self):
    """The rates as the engine computed them before it kept to the active flows: progressive filling over every
    flow of the window (:meth:`_Engine._rates`, which still serves the capped case), read at the active ones."""
    rate, used = engine._Engine._rates(self, self.x[self.lo:self.hi])
    at = np.flatnonzero(self.act)
    return at, rate[at], used


@pytest.mark.parametrize("spec, algorithm, pipeline", [("racks:2,3,4", "forest", 8), ("racks:2,3,4", "hierarchical", 4),
                                                       ("switch:5", "ring", 2), ("random", "lp", 3)])
def test_uncapped_rates_are_the_same_bits_over_the_window_the_active_flows_and_in_python(
        monkeypatch, spec, algorithm, pipeline):
    """Without dependency caps (store-and-forward, what the runtime's cost model prices) the rates are filled over
    the active flows alone, and for a few of them in plain Python (FEW_ACTIVE), over every link direction or, on a
    large fabric (FEW_DIRECTIONS), over those their routes touch: every way gives the same bits as filling over the
    whole window, the FIFO connections, receiver costs, token buckets and reverse share included."""
    topo = random_topology(6, 3, 1) if spec == "random" else get_topology(spec)
    schedule = synthesize(algorithm, topo, PlanOptions(pipeline=pipeline))
    runs = {}
    for way in ("window", "vectorised", "python", "python-touched"):
        with monkeypatch.context() as m:
            m.setattr(engine, "FEW_ACTIVE", 0 if way == "vectorised" else 10**9)
            m.setattr(engine, "FEW_DIRECTIONS", 0 if way == "python-touched" else 10**9)
            if way == "window":
                m.setattr(engine._Engine, "_uncapped_rates", _window_rates)
            calls = []
            real = engine._Engine._few_rates
            m.setattr(engine._Engine, "_few_rates", lambda self, calls=calls, real=real: calls.append(1) or real(self))
            for size in (3e5, 2e7):
                for kw in ({"fifo": True, "message_s": 1e-3, "burst_s": 4e-3, "reverse_share": 0.05}, {}):
                    r = simulate(schedule, topo, size, streaming=False, **kw)
                    runs.setdefault(way, []).append((r.time_s, r.start_s, r.sent_s, r.finish_s, r.events, r.fill_rounds))
        assert bool(calls) == way.startswith("python"), way  # each way ran as named
    for way in ("vectorised", "python", "python-touched"):
        for got, want in zip(runs[way], runs["window"]):
            assert got[0] == want[0] and got[4:] == want[4:], (way, got[0], want[0])
            for a, b in zip(got[1:4], want[1:4]):
                np.testing.assert_array_equal(a, b)


def test_dependencies_match_the_schedule():
    for spec, algorithm in [("p3.16xlarge", "lp"), ("switch:5", "ps"), ("ring:5", "ring")]:
        schedule = synthesize(algorithm, get_topology(spec), PlanOptions(pipeline=2))
        ptr, idx = schedule_dependencies(schedule)
        mine = [sorted(idx[ptr[i]:ptr[i + 1]].tolist()) for i in range(len(schedule.transfers))]
        assert mine == [sorted(d) for d in schedule.dependencies()]


# ---- latency ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["ring:2", "ring:3", "ring:5", "switch:2", "switch:3", "switch:5"])
def test_store_and_forward_ring_pays_2_n_minus_1_route_latencies(spec):
    """α is per hop; a route's latency is the sum over its hops (2 on switch:N: host -> switch -> host)."""
    alpha = 1e-4
    topo = get_topology(spec)
    n = topo.world_size
    schedule = synthesize("ring", topo)
    hops = len(schedule.transfers[0].route) - 1
    assert hops == (2 if spec.startswith("switch") else 1)
    base = simulate(schedule, topo, GB, streaming=False)
    r = simulate(schedule, topo, GB, streaming=False, latency_s=alpha)
    assert r.time_s - base.time_s == pytest.approx(2 * (n - 1) * hops * alpha, rel=1e-9)
    # The same through the links' own latency, and the planner's α-β estimate agrees exactly.
    own = simulate(schedule, with_latency(topo, alpha), GB, streaming=False)
    assert own.time_s == pytest.approx(r.time_s, rel=1e-12)
    assert r.time_s == pytest.approx(predicted_time(schedule, topo, GB, alpha), rel=1e-9)
    assert simulate(schedule, with_latency(topo, alpha), GB, streaming=False, latency=False).time_s == pytest.approx(base.time_s)


def _path_broadcast(hops: int, bw: float = 10.0) -> tuple[Topology, Schedule]:
    devs = tuple(Device(f"g{i}", "gpu") for i in range(hops + 1))
    links = tuple(Link(f"g{i}", f"g{i + 1}", bw) for i in range(hops))
    topo = Topology(f"path{hops}", devs, links)
    transfers = tuple(Transfer(0, i, i + 1, (f"g{i}", f"g{i + 1}"), False, i) for i in range(hops))
    schedule = Schedule("chain", topo.name, topo.ranks, (Chunk(0.0, 1.0, 0),), transfers, collective="broadcast")
    schedule.check(topo)
    return topo, schedule


def test_streaming_latency_is_cut_through_on_a_chain():
    """A chain of h hops: streaming pays M/β + h α (cut-through), store-and-forward h (M/β + α)."""
    h, alpha, size = 4, 1e-3, 1e8
    topo, schedule = _path_broadcast(h)
    wire = size / 10e9
    assert simulate(schedule, topo, size, latency_s=alpha).time_s == pytest.approx(wire + h * alpha, rel=1e-12)
    assert simulate(schedule, topo, size, latency_s=alpha, streaming=False).time_s == pytest.approx(h * (wire + alpha), rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_streaming_ring_latency_follows_the_documented_model(n):
    """Ring on ring:N, streaming, per-hop α: the closed form of the model in gradsync.sim.engine.

    Each link direction carries K = 2(N-1) flows of M bytes; flow s starts at s α (α after its input
    started) and they share the link equally, so (processor sharing) flow j finishes gap_j = α (K-j-1)/(j+1)
    before flow j+1, the last at T = K M / β. The last byte of flow s arrives at f_s = max(sent_s, f_{s-1}) + α.
    Latency mostly hides behind bandwidth: α <= extra <= 2(N-1) α.
    """
    alpha = 1e-6
    topo = get_topology(f"ring:{n}")
    schedule = synthesize("ring", topo)
    r = simulate(schedule, topo, GB, latency_s=alpha)
    k = 2 * (n - 1)
    t_bw = simulate(schedule, topo, GB).time_s
    sent = [t_bw]
    for j in range(k - 2, -1, -1):
        sent.insert(0, sent[0] - alpha * (k - j - 1) / (j + 1))
    f = 0.0
    for s in range(k):
        f = max(sent[s], f) + alpha
    assert r.time_s == pytest.approx(f, rel=1e-12, abs=1e-15)
    extra = r.time_s - t_bw
    assert alpha * (1 - 1e-6) <= extra <= k * alpha * (1 + 1e-6)


# ---- tensor lists ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, algorithm", [("switch:4", "ring"), ("switch:5", "ps"), ("ring:6", "ring")])
@pytest.mark.parametrize("streaming", [True, False])
def test_a_tensor_list_takes_as_long_as_its_sum(spec, algorithm, streaming):
    topo = get_topology(spec)
    schedule = synthesize(algorithm, topo)
    whole = simulate(schedule, topo, 3e8, streaming=streaming).time_s
    merged = simulate(schedule, topo, [1e8, 2e8], streaming=streaming)
    split = simulate(schedule, topo, [1e8, 2e8], streaming=streaming, merge_tensors=False)
    assert merged.time_s == pytest.approx(whole, rel=1e-9)
    assert split.time_s == pytest.approx(whole, rel=1e-9)
    assert merged.num_flows == len(schedule.transfers) and split.num_flows == 2 * len(schedule.transfers)
    assert set(split.flow_tensor.tolist()) == {0, 1} and set(merged.flow_tensor.tolist()) == {-1}
    assert simulate(schedule, topo, [0, 3e8], streaming=streaming, merge_tensors=False).time_s == pytest.approx(whole, rel=1e-9)


def test_per_tensor_flows_pipeline_store_and_forward():
    """Separate messages per tensor let a small tensor's hop go on while a big one is still in flight."""
    topo = get_topology("p3.16xlarge")
    schedule = synthesize("tree", topo)
    merged = simulate(schedule, topo, [1e8] * 4, streaming=False, fairness="flow")
    split = simulate(schedule, topo, [1e7, 3e7, 1e8, 2.6e8], streaming=False, fairness="flow", merge_tensors=False)
    assert split.size_bytes == merged.size_bytes
    assert split.time_s < merged.time_s
    start, finish = split.transfer_times()
    assert start.shape == (len(schedule.transfers),) and np.all(finish > start)


# ---- results, timeline, errors ---------------------------------------------------------------------------
def test_result_is_plain_data(tmp_path):
    topo = get_topology("p2.8xlarge")
    r = simulate(synthesize("lp", topo), topo, 1e8)
    assert isinstance(r, SimResult)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.time_s = 0.0  # type: ignore[misc]
    d = json.loads(json.dumps(r.to_dict()))
    assert d["type"] == "gradsync.simulation" and d["mode"] == "streaming"
    assert len(d["links"]) == len(topo.links) and set(d["link_classes"]) == {"pcie-card", "pcie-board"}
    assert max(x["utilisation_ab"] for x in d["links"]) == pytest.approx(1.0)
    assert r.max_active_flows <= r.num_flows and r.events >= 1


@pytest.mark.parametrize("by, name", [("link", "t.png"), ("rank", "t.svg")])
def test_timeline_plot(tmp_path, by, name):
    topo = get_topology("p3.8xlarge")
    r = simulate(synthesize("lp", topo, PlanOptions(pipeline=2)), topo, GB, streaming=False, latency_s=1e-5)
    out = plot_timeline(r, tmp_path / name, by=by)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" if name.endswith(".png") else b"<svg" in data[:2000]
    with pytest.raises(SimulationError, match="must end in"):
        plot_timeline(r, tmp_path / "t.txt")


def test_progress_lines(monkeypatch, capsys):
    monkeypatch.setattr(engine, "_PROGRESS_EVERY_S", 0.0)
    topo = get_topology("ring:4")
    schedule = synthesize("ring", topo)
    stream = io.StringIO()
    simulate(schedule, topo, GB, streaming=False, progress=stream)
    lines = stream.getvalue().splitlines()
    assert lines and all(line.startswith("gradsync simulate: ring on ring:4") for line in lines)
    simulate(schedule, topo, GB, streaming=False, progress=True)
    assert "flows done" in capsys.readouterr().err
    simulate(schedule, topo, GB, streaming=False, progress=False)
    simulate(schedule, topo, GB, streaming=False)  # stderr is not a terminal under pytest
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kwargs, message", [
    ({"size_bytes": -1.0}, "must be a finite number"),
    ({"size_bytes": []}, "tensor list is empty"),
    ({"size_bytes": [0, 0]}, "add up to 0"),
    ({"size_bytes": "1GB"}, "must be a number"),
    ({"size_bytes": 1e9, "fairness": "tcp"}, "fairness='tcp'"),
    ({"size_bytes": 1e9, "latency_s": -1.0}, "latency_s=-1.0"),
])
def test_bad_input_is_a_gradsync_error(kwargs, message):
    topo = get_topology("ring:3")
    schedule = synthesize("ring", topo)
    with pytest.raises(GradsyncError, match=message):
        simulate(schedule, topo, **kwargs)


def test_schedule_for_other_ranks_is_rejected():
    with pytest.raises(ScheduleError, match="plan it again"):
        simulate(synthesize("ring", get_topology("ring:3")), get_topology("ring:4"), GB)


# ---- late ranks (start_delay_s) ------------------------------------------------------------------------------
def _chain(topo: Topology) -> Schedule:
    """Rank 0's buffer copied to rank 1 (step 0), which forwards it to rank 2 (step 1)."""
    return Schedule("chain", topo.name, topo.ranks, (Chunk(0.0, 1.0, 0),),
                    (Transfer(0, 0, 1, ("host0", "sw0", "host1"), False, 0),
                     Transfer(0, 1, 2, ("host1", "sw0", "host2"), False, 1)), collective="broadcast")


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("delay_in_hops", [0.0, 0.5, 1.0, 3.0])
def test_a_late_sender_starts_at_its_arrival(streaming, delay_in_hops, debug_invariants):
    """Closed forms on switch:3, hop time h = M/β. Rank 1 late by d: it forwards at max(arrival of its input, d),
    so the chain ends at max(h, d) + h (store-and-forward); streaming, the forward starts at d and trails the
    first hop, ending at max(h, d + h) = d + h. The late rank *receiving* is not held back."""
    topo = get_topology("switch:3")
    hop = GB / 1.25e9
    d = delay_in_hops * hop
    r = simulate(_chain(topo), topo, GB, streaming=streaming, start_delay_s=[0.0, d, 0.0], progress=False)
    expected = d + hop if streaming else max(hop, d) + hop
    assert r.time_s == pytest.approx(expected, rel=1e-9)
    assert r.start_s[1] == pytest.approx(d if streaming else max(hop, d), rel=1e-9, abs=1e-12)
    # Late by d as the first sender: the whole chain shifts by d; as the last receiver: nothing changes.
    first = simulate(_chain(topo), topo, GB, streaming=streaming, start_delay_s={0: d}, progress=False)
    assert first.time_s == pytest.approx(d + (hop if streaming else 2 * hop), rel=1e-9)
    last = simulate(_chain(topo), topo, GB, streaming=streaming, start_delay_s={2: d}, progress=False)
    assert last.time_s == pytest.approx(hop if streaming else 2 * hop, rel=1e-9)


def test_no_delay_is_the_old_simulation():
    topo = get_topology("switch:4")
    schedule = synthesize("ring", topo, PlanOptions(pipeline=2))
    base = simulate(schedule, topo, GB, progress=False)
    for none in (None, {}, [0.0] * 4, {2: 0}):
        same = simulate(schedule, topo, GB, start_delay_s=none, progress=False)
        assert same.time_s == base.time_s and np.array_equal(same.finish_s, base.finish_s)
        assert same.start_delay_s == () and "start_delay_s" not in same.to_dict(links=False)
    late = simulate(schedule, topo, GB, start_delay_s={2: 0.5}, progress=False)
    assert late.start_delay_s == (0.0, 0.0, 0.5, 0.0) and late.to_dict(links=False)["start_delay_s"] == [0, 0, 0.5, 0]


@pytest.mark.parametrize("bad,match", [
    ([0.0, 1.0], r"start_delay_s has 2 values for 4 ranks"),
    ({4: 1.0}, r"start_delay_s names rank 4; the topology has ranks 0\.\.3"),
    ({True: 1.0}, r"names rank True"),
    ([0.0, -1.0, 0.0, 0.0], r"start_delay_s\[1\]=-1\.0 must be a finite number of seconds >= 0"),
    ({0: float("nan")}, r"start_delay_s\[0\]=nan"),
    ({0: "1"}, r"start_delay_s\[0\]='1'"),
])
def test_bad_start_delays_name_the_value(bad, match):
    topo = get_topology("switch:4")
    with pytest.raises(SimulationError, match=match):
        simulate(synthesize("ring", topo), topo, GB, start_delay_s=bad, progress=False)


# ---- token buckets (burst_s) -----------------------------------------------------------------------------------
def _burst_time(m: float, tokens: float, rate: float) -> float:
    """One message of ``m`` bytes over a link of ``rate`` B/s whose bucket holds ``tokens``: at PEAK x rate while
    the tokens last (they drain at PEAK x rate - rate), then at the rate."""
    peak = engine.BURST_PEAK * rate
    t1 = tokens / (peak - rate)
    return m / peak if m <= peak * t1 else t1 + (m - peak * t1) / rate


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("burst_over_message", [0.0, 0.3, 0.999, 2.0])
def test_a_burst_crosses_faster_then_the_link_runs_at_its_rate(streaming, burst_over_message, debug_invariants):
    """The chain on switch:3, one buffer of M: each hop is its own pair of link directions with a full bucket,
    so each hop takes the closed form above (store-and-forward: one after the other)."""
    topo = get_topology("switch:3")
    rate = 1.25e9
    burst_s = burst_over_message * GB / rate
    r = simulate(_chain(topo), topo, GB, streaming=False, latency_s=0.0, burst_s=burst_s, progress=False)
    assert r.time_s == pytest.approx(2 * _burst_time(GB, burst_s * rate, rate), rel=1e-9)
    assert r.to_dict(links=False).get("burst_s", 0.0) == burst_s
    if burst_over_message == 0:
        assert r.time_s == simulate(_chain(topo), topo, GB, streaming=False, latency_s=0.0, progress=False).time_s


@pytest.mark.parametrize("gap_over_burst", [0.0, 0.25, 3.0])
def test_a_bucket_is_spent_once_per_collective(gap_over_burst, debug_invariants):
    """Two messages on one connection (fifo), α apart: the first spends the bucket and the second runs at the
    rate, whatever the gap (buckets are full at the start and not refilled within a collective). Closed form."""
    topo = get_topology("switch:2")
    rate, m, burst_s = 1.25e9, 0.5 * GB, 0.1
    alpha = gap_over_burst * burst_s
    route = ("host0", "sw0", "host1")
    schedule = Schedule("two", topo.name, topo.ranks, (Chunk(0.0, 0.5, 0), Chunk(0.5, 0.5, 0)),
                        (Transfer(0, 0, 1, route, False, 0), Transfer(1, 0, 1, route, False, 0)), collective="broadcast")
    r = simulate(schedule, topo, GB, streaming=False, fifo=True, message_s=alpha, latency_s=0.0, burst_s=burst_s,
                 progress=False)
    first = _burst_time(m, burst_s * rate, rate)
    assert r.time_s == pytest.approx(first + alpha + m / rate + alpha, rel=1e-9)


def test_bursts_on_a_busy_fabric_keep_every_invariant(debug_invariants):
    """A ring and a pipelined tree on a fat-tree with buckets: capacities (rate or peak) hold after every event,
    bytes are conserved, and the buckets can only make a schedule faster, never slower than 1 / PEAK of it."""
    topo = get_topology("fattree:4")
    for alg, p in (("ring", 1), ("tree", 4)):
        schedule = synthesize(alg, topo, PlanOptions(pipeline=p))
        plain = simulate(schedule, topo, 64e6, streaming=False, fifo=True, message_s=1e-4, progress=False)
        fast = simulate(schedule, topo, 64e6, streaming=False, fifo=True, message_s=1e-4, burst_s=2e-4,
                        progress=False)
        assert plain.time_s / engine.BURST_PEAK <= fast.time_s < plain.time_s
        assert fast.link_bytes.sum() == pytest.approx(plain.link_bytes.sum(), rel=1e-9)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), True, "4ms"])
def test_bad_burst_names_the_value(bad):
    topo = get_topology("switch:3")
    with pytest.raises(SimulationError, match=r"burst_s=.* must be a finite number of seconds >= 0"):
        simulate(_chain(topo), topo, GB, burst_s=bad, progress=False)
