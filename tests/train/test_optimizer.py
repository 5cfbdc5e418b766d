"""``DistributedOptimizer``'s grouping, in one process: which gradients travel together, and when."""

from __future__ import annotations

import pytest
import torch

from gradsync.errors import GradsyncError
from gradsync.train.optimizer import FIRST_BUCKET_BYTES, DistributedOptimizer


class _Done:
    def wait(self) -> None:
        return None


class _Recorder:
    """A runtime that records each queued group (bytes per gradient) and the parameters whose gradients
    existed when it was queued; the sum over one process is the gradient itself."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.groups: list[list[int]] = []
        self.ready_then: list[int] = []

    def executor(self, algorithm: str | None = None, nbytes: int | None = None) -> None:
        return None

    def allreduce_async(self, group: list[torch.Tensor], op: str, algorithm: str | None) -> _Done:
        self.groups.append([g.numel() * g.element_size() for g in group])
        self.ready_then.append(sum(p.grad is not None for p in self.model.parameters()))
        return _Done()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # bytes in backward order: 4.bias 40, 4.weight 32000, 2.bias 3200, 2.weight 1280000, 0.bias 1600, 0.weight 1600000
    return torch.nn.Sequential(torch.nn.Linear(1000, 400), torch.nn.ReLU(), torch.nn.Linear(400, 800), torch.nn.ReLU(),
                               torch.nn.Linear(800, 10))


def _step(opt: DistributedOptimizer, model: torch.nn.Module) -> None:
    opt.zero_grad()
    model(torch.randn(8, 1000)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("first, expect", [
    # DDP's default: the first group closes once it holds 1 MiB, while the earlier layers' backward still runs
    (None, [[40, 32000, 3200, 1280000], [1600, 1600000]]),
    # every group alike (the behaviour before first_bucket_bytes): all in one group, sent at step()
    (25 << 20, [[40, 32000, 3200, 1280000, 1600, 1600000]]),
    # a first group of one gradient, then the rest fill up to bucket_bytes
    (1, [[40], [32000, 3200, 1280000, 1600, 1600000]]),
])
def test_the_first_group_closes_at_first_bucket_bytes(first, expect):
    model = _model()
    rt = _Recorder(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               bucket_bytes=25 << 20, first_bucket_bytes=first)
    assert opt.first_bucket_bytes == (min(25 << 20, FIRST_BUCKET_BYTES) if first is None else first)
    for _ in range(2):  # every iteration starts a first group again
        rt.groups.clear()
        _step(opt, model)
        assert rt.groups == expect
        assert opt.group_bytes == [sum(g) for g in expect]  # the statistic names the groups of the last step
    opt.remove_hooks()


def test_the_first_group_travels_while_backward_goes_on():
    """With the default, the first group is queued from inside backward (the other gradients not yet there);
    with one limit for every group, nothing goes before step()."""
    model = _model()
    rt = _Recorder(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               bucket_bytes=25 << 20)
    opt.zero_grad(set_to_none=True)
    model(torch.randn(8, 1000)).square().mean().backward()
    assert rt.groups == [[40, 32000, 3200, 1280000]] and rt.ready_then == [4]  # layer 0's gradients came after
    opt.step()
    opt.remove_hooks()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1MB"])
def test_bad_first_bucket_bytes_is_named(bad):
    model = _model()
    with pytest.raises(GradsyncError, match=f"first_bucket_bytes={bad!r} must be an integer >= 0 or None"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), runtime=_Recorder(model),
                             bucket_bytes=1 << 20, first_bucket_bytes=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1MB", float("inf")])
def test_bad_bucket_bytes_is_named(bad):
    model = _model()
    with pytest.raises(GradsyncError, match=rf"bucket_bytes={bad!r} must be an integer >= 0 \(0 sends every"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), runtime=_Recorder(model), bucket_bytes=bad)


def test_byte_limits_written_as_floats_are_whole_bytes():
    """``25e6`` is how a size is often written: taken as the integer it is, for both limits."""
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), runtime=_Recorder(model),
                               bucket_bytes=25e6, first_bucket_bytes=1e6)
    assert (opt.bucket_bytes, opt.first_bucket_bytes) == (25_000_000, 1_000_000)
    assert type(opt.bucket_bytes) is int and type(opt.first_bucket_bytes) is int
    opt.remove_hooks()


def test_first_bucket_bytes_with_compression_is_refused():
    model = _model()
    with pytest.raises(GradsyncError, match="first_bucket_bytes=4096 with compression: merge=... decides"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), runtime=_Recorder(model),
                             compression="fp16", first_bucket_bytes=4096)
