"""A Lightning callback that puts a gradsync hook on the DDP model in ``on_fit_start``.

On GPUs, Lightning registers hooks itself: ``DDPStrategy(ddp_comm_hook=gradsync.allreduce_hook,
ddp_comm_state=gradsync.GradsyncHookState())`` works as Lightning documents it (the state finds its runtime at the
first bucket). On the CPU Lightning drops ``ddp_comm_hook`` without a word; this callback registers it there::

    from gradsync.integrations.lightning import GradsyncCallback
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[GradsyncCallback(gradsync.CompressionHookState("powersgd"))])

Importing this module imports ``lightning`` (or, without it, ``pytorch_lightning``); nothing else in gradsync does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package ships the same class under its older name
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:
        raise ImportError(
            "gradsync.integrations.lightning needs Lightning: pip install lightning (tested with 2.6.6)"
        ) from exc

from gradsync.integrations.ddp import hook_for, register_comm_hook
from gradsync.train.hooks import GradsyncHookState

__all__ = ["GradsyncCallback"]


class GradsyncCallback(Callback):
    """Register ``hook`` with ``state`` on the trainer's DDP model when fitting starts.

    ``state``: a :class:`~gradsync.GradsyncHookState` (default: a new one, the planned allreduce) or a
    :class:`~gradsync.CompressionHookState`; ``hook``: default the state's own (``allreduce_hook`` or
    ``compression_hook``). Both are checked here, when the trainer is configured; the runtime is found at the first
    bucket. With one process (no DDP wrapper) nothing is registered and :attr:`registered` stays False.
    """

    def __init__(self, state: Any = None, hook: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.state = state if state is not None else GradsyncHookState()
        self.hook = hook if hook is not None else hook_for(self.state)
        self.registered = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # by now the strategy has wrapped the module (strategy.setup runs before the fit-start hooks)
        if not self.registered:
            self.registered = register_comm_hook(trainer.strategy.model, self.state, self.hook)
