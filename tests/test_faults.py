"""Faults with real processes: a killed server, a killed launcher, a failing rank. Each must end in a clear
error within a stated bound, never a hang, a traceback or an orphan (issue 19)."""

from __future__ import annotations

import io
import os
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
