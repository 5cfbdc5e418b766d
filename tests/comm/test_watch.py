"""Watching the wire on a fake clock: rolling rate and delay estimates, and the hysteresis detector that
switches exactly once when a link slows or a rank is late for k collectives, never under noise below the
threshold, and back exactly once on recovery."""

from __future__ import annotations

import random

import pytest

from gradsync.comm.watch import (
    Conditions,
    Detector,
    Hysteresis,
    RollingEstimates,
    Sample,
    arrival_delays,
    collective_rates,
    link_scales,
    on_time_pairs,
    scaled_topology,
)
from gradsync.errors import GradsyncError
from gradsync.plan import PlanOptions, synthesize
from gradsync.sim import simulate
from gradsync.topology.io import get_topology

MB = 2**20
RATE = 1.25e9  # bytes/s the model expects on every pair


class FakeWire:
    """A ring of ``n`` ranks on a fake clock: every collective each pair (i, i+1) moves ``messages`` messages of
    ``nbytes``, posted at the pace the model expects and served one at a time at the pair's true rate."""

    def __init__(self, n: int, nbytes: float = 4 * MB, messages: int = 6) -> None:
        self.n, self.nbytes, self.messages = n, nbytes, messages
        self.now = 1000.0  # any origin: only differences matter
        self.factor: dict[tuple[int, int], float] = {}

    def pairs(self) -> list[tuple[int, int]]:
        return [(i, (i + 1) % self.n) for i in range(self.n)]

    def collective(self, noise: dict[tuple[int, int], float] | None = None) -> list[Sample]:
        out = []
        end = self.now
        for pair in self.pairs():
            rate = RATE * self.factor.get(pair, 1.0) * (noise or {}).get(pair, 1.0)
            done = self.now
            for k in range(self.messages):
                posted = self.now + k * self.nbytes / RATE
                done = max(posted, done) + self.nbytes / rate
                out.append(Sample(pair, self.nbytes, posted, done))
            end = max(end, done)
        self.now = end + 0.01
        return out


def _expected(wire: FakeWire) -> dict[tuple[int, int], float]:
    return dict.fromkeys(wire.pairs(), RATE)


def _run(detector: Detector, wire: FakeWire, steps: int, rng: random.Random, spread: float = 0.1) -> list:
    switches = []
    for _ in range(steps):
        noise = {p: rng.uniform(1 - spread, 1 + spread) for p in wire.pairs()}
        got = detector.observe(collective_rates(wire.collective(noise)), _expected(wire))
        if got is not None:
            switches.append(got)
    return switches


# ---- the estimators -----------------------------------------------------------------------------------------
def test_rates_count_each_busy_second_once_and_skip_idle_gaps():
    samples = [
        Sample("a", 1e6, 0.0, 1.0),  # queued messages overlap: the union is [0, 2], 2 MB in 2 s
        Sample("a", 1e6, 0.5, 2.0),
        Sample("b", 1e6, 0.0, 0.5),  # an idle second between two messages is not slowness: 2 MB in 1 s
        Sample("b", 1e6, 1.5, 2.0),
        Sample("c", 1e3, 0.0, 1.0),  # below min_bytes: α, not the wire
    ]
    assert collective_rates(samples, min_bytes=1e5) == {"a": pytest.approx(1e6), "b": pytest.approx(2e6)}
    assert "c" in collective_rates(samples, min_bytes=0)


def test_fake_wire_rates_are_the_true_rates():
    wire = FakeWire(4)
    wire.factor[(1, 2)] = 0.25
    rates = collective_rates(wire.collective())
    assert rates[(1, 2)] == pytest.approx(0.25 * RATE)
    assert rates[(0, 1)] == pytest.approx(RATE)


def test_arrival_delays_are_measured_from_the_lower_median():
    assert arrival_delays([10.0, 10.5]) == (0.0, 0.5)
    # one early rank does not make every other rank late
    assert arrival_delays([5.0, 10.0, 10.0, 10.0, 10.7]) == pytest.approx((0.0, 0.0, 0.0, 0.0, 0.7))
    assert arrival_delays([]) == ()


def test_rolling_median_forgets_beyond_its_window():
    est = RollingEstimates(window=3)
    for v in (100.0, 1.0, 2.0, 3.0):
        est.add_rates({"x": v})
    assert est.rate("x") == 2.0  # 100 fell out of the window
    est.add_delays([0.0, 0.5])
    assert est.delay(1) == 0.5 and est.rate("y") is None


# ---- the detector -------------------------------------------------------------------------------------------
def test_a_slow_link_switches_exactly_once_after_k_collectives_and_back_once():
    wire, det, rng = FakeWire(4), Detector(Hysteresis(1.5, 1.2, k=3)), random.Random(1)
    assert _run(det, wire, 10, rng) == []
    wire.factor[(1, 2)] = 0.25
    slow = _run(det, wire, 20, rng)
    assert len(slow) == 1
    sw = slow[0]
    assert (sw.generation, sw.collective) == (1, 13)  # the third slow collective
    ((key, scale),) = sw.after.link_scale
    assert key == (1, 2) and 0.25 * 0.9 <= scale <= 0.25 * 1.1
    assert sw.before.baseline and sw.predicted_gain_s is None
    assert "(1, 2) at 0.2" in sw.message and "baseline plan -> replanned on 1 scaled link(s)" in sw.message
    assert "\n" not in sw.message
    wire.factor.clear()
    back = _run(det, wire, 20, rng)
    assert len(back) == 1
    assert (back[0].generation, back[0].collective) == (2, 33)
    assert back[0].after.baseline and det.conditions.baseline
    assert "(1, 2) back to its modelled rate" in back[0].message


def test_noise_below_the_threshold_never_switches():
    wire, det, rng = FakeWire(5), Detector(Hysteresis(1.5, 1.2, k=3)), random.Random(2)
    # every pair anywhere from 10% fast to 1.45x slow, independently, for 300 collectives
    for _ in range(300):
        noise = {p: rng.uniform(1 / 1.45, 1.1) for p in wire.pairs()}
        assert det.observe(collective_rates(wire.collective(noise)), _expected(wire)) is None
    # and bursts beyond the threshold shorter than k: each is reset by one normal collective
    for _ in range(20):
        for _ in range(2):
            assert det.observe(collective_rates(wire.collective({(0, 1): 0.3})), _expected(wire)) is None
        assert det.observe(collective_rates(wire.collective()), _expected(wire)) is None
    assert det.generation == 0


def test_values_in_the_hysteresis_band_hold_the_state():
    det = Detector(Hysteresis(1.5, 1.2, k=2, k_leave=4))
    key = (0, 1)
    got = [det.observe({key: RATE / 2}, {key: RATE}) for _ in range(2)]
    assert got[0] is None and got[1] is not None
    # 1.3x slow: no longer beyond enter, not yet inside leave: stays degraded for as long as it lasts
    assert all(det.observe({key: RATE / 1.3}, {key: RATE}) is None for _ in range(50))
    assert [det.observe({key: RATE}, {key: RATE}) is None for _ in range(4)] == [True, True, True, False]
    assert det.generation == 2


def test_a_late_rank_switches_to_the_straggler_plan_with_its_predicted_gain_and_back():
    """Rank 5 of switch:8 late by 0.6 of a ring allreduce; the predictor is the simulator, so the gain is the
    closed form of tests/plan/test_straggler.py: Δ + 7/4 M/β for ring against Δ + M/β (streaming)."""
    topo = get_topology("switch:8")
    size = 1e8
    ring_s = 7 / 4 * size / RATE

    def plan(c: Conditions) -> str:
        return "ring" if c.straggler is None else f"straggler(s={c.straggler})"

    def predict(plan_for: Conditions, world: Conditions) -> float:
        opts = PlanOptions(straggler=plan_for.straggler)
        schedule = synthesize("ring" if plan_for.straggler is None else "straggler", topo, opts)
        late = {world.straggler: world.straggler_delay_s} if world.straggler is not None else None
        return simulate(schedule, topo, size, latency=False, start_delay_s=late, progress=False).time_s

    det = Detector(late=Hysteresis(0.25, 0.1, k=3), plan_name=plan, predictor=predict)
    rng = random.Random(3)
    now = 50.0

    def step(late_by: float):
        nonlocal now
        arrivals = [now + rng.uniform(0, 0.05 * ring_s) for _ in range(8)]
        arrivals[5] += late_by
        now += 10.0
        return det.observe({}, {}, arrival_delays(arrivals), reference_s=ring_s)

    assert [step(0.0) for _ in range(5)] == [None] * 5
    switches = [s for s in (step(0.6 * ring_s) for _ in range(10)) if s]
    assert len(switches) == 1
    sw = switches[0]
    assert sw.collective == 8 and sw.after.straggler == 5
    delta = sw.after.straggler_delay_s
    assert 0.55 * ring_s <= delta <= 0.65 * ring_s
    assert sw.predicted_gain_s == pytest.approx((delta + ring_s) - (delta + size / RATE), rel=1e-6)
    assert "rank 5 late by" in sw.message and "ring -> straggler(s=5)" in sw.message and "gain" in sw.message
    back = [s for s in (step(0.0) for _ in range(10)) if s]
    assert len(back) == 1 and back[0].after.straggler is None and back[0].new_plan == "ring"
    assert back[0].predicted_gain_s > 0  # on time, the ring beats the straggler schedule
    assert "rank 5 on time again" in back[0].message


def test_every_rank_that_sees_the_same_collectives_switches_at_the_same_generation():
    runs = []
    for _ in range(3):
        wire, det = FakeWire(4), Detector()
        wire.factor[(3, 0)] = 0.4
        runs.append([(s.generation, s.collective, s.after, s.message) for s in _run(det, wire, 10, random.Random(7))])
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 1


# ---- to the planner ---------------------------------------------------------------------------------------
def test_one_slow_nic_scales_only_that_nics_link():
    """The link is at least as fast as the fastest pair through it: 0.3, not 0.25."""
    topo = get_topology("switch:4")
    # A ring run both ways (as the ring synthesizer does) with host1's NIC slow outbound: both pairs out of rank 1
    # are slow, and every other link direction also carries a pair that ran at its modelled rate.
    ring = [(i, (i + 1) % 4) for i in range(4)] + [((i + 1) % 4, i) for i in range(4)]
    slow_pairs = {(1, 2): 0.25, (1, 0): 0.3}
    scales = link_scales(topo, slow_pairs, healthy=[p for p in ring if p not in slow_pairs])
    (hop, s), = scales.items()
    e, d = hop
    lk = topo.links[e]
    assert s == 0.3 and {lk.a, lk.b} == {"host1", "sw0"} and (lk.a, lk.b)[d] == "host1"  # host1 -> switch
    slow = scaled_topology(topo, scales)
    assert slow.links[e].directed_GBps[d] == pytest.approx(topo.links[e].directed_GBps[d] * 0.3)
    assert slow.links[e].directed_GBps[1 - d] == topo.links[e].directed_GBps[1 - d]
    assert all(slow.links[i] == topo.links[i] for i in range(len(topo.links)) if i != e)



def test_a_slow_pair_bound_by_a_thin_uplink_does_not_set_the_scale_of_the_nic_it_crosses():
    """racks:2,3,4 with rank 0's NIC at a quarter, as the testbed read it: its rack-local pairs at 0.15-0.16x, its
    pairs to the other rack (bound by the 4:1 uplink, sharing the cut NIC) at 0.41-0.54x. Every one of them crosses
    the NIC, which explains them all; its scale is that of the pairs it bounds (0.16), not 0.54."""
    topo = get_topology("racks:2,3,4")
    slow = {(0, 1): 0.15, (0, 2): 0.16, (1, 0): 0.16, (2, 0): 0.16, (0, 3): 0.54, (3, 0): 0.41}
    healthy = [(1, 2), (2, 1), (3, 4), (4, 5), (5, 3), (1, 4), (4, 1)]
    scales = link_scales(topo, slow, healthy)
    nic = {e for e, lk in enumerate(topo.links) if "host0" in (lk.a, lk.b)}
    assert {e for e, _ in scales} == nic, scales
    assert sorted(scales.values()) == [0.16, 0.16], scales  # out of host0 (0.15, 0.16) and into it (0.16, 0.16)


def test_a_pair_across_a_thin_uplink_does_not_clear_the_nic_it_leaves_by():
    """racks:2,3,4 with rank 0's NIC cut (issue 39's scenario a): its pairs inside the rack are slow, its pair to the
    other rack runs at the 4:1 uplink's rate as modelled (the NIC is not what bounds it). The NIC alone is scaled;
    a rule that let every healthy pair clear every link on its route blamed the receivers' links instead."""
    topo = get_topology("racks:2,3,4")
    slow = {(0, 1): 0.25, (0, 2): 0.26}
    healthy = [(0, 3), (1, 2), (3, 4), (4, 5), (5, 3)]
    scales = link_scales(topo, slow, healthy)
    (hop, s), = scales.items()
    lk = topo.links[hop[0]]
    leaving = (lk.a, lk.b)[hop[1]]
    assert s == 0.26 and leaving == topo.ranks[0]  # rank 0's host -> its switch
    # where every link of a slow pair is one a healthy pair runs at full rate on, nothing is blamed
    assert link_scales(topo, {(1, 2): 0.5}, healthy=[(1, 0), (0, 2)]) == {}

# ---- bad input ----------------------------------------------------------------------------------------------
def test_bad_input_names_the_value():
    with pytest.raises(GradsyncError, match="leave=1.5 must be below enter=1.2"):
        Hysteresis(1.2, 1.5)
    with pytest.raises(GradsyncError, match="k=0 must be an integer >= 1"):
        Hysteresis(1.5, 1.2, k=0)
    with pytest.raises(GradsyncError, match="completed at 1.0 s, before it was posted at 2.0 s"):
        Sample((0, 1), 10, 2.0, 1.0)
    with pytest.raises(GradsyncError, match=r"nbytes=-1 must be a finite number >= 0"):
        Sample((0, 1), -1, 0.0, 1.0)
    with pytest.raises(GradsyncError, match=r"no expected rate for \(0, 1\)"):
        Detector().observe({(0, 1): 1.0}, {})
    with pytest.raises(GradsyncError, match="reference_s=0 must be a finite number > 0"):
        Detector().observe({}, {}, [0.0], reference_s=0)
    with pytest.raises(GradsyncError, match=r"arrivals_s\[1\]=nan"):
        arrival_delays([0.0, float("nan")])
    with pytest.raises(TypeError, match="must be a Hysteresis"):
        Detector(link=(1.5, 1.2))  # type: ignore[arg-type]


def test_a_late_ranks_pairs_are_left_out():
    """A message to a late rank waits until it posts the receive: its pairs read the lateness, not the wire."""
    rates = {(0, 1): 1.0, (1, 2): 2.0, (2, 0): 3.0, (2, 1): 4.0}
    assert on_time_pairs(rates, ()) == rates
    assert on_time_pairs(rates, {2}) == {(0, 1): 1.0}
    assert on_time_pairs(rates, {0, 2}) == {}
