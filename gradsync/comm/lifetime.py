"""Process groups gradsync starts, and ending them cleanly when the interpreter exits.

A gloo process group that is still alive when the interpreter tears itself down aborts the process about
half the time (``terminate called without an active exception``, exit 134), after the script's work is
done: plain PyTorch has this too when a script skips ``destroy_process_group()``. gradsync knows which
groups it started, so it ends them itself at exit: first the things that still talk over them (the
runtime's communication thread, registered with :func:`on_exit`), then the groups, newest first.

The rendezvous store rank 0 starts (torch's ``TCPStore``) listens on ``MASTER_ADDR`` only, not on every
interface as ``env://`` makes it (:func:`bound_store`): a job told ``MASTER_ADDR=127.0.0.1`` is not
reachable from other hosts.

Users who end things themselves are not disturbed: groups already destroyed (by
``gradsync.shutdown()``, ``dist.destroy_process_group()``, in either order) are skipped, and a group the
user created is never destroyed by gradsync.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import gc
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["bound_store", "destroy_owned", "init_process_group", "is_live", "on_exit", "own"]

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


def bound_store(addr: str, port: int, world_size: int, timeout_s: float, *, is_master: bool = True) -> Any:
    """The job's ``TCPStore``: rank 0's listening on ``addr`` only (``is_master``), or a client of it.

    ``env://`` makes the store listen on every interface whatever ``MASTER_ADDR`` says. TCPStore accepts an
    already listening socket (``master_listen_fd``), so the socket is bound here, to ``addr``, and handed
    over (the store owns it from then on). An ``addr`` this host cannot bind (rank 0 was given a name that
    resolves to another address) keeps torch's default, with a warning."""
    import torch.distributed as dist

    from gradsync.errors import CommError

    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(addr, port, world_size, False, timeout, multi_tenant=True)
    try:
        family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise CommError(f"MASTER_ADDR={addr!r} cannot be resolved: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(max(128, world_size))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise CommError(f"MASTER_PORT={port} on {addr} is in use: another job or process listens there; "
                            f"pick another port (gradsync launch and run pick free ones)") from None
        log.warning("gradsync: cannot bind the rendezvous store to MASTER_ADDR=%s (%s); it listens on every "
                    "interface instead", addr, exc.strerror)
        return dist.TCPStore(addr, port, world_size, True, timeout, multi_tenant=True)
    fd = sock.detach()
    try:
        return dist.TCPStore(addr, port, world_size, True, timeout, multi_tenant=True, master_listen_fd=fd)
    except Exception:
        os.close(fd)
        raise


def init_process_group(backend: str, timeout_s: float, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, env://)`` owned by gradsync (destroyed at exit), except
    that rank 0's store listens on ``MASTER_ADDR`` only (:func:`bound_store`). Under torchrun's agent, whose
    store every rank joins (``TORCHELASTIC_USE_AGENT_STORE``), plain ``env://``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    env = os.environ
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent_store or not all(v in env for v in ("MASTER_ADDR", "MASTER_PORT")):
        dist.init_process_group(backend, init_method="env://", timeout=timeout, **kwargs)
    else:
        rank = int(kwargs.pop("rank", env.get("RANK", "0")))
        world_size = int(kwargs.pop("world_size", env.get("WORLD_SIZE", "1")))
        store = bound_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, timeout_s, is_master=rank == 0)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
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
    # A shut-down runtime is freed only by the cycle collector (its parts refer to each other), and with it the last
    # references to its transport's process group. Collected here, the group's threads end while the interpreter is
    # whole; left to a collection during finalization, gloo's teardown can abort the process (exit 134).
    gc.collect()
