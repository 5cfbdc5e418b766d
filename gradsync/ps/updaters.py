"""Server-side update rules: what a server does with the pushes of one key (one slice of it).

A worker names the rule and sends its numbers (``set_optimizer("sgd", lr=0.1)``); nothing executable
travels. Each rule is a frozen dataclass of validated hyper-parameters with one method::

    apply(value, pushed, count, state)   # value: the stored slice, updated in place
                                         # pushed: the sum of ``count`` pushes (a sync round, or 1 async push)
                                         # state: the rule's tensors for this slice (momentum, Adam moments)

Without a rule, a synchronous round *replaces* the stored value with the sum of its pushes (MXNet's
default: workers update their own weights), and an asynchronous push is a *delta* added to the value, so
asynchronous SGD (push ``-lr·g``) and elastic averaging (push ``α·(w − w̃)``) share one path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

import torch

from gradsync.errors import GradsyncError
from gradsync.registry import Registry

__all__ = ["Updater", "UPDATERS", "Replace", "Accumulate", "SGD", "Adam", "Elastic", "create_updater", "default_updater", "describe"]


class Updater(Protocol):
    name: ClassVar[str]

    def apply(self, value: torch.Tensor, pushed: torch.Tensor, count: int, state: dict[str, torch.Tensor]) -> None: ...


def _check(rule: Any) -> None:
    for f in fields(rule):
        v = getattr(rule, f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise GradsyncError(f"{rule.name}: {f.name}={v!r} must be a finite number")


@dataclass(frozen=True)
class Replace:
    """Sync default: the stored value becomes the sum of the round's pushes."""

    name: ClassVar[str] = "replace"

    def apply(self, value: torch.Tensor, pushed: torch.Tensor, count: int, state: dict[str, torch.Tensor]) -> None:
        value.copy_(pushed)


@dataclass(frozen=True)
class Accumulate:
    """Async default: every push is a delta added to the stored value (the sum of all pushes is kept)."""

    name: ClassVar[str] = "accumulate"

    def apply(self, value: torch.Tensor, pushed: torch.Tensor, count: int, state: dict[str, torch.Tensor]) -> None:
        value.add_(pushed)


@dataclass(frozen=True)
class SGD:
    """``g = rescale_grad·pushed + wd·w``; with momentum ``m = μ·m + g`` (PyTorch's form); ``w -= lr·m``."""

    name: ClassVar[str] = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    wd: float = 0.0
    rescale_grad: float = 1.0

    def __post_init__(self) -> None:
        _check(self)
        if self.lr <= 0:
            raise GradsyncError(f"sgd: lr={self.lr} must be > 0")
        if not 0 <= self.momentum < 1:
            raise GradsyncError(f"sgd: momentum={self.momentum} must be in [0, 1)")
        if self.wd < 0:
            raise GradsyncError(f"sgd: wd={self.wd} must be >= 0")

    def apply(self, value: torch.Tensor, pushed: torch.Tensor, count: int, state: dict[str, torch.Tensor]) -> None:
        g = pushed.mul(self.rescale_grad)
        if self.wd:
            g.add_(value, alpha=self.wd)
        if self.momentum:
            buf = state.get("momentum")
            if buf is None:
                buf = state["momentum"] = g.clone()
            else:
                buf.mul_(self.momentum).add_(g)
            g = buf
        value.add_(g, alpha=-self.lr)


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba) on ``rescale_grad·pushed + wd·w``, bias-corrected, state ``m``, ``v``, ``t``."""

    name: ClassVar[str] = "adam"
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    wd: float = 0.0
    rescale_grad: float = 1.0

    def __post_init__(self) -> None:
        _check(self)
        if self.lr <= 0 or self.eps <= 0:
            raise GradsyncError(f"adam: lr={self.lr} and eps={self.eps} must be > 0")
        for b in ("beta1", "beta2"):
            if not 0 <= getattr(self, b) < 1:
                raise GradsyncError(f"adam: {b}={getattr(self, b)} must be in [0, 1)")

    def apply(self, value: torch.Tensor, pushed: torch.Tensor, count: int, state: dict[str, torch.Tensor]) -> None:
        g = pushed.mul(self.rescale_grad)
        if self.wd:
            g.add_(value, alpha=self.wd)
        if "m" not in state:
            state["m"] = torch.zeros_like(value)
            state["v"] = torch.zeros_like(value)
            state["t"] = torch.zeros(1, dtype=torch.int64)
        m, v, t = state["m"], state["v"], state["t"]
        t += 1
        step = int(t.item())
        m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        m_hat = m / (1 - self.beta1**step)
        v_hat = v / (1 - self.beta2**step)
        value.addcdiv_(m_hat, v_hat.sqrt_().add_(self.eps), value=-self.lr)


@dataclass(frozen=True)
class Elastic:
    """Elastic averaging, MXNET-MPI eq. (2): workers push their weights ``w``; the center moves towards them.

    ``w̃ ← w̃ + α·Σᵢ(wᵢ − w̃)`` over the ``count`` pushes applied together (one push in async mode, so
    exactly eq. (2); a sync round applies the synchronous EASGD form).
    """

    name: ClassVar[str] = "elastic"
    alpha: float = 0.1

    def __post_init__(self) -> None:
        _check(self)
        if not 0 < self.alpha <= 1:
            raise GradsyncError(f"elastic: alpha={self.alpha} must be in (0, 1]")

    def apply(self, value: torch.Tensor, pushed: torch.Tensor, count: int, state: dict[str, torch.Tensor]) -> None:
        value.add_(pushed.sub(value, alpha=count), alpha=self.alpha)


UPDATERS: Registry[type] = Registry("server update rule", GradsyncError)
UPDATERS.add("replace", Replace)
UPDATERS.add("accumulate", Accumulate)
UPDATERS.add("sgd", SGD, aliases=("momentum",))  # "momentum" = sgd with momentum 0.9 unless given
UPDATERS.add("adam", Adam)
UPDATERS.add("elastic", Elastic, aliases=("easgd",))


def create_updater(name: str, **hyperparameters: Any) -> Updater:
    """The rule ``name`` with ``hyperparameters`` checked (unknown names list the known ones)."""
    cls = UPDATERS.get(name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(hyperparameters) - known)
    if unknown:
        raise GradsyncError(f"{cls.name} has no hyper-parameter {', '.join(unknown)}; known: {sorted(known) or 'none'}")
    if UPDATERS.canonical(name) == "sgd" and name == "momentum" and "momentum" not in hyperparameters:
        hyperparameters = {**hyperparameters, "momentum": 0.9}
    return cls(**hyperparameters)


def default_updater(sync: bool) -> Updater:
    """What a key does without ``set_optimizer``: replace with the round's sum (sync) or add the delta (async)."""
    return Replace() if sync else Accumulate()


def describe(rule: Updater) -> dict[str, Any]:
    """The rule as JSON-able data (what ``set_optimizer`` sends and a checkpoint stores)."""
    return {"name": rule.name, **{f.name: getattr(rule, f.name) for f in fields(rule)}}  # type: ignore[arg-type]
