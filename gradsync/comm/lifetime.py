"""Process groups gradsync starts, and ending them cleanly when the interpreter exits.

A gloo process group that is still alive when the interpreter tears itself down aborts the process about
half the time (``terminate called without an active exception``, exit 134), after the script's work is
done: plain PyTorch has this too when a script skips ``destroy_process_group()``. gradsync knows which
groups it started, so it ends them itself at exit: first the things that still talk over them (the
runtime's communication thread, registered with :func:`on_exit`), then the groups, newest first.

Users who end things themselves are not disturbed: groups already destroyed (by
``gradsync.shutdown()``, ``dist.destroy_process_group()``, in either order) are skipped, and a group the
user created is never destroyed by gradsync.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["destroy_owned", "init_process_group", "is_live", "on_exit", "own"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_owned: list[Any] = []  # process groups gradsync created, oldest first (the default group as ``None``)
_before: list[Callable[[], None]] = []
_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        atexit.register(_at_exit)
        _registered = True


def on_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit before gradsync's process groups are destroyed (once per ``fn``)."""
    with _lock:
        if fn not in _before:
            _before.append(fn)
        _register()


def own(group: Any) -> None:
    """Record that gradsync created ``group`` (``None``: the default group), so exit destroys it."""
    with _lock:
        _owned.append(group)
        _register()


def init_process_group(backend: str, timeout_s: float, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, env://)`` owned by gradsync (destroyed at exit)."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    own(None)


def is_live(group: Any) -> bool:
    """Whether ``group`` (``None``: the default group) has not been destroyed yet."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    if group is None:
        return True
    from torch.distributed import distributed_c10d as c10d

    return group in c10d._world.pg_map  # the registry destroy_process_group() removes groups from


def destroy_owned() -> None:
    """Destroy every live group gradsync created, newest first; the default group (if ours) last."""
    import torch.distributed as dist

    with _lock:
        groups = list(reversed(_owned))
        _owned.clear()
    for g in sorted(groups, key=lambda g: g is None):  # subgroups before the default group
        try:
            if is_live(g):
                dist.destroy_process_group(g)
        except Exception as exc:  # noqa: BLE001 - at exit a failure to tidy up must not mask the job's result
            log.debug("gradsync: destroying process group %r at exit failed: %s", g, exc)


def _at_exit() -> None:
    with _lock:
        before = list(reversed(_before))
    for fn in before:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            log.debug("gradsync: exit hook %r failed: %s", fn, exc)
    destroy_owned()
