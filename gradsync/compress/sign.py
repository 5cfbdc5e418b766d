"""1-bit quantizers (seed 004 §2.1): ``signsgd``, ``signum``, ``efsignsgd``, ``onebit``.

Each sends one packed bit per element (``ceil(d / 8)`` bytes) plus at most two float32 scalars, and goes by
allgather (seed 004 Table 1). A bit says ``x_i >= 0``, so an exact zero travels as ``+``. SignSGD and
SigNUM aggregate by majority vote (the sign of the sum of signs) and are not averaged; EFSignSGD and
OneBit carry magnitudes, are averaged, and are meant to run with ``residual`` memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradsync.compress.base import (
    Compressor,
    Context,
    TensorInfo,
    check_unit_interval,
    numel_of,
    register_compressor,
    work_dtype,
)
from gradsync.compress.packing import pack_bits, pack_nonnegative, packed_nbytes, unpack_bits

__all__ = ["SignSGD", "SigNUM", "EFSignSGD", "OneBit", "majority_vote"]

_SCALE_DTYPE = torch.float32


def majority_vote(signs: Sequence[Tensor]) -> Tensor:
    """Bernstein et al. 2018's aggregation: the sign of the sum of ±1 votes (0 on a tie)."""
    return torch.sign(torch.stack(list(signs)).sum(dim=0))


def _signs(bits: Tensor, dtype: torch.dtype) -> Tensor:
    """±1 from bits, in place after the one conversion (``bits * 2 - 1`` would make three tensors)."""
    return bits.to(dtype).mul_(2).sub_(1)


class _SignOnly(Compressor):
    """Payload ``[packed signs]``; decompresses to ±1 and aggregates by majority vote."""

    communicator = "allgather"
    average = False

    def _send(self, x: Tensor, info: TensorInfo) -> Tensor:
        return x

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        return [pack_nonnegative(self._send(flat, info))], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        return _signs(unpack_bits(payload[0], ctx.info.numel), work_dtype(ctx.info.dtype))

    def aggregate(self, tensors: Sequence[Tensor]) -> Tensor:
        return majority_vote(tensors)

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return packed_nbytes(numel_of(shape), 1)


@register_compressor("signsgd")
class SignSGD(_SignOnly):
    """signSGD with majority vote (Bernstein et al. 2018a): one bit per element, no scale."""

    def __init__(self) -> None:
        super().__init__()


@register_compressor("signum")
class SigNUM(_SignOnly):
    """SIGNUM (Bernstein et al. 2018b): ``m <- beta m + (1 - beta) g`` per tensor, then send ``sign(m)``.

    The momentum is this worker's state, keyed by ``info.name``, updated once per ``compress`` call.
    """

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = check_unit_interval("momentum", momentum, "SIGNUM's beta")

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

    def __init__(self) -> None:
        super().__init__()

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        x = flat.to(work_dtype(info.dtype))
        scale = x.abs().mean() if x.numel() else x.new_zeros(())
        return [scale.reshape(1).to(_SCALE_DTYPE), pack_nonnegative(x)], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        scale, packed = payload
        dtype = work_dtype(ctx.info.dtype)
        return _signs(unpack_bits(packed, ctx.info.numel), dtype).mul_(scale.to(dtype))

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return _SCALE_DTYPE.itemsize + packed_nbytes(numel_of(shape), 1)


@register_compressor("onebit", aliases=("1bit",))
class OneBit(Compressor):
    """1-bit SGD (Seide et al. 2014): threshold at 0, reconstruct each side by its mean.

    Payload: packed bits ``x >= 0`` and float32 ``[mean of x >= 0, mean of x < 0]`` (0 for an empty side).
    Seide et al. rely on error feedback: run it with ``residual`` memory.
    """

    communicator = "allgather"

    def __init__(self) -> None:
        super().__init__()

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        x = flat.to(work_dtype(info.dtype))
        positive = x >= 0
        n_pos = positive.sum()
        n_neg = x.numel() - n_pos
        zero = torch.zeros_like(x)
        sum_pos = torch.where(positive, x, zero).sum()
        sum_neg = torch.where(positive, zero, x).sum()
        means = torch.stack([sum_pos / n_pos.clamp(min=1), sum_neg / n_neg.clamp(min=1)])
        return [means.to(_SCALE_DTYPE), pack_bits(positive)], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        means, packed = payload
        means = means.to(work_dtype(ctx.info.dtype))
        return torch.where(unpack_bits(packed, ctx.info.numel), means[0], means[1])

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        return 2 * _SCALE_DTYPE.itemsize + packed_nbytes(numel_of(shape), 1)
