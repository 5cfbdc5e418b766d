"""Compressors and inputs as the bit-for-bit tests build them: two runs draw alike, and PowerSGD compresses every
matrix."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from gradsync.compress import COMPRESSORS, Compressor, create


def seeded(name: str, **params: object) -> Compressor:
    """Compressor ``name`` with ``seed=0`` where it draws and ``min_compression_rate=0`` for PowerSGD (each unless
    ``params`` sets it)."""
    if "seed" in inspect.signature(COMPRESSORS.get(name)).parameters and "seed" not in params:
        params["seed"] = 0
    if name == "powersgd":
        params.setdefault("min_compression_rate", 0)
    return create(name, **params)


def step_tensors(shapes: Mapping[str, tuple[int, ...]], step: int, rank: int, *, per_step: int = 10,
                 bad: tuple[int, str, int, float] | None = None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s random tensors for step ``step``, by name (generator seeded ``per_step * step + rank``, drawn
    in ``shapes``' order). ``bad = (step, name, index, value)``: on rank 0 at that step, flat element ``index``
    of ``name`` is ``value`` (the one NaN or inf of a non-finite test)."""
    gen = torch.Generator().manual_seed(per_step * step + rank)
    out = {n: torch.randn(shape, generator=gen) for n, shape in shapes.items()}
    if bad is not None and bad[0] == step and rank == 0:
        out[bad[1]].view(-1)[bad[2]] = bad[3]
    return out
