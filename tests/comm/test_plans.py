"""The plan cache (gradsync.comm.plans) and the transports' Capabilities: plan decisions go through a transport's decide."""

from __future__ import annotations

from dataclasses import replace

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
