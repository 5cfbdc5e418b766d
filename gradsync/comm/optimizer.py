"""Horovod-style ``DistributedOptimizer``: gradients start travelling the moment backward produces them.

Each parameter gets a post-accumulate-grad hook. When its gradient is final, the hook adds it to the open
group of its dtype; once the group holds ``bucket_bytes`` (0: every gradient alone) the group is queued
as one tensor collective on the runtime's communication thread, and backward goes on (wait-free
backprop, seed 001 §4.1). ``step()`` flushes the open groups, waits for all of them, then runs the
wrapped optimizer. Ranks produce gradients in the same order, so their groups match.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from gradsync.comm.executor import OPS
from gradsync.comm.runtime import Runtime, Work, get_runtime
from gradsync.errors import GradsyncError

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """Wraps ``optimizer`` so gradients are allreduced (averaged by default) before every ``step()``.

    ``named_parameters``: the model's ``named_parameters()`` (default: every parameter of the optimizer).
    ``bucket_bytes``: fuse consecutive gradients of one dtype until a group holds this many bytes.
    Other attributes (``param_groups``, ``state``, ``zero_grad`` ...) are the wrapped optimizer's.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        *,
        runtime: Runtime | None = None,
        op: str = "avg",
        algorithm: str | None = None,
        bucket_bytes: int = 0,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if op not in OPS:
            raise GradsyncError(f"op={op!r} is not one of {OPS}")
        if bucket_bytes < 0:
            raise GradsyncError(f"bucket_bytes={bucket_bytes} must be >= 0 (0 sends every gradient alone)")
        self.optimizer = optimizer
        self.runtime = runtime or get_runtime()
        self.op = op
        self.algorithm = algorithm
        self.bucket_bytes = int(bucket_bytes)
        in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param{i}", p) for i, p in enumerate(in_optimizer)]
        else:
            named = list(named_parameters)
            known = {id(p) for p in in_optimizer}
            stray = [n for n, p in named if id(p) not in known]
            if stray:
                raise GradsyncError(f"named_parameters {stray[:5]} are not in the optimizer; pass model.named_parameters() of the optimized model")
        self.names = {id(p): n for n, p in named}
        self._open: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
        self._works: list[Work] = []
        self.wait_seconds = 0.0  # time step() spent waiting on communication (exposed comm time)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named if p.requires_grad
        ]
        self.runtime.executor(algorithm)  # plan now

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on self: delegate to the wrapped optimizer. (LR schedulers
        # check isinstance(opt, Optimizer): give them ``dist_opt.optimizer``.)
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:  # pragma: no cover - the hook fires after accumulation
            return
        if grad.is_sparse or not grad.is_contiguous():
            raise GradsyncError(f"gradient of {self.names.get(id(param), '?')} is sparse or not contiguous; gradsync allreduces dense gradients")
        group, size = self._open.get(grad.dtype, ([], 0))
        group.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= self.bucket_bytes:
            self._works.append(self.runtime.allreduce_async(group, self.op, self.algorithm))
            self._open.pop(grad.dtype, None)
        else:
            self._open[grad.dtype] = (group, size)

    def synchronize(self) -> None:
        """Send any open groups and wait until every gradient of this iteration is reduced."""
        for group, _ in self._open.values():
            self._works.append(self.runtime.allreduce_async(group, self.op, self.algorithm))
        self._open.clear()
        t0 = time.perf_counter()
        works, self._works = self._works, []
        for w in works:
            w.wait()
        self.wait_seconds += time.perf_counter() - t0

    def step(self, closure: Any = None) -> Any:
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
