"""The DDP hook's state as a trainer builds it: Lightning makes ``DDPStrategy(ddp_comm_state=...)`` before the
process group exists, so the state must wait for the first bucket to find its runtime."""

from __future__ import annotations

from tests.dist_launch import run_outside_a_launcher

SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import gradsync

state = gradsync.GradsyncHookState()          # before any process group: nothing to run on yet
assert state.runtime is None and not gradsync.is_initialized()
try:
    gradsync.GradsyncHookState(op="max")
except gradsync.GradsyncError as exc:         # a bad op still fails at once
    assert "op='max'" in str(exc)
else:
    raise SystemExit("op='max' was accepted")
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
net, ref = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
ref.load_state_dict(net.state_dict())
model = DDP(net)
model.register_comm_hook(state, gradsync.allreduce_hook)
x = torch.randn(4, 8)
model(x).sum().backward()
ref(x).sum().backward()
assert state.runtime is gradsync.get_runtime() and state.buckets >= 1
assert torch.equal(net.weight.grad, ref.weight.grad)  # one rank: the mean is the local gradient
print("ok")
gradsync.shutdown()
dist.destroy_process_group()
"""


def test_the_hook_state_built_before_the_process_group_starts_its_runtime_at_the_first_bucket(tmp_path):
    p = run_outside_a_launcher(SCRIPT, str(tmp_path / "store"))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]


def test_a_hook_state_given_the_model_prices_ddps_first_buckets_ahead(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Given the model and a runtime, the planned-allreduce hook state has the runtime price ahead the buckets of DDP's
    first backward: torch's own bucket assignment over the parameters in reverse (limits small enough for several),
    once; nothing without the model, nor where the state names an algorithm of its own; a model that is not a module
    is refused by name."""
    import pytest

    from gradsync.train.hooks import GradsyncHookState
    from tests.train.ddp_buckets import first_buckets

    with first_buckets(monkeypatch) as b:
        state = GradsyncHookState(b.rt, model=b.model)
        assert b.asked == [[sum(b.params[i].numel() * 4 for i in bucket) for bucket in b.buckets]]
        state.anticipate_model(b.model.parameters())
        GradsyncHookState(b.rt)
        GradsyncHookState(b.rt, algorithm="ring", model=b.model)
        assert len(b.asked) == 1
        with pytest.raises(TypeError, match="model must be the torch.nn.Module"):
            GradsyncHookState(b.rt, model="net")  # type: ignore[arg-type]


def test_a_model_whose_buckets_send_nothing_prices_nothing_ahead() -> None:
    """A trainable parameter with no elements makes a bucket of 0 bytes where it is alone in it (here, the only one):
    the runtime refuses a size of 0 to price, so the state made with that model asks for nothing and starts."""
    import torch

    from gradsync.comm.local import LocalFabric
    from gradsync.comm.runtime import Runtime
    from gradsync.train.grouped import ddp_bucket_bytes
    from gradsync.train.hooks import GradsyncHookState

    model = torch.nn.Module()
    model.empty = torch.nn.Parameter(torch.empty(0))
    assert ddp_bucket_bytes(list(model.parameters())) == []
    rt = Runtime(LocalFabric(1).transport(0))
    try:
        assert GradsyncHookState(rt, model=model).resolved
    finally:
        rt.shutdown()
