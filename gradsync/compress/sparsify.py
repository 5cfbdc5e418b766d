"""Sparsifiers with a fixed ratio (MergeComp §2.1): ``topk``, ``randk``, ``dgc``.

All three send ``k = round(ratio * d)`` values (at least one). Top-k and DGC choose different indices on
each worker, so they send the indices too and go by allgather; Rand-k draws its indices from a seed every
worker shares, sends only the values and goes by allreduce. Pair them with error feedback (``residual``,
or ``dgc`` for DGC's momentum correction): what is not sent this step is sent later (Stich et al. 2018).
"""

from __future__ import annotations

import math
import sys
from abc import abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from gradsync.compress import kernels
from gradsync.compress.base import (
    Compressor,
    Context,
    TensorInfo,
    check_ratio,
    check_seed,
    index_dtype,
    k_of,
    numel_of,
    register_compressor,
    stable_seed,
)

__all__ = ["TopK", "RandK", "DGC", "Strata", "sampled_topk", "scatter_flat", "strata_reference"]


def scatter_flat(values: Tensor, indices: Tensor, numel: int) -> Tensor:
    """A dense 1-D tensor of ``numel`` zeros with ``values`` at ``indices`` (repeated indices add up)."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.index_put_((indices.to(torch.int64),), values, accumulate=True)


def _place(values: Tensor, distinct: Tensor, numel: int) -> Tensor:
    """:func:`scatter_flat` for distinct indices (every sparsifier's): a plain scatter, ~half the time of an
    accumulating ``index_put_``."""
    fused = kernels.scatter_values(values, distinct, numel)  # a GPU: no widening pass for int32 indices
    if fused is not None:
        return fused
    return torch.zeros(numel, dtype=values.dtype, device=values.device).scatter_(0, distinct.to(torch.int64), values)


class _SparseValuesIndices(Compressor):
    """Payload ``[values, indices]``: k values in the input's dtype and k int32 (int64 past 2**31) indices."""

    communicator = "allgather"
    payload_shapes_fixed = True

    def __init__(self, ratio: float) -> None:
        super().__init__()
        self.ratio = check_ratio("ratio", ratio)

    @abstractmethod
    def _select(self, magnitude: Tensor, k: int) -> Tensor:
        """Indices of the k elements to send, given ``|x|``."""

    def _flags(self, like: Tensor) -> Tensor:
        """A reused bool scratch of ``like``'s size (the threshold comparison's output)."""
        return self._workspace("flags", like.numel(), torch.bool, like.device)

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        k = k_of(flat.numel(), self.ratio)
        # |x| dies inside this call: written into a reused buffer
        magnitude = torch.abs(flat, out=self._workspace("magnitude", flat.numel(), flat.dtype, flat.device))
        indices = self._select(magnitude, k)
        wire = index_dtype(flat.numel())
        fused = kernels.gather_narrow(flat, indices) if wire == torch.int32 else None
        if fused is not None:  # a GPU: the gather and the indices' cast to the wire's int32 in one launch
            return list(fused), Context(info)
        return [flat.index_select(0, indices), indices.to(wire)], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        values, indices = payload
        return _place(values, indices, ctx.info.numel)

    def sparse(self, payload: Sequence[Tensor], ctx: Context) -> tuple[Tensor, Tensor]:
        values, indices = payload
        return indices, values

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        numel = numel_of(shape)
        return k_of(numel, self.ratio) * (dtype.itemsize + index_dtype(numel).itemsize)


@register_compressor("topk")
class TopK(_SparseValuesIndices):
    """Top-k (Aji & Heafield 2017): exactly the k largest magnitudes; MergeComp finds ``topk()`` its bottleneck."""

    #: Sampled magnitudes for the threshold: enough that the ``2 * ratio`` quantile rests on >= 64 of them.
    _SAMPLE = 4096
    _OVERSAMPLE = 2.0  # aim at ~2k candidates (as DGC): a low estimate then forces the full top-k ~1e-5 of the time
    #: Below ``_SPARSE * samples`` elements (or above ratio 1/8) a plain ``torch.topk`` is as quick.
    _SPARSE = 8

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__(ratio)

    def _select(self, magnitude: Tensor, k: int) -> Tensor:
        """The exact top-k, found among the candidates above a sampled threshold (as DGC does).

        ``torch.topk`` over all of ``d`` costs many times the rest of the codec (measured against GRACE's
        top-k: docs/benchmarks.md, ``gradsync bench codecs``); the candidates (~``2k``) are few.
        The sample only decides how many candidates there are, never which k win, so it comes from a
        fixed-seed generator; a threshold that lets fewer than k through falls back to the full top-k.
        """
        numel = magnitude.numel()
        samples = max(self._SAMPLE, math.ceil(32 / self.ratio))
        if numel < self._SPARSE * samples or self.ratio > 1 / 8 or magnitude.device.type != "cpu":
            # off the CPU the candidates' count is a host synchronisation (nonzero's size), and a GPU's own
            # top-k is as quick at 2.5e7 elements (docs/benchmarks.md, gradsync bench gpu)
            return torch.topk(magnitude, k, sorted=False).indices
        return sampled_topk(magnitude, k, samples, self._OVERSAMPLE * self.ratio,
                            self._generator(magnitude.device, 0), self._flags(magnitude))


@register_compressor("dgc")
class DGC(_SparseValuesIndices):
    """DGC's selection (Lin et al. 2018 §3): estimate the top-k threshold on a random sample, then top-k
    only among the candidates above it. The result is the exact top-k at a fraction of the sort cost.

    The threshold is the ``oversample * ratio`` quantile of ``sample_ratio * d`` sampled magnitudes, so
    usually more than k candidates pass; if fewer do, this step falls back to a full top-k. Momentum
    correction and masking live in memory ``dgc``; warm-up and gradient clipping are left to the caller.
    """

    _MIN_SAMPLE = 64  # below this many sampled elements a quantile estimate is noise: sort everything
    _OVERSAMPLE = 2.0  # aim at ~2k candidates so a low estimate rarely forces the fallback

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01, seed: int | None = None) -> None:
        super().__init__(ratio)
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio)
        self.seed = check_seed(seed, optional=True)

    def _select(self, magnitude: Tensor, k: int) -> Tensor:
        numel = magnitude.numel()
        samples = max(self._MIN_SAMPLE, math.ceil(self.sample_ratio * numel))
        if samples * 2 >= numel or magnitude.device.type != "cpu":
            # off the CPU the candidates' count is a host synchronisation (nonzero's size), and the device's own
            # top-k finds the same k (the sample never decides which k win), as TopK does there
            return torch.topk(magnitude, k, sorted=False).indices
        return sampled_topk(magnitude, k, samples, self._OVERSAMPLE * self.ratio,
                            self._generator(magnitude.device, self.seed), self._flags(magnitude))


def sampled_topk(magnitude: Tensor, k: int, samples: int, share: float, gen: torch.Generator | None,
                 flags: Tensor | None = None) -> Tensor:
    """Indices of the ``k`` largest of ``magnitude`` (1-D): top-k among the elements at or above the ``share``
    quantile of ``samples`` random ones (DGC §3), or of all when fewer than ``k`` reach it. ``flags``: an
    optional bool scratch of ``magnitude``'s size for the comparison."""
    numel = magnitude.numel()
    where = torch.randint(numel, (samples,), generator=gen, device=magnitude.device)
    sample = magnitude[where]
    rank = min(samples, math.ceil(share * samples))
    threshold = torch.topk(sample, rank, sorted=False).values.min()
    candidates = _at_least(magnitude, threshold, flags)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


def _at_least(values: Tensor, threshold: Tensor, flags: Tensor | None = None) -> Tensor:
    """Ascending int64 indices where ``values >= threshold``; numpy on CPU (faster than ``torch.nonzero`` of a mask),
    comparing into ``flags`` (a bool scratch) when given."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        out = flags.numpy() if flags is not None and flags.shape == values.shape else None
        return torch.from_numpy(np.flatnonzero(np.greater_equal(values.numpy(), threshold.item(), out=out)))
    return torch.nonzero(values >= threshold).reshape(-1)


#: splitmix64's odd constants (Steele et al. 2014) as signed int64: a Weyl step and a multiplier.
_WEYL = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX = 0xBF58476D1CE4E5B9 - (1 << 64)
_LITTLE = sys.byteorder == "little"


def _signed64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


class Strata:
    """Rand-k's blocks for ``k`` of ``n`` elements: ``k`` runs of consecutive indices, ``n // k`` or one more long.

    One index is drawn per block (:meth:`draw`), so the k are distinct and ascending, and each element is sent
    with probability ``1 / len(its block)`` (``k / n`` when ``k`` divides ``n``): error feedback's contraction
    ``E|x - C(x)|^2 = (1 - k/n) |x|^2`` holds as for a uniform k-subset. The offsets come from a counter-based
    hash (splitmix64's finaliser, cut to its high 32 bits) of ``(seed, block)``, computed with int64 tensor ops
    that wrap identically on every device: every worker gets the same indices whatever its device, with no
    generator, no host round trip and no sort (a uniform k-subset without replacement needs one or the other).
    """

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        if not 0 < k <= n:
            raise ValueError(f"k={k} must be in [1, n={n}] (one index per block)")
        q, r = divmod(n, k)
        j = torch.arange(k, dtype=torch.int64, device=device)
        #: First index of each block: the first r blocks are q + 1 long.
        self.start = j * q + j.clamp(max=r)
        #: Each block's length (a plain int when all are equal).
        self.size: Tensor | int = q if r == 0 else torch.where(j < r, q + 1, q)
        #: ``j * _WEYL`` (wrapping): the hash's Weyl sequence without its seed.
        self.weyl = j * _WEYL

    def draw(self, seed: int) -> Tensor:
        """The k indices (int64, ascending, on the strata's device) for a 64-bit ``seed``: five passes over k."""
        x = self.weyl + _signed64(seed)
        if _LITTLE:
            halves = x.view(torch.int32).view(-1, 2)  # [low, high] of each word
            halves[:, 0].bitwise_xor_(halves[:, 1])  # x ^= x >>> 32
            x.mul_(_MIX)
            high = x.view(torch.int32).view(-1, 2)[:, 1]  # the signed high half, without a pass
        else:
            x.bitwise_xor_((x >> 32) & 0xFFFFFFFF)
            high = x.mul_(_MIX) >> 32
        return self.start + torch.remainder(high, self.size)


def strata_reference(n: int, k: int, seed: int) -> list[int]:
    """:meth:`Strata.draw` in plain Python integers: the independent expectation the tests compare against."""
    q, r = divmod(n, k)
    out = []
    for j in range(k):
        x = (j * (_WEYL % (1 << 64)) + seed) % (1 << 64)
        x ^= x >> 32
        x = (x * (_MIX % (1 << 64))) % (1 << 64)
        high = x >> 32
        high = high - (1 << 32) if high >> 31 else high
        out.append(j * q + min(j, r) + high % (q + 1 if j < r else q))
    return out


@register_compressor("randk")
class RandK(Compressor):
    """Rand-k (Stich et al. 2018), stratified: one index in each of k blocks of consecutive elements, at an offset
    hashed from ``(seed, info.name, step)`` (:class:`Strata`).

    Every worker draws the same indices on its own device, so only the values travel and they sum by allreduce.
    ``step`` counts this compressor's ``compress`` calls per tensor name (one per training step); values are not
    rescaled by ``d / k``: use it with ``residual`` memory, as Stich et al. do. Stratifying keeps each element's
    chance ``k / d`` of a uniform k-subset and spreads the k over the tensor; it is what lets the draw run on the
    device in a few passes over k (GRACE's ``randperm`` costs O(d), its ``randint`` repeats indices).
    """

    communicator = "allreduce"
    payload_shapes_fixed = True

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__()
        self.ratio = check_ratio("ratio", ratio)
        self.seed = check_seed(seed, optional=False)
        self._strata: dict[tuple[int, torch.device], Strata] = {}

    def indices(self, info: TensorInfo, step: int, device: torch.device | str = "cpu") -> Tensor:
        """The indices every worker uses for ``info.name`` at ``step`` (int64, ascending, on ``device``)."""
        return self._strata_of(info.numel, torch.device(device)).draw(stable_seed("randk", self.seed, info.name, step))

    def _strata_of(self, numel: int, device: torch.device) -> Strata:
        strata = self._strata.get((numel, device))
        if strata is None:
            strata = self._strata[(numel, device)] = Strata(numel, k_of(numel, self.ratio), device)
        return strata

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        step = self._state.get(info.name, 0)
        self._state[info.name] = step + 1
        seed = stable_seed("randk", self.seed, info.name, step)
        fused = kernels.randk_gather(flat, k_of(info.numel, self.ratio), _signed64(seed), _WEYL, _MIX)
        if fused is not None:  # the draw and the gather in one launch (a GPU): the same indices and values
            return [fused[0]], Context(info, (fused[1],))
        indices = self._strata_of(info.numel, flat.device).draw(seed)
        return [flat.index_select(0, indices)], Context(info, (indices,))

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        dense = kernels.randk_place(payload[0], ctx.extra[0], ctx.info.numel)
        return dense if dense is not None else _place(payload[0], ctx.extra[0], ctx.info.numel)

    def sparse(self, payload: Sequence[Tensor], ctx: Context) -> tuple[Tensor, Tensor]:
        return ctx.extra[0], payload[0]

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return k_of(numel_of(shape), self.ratio) * dtype.itemsize
