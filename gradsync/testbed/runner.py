"""Run one worker per emulated server, as torchrun would on a real cluster.

Each worker runs inside its server's namespace (``ip netns exec``) with the torchrun environment and
``GLOO_SOCKET_IFNAME`` set to the server's primary NIC: gloo then binds to and advertises the primary
address, which every other server reaches through the planned routes (via relays on BCube). Output is
streamed line by line with a ``[rank N]`` prefix. When a worker fails the others are stopped after a short
grace period (a collective would otherwise hang until its timeout), like torchrun does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from gradsync.testbed import netns
from gradsync.testbed.build import TestbedPlan
from gradsync.testbed.control import STATE_ENV, load_state, resolve_state_path
from gradsync.testbed.errors import TestbedError

__all__ = ["run", "worker_env", "TIMEOUT_EXIT"]

#: Exit code ``run`` returns when the timeout stopped the workers (as coreutils ``timeout`` does).
TIMEOUT_EXIT = 124
#: Seconds the other workers get to finish on their own after one failed.
_GRACE_S = 5.0


def _free_port() -> int:
    """A port nobody listens on; the namespaces are fresh, so one free here is free in rank 0's namespace too
    unless two runs share the testbed at the same moment."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(plan: TestbedPlan, rank: int, world: Sequence[int], master_port: int, state: str,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun's variables for process ``rank`` of ``world`` (server ranks), plus the interface settings."""
    server = plan.server(world[rank])
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank),
        "WORLD_SIZE": str(len(world)),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(rank),
        "MASTER_ADDR": plan.server(world[0]).address,
        "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": server.ifname,
        "TP_SOCKET_IFNAME": server.ifname,
        "NCCL_SOCKET_IFNAME": server.ifname,
        "GRADSYNC_TESTBED_ADDR": server.address,
        STATE_ENV: state,
    })
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _pump(proc: subprocess.Popen[str], label: str, stream: TextIO, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        with lock:
            stream.write(f"{label} {line if line.endswith(chr(10)) else line + chr(10)}")
            stream.flush()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N, as a shell reports it


def run(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout: float | None = None, *,
        ranks: Sequence[int] | None = None, state_path: str | os.PathLike[str] | None = None,
        stream: TextIO | None = None, master_port: int | None = None) -> int:
    """Start ``cmd`` once per server (or per server in ``ranks``) and return the worst exit code.

    Process ``i`` gets ``RANK=i`` and runs on server ``ranks[i]``; ``MASTER_ADDR`` is that first server's
    primary address. ``env`` adds to (and overrides) this process's environment. Returns 0 when all
    succeed, else the failing code with the largest magnitude (124 on timeout).
    """
    if not cmd:
        raise TestbedError("nothing to run: give a command, e.g. gradsync testbed run -- python train.py")
    netns.require()
    path = resolve_state_path(state_path)
    plan = load_state(path)
    world = list(range(plan.world_size)) if ranks is None else [int(r) for r in ranks]
    if not world or len(set(world)) != len(world):
        raise TestbedError(f"ranks {list(world)} must name distinct servers")
    for r in world:
        plan.server(r)
    missing = [ns for ns in (plan.server(r).namespace for r in world) if ns not in netns.list_netns(plan.prefix)]
    if missing:
        raise TestbedError(f"namespaces {missing} are gone; run 'gradsync testbed down' and 'up' again")
    port = master_port or _free_port()
    out = stream or sys.stdout
    lock = threading.Lock()
    extra = dict(env or {})
    procs: list[subprocess.Popen[str]] = []
    pumps: list[threading.Thread] = []
    try:
        for i, server_rank in enumerate(world):
            base = {**os.environ, **extra}
            wenv = worker_env(plan, i, world, port, str(path.resolve()), base)
            wenv.update(extra)
            proc = subprocess.Popen(
                netns.ns_exec(plan.server(server_rank).namespace, list(cmd)), env=wenv, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
            )
            procs.append(proc)
            t = threading.Thread(target=_pump, args=(proc, f"[rank {i}]", out, lock), daemon=True)
            t.start()
            pumps.append(t)
        codes = _wait(procs, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
        for t in pumps:
            t.join(timeout=5)
    worst = 0
    for c in codes:
        if abs(c) > abs(worst):
            worst = c
    return worst


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _wait(procs: list[subprocess.Popen[str]], timeout: float | None) -> list[int]:
    """Exit codes once all are done. On timeout the still-running ones count as 124; after a failure the
    ones stopped by us are left out, so the code that is reported is the real failure's."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        rcs = [p.poll() for p in procs]
        if all(rc is not None for rc in rcs):
            return [_exit_code(rc) for rc in rcs if rc is not None]
        now = time.monotonic()
        if failed_at is None and any(rc not in (None, 0) for rc in rcs):
            failed_at = now
        timed_out = deadline is not None and now > deadline
        if timed_out or (failed_at is not None and now - failed_at > _GRACE_S):
            codes = []
            for p, rc in zip(procs, rcs):
                if rc is None:
                    _kill(p)
                    if timed_out:
                        codes.append(TIMEOUT_EXIT)
                else:
                    codes.append(_exit_code(rc))
            return codes
        time.sleep(0.05)
