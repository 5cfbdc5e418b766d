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
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradsync.compress.base import (
    CompressionError,
    Context,
    TensorInfo,
    TwoRoundBatch,
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
        # Q^T in rows, as a batch keeps it (no copy there; a thin one for a tensor's own Q): a BLAS picks its
        # kernel, and so its rounding, by the operands' layout (this one differed on an AMD EPYC, two threads)
        qt = qt.contiguous()
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
        #: (shape, rank, min_compression_rate) -> matrix_plan's answer: asked several times per tensor per step
        self._plans: dict[tuple[object, int, float], tuple[int, int, int] | None] = {}
        #: an exchange's tensors -> where each one's P and Q lie in the exchange's buffer (:meth:`batch`)
        self._layouts: dict[tuple[TensorInfo, ...], _Layout | None] = {}

    def warm_start(self, name: str) -> Tensor | None:
        """The Q the next power iteration for ``name`` starts from (None before its first step)."""
        return self._state.get(name)

    # -- shape plan ---------------------------------------------------------------------------------------

    def matrix_plan(self, shape: int | Sequence[int]) -> tuple[int, int, int] | None:
        """``(rows, cols, effective rank)`` when the tensor is compressed, None when it is sent dense."""
        key = (shape if isinstance(shape, (int, tuple)) else tuple(shape), self.rank, self.min_compression_rate)
        plan = self._plans.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = self._plan(shape)
        return plan  # type: ignore[return-value]

    def _plan(self, shape: int | Sequence[int]) -> tuple[int, int, int] | None:
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
        outer_into(cast(p, dtype), cast(q, dtype).T, tensor.view(rows, cols), subtract=True)
        return tensor

    # -- an exchange of several matrices ----------------------------------------------------------------------

    def batch(self, tensors: Sequence[Tensor], infos: Sequence[TensorInfo]) -> TwoRoundBatch:
        """Every P in one buffer and every Q in the next (views), as PyTorch's hook lays them out: each round's
        sum is one collective with nothing copied in or out, and the per-matrix normalisation and division are
        fused (:class:`_LowRankBatch`). The same results as the per-tensor methods. Matrices of one work dtype
        (float32 or float64) on one device; anything else takes the per-tensor methods."""
        layout = self._layout(infos)
        if layout is None:
            return super().batch(tensors, infos)
        device = tensors[0].device
        for x, info in zip(tensors, infos):
            if x.shape != info.shape or x.dtype != info.dtype or x.device != device:
                return super().batch(tensors, infos)  # whose first_round names the mismatch
        return _LowRankBatch(self, tensors, infos, layout)

    def _layout(self, infos: Sequence[TensorInfo]) -> _Layout | None:
        key = tuple(infos)
        if key in self._layouts:
            return self._layouts[key]
        plans = [self.matrix_plan(info.shape) for info in infos]
        dtype = infos[0].dtype if infos else None
        layout = None
        if (dtype is not None and work_dtype(dtype) == dtype and all(i.dtype == dtype for i in infos)
                and all(plan is not None for plan in plans)):
            layout = _Layout(dtype, plans)  # type: ignore[arg-type]
        if len(self._layouts) > 256:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

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


_UNPLANNED = object()


#: Where each factor starts in an exchange's buffer: a multiple of 64 bytes, as every new tensor does. A BLAS picks
#: its kernel by the operands' alignment (MKL's ``m^T p`` rounds differently at an offset of 4 bytes), so the
#: products in the buffer are bit for bit those of the per-tensor methods.
ALIGN_BYTES = 64


@dataclass(eq=False)
class _Layout:
    """Where an exchange's P and Q^T factors lie in its one buffer: every P (``rows x r``), then every Q^T
    (``r x cols``, Q's columns as rows: the layout every product with Q reads fastest, so none is copied), each
    at a multiple of :data:`ALIGN_BYTES` (the gaps are zeros, summed with the rest)."""

    dtype: torch.dtype
    plans: list[tuple[int, int, int]]
    #: each P's offset in the buffer, and each Q^T's in the buffer's Q^T part
    p_offsets: list[int] = field(init=False)
    q_offsets: list[int] = field(init=False)
    #: the P part's and the Q^T part's element counts, gaps included
    p_numel: int = field(init=False)
    q_numel: int = field(init=False)
    padded: bool = field(init=False)
    #: the tensors whose P is one column (normalised together by fused launches)
    rank_one: list[int] = field(init=False)
    _owners: dict[torch.device, Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        unit = max(1, ALIGN_BYTES // self.dtype.itemsize)

        def offsets(sizes: list[int]) -> tuple[list[int], int]:
            at, starts = 0, []
            for n in sizes:
                starts.append(at)
                at += -(-n // unit) * unit
            return starts, at

        p_sizes = [rows * r for rows, _, r in self.plans]
        q_sizes = [cols * r for _, cols, r in self.plans]
        self.p_offsets, self.p_numel = offsets(p_sizes)
        self.q_offsets, self.q_numel = offsets(q_sizes)
        self.padded = self.p_numel + self.q_numel != sum(p_sizes) + sum(q_sizes)
        self.rank_one = [j for j, (_, _, r) in enumerate(self.plans) if r == 1]

    def q_views(self, q_part: Tensor) -> list[Tensor]:
        """Each Q^T (``r x cols``) in a tensor laid out as the buffer's Q^T part."""
        return [q_part.as_strided((r, cols), (cols, 1), q_part.storage_offset() + at)
                for (_, cols, r), at in zip(self.plans, self.q_offsets)]

    def q_owners(self, device: torch.device) -> Tensor:
        """Per element of the Q^T part, the index of its tensor (a gap: the tensor before it), on ``device``."""
        owners = self._owners.get(device)
        if owners is None:
            counts = [b - a for a, b in zip(self.q_offsets, [*self.q_offsets[1:], self.q_numel])]
            owners = self._owners[device] = torch.repeat_interleave(
                torch.arange(len(self.plans), device=device), torch.tensor(counts, dtype=torch.int64, device=device),
                output_size=self.q_numel)
        return owners


class _LowRankBatch(TwoRoundBatch):
    """PowerSGD's two rounds for several matrices in one buffer (:meth:`PowerSGD.batch`): each product is written
    into its place there (``out=``), rank-1 Ps are normalised by three fused launches, and the summed Q^Ts are
    divided by one. Every product and every rounding is the per-tensor methods' own."""

    def __init__(self, compressor: PowerSGD, tensors: Sequence[Tensor], infos: Sequence[TensorInfo],
                 layout: _Layout) -> None:
        super().__init__(compressor, tensors, infos)
        self.powersgd = compressor
        self.layout = layout
        size, device = layout.p_numel + layout.q_numel, self.tensors[0].device
        self.buffer = (torch.zeros if layout.padded else torch.empty)(size, dtype=layout.dtype, device=device)
        self.ps = [self.buffer.as_strided((rows, r), (r, 1), at) for (rows, _, r), at in zip(layout.plans, layout.p_offsets)]
        self.qts = layout.q_views(self.buffer[layout.p_numel:])
        self.matrices: list[Tensor] = []

    def first_round(self) -> list[Tensor]:
        c = self.powersgd
        for x, info, plan, p in zip(self.tensors, self.infos, self.layout.plans, self.ps):
            rows, cols, r = plan
            m = (x.detach() if x.requires_grad else x).reshape(rows, cols)
            q = c._state.get(info.name)
            if q is None or q.shape != (cols, r) or q.device != m.device or q.dtype != m.dtype:
                q = c._warm_q(info, plan, m)
            torch.mm(m, q if r == 1 else q.T.contiguous().T, out=p)  # times(m, q), into its place
            self.matrices.append(m)
        self.firsts = list(self.ps)
        return [self.buffer[: self.layout.p_numel]]

    def second_round(self) -> list[Tensor]:
        ps = list(self.ps)  # summed in place
        if self.layout.rank_one:  # orthonormalize's p / max(|p|, tiny), three launches for all of them
            ones = [ps[j] for j in self.layout.rank_one]
            norms = torch._foreach_norm(ones)
            torch._foreach_clamp_min_(norms, torch.finfo(self.layout.dtype).tiny)
            torch._foreach_div_(ones, norms)
        for j, (_, _, r) in enumerate(self.layout.plans):
            if r > 1:
                ps[j] = orthonormalize(ps[j])
        for m, p, qt in zip(self.matrices, ps, self.qts):
            torch.mm(p.T, m, out=qt)  # transposed_times(m, p), as the rows of Q^T
        self.rounds = [([qt.T], Context(info, (p,))) for info, p, qt in zip(self.infos, ps, self.qts)]
        return [self.buffer[self.layout.p_numel:]]

    def finish(self, outs: Sequence[Tensor | None], *, divide_by: int, marks: Tensor | None = None) -> list[Tensor]:
        layout, c = self.layout, self.powersgd
        summed = self.buffer[layout.p_numel:]
        if marks is not None:  # each tensor's own divisor, world + mark, spread over its elements
            qts = layout.q_views(summed / (marks + divide_by).index_select(0, layout.q_owners(summed.device)))
        elif not _is_one(divide_by):
            qts = layout.q_views(summed / divide_by)
        else:
            qts = self.qts
        results = []
        for (payload, ctx), plan, qt, out in zip(self.rounds, layout.plans, qts, outs):
            info = ctx.info
            c._state[info.name] = payload[0]  # the summed Q warm-starts the next step (its scale is irrelevant)
            rows, cols, _ = plan
            p = ctx.extra[0]
            if out is not None and out.shape == info.shape and out.dtype == layout.dtype and out.is_contiguous():
                outer_into(p, qt, out.view(rows, cols))  # finish's product into the given buffer (as_buffer)
                results.append(out)
            else:
                buf = as_buffer(out, rows * cols, layout.dtype)
                results.append((p @ qt if buf is None else outer_into(p, qt, buf.view(rows, cols))).view(info.shape))
        return results
