"""Start the tests' worker ranks by forking a process that has already imported torch and gradsync.

Why: a worker rank spends 4-9 s of CPU importing torch, gradsync, ``torch._dynamo`` (the first optimizer or DDP
imports it) and scikit-learn's datasets before its scenario starts. The suite starts about a hundred such ranks
on two cores. A zygote (Android's name for the same trick) imports them once, then forks a child per rank. The
child sets the rank's environment, argv and working directory, redirects its output to the rank's log and runs
the worker script as ``__main__``: what ``python script`` would do, less the imports. PyTorch's DataLoader forks
its workers after these imports the same way.

What a child keeps from a fresh interpreter:
- its own string hash seed: each rank index has its own zygote, so rank 0 and rank 1 hash strings differently, as
  two fresh processes do, and a set iterated in a different order on two ranks still shows;
- its environment at import time: a zygote serves only requests whose environment, less the per-rank variables
  a launcher sets, is the one it imported under; any other request gets a fresh interpreter;
- no threads of the zygote but the one that forks (the zygote runs no thread of its own and no parallel kernel);
- unseeded random draws of its own: torch's and numpy's generators are seeded from the OS after the fork.

The zygote is test infrastructure only: gradsync's own launchers (``gradsync run``, ``gradsync launch``) start
fresh interpreters, and the tests of those launchers go through them. ``GRADSYNC_TEST_ZYGOTE=0`` turns it off.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
#: What a zygote imports before it serves: torch and its parts every worker would import anyway, the library, and
#: the dataset loader the training workers use. Only imports: a zygote runs no kernel and starts no thread.
PRELOAD = ("torch", "torch._dynamo", "gradsync", "gradsync.comm", "gradsync.compress", "gradsync.train",
           "gradsync.models", "gradsync.models.data", "sklearn.datasets", "tests.dist_launch")
#: The variables a launcher sets per rank (gradsync.launch.torchrun_env), and pytest's name of the running test: the
#: rest of a request's environment must equal the zygote's. ``OMP_NUM_THREADS`` is not among them: OpenMP reads it
#: when torch loads it, in the zygote (a child would keep the zygote's thread count), so a zygote imports under the
#: value its children run with. ``PYTHONUNBUFFERED`` is: a child sets its streams up as it says (:func:`_fresh_stdio`).
PER_RANK = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST"})
#: Bounds on each wait for a zygote: its imports (a loaded two-core host), and one reply.
START_TIMEOUT_S, REPLY_TIMEOUT_S = 180.0, 30.0
#: How often a wait on a forked child asks its zygote.
POLL_S = 0.02


def enabled() -> bool:
    """Whether launches fork from zygotes (``GRADSYNC_TEST_ZYGOTE``, on by default where ``os.fork`` exists)."""
    return hasattr(os, "fork") and os.environ.get("GRADSYNC_TEST_ZYGOTE", "1").strip().lower() not in ("0", "false", "no", "off")


def _shared(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_RANK}


class ForkedProcess:
    """One rank forked by a zygote, with the part of :class:`subprocess.Popen` that a launch uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout)
            time.sleep(POLL_S)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """A preloaded interpreter, talked to over its stdin and stdout, one JSON line a request and a reply."""

    def __init__(self, shared: dict[str, str]) -> None:
        """Start one under ``shared``, the environment less the per-rank variables (:func:`_shared`)."""
        self.shared = shared
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.zygote"], env=shared, cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._ready = False  # read at the first request, so that several zygotes import side by side

    def _await_ready(self) -> None:
        if not self._ready:
            ready = self._reply(START_TIMEOUT_S)
            if ready.get("ready") is not True:
                raise RuntimeError(f"a test zygote did not start: {ready}")
            self._ready = True

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        out: IO[str] = self._proc.stdout  # type: ignore[assignment]
        readable, _, _ = select.select([out], [], [], timeout_s)
        line = out.readline() if readable else ""
        if not line:
            self.close()
            raise RuntimeError(f"a test zygote gave no reply within {timeout_s:.0f} s (exit code {self._proc.poll()})")
        return json.loads(line)

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self._await_ready()
        self._proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        return self._reply(REPLY_TIMEOUT_S)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
        """Fork a child that runs ``python *argv`` (``argv[0]`` a script) with ``env``, writing to ``log``."""
        reply = self._ask({"op": "spawn", "argv": argv, "env": env, "cwd": str(cwd), "log": str(log)})
        return ForkedProcess(self, int(reply["pid"]))

    def exit_code(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["code"]

    def close(self) -> None:
        """End the zygote (it kills any child still running) and wait for it."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()  # type: ignore[union-attr]
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()


#: Ranks 0..MAX_RANKS-1 fork from zygotes (one each, up to about 0.5 GiB apiece); a larger job's other ranks start
#: fresh interpreters.
MAX_RANKS = 4
_ZYGOTES: dict[int, Zygote] = {}


def _zygote(rank: int, env: dict[str, str]) -> Zygote | None:
    """Rank ``rank``'s zygote for ``env``, started here if it has none, its last one died or imported under another
    environment; None where a fresh interpreter must run the rank (zygotes off, or a rank past MAX_RANKS)."""
    if not enabled() or rank >= MAX_RANKS:
        return None
    shared = _shared(env)
    z = _ZYGOTES.get(rank)
    if z is not None and (not z.alive() or z.shared != shared):
        z.close()
        z = None
    if z is None:
        z = _ZYGOTES[rank] = Zygote(shared)
    return z


def prepare(envs: list[dict[str, str]]) -> None:
    """Start the zygotes these ranks' environments need, side by side, without waiting for their imports."""
    for rank, env in enumerate(envs):
        _zygote(rank, env)


def spawn(rank: int, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess | None:
    """Fork rank ``rank`` from its zygote, or None where a fresh interpreter must run it (see :func:`_zygote`)."""
    z = _zygote(rank, env)
    return None if z is None else z.spawn(argv, env, cwd, log)


@atexit.register
def close_all() -> None:
    for z in _ZYGOTES.values():
        z.close()
    _ZYGOTES.clear()


# ---- the zygote's side ------------------------------------------------------------------------------------------
def _fresh_stdio(env: dict[str, str]) -> None:
    """Standard streams over the new descriptors, buffered as a fresh interpreter's would be under ``env``."""
    import io

    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stream, never closed
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    else:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def _fresh_random_state() -> None:
    """Seed torch's and numpy's global generators from the OS, as a fresh interpreter's are seeded: each fork would
    otherwise replay the zygote's streams (Python's ``random`` reseeds itself after a fork)."""
    import numpy as np
    import torch

    torch.seed()
    np.random.seed()


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python argv...`` and never return."""
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.close(request["reply_fd"])
        _fresh_stdio(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _fresh_random_state()
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy
        import threading
        import traceback

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit: join non-daemon threads
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    import importlib

    reply_fd = os.dup(1)  # replies go here; anything an import prints goes where stderr goes
    os.dup2(2, 1)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    children: set[int] = set()
    out = os.fdopen(reply_fd, "w")
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _run_child({**request, "reply_fd": reply_fd})
            children.add(pid)
            reply: dict[str, Any] = {"pid": pid}
        else:
            pid = int(request["pid"])
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 255 << 8
            code = os.waitstatus_to_exitcode(status) if done else None
            if done:
                children.discard(pid)
            reply = {"code": code}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for pid in children:  # the tests' process has gone: end what it started
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


if __name__ == "__main__":
    _serve()
