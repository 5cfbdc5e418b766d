"""Run one worker per emulated server, as torchrun would on a real cluster.

Each worker runs inside its server's namespace (``ip netns exec``) with the torchrun environment and
``GLOO_SOCKET_IFNAME`` set to the server's primary NIC: gloo then binds to and advertises the primary
address, which every other server reaches through the planned routes (via relays on BCube). Output is
streamed line by line with a ``[rank N]`` prefix. When a worker fails the others are stopped after a short
grace period (a collective would otherwise hang until its timeout), like torchrun does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TextIO

from gradsync.launch import TIMEOUT_EXIT, free_port, run_workers, torchrun_env
from gradsync.testbed import netns
from gradsync.testbed.build import TestbedPlan
from gradsync.testbed.control import STATE_ENV, load_state, resolve_state_path
from gradsync.testbed.errors import TestbedError

__all__ = ["run", "worker_env", "TIMEOUT_EXIT"]


def worker_env(plan: TestbedPlan, rank: int, world: Sequence[int], master_port: int, state: str,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun's variables for process ``rank`` of ``world`` (server ranks), plus the interface settings."""
    server = plan.server(world[rank])
    env = torchrun_env(rank, len(world), plan.server(world[0]).address, master_port, base)
    env.update({
        # one worker per emulated host: each is local rank 0 of its own node
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(rank),
        "GLOO_SOCKET_IFNAME": server.ifname,
        "TP_SOCKET_IFNAME": server.ifname,
        "NCCL_SOCKET_IFNAME": server.ifname,
        "GRADSYNC_TESTBED_ADDR": server.address,
        # which NIC ends which topology link (gradsync.comm.nics, read by the runtime's watch, which drops a link
        # whose NIC loses its carrier; the testbed sits below the runtime, so the name is written out here)
        "GRADSYNC_NICS": ",".join(f"{n.ifname}={server.device}/{n.peer}" for n in server.nics),
        STATE_ENV: state,
    })
    return env


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
    port = master_port or free_port()
    extra = dict(env or {})
    commands, envs = [], []
    for i, server_rank in enumerate(world):
        wenv = worker_env(plan, i, world, port, str(path.resolve()), {**os.environ, **extra})
        wenv.update(extra)
        commands.append(netns.ns_exec(plan.server(server_rank).namespace, list(cmd)))
        envs.append(wenv)
    return run_workers(commands, envs, timeout=timeout, stream=stream)
