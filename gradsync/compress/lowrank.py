"""PowerSGD (Vogels et al. 2019): rank-r low-rank compression that still sums by allreduce, in two rounds.

A tensor is viewed as a matrix ``M`` (``shape[0]`` rows, the rest as columns). With a warm-started ``Q``
(persistent per tensor), one power iteration is: ``P = M Q``, allreduce ``P``, orthonormalise ``P``,
``Q = M^T P``, allreduce ``Q``, and the update is ``P Q^T`` (Vogels et al. Algorithm 1). Because ``P`` is
shared after the first round, each worker's contribution ``P Q_w^T`` is linear in ``M_w``: the sum of the
``Q_w`` is exact and error feedback (``residual`` memory) sees ``M_w - P Q_w^T``. See
:class:`~gradsync.compress.base.TwoRoundCompressor` for the communicator's sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradsync.compress.base import (
    CompressionError,
    Context,
    TensorInfo,
    TwoRoundCompressor,
    as_buffer,
    cast,
    check_int,
    check_matches,
    check_seed,
    numel_of,
    register_compressor,
    shares_memory,
    stable_seed,
    work_dtype,
)

__all__ = ["PowerSGD", "gram_schmidt", "orthonormalize", "outer_into", "times", "transposed_times"]


def orthonormalize(p: Tensor) -> Tensor:
    """Orthonormal columns spanning ``p``'s.

    One column (rank 1, the common case) is divided by its norm. More columns: Householder QR on the CPU;
    elsewhere Gram-Schmidt, as PyTorch's PowerSGD hook does, because a GPU's QR is a solver call per matrix
    that also copies its status to the host, a dozen launches and a synchronisation where Gram-Schmidt is a
    few passes over ``rows x r``. A zero column stays zero (its norm is floored at the dtype's tiny), where
    dividing by zero would turn a zero gradient into NaN.
    """
    if p.shape[1] == 1:
        return p / torch.linalg.vector_norm(p).clamp_min(torch.finfo(p.dtype).tiny)
    if p.device.type == "cpu":
        return torch.linalg.qr(p, mode="reduced").Q
    return gram_schmidt(p)


def gram_schmidt(p: Tensor) -> Tensor:
    """Orthonormal columns spanning ``p``'s by modified Gram-Schmidt (a new tensor; zero columns stay zero)."""
    q = p.clone()
    tiny = torch.finfo(p.dtype).tiny
    for i in range(q.shape[1]):
        col = q[:, i : i + 1]
        if i:
            done = q[:, :i]
            col.sub_(done @ (done.T @ col))
        col.div_(torch.linalg.vector_norm(col).clamp_min(tiny))
    return q


def times(m: Tensor, q: Tensor) -> Tensor:
    """``m @ q`` for a thin ``q`` (PowerSGD's r columns), contiguous.

    With 2-8 columns a single-core BLAS runs ``m @ q`` well below memory speed. The same product with ``q``'s
    columns laid out as contiguous rows was the fastest layout measured at ranks 2-8 on 256x4096 and 1024x3136
    (with ``m`` in and out of cache, also against ``(q^T m^T)^T``); at 16 columns plain ``m @ q`` was
    somewhat faster. One column is a matrix-vector product either way.
    """
    if q.shape[1] == 1:
        return m @ q
    return m @ q.T.contiguous().T


#: Products ``P Q^T`` with this many elements or more, at rank 2, are written as broadcast passes
#: (:func:`outer_into`).
BROADCAST_MIN_ELEMENTS = 1 << 18


def outer_into(p: Tensor, qt: Tensor, out: Tensor, *, subtract: bool = False) -> Tensor:
    """``out = p @ qt`` (or ``out -= p @ qt`` with ``subtract``) for a thin ``p`` (rows x r) and ``qt`` (r x cols).

    At rank 2 a single-core BLAS writes a large ``p @ qt`` well below memory speed (``addmm_`` too), while
    two broadcast passes (``p[:, 0] qt[0]``, then ``addcmul_`` of the second column) are faster either way;
    at ranks 1, 4 and 8, and on small matrices, the gemm was as fast or faster, so it stays there. The passes round after
    each column, the gemm once per element: they differ by one rounding of the first column's term.
    """
    r = p.shape[1]
    if r != 2 or out.numel() < BROADCAST_MIN_ELEMENTS:
        if subtract:  # fused: no product buffer and one pass fewer (a BLAS may round the fused form differently)
            return out.addmm_(p, qt, alpha=-1)
        return torch.mm(p, qt, out=out)
    qt = qt.contiguous()  # rows of Q^T: each pass reads one contiguous row
    if subtract:
        return out.addcmul_(p[:, :1], qt[:1], value=-1).addcmul_(p[:, 1:], qt[1:], value=-1)
    return torch.mul(p[:, :1], qt[:1], out=out).addcmul_(p[:, 1:], qt[1:])


def transposed_times(m: Tensor, p: Tensor) -> Tensor:
    """``m^T @ p`` as ``(p^T m)^T``, contiguous: the transposed gemm is several times slower with 2-8 columns
    on one core."""
    return (p.T @ m).T.contiguous()


def _is_one(divide_by: int | Tensor) -> bool:
    """``divide_by == 1`` for a number; False for a tensor (never read on the host: dividing by it is one pass)."""
    return not isinstance(divide_by, Tensor) and divide_by == 1


@register_compressor("powersgd")
class PowerSGD(TwoRoundCompressor):
    """Rank-``rank`` PowerSGD with one power iteration per step and a warm-started Q per tensor.

    Tensors with fewer than 2 dimensions, or whose matrix would shrink by less than
    ``min_compression_rate`` (``rows * cols / ((rows + cols) * r)``, as PyTorch's PowerSGD hook does), are
    sent uncompressed in one round. ``seed`` draws the first Q: every worker must use the same seed.
    Payload: ``[P, Q]`` in the tensor's dtype (one round) or ``[Q_w]`` after the shared P (two rounds).
    """

    payload_shapes_fixed = True
    merges_flat = False

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, seed: int = 0) -> None:
        super().__init__()
        self.rank = check_int("rank", rank, 1, "rank of the low-rank approximation")
        if (
            isinstance(min_compression_rate, bool)
            or not isinstance(min_compression_rate, (int, float))
            or not (min_compression_rate >= 0)
        ):
            raise CompressionError(
                f"min_compression_rate={min_compression_rate!r} must be >= 0 (dense/low-rank size below which a "
                "tensor is sent uncompressed; 0 compresses every matrix)"
            )
        self.min_compression_rate = float(min_compression_rate)
        self.seed = check_seed(seed, optional=False)

    def warm_start(self, name: str) -> Tensor | None:
        """The Q the next power iteration for ``name`` starts from (None before its first step)."""
        return self._state.get(name)

    # -- shape plan ---------------------------------------------------------------------------------------

    def matrix_plan(self, shape: int | Sequence[int]) -> tuple[int, int, int] | None:
        """``(rows, cols, effective rank)`` when the tensor is compressed, None when it is sent dense."""
        if isinstance(shape, int) or len(shape) < 2:
            return None
        rows = int(shape[0])
        cols = numel_of(shape) // rows if rows else 0
        r = min(self.rank, rows, cols)
        if r < 1 or rows * cols < self.min_compression_rate * (rows + cols) * r:
            return None
        return rows, cols, r

    def sends_exactly(self, info: TensorInfo) -> bool:
        return self.matrix_plan(info.shape) is None

    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        plan = self.matrix_plan(shape)
        if plan is None:
            return numel_of(shape) * dtype.itemsize
        rows, cols, r = plan
        return (rows + cols) * r * dtype.itemsize

    # -- one round (single worker, or allgather) -------------------------------------------------------------

    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        plan = self.matrix_plan(info.shape)
        if plan is None:
            return [flat], Context(info)
        m = self._matrix(flat, info, plan)
        p = orthonormalize(times(m, self._warm_q(info, plan, m)))
        q = transposed_times(m, p)
        self._state[info.name] = q
        return [p.to(info.dtype), q.to(info.dtype)], Context(info)

    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor:
        if self.matrix_plan(ctx.info.shape) is None:
            return payload[0]
        dtype = work_dtype(ctx.info.dtype)
        p, q = (ctx.extra[0], payload[0]) if ctx.extra else (payload[0], payload[1])
        return (p.to(dtype) @ q.to(dtype).T).reshape(-1)

    # -- two rounds (allreduce) -------------------------------------------------------------------------------

    def first_round(self, tensor: Tensor, info: TensorInfo) -> Tensor | None:
        """``P_w = M_w Q`` to be summed, or None for a tensor sent dense."""
        check_matches(tensor, info)
        plan = self.matrix_plan(info.shape)
        if plan is None:
            return None
        m = self._matrix(tensor.detach().reshape(-1), info, plan)
        return times(m, self._warm_q(info, plan, m)).to(info.dtype)

    def second_round(self, tensor: Tensor, info: TensorInfo, first_sum: Tensor | None) -> tuple[list[Tensor], Context]:
        """``[Q_w = M_w^T P]`` with ``P`` the orthonormalised sum; the ctx keeps ``P`` (identical everywhere)."""
        check_matches(tensor, info)
        plan = self.matrix_plan(info.shape)
        flat = tensor.detach().reshape(-1)
        if plan is None:
            return [flat], Context(info)
        if first_sum is None:
            raise CompressionError(f"PowerSGD compresses {info.name!r} {info.shape}: second_round needs the summed P")
        m = self._matrix(flat, info, plan)
        p = orthonormalize(first_sum.to(m.dtype))
        return [transposed_times(m, p).to(info.dtype)], Context(info, (p,))

    def finish(self, payload_sum: Sequence[Tensor], ctx: Context, out: Tensor | None = None, *,
               divide_by: int | Tensor = 1) -> Tensor:
        """``P (sum_w Q_w)^T / divide_by`` (into ``out`` when it fits: the same product, no new tensor); the
        summed Q warm-starts the next step (its scale is irrelevant: P is orthonormalised). The division is
        applied to the thin ``Q`` (``cols x r``), not to the ``rows x cols`` product: one pass over the matrix
        saved."""
        plan = self.matrix_plan(ctx.info.shape)
        if plan is None or not ctx.extra:  # sent dense (or a one-round [P, Q] payload)
            result = self.decompress(payload_sum, ctx)
            return result if _is_one(divide_by) else result / divide_by
        dtype = work_dtype(ctx.info.dtype)
        q = payload_sum[0].to(dtype)
        self._state[ctx.info.name] = q
        qt = (q if _is_one(divide_by) else q / divide_by).T.contiguous()  # rows of Q^T: the faster gemm layout
        p = ctx.extra[0].to(dtype)
        rows, cols, _ = plan
        buf = as_buffer(out, rows * cols, dtype) if ctx.info.dtype == dtype else None
        if buf is None:
            return cast((p @ qt).reshape(ctx.info.shape), ctx.info.dtype)
        return outer_into(p, qt, buf.view(rows, cols)).view(ctx.info.shape)

    def subtract_decoded(self, tensor: Tensor, payload: Sequence[Tensor], ctx: Context, *, inplace: bool = False) -> Tensor:
        """``M - P Q^T`` in ``M``'s own buffer by ``addmm_`` (no product tensor; several times faster than the
        product then the subtraction), or at rank 2 on a large matrix by two broadcast passes (:func:`outer_into`).
        Either is within a rounding of ``M - decompress``: whether a BLAS fuses the multiply-add decides the
        last bit, which error feedback (a rank's own state) does not need to match."""
        plan = self.matrix_plan(ctx.info.shape)
        dtype = work_dtype(ctx.info.dtype)
        if (plan is None or not inplace or tensor.dtype != dtype or not tensor.is_contiguous()
                or shares_memory(tensor, payload)):
            return super().subtract_decoded(tensor, payload, ctx, inplace=inplace)
        rows, cols, _ = plan
        p, q = (ctx.extra[0], payload[0]) if ctx.extra else (payload[0], payload[1])
        # M + (-1) P Q^T in one pass: the product of the same gemm, subtracted as it is written
        return outer_into(p.to(dtype), q.to(dtype).T, tensor.view(rows, cols), subtract=True).view(tensor.shape)

    # -- helpers ----------------------------------------------------------------------------------------------

    def _matrix(self, flat: Tensor, info: TensorInfo, plan: tuple[int, int, int]) -> Tensor:
        rows, cols, _ = plan
        return flat.to(work_dtype(info.dtype)).reshape(rows, cols)

    def _warm_q(self, info: TensorInfo, plan: tuple[int, int, int], m: Tensor) -> Tensor:
        _, cols, r = plan
        q = self._state.get(info.name)
        if q is None or q.shape != (cols, r):
            gen = torch.Generator().manual_seed(stable_seed("powersgd", self.seed, info.name))
            q = torch.randn(cols, r, generator=gen, dtype=m.dtype)  # host: once per tensor, the same on every rank
        return q.to(device=m.device, dtype=m.dtype)
