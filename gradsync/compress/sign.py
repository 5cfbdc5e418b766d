"""1-bit quantizers (MergeComp §2.1): ``signsgd``, ``signum``, ``efsignsgd``, ``onebit``.

Each sends one packed bit per element (``ceil(d / 8)`` bytes) plus at most two float32 scalars, and goes by
allgather (MergeComp Table 1). A bit says ``x_i >= 0``, so an exact zero travels as ``+``. SignSGD and
SigNUM aggregate by majority vote (the sign of the sum of signs) and are not averaged; EFSignSGD and
OneBit carry magnitudes, are averaged, and are meant to run with ``residual`` memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradsync.compress import kernels
from gradsync.compress.base import (
    Compressor,
    Context,
    TensorInfo,
    as_buffer,
    cast,
    check_unit_interval,
    numel_of,
    register_compressor,
    shares_memory,
    work_dtype,
)
from gradsync.compress.packing import pack_nonnegative, packed_nbytes, unpack_bits

__all__ = ["SignSGD", "SigNUM", "EFSignSGD", "OneBit", "majority_vote"]

_SCALE_DTYPE = torch.float32


def majority_vote(signs: Sequence[Tensor]) -> Tensor:
    """Bernstein et al. 2018's aggregation: the sign of the sum of ±1 votes (0 on a tie)."""
    return torch.sign(torch.stack(list(signs)).sum(dim=0))


def _signs(bits: Tensor, dtype: torch.dtype) -> Tensor:
    """±1 from bits: on CPU in place after the one conversion (``bits * 2 - 1`` would make three tensors); on a
    device one ``where`` pass (a bool ``where`` is slow on CPU only)."""
    if bits.device.type == "cpu":
        return bits.to(dtype).mul_(2).sub_(1)
    signs = torch.where(bits.view(torch.bool), 1.0, -1.0)
    return signs if signs.dtype == dtype else signs.to(dtype)


class _SignOnly(Compressor):
    """Payload ``[packed signs]``; decompresses to ±1 and aggregates by majority vote."""

    communicator = "allgather"
    payload_shapes_fixed = True
    average = False

    def _send(self, x: Tensor, info: TensorInfo) -> Tensor:
        return x

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        return [pack_nonnegative(self._send(flat, info))], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        dtype = work_dtype(ctx.info.dtype)
        fused = kernels.select_by_bits(payload[0], ctx.info.numel, dtype)
        return fused if fused is not None else _signs(unpack_bits(payload[0], ctx.info.numel), dtype)

    def aggregate(self, tensors: Sequence[Tensor]) -> Tensor:
        return majority_vote(tensors)

    def combine(self, payloads: Sequence[Sequence[Tensor]], ctx: Context, out: Tensor | None = None) -> Tensor:
        """The majority vote straight from the packed bits: with ``c`` workers voting ``+`` out of ``W``, the sum
        of the ±1 votes is ``2c - W`` (an integer, exact in floating point), so count the set bits in bytes."""
        info, world = ctx.info, len(payloads)
        counts = torch.zeros(info.numel, dtype=torch.uint8 if world < 256 else torch.int32,
                             device=payloads[0][0].device)
        for payload in payloads:
            counts.add_(unpack_bits(payload[0], info.numel).view(torch.uint8))
        dtype = work_dtype(info.dtype)
        votes = as_buffer(out, info.numel, dtype)
        votes = counts.to(dtype) if votes is None else votes.copy_(counts)
        return cast(votes.mul_(2).sub_(world).sign_().reshape(info.shape), info.dtype)

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return packed_nbytes(numel_of(shape), 1)


@register_compressor("signsgd")
class SignSGD(_SignOnly):
    """signSGD with majority vote (Bernstein et al. 2018a): one bit per element, no scale."""


@register_compressor("signum")
class SigNUM(_SignOnly):
    """SIGNUM (Bernstein et al. 2018b): ``m <- beta m + (1 - beta) g`` per tensor, then send ``sign(m)``.

    The momentum is this worker's state, keyed by ``info.name``, updated once per ``compress`` call.
    """

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = check_unit_interval("momentum", momentum, "SIGNUM's beta")

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        x = flat.to(work_dtype(info.dtype))
        previous = self._state.get(info.name)
        fused = kernels.signum_step(x, previous if previous is not None and previous.shape == x.shape else None,
                                    self.momentum)
        if fused is None:
            return super()._compress(flat, info)
        self._state[info.name] = fused[0]  # a new tensor: the step's rollback keeps the old one
        return [fused[1]], Context(info)

    def _send(self, x: Tensor, info: TensorInfo) -> Tensor:
        x = x.to(work_dtype(info.dtype))
        previous = self._state.get(info.name)
        if previous is None or previous.shape != x.shape:
            previous = torch.zeros_like(x)
        m = previous * self.momentum + x * (1 - self.momentum)
        self._state[info.name] = m
        return m


@register_compressor("efsignsgd", aliases=("ef-signsgd",))
class EFSignSGD(Compressor):
    """EF-SignSGD (Karimireddy et al. 2019): ``(||x||_1 / d) * sign(x)``; the residual memory fixes signSGD.

    Payload: packed signs and the float32 scale ``mean|x|``.
    """

    communicator = "allgather"
    payload_shapes_fixed = True

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        x = flat.to(work_dtype(info.dtype))
        fused = kernels.sign_stats(x, "mean_abs")
        if fused is not None:  # the bits and mean|x| in one read
            return [fused[1], fused[0]], Context(info)
        if x.numel():  # |x| dies here: into a reused buffer
            scale = torch.abs(x, out=self._workspace("magnitude", x.numel(), x.dtype, x.device)).mean()
        else:
            scale = x.new_zeros(())
        return [scale.reshape(1).to(_SCALE_DTYPE), pack_nonnegative(x)], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        return self._decode(payload, ctx)

    def _decode(self, payload: Sequence[Tensor], ctx: Context, out: Tensor | None = None) -> Tensor:
        """``±scale`` by the sign bits, in the work dtype, into ``out`` when given.

        As ``b * 2s - s`` for ``b`` in {0, 1}: ``2s`` is exact and so is ``2s - s = s`` (Sterbenz), so these
        are the same bits as ``(2b - 1) * s`` in three cheap passes (a ``where`` on bool is much slower on CPU).
        That form needs ``s`` on the host to rule out an overflow of ``2s``; on another device one ``where``
        picks ``±s`` (exactly) in one pass, with no synchronisation with the host.
        """
        scale, packed = payload
        dtype, numel = work_dtype(ctx.info.dtype), ctx.info.numel
        fused = kernels.select_by_bits(packed, numel, dtype, out=out, values=scale, negate=True)
        if fused is not None:
            return fused
        if out is None:
            out = torch.empty(numel, dtype=dtype, device=packed.device)
        bits = unpack_bits(packed, numel).view(torch.uint8)
        s = float(scale.reshape(())) if scale.device.type == "cpu" else math.inf
        if not abs(2 * s) <= torch.finfo(dtype).max:  # 2s would overflow, s is not finite, or not on the host
            s_dev = scale.to(dtype).reshape(())
            return torch.where(bits.view(torch.bool), s_dev, s_dev.neg(), out=out)  # ±s exactly, one pass
        return out.copy_(bits).mul_(2 * s).sub_(s)

    def combine(self, payloads: Sequence[Sequence[Tensor]], ctx: Context, out: Tensor | None = None) -> Tensor:
        """The sum of the decoded payloads, in order: the first decoded into ``out`` (or a new tensor), each
        other into one reused buffer and added."""
        info = ctx.info
        if info.dtype != work_dtype(info.dtype):  # the decoded values are rounded to fp16/bf16 before the sum
            return super().combine(payloads, ctx)
        out = self._decode(payloads[0], ctx, as_buffer(out, info.numel, info.dtype))
        if len(payloads) > 1:
            scratch = self._workspace("decoded", info.numel, out.dtype, out.device)
            for payload in payloads[1:]:
                out.add_(self._decode(payload, ctx, scratch))
        return out.reshape(info.shape)

    def subtract_decoded(self, tensor: Tensor, payload: Sequence[Tensor], ctx: Context, *, inplace: bool = False) -> Tensor:
        if not (inplace and tensor.is_contiguous() and tensor.dtype == work_dtype(ctx.info.dtype)
                and not shares_memory(tensor, payload)):
            return super().subtract_decoded(tensor, payload, ctx, inplace=inplace)
        decoded = self._decode(payload, ctx, self._workspace("decoded", ctx.info.numel, tensor.dtype, tensor.device))
        return tensor.view(-1).sub_(decoded).view(tensor.shape)

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return _SCALE_DTYPE.itemsize + packed_nbytes(numel_of(shape), 1)


@register_compressor("onebit", aliases=("1bit",))
class OneBit(Compressor):
    """1-bit SGD (Seide et al. 2014): threshold at 0, reconstruct each side by its mean.

    Payload: packed bits ``x >= 0`` and float32 ``[mean of x >= 0, mean of x < 0]`` (0 for an empty side).
    Seide et al. rely on error feedback: run it with ``residual`` memory.
    """

    communicator = "allgather"
    payload_shapes_fixed = True

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        x = flat.to(work_dtype(info.dtype))
        fused = kernels.sign_stats(x, "side_means")
        if fused is not None:  # the bits and both sides' means in one read
            return [fused[1], fused[0]], Context(info)
        positive = x >= 0
        n_pos = positive.sum()
        n_neg = x.numel() - n_pos
        # each side's sum without a zeros tensor: clamping at 0 moves the other side's elements to (+-)0, which
        # adds nothing (a NaN stays NaN, as in a masked sum)
        sum_pos = x.clamp(min=0).sum()
        sum_neg = x.clamp(max=0).sum()
        means = torch.stack([sum_pos / n_pos.clamp(min=1), sum_neg / n_neg.clamp(min=1)])
        return [means.to(_SCALE_DTYPE), pack_nonnegative(x)], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        means, packed = payload
        dtype = work_dtype(ctx.info.dtype)
        fused = kernels.select_by_bits(packed, ctx.info.numel, dtype, values=means)
        if fused is not None:
            return fused
        means = means.to(dtype)
        return torch.where(unpack_bits(packed, ctx.info.numel), means[0], means[1])

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return 2 * _SCALE_DTYPE.itemsize + packed_nbytes(numel_of(shape), 1)
