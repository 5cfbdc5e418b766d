"""Limited-bit and codebook quantizers (MergeComp §2.1): ``none``, ``fp16``, ``bf16``, ``qsgd``, ``terngrad``.

``none`` and ``fp16`` are dense and summable, so they go by allreduce (MergeComp Table 1); QSGD and TernGrad
send packed codes plus a scale, which do not sum, so they go by allgather.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradsync.compress import kernels
from gradsync.compress.base import (
    CompressionError,
    Compressor,
    Context,
    TensorInfo,
    cast,
    check_int,
    check_seed,
    numel_of,
    register_compressor,
    work_dtype,
)
from gradsync.compress.packing import less, pack_uint, packed_nbytes, unpack_fields, unpack_uint

__all__ = ["NoCompression", "FP16", "BF16", "QSGD", "TernGrad"]

_SCALE_DTYPE = torch.float32  # norms and scales travel as float32 whatever the gradient's dtype


@register_compressor("none", aliases=("fp32", "identity"))
class NoCompression(Compressor):
    """Send the tensor as is: the FP32 baseline every scaling factor in MergeComp is measured against."""

    communicator = "allreduce"
    payload_shapes_fixed = True

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        return [flat], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        return payload[0]

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return numel_of(shape) * dtype.itemsize


@register_compressor("fp16")
class FP16(Compressor):
    """Half precision on the wire, still summable by allreduce (MergeComp Table 1, Horovod's fp16 option)."""

    communicator = "allreduce"
    payload_shapes_fixed = True
    cast_dtype = torch.float16

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        return [cast(flat, self.cast_dtype)], Context(info)  # Tensor.half/bfloat16: less argument parsing than .to

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        return payload[0]

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return numel_of(shape) * self.cast_dtype.itemsize


@register_compressor("bf16")
class BF16(FP16):
    """bfloat16 on the wire (torch's ``bf16_compress_hook``): fp16's bytes with float32's range, so a large
    gradient never overflows to inf; 8 bits of mantissa against fp16's 11, so each value rounds more."""

    cast_dtype = torch.bfloat16


@register_compressor("qsgd")
class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): unbiased stochastic rounding of ``|x| / ||x||`` to ``levels`` levels.

    Element ``i`` becomes ``||x|| * sign(x_i) * l_i / s`` with ``l_i = floor(s |x_i| / ||x|| + u)``, so
    ``E[l_i] = s |x_i| / ||x||``. Each element costs ``ceil(log2(s + 1)) + 1`` bits (level and sign, packed),
    plus one float32 norm per bucket. The default ``levels=127`` is MergeComp's "8 bits per element".
    ``bucket_size`` (QSGD §3's buckets, default 128 as in QSGD's experiments and GRACE) bounds the variance:
    one norm over a whole tensor -- worse, over a MergeComp group of many tensors -- makes every element's
    level tiny (relative error 2.3 at 1e6 elements against 0.036 with buckets of 128) to save 3% of bytes.
    Buckets run over the flat (merged) buffer, so a merged group keeps a norm per 128 elements.
    ``bucket_size=None`` is one bucket per tensor (QSGD's plain form).
    """

    communicator = "allgather"
    payload_shapes_fixed = True
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
        numel = flat.numel()
        size, count = self._buckets(numel)
        if self.bits == 8 and info.dtype == torch.float32:
            fused = kernels.qsgd_encode(flat, self.levels, size, lambda: self._kernel_seed(self.seed))
            if fused is not None:
                return list(fused), Context(info)
        # ``rows``: a zero-padded copy in the work dtype, one pass
        rows = torch.empty(size * count, dtype=work_dtype(info.dtype), device=flat.device)
        rows[numel:].zero_()
        rows[:numel].copy_(flat)
        rows = rows.view(count, size)
        norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
        level = torch.rand(rows.shape, generator=self._generator(rows.device, self.seed), device=rows.device,
                           dtype=rows.dtype)
        # u + (|x| * s) / ||x||, in one pass and with the rounding of the two-step form
        level.addcdiv_(rows.abs(), torch.where(norms > 0, norms, torch.ones_like(norms)), value=self.levels)
        # floor(min(v, s)) = min(floor(v), s), and v >= 0 truncates to its floor: the integer conversion floors
        level.clamp_(max=self.levels)
        negative = less(rows, 0)  # 0/1 bytes
        if self.bits <= 8:  # level <= 127 fits int8; float -> int8 is faster than float -> uint8
            code = level.to(torch.int8).view(torch.uint8).bitwise_left_shift_(1).bitwise_or_(negative)
        else:
            code = level.to(torch.int64).bitwise_left_shift_(1).bitwise_or_(negative)
        code = code.reshape(-1)[:numel]
        packed = code if self.bits == 8 else pack_uint(code, self.bits)
        return [norms.reshape(-1).to(_SCALE_DTYPE), packed], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        return self._decode(payload, ctx)

    def _decode(self, payload: Sequence[Tensor], ctx: Context, padded: Tensor | None = None) -> Tensor:
        """The values, in the work dtype, in ``padded`` (``size * count`` elements) or a new buffer."""
        norms, packed = payload
        numel = ctx.info.numel
        codes = packed[:numel] if self.bits == 8 else unpack_uint(packed, self.bits, numel)
        size, count = self._buckets(numel)
        dtype = work_dtype(ctx.info.dtype)
        if self.bits == 8 and dtype == torch.float32:
            target = torch.empty(numel, dtype=dtype, device=codes.device) if padded is None else padded[:numel]
            fused = kernels.qsgd_decode(norms, codes, numel, self.levels, size, target)
            if fused is not None:
                return fused
        # |value| = level * (||x|| / s) per bucket, written into a padded buffer so the broadcast needs no copy
        buf = torch.empty(size * count, dtype=dtype, device=codes.device) if padded is None else padded
        buf[numel:].zero_()
        out = buf[:numel]
        out.copy_(codes >> 1)
        # a divisor tensor: CUDA divides by a host number through its reciprocal (a second rounding), the CPU
        # divides; by a tensor both divide, so every device (and the fused kernel) gets the same bits
        step = norms.to(dtype) / torch.full_like(norms, self.levels, dtype=dtype)
        buf.view(count, size).mul_(step.unsqueeze(1))
        # the sign: times -1 where the bit is set, exactly ``-v`` (zeros become -0.0 as negation makes them),
        # by an int8 factor (one byte per element where a sign-bit XOR needs a 4-8 byte integer tensor)
        negative = (codes & 1).view(torch.int8) if codes.dtype == torch.uint8 else (codes & 1).to(torch.int8)
        return out.mul_(negative.mul_(-2).add_(1))

    def combine(self, payloads: Sequence[Sequence[Tensor]], ctx: Context, out: Tensor | None = None) -> Tensor:
        """The sum of the decoded payloads in order: the first decoded into a new buffer, each other into one
        reused buffer and added (no W new d-element tensors)."""
        info = ctx.info
        dtype = work_dtype(info.dtype)
        if info.dtype != dtype:  # the decoded values are rounded to fp16/bf16 before the sum
            return super().combine(payloads, ctx)
        total = self._decode(payloads[0], ctx)
        if len(payloads) > 1:
            size, count = self._buckets(info.numel)
            scratch = self._workspace("decoded", size * count, dtype, total.device)
            for payload in payloads[1:]:
                total.add_(self._decode(payload, ctx, scratch))
        return total.reshape(info.shape)

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
    outlier (a larger error). Clipping biases the outliers (it is the paper's trade); the estimate is unbiased
    for the clipped tensor. ``clip=None`` turns it off (an unbiased estimate of ``x`` itself).
    """

    communicator = "allgather"
    payload_shapes_fixed = True
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
        fused = self._compress_fused(x)
        if fused is not None:
            return fused, Context(info)
        if self.clip is not None and x.numel() > 1:
            bound = self.clip * torch.std(x, correction=0)
            x = torch.clamp(x, -bound, bound)  # = max(min(x, b), -b) for b >= 0, in one pass
        if x.numel():
            low, high = torch.aminmax(x)  # max|x| in one pass, no |x| tensor
            scale = torch.maximum(-low, high)
        else:
            scale = x.new_zeros(())
        prob = x.abs().div_(torch.where(scale > 0, scale, torch.ones_like(scale)))
        noise = torch.rand(x.shape, generator=self._generator(x.device, self.seed), device=x.device, dtype=x.dtype)
        codes = less(noise, prob).bitwise_left_shift_(less(x, 0))  # 0, 1 (+) or 2 (-): keep << negative, bytes
        return [scale.reshape(1).to(_SCALE_DTYPE), pack_uint(codes, self._BITS)], Context(info)

    def _compress_fused(self, x: Tensor) -> list[Tensor] | None:
        """Two reads: σ and max|x| in one (``max|clip(x)| = min(max|x|, bound)``, clipping is monotone, so no
        clipped copy is made), then clipping, sampling and packing in the other."""
        clip = self.clip if x.numel() > 1 else None
        stats = kernels.sign_stats(x, "ternary", pack=False, clip=clip)
        if stats is None:
            return None
        _, scale, bound = stats
        packed = kernels.terngrad_encode(x, None if clip is None else bound, scale, lambda: self._kernel_seed(self.seed))
        return None if packed is None else [scale.reshape(1).to(_SCALE_DTYPE), packed]

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        scale, packed = payload
        fused = kernels.terngrad_decode(packed, scale, ctx.info.numel, work_dtype(ctx.info.dtype))
        if fused is not None:
            return fused
        codes = unpack_fields(packed, self._BITS, ctx.info.numel)
        # code c in {0, 1, 2} -> (c & 1) - (c >> 1) in {0, 1, -1}, on bytes; one conversion, one scaling
        ternary = (codes & 1).view(torch.int8).sub_((codes >> 1).view(torch.int8))
        dtype = work_dtype(ctx.info.dtype)
        return ternary.to(dtype).mul_(scale.to(dtype))

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return _SCALE_DTYPE.itemsize + packed_nbytes(numel_of(shape), self._BITS)
