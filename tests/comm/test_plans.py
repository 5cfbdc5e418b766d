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
