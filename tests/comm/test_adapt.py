"""The runtime's watch and replanning (gradsync.comm.adapt) on the in-process fabric and a fake clock: a slow link
switches the plan once after k collectives, at the same generation on every rank, with exact sums; noise below
the threshold never switches; a dropped link is routed around where the fabric allows, and named where not."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

from gradsync.comm import LocalFabric, run_ranks
from gradsync.comm import nics as nics_mod
from gradsync.comm.adapt import AdaptOptions, adapt_from_env
from gradsync.comm.runtime import Runtime
from gradsync.comm.watch import Hysteresis
from gradsync.errors import GradsyncError, PeerError

RATE = 1e9  # bytes per fake second on every healthy pair
BUFFER = 256 << 10  # bytes per allreduce: small enough that the executor waits in key order on its own thread
SLOW_NIC = {(1, p): 0.25 for p in range(4) if p != 1}  # rank 1 sends at a quarter of the rate to everyone
#: ``min_gain=0``: every switch replans, so the detector's mechanics show on a fixed ring, whose replan gains nothing
OPTIONS = AdaptOptions(Hysteresis(1.5, 1.2, 3), warmup=2, min_bytes=1024, pair_min_bytes=1024, min_gain=0.0,
                       every=1)
#: the default share a replan must save (5%)
GAINFUL = dataclasses.replace(OPTIONS, min_gain=AdaptOptions().min_gain)


class FakeNet:
    """Message times of an in-process job on a fake clock, shared by its ranks: a send of ``b`` bytes from ``src``
    to ``dst`` takes ``b / (RATE * factor)`` on ``src``'s NIC, which sends one message at a time from when each is
    posted; its receiver's clock moves to when it arrived. Everything is waited on the ranks' own
    threads (messages this small wait in key order), so times depend only on the schedule, the factors and the
    late ranks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrivals: dict[tuple[int, int, int], list[float]] = {}
        self.posted: dict[tuple[int, int, int], int] = {}


class ClockedTransport:
    """One rank of a :class:`FakeNet` over a :class:`LocalTransport`. ``clock()`` reads this rank's time, except
    right after a send was waited for, when it reads when that send finished: what a per-connection waiting thread
    would see on a real wire (key order would otherwise charge one pair with another's wait)."""

    ordered = False

    def __init__(self, inner, net: FakeNet) -> None:
        self.inner, self.net, self.rank, self.world_size, self.name = inner, net, inner.rank, inner.world_size, inner.name
        self.capabilities = inner.capabilities
        self.now = 0.0
        self.stamp: float | None = None
        self.busy = 0.0  # when this rank's NIC has sent everything posted so far
        self.factor: dict[tuple[int, int], float] = {}
        self.per_message = 0.0  # fake seconds each send costs its NIC beyond its bytes (a host cost no model has)

    def clock(self) -> float:
        t, self.stamp = (self.now if self.stamp is None else self.stamp), None
        return t

    def compute(self, seconds: float) -> None:
        """Time spent outside the collectives (a late rank's longer step)."""
        self.now += seconds
        self.stamp = None

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        self.stamp = None
        seconds = (tensor.numel() * tensor.element_size() / (RATE * self.factor.get((self.rank, peer), 1.0))
                   + self.per_message)
        done = self.busy = max(self.busy, self.now) + seconds
        with self.net.lock:
            self.net.arrivals.setdefault((self.rank, peer, tag), []).append(done)
        self.inner.isend(tensor, peer, tag)  # after its arrival time is known: the receiver reads it on arrival
        owner = self

        class Sent:
            def wait(self, timeout_s: float) -> None:
                owner.now = max(owner.now, done)
                owner.stamp = done

        return Sent()

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        key = (peer, self.rank, tag)
        with self.net.lock:
            ticket = self.net.posted[key] = self.net.posted.get(key, -1) + 1
        inner, owner = self.inner.irecv(tensor, peer, tag), self

        class Received:
            def wait(self, timeout_s: float) -> None:
                inner.wait(timeout_s)
                owner.stamp = None
                with owner.net.lock:
                    owner.now = max(owner.now, owner.net.arrivals[key][ticket])

        return Received()


def _values(rank: int, i: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input of collective ``i``: integers, so every dtype's sum is exact and known."""
    return (torch.arange(n, dtype=torch.int64) % 97 + 1000 * rank + i).to(dtype)


def _run_job(world: int, topology: str, algorithm: str, dtype: torch.dtype, slow: dict[int, dict[tuple[int, int], float]],
             steps: int, noise: float = 0.0, late: dict[int, dict[int, float]] | None = None, cost_model=None,
             options: AdaptOptions = OPTIONS, probe=None, per_message_s: float = 0.0):
    """Every rank runs ``steps`` allreduces; before collective ``i`` the wire's pair factors become ``slow[i]``
    (kept until the next entry), each scaled by a seeded noise in ``[1 - noise, 1 + noise]``, and the ranks in
    ``late[i]`` (kept the same way) arrive that many fake seconds late. Returns per rank (switches, whether every
    sum was exact), or with ``probe(runtime)`` whatever it returns before shutdown as a third item."""
    numel = BUFFER // torch.tensor([], dtype=dtype).element_size()
    want = [sum(_values(r, i, numel, dtype) for r in range(world)) for i in range(steps)]
    net = FakeNet()

    def body(tr):
        wire = ClockedTransport(tr, net)
        wire.per_message = per_message_s
        rt = Runtime(wire, topology, algorithm, timeout_s=20, adapt=options, clock=wire.clock, cost_model=cost_model)
        rng = random.Random(tr.rank)
        exact = True
        base: dict[tuple[int, int], float] = {}
        delays: dict[int, float] = {}
        try:
            for i in range(steps):
                base = slow.get(i, base)
                delays = (late or {}).get(i, delays)
                wire.compute(delays.get(tr.rank, 0.0))
                pairs = {(tr.rank, p) for p in range(world) if p != tr.rank}
                wire.factor = {pr: base.get(pr, 1.0) * (1 + noise * (2 * rng.random() - 1)) for pr in pairs}
                x = _values(tr.rank, i, numel, dtype)
                rt.allreduce(x)
                exact &= bool(torch.equal(x, want[i]))
            return (rt.adapt.switches, exact) + ((probe(rt),) if probe else ())
        finally:
            rt.shutdown()

    results = run_ranks(world, body, timeout_s=120)
    for got in results:
        assert not isinstance(got, BaseException), got
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_a_slow_link_switches_once_after_k_collectives_on_every_rank_with_exact_sums(dtype):
    """Rank 1's NIC sends at a quarter of its rate from collective 4 (two warm-up collectives, then the detector
    counts from 1): the third slow collective, the detector's fifth, switches every rank to generation 1, replanned
    with that uplink scaled; nothing else switches, and every sum is exact throughout."""
    results = _run_job(4, "switch:4", "ring", dtype, {4: SLOW_NIC}, steps=10)
    switches = [s for s, _ in results]
    assert all(exact for _, exact in results)
    assert all(len(s) == 1 for s in switches), switches
    first = switches[0][0]
    assert (first.generation, first.collective) == (1, 5)
    assert all((s[0].generation, s[0].collective, s[0].conditions) == (1, 5, first.conditions) for s in switches)
    seen = dict(first.conditions.link_scale)
    assert seen and {src for src, _ in seen} == {1}  # rank 1's pairs, all of them at a quarter of the model
    assert all(scale == pytest.approx(0.25, rel=0.05) for scale in seen.values())
    assert "(1, 2) at 0.25x its modelled rate" in first.message and "ring/1 -> ring/1" in first.message


@pytest.mark.parametrize("every, slow_from, watched, at", [(2, 4, 9, 3), (4, 9, 8, 4)])
def test_watching_one_allreduce_in_every_few_samples_the_same_ones_on_every_rank_and_still_switches(
        every, slow_from, watched, at):
    """``every=2``: collectives 0, 2, 4, ... are watched on every rank (the others pay nothing); two warm up. The
    slow NIC from collective 4 is seen at 4; from then every collective is watched while the detector is partway
    (5, 6), so it switches at its third watched collective (collective 6, not 8), and every one after it while the
    cluster is off its baseline (7 to 10): 9 watched of 11. ``every=4``, slow from 9: watched 0, 4 (warm-up), 8
    (healthy), 12, 13, 14 (the switch, the detector's fourth), 15, 16: 8 of 17, where one in four alone would have
    switched at collective 20."""
    options = dataclasses.replace(OPTIONS, every=every)
    steps = 4 * every + 3 if every == 2 else 17
    results = _run_job(4, "switch:4", "ring", torch.float32, {slow_from: SLOW_NIC}, steps=steps, options=options,
                       probe=lambda rt: (rt.adapt.watched, rt.adapt.eligible))
    assert all(exact for _, exact, _ in results)
    assert all(counts == (watched, steps) for _, _, counts in results), [c for _, _, c in results]
    switches = [s for s, _, _ in results]
    assert all(len(s) == 1 and (s[0].generation, s[0].collective) == (1, at) for s in switches), switches


def test_the_plan_switches_back_once_the_link_recovers():
    """Slow from collective 4, healthy again from collective 9: one switch in (detector collective 5), one back to
    the baseline three healthy collectives after recovery (collective 10); the same on every rank."""
    results = _run_job(4, "switch:4", "ring", torch.float32, {4: SLOW_NIC, 9: {}}, steps=14)
    for switches, exact in results:
        assert exact
        assert [(s.generation, s.collective) for s in switches] == [(1, 5), (2, 10)]
        assert switches[1].conditions.baseline and "back to its modelled rate" in switches[1].message


def test_off_the_baseline_every_collective_is_watched_so_the_return_is_seen_k_collectives_after_it(monkeypatch):
    """``every=4``, rank 1's NIC slow from collective 5 to 11: watched 0, 4 (warm-up), 8 (slow: partway), 9, 10
    (the switch). While the cluster is off its baseline every collective is watched, so the recovery at 12 is seen
    at 12 and the plan switches back at 14, the third healthy one; sampling one in four, as on the baseline, it
    was seen at 16 and switched back at 18."""
    from gradsync.comm import adapt

    switched: list[int] = []
    after = adapt.Adapter.after

    def spy(self, ex, nbytes):
        got = after(self, ex, nbytes)
        if self.rank == 0 and got is not None and got in self.switches:
            switched.append(self.eligible - 1)  # the collective's index among all those that qualified
        return got

    monkeypatch.setattr(adapt.Adapter, "after", spy)
    options = dataclasses.replace(OPTIONS, every=4)
    results = _run_job(4, "switch:4", "ring", torch.float32, {5: SLOW_NIC, 12: {}}, steps=20, options=options)
    assert all(exact for _, exact in results)
    assert switched == [10, 14], switched


def test_noise_below_the_threshold_never_switches():
    """Every pair's rate wanders by up to ±25% each collective (a slowdown of at most 1/0.75 = 1.33 < 1.5)."""
    results = _run_job(4, "switch:4", "ring", torch.float32, {}, steps=14, noise=0.25)
    assert all(exact and switches == [] for switches, exact in results)


def test_an_auto_runtime_replans_to_another_plan_and_logs_one_line(capsys):
    """On a flat switch, rank 1's NIC made 8x slower moves ``auto`` off the plan that leans on it; rank 0 alone
    prints the one line (what was seen, old and new plan, predicted gain)."""
    results = _run_job(4, "switch:4", "auto", torch.float64, {4: {pr: 0.125 for pr in SLOW_NIC}}, steps=8,
                       options=GAINFUL)
    assert all(exact and len(s) == 1 for s, exact in results)
    rec = results[0][0][0]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "plan generation" in ln]
    assert lines == [rec.message]
    assert rec.old_plan != rec.new_plan and f"{rec.old_plan} -> {rec.new_plan}, predicted" in rec.message
    assert rec.predicted_gain_s is not None and rec.predicted_gain_s > 0


def test_after_a_replan_the_new_plans_pairs_learn_their_factors_before_they_are_compared():
    """A factor belongs to a plan: how the wire runs that plan's pairs beside the model. ``auto`` leaves the plan
    that leans on rank 1's slow NIC; the new plan's pairs then learn their factors against the model of the
    cluster as the detector believes it, so no healthy pair reads slow on it. Compared with the factors the old
    plan taught, pairs into rank 0 read half their rate and a held switch named them, twelve collectives in. And
    the ranks' uneven ends on the slow NIC are its doing: no rank is judged late (rank 0 was, at the switch, and
    on time again three collectives later: a second replan to the same plan)."""
    slow_pairs = set(SLOW_NIC)
    results = _run_job(4, "switch:4", "auto", torch.float64, {4: {pr: 0.125 for pr in SLOW_NIC}}, steps=20,
                       options=GAINFUL, probe=lambda rt: rt.adapt.held)
    for switches, exact, held in results:
        assert exact and switches and switches[0].old_plan != switches[0].new_plan
        named = {key for rec in switches + held for key, _ in rec.conditions.link_scale}
        assert named and named <= slow_pairs, [r.message for r in switches + held]
        assert all(rec.conditions.straggler is None for rec in switches + held), [r.message for r in switches + held]
        assert len(switches) == 1 and not held, [r.message for r in switches + held]


def _count_choices(monkeypatch) -> list[tuple[int, int]]:
    """Every full choice the cost model makes from now on, as (id of its topology, size class): a list the test
    reads after the job."""
    from gradsync.sim.choose import Chooser

    calls: list[tuple[int, int]] = []
    choose = Chooser._choose

    def spy(self, size):
        calls.append((id(self.topology), int(size)))
        return choose(self, size)

    monkeypatch.setattr(Chooser, "_choose", spy)
    return calls


def test_a_replan_prices_its_choice_once_on_rank_0_and_every_rank_runs_it(monkeypatch):
    """The prospect of a replan (is the new plan worth a new generation?) chooses the plan on the scaled topology;
    the new generation then runs that choice without choosing it again (on the testbed each choice took seconds
    of rank 0's time while every rank waited). Without the adoption: two choices per rank."""
    calls = _count_choices(monkeypatch)
    results = _run_job(4, "switch:4", "auto", torch.float64, {4: {pr: 0.125 for pr in SLOW_NIC}}, steps=8,
                       options=GAINFUL, probe=lambda rt: id(rt.plans.topology))
    assert all(exact and len(s) == 1 for s, exact, _ in results)
    new_topology = {t for _, _, t in results}
    assert len(new_topology) == 4  # each rank's own scaled copy
    on_new = [t for t, size in calls if t in new_topology and size == BUFFER]
    # in process each rank decides for itself: once per rank, the prospect's; the new generation adopted it
    assert sorted(on_new) == sorted(new_topology), calls


def test_a_replan_simulates_each_plan_it_prices_once_for_its_prospect_and_its_log_line(monkeypatch):
    """The prospect prices the running plan and the new one on the scaled cluster; the switch's log line gives the
    same two predictions: from the same two simulations, not two more (each a share of the seconds every rank waits
    on rank 0)."""
    import sys

    import gradsync.comm.adapt as adapt

    priced: list[tuple[str, int, int]] = []
    real = adapt.simulate

    def spy(schedule, topology, nbytes, **kw):
        if sys._getframe(2).f_code.co_name == "_predict":  # through Adapter._on_wire, the wire's simulation
            priced.append((threading.current_thread().name, id(schedule), int(nbytes)))
        return real(schedule, topology, nbytes, **kw)

    monkeypatch.setattr(adapt, "simulate", spy)
    results = _run_job(4, "switch:4", "auto", torch.float64, {4: {pr: 0.125 for pr in SLOW_NIC}}, steps=8,
                       options=GAINFUL)
    assert all(exact and len(s) == 1 for s, exact in results)
    assert results[0][0][0].predicted_gain_s is not None  # rank 0 logs the two predictions
    assert priced and len(set(priced)) == len(priced), priced


def test_back_on_the_baseline_auto_runs_its_baseline_picks_again_without_choosing_them(monkeypatch):
    """The cluster as it was before the first switch gets the plans it had: the size classes' settled picks come
    back at the return, and nothing is chosen (or, on a process group, explored) again on the baseline topology."""
    calls = _count_choices(monkeypatch)
    results = _run_job(4, "switch:4", "auto", torch.float64, {4: SLOW_NIC, 10: {}}, steps=16,
                       probe=lambda rt: (id(rt.adapt.base_topology), rt.plans.topology is rt.adapt.base_topology))
    for switches, exact, (_, home) in results:
        assert exact and home
        away, back = switches
        assert not away.conditions.baseline and back.conditions.baseline and back.new_plan == away.old_plan
    base = {b for _, _, (b, _) in results}
    on_base = [t for t, size in calls if t in base and size == BUFFER]
    assert sorted(on_base) == sorted(base), calls  # each rank's first choice only (in process each decides)


def test_a_link_back_is_seen_on_a_plan_without_the_pairs_that_showed_it_slow():
    """Rank 1's NIC at 1/8 moves ``auto`` from ``ps/1`` to ``tree/2``, which has no (1, 3), the pair that read slow.
    Its pairs across that NIC learn their degraded level instead of being compared; once they run at twice that
    level for k collectives the link is back, every rank returns to the baseline's plan at the same collective, and
    no healthy pair or rank was flagged on the way."""
    results = _run_job(4, "switch:4", "auto", torch.float64, {4: {pr: 0.125 for pr in SLOW_NIC}, 10: {}}, steps=20,
                       options=GAINFUL, probe=lambda rt: rt.adapt.held)
    for switches, exact, held in results:
        assert exact and not held
        away, back = switches
        assert [k for k, _ in away.conditions.link_scale] == [(1, 3)] and away.new_plan != away.old_plan
        assert back.conditions.baseline and back.new_plan == away.old_plan
        assert "(1, 3) back to its modelled rate" in back.message
    assert len({tuple((s.generation, s.collective) for s in sw) for sw, _, _ in results}) == 1


def test_a_links_return_is_judged_by_the_least_gain_it_should_bring_the_pair():
    """The racks testbed's case: tree/16 around a NIC believed at 0.18x, which made the path 5.4x slower, gains its
    pair across it 2.1x in the model when the NIC is back; the pair read 1.9x its degraded level once back: above
    sqrt(2.1) = 1.45 (back), under the 2x the path alone asked. A read 1.2x the level while degraded is not back.
    Where the model gains the pair less than the wire does (a ring's pair: 1.16x in the model), the bar stays at
    RETURN_MIN; with no model rate the path decides; the bar never passes RETURN_GAIN."""
    from gradsync.comm.adapt import RETURN_GAIN, RETURN_MIN, return_margins

    level = 10.0
    pair = (0, 1)

    def margin(read: float, path: float, plan: dict) -> float:
        (got,) = return_margins({pair: read * level}, {pair: level}, {pair: path}, plan)
        return got

    assert margin(1.9, 5.43, {pair: 2.1}) == pytest.approx(1.9 / 2.1 ** 0.5) and margin(1.9, 5.43, {pair: 2.1}) >= 1
    assert margin(1.9, 5.43, {}) == pytest.approx(1.9 / RETURN_GAIN) and margin(1.9, 5.43, {}) < 1  # the path: not back
    assert margin(1.2, 5.43, {pair: 2.1}) < 1.0
    assert margin(4.0, 4.0, {pair: 1.16}) == pytest.approx(4.0 / RETURN_MIN)
    assert margin(1.25, 4.0, {pair: 1.16}) < 1.0
    assert margin(1.9, 1.5, {pair: 9.0}) == pytest.approx(1.9 / RETURN_MIN)  # sqrt(1.5) < RETURN_MIN
    assert margin(3.0, 16.0, {pair: 16.0}) == pytest.approx(3.0 / RETURN_GAIN)


def test_a_switch_that_only_slows_links_is_held_without_choosing_where_no_plan_can_gain(monkeypatch):
    """On ``tree/2`` around rank 1's slow NIC, the pair (2, 0) reads 0.6x from collective 9: the new belief only slows
    a link, so no plan is faster on it than the least the running generation priced before; the running plan is
    priced within 5% of that, and the switch is held at collective 10 without choosing among every plan. A full
    choice on that belief (brute force, here) finds nothing 5% faster either."""
    from gradsync.sim.choose import Chooser
    from gradsync.sim.cost import size_class

    calls = _count_choices(monkeypatch)
    slow = {pr: 0.125 for pr in SLOW_NIC}

    def probe(rt):
        return (rt.adapt.held, rt.adapt._world, rt.plans.chooser(), rt.plans.schedule(*rt.choice(BUFFER)),
                rt.plans.options)

    results = _run_job(4, "switch:4", "auto", torch.float64, {4: slow, 9: {**slow, (2, 0): 0.6}}, steps=13,
                       options=GAINFUL, probe=probe)
    for switches, exact, (held, belief, chooser, running, options) in results:
        assert exact and len(switches) == 1 and [h.collective for h in held] == [10]
        assert id(belief) not in {t for t, _ in calls}  # nothing chosen on the held belief
        full = Chooser(belief, chooser.model, algorithms=chooser.algorithms, native=chooser.native, options=options,
                       margin=chooser.margin).choose(BUFFER)
        now = chooser.model.predict(running, belief, size_class(BUFFER))
        assert min(c.predicted_s for c in full.candidates) >= now * (1 - GAINFUL.min_gain)


def test_a_cost_model_with_measured_class_rates_still_prices_the_slow_link():
    """A model whose link classes were measured (``gradsync testbed probe --cost-model``) replaces each link's rate
    by its class's; the belief that rank 1's NIC runs at 1/8 is applied after that, so the replan prices the slow NIC
    and switches (it was erased: both plans priced alike on the scaled cluster, and every switch was held)."""
    from gradsync.sim.cost import CostModel

    results = _run_job(4, "switch:4", "auto", torch.float64, {4: {pr: 0.125 for pr in SLOW_NIC}}, steps=8,
                       options=GAINFUL, probe=lambda rt: rt.adapt.held, cost_model=CostModel(link_GBps={"network": 1.0}))
    for switches, exact, held in results:
        assert exact and not held
        (away,) = switches
        assert away.new_plan != away.old_plan and away.conditions.link_scale


def test_a_held_switch_does_not_hide_the_links_return():
    """Rank 1's NIC at 1/8 from collective 4 moves ``auto`` to ``tree/2``; from 9 the pair (2, 0) reads 0.6x as well,
    a switch no replan gains from (held: the belief now has two slow links, the plan and what its pairs learned stay).
    The NIC is back at 14: its pairs on ``tree/2`` learned their degraded level on the first belief and show the
    return at once, back to the baseline's plan at collective 15 with every link cleared on every rank. (When a
    held switch's belief hid them, the return came at 18, on the other pair's, still believing the NIC slow.)"""
    slow = {pr: 0.125 for pr in SLOW_NIC}
    results = _run_job(4, "switch:4", "auto", torch.float64, {4: slow, 9: {**slow, (2, 0): 0.6}, 14: {(2, 0): 0.6}},
                       steps=18, options=GAINFUL, probe=lambda rt: rt.adapt.held)
    for switches, exact, held in results:
        assert exact
        assert [h.collective for h in held] == [10] and held[0].new_plan == held[0].old_plan
        assert "no plan would save 5%" in held[0].message
        away, back = switches
        assert back.collective == 15 and back.conditions.baseline and back.new_plan == away.old_plan
    assert len({tuple((s.generation, s.collective) for s in sw) for sw, _, _ in results}) == 1


def test_after_a_switch_the_watched_size_runs_the_models_pick_without_exploring():
    """An explorer's calls are not watched (each runs one of several candidates): after a switch the watched size
    class is decided at once with the model's pick for the new belief, so the watch sees every collective (and a
    link's return) from the next one on."""
    from gradsync.sim.cost import size_class

    def probe(rt):
        return rt.tuning.explored(), rt.choice(BUFFER), rt.plans.chooser().choose(BUFFER)

    results = _run_job(4, "switch:4", "auto", torch.float64, {4: {pr: 0.125 for pr in SLOW_NIC}}, steps=8,
                       options=GAINFUL, probe=probe)
    for switches, exact, (explored, running, model) in results:
        assert exact and len(switches) == 1
        assert size_class(BUFFER) in explored and explored[size_class(BUFFER)] is None  # decided, nothing timed
        assert running == (model.algorithm, model.pipeline)


def test_a_switch_whose_replan_gains_nothing_is_held_and_keeps_plan_and_executors(capsys):
    """One slow NIC slows every ring through it alike: with the default min_gain the fixed ring's replan saves
    nothing, so the switch in and the switch back are both held on every rank, at the same collectives: no new
    plan generation (a replan resets the plan cache, which bumps it), one line each from rank 0, every sum exact."""
    results = _run_job(4, "switch:4", "ring", torch.float32, {4: SLOW_NIC, 9: {}}, steps=14, options=GAINFUL,
                       probe=lambda rt: (rt.plans.generation, rt.adapt.held))
    for switches, exact, (generation, held) in results:
        assert exact and switches == [] and generation == 0
        assert [(h.collective, h.old_plan, h.new_plan) for h in held] == [(5, "ring/1", "ring/1"), (10, "ring/1", "ring/1")]
        assert held[0].conditions.link_scale and held[1].conditions.baseline
        assert abs(held[0].predicted_gain_s) < 1e-4  # of a ~2 ms collective: under the 5% a switch must save
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "plan held" in ln]
    assert lines == [h.message for h in results[0][2][1]]
    assert "keeping ring/1" in lines[0] and "(1, 2) at 0.25x its modelled rate" in lines[0]
    assert "predicted" in lines[0]  # priced: the slow NIC's link is scaled, so the replan had to be priced
    # back to the rates the running plan was made for: held without pricing the same plan again
    assert "back to its modelled rate" in lines[1] and "no link is slower than the plan assumes" in lines[1]
    assert "predicted" not in lines[1]


def test_every_is_a_count_of_at_least_one():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(GradsyncError, match="every="):
            AdaptOptions(every=bad)


def test_min_gain_is_a_share_in_zero_to_one():
    for bad in (-0.1, 1.0, True, "5%"):
        with pytest.raises(GradsyncError, match="min_gain"):
            AdaptOptions(min_gain=bad)


# ---- rerouting ---------------------------------------------------------------------------------------------
def _drop_and_run(topology: str, world: int, links: list[tuple[str, str]]):
    numel = 3000

    def body(tr):
        rt = Runtime(tr, topology, "ring", timeout_s=20, adapt=True)
        try:
            for u, v in links:
                rt.drop_link(u, v)
            x = _values(tr.rank, 0, numel, torch.int64)
            rt.allreduce(x)
            return rt.schedule(None, numel * 8), rt.topology, x
        finally:
            rt.shutdown()

    return run_ranks(world, body, timeout_s=120)


def test_bcube_without_one_link_replans_on_the_surviving_graph_with_exact_sums():
    """bcube:3,2 less server s00's level-0 link: the new schedule's routes avoid it and the sum is exact."""
    results = _drop_and_run("bcube:3,2", 9, [("s00", "L0.sw0")])
    want = sum(_values(r, 0, 3000, torch.int64) for r in range(9))
    for got in results:
        assert not isinstance(got, BaseException), got
        schedule, topology, x = got
        assert torch.equal(x, want)
        assert not topology.has_link("s00", "L0.sw0")
        hops = {frozenset(h) for t in schedule.transfers for h in zip(t.route[:-1], t.route[1:])}
        assert frozenset(("s00", "L0.sw0")) not in hops
        assert len(schedule.transfers) > 0


def test_ring_without_a_link_is_a_path_and_without_two_the_error_names_the_link():
    """ring:4 less one link still joins every rank (a path: the job goes on, exact); less a second link at the same
    rank, gpu0 is cut off, and every rank's PeerError names the link and the rank."""
    want = sum(_values(r, 0, 3000, torch.int64) for r in range(4))
    for got in _drop_and_run("ring:4", 4, [("gpu0", "gpu1")]):
        assert not isinstance(got, BaseException), got
        assert torch.equal(got[2], want)
    for got in _drop_and_run("ring:4", 4, [("gpu0", "gpu1"), ("gpu3", "gpu0")]):
        assert isinstance(got, PeerError), got
        assert "links gpu0-gpu1, gpu3-gpu0 are down" in str(got) and "['gpu0']" in str(got) and got.peer == 0


# ---- a NIC without carrier --------------------------------------------------------------------------------
def _fake_nics(monkeypatch, tmp_path, world: int, per_rank: int = 2):
    """A folder of fake interfaces ``r{rank}n{i}``, each with a carrier file reading 1, as the kernel's."""
    monkeypatch.setattr(nics_mod, "SYS_NET", tmp_path)
    for r in range(world):
        for i in range(per_rank):
            (tmp_path / f"r{r}n{i}").mkdir()
            (tmp_path / f"r{r}n{i}" / "carrier").write_text("1\n")
    return lambda r, i, up: (tmp_path / f"r{r}n{i}" / "carrier").write_text("1\n" if up else "0\n")


def _ring_nics(rank: int) -> tuple[tuple[str, str, str], ...]:
    """ring:4's rank ``rank``: NIC 0 to the next GPU, NIC 1 to the previous one."""
    return ((f"r{rank}n0", f"gpu{rank}", f"gpu{(rank + 1) % 4}"), (f"r{rank}n1", f"gpu{rank}", f"gpu{(rank - 1) % 4}"))


def test_a_nic_without_carrier_drops_its_link_on_every_rank_at_one_collective_and_its_return_brings_it_back(
        monkeypatch, tmp_path, capsys):
    """Rank 0's NIC to gpu1 loses its carrier before collective 3: every rank replans without gpu0-gpu1 at that
    collective (the same generation, one log line), the new plan's routes avoid it, every sum is exact; the carrier
    back before collective 6, every rank returns to the full ring."""
    set_carrier = _fake_nics(monkeypatch, tmp_path, 4)
    numel = 3000
    want = sum(_values(r, 0, numel, torch.int64) for r in range(4))

    def body(tr):
        options = dataclasses.replace(OPTIONS, warmup=1, nics=_ring_nics(tr.rank))
        rt = Runtime(tr, "ring:4", "ring", timeout_s=20, adapt=options)
        seen = []
        try:
            for step in range(8):
                if tr.rank == 0 and step in (3, 6):
                    set_carrier(0, 0, up=step == 6)
                x = _values(tr.rank, 0, numel, torch.int64)
                rt.allreduce(x)
                hops = {frozenset(h) for t in rt.schedule(None, numel * 8).transfers
                        for h in zip(t.route[:-1], t.route[1:])}
                seen.append((torch.equal(x, want), rt.topology.has_link("gpu0", "gpu1"),
                             frozenset(("gpu0", "gpu1")) in hops))
            return seen, [(s.generation, s.message) for s in rt.adapt.switches]
        finally:
            rt.shutdown()

    results = run_ranks(4, body, timeout_s=120)
    for got in results:
        assert not isinstance(got, BaseException), got
    assert all(r[1] == results[0][1] for r in results)  # every rank: the same switches at the same generations
    for seen, switches in results:
        assert all(exact for exact, _, _ in seen)
        assert [has for _, has, _ in seen] == [True] * 3 + [False] * 3 + [True] * 2
        assert [used for _, _, used in seen] == [True] * 3 + [False] * 3 + [True] * 2
        assert len(switches) == 2 and switches[0][0] < switches[1][0]
        assert "link gpu0-gpu1 is down (no carrier)" in switches[0][1] and "surviving links" in switches[0][1]
        assert "link gpu0-gpu1 is back" in switches[1][1] and "predicted" in switches[1][1]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "no carrier" in ln or "is back" in ln]
    assert lines == [m for _, m in results[0][1]]  # rank 0 logs each, once


def test_every_nic_of_a_rank_without_carrier_is_a_peer_error_naming_its_links(monkeypatch, tmp_path):
    set_carrier = _fake_nics(monkeypatch, tmp_path, 4)

    def body(tr):
        rt = Runtime(tr, "ring:4", "ring", timeout_s=20,
                     adapt=dataclasses.replace(OPTIONS, warmup=1, nics=_ring_nics(tr.rank)))
        try:
            for step in range(3):
                if tr.rank == 2 and step == 1:
                    set_carrier(2, 0, up=False)
                    set_carrier(2, 1, up=False)
                rt.allreduce(_values(tr.rank, 0, 3000, torch.int64))
        finally:
            rt.shutdown()

    for got in run_ranks(4, body, timeout_s=120):
        assert isinstance(got, PeerError), got
        assert "links gpu1-gpu2, gpu2-gpu3 are down" in str(got) and "['gpu2']" in str(got) and got.peer == 2


def test_nics_are_read_from_the_environment_and_checked_against_the_topology_and_the_host(monkeypatch, tmp_path):
    _fake_nics(monkeypatch, tmp_path, 1)
    assert nics_mod.parse_nics(" a=s00/L0.sw0, b=s00/L1.sw0 ") == (("a", "s00", "L0.sw0"), ("b", "s00", "L1.sw0"))
    for bad in ("a=s00", "a", "=s00/L0.sw0", "a=s00/L0.sw0,a=s00/L1.sw0"):
        with pytest.raises(GradsyncError, match="GRADSYNC_NICS"):
            nics_mod.parse_nics(bad)
    with pytest.raises(TypeError, match="nics="):
        AdaptOptions(nics=(("a", "b"),))

    def start(options, rank=0):
        made = []

        def body(tr):
            made.append(Runtime(tr, "switch:2", "ring", timeout_s=10, adapt=options))
            return made[-1].adapt.nics

        try:
            return run_ranks(2, body, timeout_s=60)[rank]
        finally:
            for rt in made:
                rt.shutdown()

    # from the environment: another device's NICs are left out (a testbed job on fewer servers than it has)
    monkeypatch.setenv("GRADSYNC_NICS", "r0n0=host0/sw0,r0n1=host7/sw0")
    assert start(OPTIONS) == (("r0n0", "host0", "sw0"),)
    monkeypatch.setenv("GRADSYNC_NICS", "r0n0=host0/host1")
    got = start(OPTIONS)
    assert isinstance(got, GradsyncError) and "has no link host0-host1" in str(got)
    monkeypatch.setenv("GRADSYNC_NICS", "eth9=host0/sw0")
    got = start(OPTIONS)
    assert isinstance(got, GradsyncError) and "'eth9', which this host does not have" in str(got)
    got = start(dataclasses.replace(OPTIONS, nics=(("r0n0", "host1", "sw0"),)))
    assert isinstance(got, GradsyncError) and "gives NIC 'r0n0' to 'host1', but this is rank 0" in str(got)


def test_dropping_a_link_that_is_not_there_names_the_links_at_its_devices():
    rt = Runtime(LocalFabric(1).transport(0), "switch:1", "ring", timeout_s=10, adapt=True)
    try:
        assert rt.adapt is None  # one rank: nothing to watch
        with pytest.raises(GradsyncError, match="adapt=True"):
            rt.drop_link("gpu0", "sw")
    finally:
        rt.shutdown()


def test_adapt_switch_and_environment(monkeypatch):
    monkeypatch.delenv("GRADSYNC_ADAPT", raising=False)
    assert adapt_from_env(None) is None  # off by default until its overhead is measured within 1%
    monkeypatch.setenv("GRADSYNC_ADAPT", "0")
    assert adapt_from_env(None) is None
    monkeypatch.setenv("GRADSYNC_ADAPT", "1")
    assert adapt_from_env(None) == AdaptOptions()
    assert adapt_from_env(False) is None
    with pytest.raises(TypeError, match="adapt='yes'"):
        adapt_from_env("yes")  # type: ignore[arg-type]
    with pytest.raises(GradsyncError, match="warmup=0"):
        AdaptOptions(warmup=0)


@pytest.mark.parametrize("alpha", [None, 1e-6])
def test_a_late_rank_switches_every_rank_once_and_back_with_the_plan_the_model_prices_fastest(alpha):
    """Rank 3 arrives 2 ms late from collective 4 to 8: each rank's time in the collective says so without a
    common clock (the others wait for it), every rank switches at the detector's fifth collective to conditions
    naming rank 3, with the plan the simulator prices fastest for that late arrival among ``auto``'s choice and
    the straggler schedule, and back three collectives after it is on time again; every sum exact. With the
    default message cost ``auto``'s choice stays (256 KiB: α decides); with α = 1 µs the straggler schedule wins
    and runs."""
    from dataclasses import replace

    from gradsync.plan import PlanOptions, synthesize
    from gradsync.sim import simulate
    from gradsync.sim.cost import CostModel
    from gradsync.topology.io import get_topology

    model = CostModel() if alpha is None else replace(CostModel(), message_s=alpha, native_message_s=alpha)
    results = _run_job(4, "switch:4", "auto", torch.float32, {}, steps=14, late={4: {3: 2e-3}, 9: {}},
                       cost_model=None if alpha is None else model)
    for switches, exact in results:
        assert exact
        if alpha is not None:  # the fake wire's straggler schedule measures slower than its model: back after k
            back = switches.pop(1)
            assert (back.collective, back.new_plan) == (8, switches[0].old_plan) and back.predicted_gain_s < 0
        assert [(s.generation, s.collective, s.conditions.straggler) for s in switches] == [(1, 5, 3), (2, 10, None)]
        assert switches[0].conditions.straggler_delay_s == pytest.approx(2e-3, rel=0.05)
        assert "rank 3 late by 0.00" in switches[0].message and "rank 3 on time again" in switches[1].message
    topo = get_topology("switch:4")
    old = switches[0].old_plan.split("/")

    def seconds(name: str, depth: int) -> float:
        schedule = synthesize(name, topo, PlanOptions(pipeline=depth, straggler=3))
        return simulate(schedule, model.rates(topo), BUFFER, streaming=False, fifo=True, message_s=model.message_s,
                        progress=False, start_delay_s={3: 2e-3}).time_s

    priced = {f"{old[0]}/{old[1]}": seconds(old[0], int(old[1]))}
    priced.update({f"straggler/{d}": seconds("straggler", d) for d in model.pipelines})
    assert switches[0].new_plan == min(priced, key=lambda k: (priced[k], k != switches[0].old_plan))
    assert switches[0].new_plan.startswith("straggler/") == (alpha is not None)


def test_a_plan_that_measures_slower_than_the_one_it_replaced_goes_back_on_every_rank():
    """The model (α = 1 µs) picks the straggler schedule for rank 3, 40 ms late, but every send costs 200 fake µs
    that it does not price: after the detector's k = 3 collectives on it, its median is above the old plan's
    median before the switch, and every rank goes back to the old plan at the same collective with one line;
    rank 3 on time again switches as usual; every sum exact."""
    from dataclasses import replace

    from gradsync.sim.cost import CostModel

    model = replace(CostModel(), message_s=1e-6, native_message_s=1e-6)
    # the link side off: 32 sub-chunks' small messages read slow beside the ring's large ones (200 µs each)
    options = dataclasses.replace(OPTIONS, link=Hysteresis(100.0, 50.0, 3))
    # 40 ms late: longer than the others' reduce among themselves at 200 µs a message, so the late rank still
    # shows late on the straggler plan (a delay that plan hides reads as on time, and it switches back itself)
    results = _run_job(4, "switch:4", "auto", torch.float32, {}, steps=16, late={4: {3: 4e-2}, 12: {}},
                       cost_model=model, per_message_s=2e-4, options=options)
    for switches, exact in results:
        assert exact
        first, back, on_time = switches
        assert (first.generation, first.collective, first.conditions.straggler) == (1, 5, 3)
        assert first.new_plan.startswith("straggler/") and first.new_plan != first.old_plan
        # three collectives on trial (6, 7, 8), then back to the old plan within the same generation
        assert (back.generation, back.collective, back.old_plan, back.new_plan) == (1, 8, first.new_plan,
                                                                                    first.old_plan)
        assert back.predicted_gain_s < 0 and f"back to {first.old_plan}" in back.message
        assert (on_time.generation, on_time.conditions.straggler) == (2, None)
    assert len({tuple((s.generation, s.collective, s.new_plan) for s in sw) for sw, _ in results}) == 1


def test_a_pair_no_link_explains_is_held_while_the_same_rank_stays_late_and_its_return_is_still_seen():
    """On the straggler plan for rank 3 (40 ms late from collective 4 to 13), pair (0, 1) reads 0.3x from
    collective 10, which no link explains (rank 0's other pairs and rank 1's are healthy): the switch at 11 keeps
    the plan (held, no planning) rather than planning the same plan again, the pair learns its level there anew,
    and rank 3's return is still seen a few collectives after it is on time; every rank alike, every sum exact."""
    from dataclasses import replace

    from gradsync.sim.cost import CostModel

    model = replace(CostModel(), message_s=1e-6, native_message_s=1e-6)
    results = _run_job(4, "switch:4", "straggler", torch.float32, {10: {(0, 1): 0.3}}, steps=20,
                       late={4: {3: 4e-2}, 14: {}}, cost_model=model, options=GAINFUL,
                       probe=lambda rt: [(h.collective, h.message) for h in rt.adapt.held])
    for switches, exact, held in results:
        assert exact
        assert (switches[0].collective, switches[0].conditions.straggler) == (5, 3), switches
        assert [c for c, _ in held] == [11] and "(0, 1) at" in held[0][1] and "no link is slower" in held[0][1], held
        back = switches[1]
        assert 14 < back.collective <= 17 and "rank 3 on time again" in back.message, back.message
    assert len({tuple((s.generation, s.collective) for s in r[0]) + tuple(r[2]) for r in results}) == 1


def _allreduce_across_a_replan(rt: Runtime, rank: int, **kwargs) -> float:
    """Queue an allreduce of ``rank + 1`` (``kwargs``: ``allreduce_async``'s) while the communication thread is held,
    replan (a new cost model: the executor it was queued with is closed), then let it run; its sum's first value."""
    from gradsync.sim.cost import CostModel

    gate = threading.Event()
    rt.submit(lambda: gate.wait(10))
    x = torch.full((1000,), float(rank + 1))
    work = rt.allreduce_async(x, **kwargs)
    rt.set_cost_model(CostModel())
    gate.set()
    work.wait()
    return float(x[0])


def test_a_collective_queued_before_a_replan_runs_on_the_new_plan():
    """An allreduce queued with an executor that a replan closed since (here a new cost model while the queue is
    held) picks its executor again when it runs: the old one is never run after it was closed, and the sum is
    exact."""

    def body(tr):
        rt = Runtime(tr, "switch:2", "ring", timeout_s=20, adapt=False)
        old = rt.executor()
        ran = []
        real = old.run
        old.run = lambda *a, **k: ran.append("old") or real(*a, **k)
        try:
            total = _allreduce_across_a_replan(rt, tr.rank)
            return ran, total, rt.plans.owns(old), rt.adapt
        finally:
            rt.shutdown()

    for got in run_ranks(2, body):
        assert not isinstance(got, BaseException), got
        assert got == ([], 3.0, False, None)


def test_a_queued_collective_that_asked_for_the_pick_as_it_stands_is_resolved_again_the_same_way():
    """``allreduce_async(..., explore=False)`` (compression="auto" timing the size's settled exchange) whose executor
    a replan closed before it ran picks its executor again with ``explore=False``: an explorer would time its
    candidates on that call instead, and the caller's timing would be the exploration's."""

    def body(tr):
        rt = Runtime(tr, "switch:2", "ring", timeout_s=20, adapt=False)
        asked = []
        real = rt._executor_for

        def spy(tensors, op, algorithm, explore=True):
            asked.append(explore)
            return real(tensors, op, algorithm, explore)

        rt._executor_for = spy
        try:
            return asked, _allreduce_across_a_replan(rt, tr.rank, explore=False)
        finally:
            rt.shutdown()

    for got in run_ranks(2, body):
        assert not isinstance(got, BaseException), got
        assert got == ([False, False], 3.0)  # resolved when queued, and again when it ran


def test_adapt_false_and_the_environment_turn_the_watch_off(monkeypatch):
    def body(tr):
        rt = Runtime(tr, "switch:2", "ring", timeout_s=20)
        try:
            x = torch.ones(1 << 19)  # 2 MiB: watched when the watch is on
            rt.allreduce(x)
            return rt.adapt, rt.executor(None, x.numel() * 4).sent
        finally:
            rt.shutdown()

    monkeypatch.setenv("GRADSYNC_ADAPT", "off")
    assert all(got == (None, None) for got in run_ranks(2, body))
    monkeypatch.setenv("GRADSYNC_ADAPT", "1")
    for got in run_ranks(2, body):
        assert not isinstance(got, BaseException), got
        assert got[0] is not None and got[0].watched == 1 and got[1] is None  # recorded, then let go


def test_the_count_of_kernel_read_pairs_is_the_last_collectives_not_an_earlier_ones():
    """``Adapter.tcp_pairs`` says how many of the last watched collective's pair rates came from the kernel's counters:
    a collective without a counter reading (the backend's own, or one before the connections are mapped) counts 0,
    not what an earlier collective counted."""
    from types import SimpleNamespace
    from unittest import mock

    from gradsync.comm.adapt import Adapter
    from gradsync.comm.executor import Executor

    ex = mock.Mock(spec=Executor)
    ex.sent, ex.proc_of = [], [0, 1]
    for collective in (ex, object()):
        watch = SimpleNamespace(rank=0, options=SimpleNamespace(pair_min_bytes=1), _tcp_before=None,
                                _tcp_reader=None, _tcp_peers=None, tcp_pairs=2)
        assert Adapter._measure(watch, collective) == {}  # type: ignore[arg-type]
        assert watch.tcp_pairs == 0


@pytest.mark.parametrize("name", ["ring", "tree"])
def test_the_watch_prices_a_plan_on_the_wire_as_the_cost_model_does_token_buckets_included(name):
    """Where the model holds token buckets (``burst_s``, a shaper's), the watch's price of a plan on the warm-up's
    wire (at a slowdown of 1, no rank late) is the cost model's own, not that of a wire without them."""
    from types import SimpleNamespace

    from gradsync.comm.adapt import Adapter
    from gradsync.plan.synthesizers import PlanOptions, synthesize
    from gradsync.sim.cost import CostModel
    from gradsync.topology.builders import switch

    topo = switch(4)
    schedule = synthesize(name, topo, PlanOptions())
    nbytes = float(1 << 20)
    model = CostModel(burst_s=2e-3)
    watch = SimpleNamespace(plans=SimpleNamespace(cost_model=model), slowdown=1.0)
    watch._sim_args = lambda s: Adapter._sim_args(watch, s)  # type: ignore[arg-type]
    priced = Adapter._on_wire(watch, schedule, topo, nbytes, {}).time_s  # type: ignore[arg-type]
    assert priced == pytest.approx(model.run(schedule, topo, nbytes).time_s, rel=1e-12)
    flat = dataclasses.replace(model, burst_s=0.0)
    assert priced < flat.run(schedule, topo, nbytes).time_s  # the buckets are what the price took in
