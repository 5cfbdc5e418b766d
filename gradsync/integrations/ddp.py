"""One call that puts a gradsync hook on a DDP-wrapped model, whoever wrapped it (torchrun script, Accelerate's
``prepare()``, Lightning's strategy).

Accelerate's recipe (launched with ``torchrun`` or ``accelerate launch``)::

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    register_comm_hook(model, gradsync.CompressionHookState("powersgd"))   # or model.register_comm_hook(state, hook)

``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's own enum of hooks, so the hook goes on the
prepared model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from gradsync.train.compressed_hook import CompressionHookState, compression_hook
from gradsync.train.hooks import GradsyncHookState, allreduce_hook

__all__ = ["HOOKS", "hook_for", "register_comm_hook"]

#: Each hook state's hook: a state names its hook, so a user passes one object.
HOOKS: dict[type, Callable[..., Any]] = {
    GradsyncHookState: allreduce_hook,
    CompressionHookState: compression_hook,
}


def hook_for(state: Any) -> Callable[..., Any]:
    """The gradsync hook that runs with ``state`` (a :class:`GradsyncHookState` or :class:`CompressionHookState`)."""
    for cls, hook in HOOKS.items():
        if isinstance(state, cls):
            return hook
    raise TypeError(
        f"state={state!r} is not a gradsync hook state; pass gradsync.GradsyncHookState() or "
        f"gradsync.CompressionHookState('<compressor>'), or pass hook= with your own state"
    )


def register_comm_hook(model: Any, state: Any = None, hook: Callable[..., Any] | None = None) -> bool:
    """Register ``hook`` (default: ``state``'s, :func:`hook_for`) with ``state`` (default: a new
    :class:`GradsyncHookState`, the planned allreduce) on ``model``. Returns False, registering nothing, when
    ``model`` is not wrapped in DDP (one process: nothing to synchronise), True otherwise. A gradsync state that has
    its runtime already is given the wrapped module, so that what DDP's first buckets send is priced ahead
    (``anticipate_model``; once, and nothing where the state was made with the model)."""
    if state is None:
        state = GradsyncHookState()
    hook = hook if hook is not None else hook_for(state)
    if not isinstance(model, DistributedDataParallel):
        return False
    try:
        model.register_comm_hook(state, hook)
    except RuntimeError as exc:
        if "only be called once" not in str(exc):
            raise
        raise ValueError(
            "this DDP model already has a communication hook (the trainer registered one, e.g. Lightning's "
            "DDPStrategy(ddp_comm_hook=...) on GPUs); register gradsync's in one place only"
        ) from exc
    if isinstance(state, tuple(HOOKS)) and state.resolved:
        state.anticipate_model(model.module.parameters())
    return True
