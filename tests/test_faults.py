"""Faults with real processes: a killed server, a killed launcher, a failing rank. Each must end in a clear
error within a stated bound, never a hang, a traceback or an orphan (issue 19)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gradsync.errors import CommError
from gradsync.launch import free_port
from gradsync.ps.kvstore import KVStoreConfig, PSKVStore
from gradsync.ps.launch import ServerProcess, start_server

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _server(out: io.StringIO) -> ServerProcess:
    """A server process on a free loopback port, returned once it listens."""
    server = start_server(0, f"tcp://127.0.0.1:{free_port()}", env=ENV, stream=out, lock=threading.Lock())
    deadline = time.monotonic() + 60
    while "listening" not in out.getvalue():
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"the server did not start: {out.getvalue()[-2000:]}")
        time.sleep(0.05)
    return server


def test_killed_server_gives_a_clear_error_within_three_request_timeouts() -> None:
    """SIGKILL the only server between rounds: the next pushpull raises CommError naming the endpoint and
    what to check, within 3x the 2 s request timeout (it used to recurse into RecursionError after minutes)."""
    out = io.StringIO()
    server = _server(out)
    try:
        kv = PSKVStore(KVStoreConfig(rank=0, num_workers=1, servers=(server.endpoint,), timeout_s=2.0, retry_s=0.5),
                       sync=True, hybrid=False)
        kv.init("w", torch.zeros(4))
        got = torch.empty(4)
        kv.pushpull("w", torch.ones(4), got)
        assert torch.equal(got, torch.ones(4))
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(CommError) as e:
            kv.pushpull("w", torch.ones(4), torch.empty(4))
        elapsed = time.monotonic() - t0
        kv.close()
    finally:
        server.kill()
    message = str(e.value)
    assert elapsed < 3 * 2.0, elapsed
    assert server.endpoint in message and "key 'w'" in message and "still running" in message, message


# ---- the launcher ---------------------------------------------------------------------------------------
def _gradsync(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradsync", *args]


def _children_of(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc), so the test knows what the launcher started."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


#: a worker that starts a grandchild (its own `sleep`) and then waits forever
SLEEPER = ("import subprocess, sys, time; subprocess.Popen(['sleep', '300']); print('ready', flush=True); "
           "time.sleep(300)")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launch_ends_every_process_it_started(sig: signal.Signals) -> None:
    """SIGTERM/SIGINT to `gradsync launch`: 5 s later no server, worker or worker's child is alive
    (SIGTERM used to orphan the servers, still listening)."""
    launcher = subprocess.Popen(_gradsync("launch", "-n", "2", "-s", "1", "--", sys.executable, "-c", SLEEPER),
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        # 2 workers + their 2 sleeps + 1 server (the launcher's own interpreter has no other children)
        while len(started := _children_of(launcher.pid)) < 5:
            assert launcher.poll() is None and time.monotonic() < deadline, (started, launcher.communicate())
            time.sleep(0.1)
        time.sleep(0.5)  # the grandchildren exist; let the server finish importing
        started = _children_of(launcher.pid)
        launcher.send_signal(sig)
        t0 = time.monotonic()
        out, err = launcher.communicate(timeout=5)
        assert time.monotonic() - t0 < 5
        time.sleep(max(0.0, 5 - (time.monotonic() - t0)))
        assert [p for p in started if _alive(p)] == []
    finally:
        for p in started:  # only what this test's launcher started
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + sig, (launcher.returncode, err)
    assert f"stopped by {sig.name}" in err and "Traceback" not in err, err


def test_failing_rank_is_named_with_its_code_and_output() -> None:
    worker = ("import os, sys; r = os.environ['RANK']; print('hello from rank', r, flush=True); "
              "sys.exit(3 if r == '1' else 0)")
    p = subprocess.run(_gradsync("launch", "-n", "2", "-s", "1", "--", sys.executable, "-c", worker), env=ENV,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 3, p.stderr
    assert "[rank 1] exited first, exit code 3" in p.stderr and "  hello from rank 1" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_dead_server_ends_the_job_naming_it() -> None:
    """SIGKILL the server of a running job: launch exits within 3x the request timeout (3 s), naming the
    server, its endpoint and its exit code, and leaves nothing running."""
    launcher = subprocess.Popen(
        _gradsync("launch", "-n", "2", "-s", "1", "--request-timeout", "3", "--", sys.executable, "-c", SLEEPER),
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(started := _children_of(launcher.pid)) < 5:
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.1)
        server = [p for p in started if b"gradsync.ps.server" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(server) == 1
        os.kill(server[0], signal.SIGKILL)
        t0 = time.monotonic()
        out, err = launcher.communicate(timeout=3 * 3)
        assert time.monotonic() - t0 < 3 * 3
        time.sleep(0.5)
        assert [p for p in started if _alive(p)] == []
    finally:
        for p in started:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 137, err
    assert "[server 0] (tcp://127.0.0.1:" in err and "exit code 137 (killed by SIGKILL)" in err, err


@pytest.mark.parametrize("args, message", [
    (["launch", "-n", "2", "--", "/no/such/cmd"], "cannot run '/no/such/cmd': no such executable file"),
    (["launch", "-n", "1", "--", "no-such-program-gradsync"], "not found on PATH"),
    (["run", "-n", "1", "--", "/no/such/cmd"], "cannot run '/no/such/cmd'"),
    (["launch", "-n", "1", "--request-timeout", "-1", "--", "true"], "--request-timeout -1.0 must be"),
    (["launch", "-n", "1", "--request-timeout", "0", "--", "true"], "--request-timeout 0.0 must be"),
    (["launch", "-n", "1", "--timeout", "nan", "--", "true"], "--timeout nan must be a finite"),
    (["launch", "-n", "1", "--checkpoint-interval", "-2", "--", "true"], "--checkpoint-interval -2.0 must be"),
    (["launch", "-n", "1", "--checkpoint-every", "-1", "--", "true"], "--checkpoint-every -1 must be"),
    (["run", "-n", "1", "--timeout", "-5", "--", "true"], "timeout -5.0 must be"),
])
def test_launcher_bad_input_is_one_line_with_exit_2(args: list[str], message: str) -> None:
    p = subprocess.run(_gradsync(*args), env=ENV, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("gradsync: error: ") and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "[server" not in p.stdout
