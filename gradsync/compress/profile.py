"""Measure the costs MergeComp plans with: codec time ``h(x)`` and communication time ``g(x)`` (§4.3).

MergeComp's Assumption 5 says both are linear in the group size ``x``. On a CPU they are not quite: a group
that fits in cache compresses faster per element than one that streams from DRAM, and fixed Python/launch
overheads dominate small groups. So this module measures, fits and reports how far from a line the data is:

* :func:`measure_codec` -- min-of-``repeats`` time of compress + decompress per size, as TicTac's time oracle
  takes the minimum of several runs (the minimum is the least disturbed by other work on the machine);
* :func:`measure_comm` -- the same for a ``send(nbytes) -> seconds`` callable, so the runtime can plug its
  allreduce in; sizes stay in **elements** and bytes come from the compressor's ``payload_bytes``;
* :func:`fit_linear` -- ``LinearCost`` by least squares, with R² and the residual pattern;
* :class:`MeasuredCost` -- piecewise-linear interpolation through the samples, a drop-in ``Cost`` for
  :class:`~gradsync.compress.merge.MergeCostModel` when the line is too coarse;
* :func:`refit_if_drifted` -- re-fit (or rescale) a cost whose predictions missed new samples by more than a
  tolerance (the machine got busier, the clock changed).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from gradsync.compress.base import Compressor, TensorInfo
from gradsync.compress.merge import LinearCost, MergeError

__all__ = [
    "DEFAULT_SIZES",
    "DriftCheck",
    "LinearFit",
    "MeasuredCost",
    "Samples",
    "fit_linear",
    "measure_codec",
    "measure_comm",
    "prediction_error",
    "refit_if_drifted",
]

#: 2^10 .. 2^22 elements, every factor of 4: from a bias vector to a large fully connected layer.
DEFAULT_SIZES: tuple[int, ...] = tuple(2**k for k in range(10, 23, 2))


def _check_repeats(repeats: object) -> int:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise MergeError(f"repeats={repeats!r} must be an integer >= 1 (runs per size; the minimum is kept)")
    return repeats


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sizes)
    if not out:
        raise MergeError("sizes=() must list at least one element count")
    for i, s in enumerate(out):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
            raise MergeError(f"sizes[{i}]={s!r} must be an integer >= 1 (elements)")
    return tuple(int(s) for s in out)


@dataclass(frozen=True)
class Samples:
    """Measured ``seconds[i]`` for ``sizes[i]`` elements, sorted by size, one entry per size."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        sizes = _check_sizes(self.sizes)
        seconds = tuple(self.seconds)
        if len(seconds) != len(sizes):
            raise MergeError(f"len(seconds)={len(seconds)} != len(sizes)={len(sizes)}: one time per size")
        for i, t in enumerate(seconds):
            if (
                isinstance(t, bool)
                or not isinstance(t, (int, float, np.integer, np.floating))
                or not (math.isfinite(t) and t >= 0)
            ):
                raise MergeError(f"seconds[{i}]={t!r} must be a finite number >= 0 (measured for {sizes[i]} elements)")
        order = sorted(range(len(sizes)), key=sizes.__getitem__)
        sizes = tuple(sizes[i] for i in order)
        for a, b in zip(sizes, sizes[1:]):
            if a == b:
                raise MergeError(f"size {a} appears twice; keep one measurement per size (Samples.merged replaces)")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "seconds", tuple(float(seconds[i]) for i in order))

    def merged(self, newer: Samples) -> Samples:
        """These samples updated by ``newer`` (its value wins where both measured a size)."""
        table = dict(zip(self.sizes, self.seconds))
        table.update(zip(newer.sizes, newer.seconds))
        return Samples(tuple(table), tuple(table.values()))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.sizes, dtype=np.float64), np.asarray(self.seconds, dtype=np.float64)


def _fresh(compressor: Compressor) -> Compressor:
    """A new compressor with the same parameters, so profiling leaves the caller's per-tensor state alone."""
    names = [p for p in inspect.signature(type(compressor).__init__).parameters if p != "self"]
    return type(compressor)(**{p: getattr(compressor, p) for p in names if hasattr(compressor, p)})


def measure_codec(
    compressor: Compressor,
    sizes: Sequence[int] = DEFAULT_SIZES,
    *,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    part: Literal["both", "encode", "decode", "feedback", "combine"] = "both",
    seed: int = 0,
    timer: Callable[[], float] = time.perf_counter,
    world: int = 1,
    device: torch.device | str = "cpu",
) -> Samples:
    """Seconds to compress and decompress one flat tensor of each size: the minimum of ``repeats`` runs.

    ``device``: where the tensors live (the gradients' device); on a GPU the timer waits for the device's
    queued kernels first, so a time is the kernels' and not their launch's.

    ``part="both"`` is MergeComp's ``h`` (Figure 3 counts encoding and decoding); ``"encode"`` or ``"decode"``
    time one side (put a separately profiled decode into ``MergeCostModel.d``). One untimed warm-up run per size
    pays for allocations and lazy initialisation. A fresh copy of ``compressor`` is profiled, so stateful
    compressors (PowerSGD's warm start, SigNUM's momentum) keep their state; the thread count is left to
    the caller. For allgather compressors the decode of one payload is timed (a receiver decodes one per
    worker: scale by the world size). Tensors are flat, as MergeComp's merged buffers are; a compressor that
    passes 1-D tensors through (PowerSGD) therefore measures as nearly free.

    What a step really runs besides ``encode``: ``"feedback"`` times error feedback's in-place
    ``subtract_decoded`` (O(k) for a sparse payload, where a decode is O(d)); ``"combine"`` times a receiver's
    :meth:`~gradsync.compress.base.Compressor.combine` of ``world`` payloads into a reused buffer (one zeroed
    buffer and W sparse adds for top-k, not W decodes).
    """
    if not isinstance(compressor, Compressor):
        raise MergeError(f"compressor={compressor!r} must be a Compressor (gradsync.compress.create(name))")
    sizes = _check_sizes(sizes)
    repeats = _check_repeats(repeats)
    if part not in ("both", "encode", "decode", "feedback", "combine"):
        raise MergeError(f"part={part!r} must be 'both', 'encode', 'decode', 'feedback' or 'combine'")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise MergeError(f"world={world!r} must be an integer >= 1 (payloads a receiver combines)")
    codec = _fresh(compressor)
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    if device.type == "cuda":
        clock = timer

        def timer() -> float:
            torch.cuda.synchronize(device)
            return clock()

    out = []
    for size in sizes:
        x = torch.randn(size, generator=gen).to(device=device, dtype=dtype)  # host: the same data on any device
        info = TensorInfo(f"mergecomp.profile.{size}", (size,), dtype)
        best = math.inf
        scratch = torch.empty(size, dtype=dtype, device=device)
        for run in range(repeats + 1):
            if part == "decode":
                payload, ctx = codec.compress(x, info)
                t0 = timer()
                codec.decompress(payload, ctx)
                t1 = timer()
            elif part == "feedback":
                payload, ctx = codec.compress(x, info)
                scratch.copy_(x)
                t0 = timer()
                codec.subtract_decoded(scratch, payload, ctx, inplace=True)
                t1 = timer()
            elif part == "combine":
                payload, ctx = codec.compress(x, info)
                t0 = timer()
                codec.combine([payload] * world, ctx, scratch)
                t1 = timer()
            else:
                t0 = timer()
                payload, ctx = codec.compress(x, info)
                if part == "both":
                    codec.decompress(payload, ctx)
                t1 = timer()
            if run:  # run 0 warms up
                best = min(best, t1 - t0)
        out.append(max(best, 0.0))
    return Samples(sizes, tuple(out))


def measure_comm(
    send: Callable[[int], float],
    sizes: Sequence[int] = DEFAULT_SIZES,
    *,
    compressor: Compressor | None = None,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
) -> Samples:
    """``g`` per element count: the minimum of ``repeats`` calls of ``send(nbytes)`` (which returns seconds).

    ``nbytes`` is what one worker puts on the wire for a group of that many elements: the compressor's
    ``payload_bytes`` (uncompressed ``dtype`` bytes without one). ``send`` times itself, so it can be an
    allreduce, a simulator or a formula.
    """
    if not callable(send):
        raise MergeError(f"send={send!r} must be a callable send(nbytes) -> seconds")
    if compressor is not None and not isinstance(compressor, Compressor):
        raise MergeError(f"compressor={compressor!r} must be a Compressor or None (uncompressed)")
    sizes = _check_sizes(sizes)
    repeats = _check_repeats(repeats)
    out = []
    for size in sizes:
        nbytes = compressor.payload_bytes(size, dtype) if compressor is not None else size * dtype.itemsize
        best = math.inf
        for _ in range(repeats):
            t = send(int(nbytes))
            if (
                isinstance(t, bool)
                or not isinstance(t, (int, float, np.integer, np.floating))
                or not (math.isfinite(t) and t >= 0)
            ):
                raise MergeError(f"send({nbytes}) returned {t!r}; it must return the seconds it took (finite, >= 0)")
            best = min(best, float(t))
        out.append(best)
    return Samples(sizes, tuple(out))


# -- fits ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearFit:
    """A least-squares line through samples, and how well it fits."""

    cost: LinearCost
    samples: Samples
    #: Coefficient of determination on the raw seconds (1 = every point on the line).
    r2: float
    #: ``(measured - fitted) / fitted`` per size: the shape of the misfit.
    rel_residuals: tuple[float, ...]

    @property
    def max_rel_error(self) -> float:
        return max((abs(r) for r in self.rel_residuals), default=0.0)

    @property
    def pattern(self) -> str:
        """Signs of the residuals by increasing size, e.g. ``'+--++'``: convex data under a line reads ``+-+``."""
        return "".join("+" if r > 0 else "-" if r < 0 else "0" for r in self.rel_residuals)

    def report(self) -> str:
        """A small table: the line, R², and measured against fitted per size."""
        c = self.cost
        lines = [
            f"h(x) = {c.base_s * 1e6:.3f} us + {c.per_element_s * 1e9:.4f} ns * x   R^2 = {self.r2:.5f}   "
            f"residual signs {self.pattern}"
        ]
        for size, t, r in zip(self.samples.sizes, self.samples.seconds, self.rel_residuals):
            lines.append(f"  {size:>10d}  measured {t * 1e6:12.3f} us  fit {c(size) * 1e6:12.3f} us  {r:+8.1%}")
        return "\n".join(lines)


def fit_linear(samples: Samples, *, relative: bool = True) -> LinearFit:
    """``B + γ x`` through ``samples`` by least squares, both coefficients kept ``>= 0``.

    ``relative=True`` (default) minimises relative errors (weights ``1/t``): sizes span four orders of
    magnitude, and plain least squares would fit the largest size and leave ``B`` -- what decides how many
    groups pay off -- to chance (often negative). ``relative=False`` is ordinary least squares. A negative
    coefficient is clamped to 0 and the other re-fitted.
    """
    if not isinstance(samples, Samples):
        raise MergeError(f"samples={samples!r} must be Samples")
    if len(samples.sizes) < 2:
        raise MergeError(f"fit_linear needs samples at >= 2 sizes, got {len(samples.sizes)} ({samples.sizes})")
    x, t = samples.arrays()
    w = 1.0 / np.maximum(t, np.finfo(np.float64).tiny) if relative else np.ones_like(t)
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (base, per), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if base < 0:  # through the origin
        base, per = 0.0, float(np.dot(x * w, t * w) / np.dot(x * w, x * w))
    if per < 0:  # constant
        base, per = float(np.dot(w, t * w) / np.dot(w, w)), 0.0
    cost = LinearCost(max(float(base), 0.0), max(float(per), 0.0))
    pred = cost(x)
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = tuple(float(r) for r in np.where(pred > 0, (t - pred) / np.where(pred > 0, pred, 1.0), 0.0))
    return LinearFit(cost, samples, r2, rel)


@dataclass(frozen=True)
class MeasuredCost:
    """Piecewise-linear interpolation through measured ``(size, seconds)`` points: a :class:`Cost` for ``MergeCostModel``.

    Between knots it interpolates; outside it extends the first and last segments (the last segment's slope
    is the streaming per-element cost) and never goes below 0. With ``monotone=True`` (default, see
    :meth:`from_samples`) noise that makes a larger size look cheaper is flattened by a running maximum.
    """

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        sizes, seconds = tuple(float(s) for s in self.sizes), tuple(float(t) for t in self.seconds)
        if not sizes or len(sizes) != len(seconds):
            raise MergeError(f"MeasuredCost needs one time per size, got {len(sizes)} sizes and {len(seconds)} times")
        if any(b <= a for a, b in zip(sizes, sizes[1:])) or sizes[0] < 0:
            raise MergeError(f"sizes={sizes} must be >= 0 and strictly increasing")
        if not all(math.isfinite(t) and t >= 0 for t in seconds):
            raise MergeError(f"seconds={seconds} must be finite and >= 0")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "seconds", seconds)

    @classmethod
    def from_samples(cls, samples: Samples, *, monotone: bool = True) -> MeasuredCost:
        t = np.asarray(samples.seconds, dtype=np.float64)
        if monotone:
            t = np.maximum.accumulate(t)
        return cls(tuple(float(s) for s in samples.sizes), tuple(float(v) for v in t))

    def __call__(self, numel: Any) -> Any:
        xs, ts = np.asarray(self.sizes), np.asarray(self.seconds)
        x = np.asarray(numel, dtype=np.float64)
        out = np.interp(x, xs, ts)
        if xs.size > 1:
            lo_slope = (ts[1] - ts[0]) / (xs[1] - xs[0])
            hi_slope = (ts[-1] - ts[-2]) / (xs[-1] - xs[-2])
            out = np.where(x < xs[0], ts[0] + lo_slope * (x - xs[0]), out)
            out = np.where(x > xs[-1], ts[-1] + hi_slope * (x - xs[-1]), out)
        out = np.maximum(out, 0.0)
        return float(out) if out.ndim == 0 else out


def prediction_error(cost: LinearCost | MeasuredCost, samples: Samples) -> float:
    """Largest ``|predicted - measured| / measured`` over ``samples`` (inf if a measured 0 is mispredicted)."""
    x, t = samples.arrays()
    pred = np.asarray(cost(x), dtype=np.float64)
    diff = np.abs(pred - t)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(t > 0, diff / np.where(t > 0, t, 1.0), np.where(diff > 0, np.inf, 0.0))
    return float(rel.max())


@dataclass(frozen=True)
class DriftCheck:
    """The cost to plan with now, how far the old one was off, and whether it was re-fitted."""

    cost: LinearCost | MeasuredCost
    error: float
    refitted: bool


def refit_if_drifted(cost: LinearCost | MeasuredCost, new_samples: Samples, tolerance: float) -> DriftCheck:
    """Keep ``cost`` while it predicts ``new_samples`` within ``tolerance`` (relative); otherwise re-fit it.

    A :class:`LinearCost` is re-fitted on the new samples (rescaled by their median measured/predicted ratio
    when they cover a single size). A :class:`MeasuredCost` takes the new points as knots and rescales its
    other knots by that median ratio, so a uniform slowdown carries over to sizes not re-measured. Re-plan
    (``search_optimal``) when ``refitted`` is True.
    """
    if not isinstance(new_samples, Samples):
        raise MergeError(f"new_samples={new_samples!r} must be Samples")
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not (math.isfinite(tolerance) and tolerance > 0)
    ):
        raise MergeError(f"tolerance={tolerance!r} must be a finite number > 0 (relative prediction error)")
    if not isinstance(cost, (LinearCost, MeasuredCost)):
        raise MergeError(f"cost={cost!r} must be a LinearCost or a MeasuredCost")
    error = prediction_error(cost, new_samples)
    if error <= tolerance:
        return DriftCheck(cost, error, False)
    x, t = new_samples.arrays()
    pred = np.asarray(cost(x), dtype=np.float64)
    ok = pred > 0
    ratio = float(np.median(t[ok] / pred[ok])) if ok.any() else 1.0
    if isinstance(cost, LinearCost):
        if len(new_samples.sizes) >= 2:
            new: LinearCost | MeasuredCost = fit_linear(new_samples).cost
        else:
            new = LinearCost(cost.base_s * ratio, cost.per_element_s * ratio)
    else:
        remeasured = {float(size) for size in new_samples.sizes}
        table = {size: v * ratio for size, v in zip(cost.sizes, cost.seconds) if size not in remeasured}
        table.update(zip(sorted(remeasured), new_samples.seconds))
        knots = sorted(table)
        new = MeasuredCost(tuple(knots), tuple(np.maximum.accumulate([table[k] for k in knots]).tolist()))
    return DriftCheck(new, error, True)
