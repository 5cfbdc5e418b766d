"""Error feedback (GRACE's ``Memory``): ``none``, ``residual``, ``dgc``.

MergeComp §3.2 counts error feedback as a second decode per step; its Theorem 2 assumes it for quantizers.
Each memory is one worker's state, keyed by ``info.name``, and uses only the local payload it is given
(``decompress`` is pure), so it never re-compresses.
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def compensate(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        return tensor

    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        return None


@register_memory("residual", aliases=("ef", "error-feedback"))
class ResidualMemory(Memory):
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019): ``e <- (g + e) - decompress(compress(g + e))``.

    Over T steps, the sum of what was sent plus the final residual equals the sum of the gradients.
    """

    def residual(self, name: str) -> Tensor | None:
        """What ``name`` still owes (None before its first update)."""
        return self._state.get(name)

    def compensate(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        """``tensor + e``, added into ``e``'s own buffer (no new d-element tensor per step): until :meth:`update`
        the buffer holds the compensated tensor, and :meth:`update` turns it back into the residual in place."""
        residual = self._state.get(info.name)
        if residual is None or residual.shape != tensor.shape:
            return tensor
        if residual.dtype != tensor.dtype or not residual.is_contiguous():
            return tensor + residual.to(tensor.dtype)
        return residual.add_(tensor)

    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        # In place only in the buffer compensate returned (never the caller's gradient): O(k) when sparse.
        owned = tensor is self._state.get(info.name)
        self._state[info.name] = compressor.subtract_decoded(tensor, payload, ctx, inplace=owned)


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

    def velocity(self, name: str) -> Tensor | None:
        """The accumulated ``v`` still owed for ``name`` (None before its first update)."""
        state = self._state.get(name)
        return None if state is None else state[1]

    def momentum_buffer(self, name: str) -> Tensor | None:
        """The corrected momentum ``u`` for ``name``, zero where it was last sent (None before compensate)."""
        state = self._state.get(name)
        return None if state is None else state[0]

    def compensate(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        """``u <- m u + g``; ``v <- v + u``, in the memory's own buffers after the first step (same bits)."""
        u, v = self._state.get(info.name, (None, None))
        if u is None or u.shape != tensor.shape or u.dtype != tensor.dtype:
            u = torch.zeros_like(tensor) * self.momentum + tensor
            v = torch.zeros_like(tensor) + u
        else:
            u.mul_(self.momentum).add_(tensor)
            v.add_(u)
        self._state[info.name] = (u, v)
        return v

    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        u, v = self._state.get(info.name, (None, None))
        if u is None or u.shape != tensor.shape:
            u = torch.zeros_like(tensor)
        # In place only in the buffers compensate returned (never the caller's tensor).
        owned = tensor is v and u.is_contiguous()
        pair = compressor.sparse(payload, ctx)
        if owned and pair is not None:  # O(k): mask u where a non-zero was sent, subtract what was sent
            indices, values = pair
            u.view(-1).index_fill_(0, indices[values != 0].to(torch.int64), 0)
            self._state[info.name] = (u, compressor.subtract_decoded(tensor, payload, ctx, inplace=True))
            return
        sent = compressor.decompress(payload, ctx)
        mask = sent != 0
        u = u.masked_fill_(mask, 0) if owned else u.masked_fill(mask, 0)
        if owned and not shares_memory(tensor, [*payload, sent]):
            self._state[info.name] = (u, tensor.sub_(sent))
        else:
            self._state[info.name] = (u, tensor - sent)


#: Error feedback each compressor is meant to run with (biased ones need it; unbiased or voting ones do not).
DEFAULT_MEMORY: dict[str, str] = {
    "none": "none",
    "fp16": "none",
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
