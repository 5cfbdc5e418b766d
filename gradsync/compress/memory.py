"""Error feedback (GRACE's ``Memory``): ``none``, ``residual``, ``dgc``.

Seed 004 §3.2 counts error feedback as a second decode per step; its Theorem 2 assumes it for quantizers.
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
)

__all__ = ["DEFAULT_MEMORY", "NoMemory", "ResidualMemory", "DGCMemory", "default_memory"]


@register_memory("none")
class NoMemory(Memory):
    """No error feedback: what a compressor drops is lost (right for ``none``, ``fp16``, unbiased QSGD)."""

    def __init__(self) -> None:
        super().__init__()

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

    def __init__(self) -> None:
        super().__init__()

    def residual(self, name: str) -> Tensor | None:
        """What ``name`` still owes (None before its first update)."""
        return self._state.get(name)

    def compensate(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        residual = self._state.get(info.name)
        if residual is None or residual.shape != tensor.shape:
            return tensor
        return tensor + residual.to(tensor.dtype)

    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        self._state[info.name] = tensor - compressor.decompress(payload, ctx)


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
        u, v = self._state.get(info.name, (None, None))
        if u is None or u.shape != tensor.shape:
            u, v = torch.zeros_like(tensor), torch.zeros_like(tensor)
        u = u * self.momentum + tensor
        v = v + u
        self._state[info.name] = (u, v)
        return v

    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        u, _ = self._state.get(info.name, (torch.zeros_like(tensor), None))
        sent = compressor.decompress(payload, ctx)
        self._state[info.name] = (u.masked_fill(sent != 0, 0), tensor - sent)


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
