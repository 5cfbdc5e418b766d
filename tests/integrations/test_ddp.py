"""register_comm_hook on a DDP model, and the Accelerate recipe (``prepare()``, then the hook) under torchrun."""

from __future__ import annotations

import pytest
import torch

import gradsync
from gradsync.integrations.ddp import hook_for, register_comm_hook
from tests.dist_launch import torchrun
from tests.integrations.trainer_checks import check_replicas


def test_each_state_names_its_hook_and_anything_else_is_refused_with_the_fix():
    assert hook_for(gradsync.GradsyncHookState()) is gradsync.allreduce_hook
    assert hook_for(gradsync.CompressionHookState("fp16")) is gradsync.compression_hook
    with pytest.raises(TypeError, match="GradsyncHookState"):
        hook_for({"op": "avg"})


def test_a_model_without_ddp_gets_no_hook():
    # one process: accelerate's prepare() returns the module itself, and there is nothing to synchronise
    assert register_comm_hook(torch.nn.Linear(2, 2), gradsync.GradsyncHookState()) is False


def test_plain_fp16_and_powersgd_hooks_run_under_accelerate_with_torchrun_and_keep_replicas_identical(tmp_path):
    pytest.importorskip("accelerate")
    check_replicas(torchrun("tests/workers/trainer_worker.py", ["accelerate", str(tmp_path)], 2, tmp_path))


def test_registering_on_a_ddp_model_prices_its_first_buckets_ahead_once_where_the_state_has_a_runtime(monkeypatch):
    """register_comm_hook hands a state that has its runtime the wrapped module: DDP's first buckets (DDP's default
    limits over its parameters in reverse) are priced ahead, for the planned allreduce and for a fixed codec on
    gradsync's thread alike; a state made with the model asked already and does not ask again; one with no runtime
    yet (a trainer's, made before the process group) is left to its first bucket."""
    from torch.nn.parallel import DistributedDataParallel

    from gradsync.comm.local import LocalFabric
    from gradsync.comm.runtime import Runtime
    from gradsync.train.grouped import ddp_partition

    class Wrapped(DistributedDataParallel):  # DDP's type and module, without a process group
        def __init__(self, module: torch.nn.Module) -> None:
            torch.nn.Module.__init__(self)
            self.module = module

        def register_comm_hook(self, state, hook):  # type: ignore[no-untyped-def]
            self.hooked = (state, hook)

    asked: list[list[float]] = []
    monkeypatch.setattr(Runtime, "anticipate", lambda self, sizes, first=False: asked.append(list(sizes)))
    rt = Runtime(LocalFabric(1).transport(0))
    try:
        net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 600))
        nbytes = [p.numel() * 4 for p in reversed(list(net.parameters()))]
        expect = list(ddp_partition(nbytes).group_sizes(nbytes))
        assert len(expect) == 2  # the last layer's 1.2 MB close the first bucket at 1 MiB; the first layer's the second
        assert register_comm_hook(Wrapped(net), gradsync.GradsyncHookState(rt)) and asked == [expect]
        assert register_comm_hook(Wrapped(net), gradsync.CompressionHookState("none", runtime=rt))
        assert asked[1] == [n + 4 * len(bucket) for n, bucket in zip(expect, ([0, 1], [2, 3]))]  # payloads, marks
        assert register_comm_hook(Wrapped(net), gradsync.GradsyncHookState(rt, model=net)) and len(asked) == 3
        monkeypatch.setattr("gradsync.train.hooks.is_initialized", lambda: False)  # no runtime, no process group
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
        assert register_comm_hook(Wrapped(net), gradsync.GradsyncHookState()) and len(asked) == 3
    finally:
        rt.shutdown()
