"""Tuning (gradsync.comm.tuning) on the in-process fabric: tuned choices, their cache, and the explorer on a fake clock.

The multi-process calibration and auto runs are in tests/comm/test_dist.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gradsync.comm import Executor
from gradsync.comm.local import LocalFabric
from gradsync.errors import GradsyncError


def test_tuned_choice_keeps_the_model_unless_a_candidate_is_clearly_faster():
    from gradsync.comm.tuning import TUNE_MARGIN, tuned_choice

    model = ("native", 1)
    # within the margin (noise): the model's choice stays, even when another measured a little faster
    assert tuned_choice({model: 1.0, ("tree", 1): 1.0 - TUNE_MARGIN / 2}, model) == model
    # clearly faster: the fastest wins (the 84 KB tree on the racks testbed: 1.7 ms against 6.4)
    measured = {model: 6.4e-3, ("tree", 1): 1.7e-3, ("lp", 1): 1.6e-3, ("hierarchical", 1): 5.1e-3}
    assert tuned_choice(measured, model) == ("lp", 1)
    # the model's choice measured fastest: kept
    assert tuned_choice({model: 1.0, ("ring", 1): 2.0}, model) == model
    with pytest.raises(GradsyncError, match="was not measured"):
        tuned_choice({("ring", 1): 1.0}, model)


def test_tuned_choice_falls_back_to_the_native_collective_whenever_it_measured_faster():
    """Within the margin another plan does not replace the model's choice, but the backend's own collective does
    (the 256 KiB class on the hand-written three-rack file: lp/2 72 ms against gloo's 68 ms was kept)."""
    from gradsync.comm.tuning import TUNE_MARGIN, tuned_choice

    model, native = ("lp", 2), ("native", 1)
    near = {model: 0.0720, native: 0.0684, ("tree", 1): 0.0690}
    assert tuned_choice(near, model) == model  # no fallback named: the margin rules
    assert tuned_choice(near, model, fallback=native) == native
    # the fallback measured slower, or was not measured: the model's choice stays
    assert tuned_choice({model: 1.0, native: 1.01}, model, fallback=native) == model
    assert tuned_choice({model: 1.0, ("tree", 1): 0.99}, model, fallback=native) == model
    # a clearly faster plan still beats both
    assert tuned_choice({model: 1.0, native: 0.97, ("tree", 1): 1.0 - 2 * TUNE_MARGIN}, model, fallback=native) == ("tree", 1)


def test_cached_tuned_choices_are_checked_before_auto_uses_them():
    """``use_tuned`` adopts a cache's choices per size class (what ``auto`` then runs, exact) and refuses a
    wrong file whole, naming the entry: an unknown algorithm, a size that is no class, a depth of 0."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import TUNED_TYPE

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    good = {"type": TUNED_TYPE, "classes": {"4096": {"choice": ["tree", 1]}, "65536": {"choice": ["ring", 2]}}}
    rt.use_tuned(good)
    assert rt.choice(4096) == ("tree", 1) and rt.choice(65536) == ("ring", 2)
    assert rt.executor("auto", 1000).schedule.algorithm == "tree" and rt.tuned[4096]["cached"] is True
    for bad in ({"type": "other", "classes": {}}, {"type": TUNED_TYPE, "classes": {"4096": {"choice": ["nope", 1]}}},
                {"type": TUNED_TYPE, "classes": {"5000": {"choice": ["tree", 1]}}},
                {"type": TUNED_TYPE, "classes": {"8192": {"choice": ["tree", 0]}}}, [1, 2],
                {"type": TUNED_TYPE, "classes": {"8192": {"choice": [["tree"], 1]}}},
                {"type": TUNED_TYPE, "classes": {"8192": "tree"}}):
        fresh = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
        before = fresh.plans.chosen()
        with pytest.raises(GradsyncError, match="tuned"):
            fresh.use_tuned(bad)
        assert fresh.plans.chosen() == before and fresh.tuned == {}


def test_tune_without_a_process_group_has_nothing_to_measure():
    from gradsync.comm import Runtime

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    assert rt.tune() == {} and rt.tuned == {}
    with pytest.raises(GradsyncError, match="reps=0"):
        rt.tune(reps=0)
    with pytest.raises(GradsyncError, match="max_bytes=-1"):
        rt.tune(max_bytes=-1)


def test_exploring_needs_a_process_group_and_leaves_small_classes_to_tune():
    """``explore`` times depths on a job's own calls only where a process group can agree on the timings,
    and only from EXPLORE_MIN_BYTES up, where tuning did not measure the class: without a group, ``auto`` runs
    the model's choice, nothing is recorded."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import EXPLORE_MIN_BYTES, TUNE_MAX_BYTES

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    rt.explore = True
    for nbytes in (1000, EXPLORE_MIN_BYTES // 2, TUNE_MAX_BYTES, 4 << 20):
        ex = rt.executor("auto", nbytes)
        assert (ex.schedule.algorithm, ex.schedule is rt.executor("auto", nbytes).schedule) == (rt.choice(nbytes)[0], True)
    assert not rt.exploring() and rt.tuned == {}
    assert rt.tuning.explored() == {TUNE_MAX_BYTES: None, 4 << 20: None}  # decided once: nothing to time
    # a small class tuning measured is not explored again; one it did not measure is
    tuned_rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    tuned_rt.explore = True
    tuned_rt.tuning.tuned = {TUNE_MAX_BYTES: {"choice": ["ring", 1]}}
    tuned_rt.executor("auto", TUNE_MAX_BYTES)
    tuned_rt.executor("auto", EXPLORE_MIN_BYTES)
    assert tuned_rt.tuning.explored() == {EXPLORE_MIN_BYTES: None}


def _fake_timing(monkeypatch, rt, cost) -> list:
    """The explorer on a fake clock: a call of the plan ``(name, depth)`` takes ``cost[(name, depth)]`` (or
    ``cost[depth]``; a callable: its value at each call) seconds of the tuning module's clock only (other threads
    keep the real one), ranks agree on the values as they are, and ``rt``'s executors are fakes. Returns the
    picks run, in order."""
    import gradsync.comm.tuning as tuning

    clock = [0.0]
    ran: list = []

    class Fake:
        def __init__(self, pick) -> None:
            self.pick, self.schedule = pick, None

        def run(self, tensors, op="sum"):
            ran.append(self.pick)
            took = cost[self.pick] if self.pick in cost else cost[self.pick[1]]
            clock[0] += took() if callable(took) else took
            return tensors

    real = tuning.time
    fake = {**{k: getattr(real, k) for k in dir(real) if not k.startswith("_")}, "perf_counter": lambda: clock[0]}
    monkeypatch.setattr(tuning, "time", SimpleNamespace(**fake))
    monkeypatch.setattr(tuning, "max_over_ranks", lambda group, values, device: list(values))
    monkeypatch.setattr(rt.plans, "executor", lambda name, depth, size, collective="allreduce": Fake((name, depth)))
    return ran


def _explore(ex) -> int:
    """Run ``ex`` (an ``Explorer``) on a dummy tensor until it picks; the calls it took, never more than
    ``EXPLORE_MAX_CALLS`` (the longest run the trials of compression="auto" wait out)."""
    from gradsync.comm.tuning import EXPLORE_MAX_CALLS

    calls = 0
    while ex.pick is None:
        ex.run(torch.zeros(1))
        calls += 1
        assert calls <= EXPLORE_MAX_CALLS
    return calls


@pytest.mark.parametrize("model, cost, steps, pick", [
    # the double wins twice, then the next double is within the margin: the last winner stays
    (1, {1: 10.0, 2: 8.0, 4: 6.0, 8: 5.9}, [[1, 2], [2, 4], [4, 8]], 4),
    # the half keeps winning: EXPLORE_STEPS more steps, then it stops even though 1 would be faster still
    (16, {32: 11.0, 16: 10.0, 8: 9.0, 4: 8.0, 2: 7.0, 1: 6.0}, [[16, 32, 8], [8, 4], [4, 2]], 2),
    # the model's depth wins the first step: nothing more to measure
    (4, {8: 10.0, 4: 9.0, 2: 9.5}, [[4, 8, 2]], 4),
])
def test_the_explorer_steps_on_while_the_edge_wins(monkeypatch, model, cost, steps, pick):
    """``Explorer``'s rule on timings it is handed (a fake clock: each depth's call takes ``cost``): a step
    keeps its first candidate unless another beats it by ``EXPLORE_MARGIN``; a pick at the edge is timed
    against the next depth that way, at most ``EXPLORE_STEPS`` more times; then the pick is recorded and run."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import EXPLORE_REPS, EXPLORE_STEPS, Explorer

    assert EXPLORE_STEPS == 2  # the second case's three steps
    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    picks = _fake_timing(monkeypatch, rt, cost)
    first = [("ring", model)] + [("ring", q) for q in (2 * model, model // 2) if q >= 1]
    ex = Explorer(rt.tuning, object(), 4 << 20, first)
    before = rt.settling
    calls = _explore(ex)
    assert rt.settling - before == calls  # every call that measured ran a candidate, not the class's pick
    record = rt.tuned[4 << 20]
    assert [[c[1] for c in step["candidates"]] for step in record["steps"]] == steps
    assert ex.pick == ("ring", pick) and record["choice"] == ["ring", pick] and rt.choice(4 << 20) == ("ring", pick)
    assert calls == sum((1 + EXPLORE_REPS) * len(step) for step in steps)
    ran = [depth for _, depth in picks]
    assert ran[-len(steps[-1]):] == steps[-1]  # the last round: the last step's candidates, in turn
    ex.run(torch.zeros(1))
    assert picks[-1] == ("ring", pick) and record["measured_s"]["ring/" + str(pick)] == cost[pick]
    assert rt.settling - before == calls  # the pick's own calls settle nothing


@pytest.mark.parametrize("rival_cost, steps, pick", [
    # the other algorithm runs 10% faster: it wins the first step, then its own double and half are timed
    ({8: 9.0, 16: 8.5, 4: 9.5}, [["forest/8", "forest/16", "forest/4", "hierarchical/8"],
                                  ["hierarchical/8", "hierarchical/16", "hierarchical/4"]], "hierarchical/16"),
    # it is slower, as the model said: the model's depth stays and nothing more is timed
    ({8: 11.0, 16: 12.0, 4: 12.0}, [["forest/8", "forest/16", "forest/4", "hierarchical/8"]], "forest/8"),
])
def test_the_explorer_times_a_rival_algorithm_and_its_depths_when_it_wins(monkeypatch, rival_cost, steps, pick):
    """A first step with another algorithm's plan beside the model's depths (what ``rival_of`` adds): measured
    faster by more than the margin, it replaces the model's algorithm and is stepped over its own depths."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import Explorer

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    _fake_timing(monkeypatch, rt, {("forest", 8): 10.0, ("forest", 16): 10.5, ("forest", 4): 10.2,
                                   **{("hierarchical", d): t for d, t in rival_cost.items()}})
    monkeypatch.setattr(rt.plans, "plannable", lambda name, depth: depth in (4, 8, 16))
    ex = Explorer(rt.tuning, object(), 4 << 20, [("forest", 8), ("forest", 16), ("forest", 4), ("hierarchical", 8)])
    _explore(ex)
    record = rt.tuned[4 << 20]
    assert [[f"{a}/{d}" for a, d in step["candidates"]] for step in record["steps"]] == steps
    assert "/".join(map(str, ex.pick)) == pick and rt.choice(4 << 20) == ex.pick


def test_candidates_at_half_the_pace_leave_the_step_after_two_timed_rounds(monkeypatch):
    """The backend's allreduce beside three planned depths that each take twice as long: after the warm-up and two
    timed rounds the plans leave, and the backend is picked on the twelfth call instead of the sixteenth; the record
    names what left and how many calls the step took."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import EXPLORE_DROP, EXPLORE_DROP_AFTER, EXPLORE_REPS, Explorer

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    cands = [("forest", 8), ("forest", 16), ("forest", 4), ("native", 1)]
    picks = _fake_timing(monkeypatch, rt, {("forest", 8): 2.0, ("forest", 16): 2.1, ("forest", 4): 2.2, ("native", 1): 1.0})
    assert 2.0 >= EXPLORE_DROP * 1.0 and EXPLORE_REPS == EXPLORE_DROP_AFTER + 1  # one round is left to save
    ex = Explorer(rt.tuning, object(), 4 << 20, cands)
    assert _explore(ex) == 3 * len(cands)
    assert picks == cands * 3 and ex.pick == ("native", 1)
    step = rt.tuned[4 << 20]["steps"][0]
    assert step["candidates"] == [list(c) for c in cands] and step["calls"] == 12
    assert step["pruned"] == ["forest/8", "forest/16", "forest/4"] and step["pick"] == ["native", 1]
    assert step["measured_s"] == pytest.approx({"forest/8": 2.0, "forest/16": 2.1, "forest/4": 2.2, "native/1": 1.0})


def test_a_candidate_that_left_stops_running_and_the_others_finish_their_rounds(monkeypatch):
    """Only the slow half leaves: the model's depth and its double alternate for the remaining timed rounds, and the
    pick is made among them by the margin rule (the double, 1 % quicker, does not replace the model's depth)."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import EXPLORE_REPS, Explorer

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    picks = _fake_timing(monkeypatch, rt, {4: 1.0, 8: 0.99, 2: 1.6})
    ex = Explorer(rt.tuning, object(), 4 << 20, [("ring", 4), ("ring", 8), ("ring", 2)])
    calls = _explore(ex)
    assert calls == 3 * 3 + 2 * (EXPLORE_REPS - 2)
    assert [d for _, d in picks] == [4, 8, 2] * 3 + [4, 8] * (EXPLORE_REPS - 2)
    step = rt.tuned[4 << 20]["steps"][0]
    assert step["pruned"] == ["ring/2"] and step["calls"] == calls and ex.pick == ("ring", 4)


def test_a_candidate_under_the_drop_ratio_is_timed_every_round(monkeypatch):
    """A depth whose first two timed calls took 1.4x and 2x the model's (the quicker under EXPLORE_DROP) stays in the
    step: every call of the full rounds runs, and nothing is recorded as having left."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import EXPLORE_REPS, Explorer

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    slow = iter([1.0, 1.4, 2.0] + [1.0] * 10)  # its warm-up, then 1.4x and 2x, then as quick as the model's
    _fake_timing(monkeypatch, rt, {4: 1.0, 8: lambda: next(slow)})
    ex = Explorer(rt.tuning, object(), 4 << 20, [("ring", 4), ("ring", 8)])
    assert _explore(ex) == 2 * (1 + EXPLORE_REPS)
    assert rt.tuned[4 << 20]["steps"][0]["pruned"] == []


@pytest.mark.parametrize("priced_native, warm_native, leaves", [
    # priced at 1.6x the model's depth and its warm-up call 1.3x the quickest: it leaves after the warm-up round
    (1.6, 1.3, True),
    # priced slow, but its warm-up call near the quickest: the readings disagree, it is timed
    (1.6, 1.2, False),
    # its warm-up call slow, but priced under EXPLORE_DROP: timed too (one call alone is not a reading)
    (1.4, 1.3, False),
])
def test_a_candidate_priced_and_warmed_up_slow_leaves_after_the_warm_up_round(monkeypatch, priced_native, warm_native,
                                                                             leaves):
    """The backend's collective beside three planned depths: where the model priced it at EXPLORE_DROP times the
    incumbent and its warm-up call took EXPLORE_DROP_WARM times the quickest warm-up call, it leaves before any timed
    call (one small all-reduce agrees on the warm-up calls) and the plans finish their rounds; the record names it,
    with its warm-up call as its time. Otherwise it is timed with the rest (its timed calls, 1.3x, stay under the
    later drop)."""
    import gradsync.comm.tuning as tuning
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import EXPLORE_DROP, EXPLORE_DROP_WARM, EXPLORE_REPS, Explorer

    assert 1.2 < EXPLORE_DROP_WARM <= 1.3 and 1.4 < EXPLORE_DROP <= 1.6  # the cases sit either side of both bars
    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    native = iter([warm_native] + [1.3] * 10)  # its warm-up call, then its timed calls
    cands = [("forest", 8), ("forest", 16), ("forest", 4), ("native", 1)]
    picks = _fake_timing(monkeypatch, rt, {("forest", 8): 1.0, ("forest", 16): 1.01, ("forest", 4): 1.02,
                                           ("native", 1): lambda: next(native)})
    agreed: list = []
    monkeypatch.setattr(tuning, "max_over_ranks", lambda group, values, device: agreed.append(values) or list(values))
    priced = {("forest", 8): 2.0, ("forest", 16): 2.0, ("forest", 4): 2.1, ("native", 1): 2.0 * priced_native}
    ex = Explorer(rt.tuning, object(), 4 << 20, cands, priced)
    try:
        calls = _explore(ex)
    finally:
        rt.shutdown()
    step = rt.tuned[4 << 20]["steps"][0]
    assert ex.pick == ("forest", 8)
    if leaves:
        assert calls == 4 + 3 * EXPLORE_REPS and picks == cands + cands[:3] * EXPLORE_REPS
        assert step["pruned"] == ["native/1"] and step["measured_s"]["native/1"] == pytest.approx(warm_native)
        assert agreed[0] == pytest.approx([1.0, 1.01, 1.02, warm_native])  # the warm-up calls, agreed first
    else:
        assert calls == 4 * (1 + EXPLORE_REPS) and step["pruned"] == []
        assert step["measured_s"]["native/1"] == pytest.approx(1.3)


def test_a_step_whose_other_candidates_all_leave_after_the_warm_up_round_picks_the_incumbent(monkeypatch):
    """The model's depth against the backend alone, both readings saying the backend is slow: the explorer picks the
    model's depth after the warm-up round, its warm-up call standing as its time."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import Explorer

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    _fake_timing(monkeypatch, rt, {("forest", 8): 1.0, ("native", 1): 2.0})
    ex = Explorer(rt.tuning, object(), 4 << 20, [("forest", 8), ("native", 1)], {("forest", 8): 1.0, ("native", 1): 1.7})
    try:
        assert _explore(ex) == 2
    finally:
        rt.shutdown()
    record = rt.tuned[4 << 20]
    assert ex.pick == ("forest", 8) and record["measured_s"] == {"forest/8": 1.0, "native/1": 2.0}
    assert record["steps"][0]["pruned"] == ["native/1"]


def test_rival_of_takes_another_algorithm_the_model_prices_close():
    """Within EXPLORE_RIVAL of the model's choice: the best-priced plan of another algorithm (never native)."""
    from gradsync.sim.choose import EXPLORE_RIVAL, Candidate, Choice, rival_of

    def choice(*cands):
        return Choice("forest", 8, 1.0, 4 << 20, tuple(Candidate(a, p, t) for a, p, t in cands))

    close = 1.0 * (1 + EXPLORE_RIVAL) * 0.99
    assert rival_of(choice(("native", 1, 1.0), ("forest", 8, 1.0), ("forest", 16, 1.02), ("hierarchical", 4, close + 0.005),
                           ("hierarchical", 8, close), ("lp", 16, 1.05)), ("forest", 8)) == [("lp", 16)]
    assert rival_of(choice(("forest", 8, 1.0), ("hierarchical", 8, 1.0 * (1 + EXPLORE_RIVAL) * 1.01)), ("forest", 8)) == []
    assert rival_of(choice(("native", 1, 0.9), ("forest", 8, 1.0)), ("forest", 8)) == []
    assert rival_of(choice(("hierarchical", 8, 1.0)), ("forest", 8)) == []  # the model's pick was not priced here
    # an algorithm priced exactly as the model's at every depth is the same plan (lp as one tree): the next one
    same = (("tree", 16, 1.05), ("tree", 32, 1.0), ("lp", 16, 1.05), ("lp", 32, 1.0), ("forest", 8, 1.01))
    assert rival_of(Choice("tree", 32, 1.0, 1 << 20, tuple(Candidate(a, p, t) for a, p, t in same)),
                    ("tree", 32)) == [("forest", 8)]
    # priced the same at the model's depth only: a different plan, still the rival
    near = (("tree", 16, 1.05), ("tree", 32, 1.0), ("lp", 16, 1.04), ("lp", 32, 1.0), ("forest", 8, 1.01))
    assert rival_of(Choice("tree", 32, 1.0, 1 << 20, tuple(Candidate(a, p, t) for a, p, t in near)),
                    ("tree", 32)) == [("lp", 32)]


def test_an_explored_pick_joins_the_cache_and_the_next_job_runs_it_without_timing(tmp_path, monkeypatch):
    """A size class the first calls settled (``Explorer``) is written beside the tuned small classes (rank 0,
    the cache of ``init(calibrate=True)``); a runtime that reads that file back runs the pick from its first
    call and times nothing; under a new cost model the class is priced and explored afresh, and a pick made
    then is not written into the old model's file."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import TUNED_TYPE, Explorer
    from gradsync.sim.cost import CostModel

    monkeypatch.setenv("GRADSYNC_CACHE", str(tmp_path))
    size = 4 << 20
    cost = {1: 10.0, 2: 8.0, 4: 6.0, 8: 5.9}  # the double wins twice, then the margin keeps 4

    def explore(rt: Runtime) -> Explorer:
        _fake_timing(monkeypatch, rt, cost)
        ex = Explorer(rt.tuning, object(), size, [("ring", 1), ("ring", 2)])
        for _ in range(40):
            if ex.pick is not None:
                break
            ex.run(torch.zeros(1))
        return ex

    small = {"4096": {"choice": ["tree", 1], "model": ["ring", 1]}}  # what tune() measured at init
    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    path = Path(rt.tuning.cache_path("tuned"))
    path.write_text(json.dumps({"type": TUNED_TYPE, "classes": small}))
    rt.tuning.cached("tuned", "tuned choices", rt.use_tuned, lambda: pytest.fail("the file should be read"))
    rt.tuned_cache = (str(path), rt.plans.generation)  # as init(calibrate=True) leaves it
    assert explore(rt).pick == ("ring", 4)
    doc = json.loads(path.read_text())
    assert doc["type"] == TUNED_TYPE and doc["classes"]["4096"]["choice"] == ["tree", 1]  # the small class kept
    assert doc["classes"][str(size)]["choice"] == ["ring", 4] and doc["classes"][str(size)]["online"] is True
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed

    again = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    again.tuning.cached("tuned", "tuned choices", again.use_tuned, lambda: pytest.fail("the file should be read"))
    again.explore = True
    monkeypatch.setattr(again.plans, "caps", replace(again.caps, group=object()))  # as if it could time its calls
    ex = again.executor("auto", 3 << 20)  # the class of 4 MiB: a real executor of the kept pick, nothing timed
    assert isinstance(ex, Executor) and (ex.schedule.algorithm, again.choice(3 << 20)) == ("ring", ("ring", 4))
    assert again.tuning.explored()[size] is None and not again.exploring()
    assert again.tuned[size]["cached"] is True and again.tuned[4096]["choice"] == ["tree", 1]

    again.tuned_cache = (str(path), again.plans.generation)
    again.set_cost_model(CostModel(message_s=again.cost_model.message_s * 2))
    assert size not in again.tuning.explored() and size not in again.plans.chosen()  # a new model: priced, explored afresh ...
    before = path.read_text()
    cost[2] = 5.0
    assert explore(again).pick == ("ring", 2)
    assert path.read_text() == before  # ... and not written under the old model's key


def test_a_cached_result_that_does_not_read_back_is_measured_again_and_rewritten(tmp_path, monkeypatch):
    """The calibration's and the tuned choices' cache (``Tuning.cached``): a corrupt file is ignored with a warning
    naming it, the result is measured and written by rank 0, and the next init uses the file, measuring nothing."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import TUNED_TYPE

    monkeypatch.setenv("GRADSYNC_CACHE", str(tmp_path))
    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    path = Path(rt.tuning.cache_path("tuned"))
    assert path.parent == tmp_path
    path.write_text("{not json")
    doc = {"type": TUNED_TYPE, "classes": {"4096": {"choice": ["tree", 1]}}}
    measured = []

    def measure():
        measured.append(1)
        return doc

    with pytest.warns(UserWarning, match=r"ignoring the cached tuned choices .*tuned-.*\.json"):
        rt.tuning.cached("tuned", "tuned choices", rt.use_tuned, measure)
    assert measured == [1] and json.loads(path.read_text()) == doc
    again = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    again.tuning.cached("tuned", "tuned choices", again.use_tuned, measure)
    assert measured == [1] and again.choice(4096) == ("tree", 1)


def _plans(topology: str, *, backend: str = "gloo", native: bool = True, world: int | None = None,
           mapping: object = None) -> SimpleNamespace:
    """What :meth:`Tuning.calibration_pays` reads of a plan cache, for a process-group transport on one rank."""
    from gradsync.sim.choose import Chooser
    from gradsync.topology import get_topology

    topo = get_topology(topology)
    return SimpleNamespace(caps=SimpleNamespace(native=native, backend=backend), mapping=mapping,
                           decide=lambda key, compute: compute(), topology=topo,
                           chooser=lambda collective: Chooser(topo, native=True),
                           transport=SimpleNamespace(world_size=world or topo.world_size, rank=0))


def test_the_default_calibrates_only_where_a_plan_beats_the_backends_ring_in_bandwidth(tmp_path):
    """init's default measures the wire where the pick turns on its rates: auto, over a backend it plans for,
    on a topology where some plan moves less over the bottleneck than the rank-order ring (a hand-written
    two-rack file without attrs, bcube). A flat switch, a named algorithm, NCCL, no process group, one rank or
    a custom mapping measure nothing."""
    from gradsync.comm.tuning import Tuning

    two_racks = tmp_path / "two-racks.yaml"
    two_racks.write_text(
        "name: two-racks\n"
        "devices: [{name: t0, kind: switch}, {name: t1, kind: switch}, {name: a, kind: host}, {name: b, kind: host},"
        " {name: c, kind: host}, {name: d, kind: host}]\n"
        "links: [{a: a, b: t0, bandwidth_GBps: 4}, {a: b, b: t0, bandwidth_GBps: 4}, {a: c, b: t1, bandwidth_GBps: 4},"
        " {a: d, b: t1, bandwidth_GBps: 4}, {a: t0, b: t1, bandwidth_GBps: 1}]\n")

    def pays(topology: str, algorithm: str = "auto", **kw) -> bool:
        return Tuning(_plans(topology, **kw), submit=None).calibration_pays(algorithm)  # type: ignore[arg-type]

    assert pays(str(two_racks)) and pays("bcube:2,2") and pays("racks:2,3,4")
    assert not pays("switch:6") and not pays("fattree:4")  # no bandwidth advantage: the native ring stays
    assert not pays(str(two_racks), "ring")
    assert not pays(str(two_racks), backend="nccl") and not pays(str(two_racks), native=False)
    assert not pays(str(two_racks), mapping=[0, 1, 2, 3]) and not pays("switch:1", world=1)


def test_the_natives_alpha_is_solved_on_its_overlapping_price():
    """Calibration reads the backend's α off a small allreduce priced as 2(N-1) max(wire, α) (not affine in α):
    the solved α gives back the measured time (α above the step's wire time: below it α does not show), and the
    edge cases say what they return."""
    from gradsync.comm.tuning import _solve_rising
    from gradsync.sim.cost import CostModel
    from gradsync.topology import get_topology

    t = get_topology("switch:5")
    base = CostModel()
    for true_alpha in (2e-3, 1e-6 * 30):
        measured = replace(base, native_message_s=true_alpha).predict_native(t, 4096)
        got = _solve_rising(lambda a: replace(base, native_message_s=a).predict_native(t, 4096), measured, 7.0)
        assert replace(base, native_message_s=got).predict_native(t, 4096) == pytest.approx(measured, rel=2e-3)
    assert _solve_rising(lambda a: 1.0 + a, 0.5, 7.0) == 1e-6  # slower than measured at α = 0: the floor
    assert _solve_rising(lambda a: 1.0, 2.0, 7.0) == 7.0  # α does not move it: unchanged


def test_native_rival_of_times_the_backend_beside_every_plan_and_a_near_plan_beside_the_backend():
    """The backend's collective is timed beside the model's plan however far the model prices it (a plan's executor
    shares the cores with training, which the model does not see; docs/runtime.md); the best plan is timed beside the backend's, when the
    model chose it, within EXPLORE_NATIVE only."""
    from gradsync.sim.choose import EXPLORE_NATIVE, Candidate, Choice, native_rival_of

    def choice(*cands):
        return Choice(cands[0][0], cands[0][1], cands[0][2], 256 << 10, tuple(Candidate(a, p, t) for a, p, t in cands))

    near = 1 + EXPLORE_NATIVE * 0.9
    far = 1 + EXPLORE_NATIVE * 1.1
    assert native_rival_of(choice(("lp", 2, 1.0), ("native", 1, near), ("tree", 1, 1.01)), ("lp", 2)) == [("native", 1)]
    assert native_rival_of(choice(("lp", 2, 1.0), ("native", 1, far)), ("lp", 2)) == [("native", 1)]
    assert native_rival_of(choice(("lp", 2, 1.0), ("native", 1, 10.0)), ("lp", 2)) == [("native", 1)]
    assert native_rival_of(choice(("native", 1, 1.0), ("hierarchical", 2, near), ("hierarchical", 1, near * 1.01)),
                           ("native", 1)) == [("hierarchical", 2)]
    assert native_rival_of(choice(("native", 1, 1.0), ("hierarchical", 2, far)), ("native", 1)) == []
    assert native_rival_of(choice(("native", 1, 1.0)), ("native", 1)) == []  # no plan was priced
    assert native_rival_of(choice(("lp", 2, 1.0)), ("lp", 2)) == []  # no process group: the backend was not priced


def _drifting(before: float, calls: int, after: float):
    """A call time for ``_fake_timing``: ``before`` for the first ``calls`` calls, ``after`` from then on."""
    seen = [0]

    def took() -> float:
        seen[0] += 1
        return before if seen[0] <= calls else after
    return took


@pytest.mark.parametrize("first, cost, steps, pick", [
    # the model's plan measured 5% slower than the backend's collective: within the margin, yet the backend wins
    ([("lp", 2), ("lp", 4), ("lp", 1), ("native", 1)], {("lp", 2): 72.0, ("lp", 4): 80.0, ("lp", 1): 75.0,
                                                         ("native", 1): 68.0}, 1, ("native", 1)),
    # the model chose the backend; the plan beside it measured 1.4x quicker: it wins and its depths are timed
    ([("native", 1), ("hierarchical", 2)], {("native", 1): 62.0, ("hierarchical", 1): 50.0, ("hierarchical", 2): 45.0,
                                            ("hierarchical", 4): 47.0}, 2, ("hierarchical", 2)),
    # the model chose the backend and it measured quickest: kept, nothing more timed
    ([("native", 1), ("hierarchical", 2)], {("native", 1): 62.0, ("hierarchical", 2): 63.0}, 1, ("native", 1)),
    # lp/4 beat the backend in the first step, then its half won the next step (its first 4 calls at 25), which
    # times depths only; in the last step it ran at 33, slower than the backend measured: the backend is run
    ([("lp", 8), ("lp", 16), ("lp", 4), ("native", 1)], {("lp", 8): 29.0, ("lp", 16): 28.0, ("lp", 4): 26.0,
                                                          ("native", 1): 27.7, ("lp", 2): _drifting(25.0, 4, 33.0),
                                                          ("lp", 1): 40.0}, 3, ("native", 1)),
])
def test_the_explorer_never_settles_on_a_plan_slower_than_the_backend(monkeypatch, first, cost, steps, pick):
    """The backend's collective among the explored candidates (``native_rival_of``): any measured edge keeps it (no
    margin); a plan that beat it is stepped over its own depths, as any other algorithm's."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import Explorer

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    _fake_timing(monkeypatch, rt, cost)
    monkeypatch.setattr(rt.plans, "plannable", lambda name, depth: name != "native" and (name, depth) in cost)
    ex = Explorer(rt.tuning, object(), 256 << 10, first)
    _explore(ex)
    record = rt.tuned[256 << 10]
    assert ex.pick == pick and rt.choice(256 << 10) == pick and len(record["steps"]) == steps


@pytest.mark.parametrize("again, pick", [
    # lp/32 won the first step on a lucky median (0.928 against the model's 0.968), then timed 0.987 beside its own
    # double: no longer 3 % ahead of the model's choice, which runs (file-3racks, 4 MiB, 2026-11-29: lp/32 ran 1.066 s)
    (0.987, ("lp", 16)),
    # timed again at 0.930: still more than the margin ahead of the model's 0.968, so it stays
    (0.930, ("lp", 32)),
])
def test_a_pick_timed_again_must_still_beat_the_models_choice_by_the_margin(monkeypatch, again, pick):
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import EXPLORE_MARGIN, EXPLORE_REPS, Explorer

    assert 0.987 > (1 - EXPLORE_MARGIN) * 0.968 > 0.930  # the two cases sit either side of the margin
    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    cost = {("lp", 16): 0.968, ("lp", 8): 0.972, ("lp", 32): _drifting(0.928, 1 + EXPLORE_REPS, again),
            ("lp", 64): 1.018}
    _fake_timing(monkeypatch, rt, cost)
    monkeypatch.setattr(rt.plans, "plannable", lambda name, depth: (name, depth) in cost)
    dropped: list = []
    monkeypatch.setattr(rt.plans, "drop", lambda picks: dropped.extend(picks))
    ex = Explorer(rt.tuning, object(), 4 << 20, [("lp", 16), ("lp", 32), ("lp", 8)])
    _explore(ex)
    record = rt.tuned[4 << 20]
    assert [[d for _, d in step["candidates"]] for step in record["steps"]] == [[16, 32, 8], [32, 64]]
    assert [tuple(step["pick"]) for step in record["steps"]] == [("lp", 32), ("lp", 32)]  # each step's own rule
    assert ex.pick == pick and rt.choice(4 << 20) == pick and record["choice"] == list(pick)
    assert record["measured_s"]["lp/32"] == pytest.approx(again)  # the latest time of each candidate is what the record keeps
    assert (("lp", 32) in dropped) == (pick == ("lp", 16))  # a pick given up releases its executor


def test_picks_native_reads_the_sizes_pick_not_the_explorer_in_front_of_it(monkeypatch):
    """``picks_native``: whether the size's pick is the backend's collective, even while an explorer (which
    ``runs_natively`` sees instead) times a plan against it; a named algorithm's pick is itself. ``explore=False``
    gives the pick's executor, not the explorer."""
    from gradsync.comm import Runtime
    from gradsync.sim.cost import NATIVE

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    assert not rt.picks_native(4 << 20)  # no process group: the chooser prices plans only
    monkeypatch.setattr(rt.plans, "choice", lambda size, collective="allreduce": (NATIVE, 1))
    exploring = SimpleNamespace(schedule=None)
    monkeypatch.setattr(rt.tuning, "explorer", lambda size, pick: exploring)
    assert rt.executor("auto", 4 << 20) is exploring and not rt.runs_natively(4 << 20)
    assert rt.picks_native(4 << 20)
    picked = SimpleNamespace(schedule=None)
    monkeypatch.setattr(rt.plans, "executor", lambda name, depth, size, collective="allreduce": picked)
    assert rt.executor("auto", 4 << 20, explore=False) is picked  # the pick itself, as it stands
    named = Runtime(LocalFabric(2).transport(0), "switch:2", "ring", timeout_s=5)
    assert not named.picks_native(4 << 20)
    rt.shutdown()
    named.shutdown()
