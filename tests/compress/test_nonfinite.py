"""Non-finite gradients (issue 42): one NaN or inf on one worker never reaches the error-feedback memory or a
compressor's state, and always reaches the aggregate (GradScaler's contract: it sees the inf and skips the step).

The reference for "the memory was left alone" is a second run that never saw the bad step at all: every later
step must give the same bits.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradsync.compress import COMPRESSORS, CompressionError, create, create_memory
from gradsync.compress.base import (
    StepBoundary,
    StepVerdict,
    TensorInfo,
    Verdicts,
    nonfinite_marks,
    simulate_step,
)
from gradsync.compress.memory import DEFAULT_MEMORY
from tests.compress.seeded import seeded

NAMES = COMPRESSORS.names()
BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
WORLD = 2

pytestmark = [pytest.mark.usefixtures("single_intraop_thread"),
              pytest.mark.filterwarnings("ignore:gradsync. a gradient:RuntimeWarning")]


def _grads(step: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=gen) for _ in range(WORLD)]


def _run(name: str, memory: str, steps: list[int], shape: tuple[int, ...], bad_step: int | None = None,
         bad_value: float = math.nan) -> tuple[dict[int, torch.Tensor], list]:
    """Outputs per step of a 2-worker run; at ``bad_step`` worker 0's element 3 is ``bad_value``."""
    compressors = [seeded(name) for _ in range(WORLD)]
    memories = [create_memory(memory) for _ in range(WORLD)]
    info = TensorInfo("w", shape, torch.float32)
    outs = {}
    for step in steps:
        grads = _grads(step, shape)
        if step == bad_step:
            grads[0].view(-1)[3] = bad_value
        outs[step] = simulate_step(compressors, memories, grads, info)
    return outs, memories


#: The large shape reaches top-k's sampled threshold and DGC's sampling (their seeded generators).
CASES = [(n, (40, 25)) for n in NAMES] + [(n, (96, 1024)) for n in ("topk", "dgc", "qsgd", "signum")]


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("memory", ["default", "residual"])
@pytest.mark.parametrize("name, shape", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_one_bad_step_reaches_the_aggregate_and_never_the_memory(name: str, shape, memory: str, bad: str) -> None:
    memory = DEFAULT_MEMORY.get(name, "none") if memory == "default" else memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen, memories = _run(name, memory, [0, 1, 2, 3, 4, 5], shape, bad_step=2, bad_value=BAD[bad])
    never, reference = _run(name, memory, [0, 1, 3, 4, 5], shape)
    assert torch.isnan(seen[2]).all(), f"{name}: the bad step's aggregate must be NaN, got {seen[2].view(-1)[:5]}"
    for step in (3, 4, 5):
        assert torch.isfinite(seen[step]).all(), (name, step)
        assert torch.equal(seen[step], never[step]), f"{name}/{memory}: step {step} differs from the run without step 2"
    assert [m.nonfinite_steps for m in memories] == [1] * WORLD
    assert [m.nonfinite_steps for m in reference] == [0] * WORLD
    if memory == "residual":
        for m, r in zip(memories, reference):
            assert torch.equal(m.residual("w"), r.residual("w"))
    assert sum("NaN or inf on some worker" in str(w.message) for w in caught) == WORLD  # once per memory


@pytest.mark.parametrize("name", ["randk", "signum", "powersgd", "qsgd"])
def test_compressor_state_is_rolled_back_when_the_step_was_bad_elsewhere(name: str) -> None:
    """Worker 1 saw only finite values, but the step was bad on worker 0: worker 1's own state (Rand-k's step,
    SigNUM's momentum, PowerSGD's warm start, QSGD's generator) goes back as well, so the workers stay in step."""
    seen, _ = _run(name, DEFAULT_MEMORY.get(name, "none"), [0, 1, 2, 3], (40, 25), bad_step=1)
    never, _ = _run(name, DEFAULT_MEMORY.get(name, "none"), [0, 2, 3], (40, 25))
    assert torch.equal(seen[2], never[2]) and torch.equal(seen[3], never[3])


def test_dgc_memory_keeps_momentum_and_velocity_from_before_the_bad_step() -> None:
    seen, memories = _run("dgc", "dgc", [0, 1, 2], (40, 25), bad_step=2, bad_value=math.inf)
    never, reference = _run("dgc", "dgc", [0, 1], (40, 25))
    for m, r in zip(memories, reference):
        assert torch.equal(m.velocity("w"), r.velocity("w"))
        assert torch.equal(m.momentum_buffer("w"), r.momentum_buffer("w"))
        assert m.nonfinite_steps == 1


def _step_verdict(finite: bool) -> StepVerdict:
    step = StepVerdict()
    step.fill(step.reserve(), Verdicts(torch.tensor([finite])))
    step.close()
    return step


@pytest.mark.parametrize("memory", ["residual", "dgc", "none"])
def test_a_debt_released_is_forgotten_by_a_finite_step_and_kept_by_a_bad_one(memory: str) -> None:
    """What a memory owes (the residual; DGC's velocity) is released by a step that sends it another way: forgotten
    where that step was finite everywhere, kept as it was where it was not, as an update would be."""
    c = create("topk", ratio=0.1)
    info = TensorInfo("w", (100,), torch.float32)
    owes = {"residual": "residual", "dgc": "velocity"}.get(memory)
    for finite in (True, False):
        m = create_memory(memory)
        assert m.owed("w") is None
        g = torch.randn(100, generator=torch.Generator().manual_seed(0))
        x = m.compensate(g, info)
        payload, ctx = c.compress(x, info)
        m.update(x, info, c, payload, ctx)
        m.commit(info, _step_verdict(True))
        if owes is None:  # nothing is ever owed: nothing to release
            assert m.owed("w") is None
            continue
        debt = m.owed("w")
        torch.testing.assert_close(debt, getattr(m, owes)("w"), rtol=0, atol=0)
        assert float(debt.abs().sum()) > 0
        kept = debt.clone()
        m.release("w")
        m.commit(info, _step_verdict(finite))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            after = m.owed("w")
        if finite:
            assert after is None
            assert torch.equal(m.compensate(g, info), g)  # the next step starts from nothing owed
        else:
            assert torch.equal(after, kept) and m.nonfinite_steps == 1


def test_a_step_without_a_verdict_keeps_its_update() -> None:
    """Callers that run compensate and update alone (no communicator, no commit) keep the old behaviour."""
    memory, c = create_memory("residual"), create("topk", ratio=0.1)
    info = TensorInfo("w", (100,), torch.float32)
    g = torch.randn(100, generator=torch.Generator().manual_seed(0))
    x = memory.compensate(g, info)
    payload, ctx = c.compress(x, info)
    memory.update(x, info, c, payload, ctx)
    torch.testing.assert_close(memory.residual("w"), g - c.decompress(payload, ctx), rtol=0, atol=0)
    assert memory.nonfinite_steps == 0


def test_nonfinite_marks_are_zero_or_nan_per_group() -> None:
    ok, nan, inf = torch.ones(5), torch.tensor([1.0, math.nan]), torch.tensor([-math.inf, 2.0])
    marks = nonfinite_marks([[ok], [ok, nan], [inf], [torch.zeros(0)], [torch.tensor([65504.0]).half() * 2]],
                            torch.float16, torch.device("cpu"))
    assert marks.dtype == torch.float16
    assert marks[0] == 0 and marks[3] == 0 and torch.isnan(marks[[1, 2, 4]]).all()
    packed_bits = torch.tensor([255], dtype=torch.uint8)  # not floating: never a mark
    assert nonfinite_marks([[ok, packed_bits]], torch.float32, torch.device("cpu"))[0] == 0
    # a finite float64 beyond float32's range is finite: marked in its own dtype, then cast
    big = torch.tensor([1e300, -1e300], dtype=torch.float64)
    assert nonfinite_marks([[big], [big * 1e10]], torch.float32, torch.device("cpu")).tolist()[0] == 0
    assert torch.isnan(nonfinite_marks([[big * 1e10]], torch.float32, torch.device("cpu"))).all()


def test_verdicts_read_on_the_host() -> None:
    v = Verdicts(torch.tensor([True, False]))
    assert len(v) == 2 and bool(v[0]) and not bool(v[1])


def test_the_step_never_reads_a_value_on_the_host() -> None:
    """On the meta device (a stand-in for a GPU, tests/test_device_discipline.py) the marks, the NaN poisoning
    and the commit run without a host read; deciding the verdict is left to the name's next use."""
    info = TensorInfo("w", (40, 25), torch.float32)
    for name in ("topk", "signsgd", "efsignsgd", "powersgd"):
        workers = [create(name) for _ in range(WORLD)]
        memories = [create_memory("residual") for _ in range(WORLD)]
        grads = [torch.empty(info.shape, device="meta") for _ in range(WORLD)]
        out = simulate_step(workers, memories, grads, info)
        assert out.device.type == "meta"


def test_a_step_verdict_is_every_exchange_finite_and_final_once_closed_and_run() -> None:
    step = StepVerdict()
    first, second = step.reserve(), step.reserve()
    step.fill(first, Verdicts(torch.tensor([True, True])))
    assert bool(step) and not step.decided  # open, and the second exchange has not run
    step.close()
    assert not step.decided
    step.fill(second, Verdicts(torch.tensor([True, False])))
    assert step.decided and not bool(step)  # one tensor of one exchange: the whole step
    with pytest.raises(CompressionError, match="already closed"):
        step.reserve()


def test_the_boundary_opens_a_step_when_a_name_comes_again_and_counts_a_bad_step_once() -> None:
    boundary = StepBoundary()
    a = boundary.verdict_for(["a", "b"])
    assert boundary.verdict_for(["c"]) is a  # a second exchange of the same step
    a.fill(a.reserve(), Verdicts(torch.tensor([False, True, True])))
    b = boundary.verdict_for(["a"])  # "a" again: the next step
    assert b is not a and a.decided and boundary.nonfinite_steps == 1
    b.fill(b.reserve(), Verdicts(torch.tensor([True])))
    boundary.close()
    boundary.close()  # nothing open: nothing happens
    assert boundary.nonfinite_steps == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_is_false_exactly_when_an_element_is_nan_or_inf(dtype: torch.dtype) -> None:
    """auto's native "none" verdict: against torch.isfinite(...).all(), element by element at random places."""
    from gradsync.compress.base import all_finite

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1000, generator=gen).to(dtype)
    assert all_finite(base).tolist() == [True] and all_finite(base[:0]).tolist() == [True]
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, 517, 999):
            t = base.clone()
            t[at] = bad
            got = all_finite(t)
            assert got.shape == (1,) and got.dtype == torch.bool and got.item() is bool(torch.isfinite(t).all()), (bad, at)
    big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)
    assert all_finite(big).item()  # the largest finite values are finite (their sum overflows: the exact pass)
    big[2] = float("nan")
    assert not all_finite(big).item()
