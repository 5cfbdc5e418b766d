"""The executor on the in-process fabric: every synthesizer, many shapes, against exact sums.

The real-process tests (gloo) are in test_comm_dist.py; these cover the combinatorics cheaply.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradsync.comm import Executor, compile_program, process_mapping, run_ranks
from gradsync.comm.local import LocalFabric
from gradsync.errors import GradsyncError, PeerError, PlanError
from gradsync.plan import SYNTHESIZERS, PlanOptions, synthesize
from gradsync.topology.io import get_topology
from tests.conftest import random_topology

TOPOLOGIES = ["switch:2", "switch:3", "ring:4", "p3.8xlarge", "bcube:2,2", "bcube:3,2", "fattree:4", "p2.8xlarge", "racks:2,3,4"]


def _inputs(rank: int, numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Integer-valued inputs (exact in float32 too), different per rank and per tensor."""
    return [((torch.arange(n, dtype=torch.float64) % 97) * (rank + 1) + 1000 * i).to(dtype) for i, n in enumerate(numels)]


def _allreduce_everywhere(schedule, numels, dtype, op="sum", mapping=None):
    def body(tr):
        xs = _inputs(tr.rank, numels, dtype)
        ex = Executor(schedule, tr, timeout_s=20, mapping=mapping)
        ex.run(xs if len(xs) != 1 else xs[0], op=op)
        return xs

    return run_ranks(schedule.world_size, body)


def _cases():
    for name in TOPOLOGIES:
        topo = get_topology(name)
        for alg in SYNTHESIZERS.names():
            # auto returns one of the others' schedules; the process tests run it
            if not SYNTHESIZERS.get(alg).applicable(topo):
                yield name, alg


@pytest.mark.parametrize("topo_name,algorithm", list(_cases()))
def test_every_synthesizer_sums_exactly(topo_name, algorithm):
    topo = get_topology(topo_name)
    n = topo.world_size
    big = n > 8  # fewer combinations where one allreduce runs 9-16 threads
    for pipeline in (1,) if big else (1, 3):
        schedule = synthesize(algorithm, topo, PlanOptions(pipeline=pipeline))
        for dtype in (torch.float64,) if big else (torch.float32, torch.float64):
            for numels in ([0], [1009], [7, 0, 31, 2]) if big else ([0], [1], [13], [1009], [7, 0, 31, 2]):
                results = _allreduce_everywhere(schedule, numels, dtype)
                expected = [sum(_inputs(r, numels, torch.float64)[i] for r in range(n)) for i in range(len(numels))]
                for rank, got in enumerate(results):
                    assert not isinstance(got, BaseException), f"rank {rank}: {got!r}"
                    for g, e in zip(got, expected):
                        assert g.dtype == dtype
                        assert torch.equal(g.to(torch.float64), e), (algorithm, pipeline, numels, rank)


def test_random_topologies_lp_and_tree():
    for seed in range(4):
        topo = random_topology(5, 3, seed)
        for alg in ("lp", "tree", "ring", "multiring"):
            schedule = synthesize(alg, topo, PlanOptions(pipeline=2))
            res = _allreduce_everywhere(schedule, [101], torch.float64)
            exp = sum(_inputs(r, [101], torch.float64)[0] for r in range(5))
            assert all(torch.equal(x[0], exp) for x in res), (seed, alg)


def test_avg_divides_and_rejects_integers():
    schedule = synthesize("ring", get_topology("switch:4"))
    res = _allreduce_everywhere(schedule, [10], torch.float64, op="avg")
    exp = sum(_inputs(r, [10], torch.float64)[0] for r in range(4)) / 4
    assert all(torch.allclose(x[0], exp) for x in res)
    res = _allreduce_everywhere(schedule, [10], torch.int64, op="avg")
    assert all(isinstance(x, TypeError) and "floating-point" in str(x) for x in res)


def test_results_bitwise_identical_across_ranks_with_random_floats():
    """Each chunk is reduced at one place and copied out, so every rank holds the same bits."""
    for alg in ("ring", "ps", "lp", "multiring"):
        schedule = synthesize(alg, get_topology("p3.8xlarge"), PlanOptions(pipeline=2))

        def body(tr, schedule=schedule):
            x = torch.randn(1000, generator=torch.Generator().manual_seed(tr.rank))
            Executor(schedule, tr).run(x)
            return x

        res = run_ranks(4, body)
        assert all(torch.equal(res[0], r) for r in res[1:]), alg


def test_mapping_places_devices_on_processes():
    """Process p runs device mapping[p]; the result is the same sum whatever the placement."""
    topo = get_topology("p3.8xlarge")
    schedule = synthesize("lp", topo)
    perm = [2, 0, 3, 1]  # schedule rank r runs on process perm[r]
    res = _allreduce_everywhere(schedule, [50], torch.float64, mapping=perm)
    exp = sum(_inputs(r, [50], torch.float64)[0] for r in range(4))
    assert all(torch.equal(x[0], exp) for x in res)
    by_name = {topo.ranks[r]: perm[r] for r in range(4)}
    assert process_mapping(schedule, by_name, 4) == perm
    with pytest.raises(GradsyncError, match="exactly once"):
        process_mapping(schedule, [0, 0, 1, 2], 4)
    with pytest.raises(GradsyncError, match="world_size=3"):
        process_mapping(schedule, None, 3)
    with pytest.raises(GradsyncError, match="not ranks"):
        process_mapping(schedule, {"nope": 0}, 4)


def test_program_tags_match_between_sender_and_receiver():
    """Both ends of every transfer compute the same (peer, tag), and tags are unique per ordered pair."""
    schedule = synthesize("bml", get_topology("bcube:3,2"), PlanOptions(pipeline=2))
    sends, recvs = {}, {}
    for r in range(schedule.world_size):
        prog = compile_program(schedule, r)
        for phases in prog.phases:
            for ph in phases:
                for a in ph.sends:
                    key = (r, a.peer, a.tag)
                    assert key not in sends
                    sends[key] = a.index
                for a in ph.recvs:
                    recvs[(a.peer, r, a.tag)] = a.index
    assert sends == recvs
    assert len(sends) == len(schedule.transfers)
    # tags are dense per pair: 0..k-1
    per_pair: dict[tuple[int, int], list[int]] = {}
    for (s, d, tag) in sends:
        per_pair.setdefault((s, d), []).append(tag)
    assert all(sorted(t) == list(range(len(t))) for t in per_pair.values())


def test_phase_steps_increase_and_sends_never_precede_their_inputs():
    schedule = synthesize("lp", get_topology("p3.16xlarge"), PlanOptions(pipeline=2))
    deps = schedule.dependencies()
    for r in range(schedule.world_size):
        prog = compile_program(schedule, r)
        for phases in prog.phases:
            steps = [p.step for p in phases]
            assert steps == sorted(set(steps))
            seen_recv: set[int] = set()
            for ph in phases:
                for a in ph.sends:  # every dependency of a send arrived in an earlier phase of this chunk
                    assert set(deps[a.index]) <= seen_recv
                seen_recv |= {a.index for a in ph.recvs}


def test_bad_inputs_are_named():
    schedule = synthesize("ring", get_topology("switch:2"))
    tr = LocalFabric(2).transport(0)
    ex = Executor(schedule, tr)
    with pytest.raises(TypeError, match="not contiguous"):
        ex.run(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="one dtype"):
        ex.run([torch.zeros(3), torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(GradsyncError, match="op='max'"):
        ex.run(torch.zeros(3), op="max")
    with pytest.raises(GradsyncError, match="timeout_s"):
        Executor(schedule, tr, timeout_s=0)
    with pytest.raises(GradsyncError, match="world_size=3"):
        Executor(schedule, LocalFabric(3).transport(0))
    with pytest.raises(PlanError, match="rings"):
        PlanOptions(rings=0)


def test_dead_rank_is_named_by_every_survivor():
    """Rank 2 dies before sending; ranks 0 and 1 raise PeerError naming rank 2 (not each other)."""
    schedule = synthesize("ring", get_topology("switch:4"))

    def body(tr):
        if tr.rank == 2:
            raise RuntimeError("simulated crash")
        Executor(schedule, tr, timeout_s=2).run(torch.ones(64))

    res = run_ranks(4, body)
    for r in (0, 1, 3):
        assert isinstance(res[r], PeerError), (r, res[r])
        assert res[r].peer == 2, (r, str(res[r]))
        assert "rank 2" in str(res[r])


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


@pytest.mark.parametrize("window", [0, 1, 100, 700, 3000, 1 << 30])
def test_receive_window_sizes_all_give_the_exact_sum(window):
    """Receives posted ahead (any window, even smaller than one chunk) never change the result."""
    for alg, topo_name in (("ring", "switch:4"), ("bml", "bcube:2,2"), ("lp", "p3.8xlarge"), ("ps", "switch:3")):
        schedule = synthesize(alg, get_topology(topo_name), PlanOptions(pipeline=2))
        n = schedule.world_size

        def body(tr, schedule=schedule):
            ex = Executor(schedule, tr, recv_window_bytes=window, timeout_s=5)
            for _ in range(3):  # consecutive collectives reuse tags: a duplicate receive would steal the next one's
                xs = _inputs(tr.rank, [1257, 0, 31], torch.float64)
                ex.run(xs)
            return xs

        res = run_ranks(n, body)
        exp = [sum(_inputs(r, [1257, 0, 31], torch.float64)[i] for r in range(n)) for i in range(3)]
        for got in res:
            assert not isinstance(got, BaseException), got
            assert all(torch.equal(g, e) for g, e in zip(got, exp)), (alg, window)
    with pytest.raises(GradsyncError, match="recv_window_bytes"):
        Executor(schedule, LocalFabric(n).transport(0), recv_window_bytes=-1)


def _phase_pairs(schedule):
    """(u, t) for every two transfers of one chunk at a shared rank with u at an earlier step than t."""
    ts = schedule.transfers
    for i, t in enumerate(ts):
        for j, u in enumerate(ts):
            if u.chunk == t.chunk and u.step < t.step and {u.src, u.dst} & {t.src, t.dst}:
                yield j, i


@pytest.mark.parametrize("alg,topo_name", [("tree", "racks:2,3,4"), ("bml", "bcube:2,2"), ("lp", "p3.8xlarge"),
                                           ("ring", "switch:4"), ("ps", "switch:3")])
def test_any_phase_order_keeps_the_run_exact(alg, topo_name):
    """The executor waits in the cost model's predicted arrival order; for *any* times ``phase_order``
    gives a global order in which the executor cannot deadlock. Checked with the model's times and with
    random ones (brute force over pairs for the order property, exact sums for the run)."""
    from gradsync.sim.cost import CostModel, phase_order

    topo = get_topology(topo_name)
    schedule = synthesize(alg, topo, PlanOptions(pipeline=4))
    rng = np.random.default_rng(7)
    orders = [CostModel().wait_order(schedule, topo, 1 << 20), phase_order(schedule, rng.random(len(schedule.transfers)))]
    for order in orders:
        for u, t in _phase_pairs(schedule):
            assert (order[u], schedule.transfers[u].step) < (order[t], schedule.transfers[t].step)
        n = schedule.world_size

        def body(tr, order=order):
            ex = Executor(schedule, tr, timeout_s=20, order=order)
            xs = _inputs(tr.rank, [1257, 3], torch.float32)
            ex.run(xs)
            return xs

        exp = [sum(_inputs(r, [1257, 3], torch.float64)[i] for r in range(n)) for i in range(2)]
        for got in run_ranks(n, body):
            assert not isinstance(got, BaseException), got
            assert all(torch.equal(g.double(), e) for g, e in zip(got, exp)), alg
    with pytest.raises(GradsyncError, match="order has 3 entries"):
        Executor(schedule, LocalFabric(schedule.world_size).transport(0), order=[0.0, 1.0, 2.0])


def test_blocking_allreduce_runs_on_the_callers_thread_only_when_nothing_is_queued():
    """``Runtime.allreduce`` skips the communication thread when it is idle, but never overtakes queued work:
    a blocking call behind a queued one runs after it, on the communication thread, and every sum is exact."""
    import threading

    from gradsync.comm import Runtime

    def body(tr):
        rt = Runtime(tr, "switch:3", "ring", timeout_s=20)
        ex = rt.executor()
        ran: list[tuple[str, float]] = []
        real_run = ex.run

        def spy(tensors, op="sum"):
            ran.append((threading.current_thread().name, float(tensors.flatten()[0])))
            return real_run(tensors, op)

        ex.run = spy
        gate = threading.Event()
        xs = [torch.full((517,), float(10 ** i * (tr.rank + 1))) for i in range(3)]
        rt.submit(lambda: gate.wait(10))  # holds the queue until the timer fires
        first = rt.allreduce_async(xs[0])
        threading.Timer(0.2, gate.set).start()
        rt.allreduce(xs[1])  # queued work ahead: must wait its turn on the communication thread
        assert first.done()
        rt.allreduce(xs[2])  # idle: runs right here
        rt.shutdown()
        return ran, [float(x[0]) for x in xs], threading.current_thread().name

    for got in run_ranks(3, body):
        assert not isinstance(got, BaseException), got
        ran, sums, caller = got
        assert sums == [6.0, 60.0, 600.0]
        assert [who for who, _ in ran] == ["gradsync-comm", "gradsync-comm", caller]
        assert ran[0][1] < 10 <= ran[1][1]  # the queued one went first, before the blocking one



@pytest.mark.parametrize("progress", ["lanes", "ordered"])
def test_trace_records_every_message_once_in_time_order(progress):
    schedule = synthesize("tree", get_topology("racks:2,2,4"), PlanOptions(pipeline=2))

    def body(tr):
        ex = Executor(schedule, tr, timeout_s=20, progress=progress)
        ex.trace = []
        ex.run(_inputs(tr.rank, [301], torch.float32)[0])
        mine = {i for i, t in enumerate(schedule.transfers) if tr.rank in (t.src, t.dst)}
        return ex.trace, mine

    for got in run_ranks(schedule.world_size, body):
        assert not isinstance(got, BaseException), got
        trace, mine = got
        assert sorted(i for i, *_ in trace) == sorted(mine)
        times = [t for *_, t in trace]
        assert times == sorted(times) and times[0] >= 0


def test_auto_progress_waits_in_order_for_small_runs_and_uses_lanes_for_large():
    """``progress="auto"``: lane threads only for runs over SMALL_RUN_BYTES; exact either way."""
    from gradsync.comm.executor import SMALL_RUN_BYTES

    schedule = synthesize("ring", get_topology("switch:3"), PlanOptions())
    small = SMALL_RUN_BYTES // 4  # float32: exactly at the limit
    big = small + 1

    def body(tr):
        ex = Executor(schedule, tr, timeout_s=20)
        assert ex.progress == "auto"
        out = []
        for numel in (small, big):
            x = torch.full((numel,), float(tr.rank + 1))
            ex.run(x)
            out.append((bool(torch.all(x == 6.0)), len(ex._lanes)))
        ex.close()
        return out

    for got in run_ranks(schedule.world_size, body):
        assert not isinstance(got, BaseException), got
        (small_ok, small_lanes), (big_ok, big_lanes) = got
        assert small_ok and big_ok
        assert small_lanes == 0 and big_lanes > 0


def test_get_runtime_without_a_process_group_says_how_to_start():
    import torch.distributed as dist

    import gradsync

    if dist.is_initialized() or gradsync.is_initialized():
        pytest.skip("a process group or runtime exists in this test process")
    with pytest.raises(GradsyncError, match=r"call gradsync.init\(\), or torch.distributed.init_process_group\(\)"):
        gradsync.get_runtime()


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
    and only above the tuned classes: without one, ``auto`` runs the model's choice, nothing is recorded."""
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import TUNE_MAX_BYTES

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    rt.explore = True
    for nbytes in (1000, TUNE_MAX_BYTES, 4 << 20):
        ex = rt.executor("auto", nbytes)
        assert (ex.schedule.algorithm, ex.schedule is rt.executor("auto", nbytes).schedule) == (rt.choice(nbytes)[0], True)
    assert not rt.exploring() and rt.tuned == {}
    assert rt.tuning.explored() == {4 << 20: None}  # decided once: nothing to time


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
    import gradsync.comm.tuning as tuning
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import EXPLORE_REPS, EXPLORE_STEPS, Explorer

    assert EXPLORE_STEPS == 2  # the second case's three steps
    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)
    clock = [0.0]
    ran: list[int] = []

    class Fake:
        def __init__(self, depth: int) -> None:
            self.depth, self.schedule = depth, None

        def run(self, tensors, op="sum"):
            ran.append(self.depth)
            clock[0] += cost[self.depth]
            return tensors

    real = tuning.time  # only the tuning module's clock is faked: other threads keep the real one
    fake = {**{k: getattr(real, k) for k in dir(real) if not k.startswith("_")}, "perf_counter": lambda: clock[0]}
    monkeypatch.setattr(tuning, "time", SimpleNamespace(**fake))
    monkeypatch.setattr(tuning, "max_over_ranks", lambda group, values, device: list(values))
    monkeypatch.setattr(rt.plans, "executor", lambda name, depth, size, collective="allreduce": Fake(depth))
    first = [("ring", model)] + [("ring", q) for q in (2 * model, model // 2) if q >= 1]
    ex = Explorer(rt.tuning, object(), 4 << 20, first)
    calls = 0
    while ex.pick is None:
        ex.run(torch.zeros(1))
        calls += 1
        assert calls <= 40
    record = rt.tuned[4 << 20]
    assert [[c[1] for c in step["candidates"]] for step in record["steps"]] == steps
    assert ex.pick == ("ring", pick) and record["choice"] == ["ring", pick] and rt.choice(4 << 20) == ("ring", pick)
    assert calls == sum((1 + EXPLORE_REPS) * len(step) for step in steps)
    assert ran[-len(steps[-1]):] == steps[-1]  # the last round: the last step's candidates, in turn
    ex.run(torch.zeros(1))
    assert ran[-1] == pick and record["measured_s"]["ring/" + str(pick)] == cost[pick]


def test_an_explored_pick_joins_the_cache_and_the_next_job_runs_it_without_timing(tmp_path, monkeypatch):
    """A size class the first calls settled (``Explorer``) is written beside the tuned small classes (rank 0,
    the cache of ``init(calibrate=True)``); a runtime that reads that file back runs the pick from its first
    call and times nothing; under a new cost model the class is priced and explored afresh, and a pick made
    then is not written into the old model's file."""
    import gradsync.comm.tuning as tuning
    from gradsync.comm import Runtime
    from gradsync.comm.tuning import TUNED_TYPE, Explorer
    from gradsync.sim.cost import CostModel

    monkeypatch.setenv("GRADSYNC_CACHE", str(tmp_path))
    size = 4 << 20
    cost = {1: 10.0, 2: 8.0, 4: 6.0, 8: 5.9}  # the double wins twice, then the margin keeps 4
    clock = [0.0]

    class Fake:
        def __init__(self, depth: int) -> None:
            self.depth, self.schedule = depth, None

        def run(self, tensors, op="sum"):
            clock[0] += cost[self.depth]
            return tensors

    real = tuning.time
    fake = {**{k: getattr(real, k) for k in dir(real) if not k.startswith("_")}, "perf_counter": lambda: clock[0]}
    monkeypatch.setattr(tuning, "time", SimpleNamespace(**fake))
    monkeypatch.setattr(tuning, "max_over_ranks", lambda group, values, device: list(values))

    def explore(rt: Runtime) -> Explorer:
        monkeypatch.setattr(rt.plans, "executor", lambda name, depth, size, collective="allreduce": Fake(depth))
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


def test_the_runtime_reads_what_a_transport_can_do_from_its_capabilities():
    """A transport declares what it offers beyond isend/irecv in one record, read once: a point-to-point
    transport plans without the native collective and decides locally; one that declares ``decide`` has every
    plan decision go through it, keyed by the cost model's generation; nothing in comm probes a transport."""
    import re
    from pathlib import Path

    from gradsync.comm import Runtime
    from gradsync.comm.transport import Capabilities

    local = LocalFabric(2).transport(0)
    assert local.capabilities == Capabilities(failures=local.failures) and not local.capabilities.native
    assert local.capabilities.collective_device() == torch.device("cpu")
    rt = Runtime(local, "switch:2", "auto", timeout_s=5)
    assert "native" not in {c.algorithm for c in rt.chooser.choose(1 << 20).candidates}
    with pytest.raises(GradsyncError, match="calibration needs a torch.distributed transport"):
        rt.calibrate()

    asked: list[str] = []

    def decide(key, compute, timeout_s):
        asked.append(key)
        return compute()

    declared = LocalFabric(2).transport(0)
    declared.capabilities = replace(declared.capabilities, decide=decide)
    rt = Runtime(declared, "switch:2", "auto", timeout_s=5)
    rt.executor("auto", 1 << 20)
    assert "g0/choice/1048576" in asked and any(k.startswith("g0/order/allreduce/") for k in asked)
    rt.set_cost_model(rt.cost_model)
    rt.executor("auto", 1 << 20)
    assert "g1/choice/1048576" in asked  # a new model decides afresh, under its own keys
    comm = Path(__file__).resolve().parents[1] / "gradsync" / "comm"
    probes = [f"{p.name}: {m}" for p in comm.glob("*.py")
              for m in re.findall(r"getattr\((?:self\.)?transport\b[^)]*\)", p.read_text())]
    assert probes == []
