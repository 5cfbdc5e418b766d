"""``CompressionStep`` on two in-process ranks: a training step is one transaction over all of its exchanges
(issue 42). One NaN or inf in one tensor on one rank leaves every tensor's error feedback and compressor state
as it was, so the later steps are bit for bit those of a run that never took the bad step, and it counts once."""

from __future__ import annotations

import math

import pytest
import torch

from gradsync.comm.runtime import Runtime
from gradsync.compress import COMPRESSORS
from gradsync.compress.base import TensorInfo
from gradsync.train.communicator import CompressionStep, average_in_place, native_cast_sum_async
from tests.compress.seeded import seeded
from tests.train.local_ranks import on_ranks

WORLD = 2
BAD_STEP = 2
STEPS = 5
#: one exchange of two tensors (a matrix and a vector: PowerSGD sends the vector as it is), then one of one tensor
EXCHANGES = ({"a": (40, 25), "c": (300,)}, {"b": (20, 30)})
#: where the bad element goes: the last exchange (its step's first exchange already ran) or the first one
BAD = {"nan": (math.nan, "b"), "inf": (math.inf, "c")}

pytestmark = [pytest.mark.usefixtures("single_intraop_thread"),
              pytest.mark.filterwarnings("ignore:gradsync. a gradient:RuntimeWarning")]


def _grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return {n: torch.randn(shape, generator=gen) for ex in EXCHANGES for n, shape in ex.items()}


def _run(name: str, memory: str, bad: str, skip: bool):
    value, where = BAD[bad]

    def rank(r: int, rt: Runtime) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        step = CompressionStep(seeded(name), memory, runtime=rt)
        outs: list[dict[str, torch.Tensor]] = []
        for s in range(STEPS):
            if skip and s == BAD_STEP:
                outs.append({})
                continue
            grads = _grads(r, s)
            if s == BAD_STEP and r == 0:
                grads[where].view(-1)[7] = value
            works = []
            for ex in EXCHANGES:
                infos = [TensorInfo(n, shape, torch.float32) for n, shape in ex.items()]
                works.append((list(ex), step.step_async([grads[n] for n in ex], infos)))
            step.close_step()
            outs.append({n: out for names, work in works for n, out in zip(names, work.wait())})
        return outs, step.nonfinite_steps, step.memory.nonfinite_steps

    return on_ranks(WORLD, rank)


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("name", COMPRESSORS.names())
def test_one_bad_tensor_leaves_every_tensor_of_the_step_as_if_the_step_never_happened(name: str, bad: str) -> None:
    _, where = BAD[bad]
    memory = "dgc" if name == "dgc" else "residual"  # error feedback on every tensor: there is something to keep
    seen = _run(name, memory, bad, skip=False)
    never = _run(name, memory, bad, skip=True)
    for r, ((outs, steps, dropped), (ref, ref_steps, _)) in enumerate(zip(seen, never)):
        got = outs[BAD_STEP][where]
        if name == "powersgd" and len(got.shape) == 1:  # sent as it is: the inf reaches the sum by itself
            assert not torch.isfinite(got).all(), (name, r)
        else:
            assert torch.isnan(got).all(), (name, r, "the bad tensor's aggregate must be all NaN")
        for s in range(BAD_STEP + 1, STEPS):
            for n in outs[s]:
                assert torch.isfinite(outs[s][n]).all(), (name, r, s, n)
                assert torch.equal(outs[s][n], ref[s][n]), f"{name}: rank {r}, step {s}, {n!r} differs from the run without step {BAD_STEP}"
        assert (steps, dropped, ref_steps) == (1, 1, 0), (name, r)
    # the ranks agree: the same aggregates everywhere
    for s in range(BAD_STEP + 1, STEPS):
        assert all(torch.equal(seen[0][0][s][n], seen[1][0][s][n]) for n in seen[0][0][s]), (name, s)


def test_a_name_sent_again_begins_the_next_step() -> None:
    """Without close_step(), the first name sent a second time ends the step: a caller that sends one tensor per
    step (``step.step(t, info)`` in a loop) gets a step per call."""

    def rank(r: int, rt: Runtime) -> list[int]:
        step = CompressionStep("topk", "residual", runtime=rt)
        info = TensorInfo("w", (50,), torch.float32)
        counts = []
        for s in range(4):
            g = torch.ones(50) * (s + 1)
            if s == 1 and r == 1:
                g[0] = math.inf
            out = step.step(g, info)
            assert bool(torch.isnan(out).all()) == (s == 1), (r, s)
            counts.append(step.nonfinite_steps)
        return counts

    # the bad step counts once the next one began (it may still have been open before)
    assert on_ranks(WORLD, rank) == [[0, 0, 1, 1]] * WORLD


class _SumsNatively:
    """A runtime whose backend sums every size natively, on two ranks that hold the same tensor: the sum doubles."""

    world_size = 2

    def __init__(self) -> None:
        self.sent: list[torch.dtype] = []

    def runs_natively(self, nbytes: int) -> bool:
        return True

    def native_allreduce_async(self, tensor: torch.Tensor, always: bool = False) -> torch.futures.Future:
        self.sent.append(tensor.dtype)
        tensor.mul_(2)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([tensor])
        return fut


@pytest.mark.parametrize("finished", [False, True])
def test_a_native_cast_sum_is_cast_back_then_finished_in_one_future(finished: bool) -> None:
    """The fp16 hook's native path: the sum in fp16, cast back into the buffer, then ``finish`` (the average) on
    the cast-back sum; the future's value is ``finish``'s result, or the buffer summed without one."""
    rt = _SumsNatively()
    x = torch.tensor([1.0, 1 / 3, 1000.1, -2.5e-3])
    summed = (x.half() * 2).float()  # what two ranks' fp16 sum casts back to
    seen: list[torch.Tensor] = []

    def finish(flat: torch.Tensor) -> torch.Tensor:
        seen.append(flat.clone())
        return average_in_place(flat, 2)

    fut = native_cast_sum_async(rt, x, torch.float16, finish=finish if finished else None)  # type: ignore[arg-type]
    assert fut is not None and rt.sent == [torch.float16]
    assert fut.wait() is x
    if finished:
        assert len(seen) == 1 and torch.equal(seen[0], summed)
        assert torch.equal(x, summed / 2)
    else:
        assert torch.equal(x, summed)
