"""Limited-bit and codebook quantizers (seed 004 §2.1): ``none``, ``fp16``, ``qsgd``, ``terngrad``.

``none`` and ``fp16`` are dense and summable, so they go by allreduce (seed 004 Table 1); QSGD and TernGrad
send packed codes plus a scale, which do not sum, so they go by allgather.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradsync.compress.base import (
    CompressionError,
    Compressor,
    Context,
    TensorInfo,
    check_int,
    check_seed,
    numel_of,
    register_compressor,
    work_dtype,
)
from gradsync.compress.packing import pack_uint, packed_nbytes, unpack_uint

__all__ = ["NoCompression", "FP16", "QSGD", "TernGrad"]

_SCALE_DTYPE = torch.float32  # norms and scales travel as float32 whatever the gradient's dtype


@register_compressor("none", aliases=("fp32", "identity"))
class NoCompression(Compressor):
    """Send the tensor as is: the FP32 baseline every scaling factor in seed 004 is measured against."""

    communicator = "allreduce"

    def __init__(self) -> None:
        super().__init__()

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        return [flat], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        return payload[0]

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return numel_of(shape) * dtype.itemsize


@register_compressor("fp16")
class FP16(Compressor):
    """Half precision on the wire, still summable by allreduce (seed 004 Table 1, Horovod's fp16 option)."""

    communicator = "allreduce"

    def __init__(self) -> None:
        super().__init__()

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        return [flat.to(torch.float16)], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        return payload[0]

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return numel_of(shape) * torch.float16.itemsize


@register_compressor("qsgd")
class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): unbiased stochastic rounding of ``|x| / ||x||`` to ``levels`` levels.

    Element ``i`` becomes ``||x|| * sign(x_i) * l_i / s`` with ``l_i = floor(s |x_i| / ||x|| + u)``, so
    ``E[l_i] = s |x_i| / ||x||``. Each element costs ``ceil(log2(s + 1)) + 1`` bits (level and sign, packed),
    plus one float32 norm per bucket. The default ``levels=127`` is seed 004's "8 bits per element".
    ``bucket_size`` (QSGD §3's buckets, default 128 as in QSGD's experiments and GRACE) bounds the variance:
    one norm over a whole tensor -- worse, over a MergeComp group of many tensors -- makes every element's
    level tiny (relative error 2.3 at 1e6 elements against 0.036 with buckets of 128) to save 3% of bytes.
    Buckets run over the flat (merged) buffer, so a merged group keeps a norm per 128 elements.
    ``bucket_size=None`` is one bucket per tensor (QSGD's plain form).
    """

    communicator = "allgather"
    #: Codes wider than this (level and sign) would not send fewer bits than float32 values.
    MAX_BITS = 31

    def __init__(self, levels: int = 127, bucket_size: int | None = 128, seed: int | None = None) -> None:
        super().__init__()
        self.levels = check_int("levels", levels, 1, "quantization levels s")
        self.bits = self.levels.bit_length() + 1  # ceil(log2(s + 1)) bits of level, one of sign
        if self.bits > self.MAX_BITS:
            raise CompressionError(
                f"levels={levels!r} needs {self.bits} bits per element (level and sign), no fewer than a float32 "
                f"value: nothing is saved; use levels < 2**{self.MAX_BITS - 1} (127 for 8 bits, 7 for 4 bits)"
            )
        self.bucket_size = (
            None if bucket_size is None else check_int("bucket_size", bucket_size, 1, "elements per norm")
        )
        self.seed = check_seed(seed, optional=True)

    def _buckets(self, numel: int) -> tuple[int, int]:
        size = self.bucket_size or max(numel, 1)
        return size, math.ceil(numel / size)

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        x = flat.to(work_dtype(info.dtype))
        size, count = self._buckets(x.numel())
        rows = torch.nn.functional.pad(x, (0, size * count - x.numel())).view(count, size)
        norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
        scaled = rows.abs() * self.levels / torch.where(norms > 0, norms, torch.ones_like(norms))
        noise = torch.rand(scaled.shape, generator=self._generator(x.device, self.seed), device=x.device, dtype=x.dtype)
        level = torch.floor(scaled + noise).clamp_(max=self.levels)
        # level and sign in one code, built in float and converted once, to a byte where it fits
        code = (level.mul_(2) + (rows < 0)).reshape(-1)[: x.numel()]
        codes = code.to(torch.uint8 if self.bits <= 8 else torch.int64)
        packed = codes if self.bits == 8 else pack_uint(codes, self.bits)
        return [norms.reshape(-1).to(_SCALE_DTYPE), packed], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        norms, packed = payload
        numel = ctx.info.numel
        codes = packed[:numel] if self.bits == 8 else unpack_uint(packed, self.bits, numel)
        size, count = self._buckets(numel)
        dtype = work_dtype(ctx.info.dtype)
        mag = (codes >> 1).to(dtype)
        mag = torch.nn.functional.pad(mag, (0, size * count - numel)).view(count, size)
        out = (mag * (norms.to(dtype) / self.levels).unsqueeze(1)).reshape(-1)[:numel]
        return torch.where((codes & 1).bool(), -out, out)

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        numel = numel_of(shape)
        _, count = self._buckets(numel)
        return count * _SCALE_DTYPE.itemsize + packed_nbytes(numel, self.bits)


@register_compressor("terngrad")
class TernGrad(Compressor):
    """TernGrad (Wen et al. 2017): ``max|x| * sign(x_i) * b_i`` with ``b_i ~ Bernoulli(|x_i| / max|x|)``.

    The three values {-1, 0, +1} take 2 bits per element, packed, plus one float32 scale. ``clip`` (default
    2.5, TernGrad §3.3 and GRACE) first clamps ``x`` to ``±clip·σ`` (σ: the standard deviation of the tensor's
    elements): a few outliers set ``max|x|``, and without clipping every other element is sent as 0 or ±that
    outlier (1.8-6x the error). Clipping biases the outliers (it is the paper's trade); the estimate is unbiased
    for the clipped tensor. ``clip=None`` turns it off (an unbiased estimate of ``x`` itself).
    """

    communicator = "allgather"
    _BITS = 2  # codes: 0 -> 0, 1 -> +scale, 2 -> -scale

    def __init__(self, clip: float | None = 2.5, seed: int | None = None) -> None:
        super().__init__()
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not math.isfinite(clip) or clip <= 0):
            raise CompressionError(f"clip={clip!r} must be a positive number of standard deviations (TernGrad: 2.5) "
                                   f"or None for no clipping")
        self.clip = None if clip is None else float(clip)
        self.seed = check_seed(seed, optional=True)

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        x = flat.to(work_dtype(info.dtype))
        if self.clip is not None and x.numel() > 1:
            bound = self.clip * torch.std(x, correction=0)
            x = torch.maximum(torch.minimum(x, bound), -bound)
        scale = x.abs().max() if x.numel() else x.new_zeros(())
        prob = x.abs() / torch.where(scale > 0, scale, torch.ones_like(scale))
        noise = torch.rand(x.shape, generator=self._generator(x.device, self.seed), device=x.device, dtype=x.dtype)
        codes = (noise < prob).to(torch.uint8) << (x < 0).to(torch.uint8)  # 0, 1 (+) or 2 (-)
        return [scale.reshape(1).to(_SCALE_DTYPE), pack_uint(codes, self._BITS)], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        scale, packed = payload
        codes = unpack_uint(packed, self._BITS, ctx.info.numel)
        dtype = work_dtype(ctx.info.dtype)
        ternary = (codes == 1).to(dtype) - (codes == 2).to(dtype)
        return ternary * scale.to(dtype)

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return _SCALE_DTYPE.itemsize + packed_nbytes(numel_of(shape), self._BITS)
