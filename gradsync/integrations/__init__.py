"""Integrations: gradsync's DDP hooks inside the trainers people already use (Lightning, Accelerate, torchrun).

They sit above :mod:`gradsync.train` (the hooks and their states) and import a trainer only when their own
module is imported: ``gradsync.integrations.lightning`` imports ``lightning``; nothing here imports
``accelerate`` (its prepared model is a plain ``DistributedDataParallel``, see :func:`register_comm_hook`).

``ddp``: :func:`register_comm_hook` (a state -> its hook, registered on a DDP-wrapped model).
``lightning``: :class:`~gradsync.integrations.lightning.GradsyncCallback` (the hook registered in
``on_fit_start``, where Lightning on the CPU drops ``DDPStrategy(ddp_comm_hook=...)``).
"""

from typing import Any

_EXPORTS = {"register_comm_hook": "ddp", "hook_for": "ddp", "GradsyncCallback": "lightning"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"gradsync.integrations.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'gradsync.integrations' has no attribute {name!r}")
