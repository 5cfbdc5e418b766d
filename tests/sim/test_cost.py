"""The runtime's cost model (gradsync.sim.cost): closed forms, calibration input (the chooser: test_choose.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

import gradsync.sim.engine as engine_module
from gradsync.comm.tuning import load_cost_model
from gradsync.errors import GradsyncError, PlanError, SimulationError
from gradsync.plan import synthesize
from gradsync.plan.schedule import Chunk, Schedule, Transfer
from gradsync.sim import simulate
from gradsync.sim.cost import CostModel, burst_of, native_schedule, reverse_share_of, size_class, stream_rate_of
from gradsync.topology import get_topology


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("alpha", [0.0, 1e-4, 1e-2])
def test_native_ring_is_the_store_and_forward_closed_form(n, alpha):
    """gloo's ring in rank order: 2(N-1) steps of M/N bytes, each taking the longer of its wire time and α (the
    backend's per-step cost runs while the step's bytes arrive): 2(N-1) max(M/(Nβ), α). The executor's α stays
    in series: the same ring on the executor's price pays M/(Nβ) + α per step."""
    t = get_topology(f"ring:{n}")
    beta = t.links[0].bandwidth_GBps * 1e9
    m = 3e7
    step = m / (n * beta)
    assert (alpha > step) == (alpha == 1e-2)  # both regimes are covered
    model = CostModel(native_message_s=alpha, message_s=alpha)
    assert model.predict_native(t, m) == pytest.approx(2 * (n - 1) * max(step, alpha), rel=1e-9)
    assert model.predict(native_schedule(t), t, m) == pytest.approx(2 * (n - 1) * (step + alpha), rel=1e-9)


def test_bidirectional_ring_halves_the_bytes_per_step():
    t = get_topology("ring:4")
    beta = t.links[0].bandwidth_GBps * 1e9
    m = 8e6
    got = CostModel(message_s=0.0).predict(synthesize("ring", t), t, m)
    assert got == pytest.approx(2 * 3 * m / (2 * 4 * beta), rel=1e-9)


def _chain(hops: int, pipeline: int) -> Schedule:
    """A buffer in ``pipeline`` sub-chunks relayed along ranks 0 -> 1 -> ... -> hops of ``ring:hops+1``."""
    chunks = tuple(Chunk(j / pipeline, 1 / pipeline, 0) for j in range(pipeline))
    transfers = tuple(Transfer(j, k, k + 1, (f"gpu{k}", f"gpu{k + 1}"), False, k)
                      for j in range(pipeline) for k in range(hops))
    return Schedule("chain", f"ring:{hops + 1}", tuple(f"gpu{i}" for i in range(hops + 1)), chunks, transfers,
                    collective="broadcast")


@pytest.mark.parametrize("hops,pipeline", [(1, 1), (2, 4), (3, 8), (4, 3)])
@pytest.mark.parametrize("alpha", [0.0, 3e-4])
def test_pipelined_chain_is_the_closed_form(hops, pipeline, alpha):
    """One message at a time per connection and per receiver: sub-chunk j leaves hop k at (k + j + 1)(τ + α),
    so the chain takes (h + P - 1)(M/(Pβ) + α) -- pipelining pays only where the bytes outweigh α."""
    t = get_topology(f"ring:{hops + 1}")
    beta = t.links[0].bandwidth_GBps * 1e9
    m = 4e7
    got = CostModel(message_s=alpha).predict(_chain(hops, pipeline), t, m)
    assert got == pytest.approx((hops + pipeline - 1) * (m / (pipeline * beta) + alpha), rel=1e-9)


def test_a_receiver_handles_its_messages_one_at_a_time():
    """Three ranks send to rank 0 of a switch at once: they share its link (3M/β), then rank 0 handles the
    three arrivals one after another (3α) -- the fan-in a parameter server's owner pays."""
    t = get_topology("switch:4")
    beta = t.links[0].bandwidth_GBps * 1e9
    m, alpha = 1e6, 2e-4
    routes = [(f"host{i}", "sw0", "host0") for i in range(1, 4)]
    s = Schedule("gather", "switch:4", tuple(f"host{i}" for i in range(4)), (Chunk(0.0, 1.0, 0),),
                 tuple(Transfer(0, i, 0, r, True, 0) for i, r in zip(range(1, 4), routes)), collective="reduce")
    assert CostModel(message_s=alpha).predict(s, t, m) == pytest.approx(3 * m / beta + 3 * alpha, rel=1e-9)


def test_measured_rates_and_goodput_scale_the_links():
    t = get_topology("ring:4")
    s = synthesize("ring", t)
    base = CostModel(message_s=0.0).predict(s, t, 1e8)
    kind = t.links[0].kind
    slow = CostModel(message_s=0.0, link_GBps={kind: t.links[0].bandwidth_GBps / 2}, goodput=0.5).predict(s, t, 1e8)
    assert slow == pytest.approx(4 * base, rel=1e-9)


def test_a_runtimes_scaled_links_keep_their_scales_under_measured_class_rates():
    """A belief that links run slow (gradsync.comm.watch.scaled_topology) is applied after the class rate that
    replaces the file's: with every link of ring:4 at half, the ring takes twice as long under a model with measured
    class rates, as under one without (the class rate used to replace the scaled rate, and the belief was lost)."""
    from gradsync.comm.watch import scaled_topology

    t = get_topology("ring:4")
    s = synthesize("ring", t)
    kind = t.links[0].kind
    measured = CostModel(message_s=0.0, link_GBps={kind: 0.2}, goodput=0.5)
    halved = scaled_topology(t, {(e, d): 0.5 for e in range(len(t.links)) for d in (0, 1)})
    assert measured.predict(s, halved, 1e8) == pytest.approx(2 * measured.predict(s, t, 1e8), rel=1e-9)
    one = scaled_topology(scaled_topology(t, {(0, 0): 0.5}), {(0, 0): 0.5, (0, 1): 0.8})  # scales compose
    rated = measured.rates(one)
    assert rated.links[0].directed_GBps == pytest.approx((0.2 * 0.5 * 0.25, 0.2 * 0.5 * 0.8))
    assert rated.links[1].directed_GBps == pytest.approx((0.1, 0.1)) and rated.links[1].bandwidth_down_GBps is None


def test_a_calibration_stream_far_below_the_files_rate_rescales_every_class():
    """racks:2,3,4 as built (10 Gbit/s NICs, 2.5 Gbit/s uplinks) on a wire 25x slower: rank 0 -> rank 3
    crosses the uplink, 0.3125 GB/s x goodput 0.96 in the file; the stream measured 1/25 of that, so every
    link shrinks 25x (through goodput) and keeps its 4:1 ratio, and auto then sees what the wire costs."""
    t = get_topology("racks:2,3,4")
    model = CostModel(goodput=0.96)
    assert model.path_GBps(t, 0, 3) == pytest.approx(0.3125 * 0.96)
    assert model.path_GBps(t, 0, 1) == pytest.approx(1.25 * 0.96)
    # every path from rank 0 at once (what calibration picks its far rank from): the same rates, with hops
    paths = model.paths_from(t, 0)
    assert paths[0] == (math.inf, 0) and paths[1] == (pytest.approx(1.25 * 0.96), 2)
    assert paths[3] == (pytest.approx(0.3125 * 0.96), 4)
    assert [g for g, _ in paths[1:]] == pytest.approx([model.path_GBps(t, 0, p) for p in range(1, 6)])
    nbytes = 4 << 20
    seconds = nbytes / (0.3125 * 0.96 / 25 * 1e9)
    refined, note = model.refined(t, 0, 3, nbytes, seconds)
    assert refined.path_GBps(t, 0, 3) == pytest.approx(0.3125 * 0.96 / 25)
    assert refined.path_GBps(t, 0, 1) == pytest.approx(1.25 * 0.96 / 25)  # the file's ratio between classes
    assert refined.goodput == pytest.approx(0.96 / 25) and refined.link_GBps == model.link_GBps
    assert refined.message_s == model.message_s
    assert note is not None and "25.0x below" in note and note in refined.source
    # a measured rate already in link_GBps is scaled from there, not from the file
    measured = CostModel(link_GBps={"uplink": 0.1}, goodput=1.0)
    again, _ = measured.refined(t, 0, 3, nbytes, nbytes / (0.1 / 4 * 1e9))
    assert again.path_GBps(t, 0, 3) == pytest.approx(0.025) and again.link_GBps == {"uplink": 0.1}
    # links of one class at different rates keep their ratio (a file with one kind for everything)
    mixed = get_topology("racks:2,3,4")
    mixed = replace(mixed, links=tuple(replace(lk, kind="network") for lk in mixed.links))
    slow, _ = CostModel().refined(mixed, 0, 3, nbytes, nbytes / (0.3125 / 25 * 1e9))
    assert slow.path_GBps(mixed, 0, 3) == pytest.approx(0.3125 / 25)
    assert slow.path_GBps(mixed, 0, 1) == pytest.approx(1.25 / 25)
    # the prediction follows: a 13 MB native ring now costs what the slower wire makes it cost
    assert refined.predict_native(t, 13e6) > 20 * model.predict_native(t, 13e6)


@pytest.mark.parametrize("factor", [1.0, 1.9, 0.01])  # within RATE_TOLERANCE, or faster than the file (loopback)
def test_a_calibration_stream_near_or_above_the_files_rate_changes_nothing(factor):
    t = get_topology("racks:2,3,4")
    model = CostModel(goodput=0.96)
    seconds = (4 << 20) / (model.path_GBps(t, 0, 3) * 1e9) * factor
    refined, note = model.refined(t, 0, 3, 4 << 20, seconds)
    assert refined is model and note is None


@pytest.mark.parametrize("nbytes, seconds", [(4 << 20, 0.0), (4 << 20, -1.0), (0, 0.1), (4 << 20, float("nan")),
                                             (4 << 20, float("inf")), (True, 0.1)])
def test_a_measurement_that_is_not_a_rate_keeps_the_files_rates_and_says_so(nbytes, seconds):
    t = get_topology("racks:2,3,4")
    model = CostModel()
    refined, note = model.refined(t, 0, 3, nbytes, seconds)
    assert refined is model and note is not None and "not a positive rate" in note


@pytest.mark.parametrize("kappa", [0.0, 0.03, 0.2])
def test_reverse_share_is_measured_on_the_extra_bytes_not_the_start(kappa):
    """One stream: α + M/β; both ways: α + s + M(1+κ)/β, s a start-up that no later byte pays (two streams
    ramping into one bottleneck). Plain both/one over-counts κ by s/(α + M/β); the difference of two sizes
    gives κ exactly, whatever s and α are."""
    beta, alpha, start = 12.5e6, 1e-3, 0.045
    rows = []
    for m_small, m_large in ((2e6, 4e6), (2.1e6, 4.2e6), (1.9e6, 4e6)):
        rows.append((alpha + m_small / beta, alpha + m_large / beta, alpha + start + m_small * (1 + kappa) / beta,
                     alpha + start + m_large * (1 + kappa) / beta))
    assert reverse_share_of(rows) == pytest.approx(kappa, abs=1e-12)
    plain = rows[0][3] / rows[0][1] - 1
    assert plain > kappa + 0.1  # what a single size would have said


def test_reverse_share_skips_noise_falls_back_and_stays_in_range():
    # a repetition where the larger transfer was not slower (noise, loopback) is skipped
    assert reverse_share_of([(1.0, 2.0, 1.0, 2.1), (1.0, 0.9, 1.0, 5.0)]) == pytest.approx(0.1)
    # none usable: the large transfers' plain ratio stands in
    assert reverse_share_of([(0.002, 0.002, 0.002, 0.0024)]) == pytest.approx(0.2)
    # kept in [0, cap]
    assert reverse_share_of([(1.0, 2.0, 1.0, 1.5)]) == 0.0
    assert reverse_share_of([(1.0, 2.0, 1.0, 4.0)], cap=0.5) == 0.5
    with pytest.raises(PlanError, match="one m, one M, both m, both M"):
        reverse_share_of([(1.0, 2.0)])
    with pytest.raises(PlanError, match="one m, one M, both m, both M"):
        reverse_share_of([])


@pytest.mark.parametrize("start", [0.0, 0.02, 0.3])
def test_a_streams_rate_is_measured_on_the_extra_bytes_not_the_start(start):
    """One stream of b bytes takes ``start + b / β`` (connection warm-up, TCP's window, α: paid once). The
    rate from the extra bytes of the larger transfer is β whatever the start; the whole transfer alone reads
    slower by ``start / (M / β)``, and so would a calibration that rescales the links with it."""
    beta = 7.5e6  # 60 Mbit/s
    small, large = 2 << 20, 4 << 20
    # noise only adds time: a busy spell slows one repetition of either size, never speeds one up
    rows = [(start + small / beta, start + large / beta + 0.2), (start + small / beta + 0.1, start + large / beta),
            (start + small / beta + 0.05, start + large / beta + 0.3)]
    nbytes, seconds = stream_rate_of(rows, small, large)
    assert nbytes == large - small and nbytes / seconds == pytest.approx(beta, rel=1e-9)
    whole = large / rows[1][1]
    assert whole == pytest.approx(beta / (1 + start * beta / large), rel=1e-9)  # what the whole stream says
    # through the model: the refined path rate is the wire's β, not the start-diluted one
    t = get_topology("racks:2,3,4")
    refined, _ = CostModel().refined(t, 0, 3, nbytes, seconds)
    assert refined.path_GBps(t, 0, 3) == pytest.approx(beta / 1e9, rel=1e-9)


def test_a_streams_rate_falls_back_to_the_whole_transfer_where_noise_hides_the_extra_bytes():
    # loopback: the fastest larger transfer was not slower than the fastest smaller; it stands in whole
    assert stream_rate_of([(0.002, 0.0019), (0.003, 0.001), (0.0015, 0.002)], 100, 200) == (200.0, 0.001)
    # each size's fastest repetition, whichever repetitions they come from
    assert stream_rate_of([(1.0, 3.5), (1.5, 3.0)], 100, 300) == (200.0, 2.0)
    with pytest.raises(PlanError, match="one way small, one way large"):
        stream_rate_of([(1.0, 2.0, 3.0)], 100, 200)
    with pytest.raises(PlanError, match="0 < small_bytes < large_bytes"):
        stream_rate_of([(1.0, 2.0)], 200, 100)


def _pair(routes: list[tuple[int, int]], topology: str, hosts: int) -> Schedule:
    """One whole-buffer message per ``(src, dst)`` of ``routes`` at step 0, each its own chunk, on a switch."""
    chunks = tuple(Chunk(0.0, 1.0, src) for src, _ in routes)
    transfers = tuple(Transfer(i, a, b, (f"host{a}", "sw0", f"host{b}"), False, 0) for i, (a, b) in enumerate(routes))
    return Schedule("pairs", topology, tuple(f"host{i}" for i in range(hosts)), chunks, transfers,
                    collective="broadcast")


@pytest.mark.parametrize("kappa", [0.0, 0.05, 0.2])
def test_a_link_loaded_both_ways_carries_one_over_one_plus_kappa_each_way(kappa):
    """κ of a stream's rate runs against it (acknowledgements): an exchange over one switch takes
    M(1 + κ)/β, a lone stream M/β, and fan-in from two senders 2M/β, as measured on the testbed (fan-in
    and fan-out lose nothing, a link loaded both ways loses κ)."""
    t = get_topology("switch:3")
    beta = t.links[0].bandwidth_GBps * 1e9
    m = 1e7
    model = CostModel(message_s=0.0, reverse_share=kappa)
    assert model.predict(_pair([(0, 1)], "switch:3", 3), t, m) == pytest.approx(m / beta, rel=1e-9)
    assert model.predict(_pair([(0, 1), (1, 0)], "switch:3", 3), t, m) == pytest.approx(m * (1 + kappa) / beta, rel=1e-9)
    assert model.predict(_pair([(1, 0), (2, 0)], "switch:3", 3), t, m) == pytest.approx(2 * m / beta, rel=1e-9)
    with pytest.raises(SimulationError, match=r"reverse_share=1.5 must lie in \[0, 1\)"):
        simulate(_pair([(0, 1)], "switch:3", 3), t, m, reverse_share=1.5)


@pytest.mark.parametrize("n", [3, 5])
def test_native_ring_with_reverse_share_is_the_closed_form(n):
    """Every NIC of a switch is loaded both ways in gloo's ring: 2(N-1) max(M(1+κ)/(Nβ), α)."""
    t = get_topology(f"switch:{n}")
    beta = t.links[0].bandwidth_GBps * 1e9
    m, kappa = 3e7, 0.08
    step = m * (1 + kappa) / (n * beta)
    for alpha in (1e-4, 3 * step):
        got = CostModel(native_message_s=alpha, reverse_share=kappa).predict_native(t, m)
        assert got == pytest.approx(2 * (n - 1) * max(step, alpha), rel=1e-9)


@pytest.mark.parametrize("bad,match", [
    ({"reverse_share": 1.0}, r"reverse_share=1.0 must lie in \[0, 1\)"),
    ({"reverse_share": -0.1}, "reverse_share=-0.1"),
    ({"reverse_share": True}, "reverse_share=True"),
    ({"link_GBps": {"link": 0.0}}, "measured 0"),
    ({"link_GBps": {"link": float("nan")}}, "positive number"),
    ({"goodput": 0.0}, r"goodput=0.0 must lie in \(0, 1\]"),
    ({"message_s": -1.0}, "message_s=-1.0"),
    ({"pipelines": ()}, "pipelines"),
])
def test_bad_calibration_is_a_clear_error(bad, match):
    with pytest.raises(PlanError, match=match):
        CostModel(**bad)


def test_cost_model_round_trips_through_json_and_rejects_unknown_fields(tmp_path):
    m = CostModel(message_s=1e-4, goodput=0.9, reverse_share=0.07, link_GBps={"network": 1.25}, source="measured")
    f = tmp_path / "cost.json"
    f.write_text(json.dumps(m.to_dict()))
    assert load_cost_model(str(f)) == m
    with pytest.raises(PlanError, match="unknown cost model fields"):
        CostModel.from_dict({**m.to_dict(), "alpha": 1})
    f.write_text("{not json")
    with pytest.raises(GradsyncError, match="cannot be read as JSON"):
        load_cost_model(str(f))
    assert load_cost_model(None) is None


def test_size_classes_are_powers_of_two_from_4k():
    assert [size_class(x) for x in (0, 1, 4096, 4097, 1 << 20, (1 << 20) + 1)] == [4096, 4096, 4096, 8192, 1 << 20, 1 << 21]


def test_native_schedule_checks_itself():
    for spec in ("switch:3", "bcube:2,2", "p3.8xlarge"):
        t = get_topology(spec)
        native_schedule(t).check(t)


def _one_way(topo, nbytes: float, burst_s: float, alpha: float) -> float:
    """A one-way transfer host0 -> host1 of ``nbytes`` on the event simulator with a bucket of ``burst_s``: the
    wire ``burst_of`` is meant to read."""
    route = ("host0", "sw0", "host1")
    schedule = Schedule("one", topo.name, topo.ranks, (Chunk(0.0, 1.0, 0),), (Transfer(0, 0, 1, route, False, 0),),
                        collective="broadcast")
    return simulate(schedule, topo, nbytes, streaming=False, fifo=True, message_s=alpha, latency_s=0.0,
                    burst_s=burst_s, progress=False).time_s


@pytest.mark.parametrize("burst_s", [0.0, 0.004, 0.012])
def test_a_burst_is_read_back_from_a_tiny_and_a_mid_transfer(burst_s):
    """Under a bucket of B bytes a transfer of m > B takes α + (m - B)/β exactly (the peak's share cancels) and
    a tiny one α + tiny/(PEAK β): so burst_of gives back the simulator's bucket to tiny / PEAK bytes, and 0 where
    there is none (a saving below the tiny transfer's time is noise)."""
    topo = get_topology("switch:2")
    beta, alpha, tiny = 1.25e9, 2e-3, 4096.0
    mid = beta * 0.025
    noise = (0.0, 3e-4)  # a busy spell on one repetition only ever adds time
    rows = [(_one_way(topo, tiny, burst_s, alpha) + a, _one_way(topo, mid, burst_s, alpha) + b)
            for a, b in zip(noise, noise[::-1])]
    got = burst_of(rows, tiny, mid, beta)
    if burst_s == 0:
        assert got == 0.0
    else:
        assert got == pytest.approx(burst_s, abs=tiny / engine_module.BURST_PEAK / beta * 1.0001)


def test_burst_of_keeps_within_the_mid_transfer_and_names_bad_input():
    # faster than the rate allows for every byte: the whole mid transfer was the burst, no more
    assert burst_of([(0.001, 0.001)], 4096, 1e6, 1e7) == pytest.approx(1e6 / 1e7)
    # slower than the rate: no bucket
    assert burst_of([(0.001, 0.2)], 4096, 1e6, 1e7) == 0.0
    for bad in ([], [(0.1,)], [(0.1, float("nan"))]):
        with pytest.raises(PlanError, match="burst_of needs"):
            burst_of(bad, 4096, 1e6, 1e7)
    with pytest.raises(PlanError, match="burst_of needs"):
        burst_of([(0.1, 0.2)], 1e6, 4096, 1e7)


def test_a_models_burst_makes_short_messages_cheaper_and_travels_in_its_json():
    topo = get_topology("racks:2,3,4")
    ring = synthesize("ring", topo)
    plain = CostModel()
    bursty = CostModel(burst_s=0.004)
    assert CostModel.from_dict(json.loads(json.dumps(bursty.to_dict()))) == bursty
    small, large = plain.predict(ring, topo, 64 << 10), plain.predict(ring, topo, 1 << 30)
    assert bursty.predict(ring, topo, 64 << 10) < small
    assert bursty.predict(ring, topo, 1 << 30) == pytest.approx(large, rel=0.02)
    with pytest.raises(PlanError, match="burst_s=-1"):
        CostModel(burst_s=-1)


def test_a_straggler_plan_is_waited_on_with_its_late_rank_last():
    """The executor blocks on one message at a time in wait order: for the straggler schedule every on-time
    rank's reduce among the others (steps before the late rank joins) comes before any transfer to or from the
    late rank, so the others do that work while it is late. The on-time order (no delay) interleaves them: a rank
    would block on the late rank's first shard with its own reduce unfinished."""
    from gradsync.plan import PlanOptions, synthesize
    from gradsync.sim.cost import CostModel, phase_order
    from gradsync.sim.engine import simulate
    from gradsync.topology.io import get_topology

    topo = get_topology("switch:5")
    schedule = synthesize("straggler", topo, PlanOptions(pipeline=4, straggler=4))
    a = schedule.arrays
    m = topo.world_size - 1
    touches_late = (a["src"] == 4) | (a["dst"] == 4)
    reduce_among_others = (a["step"] < m - 1) & ~touches_late
    assert reduce_among_others.any() and touches_late.any()
    model = CostModel()
    order = model.wait_order(schedule, topo, 1 << 22)
    assert order[reduce_among_others].max() <= order[touches_late].min()
    on_time = simulate(schedule, model.rates(topo), float(1 << 22), streaming=False, fifo=True,
                       message_s=model.message_s, reverse_share=model.reverse_share, progress=False)
    plain = phase_order(schedule, on_time.transfer_times()[1])
    assert plain[reduce_among_others].max() > plain[touches_late].min()  # what the late-aware order changes
