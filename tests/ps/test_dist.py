"""The parameter server with real processes: `gradsync launch`, client groups, killed workers, a restarted server."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gradsync.launch import free_port, run_workers, torchrun_env
from gradsync.ps.env import CLIENTS_ENV, SERVERS_ENV
from gradsync.ps.launch import PSJob, launch, start_server

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, str(ROOT / "tests" / "workers" / "ps_worker.py")]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _ok_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " OK " in f" {line.split('] ', 1)[-1]} "]


@pytest.mark.parametrize("kind,workers,servers,clients", [
    ("dist_sync", 3, 2, 0), ("hybrid_sync", 4, 1, 2), ("collective", 2, 0, 0),
])
def test_push_pull_oracle_under_gradsync_launch(kind: str, workers: int, servers: int, clients: int) -> None:
    cmd = [sys.executable, "-m", "gradsync", "launch", "-n", str(workers), "-s", str(servers), "-c", str(clients),
           "--timeout", "120", "--", *WORKER, "oracle", kind]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    oks = _ok_lines(p.stdout)
    assert len(oks) == workers, p.stdout[-3000:]
    if servers:
        assert f"[server {servers - 1}] " in p.stdout  # the servers ran and logged


def test_killed_worker_async_others_go_on() -> None:
    out = io.StringIO()
    rc = launch([*WORKER, "async_killed"], PSJob(workers=3, servers=1, timeout_s=90), env=ENV, stream=out)
    text = out.getvalue()
    assert rc == 137, text[-3000:]  # rank 2's SIGKILL is the job's exit code
    assert {line.split("]")[0] for line in _ok_lines(text)} == {"[rank 0", "[rank 1"}, text[-3000:]


def test_killed_worker_sync_survivors_name_it() -> None:
    out = io.StringIO()
    t0 = time.monotonic()
    rc = launch([*WORKER, "sync_killed"], PSJob(workers=3, servers=1, timeout_s=90), env=ENV, stream=out)
    text = out.getvalue()
    assert rc == 137, text[-3000:]
    oks = _ok_lines(text)
    assert len(oks) == 2 and all("peer=2" in line and "client(s) [2]" in line for line in oks), text[-3000:]
    assert time.monotonic() - t0 < 60


def test_killed_server_restarts_from_checkpoint(tmp_path: Path) -> None:
    """SIGKILL the only server mid-training, start a new one on the same address from its checkpoint
    (written every update): both workers finish every round with the closed-form value."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    lock = threading.Lock()
    out = io.StringIO()
    server = start_server(0, endpoint, checkpoint_dir=str(tmp_path), checkpoint_every=1, env=ENV, stream=out, lock=lock)
    base = {**ENV, SERVERS_ENV: endpoint, CLIENTS_ENV: "2"}
    port = free_port()
    envs = [torchrun_env(r, 2, "127.0.0.1", port, base) for r in range(2)]
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(
        run_workers([[*WORKER, "restart", "40"]] * 2, envs, timeout=120, stream=out)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while "server-0.npz" not in {p.name for p in tmp_path.iterdir()} and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # some rounds in
        server.kill()
        time.sleep(0.5)
        server = start_server(0, endpoint, checkpoint_dir=str(tmp_path), checkpoint_every=1, env=ENV, stream=out,
                              lock=lock)
        t.join(timeout=150)
    finally:
        server.stop()
    text = out.getvalue()
    assert result == [0], text[-4000:]
    assert len(_ok_lines(text)) == 2 and "restored" in text, text[-4000:]
    assert not any(p.name.startswith("server-0.tmp") for p in tmp_path.iterdir())


def test_every_algorithm_trains_on_shared_servers() -> None:
    """dist/mpi/collective SGD equal single-process SGD on the union batch (1e-5); ASGD, ESGD and local SGD
    learn the digits (> 0.75), all on 4 workers and 2 servers, hybrid kinds in 2 clients."""
    from gradsync.train.ps_trainer import ALGORITHMS

    out = io.StringIO()
    rc = launch([*WORKER, "algorithms"], PSJob(workers=4, servers=2, timeout_s=240), env=ENV, stream=out)
    text = out.getvalue()
    assert rc == 0, text[-4000:]
    oks = _ok_lines(text)
    for name in ALGORITHMS.names():
        assert sum(f" OK {name} rank " in f" {line.split('] ', 1)[1]}" for line in oks) == 4, (name, text[-4000:])


def test_compression_through_the_parameter_server() -> None:
    out = io.StringIO()
    rc = launch([*WORKER, "compress_ps"], PSJob(workers=2, servers=1, timeout_s=120), env=ENV, stream=out)
    text = out.getvalue()
    assert rc == 0 and len(_ok_lines(text)) == 2, text[-4000:]
