"""``DistributedOptimizer``'s grouping, in one process: which gradients travel together, and when; and its compressed
step on two in-process ranks when one gradient is NaN or inf."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm.runtime import Runtime
from gradsync.compress import COMPRESSORS
from gradsync.errors import GradsyncError
from gradsync.train.grouped import ddp_partition
from gradsync.train.optimizer import DDP_BUCKET_BYTES, FIRST_BUCKET_BYTES, DistributedOptimizer
from tests.compress.seeded import seeded, step_tensors
from tests.train.local_ranks import on_ranks


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
        self.anticipated: list[list[float]] = []

    def prepare(self, algorithm: str | None = None) -> None:
        return None

    def anticipate(self, sizes: list[float], *, first: bool = False) -> None:
        self.anticipated.append(list(sizes))

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
    assert rt.anticipated == [[sum(g) for g in expect]]  # priced ahead as it starts: the groups' sizes, in order
    for _ in range(2):  # every iteration starts a first group again
        rt.groups.clear()
        _step(opt, model)
        assert rt.groups == expect
        assert opt.group_bytes == [sum(g) for g in expect]  # the statistic names the groups of the last step
    opt.remove_hooks()


@pytest.mark.parametrize("seed", range(6))
def test_auto_calibration_buckets_are_ddps_own(seed: int) -> None:
    """compression="auto"'s calibration steps send DDP's default buckets: the same cuts as torch's own bucketing
    (``_compute_bucket_assignment_by_size`` with DDP's first and later limits) on random tensor sizes."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(seed)
    numels = [int(torch.randint(1, 9_000_000, (1,), generator=g)) // int(torch.randint(1, 50, (1,), generator=g))
              for _ in range(int(torch.randint(1, 30, (1,), generator=g)))]
    tensors = [torch.empty(n) for n in numels]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES])
    assert [list(range(a, b)) for a, b in ddp_partition([4 * n for n in numels]).bounds] == buckets


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


# ---- gradient accumulation (backward_passes_per_step, no_sync) ------------------------------------------------------
def _scalar() -> tuple[torch.nn.Module, torch.nn.Parameter]:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1))
    return model, model.w


@pytest.mark.parametrize("bad", [0, -1, 1.0, "2", True, None])
def test_bad_backward_passes_per_step_is_named(bad):
    model, w = _scalar()
    with pytest.raises(GradsyncError, match=rf"backward_passes_per_step={bad!r} must be an integer >= 1"):
        DistributedOptimizer(torch.optim.SGD([w], lr=1.0), model.named_parameters(), runtime=_Recorder(model),
                             backward_passes_per_step=bad)


def test_two_passes_then_one_step_apply_the_accumulated_gradient_sent_once():
    """The issue's case: gradients 2 and 3 in two passes move the weight by 5 (the accumulated gradient), and the
    gradient travels once, after the second pass."""
    model, w = _scalar()
    rt = _Recorder(model)
    opt = DistributedOptimizer(torch.optim.SGD([w], lr=1.0), model.named_parameters(), runtime=rt, backward_passes_per_step=2)
    for step in range(2):
        opt.zero_grad()
        (w * 2).sum().backward()
        assert rt.groups == [[4]] * step  # nothing sent after the first pass
        (w * 3).sum().backward()
        assert rt.groups == [[4]] * (step + 1)
        opt.step()
        assert w.item() == -5.0 * (step + 1)
    opt.remove_hooks()


def test_a_second_pass_without_accumulation_raises_naming_the_count_and_the_fix():
    model, w = _scalar()
    opt = DistributedOptimizer(torch.optim.SGD([w], lr=1.0), model.named_parameters(), runtime=_Recorder(model))
    (w * 2).sum().backward()
    with pytest.raises(GradsyncError, match=r"'w' arrived from backward pass 2 .* backward_passes_per_step=2 .*no_sync"):
        (w * 3).sum().backward()
    opt.zero_grad()  # drops the step; the next one works
    (w * 2).sum().backward()
    opt.step()
    assert w.item() == -2.0
    opt.remove_hooks()


def test_no_sync_passes_accumulate_locally_and_travel_with_the_next_pass():
    model, w = _scalar()
    rt = _Recorder(model)
    opt = DistributedOptimizer(torch.optim.SGD([w], lr=1.0), model.named_parameters(), runtime=rt)
    with opt.no_sync():
        (w * 2).sum().backward()
        (w * 4).sum().backward()
    assert rt.groups == []
    (w * 3).sum().backward()
    assert rt.groups == [[4]]
    opt.step()
    assert w.item() == -9.0
    with opt.no_sync():  # only no_sync passes: step() sends them
        (w * 1).sum().backward()
    opt.step()
    assert rt.groups == [[4], [4]] and w.item() == -9.0 - 10.0  # .grad was not zeroed: 9 + 1
    opt.remove_hooks()


def test_a_step_after_fewer_passes_sends_them_at_step():
    model, w = _scalar()
    rt = _Recorder(model)
    opt = DistributedOptimizer(torch.optim.SGD([w], lr=1.0), model.named_parameters(), runtime=rt, backward_passes_per_step=3)
    (w * 2).sum().backward()
    assert rt.groups == []
    opt.step()
    assert rt.groups == [[4]] and w.item() == -2.0
    opt.remove_hooks()


# ---- non-finite gradients with compression (issue 42): the step is one transaction over every group ----------

_SHAPES = {"w1": (16, 8), "b1": (16,), "w2": (4, 16), "b2": (4,)}  # backward order: b2, w2, b1, w1
_BAD = {"nan": (float("nan"), "w1"), "inf": (float("inf"), "b2")}  # in the last group sent, or in the first


class _Linear(torch.nn.Module):
    """Parameters whose gradient is a fixed tensor per step (the loss is linear in them): every rank knows its
    gradients in advance, and a NaN put in one reaches exactly that gradient."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in _SHAPES.items():
            setattr(self, name, torch.nn.Parameter(torch.zeros(shape)))

    def loss(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, n) * c).sum() for n, c in coeffs.items())  # type: ignore[return-value]


def _compressed_run(name: str, bad: str, skip: bool) -> list:
    value, where = _BAD[bad]

    def rank(r: int, rt: Runtime) -> tuple[list[dict[str, torch.Tensor]], int]:
        model = _Linear()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), runtime=rt,
                                   compression=seeded(name), memory="dgc" if name == "dgc" else "residual", merge=2)
        outs: list[dict[str, torch.Tensor]] = []
        for s in range(5):
            if skip and s == 2:
                outs.append({})
                continue
            coeffs = step_tensors(_SHAPES, s, r, bad=(2, where, 1, value))
            opt.zero_grad()
            model.loss(coeffs).backward()
            opt.step()
            outs.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.remove_hooks()
        return outs, opt.nonfinite_steps

    return on_ranks(2, rank)


@pytest.mark.filterwarnings("ignore:gradsync. a gradient:RuntimeWarning")
@pytest.mark.parametrize("bad", sorted(_BAD))
@pytest.mark.parametrize("name", COMPRESSORS.names())
def test_one_bad_gradient_leaves_every_group_as_if_the_step_never_happened(name: str, bad: str) -> None:
    """Two merged groups; one element of one gradient on rank 0 is NaN or inf at step 2: that gradient comes back
    non-finite (GradScaler skips the step), and steps 3 and 4 are bit for bit a run that skipped step 2 -- the
    other group's error feedback did not take step 2 either. The optimizer counts the step once."""
    _, where = _BAD[bad]
    seen, never = _compressed_run(name, bad, skip=False), _compressed_run(name, bad, skip=True)
    for r, ((outs, count), (ref, ref_count)) in enumerate(zip(seen, never)):
        assert not torch.isfinite(outs[2][where]).all(), (name, r)
        for s in (3, 4):
            for n in _SHAPES:
                assert torch.isfinite(outs[s][n]).all() and torch.equal(outs[s][n], ref[s][n]), (name, r, s, n)
        assert (count, ref_count) == (1, 0), (name, r)


@pytest.mark.filterwarnings("ignore:gradsync. a gradient:RuntimeWarning")
@pytest.mark.parametrize("name", ["none", "topk", "powersgd", "efsignsgd"])
def test_a_non_finite_step_is_skipped_on_every_rank_without_a_grad_scaler(name: str) -> None:
    """Issue 42, GradScaler's contract kept by the optimizer itself: the parameters after a step whose gradient
    held an inf on rank 0 are the parameters before it, on both ranks, finite; the next step moves them again."""

    def rank(r: int, rt: Runtime) -> tuple[list[dict[str, torch.Tensor]], int]:
        model = _Linear()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                                   compression=seeded(name), memory="residual", merge=2)
        params = []
        for s in range(3):
            coeffs = step_tensors(_SHAPES, s, r, bad=(1, "b2", 0, float("inf")))
            opt.zero_grad()
            model.loss(coeffs).backward()
            opt.step()
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.remove_hooks()
        return params, opt.nonfinite_steps

    for r, (params, count) in enumerate(on_ranks(2, rank)):
        assert count == 1, (name, r)
        for n in _SHAPES:
            assert torch.isfinite(params[1][n]).all() and torch.equal(params[1][n], params[0][n]), (name, r, n)
        assert any(not torch.equal(params[2][n], params[1][n]) for n in _SHAPES), (name, r)


def test_an_auto_runtime_prices_nothing_when_an_optimizer_or_hook_starts_on_it() -> None:
    """Each size class is priced at its first call: starting an optimizer (or a DDP hook state) on ``auto`` plans its
    candidates but prices no class (the default ``options.size_bytes`` class it used to price, 128 MiB, cost rank 0
    7-8 s on the testbed's two-tier file while every rank waited, for a size the MLP never sent); a named algorithm is
    still planned there, and a bad one fails there."""
    from gradsync.comm.local import LocalFabric
    from gradsync.train.hooks import GradsyncHookState

    rt = Runtime(LocalFabric(2).transport(0), "switch:2", "auto", timeout_s=5)

    def start(**kw):  # type: ignore[no-untyped-def]
        model = _model()
        return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                                    **kw)

    try:
        start()
        GradsyncHookState(runtime=rt)
        assert rt.plans.chosen() == {} and rt.plans.built() == set()
        start(algorithm="ring")
        assert rt.plans.built() == {("ring", rt.options.pipeline)}
        with pytest.raises(GradsyncError, match="unknown algorithm 'nope'"):
            start(algorithm="nope")
    finally:
        rt.shutdown()


def _priced_and_sent(monkeypatch: pytest.MonkeyPatch, send: str) -> tuple[list[list[float]], list[int]]:
    """Record what a runtime is asked to price ahead, and the bytes of each call of its ``send`` method (which still
    runs)."""
    asked: list[list[float]] = []
    sent: list[int] = []
    monkeypatch.setattr(Runtime, "anticipate", lambda self, sizes, first=False: asked.append(list(sizes)))
    run = getattr(Runtime, send)

    def recorded(self: Runtime, tensors, *args, **kwargs):  # type: ignore[no-untyped-def]
        sent.append(sum(t.numel() * t.element_size() for t in ([tensors] if torch.is_tensor(tensors) else tensors)))
        return run(self, tensors, *args, **kwargs)

    monkeypatch.setattr(Runtime, send, recorded)
    return asked, sent


def _start_and_step(rt: Runtime, asked: list, sent: list, **kw: object) -> torch.nn.Module:
    """An optimizer (``kw``) over a small model on ``rt``: it asks for pricing once as it starts, sends nothing before
    its first step, which runs here; the model is returned."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               **kw)  # type: ignore[arg-type]
    assert len(asked) == 1 and not sent
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model


@pytest.mark.parametrize("merge", ["layerwise", 2])
@pytest.mark.parametrize("name", ["fp16", "none", "randk"])
def test_a_fixed_codec_has_its_first_steps_allreduce_sizes_priced_ahead(name: str, merge: object,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """As it starts, an optimizer with a fixed codec that sums by one allreduce asks its runtime to price ahead what
    its groups send: the sizes its first step then hands the runtime's allreduce, each group's payloads and marks."""
    from gradsync.comm.local import LocalFabric

    asked, sent = _priced_and_sent(monkeypatch, "run_allreduce")
    rt = Runtime(LocalFabric(1).transport(0))
    try:
        _start_and_step(rt, asked, sent, compression=name, merge=merge)
        assert sorted(asked[0]) == sorted(sent) and len(sent) == (4 if merge == "layerwise" else 2), (asked, sent)
    finally:
        rt.shutdown()


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_a_codec_with_another_exchange_prices_nothing_ahead(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An allgather (top-k) or two rounds (PowerSGD) is no single allreduce of a size known before the step: nothing
    is anticipated."""
    from gradsync.comm.local import LocalFabric

    asked: list[list[float]] = []
    monkeypatch.setattr(Runtime, "anticipate", lambda self, sizes, first=False: asked.append(list(sizes)))
    rt = Runtime(LocalFabric(1).transport(0))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3))
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                             compression=name)
        assert asked == []
    finally:
        rt.shutdown()


@pytest.mark.parametrize("bucket_bytes, first_bucket_bytes, expect", [
    (0, None, [12, 3600, 1200, 9600]),  # every gradient alone, in backward order
    (4000, None, [12 + 3600 + 1200, 9600]),  # fused until a group holds 4,000 bytes
    (4000, 100, [12 + 3600, 1200 + 9600]),  # the first group closes at 100
    (1 << 20, None, [12 + 3600 + 1200 + 9600]),  # all open at the end, sent by step()
])
def test_an_uncompressed_optimizer_has_its_groups_sizes_priced_ahead(bucket_bytes: int, first_bucket_bytes: int | None,
                                                                      expect: list[int],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Without compression, as it starts, the optimizer asks its runtime to price ahead the sizes of the groups its
    first step then hands the runtime's allreduce, in that order (the model's float32 bytes in backward order: 12, 3,600,
    1,200, 9,600); a named algorithm is not ``auto``'s to price: nothing is asked."""
    from gradsync.comm.local import LocalFabric

    asked, sent = _priced_and_sent(monkeypatch, "allreduce_async")
    rt = Runtime(LocalFabric(1).transport(0))
    try:
        model = _start_and_step(rt, asked, sent, bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes)
        assert asked[0] == sent == expect
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                             algorithm="ring", bucket_bytes=bucket_bytes)
        assert len(asked) == 1
    finally:
        rt.shutdown()
