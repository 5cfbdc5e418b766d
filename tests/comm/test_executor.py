"""The executor on the in-process fabric: every synthesizer, many shapes, against exact sums.

The real-process tests (gloo) are in tests/comm/test_dist.py; these cover the combinatorics cheaply.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gradsync.comm import Executor, compile_program, process_mapping, run_ranks
from gradsync.comm.local import LocalFabric
from gradsync.errors import GradsyncError, PeerError, PlanError
from gradsync.plan import SYNTHESIZERS, PlanOptions, synthesize
from gradsync.topology.io import get_topology
from tests.conftest import random_topology
from tests.topology.test_hierarchy import stripped

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
        for alg in ("lp", "forest", "tree", "ring", "multiring"):
            schedule = synthesize(alg, topo, PlanOptions(pipeline=2))
            res = _allreduce_everywhere(schedule, [101], torch.float64)
            exp = sum(_inputs(r, [101], torch.float64)[0] for r in range(5))
            assert all(torch.equal(x[0], exp) for x in res), (seed, alg)


@pytest.mark.parametrize("spec,algorithm", [("bcube:2,2", "bml"), ("bcube:3,2", "hierarchical"), ("racks:3,2,4", "hierarchical")])
def test_hierarchy_from_a_shuffled_file_sums_exactly(spec, algorithm, tmp_path):
    """The hierarchy inferred from a topology file in a shuffled rank order: pieces root at permuted ranks."""
    built = get_topology(spec)
    ranks = list(built.ranks)
    random.Random(5).shuffle(ranks)
    topo = stripped(built, tmp_path, ranks)
    schedule = synthesize(algorithm, topo, PlanOptions(pipeline=2))
    res = _allreduce_everywhere(schedule, [7, 1009], torch.float64)
    exp = [sum(_inputs(r, [7, 1009], torch.float64)[i] for r in range(topo.world_size)) for i in range(2)]
    assert all(torch.equal(x[i], exp[i]) for x in res for i in range(2)), (spec, algorithm)

def test_avg_divides_and_rejects_integers():
    schedule = synthesize("ring", get_topology("switch:4"))
    res = _allreduce_everywhere(schedule, [10], torch.float64, op="avg")
    exp = sum(_inputs(r, [10], torch.float64)[0] for r in range(4)) / 4
    assert all(torch.allclose(x[0], exp) for x in res)
    res = _allreduce_everywhere(schedule, [10], torch.int64, op="avg")
    assert all(isinstance(x, TypeError) and "floating-point" in str(x) for x in res)


def test_results_bitwise_identical_across_ranks_with_random_floats():
    """Each chunk is reduced at one place and copied out, so every rank holds the same bits."""
    for alg in ("ring", "ps", "lp", "forest", "multiring"):
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


def test_a_local_fabric_shares_rank_0s_decisions_only_when_asked_and_names_a_dead_rank_0():
    """``LocalFabric(decide=True)``: every rank gets rank 0's bytes (the others never compute); a rank waiting for a
    decision of a rank 0 that died raises PeerError naming rank 0, not a hang. Without it, no shared decisions."""
    import threading

    assert LocalFabric(2).transport(1).capabilities.decide is None
    fabric = LocalFabric(3, decide=True)
    out: dict[int, bytes] = {}

    def rank(r: int) -> None:
        out[r] = fabric.transport(r).capabilities.decide("k", lambda: f"rank{r}".encode(), 5.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]  # rank 0 last: the others wait for it
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {0: b"rank0", 1: b"rank0", 2: b"rank0"}
    fabric.fail(0)
    with pytest.raises(PeerError, match="rank 0 failed") as info:
        fabric.transport(1).capabilities.decide("other", lambda: b"x", 5.0)
    assert info.value.peer == 0
    with pytest.raises(PeerError, match="within 0.05 s"):
        LocalFabric(2, decide=True).transport(1).capabilities.decide("k", lambda: b"x", 0.05)


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


def test_two_racks_linked_straight_sum_exactly():
    """hierarchical on two rack switches linked to each other (no spine), every dtype, odd sizes."""
    from tests.plan.test_hierarchical import _two_racks_linked_straight

    topo = _two_racks_linked_straight()
    schedule = synthesize("hierarchical", topo, PlanOptions(pipeline=2))
    for dtype in (torch.float32, torch.float64, torch.int64):
        res = _allreduce_everywhere(schedule, [7, 1009], dtype)
        exp = [sum(_inputs(r, [7, 1009], torch.float64)[i] for r in range(topo.world_size)) for i in range(2)]
        assert all(torch.equal(x[i].to(torch.float64), exp[i]) for x in res for i in range(2)), dtype


@pytest.mark.parametrize("progress", ["lanes", "ordered"])
def test_a_peer_found_gone_as_a_message_is_posted_is_named_as_a_failed_wait_is(progress):
    """gloo raises at the send or receive itself, not at its wait, where the peer's connection closed before the call
    (the transport names the peer: TorchTransport._start). The executor gives it the same context as a failed wait:
    this rank, the transfer, the peer, and the failure board's post."""
    schedule = synthesize("ring", get_topology("switch:2"))
    fabric = LocalFabric(2)
    tr = fabric.transport(0)

    def gone(*_args):  # type: ignore[no-untyped-def]
        raise PeerError("rank 1 closed its connection (the process exited or crashed): Connection closed by peer", 1)

    tr.isend = gone  # type: ignore[method-assign]
    tr.irecv = gone  # type: ignore[method-assign]
    with pytest.raises(PeerError, match=r"rank 0 \(.*\), ring allreduce: (sending|receiving) chunk \d+ .* rank 1 .* "
                                        r"failed: rank 1 closed its connection") as info:
        Executor(schedule, tr, timeout_s=2, progress=progress).run(torch.ones(64))
    assert info.value.peer == 1 and 0 in tr.capabilities.failures.read()
