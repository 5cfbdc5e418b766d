"""The runtime on real processes over gloo (loopback): sums, DDP hook, DistributedOptimizer, dead peers."""

from __future__ import annotations

import sys

import pytest

from gradsync.sim.choose import algorithms_for
from gradsync.sim.cost import CostModel
from gradsync.topology.io import get_topology
from tests.dist_launch import launch

WORKER = "tests/workers/comm_worker.py"
#: allreduces the kernel-counter test watches
TCP_RATE_CALLS = 8


def _applicable(topology: str) -> list[str]:
    topo = get_topology(topology)
    return [*algorithms_for(topo), "native"]


@pytest.mark.parametrize("world,topology", [(2, "switch:2"), (3, "switch:3"), (4, "bcube:2,2")])
def test_every_synthesizer_sums_on_processes(tmp_path, world, topology):
    reports = launch(WORKER, ["sums", str(tmp_path), topology], world, tmp_path)
    expected = _applicable(topology)
    if world == 4:
        assert {"bml", "hierarchical", "multiring", "lp"} <= set(expected)
    for rank, rep in enumerate(reports):
        assert rep is not None, f"rank {rank} wrote no report"
        assert rep["checked"] == expected
        assert rep["failures"] == [], f"rank {rank}: {rep['failures']}"
        assert rep["auto"] == reports[0]["auto"]  # every rank makes the same choice per size class
    if topology == "switch:2":  # one link each way: nothing beats the backend's own ring, auto keeps it
        assert {a for a, _ in reports[0]["auto"].values()} == {"native"}
    if topology == "bcube:2,2":  # two switch levels: a planned schedule wins at some size
        assert {a for a, _ in reports[0]["auto"].values()} - {"native"}


@pytest.mark.parametrize("world,topology", [(2, "switch:2"), (3, "p3.8xlarge[0,1,2]"), (4, "bcube:2,2")])
def test_reduce_scatter_and_allgather_on_processes(tmp_path, world, topology):
    """Issue 14 part 3: every synthesizer that plans them gives torch's exact results over gloo."""
    reports = launch(WORKER, ["sharded", str(tmp_path), topology], world, tmp_path)
    topo = get_topology(topology)
    expected = algorithms_for(topo, "allgather")
    assert {"ring", "ps", "tree", "lp", "auto"} <= set(expected)
    for rank, rep in enumerate(reports):
        assert rep is not None and rep["checked"] == expected and rep["failures"] == [], (rank, rep)


def test_bml_on_bcube_3_2_with_nine_processes(tmp_path):
    reports = launch(WORKER, ["sums", str(tmp_path), "bcube:3,2", "bml"], 9, tmp_path, timeout_s=280)
    for rank, rep in enumerate(reports):
        assert rep is not None and rep["checked"] == ["bml"] and rep["failures"] == [], (rank, rep)


def test_the_watch_reads_each_pairs_rate_from_the_kernels_counters_of_its_gloo_connection(tmp_path):
    """Issue 39: on gloo, each rank maps its TCP connections to the other ranks (every other rank found: its
    gloo connection), and a watched planned allreduce takes its pairs' rates from those connections' counters (the
    planned ring sends to both neighbours: two pairs per rank; a connection whose busy time was all the receiver's
    stalls, 3 processes sharing 2 cores, gives no rate that time); the sums stay exact. Nothing measured the model
    (``ring`` is not ``auto``: ``init`` calibrates nothing), so at the warm-up's end every rank measures the
    executor's α together and prices with it from then on, the same on every rank."""
    if not sys.platform.startswith("linux"):
        pytest.skip("TCP_INFO's counters are Linux's")
    # a pair gives no kernel rate on a call whose connection was busy only while the receiver stalled it (3
    # processes sharing 2 cores): several calls past the warm-up, so that some pairs read one
    reports = launch(WORKER, ["tcp_rates", str(tmp_path), "switch:3", str(TCP_RATE_CALLS)], 3, tmp_path, timeout_s=120)
    for rank, rep in enumerate(reports):
        assert rep["exact"] and rep["watched"] == TCP_RATE_CALLS, (rank, rep)
        assert rep["peers"] == [r for r in range(3) if r != rank], (rank, rep)
        assert all(0 <= n <= 2 for n in rep["tcp_pairs"]) and sum(rep["tcp_pairs"]) >= 2, (rank, rep)
        assert rep["source"] == reports[0]["source"] and rep["message_s"] == reports[0]["message_s"], (rank, rep)
    assert "executor α measured by the watch" in reports[0]["source"], reports[0]
    # the agreement rounds ran on a tree (two latency steps a level), not on gloo's ring or the job's planned ring
    assert all("tree" in rep["built"] for rep in reports), reports[0]
    assert 1e-6 <= reports[0]["message_s"] < 0.5 and reports[0]["message_s"] != CostModel().message_s, reports[0]


# rank 3 is on time from allreduce 10; a loaded host's scheduling can hold the switch back by several collectives
LATE_CALLS = 24


def test_a_late_rank_on_the_backends_own_ring_moves_every_rank_to_the_straggler_plan_and_back(tmp_path):
    """Issue 39 (b) where ``auto`` runs the backend's ring (a flat switch): those allreduces are watched too (each
    rank's time in the collective shows the late one; the ring has no pair rates to give), every rank switches at
    the same collective to the plan the simulator prices fastest for the late arrival, and back when it is on
    time; every sum exact. All are watched: the native fast path would have hidden them."""
    from dataclasses import replace

    from gradsync.plan import PlanOptions, synthesize
    from gradsync.sim import simulate
    from gradsync.sim.cost import native_schedule

    reports = launch(WORKER, ["late_native", str(tmp_path), "switch:4", str(LATE_CALLS)], 4, tmp_path, timeout_s=180)
    first = reports[0]
    new = first["switches"][0]["new"]
    # On trial for k = 3 collectives (6-8): kept if its median is no slower than the ring's before the switch,
    # else every rank goes back to the ring at collective 8 (loopback's per-message cost is not in α = 1 µs).
    back = len(first["switches"]) == 3
    for rank, rep in enumerate(reports):
        assert rep is not None and rep["exact"] and rep["watched"] == LATE_CALLS, (rank, rep)
        got = [(s["generation"], s["collective"], s["straggler"], s["old"], s["new"]) for s in rep["switches"]]
        assert got[0] == (1, 5, 3, "native/1", new), (rank, rep)
        if back:
            assert got[1] == (1, 8, 3, new, "native/1") and "back to native/1" in rep["switches"][1]["message"]
        # on time from allreduce 10: k = 3 collectives below half of one (11 without jitter; a loaded host's
        # scheduling can push a few-ms collective over that for several rounds: one CI run's came after 15)
        assert len(got) == 2 + back and got[-1][0] == 2 and got[-1][2] is None and 11 <= got[-1][1] < LATE_CALLS, got
        assert got[-1][3:] == ("native/1" if back else new, "native/1"), got
        assert rep["switches"][0]["delay_s"] == pytest.approx(rep["late_s"], rel=0.2)
        assert rep["plans"] == first["plans"], (rank, rep)
    on_time = first["switches"][-1]["collective"]  # collective c's switch shows from allreduce c + 1 on
    trial = [new] * (3 if back else on_time - 5)  # allreduces 6-8 on trial, or until rank 3 is on time again
    assert first["plans"] == ["native/1"] * 6 + trial + ["native/1"] * (LATE_CALLS - 6 - len(trial)), first["plans"]
    # the pick is the simulator's fastest for rank 3 late by the measured delay (the worker's α = 1 µs), on the
    # model's rates divided by the warm-up's fitted slowdown (loopback is not the model's switch)
    topo, model = get_topology("switch:4"), replace(CostModel(), message_s=1e-6, native_message_s=1e-6)
    slowdown = first["slowdown"]
    assert slowdown > 1 and all(rep["slowdown"] == slowdown for rep in reports)  # one fit, agreed by every rank
    wire = replace(topo, links=tuple(lk.scaled(1 / slowdown) for lk in topo.links))
    late = {3: first["switches"][0]["delay_s"]}

    def seconds(schedule) -> float:
        return simulate(schedule, wire, 1 << 20, streaming=False, fifo=True, message_s=1e-6,
                        reverse_share=model.reverse_share, progress=False, start_delay_s=late).time_s

    priced = {"native/1": seconds(native_schedule(topo))}
    priced.update({f"straggler/{d}": seconds(synthesize("straggler", topo, PlanOptions(pipeline=d, straggler=3)))
                   for d in model.pipelines})
    assert new == min(priced, key=lambda k: (priced[k], k != "native/1")) and new.startswith("straggler/"), priced
    assert all(rep["message_s"] == 1e-6 for rep in reports)  # an α the user wrote is never measured over


def test_calibration_measures_message_costs_once_and_caches_them(tmp_path):
    """The measured α is the same on every rank, positive and bounded, marked in the model's source, written
    once to the cache, and a second init reads it back unchanged (no second measurement)."""
    cache = tmp_path / "cache"
    reports = launch(WORKER, ["calibrate", str(tmp_path), "switch:3", str(cache)], 3, tmp_path)
    first = reports[0]["first"]
    for rank, rep in enumerate(reports):
        assert rep["exact"], (rank, rep)
        assert rep["first"] == first and rep["second"] == first, (rank, rep)
    assert "calibrated on 3 ranks" in first["source"]
    assert 1e-6 <= first["message_s"] < 0.5 and 1e-6 <= first["native_message_s"] < 0.5, first
    assert 0.0 <= first["reverse_share"] <= 0.5 and "both ways" in first["source"], first
    assert 0.0 <= first["burst_s"] < 0.1 and "burst" in first["source"], first
    files = reports[0]["files"]
    assert len(files) == 2 and files[0].startswith("cost_model-") and files[1].startswith("tuned-"), files
    # auto's small classes were timed: 4 KB .. 256 KB, the same choices on every rank, each one of the measured
    # candidates (the native collective always among them), and what auto runs afterwards
    tuned = reports[0]["tuned"]
    assert sorted(int(k) for k in tuned) == [4096 << i for i in range(7)], tuned
    for rank, rep in enumerate(reports):
        assert rep["tuned"] == tuned and rep["used"] == tuned, (rank, rep["tuned"], rep["used"])
        assert rep["tuned_again"] == tuned, (rank, rep["tuned_again"])  # the second init read them back
        # only the picked plans stay cached: a candidate measured but not picked prices its wait order anew
        assert set(rep["kept"]) <= {f"{a}/{p}" for a, p in tuned.values()}, (rank, rep["kept"], tuned)
    for size, (algorithm, pipeline) in tuned.items():
        assert f"{algorithm}/{pipeline}" in reports[0]["measured"][size] and "native/1" in reports[0]["measured"][size]


def test_the_default_init_calibrates_quickly_where_it_matters_and_caches_it(tmp_path):
    """init(topology) alone on racks (a plan beats the rank-order ring over the uplinks): message costs, the
    two-way loss, the burst and the slowest path's rate measured once (no small-class timing), the same on every rank, cached
    in a file of its own and read back by the next init; auto then explores. On a flat switch: the defaults,
    nothing measured or written."""
    cache = tmp_path / "cache"
    reports = launch(WORKER, ["default_init", str(tmp_path), "racks:2,2,4", str(cache)], 4, tmp_path)
    first = reports[0]["first"]
    for rank, rep in enumerate(reports):
        assert rep["exact"] and rep["explore"] and not rep["flat_explore"], (rank, rep)
        assert rep["first"] == first and rep["second"] == first, (rank, rep)
        assert rep["flat"]["source"] == "defaults", (rank, rep["flat"])
    assert "calibrated on 4 ranks" in first["source"] and "of one way" in first["source"], first
    assert 0.0 <= first["reverse_share"] <= 0.5 and 1e-6 <= first["message_s"] < 0.5, first
    assert 0.0 <= first["burst_s"] < 0.1 and "burst" in first["source"], first
    files = reports[0]["files"]
    assert len(files) == 1 and files[0].startswith("quick_cost_model-"), files
    assert reports[0]["files_after"] == files  # the flat switch wrote nothing


def test_auto_times_the_depths_beside_the_models_on_a_large_class_and_keeps_one(tmp_path):
    """With ``explore``, a class above 256 KB runs the model's depth, its double and its half in turn (one
    warm-up round, then ``EXPLORE_REPS`` timed rounds), every result exact; a step picks by the margin rule
    on the slowest rank's medians against its first candidate, and a pick at the edge (the double, the half)
    is timed against the next depth that way, at most ``EXPLORE_STEPS`` more times; a pick timed again must still
    beat the model's depth by the margin. Then all ranks keep the same pick and run it; the candidates not picked
    are dropped."""
    from gradsync.comm.tuning import EXPLORE_MARGIN, EXPLORE_STEPS

    reports = launch(WORKER, ["explore", str(tmp_path), "switch:3"], 3, tmp_path)
    first = reports[0]
    name, p = first["model"]
    record = first["record"]
    assert record["online"] is True and record["model"] == [name, p], record
    steps = record["steps"]
    want = [[name, q] for q in (p, 2 * p, p // 2) if q in first["pipelines"]]
    assert len(want) >= 2 and steps[0]["candidates"] == want, (want, steps)
    assert 1 <= len(steps) <= 1 + EXPLORE_STEPS, steps
    for i, step in enumerate(steps):  # each pick by the margin rule; each next step from the last one's pick
        measured, incumbent = step["measured_s"], "/".join(map(str, step["candidates"][0]))
        assert set(measured) == {"/".join(map(str, c)) for c in step["candidates"]}, step
        # a candidate that left the step after a timed round (EXPLORE_DROP) is no pick, unless it is the incumbent
        stayed = {k: t for k, t in measured.items() if k not in step["pruned"] or k == incumbent}
        fastest = min(stayed, key=stayed.get)
        expect = fastest if measured[fastest] < (1 - EXPLORE_MARGIN) * measured[incumbent] else incumbent
        assert "/".join(map(str, step["pick"])) == expect, step
        depths = [c[1] for c in step["candidates"]]
        moved, q = step["pick"] != step["candidates"][0], step["pick"][1]
        edge = 2 * q if moved and q == max(depths) else q // 2 if moved and q == min(depths) else None
        if i + 1 < len(steps):
            assert steps[i + 1]["candidates"] == [step["pick"], [name, edge]], steps
        else:  # the last step: nothing further that way, or no steps left
            assert (edge is None or edge < 1 or edge not in first["pipelines"] or i == EXPLORE_STEPS), steps
    rounds = sum(step["calls"] for step in steps)  # the full rounds, less the calls of candidates that left
    assert all(step["calls"] == (1 + first["reps"]) * len(step["candidates"]) for step in steps if not step["pruned"])
    # the last step's pick runs, unless it is not the model's and its latest time no longer beats the model's by
    # the margin: then the model's choice does
    latest = {k: t for step in steps for k, t in step["measured_s"].items()}
    final, model = steps[-1]["pick"], "/".join(map(str, (name, p)))
    if final != [name, p] and not latest["/".join(map(str, final))] < (1 - EXPLORE_MARGIN) * latest[model]:
        final = [name, p]
    for rank, rep in enumerate(reports):
        assert rep["exact"], (rank, rep)
        assert rep["record"] == record and rep["pick"] == final == record["choice"], (rank, rep)
        # it explored for exactly its rounds (calls come in pairs), then settled
        assert rep["calls"] == rounds + rounds % 2 and rep["exploring"][-1] is False, (rank, rep)
        assert all(rep["exploring"][:-1]), (rank, rep)
        assert rep["runs_pick"] and rep["planned_only"] is False, (rank, rep)
        picked = "/".join(map(str, rep["pick"]))
        tried = {"/".join(map(str, c)) for step in steps for c in step["candidates"]}
        assert picked in rep["kept"] and (set(rep["kept"]) & tried) - set(rep["before"]) <= {picked}, (rank, rep)


def test_ddp_hook_matches_ddp_without_hook(tmp_path):
    reports = launch(WORKER, ["ddp", str(tmp_path), "p3.8xlarge[0,1,2]"], 3, tmp_path)
    for rank, rep in enumerate(reports):
        assert rep["torch.float32_ok"] and rep["torch.float64_ok"], (rank, rep)


def test_ddp_hook_issues_a_native_size_itself_with_the_queued_paths_bits(tmp_path):
    reports = launch(WORKER, ["ddp_native", str(tmp_path), "switch:3"], 3, tmp_path)
    for rank, rep in enumerate(reports):
        # every bucket of both iterations (DDP's first runs as one bucket, then rebuilt: 1 + 2) took the native path
        assert rep["native_calls"] == rep["buckets"] >= 3 and rep["all_native"], (rank, rep)
        assert rep["same_as_queued"] and rep["vs_ddp"] <= 1e-12, (rank, rep)
        # gradsync.allreduce of one tensor: the user's group, whatever the queue holds; a list: gradsync's own
        assert rep["sync_exact"] and rep["sync_groups"] == ["user", "user", "user", "own"], (rank, rep)
        assert "floating-point" in rep["int_avg"], (rank, rep)


def test_distributed_optimizer_equals_union_batch_training(tmp_path):
    reports = launch(WORKER, ["optimizer", str(tmp_path), "switch:3"], 3, tmp_path)
    for rank, rep in enumerate(reports):
        for bucket, r in rep.items():
            assert r["across_ranks"] == 0.0, (rank, bucket, r)  # every rank holds the same bits
            assert r["vs_reference"] < 1e-12, (rank, bucket, r)


def test_killed_rank_is_named_by_survivors_within_timeout(tmp_path):
    reports = launch(WORKER, ["kill", str(tmp_path), "switch:3"], 3, tmp_path, allow_exit={2: 17})
    assert reports[2] is None
    for rank in (0, 1):
        rep = reports[rank]
        assert rep["error"] is not None, f"rank {rank} finished without noticing rank 2 died"
        assert rep["peer"] == 2 and "rank 2" in rep["error"], rep
        assert rep["seconds"] <= rep["timeout_s"] + 2.0, rep


@pytest.mark.parametrize("what, named, aborts", [
    ("size", "allreduce #5 differs between ranks: rank 0 sent 1000 float32, rank 1 500 (seen by rank 0)", True),
    ("dtype", "allreduce #5 differs between ranks: rank 0 sent 1000 float32, rank 1 1000 float16", True),
    ("count", "ranks made different collective calls: rank 1 called allreduce 4 times, rank 0 5 times", False),
])
def test_mismatched_collectives_name_the_rank_and_the_difference(tmp_path, what, named, aborts):
    """Issue 42: not "a peer left or timed out?" but what differs and on which rank, within the timeout (plus the
    few seconds a failed rank waits for its peers' ledgers). gloo itself aborts the rank that receives more bytes
    than it expects (rank 1 here): rank 0 names it from the signature rank 1 posted when it first used it."""
    reports = launch(WORKER, ["mismatch", str(tmp_path), "switch:2", what, "native"], 2, tmp_path, timeout_s=60,
                     allow_exit={1: -6} if aborts else None)
    rep = reports[0]
    assert rep is not None and rep["error"], reports
    assert named in rep["error"], rep
    assert rep["seconds"] <= rep["timeout_s"] + 6.0, rep
