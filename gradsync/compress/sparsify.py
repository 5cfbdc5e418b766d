"""Sparsifiers with a fixed ratio (MergeComp §2.1): ``topk``, ``randk``, ``dgc``.

All three send ``k = round(ratio * d)`` values (at least one). Top-k and DGC choose different indices on
each worker, so they send the indices too and go by allgather; Rand-k draws its indices from a seed every
worker shares, sends only the values and goes by allreduce. Pair them with error feedback (``residual``,
or ``dgc`` for DGC's momentum correction): what is not sent this step is sent later (Stich et al. 2018).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

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

__all__ = ["TopK", "RandK", "DGC", "sampled_topk", "scatter_flat"]


def scatter_flat(values: Tensor, indices: Tensor, numel: int) -> Tensor:
    """A dense 1-D tensor of ``numel`` zeros with ``values`` at ``indices`` (repeated indices add up)."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.index_put_((indices.to(torch.int64),), values, accumulate=True)


def _place(values: Tensor, distinct: Tensor, numel: int) -> Tensor:
    """:func:`scatter_flat` for distinct indices (every sparsifier's): a plain scatter, ~half the time of an
    accumulating ``index_put_``."""
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
        return [flat.index_select(0, indices), indices.to(index_dtype(flat.numel()))], Context(info)

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
        if numel < self._SPARSE * samples or self.ratio > 1 / 8:
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
        if samples * 2 >= numel:
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


def sample_without_replacement(n: int, k: int, gen: torch.Generator) -> Tensor:
    """``k`` distinct indices of ``range(n)``, a uniformly random ``k``-subset in random order, in O(k log k).

    ``randperm(n)[:k]`` costs O(n) time and memory per call (against GRACE's rand-k: ``gradsync bench codecs``). For
    ``k <= n / 4``: draw with replacement, keep the distinct values, draw again for the shortfall (expected
    draws < 1.2 k), then a random order of a random ``k`` of them. The result is symmetric under any
    permutation of ``range(n)``, hence uniform over ``k``-subsets; deterministic for a seeded ``gen``.
    """
    # host: the same indices on every worker whatever its device, so drawn on the host's generator
    if k * 4 > n:
        return torch.randperm(n, generator=gen)[:k]  # host
    picked = torch.empty(0, dtype=torch.int64)  # host
    while picked.numel() < k:
        more = torch.randint(n, (k - picked.numel() + 16,), generator=gen)  # host
        picked = torch.unique(torch.cat([picked, more]))
    return picked[torch.randperm(picked.numel(), generator=gen)[:k]]  # host


@register_compressor("randk")
class RandK(Compressor):
    """Rand-k (Stich et al. 2018): k indices drawn from a generator seeded by ``(seed, info.name, step)``.

    Every worker draws the same indices, so only the values travel and they sum by allreduce. ``step``
    counts this compressor's ``compress`` calls per tensor name (one per training step); values are not
    rescaled by ``d / k``: use it with ``residual`` memory, as Stich et al. do.
    """

    communicator = "allreduce"
    payload_shapes_fixed = True

    def __init__(self, ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__()
        self.ratio = check_ratio("ratio", ratio)
        self.seed = check_seed(seed, optional=False)

    def indices(self, info: TensorInfo, step: int) -> Tensor:
        """The indices every worker uses for ``info.name`` at ``step`` (int64, CPU)."""
        gen = torch.Generator().manual_seed(stable_seed("randk", self.seed, info.name, step))
        return sample_without_replacement(info.numel, k_of(info.numel, self.ratio), gen)

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        step = self._state.get(info.name, 0)
        self._state[info.name] = step + 1
        indices = self.indices(info, step).to(flat.device)
        return [flat.index_select(0, indices)], Context(info, (indices,))

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        return _place(payload[0], ctx.extra[0], ctx.info.numel)

    def sparse(self, payload: Sequence[Tensor], ctx: Context) -> tuple[Tensor, Tensor]:
        return ctx.extra[0], payload[0]

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return k_of(numel_of(shape), self.ratio) * dtype.itemsize
