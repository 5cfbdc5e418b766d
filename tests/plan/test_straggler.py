"""The straggler-tolerant allreduce (StragglAR): exact for every world size and late rank, the late rank idle
until it joins, and faster than ring in the simulator by the closed forms derived below."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm import Executor, run_ranks
from gradsync.errors import PlanError
from gradsync.plan import PlanOptions, straggler, synthesize
from gradsync.plan.straggler import late_rank
from gradsync.sim import simulate
from gradsync.topology.io import get_topology

GB = 1e9
BETA = 1.25e9  # bytes/s of every switch:N link (10 Gbit/s Ethernet)


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Integer values, different on every rank: their sum is exact in every dtype tested."""
    return ((torch.arange(numel, dtype=torch.float64) % 89) * (rank + 2) - 40 * rank).to(dtype)


def _late_ranks(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


@pytest.mark.parametrize("n", range(2, 10))
def test_every_late_rank_passes_the_self_check_and_idles_until_it_joins(n):
    topo = get_topology(f"switch:{n}")
    m = n - 1
    for s in range(n):
        for pipeline in (1, 3):
            schedule = synthesize("straggler", topo, PlanOptions(straggler=s, pipeline=pipeline))
            schedule.check(topo)  # the replay, again, on the returned object
            assert schedule.meta["straggler"] == s
            sizes = [c.size for c in schedule.chunks]
            mine = [t for t in schedule.transfers if s in (t.src, t.dst)]
            # Nothing touches the late rank before the join step m - 1: the others' reduce-scatter needs no input from it.
            assert min(t.step for t in mine) == m - 1
            # It sends its whole contribution once (reduces) and receives the whole result once (copies).
            assert sum(sizes[t.chunk] for t in mine if t.src == s) == pytest.approx(1.0)
            assert all(t.reduce for t in mine if t.src == s) and not any(t.reduce for t in mine if t.dst == s)
            assert sum(sizes[t.chunk] for t in mine if t.dst == s) == pytest.approx(1.0)
            # Every chunk's reduction completes at an on-time rank, where the late rank's share is added last.
            assert all(c.root != s for c in schedule.chunks)


@pytest.mark.parametrize("n", range(2, 10))
def test_executor_sums_exactly_for_every_world_size(n):
    topo = get_topology(f"switch:{n}")
    for s in _late_ranks(n):
        for pipeline, dtype in ((1, torch.float32), (2, torch.float64), (3, torch.int64)):
            schedule = synthesize("straggler", topo, PlanOptions(straggler=s, pipeline=pipeline))
            for numel in (1, 13, 1009):

                def body(tr, schedule=schedule, numel=numel, dtype=dtype):
                    x = _inputs(tr.rank, numel, dtype)
                    Executor(schedule, tr, timeout_s=20).run(x)
                    return x

                expected = sum(_inputs(r, numel, torch.float64) for r in range(n))
                for rank, got in enumerate(run_ranks(n, body)):
                    assert not isinstance(got, BaseException), f"rank {rank}: {got!r}"
                    assert got.dtype == dtype
                    assert torch.equal(got.to(torch.float64), expected), (n, s, pipeline, numel, rank)


@pytest.mark.parametrize("spec", ["ring:4", "bcube:3,2", "fattree:4", "racks:2,3,4", "p3.8xlarge"])
def test_plans_on_fabrics_other_than_a_switch(spec):
    """Routes follow the topology's links (the self-check replays them) on rings, relays and two tiers."""
    topo = get_topology(spec)
    for s in _late_ranks(topo.world_size):
        schedule = synthesize("straggler", topo, PlanOptions(straggler=s, pipeline=2))
        schedule.check(topo)


@pytest.mark.parametrize("spec,results", [("switch:8", "fanout"), ("ring:6", "fanout"), ("bcube:3,2", "fanout"),
                                          ("racks:2,3,4", "ring"), ("racks:3,3,3", "ring")])
def test_results_go_out_the_way_that_loads_the_busiest_link_less(spec, results):
    """Fan-out (each owner copies its shard straight to every rank) unless the ring's allgather loads the busiest
    link direction less: on racks a shard crosses an uplink once per rank beyond it with fan-out. Brute force:
    both ways built and their fluid costs compared here, from the transfers."""
    topo = get_topology(spec)
    m = topo.world_size - 1
    for s in _late_ranks(topo.world_size):
        schedule = synthesize("straggler", topo, PlanOptions(straggler=s, pipeline=2))
        assert schedule.meta["results"] == results
        sizes = [c.size for c in schedule.chunks]
        copies = [t for t in schedule.transfers if not t.reduce and t.dst != s]
        if results == "fanout":  # one step after the join, from the owner, to each of the m - 1 others
            assert {t.step for t in copies} == {m} and all(t.src == schedule.chunks[t.chunk].root for t in copies)
            assert sum(sizes[t.chunk] for t in copies) == pytest.approx(m - 1)
        else:  # around the ring: m - 2 more hops after the first
            assert {t.step for t in copies} == set(range(m, 2 * m - 1))
        costs = {}
        for way in ("fanout", "ring"):
            other = schedule if way == results else None
            if other is None:  # the way not taken: same phases, results out the other way
                other = straggler._results_out(topo, PlanOptions(straggler=s, pipeline=2), s, fanout=way == "fanout")
            other.check(topo)
            costs[way] = other.link_loads(topo).cost(topo.directed_costs)
        assert costs[results] <= min(costs.values()) * (1 + 1e-9), costs


def test_default_late_rank_is_the_last_and_a_bad_one_is_refused():
    topo = get_topology("switch:5")
    assert late_rank(topo, PlanOptions()) == 4
    assert synthesize("straggler", topo).meta["straggler"] == 4
    with pytest.raises(PlanError, match=r"straggler=5 is not a rank of 'switch:5' \(ranks 0\.\.4\)"):
        synthesize("straggler", topo, PlanOptions(straggler=5))
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(PlanError, match="must be a rank"):
            PlanOptions(straggler=bad)


def test_one_rank_is_trivially_exact():
    topo = get_topology("switch:1")
    schedule = synthesize("straggler", topo)
    assert schedule.transfers == ()
    schedule.check(topo)


# ---- the simulator: one rank late by Δ ---------------------------------------------------------------------
# Every switch:N link moves β bytes/s each way; M bytes; no latency. Let s be late by Δ (it sends nothing before
# Δ; the simulator's start_delay_s) and T_RS = (N-2)/(N-1) · M/β the on-time ranks' reduce-scatter among N - 1.
#
# Ring: every chunk passes through s, so s's link carries 2(N-1)/N · M after Δ: time >= Δ + 2(N-1)/N · M/β. When a
#   connection carries one message at a time (fifo, the runtime's model) or flows stream, s's sends go out
#   back to back from Δ and everything downstream is shifted by exactly Δ, so the bound is met with equality.
# Straggler, Δ >= T_RS (the reduce-scatter is over when s arrives): s sends its M to the N - 1 shard owners
#   (M/β), and the owners copy the finished shards back (M/β into s), while the on-time ranks' allgather moves
#   (N-2)/(N-1) · M over links that have M/β of time left beside the copy to s.
#   * Streaming: a copy back streams behind the send it depends on, so s's two directions overlap: Δ + M/β.
#   * Store-and-forward in P sub-chunks per shard, fifo: the N - 1 connections out of s share its link, so
#     sub-chunk k of every shard has arrived at Δ + (k+1) M/(Pβ); its copy back takes M/(Pβ) on s's incoming
#     link, just as the next sub-chunk arrives: Δ + (P+1)/P · M/β.
def _ring_closed_form(n: int, delta: float) -> float:
    return delta + 2 * (n - 1) / n * GB / BETA


def _straggler_closed_form(delta: float, streaming: bool, pipeline: int) -> float:
    return delta + (1.0 if streaming else (pipeline + 1) / pipeline) * GB / BETA


@pytest.mark.parametrize("n", range(3, 10))
@pytest.mark.parametrize("streaming,pipeline", [(True, 1), (True, 4), (False, 1), (False, 2), (False, 4)])
def test_simulated_time_with_a_late_rank_matches_the_closed_forms(n, streaming, pipeline):
    topo = get_topology(f"switch:{n}")
    s = n // 2
    delta = 2 * (n - 1) / n * GB / BETA  # one undisturbed ring allreduce (issue 39's scenario (b))
    assert delta >= (n - 2) / (n - 1) * GB / BETA  # >= T_RS: the closed form's condition
    opts = PlanOptions(straggler=s, pipeline=pipeline)
    mode = {"streaming": streaming, "fifo": not streaming, "latency": False, "progress": False, "start_delay_s": {s: delta}}
    ring = simulate(synthesize("ring", topo, PlanOptions(pipeline=pipeline)), topo, GB, **mode).time_s
    late = simulate(synthesize("straggler", topo, opts), topo, GB, **mode).time_s
    assert ring == pytest.approx(_ring_closed_form(n, delta), rel=1e-6)
    assert late == pytest.approx(_straggler_closed_form(delta, streaming, pipeline), rel=1e-6)
    # Who wins is what the closed forms say: always when streaming (1 < 2(N-1)/N for N >= 3); store-and-forward
    # once the sub-chunks overlap s's two directions enough, (P+1)/P < 2(N-1)/N (a tie at N = 4, P = 2).
    after_late, after_ring = (1.0 if streaming else (pipeline + 1) / pipeline), 2 * (n - 1) / n
    if after_late == pytest.approx(after_ring):
        assert late == pytest.approx(ring, rel=1e-6)
    else:
        assert (late < ring) == (after_late < after_ring)
    if streaming or pipeline == 4:
        assert late < ring


def test_nobody_late_it_is_exact_but_no_faster_than_ring():
    """Without a straggler the schedule costs more than a ring (an on-time link carries (2m-1)/m > 2(N-1)/N):
    the gain comes from the delay, not from a better allreduce."""
    topo = get_topology("switch:8")
    ring = simulate(synthesize("ring", topo), topo, GB, progress=False).time_s
    late = simulate(synthesize("straggler", topo), topo, GB, progress=False).time_s
    assert ring == pytest.approx(7 / 4 * GB / BETA, rel=1e-6)
    assert late > ring
