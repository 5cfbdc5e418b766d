"""The plan cache (gradsync.comm.plans) and the transports' Capabilities: plan decisions go through a transport's decide."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from gradsync.comm.local import LocalFabric
from gradsync.errors import GradsyncError


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
    comm = Path(__file__).resolve().parents[2] / "gradsync" / "comm"
    probes = [f"{p.name}: {m}" for p in comm.glob("*.py")
              for m in re.findall(r"getattr\((?:self\.)?transport\b[^)]*\)", p.read_text())]
    assert probes == []


def test_an_executor_waits_in_the_order_of_the_simulation_that_priced_its_plan(monkeypatch):
    """The chooser simulated the chosen plan to price it; building its executor orders the waits by that same
    simulation's finish times (the same order a fresh simulation gives) instead of running it again: on rank 0,
    where every size class's first call waits for it (issue 40's choosing cost)."""
    import numpy as np

    import gradsync.sim.cost as cost
    from gradsync.comm import Runtime
    from gradsync.sim.cost import size_class

    rt = Runtime(LocalFabric(4).transport(0), "racks:2,2,4", "auto", timeout_s=5)
    try:
        size = size_class(1 << 20)
        name, depth = rt.plans.choice(size)
        assert name != "native"  # a planned schedule: its executor has a wait order
        runs: list[str] = []
        real = cost.simulate
        monkeypatch.setattr(cost, "simulate", lambda s, *a, **k: runs.append(s.algorithm) or real(s, *a, **k))
        ex = rt.plans.executor(name, depth, size)
        assert runs == []  # no second simulation of the plan
        model, topo = rt.cost_model, rt.plans.topology
        known = rt.plans.chooser().finish_times(ex.schedule, size)
        assert known is not None and len(known) == len(ex.schedule.transfers)
        assert np.array_equal(model.wait_order(ex.schedule, topo, size, known), model.wait_order(ex.schedule, topo, size))
        assert runs == [name]  # the fresh order above simulated once
        # the other candidates' finish times are not kept (one array per transfer each, every size class)
        chooser = rt.plans.chooser()
        others = [c for c in chooser.choose(size).candidates if c.algorithm != "native"
                  and chooser.schedule(c.algorithm, c.pipeline).digest != ex.schedule.digest]
        assert others and all(chooser.finish_times(chooser.schedule(c.algorithm, c.pipeline), size) is None
                              for c in others)
    finally:
        rt.shutdown()


@pytest.mark.parametrize("rank,threshold,said", [(0, 0.0, True), (0, 1e9, False), (1, 0.0, False)])
def test_a_long_pricing_is_said_once_on_rank_0(monkeypatch, capsys, rank, threshold, said):
    """A size class priced for longer than ANNOUNCE_PRICING_S gets one line on rank 0's stderr (every rank stalls
    for it in a job's first steps): the class, the time, the pick. A class already priced, a short pricing and
    another rank say nothing."""
    import gradsync.comm.plans as plans
    from gradsync.comm import Runtime

    monkeypatch.setattr(plans, "ANNOUNCE_PRICING_S", threshold)
    rt = Runtime(LocalFabric(2).transport(rank), "switch:2", "auto", timeout_s=5)
    try:
        pick = rt.plans.choice(1 << 20)
        assert rt.plans.choice(1 << 20) == pick  # priced once
    finally:
        rt.shutdown()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "priced allreduce plans" in line]
    if said:
        assert len(lines) == 1, err
        assert "1 MiB size class on 'switch:2'" in lines[0] and "every rank prices it" in lines[0]
        assert lines[0].endswith(f"{pick[0]} at depth {pick[1]}"), lines[0]
    else:
        assert not lines, err


def _declared(world: int, rank: int, topology: str, algorithm: str = "auto"):
    """A runtime on a local transport that shares decisions (rank 0 computes them), as torch.distributed's does."""
    from gradsync.comm import Runtime
    from gradsync.comm.transport import Capabilities

    transport = LocalFabric(world).transport(rank)
    transport.capabilities = replace(transport.capabilities, decide=lambda key, compute, timeout_s: compute())
    assert isinstance(transport.capabilities, Capabilities)
    return Runtime(transport, topology, algorithm, timeout_s=5)


def test_rank_0_prices_anticipated_sizes_in_a_child_and_the_first_call_adopts_them(monkeypatch):
    """On a rack fabric the first call of an anticipated size adopts the child's pricing (no simulation on the
    caller's thread), with the pick and wait order a chooser here makes; a replan's new cost model ends the child."""
    import time

    import gradsync.sim.cost as cost
    from gradsync.sim.choose import Chooser

    rt = _declared(6, 0, "racks:2,3,4")
    try:
        size = 4 << 20
        rt.anticipate([size])
        pricer = rt.plans.pricer
        assert pricer is not None and rt.plans.ahead_refused is None
        deadline = time.monotonic() + 120
        while size not in pricer.finished and pricer.failed is None and time.monotonic() < deadline:
            pricer.poll()
            time.sleep(0.02)
        assert size in pricer.finished, pricer.failed

        def no_simulation(*a, **kw):
            raise AssertionError("an anticipated size is not simulated on the caller's thread")

        monkeypatch.setattr(cost.CostModel, "run", no_simulation)
        pick = rt.choice(size)
        monkeypatch.undo()
        assert pricer.adopted == [4 << 20]
        fresh = Chooser(rt.topology, rt.cost_model, native=rt.plans.chooser().native,
                        keep_within=rt.plans.chooser().keep_within).choose(size)
        assert pick == (fresh.algorithm, fresh.pipeline) and rt.chooser.chosen(size) == fresh
        rt.set_cost_model(rt.cost_model)  # a new generation: the child priced for the old one
        assert rt.plans.pricer is None and pricer._proc.poll() is not None
    finally:
        rt.shutdown()


def test_the_child_starts_before_any_size_is_asked_and_the_first_asks_reach_it():
    """``start_pricing`` (what ``init`` calls once the runtime is set up) starts rank 0's child before any size is
    anticipated: its interpreter's start is then not on the clock of the first class asked. The sizes asked later go
    to that child (one child a generation), and it ends with the runtime."""
    from gradsync.comm.tuning import EXPLORE_MIN_BYTES
    from gradsync.sim.cost import size_class

    rt = _declared(6, 0, "racks:2,3,4")
    try:
        rt.explore = True
        assert rt.start_pricing()
        pricer = rt.plans.pricer
        assert pricer is not None and pricer.alive and not pricer._asked and rt.plans.ahead_refused is None
        assert pricer.orders_from == EXPLORE_MIN_BYTES  # an exploring runtime's child orders the neighbours too
        assert rt.start_pricing() and rt.plans.pricer is pricer
        rt.anticipate([3 << 20])
        assert rt.plans.pricer is pricer and pricer._asked == {size_class(3 << 20)}
    finally:
        rt.shutdown()
    assert pricer._proc.poll() is not None


def test_a_stopped_child_ends_and_no_ask_starts_another_until_a_new_generation():
    """``stop_ahead`` (the sweep's init runtime, whose methods price on runtimes of their own) ends the child and says
    why; a later ask is priced at its first call as without a child; a replan's new generation may start one again."""
    rt = _declared(6, 0, "racks:2,3,4")
    try:
        assert rt.start_pricing()
        pricer = rt.plans.pricer
        rt.plans.stop_ahead("not needed here")
        assert rt.plans.pricer is None and rt.plans.ahead_refused == "not needed here"
        assert pricer is not None and pricer._proc.wait(timeout=30) is not None
        rt.anticipate([3 << 20])
        assert not rt.start_pricing() and rt.plans.pricer is None
        rt.set_cost_model(rt.cost_model)
        assert rt.start_pricing() and rt.plans.pricer is not None
    finally:
        rt.shutdown()


def test_init_starts_the_pricing_once_exploring_is_set(monkeypatch):
    """``init`` starts the child after it calibrates and sets exploring: the child prices with the job's cost model,
    and orders an explorer's neighbours only where the runtime explores."""
    from gradsync.comm import runtime as runtime_mod

    seen: list[tuple[bool, object]] = []
    monkeypatch.setattr(runtime_mod.Runtime, "start_pricing", lambda self: seen.append((self.explore, self.cost_model)))
    monkeypatch.setattr(runtime_mod, "create_transport", lambda name, **kw: LocalFabric(1).transport(0))
    rt = runtime_mod.init(topology="switch:1", transport="local", explore=True, timeout_s=5)
    try:
        assert seen == [(True, rt.cost_model)]
    finally:
        runtime_mod.shutdown()


def test_no_child_where_every_rank_prices_its_own():
    from gradsync.comm import Runtime

    rt = Runtime(LocalFabric(6).transport(0), "racks:2,3,4", "auto", timeout_s=5)
    try:
        rt.anticipate([4 << 20])
        assert rt.plans.pricer is None and "every rank prices its own" in (rt.plans.ahead_refused or "")
    finally:
        rt.shutdown()


@pytest.mark.parametrize(("world", "rank", "topology", "algorithm", "why"), [
    (6, 1, "racks:2,3,4", "auto", "rank 0 prices for the job"),
    (4, 0, "switch:4", "auto", "no plan moves fewer bytes than the backend's ring"),
    (6, 0, "racks:2,3,4", "ring", None),
])
def test_no_child_where_pricing_ahead_would_not_pay(world, rank, topology, algorithm, why):
    rt = _declared(world, rank, topology, algorithm)
    try:
        assert not rt.start_pricing()
        rt.anticipate([4 << 20])
        assert rt.plans.pricer is None
        if why is None:
            assert rt.plans.ahead_refused is None  # a named algorithm has nothing to price
        else:
            assert why in (rt.plans.ahead_refused or "")
    finally:
        rt.shutdown()


def test_price_ahead_is_switched_by_the_environment(monkeypatch):
    rt = _declared(6, 0, "racks:2,3,4")
    try:
        monkeypatch.setenv("GRADSYNC_PRICE_AHEAD", "2")
        with pytest.raises(GradsyncError, match="GRADSYNC_PRICE_AHEAD=2 must be 0 .off. or 1"):
            rt.anticipate([4 << 20])
        monkeypatch.setenv("GRADSYNC_PRICE_AHEAD", "0")
        assert not rt.start_pricing()
        rt.anticipate([4 << 20])
        assert rt.plans.pricer is None and rt.plans.ahead_refused is None
        with pytest.raises(GradsyncError, match="must be positive byte counts"):
            rt.anticipate([0])
    finally:
        rt.shutdown()


def test_an_explorers_neighbours_are_ordered_from_the_child_without_simulating_while_ranks_wait(monkeypatch):
    """A priced-ahead class's explorer asks the child for its neighbours' finish times as it starts; the executors it
    builds of them then take their wait orders from the child (no simulation on the caller's thread), the orders a
    simulation here gives. Without a child, nothing is asked and the order is simulated here as before."""
    import time

    import gradsync.sim.cost as cost
    from gradsync.sim.pricing import order_candidates

    rt = _declared(6, 0, "racks:2,3,4")
    orders: dict[str, bytes] = {}
    decide = rt.plans.caps.decide

    def recording(key, compute, timeout_s):
        got = decide(key, compute, timeout_s)
        if key.split("/")[1] == "order":
            orders[key] = got
        return got

    # a process group's capabilities (the explorer times on one), with the recording decide
    rt.plans.caps = replace(rt.plans.caps, group=object(), backend="gloo", decide=recording)
    rt.explore = True
    try:
        size = 8 << 20
        rt.anticipate([size])
        pricer = rt.plans.pricer
        assert pricer is not None and pricer.orders_from is not None  # an exploring runtime's child orders unasked
        deadline = time.monotonic() + 120
        while size not in pricer.finished and pricer.failed is None and time.monotonic() < deadline:
            pricer.poll()
            time.sleep(0.02)
        asked = []
        monkeypatch.setattr(pricer, "want_orders", lambda n, real=pricer.want_orders: (asked.append(n), real(n)))
        explorer = rt.tuning.explorer(size, rt.choice(size))
        assert explorer is not None and asked == [size]
        chooser = rt.plans.chooser()
        neighbours = order_candidates(chooser, size)
        assert neighbours and set(neighbours) <= set(explorer.candidates)
        digests = {(size, chooser.schedule(*n).digest) for n in neighbours}
        while not digests <= set(pricer._orders) and pricer.failed is None and time.monotonic() < deadline:
            pricer.poll()
            time.sleep(0.02)
        assert digests <= set(pricer._orders), pricer.failed

        def no_simulation(*a, **kw):
            raise AssertionError("a neighbour the child ordered is not simulated on the caller's thread")

        monkeypatch.setattr(cost.CostModel, "run", no_simulation)
        for name, depth in neighbours:
            rt.plans.executor(name, depth, size)
        monkeypatch.undo()
        assert set(pricer.ordered) == digests
        for name, depth in neighbours:
            schedule = chooser.schedule(name, depth)
            fresh = rt.cost_model.wait_order(schedule, rt.topology, size)
            assert np.array_equal(np.frombuffer(orders[f"g0/order/allreduce/{name}/{depth}/{size}"], "<f8"), fresh)
    finally:
        rt.shutdown()


def _sharing(world: int, topology: str) -> tuple[list, dict[str, bytes], list[str]]:
    """Runtimes of ranks 0 and 1 on local transports whose decisions go through one shared board, as the rendezvous
    store shares rank 0's: rank 0 computes and posts, rank 1 reads what rank 0 posted (and fails on a key it did not)."""
    from gradsync.comm import Runtime

    board: dict[str, bytes] = {}
    asked: list[str] = []
    runtimes = []
    for rank in (0, 1):
        def decide(key, compute, timeout_s, rank=rank):
            asked.append(f"{rank}:{key}")
            if rank == 0:
                board[key] = compute()
            return board[key]

        transport = LocalFabric(world).transport(rank)
        transport.capabilities = replace(transport.capabilities, decide=decide)
        runtimes.append(Runtime(transport, topology, "auto", timeout_s=5))
    return runtimes, board, asked


def test_a_planned_executor_runs_the_plan_rank_0_shared_without_planning_it_again(monkeypatch):
    """Building a planned executor, rank 0 plans it (or takes the plan its pricing made) and shares the plain data
    under one key; another rank builds the same schedule from it, checked, without solving it (forest's LP: half a
    second a rank on six processes of one host, which rank 0 waited for in the plan's first call)."""
    from gradsync.sim import choose

    (rt0, rt1), board, asked = _sharing(6, "racks:2,3,4")
    try:
        size = 4 << 20
        ex0 = rt0.plans.executor("forest", 2, size)
        solved: list[tuple[str, int]] = []
        real = choose._plan.synthesize

        def counted(name, topology, options, **kw):
            solved.append((name, options.pipeline))
            return real(name, topology, options, **kw)

        monkeypatch.setattr(choose._plan, "synthesize", counted)
        ex1 = rt1.plans.executor("forest", 2, size)
        assert solved == [], solved  # rank 1 planned nothing
        assert ex1.schedule.digest == ex0.schedule.digest and ex1.schedule.to_dict() == ex0.schedule.to_dict()
        assert "0:g0/schedule/allreduce/forest/2" in asked and "1:g0/schedule/allreduce/forest/2" in asked
        with pytest.raises(KeyError, match="g0/schedule/allreduce/forest/4"):
            rt1.plans.executor("forest", 4, size)  # a depth rank 0 has not shared yet: rank 1 waits for it
        assert solved == [], solved  # and plans nothing of its own meanwhile
    finally:
        rt0.shutdown()
        rt1.shutdown()


def test_a_shared_plan_that_does_not_check_here_is_refused_by_name():
    """A plan shared by rank 0 that this rank's topology does not run (another topology or options on rank 0, or
    bytes damaged on the way) fails as the executor is built, naming the plan and the fix, not mid-collective."""
    import json

    from gradsync.errors import PlanError

    (rt0, rt1), board, _ = _sharing(6, "racks:2,3,4")
    try:
        rt0.plans.executor("forest", 2, 4 << 20)
        key = "g0/schedule/allreduce/forest/2"
        doc = json.loads(board[key])
        doc["transfers"]["dst"] = [0 for _ in doc["transfers"]["dst"]]  # every transfer into rank 0
        board[key] = json.dumps(doc).encode()
        with pytest.raises(PlanError, match="forest plan at depth 2 that rank 0 shared .* same topology"):
            rt1.plans.executor("forest", 2, 4 << 20)
        board[key] = b"not json"
        with pytest.raises(PlanError, match="rank 0 shared"):
            rt1.plans.executor("forest", 2, 4 << 20)
    finally:
        rt0.shutdown()
        rt1.shutdown()
