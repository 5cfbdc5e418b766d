"""Overlap the forward pass with the parameter pulls still in flight (TicTac §4).

A worker that starts an ordered :meth:`~gradsync.ps.kvstore.KVStore.pull_async` need not wait for every
parameter before computing: module ``m`` can run as soon as *its* parameters have arrived. This module
registers a forward pre-hook on every module that owns parameters; the hook waits for exactly those keys
(``handle.wait(key)``) and then lets the module run, so the first layers compute while the server is still
sending the later ones. With the critical-path order (``gradsync.order.priorities(..., method="tac")``)
the parameters arrive in the order the forward pass needs them.

    handle = kv.pull_async(keys, [p.data for p in params], priority=[prio[n] for n in names])
    with attach_pull_waits(model, handle):
        loss = model(x)                      # each layer waits for its own parameters only

A parameter read outside its owner's ``forward`` (weight tying, functional use by a parent) is not waited
for by its owner's hook: wait for it explicitly or call ``handle.wait_all()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradsync.errors import GradsyncError
from gradsync.ps.kvstore import PullHandle
from gradsync.ps.wire import Key

__all__ = ["PullWaits", "attach_pull_waits"]

HandleSource = PullHandle | Callable[[], PullHandle | None]


class PullWaits:
    """The hooks :func:`attach_pull_waits` registered; ``remove()`` (or leaving the ``with``) takes them off."""

    def __init__(self, hooks: list[Any], keys: dict[str, Key]) -> None:
        self._hooks = hooks
        self.keys = keys

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __enter__(self) -> PullWaits:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def attach_pull_waits(model: torch.nn.Module, handle: HandleSource,
                      key_of_param: Mapping[str, Key] | Callable[[str], Key] | None = None, *,
                      on_ready: Callable[[Key], None] | None = None) -> PullWaits:
    """Make each module of ``model`` wait for its own parameters' pulls before its forward runs.

    ``handle``: a :class:`PullHandle`, or a function returning the one currently in flight (``None``: no
    pull outstanding) so the hooks can stay attached across training steps. ``key_of_param`` maps a name
    from ``model.named_parameters()`` to its KVStore key (a mapping, a function, or ``None`` for the name
    itself); parameters missing from a mapping are not waited for. ``on_ready(key)`` runs after each wait
    (e.g. to apply a pulled gradient to its parameter before the module reads it).
    """
    if isinstance(handle, PullHandle):
        fixed = handle

        def source() -> PullHandle | None:
            return fixed
    elif callable(handle):
        source = handle
    else:
        raise GradsyncError(f"handle must be a PullHandle or a function returning one, got {type(handle).__name__}")
    if key_of_param is None:
        def key_for(name: str) -> Key | None:
            return name
    elif isinstance(key_of_param, Mapping):
        table = dict(key_of_param)

        def key_for(name: str) -> Key | None:
            return table.get(name)
    else:
        key_for = key_of_param
    hooks: list[Any] = []
    all_keys: dict[str, Key] = {}
    for mod_name, module in model.named_modules():
        keys = []
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            key = key_for(full)
            if key is not None:
                keys.append(key)
                all_keys[full] = key
        if keys:
            hooks.append(module.register_forward_pre_hook(_waiter(keys, source, on_ready)))
    if not all_keys:
        raise GradsyncError("attach_pull_waits: no parameter of the model maps to a key; check key_of_param "
                            f"(model parameters: {[n for n, _ in model.named_parameters()][:5]} ...)")
    return PullWaits(hooks, all_keys)


def _waiter(keys: list[Key], source: Callable[[], PullHandle | None],
            on_ready: Callable[[Key], None] | None) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: Any) -> None:
        h = source()
        if h is None:
            return
        for k in keys:
            if k in h.keys:
                h.wait(k)
                if on_ready is not None:
                    on_ready(k)

    return hook
