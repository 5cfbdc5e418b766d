"""``gradsync launch --workers W --servers S --clients C -- python train.py``: a PS job on this machine.

As MXNET-MPI §4.1.2's launcher: it starts the S servers first (loopback, free ports), tells every worker
where they are through the environment the KVStore reads (``GRADSYNC_PS_SERVERS``, ``GRADSYNC_PS_CLIENTS``,
plus torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_*`` for the client groups), runs the W workers with
:func:`gradsync.launch.run_workers`, and stops the servers (SIGTERM: they checkpoint, if asked to, and exit)
when the workers are done. ``--servers 0`` is the pure-collective end of the range.

``--testbed`` runs the same job on the emulated cluster that ``gradsync testbed up`` built: every server and
worker inside a server namespace (:class:`Placement`), servers bound to their host's address, workers with
the testbed runner's environment (:func:`gradsync.testbed.runner.worker_env`), so the PS traffic crosses the
emulated links. Workers take hosts ``0..W-1``; servers take the next ``S`` hosts (on their own, as MXNET-MPI's
dist-SGD servers) or, with ``--colocate``, server ``i`` shares worker ``i mod W``'s host.

Secure by default: unless the user set ``GRADSYNC_PS_SECRET``, each job gets a random secret
(:func:`secrets.token_hex`) and a random job id (``GRADSYNC_PS_JOB``), handed to its servers and workers
through their environment only (never a command line, which other users can read). A local process that
was not given them cannot push to, read from or stop the job's servers.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from gradsync.errors import GradsyncError
from gradsync.launch import (
    TAIL_LINES,
    Child,
    Terminated,
    check_command,
    check_count,
    check_timeout,
    free_port,
    guard_group,
    kill_group,
    pump,
    run_workers,
    torchrun_env,
)
from gradsync.ps.env import CLIENTS_ENV, JOB_ENV, SECRET_ENV, SERVERS_ENV, TIMEOUT_ENV

__all__ = ["PSJob", "Placement", "ServerProcess", "start_server", "stop_servers", "launch", "job_env", "place"]


@dataclass(frozen=True)
class PSJob:
    """The shape of a PS job: W workers in C clients, S servers, and how servers checkpoint."""

    workers: int
    servers: int = 1
    clients: int = 0  # 0: one per worker
    host: str = "127.0.0.1"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_interval_s: float = 0.0
    timeout_s: float | None = None  # the whole job
    request_timeout_s: float | None = None  # one KVStore request (GRADSYNC_PS_TIMEOUT)
    testbed: bool = False  # run inside the emulated cluster's namespaces (gradsync testbed up)
    colocate: bool = False  # testbed: server i on worker i's host instead of a host of its own
    testbed_state: str | None = None  # testbed state file (default: the one `gradsync testbed up` wrote)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise GradsyncError(f"--workers {self.workers}: a job needs at least one worker")
        if self.servers < 0:
            raise GradsyncError(f"--servers {self.servers} must be >= 0 (0: collective, no servers)")
        check_count(self.workers + self.servers, f"--workers {self.workers} and --servers {self.servers}")
        c = self.clients or self.workers
        if not 1 <= c <= self.workers or self.workers % c:
            raise GradsyncError(f"--clients {self.clients} must divide --workers {self.workers} into equal groups")
        if self.checkpoint_every < 0:
            raise GradsyncError(f"--checkpoint-every {self.checkpoint_every} must be >= 0 (0: off)")
        check_timeout("--checkpoint-interval", self.checkpoint_interval_s, allow_zero=True)
        check_timeout("--timeout", self.timeout_s)
        check_timeout("--request-timeout", self.request_timeout_s)
        if self.colocate and not self.testbed:
            raise GradsyncError("--colocate places servers on testbed hosts; add --testbed (on this machine every "
                                "process shares one host anyway)")


@dataclass(frozen=True)
class Placement:
    """Where a job's processes run: the address each server binds, how a command is run on a server's or a
    worker's host, and the workers' environments (torchrun's variables for the client groups)."""

    server_hosts: tuple[str, ...]
    server_argv: Callable[[int, list[str]], list[str]]
    worker_argv: Callable[[int, list[str]], list[str]]
    worker_envs: Callable[[Mapping[str, str]], list[dict[str, str]]]
    where: str


def _local(job: PSJob) -> Placement:
    def envs(base: Mapping[str, str]) -> list[dict[str, str]]:
        port = free_port()
        return [torchrun_env(r, job.workers, job.host, port, base) for r in range(job.workers)]

    return Placement((job.host,) * job.servers, lambda i, argv: argv, lambda i, argv: argv, envs, "this machine")


def _testbed(job: PSJob) -> Placement:
    from gradsync.testbed import netns
    from gradsync.testbed.control import load_state, resolve_state_path
    from gradsync.testbed.runner import worker_env

    netns.require()
    path = resolve_state_path(job.testbed_state)
    plan = load_state(path)
    hosts = plan.world_size
    need = job.workers + (0 if job.colocate else job.servers)
    if need > hosts:
        raise GradsyncError(
            f"--testbed: {job.workers} workers and {job.servers} servers on hosts of their own need {need} hosts; "
            f"the testbed {plan.topology} has {hosts}. Add --colocate (server i on worker i's host), run fewer "
            f"processes, or bring up a larger topology")
    workers = list(range(job.workers))
    servers = [i % job.workers if job.colocate else job.workers + i for i in range(job.servers)]

    def envs(base: Mapping[str, str]) -> list[dict[str, str]]:
        port = free_port()
        return [worker_env(plan, r, workers, port, str(path.resolve()), base) for r in workers]

    return Placement(tuple(plan.server(h).address for h in servers),
                     lambda i, argv: netns.ns_exec(plan.server(servers[i]).namespace, argv),
                     lambda i, argv: netns.ns_exec(plan.server(workers[i]).namespace, argv), envs,
                     f"testbed {plan.topology} (workers on hosts 0-{job.workers - 1}, servers on hosts "
                     f"{', '.join(map(str, servers)) or 'none'})")


def place(job: PSJob) -> Placement:
    """The job's :class:`Placement`: this machine's loopback, or the testbed's namespaces (``job.testbed``)."""
    return _testbed(job) if job.testbed else _local(job)


@dataclass
class ServerProcess:
    """A server started by :func:`start_server`: its process (leading its own session) and last lines."""

    proc: subprocess.Popen[str]
    endpoint: str
    index: int
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))

    def child(self) -> Child:
        """This server as a process :func:`~gradsync.launch.run_workers` watches."""
        return Child(f"[server {self.index}] ({self.endpoint})", self.proc, self.tail)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (it checkpoints, if asked to, and exits); its group killed after ``timeout``."""
        stop_servers([self], timeout)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (tests use it; no final checkpoint)."""
        kill_group(self.proc)


def stop_servers(servers: Sequence[ServerProcess], timeout: float = 10.0) -> None:
    """SIGTERM every server at once, give them ``timeout`` seconds in all, then kill their groups."""
    for s in servers:
        if s.proc.poll() is None:
            try:
                s.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for s in servers:
        try:
            s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill_group(s.proc)  # still running, or something it started


def start_server(index: int, endpoint: str, *, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 checkpoint_interval_s: float = 0.0, env: Mapping[str, str] | None = None,
                 stream: TextIO | None = None, lock: threading.Lock | None = None,
                 argv: Callable[[list[str]], list[str]] | None = None) -> ServerProcess:
    """Start ``python -m gradsync.ps.server`` bound to ``endpoint``; its output is prefixed ``[server i]``.
    ``argv`` wraps the command (e.g. into a testbed namespace)."""
    cmd = [sys.executable, "-m", "gradsync.ps.server", "--bind", endpoint, "--id", str(index)]
    if checkpoint_dir:
        cmd += ["--checkpoint-dir", checkpoint_dir]
    if checkpoint_every:
        cmd += ["--checkpoint-every", str(checkpoint_every)]
    if checkpoint_interval_s:
        cmd += ["--checkpoint-interval", str(checkpoint_interval_s)]
    proc = subprocess.Popen(argv(cmd) if argv else cmd, env=dict(env or os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    guard_group(proc)
    server = ServerProcess(proc, endpoint, index)
    threading.Thread(target=pump, args=(proc, f"[server {index}]", stream or sys.stdout, lock or threading.Lock(),
                                        server.tail), daemon=True).start()
    return server


def job_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus a random per-job secret and job id, each unless the user set one."""
    env = dict(base)
    if not env.get(SECRET_ENV):
        env[SECRET_ENV] = secrets.token_hex(32)
    if not env.get(JOB_ENV, "").strip():
        env[JOB_ENV] = secrets.token_hex(8)
    return env


def launch(cmd: Sequence[str], job: PSJob, *, env: Mapping[str, str] | None = None,
           stream: TextIO | None = None) -> int:
    """Run ``cmd`` as ``job.workers`` workers against ``job.servers`` fresh servers; the workers' exit code.

    A server that exits while the workers run ends the job (after a short grace), reported by name; every
    process started here is ended before this returns or raises (SIGTERM to the launcher included)."""
    if not cmd:
        raise GradsyncError("nothing to run: gradsync launch --workers 4 --servers 1 -- python train.py")
    base = {**os.environ, **(env or {})}
    check_command(cmd, base)  # before any server is started
    where = place(job)
    if job.testbed:
        print(f"gradsync launch: {job.workers} workers, {job.servers} servers on the {where.where}",
              file=stream or sys.stdout, flush=True)
    if job.servers:
        base = job_env(base)
    lock = threading.Lock()
    servers: list[ServerProcess] = []
    stop_s = 10.0
    try:
        ports: set[int] = set()
        for i in range(job.servers):
            port = free_port()
            while port in ports:  # co-located servers share an address: never one port twice
                port = free_port()
            ports.add(port)
            servers.append(start_server(i, f"tcp://{where.server_hosts[i]}:{port}", checkpoint_dir=job.checkpoint_dir,
                                        checkpoint_every=job.checkpoint_every,
                                        checkpoint_interval_s=job.checkpoint_interval_s, env=base, stream=stream,
                                        lock=lock, argv=lambda argv, i=i: where.server_argv(i, argv)))
        time.sleep(0.05)
        dead = [s for s in servers if s.proc.poll() is not None]
        if dead:
            raise GradsyncError(f"server {dead[0].index} exited at start with code {dead[0].proc.returncode}")
        base[SERVERS_ENV] = ",".join(s.endpoint for s in servers)
        base[CLIENTS_ENV] = str(job.clients or job.workers)
        if job.request_timeout_s:
            base[TIMEOUT_ENV] = str(job.request_timeout_s)
        envs = where.worker_envs(base)
        return run_workers([where.worker_argv(r, list(cmd)) for r in range(job.workers)], envs, timeout=job.timeout_s,
                           stream=stream, watch=[s.child() for s in servers])
    except Terminated:
        stop_s = 2.0  # nothing may outlive the launcher by more than a few seconds
        raise
    finally:
        stop_servers(servers, stop_s)
