"""Error feedback (GRACE's ``Memory``): ``none``, ``residual``, ``dgc``.

MergeComp §3.2 counts error feedback as a second decode per step; its Theorem 2 assumes it for quantizers.
Each memory is one worker's state, keyed by ``info.name``, and uses only the local payload it is given
(``decompress`` is pure), so it never re-compresses.

A step never writes into the committed state: compensate works in a spare buffer (the state a previous step
left behind), so a step that turns out non-finite on some worker is dropped by keeping the old buffer -- a
pointer, no copy (:class:`~gradsync.compress.base.Memory`). The price is a second buffer per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from gradsync.compress.base import (
    COMPRESSORS,
    Compressor,
    Context,
    Memory,
    TensorInfo,
    check_unit_interval,
    register_memory,
    shares_memory,
)

__all__ = ["DEFAULT_MEMORY", "NoMemory", "ResidualMemory", "DGCMemory", "default_memory"]


@register_memory("none")
class NoMemory(Memory):
    """No error feedback: what a compressor drops is lost (right for ``none``, ``fp16``, unbiased QSGD)."""

    stateless = True

    def compensate(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        if self._pending:
            self._settle(info.name)  # only counts a non-finite step: there is no state
        return tensor

    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        return None


def _reusable(spare: Tensor | None, like: Tensor) -> bool:
    return (spare is not None and spare.shape == like.shape and spare.dtype == like.dtype
            and spare.device == like.device and spare.is_contiguous())


@register_memory("residual", aliases=("ef", "error-feedback"))
class ResidualMemory(Memory):
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019): ``e <- (g + e) - decompress(compress(g + e))``.

    Over T steps, the sum of what was sent plus the final residual equals the sum of the gradients (a step
    dropped as non-finite counts as never taken).
    """

    #: Devices where :meth:`compensate_all` is two fused launches for all the tensors (copy the gradients into the
    #: spare buffers, add the residuals): a GPU, where a launch per tensor costs more host time than the second pass
    #: costs the device. On the CPU the one pass per tensor is cheaper.
    fused_devices: ClassVar[frozenset[str]] = frozenset({"cuda"})

    def __init__(self) -> None:
        super().__init__()
        #: name -> the compensated buffer :meth:`compensate` handed out (the memory's own, so update may write it)
        self._lent: dict[str, Tensor] = {}

    def residual(self, name: str) -> Tensor | None:
        """What ``name`` still owes (None before its first update)."""
        return self._committed(name)

    def owed(self, name: str) -> Tensor | None:
        """:meth:`residual`: the part of ``name``'s gradients not sent yet."""
        return self.residual(name)

    def compensate(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        """``e + tensor``, written into the spare buffer a previous step left (no new d-element tensor per step);
        :meth:`update` turns it into the proposed residual in place, and ``e`` stays for a non-finite step."""
        residual = self._committed(info.name)
        if residual is None or residual.shape != tensor.shape:
            return tensor
        if residual.dtype != tensor.dtype:
            return tensor + residual.to(tensor.dtype)
        spare = self._spare.pop(info.name, None)
        if not _reusable(spare, residual) or spare is residual:
            spare = torch.empty_like(residual, memory_format=torch.contiguous_format)
        out = torch.add(residual, tensor, out=spare)
        self._lent[info.name] = out
        return out

    def compensate_all(self, tensors: Sequence[Tensor], infos: Sequence[TensorInfo]) -> list[Tensor]:
        """:meth:`compensate` of each tensor, in two fused launches on :attr:`fused_devices` (``tensor + e`` is
        ``e + tensor`` bit for bit); a tensor without a residual of its shape, dtype and device goes alone."""
        if not tensors or tensors[0].device.type not in self.fused_devices:
            return super().compensate_all(tensors, infos)
        out = list(tensors)
        spares: list[Tensor] = []
        grads: list[Tensor] = []
        residuals: list[Tensor] = []
        for j, (tensor, info) in enumerate(zip(tensors, infos)):
            residual = self._committed(info.name)
            if (residual is None or residual.shape != tensor.shape or residual.dtype != tensor.dtype
                    or residual.device != tensor.device):
                out[j] = self.compensate(tensor, info)
                continue
            spare = self._spare.pop(info.name, None)
            if not _reusable(spare, residual) or spare is residual:
                spare = torch.empty_like(residual, memory_format=torch.contiguous_format)
            self._lent[info.name] = out[j] = spare
            spares.append(spare)
            grads.append(tensor)
            residuals.append(residual)
        if spares:
            torch._foreach_copy_(spares, grads)
            torch._foreach_add_(spares, residuals)
        return out

    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        # In place only in the buffer compensate lent (never the caller's gradient): O(k) when sparse.
        owned = self._lent.pop(info.name, None) is tensor
        self._propose(info.name, compressor.subtract_decoded(tensor, payload, ctx, inplace=owned))

    def reset(self) -> None:
        super().reset()
        self._lent.clear()


@register_memory("dgc")
class DGCMemory(Memory):
    """DGC's momentum correction and factor masking (Lin et al. 2018 §3.2, Algorithm 1).

    ``u <- m u + g``; ``v <- v + u``; send from ``v``; then ``v`` keeps what was not sent and ``u`` is
    zeroed where something was sent (momentum factor masking). The momentum lives here, so the optimizer
    should run without its own. With ``momentum=0`` this is ``residual``.
    """

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = check_unit_interval("momentum", momentum, "DGC's momentum m")
        #: name -> the (u, v) :meth:`compensate` computed, in the memory's own buffers
        self._lent: dict[str, tuple[Tensor, Tensor]] = {}

    def velocity(self, name: str) -> Tensor | None:
        """The accumulated ``v`` still owed for ``name`` (None before its first update)."""
        state = self._committed(name)
        return None if state is None else state[1]

    def owed(self, name: str) -> Tensor | None:
        """:meth:`velocity`: the accumulated ``v`` not sent yet (the momentum ``u`` is the optimizer's part, not a
        debt)."""
        return self.velocity(name)

    def momentum_buffer(self, name: str) -> Tensor | None:
        """The corrected momentum ``u`` for ``name``, zero where it was last sent (None before its first update)."""
        state = self._committed(name)
        return None if state is None else state[0]

    def compensate(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        """``u <- m u + g``; ``v <- v + u``, in spare buffers after the first step (same bits; the committed
        ``u`` and ``v`` stay for a non-finite step)."""
        u, v = self._committed(info.name) or (None, None)
        if u is None or u.shape != tensor.shape or u.dtype != tensor.dtype:
            u = torch.zeros_like(tensor) * self.momentum + tensor
            v = torch.zeros_like(tensor) + u
        else:
            su, sv = self._spare.pop(info.name, (None, None))
            if not _reusable(su, u) or su is u:
                su = torch.empty_like(u, memory_format=torch.contiguous_format)
            if not _reusable(sv, v) or sv is v:
                sv = torch.empty_like(v, memory_format=torch.contiguous_format)
            u = torch.mul(u, self.momentum, out=su).add_(tensor)
            v = torch.add(v, u, out=sv)
        self._lent[info.name] = (u, v)
        return v

    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        lent = self._lent.pop(info.name, None)
        if lent is not None:
            u, v = lent
        else:
            u, v = self._committed(info.name) or (None, None)
            if u is None or u.shape != tensor.shape:
                u = torch.zeros_like(tensor)
        # In place only in the buffers compensate lent (never the caller's tensor nor the committed state).
        owned = lent is not None and tensor is v and u.is_contiguous()
        pair = compressor.sparse(payload, ctx)
        if owned and pair is not None:  # O(k): mask u where a non-zero was sent, subtract what was sent
            indices, values = pair
            u.view(-1).index_fill_(0, indices[values != 0].to(torch.int64), 0)
            self._propose(info.name, (u, compressor.subtract_decoded(tensor, payload, ctx, inplace=True)))
            return
        sent = compressor.decompress(payload, ctx)
        mask = sent != 0
        u = u.masked_fill_(mask, 0) if owned else u.masked_fill(mask, 0)
        if owned and not shares_memory(tensor, [*payload, sent]):
            self._propose(info.name, (u, tensor.sub_(sent)))
        else:
            self._propose(info.name, (u, tensor - sent))

    def reset(self) -> None:
        super().reset()
        self._lent.clear()


#: Error feedback each compressor is meant to run with (biased ones need it; unbiased or voting ones do not).
DEFAULT_MEMORY: dict[str, str] = {
    "none": "none",
    "fp16": "none",
    "bf16": "none",
    "qsgd": "none",
    "terngrad": "none",
    "signsgd": "none",
    "signum": "none",
    "topk": "residual",
    "randk": "residual",
    "efsignsgd": "residual",
    "onebit": "residual",
    "powersgd": "residual",
    "dgc": "dgc",
}


def default_memory(compressor: Compressor | str) -> str:
    """The memory name :data:`DEFAULT_MEMORY` pairs with a compressor (``"none"`` for unlisted ones)."""
    name = compressor if isinstance(compressor, str) else compressor.name
    return DEFAULT_MEMORY.get(COMPRESSORS.canonical(name) if name else name, "none")
