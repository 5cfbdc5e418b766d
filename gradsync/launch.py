"""Start one worker process per rank with torchrun's environment, stream their output, reap them.

One implementation for every place gradsync starts workers: the loopback launcher here (demo,
benchmarks, ``gradsync run``), the testbed's ``run`` (workers inside network namespaces) and, later, the
parameter-server launcher. When a worker fails, the others get a short grace period and are then killed,
as torchrun does: a collective would otherwise wait for its timeout. The failure is reported with the
failing process's label, exit code and last lines. Every child leads its own session, and is ended with
its whole process group, also when the launcher gets SIGTERM or SIGINT (:func:`end_on_signals`).

A launcher killed outright (SIGKILL, the OOM killer) runs no cleanup, so a watchdog does it: the first child
started also starts a small guard process (:func:`guard_group`), which learns each child's process group from a
pipe and, when the pipe closes without a goodbye (its launcher died), kills every group still listed:
workers, servers and whatever they started in their groups. ``PR_SET_PDEATHSIG`` would not do: it reaches
direct children only, and fires when the *thread* that started the child ends, not the process.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

from gradsync.errors import GradsyncError

__all__ = ["TIMEOUT_EXIT", "TAIL_LINES", "MAX_PROCESSES", "MAX_PROCESSES_ENV", "Child", "Terminated", "check_command",
           "check_count", "check_timeout", "end_on_signals", "free_port", "kill_group", "pump", "torchrun_env",
           "run_workers", "worker_command", "launch_local", "run_launcher", "guard_group"]

#: Exit code reported when the timeout stopped the workers (as coreutils ``timeout`` does).
TIMEOUT_EXIT = 124
#: Seconds the other workers get to finish on their own after one failed.
GRACE_S = 5.0
#: Lines of a failed process's output repeated in the failure report.
TAIL_LINES = 20
#: Most processes one launcher starts on this machine, unless ``MAX_PROCESSES_ENV`` says otherwise; also at
#: most :data:`PROCESSES_PER_CPU` per CPU. Tens of thousands of Python processes exhaust memory and the
#: process table long before they do any work: refused at once, not after minutes of silence.
MAX_PROCESSES = 4096
PROCESSES_PER_CPU = 64
MAX_PROCESSES_ENV = "GRADSYNC_MAX_PROCESSES"

#: The guard: reads "+PGID" / "-PGID" lines; at end of input without "bye", SIGKILLs every group listed.
_GUARD = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line == "bye":
        sys.exit(0)
    if line[:1] in "+-" and line[1:].isdigit():
        (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


class _Guard:
    """This process's guard (see the module docstring): started on first use, told goodbye at exit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.owner = 0
        os.register_at_fork(after_in_child=self._forget)
        atexit.register(self.close)

    def tell(self, line: str) -> None:
        with self.lock:
            if self.proc is None or self.owner != os.getpid():
                self.proc = subprocess.Popen([sys.executable, "-S", "-c", _GUARD], stdin=subprocess.PIPE, text=True,
                                             start_new_session=True, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)
                self.owner = os.getpid()
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # the guard is gone (killed by hand): nothing more to do than without one

    def close(self) -> None:
        """Goodbye: every child was ended by the launcher itself (``finally`` blocks), none is to be killed."""
        with self.lock:
            proc, self.proc = self.proc, None
            if proc is None or self.owner != os.getpid() or proc.stdin is None:
                return
            try:
                proc.stdin.write("bye\n")
                proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _forget(self) -> None:
        """In a forked child: drop the parent's pipe (its death, not ours, must close it), keep no guard."""
        if self.proc is not None and self.proc.stdin is not None:
            try:
                os.close(self.proc.stdin.fileno())
            except OSError:
                pass
        self.proc, self.lock = None, threading.Lock()


_guard = _Guard()


def guard_group(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """Have the guard kill ``proc``'s process group (it leads its own session) if this launcher dies
    without ending it; :func:`kill_group` takes it off the list."""
    _guard.tell(f"+{proc.pid}")


def check_count(n: int, what: str) -> None:
    """Refuse to start ``n`` processes (``what`` says which option asked for them) past :data:`MAX_PROCESSES`
    or :data:`PROCESSES_PER_CPU` per CPU, naming the limit and how to raise it."""
    text = os.environ.get(MAX_PROCESSES_ENV, "").strip()
    cpus = os.cpu_count() or 1
    if text:
        try:
            limit = int(text)
        except ValueError:
            raise GradsyncError(f"{MAX_PROCESSES_ENV}={text!r} is not an integer; e.g. {MAX_PROCESSES_ENV}=8192") from None
        source = f"{MAX_PROCESSES_ENV}={limit}"
    else:
        limit = min(MAX_PROCESSES, PROCESSES_PER_CPU * cpus)
        source = f"the lower of {MAX_PROCESSES} and {PROCESSES_PER_CPU} per CPU ({cpus} CPUs)"
    if n > limit:
        raise GradsyncError(f"{what}: {n} processes on one machine, more than the limit of {limit} ({source}); "
                            f"set {MAX_PROCESSES_ENV}=N to allow more")


class Terminated(BaseException):
    """SIGTERM or SIGINT reached a launcher: raised in its main thread so ``finally`` blocks end the children.

    A BaseException (as KeyboardInterrupt) so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def end_on_signals() -> Iterator[None]:
    """While inside: SIGTERM and SIGINT raise :class:`Terminated` (once; a second signal must not cut the
    cleanup short). Without this, SIGTERM ends the launcher at once and its children outlive it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; the caller owns signals there
        return
    fired: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if not fired:
            fired.append(signum)
            raise Terminated(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def check_timeout(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    """A clear error for a timeout that is not a finite positive number of seconds (None: no timeout)."""
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0 (0: off)" if allow_zero else "> 0"
        raise GradsyncError(f"{name} {value!r} must be a finite number of seconds {bound}")


def check_command(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Refuse a command whose program cannot be found, before anything is started."""
    if not cmd:
        raise GradsyncError("nothing to run: give a command, e.g. -- python train.py")
    exe = cmd[0]
    if os.sep in exe:
        found = os.path.isfile(exe) and os.access(exe, os.X_OK)
        where = "no such executable file"
    else:
        found = shutil.which(exe, path=(env or os.environ).get("PATH", os.defpath)) is not None
        where = "not found on PATH"
    if not found:
        raise GradsyncError(f"cannot run {exe!r}: {where}; check the command after --, e.g. -- python train.py")


def free_port() -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world_size: int, master_addr: str, master_port: int,
                 base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables torchrun sets for one single-node worker, on top of ``base`` (default: os.environ)."""
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
    })
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")  # N workers on few cores: one intra-op thread each
    return env


@dataclass(eq=False)
class Child:
    """A process a launcher started (in its own session, so its group can be ended), and its last lines."""

    label: str
    proc: subprocess.Popen[str]
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))


def pump(proc: subprocess.Popen[str], label: str, stream: TextIO, lock: threading.Lock,
         tail: deque[str] | None = None) -> None:
    """Copy ``proc``'s output to ``stream``, each line prefixed with ``label``; keep the last ones in ``tail``."""
    if proc.stdout is None:
        raise GradsyncError(f"{label}: started without a stdout pipe to read")
    for line in proc.stdout:
        line = line if line.endswith("\n") else line + "\n"
        if tail is not None:
            tail.append(line)
        with lock:
            stream.write(f"{label} {line}")
            stream.flush()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N, as a shell reports it


def _describe(code: int) -> str:
    if code > 128:
        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def kill_group(proc: subprocess.Popen[str], timeout: float = 5.0) -> None:
    """SIGKILL ``proc``'s process group (it leads its own session: that is it and what it started); reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    _guard.tell(f"-{proc.pid}")



@dataclass
class _Outcome:
    codes: list[int]
    first: Child | None = None  # the first to fail, worker or watched process
    first_code: int = 0
    timed_out: bool = False


def _wait(children: list[Child], timeout: float | None, watch: Sequence[Child] = ()) -> _Outcome:
    """Exit codes once all are done. On timeout the still-running ones count as 124; after a failure the
    ones stopped by us are left out, so the code that is reported is the real failure's. A ``watch``ed
    process (a server) that exits while the workers run is a failure of the job."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at: float | None = None
    out = _Outcome([])
    while True:
        rcs = [c.proc.poll() for c in children]
        if all(rc is not None for rc in rcs):
            out.codes = [_exit_code(rc) for rc in rcs if rc is not None]
            if out.first is None:  # they all ended between two polls: name one that failed
                failed = [(c, code) for c, code in zip(children, out.codes) if code != 0]
                if failed:
                    out.first, out.first_code = failed[0]
            return out
        now = time.monotonic()
        if failed_at is None:
            for c, rc in [*zip(children, rcs), *((w, w.proc.poll()) for w in watch)]:
                if rc is not None and (rc != 0 or any(c is w for w in watch)):
                    failed_at, out.first, out.first_code = now, c, _exit_code(rc)
                    break
        timed_out = deadline is not None and now > deadline
        if timed_out or (failed_at is not None and now - failed_at > GRACE_S):
            out.timed_out = timed_out and failed_at is None
            for c, rc in zip(children, rcs):
                if rc is None:
                    kill_group(c.proc)
                    if timed_out:
                        out.codes.append(TIMEOUT_EXIT)
                else:
                    out.codes.append(_exit_code(rc))
            return out
        time.sleep(0.05)


def _report(out: _Outcome, timeout: float | None, stream: TextIO) -> None:
    """Say which process failed first, how, and what it printed last (the others may only echo its loss)."""
    if out.first is not None:
        c = out.first
        how = _describe(out.first_code) if out.first_code else "exit code 0 while the workers still ran"
        lines = "".join(f"  {line}" for line in c.tail) or "  (no output)\n"
        stream.write(f"gradsync: job failed: {c.label} exited first, {how}; the others were stopped or "
                     f"finished on their own. Last {len(c.tail)} line(s) of its output:\n{lines}")
    elif out.timed_out:
        stream.write(f"gradsync: job stopped: still running after --timeout {timeout:g} s (exit {TIMEOUT_EXIT})\n")
    stream.flush()


def run_workers(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *, timeout: float | None = None,
                stream: TextIO | None = None, labels: Sequence[str] | None = None,
                watch: Sequence[Child] = ()) -> int:
    """Start ``commands[i]`` with ``envs[i]``; prefix each output line with ``labels[i]``; worst exit code.

    Returns 0 when all succeed, else the failing code of largest magnitude (124 on timeout); when a
    ``watch``ed process (a server) exits first, its code (1 if it exited 0). A failure is reported on
    ``stream`` (default stderr): which process, its exit code and the tail of its output. Every process
    started here is ended (its whole group) before this returns or raises, :class:`Terminated` included.
    """
    if len(commands) != len(envs):
        raise GradsyncError(f"{len(commands)} commands but {len(envs)} environments")
    check_timeout("timeout", timeout)
    for cmd, env in zip(commands, envs):
        check_command(cmd, env)
    out = stream or sys.stdout
    lock = threading.Lock()
    children: list[Child] = []
    pumps: list[threading.Thread] = []
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            label = labels[i] if labels else f"[rank {i}]"
            try:
                proc = subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, start_new_session=True)
            except OSError as e:
                raise GradsyncError(f"cannot start {label} {cmd[0]!r}: {e.strerror or e}; check the command "
                                    f"after --") from None
            guard_group(proc)
            child = Child(label, proc)
            children.append(child)
            t = threading.Thread(target=pump, args=(proc, label, out, lock, child.tail), daemon=True)
            t.start()
            pumps.append(t)
        result = _wait(children, timeout, watch)
    finally:
        for c in children:  # also what a finished worker left running in its group
            kill_group(c.proc)
        for t in pumps:
            t.join(timeout=5)
    _report(result, timeout, stream or sys.stderr)
    if result.first is not None and any(result.first is w for w in watch):
        return result.first_code or 1
    worst = 0
    for code in result.codes:
        if abs(code) > abs(worst):
            worst = code
    return worst


def worker_command(argv: Sequence[str], usage: str, error: type[Exception] = GradsyncError) -> list[str]:
    """The command after ``--`` on a launcher's command line; ``error(usage)`` when there is none."""
    cmd = list(argv)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise error(usage)
    return cmd


def launch_local(cmd: Sequence[str], world_size: int, *, env: Mapping[str, str] | None = None,
                 timeout: float | None = None, stream: TextIO | None = None) -> int:
    """Run ``cmd`` as ``world_size`` workers on this machine over loopback, like ``torchrun --standalone``."""
    if not cmd:
        raise GradsyncError("nothing to run: give a command, e.g. python train.py")
    if world_size < 1:
        raise GradsyncError(f"world_size={world_size} must be >= 1")
    check_count(world_size, f"--workers {world_size}")
    check_timeout("timeout", timeout)
    port = free_port()
    base = {**os.environ, **(env or {})}
    envs = [torchrun_env(r, world_size, "127.0.0.1", port, base) for r in range(world_size)]
    return run_workers([list(cmd)] * world_size, envs, timeout=timeout, stream=stream)


def stop_group(proc: subprocess.Popen[str], grace_s: float) -> None:
    """SIGTERM ``proc``'s group, then SIGKILL it after ``grace_s``: for a launcher (mpirun) that ends the
    ranks it started on SIGTERM, wherever they sit, but not on SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)


def run_launcher(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
                 grace_s: float = 3.0, stream: TextIO | None = None) -> int:
    """Run another launcher (``mpirun -n N ...``) as one child leading its own session; its exit code.

    Its output goes straight through (it labels its ranks itself). When this process gets SIGTERM/SIGINT
    (inside :func:`end_on_signals`), or ``timeout`` passes, the launcher gets SIGTERM, so it can end its
    ranks, and its group SIGKILL ``grace_s`` later: nothing it started outlives this call by much more."""
    check_timeout("timeout", timeout)
    check_command(cmd, env)
    out = stream or sys.stderr
    try:
        proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env), start_new_session=True)
    except OSError as e:
        raise GradsyncError(f"cannot start {cmd[0]!r}: {e.strerror or e}") from None
    guard_group(proc)
    try:
        try:
            rc = _exit_code(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            stop_group(proc, grace_s)
            out.write(f"gradsync: job stopped: still running after --timeout {timeout:g} s (exit {TIMEOUT_EXIT})\n")
            return TIMEOUT_EXIT
    finally:
        stop_group(proc, grace_s)  # Terminated on the way out, or what the launcher left in its group
    if rc:
        out.write(f"gradsync: {os.path.basename(cmd[0])} exited with {_describe(rc)} (its output above names the "
                  f"failing rank)\n")
    return rc
