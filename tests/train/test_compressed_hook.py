"""The compressed hook's state as a trainer builds it: Lightning makes ``DDPStrategy(ddp_comm_state=...)`` before
the process group exists, so :class:`CompressionHookState` must check its arguments at once and find its runtime
at the first bucket (as :class:`GradsyncHookState` does, tests/train/test_hooks.py)."""

from __future__ import annotations

import pytest

from tests.dist_launch import run_outside_a_launcher

SCRIPT = r"""
import sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import gradsync
from gradsync.compress.base import CompressionError

states = {c: gradsync.CompressionHookState(c) for c in ("none", "fp16", "topk")}  # before any process group
assert not gradsync.is_initialized() and not any(s.resolved for s in states.values())
bad = [
    (dict(compression="nope"), "nope"),
    (dict(compression="none", merge="layers"), "merge='layers'"),
    (dict(compression="topk", communicator="allreduce"), "allgather"),
    (dict(compression="none", memory="lots"), "lots"),
    (dict(compression="none", runtime=object()), "Runtime"),
]
for kwargs, word in bad:                       # bad arguments still fail at construction
    try:
        gradsync.CompressionHookState(**kwargs)
    except (CompressionError, ValueError, TypeError) as exc:
        assert word in str(exc), (kwargs, str(exc))
    else:
        raise SystemExit(f"{kwargs} was accepted")
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
for name, state in states.items():
    torch.manual_seed(0)
    net, ref = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
    ref.load_state_dict(net.state_dict())
    model = DDP(net)
    model.register_comm_hook(state, gradsync.compression_hook)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert state.resolved and state.resolve() is gradsync.get_runtime() and state.buckets >= 1, name
    if name == "topk":  # one rank, no error feedback yet: the k largest of the gradient, the rest zero
        nz = net.weight.grad != 0
        assert nz.any() and torch.equal(net.weight.grad[nz], ref.weight.grad[nz]), name
    else:               # one rank: the mean is the local gradient (fp16 rounds it)
        want = ref.weight.grad.half().float() if name == "fp16" else ref.weight.grad
        assert torch.equal(net.weight.grad, want), (name, net.weight.grad, want)
late = gradsync.CompressionHookState("none")   # built once a runtime exists: found at once
assert late.resolved and late.resolve() is gradsync.get_runtime()
print("ok")
gradsync.shutdown()
dist.destroy_process_group()
"""


def test_the_compression_state_built_before_the_process_group_starts_its_runtime_at_the_first_bucket(tmp_path):
    p = run_outside_a_launcher(SCRIPT, str(tmp_path / "store"))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]


def test_a_fixed_codec_hook_given_the_model_prices_its_first_buckets_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook state with a fixed codec on gradsync's thread, given the model and a runtime, has the runtime price ahead
    what DDP's first buckets send (torch's own bucket assignment over the parameters in reverse, here with limits
    small enough for several): per bucket its gradients' payloads (``"none"``: as they are) and one mark each, or its
    flat buffer and one mark (``merge="bucket"``). A cast summed by the process group's own allreduce asks nothing."""
    from gradsync.train.compressed_hook import CompressionHookState
    from tests.train.ddp_buckets import first_buckets

    with first_buckets(monkeypatch) as b:
        CompressionHookState("none", runtime=b.rt, model=b.model)
        assert b.asked == [[sum(b.params[i].numel() * 4 + 4 for i in bucket) for bucket in b.buckets]]
        CompressionHookState("none", runtime=b.rt, model=b.model, merge="bucket")
        assert b.asked[1] == [sum(b.params[i].numel() * 4 for i in bucket) + 4 for bucket in b.buckets]
        CompressionHookState("fp16", runtime=b.rt, model=b.model)
        CompressionHookState("topk", runtime=b.rt, model=b.model)
        assert len(b.asked) == 2
