"""Faults with real processes: a killed server, a killed launcher, a failing rank. Each must end in a clear
error within a stated bound, never a hang, a traceback or an orphan (issue 19)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradsync.errors import CommError, GradsyncError
from gradsync.launch import free_port
from gradsync.ps.client import PSClient
from gradsync.ps.kvstore import KVStoreConfig, PSKVStore
from gradsync.ps.launch import ServerProcess, start_server
from gradsync.ps.server import MAX_AHEAD, Server, ServerConfig
from gradsync.ps.wire import Flag, Op, decode, encode, seal
from tests.ps.cluster import OneServer

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


def _reap(started: set[int], launcher: subprocess.Popen) -> None:
    """Kill what a test's launcher started (and the launcher) if the test left any of it running."""
    for p in started:  # only what this test's launcher started
        if _alive(p):
            os.kill(p, signal.SIGKILL)
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()


def _await_children(launcher: subprocess.Popen, count: int, started: set[int], timeout: float = 60.0) -> None:
    """Wait until ``launcher`` has ``count`` live descendants; ``started`` holds them (for ``_reap``)."""
    deadline = time.monotonic() + timeout
    while True:
        current = _children_of(launcher.pid)
        started.clear()
        started.update(current)
        if len(current) >= count:
            return
        assert launcher.poll() is None and time.monotonic() < deadline, (current, launcher.communicate())
        time.sleep(0.1)


def _signal_ends_everything(launcher: subprocess.Popen, sig: signal.Signals, started: set[int], settle_s: float) -> str:
    """After ``settle_s``, send ``sig`` to ``launcher``: it exits within 5 s and 5 s after the signal nothing it
    started is alive. Returns its stderr."""
    time.sleep(settle_s)
    started.update(_children_of(launcher.pid))
    launcher.send_signal(sig)
    t0 = time.monotonic()
    _, err = launcher.communicate(timeout=5)
    assert time.monotonic() - t0 < 5
    time.sleep(max(0.0, 5 - (time.monotonic() - t0)))
    assert [p for p in started if _alive(p)] == []
    return err


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
        # 2 workers + their 2 sleeps + 1 server (the launcher's own interpreter has no other children)
        _await_children(launcher, 5, started)
        err = _signal_ends_everything(launcher, sig, started, 0.5)  # 0.5 s: let the server finish importing
    finally:
        _reap(started, launcher)
    assert launcher.returncode == 128 + sig, (launcher.returncode, err)
    assert f"stopped by {sig.name}" in err and "Traceback" not in err, err


def test_sigkill_of_launch_leaves_no_process_of_the_job() -> None:
    """SIGKILL (the OOM killer's signal) gives the launcher no chance to clean up: its guard process does, and
    5 s later no server, worker or worker's child is alive (they used to live on under PID 1)."""
    launcher = subprocess.Popen(_gradsync("launch", "-n", "2", "-s", "1", "--", sys.executable, "-c", SLEEPER),
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    started: set[int] = set()
    try:
        _await_children(launcher, 6, started)  # the guard, 1 server, 2 workers and their 2 sleeps
        time.sleep(0.5)  # let the server finish importing
        started.update(_children_of(launcher.pid))
        workers = [p for p in started if b"ready" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2, started
        launcher.kill()
        t0 = time.monotonic()
        launcher.communicate(timeout=5)
        time.sleep(max(0.0, 5 - (time.monotonic() - t0)))
        assert [p for p in started if _alive(p)] == []
    finally:
        _reap(started, launcher)
    assert launcher.returncode == -signal.SIGKILL


def test_absurd_worker_count_is_refused_at_once() -> None:
    t0 = time.monotonic()
    p = subprocess.run(_gradsync("launch", "--workers", "100000", "--", "true"), env=ENV, capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "100001 processes on one machine, more than the limit of" in p.stderr, p.stderr
    assert "GRADSYNC_MAX_PROCESSES=N" in p.stderr and time.monotonic() - t0 < 30


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
        _await_children(launcher, 5, started)
        server = [p for p in started if b"gradsync.ps.server" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(server) == 1
        os.kill(server[0], signal.SIGKILL)
        t0 = time.monotonic()
        out, err = launcher.communicate(timeout=3 * 3)
        assert time.monotonic() - t0 < 3 * 3
        time.sleep(0.5)
        assert [p for p in started if _alive(p)] == []
    finally:
        _reap(started, launcher)
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


# ---- hostile frames to a live server (in-process, on a thread) -------------------------------------------
KEY = b"k3y"


class _Served(OneServer):
    """One server on a thread, and a DEALER that sends raw frames to it as a hostile peer would."""

    def __init__(self, **cfg: object) -> None:
        super().__init__(**cfg)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)

    def send(self, frames: list) -> None:  # type: ignore[type-arg]
        self.sock.send_multipart([bytes(f) for f in frames])

    def replies(self, quiet_ms: int = 300, first_ms: int = 5000) -> list:  # type: ignore[type-arg]
        """Every reply that arrives until the socket has been quiet for ``quiet_ms`` (the first may take
        ``first_ms``)."""
        got = []
        while self.sock.poll(quiet_ms if got else first_ms):
            frames = self.sock.recv_multipart()  # a rejection is unsigned: its sender may hold no secret
            got.append(decode(frames, secret=self.server.config.secret if len(frames) == 3 else None))
        return got

    def ask(self, frames: list):  # type: ignore[no-untyped-def, type-arg]
        self.send(frames)
        got = self.replies(50)
        assert len(got) == 1, got
        return got[0]

    def close(self) -> None:
        self.sock.close()
        self.stop(5.0)


@pytest.fixture
def served() -> Iterator[_Served]:
    s = _Served()
    yield s
    s.close()


def _committed(s: _Served, key: str, round_: int) -> torch.Tensor:
    m = s.ask(encode(Op.PULL, key=key, version=round_, req_id=999))
    assert m.op == Op.VALUE and m.version == round_, (m.op, m.text() if m.op == Op.ERROR else m.version)
    return m.tensor().clone()


def _two_pusher_key(s: _Served) -> None:
    """Key "w" with 2 pushers, round 1 committed: sum of 1s and 2s = 3."""
    assert s.ask(encode(Op.INIT, key="w", tensor=torch.zeros(256), count=2, flags=Flag.SYNC)).op == Op.ACK
    for sender in (0, 1):
        assert s.ask(encode(Op.PUSH, key="w", tensor=torch.full((256,), sender + 1.0), version=1,
                            sender=sender)).op == Op.ACK


def test_future_round_flood_is_refused_past_the_cap_and_memory_stays_bounded(served: _Served) -> None:
    """200 pushes of rounds far ahead (the issue's RSS +200 MB): only max_ahead rounds are buffered, every
    other one gets an ERROR naming the cap, and the value stays the last committed round's."""
    _two_pusher_key(served)
    for r in range(3, 203):
        served.send(encode(Op.PUSH, key="w", tensor=torch.full((256,), 50.0), version=r, sender=0, req_id=r))
    replies = served.replies()
    acks = sorted(m.req_id for m in replies if m.op == Op.ACK)
    errors = [m for m in replies if m.op == Op.ERROR]
    # round 2 is being summed; MAX_AHEAD rounds after it (3..10) may wait, the rest are refused
    assert acks == list(range(3, 2 + MAX_AHEAD + 1)), acks
    assert len(errors) == 200 - len(acks) and "holds at most 8 rounds ahead" in errors[0].text(), errors[0].text()
    slot = served.server.slots[("w", 0)]
    assert sum(len(v) for v in slot.future.values()) == MAX_AHEAD
    assert torch.equal(_committed(served, "w", 1), torch.full((256,), 3.0))


def test_pull_of_a_far_round_is_refused_not_parked_forever(served: _Served) -> None:
    _two_pusher_key(served)
    m = served.ask(encode(Op.PULL, key="w", version=10**15))
    assert m.op == Op.ERROR and "names round 1000000000000000" in m.text() and "--max-ahead" in m.text(), m.text()
    assert not served.server.deferred.get(("w", 0)) and not served.server.parked


def test_parked_pulls_are_capped_per_key_and_per_client() -> None:
    s = _Served(max_parked_per_key=4, max_parked_per_client=6)
    try:
        _two_pusher_key(s)
        for i in range(10):  # round 2 is not complete: each pull parks, up to the key's cap
            s.send(encode(Op.PULL, key="w", version=2, req_id=100 + i))
        errors = s.replies()
        assert len(errors) == 6 and all("--max-parked-per-key" in m.text() for m in errors), [m.text() for m in errors]
        assert s.ask(encode(Op.INIT, key="v", tensor=torch.zeros(2), count=2, flags=Flag.SYNC)).op == Op.ACK
        for i in range(4):  # this connection holds 4 already: 2 more fit
            s.send(encode(Op.PULL, key="v", version=1, req_id=200 + i))
        errors = s.replies()
        assert len(errors) == 2 and all("--max-parked-per-client" in m.text() for m in errors)
        # completing round 2 of "w" answers its 4 parked pulls with the committed value, and frees the client
        s.send(encode(Op.PUSH, key="w", tensor=torch.full((256,), 5.0), version=2, sender=0, req_id=1))
        s.send(encode(Op.PUSH, key="w", tensor=torch.full((256,), 6.0), version=2, sender=1, req_id=2))
        values = [m for m in s.replies() if m.op == Op.VALUE]
        assert len(values) == 4 and all(torch.equal(m.tensor(), torch.full((256,), 11.0)) for m in values)
        assert sum(s.server.parked.values()) == 2  # the two pulls of "v" still wait
    finally:
        s.close()


@pytest.mark.parametrize("shape, numel, parts, match", [
    ((2**62, 2**62), 1, 1, "at most 2^63 - 1"),
    ((2, 3), 5, 1, "holds 6 elements, but the frame carries 5"),
    ((1 << 40,), 4, 2, "cannot be sent"),
])
def test_init_shape_must_match_its_elements_and_the_payload_limit(served: _Served, shape: tuple[int, ...],
                                                                  numel: int, parts: int, match: str) -> None:
    m = served.ask(encode(Op.INIT, key="x", tensor=torch.ones(numel), shape=shape, parts=parts, count=1))
    assert m.op == Op.ERROR and match in m.text(), m.text()
    assert not served.server.slots


def test_oversized_frame_is_rejected_and_the_value_kept() -> None:
    s = _Served(max_payload=4096)
    try:
        _two_pusher_key(s)
        m = s.ask(encode(Op.PUSH, key="w", tensor=torch.ones(2048), version=2))
        assert m.op == Op.ERROR and "exceeds this server's limit of 4096" in m.text(), m.text()
        assert torch.equal(_committed(s, "w", 1), torch.full((256,), 3.0))
    finally:
        s.close()


def test_replayed_frame_is_rejected_and_logged(caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames captured off the wire and sent again (same session and seq, valid tag) are refused and
    logged: an old SET_OPTIMIZER cannot undo a later one, an old push is not applied again; the key keeps
    its last committed value and the job goes on."""
    s = _Served(secret=KEY)
    sent: list[list[bytes]] = []
    import gradsync.ps.client as client_mod

    real_seal = client_mod.seal

    def recording_seal(*args: object, **kw: object) -> list:  # type: ignore[type-arg]
        frames = real_seal(*args, **kw)  # type: ignore[arg-type]
        sent.append([bytes(f) for f in frames])
        return frames

    monkeypatch.setattr(client_mod, "seal", recording_seal)
    try:
        client = PSClient([s.endpoint], sender=0, secret=KEY, timeout_s=5)

        def call(op: Op, **fields: object) -> list:  # type: ignore[type-arg]
            got: list = []  # type: ignore[type-arg]
            client.call([client.request(0, op, what=op.name, on_reply=got.append, **fields)])
            return [(sent[-1], m) for m in got]

        call(Op.INIT, key="w", tensor=torch.zeros(4), count=1, flags=Flag.SYNC)
        old_optimizer = call(Op.SET_OPTIMIZER, json_payload={"name": "sgd", "hyperparameters": {"lr": 1.0}})[0][0]
        call(Op.SET_OPTIMIZER, json_payload={"name": "replace", "hyperparameters": {}})
        old_push = call(Op.PUSH, key="w", tensor=torch.ones(4), version=1)[0][0]
        with caplog.at_level(logging.WARNING, logger="gradsync.ps"):
            replies = [s.ask(f) for f in (old_optimizer, old_push, old_push)]
        assert all(r.op == Op.ERROR and "replayed frame" in r.text() for r in replies), [r.text() for r in replies]
        assert s.server.stats["replayed"] == 3
        assert sum("replayed frame" in r.getMessage() for r in caplog.records) == 3
        assert type(s.server.updater).__name__.lower().startswith("replace"), s.server.updater
        (_, value), = call(Op.PULL, key="w", version=1)
        assert torch.equal(value.tensor(), torch.ones(4))  # round 1 = the one push, replaced in
        (_, ack), = call(Op.PUSH, key="w", tensor=torch.full((4,), 2.0), version=2)  # the job goes on
        assert ack.op == Op.ACK and ack.version == 2
        client.close()
    finally:
        s.close()


def test_frame_without_session_is_refused_by_a_server_with_a_secret() -> None:
    s = _Served(secret=KEY)
    try:
        m = decode(raw_frames := [bytes(f) for f in encode(Op.PING, secret=KEY)], secret=KEY)
        assert m.session == 0
        reply = s.ask(raw_frames)
        assert reply.op == Op.ERROR and "carries no session" in reply.text()
    finally:
        s.close()


def test_second_job_on_one_server_is_refused_at_connect(served: _Served) -> None:
    """Job A's store claims the server; job B's store fails at create (its first PING) with an error naming
    both jobs, instead of sharing A's rounds; A's values are untouched and A goes on."""
    a = PSKVStore(KVStoreConfig(servers=(served.endpoint,), job=0xA, timeout_s=5), sync=True, hybrid=False)
    a.init("w", torch.zeros(3))
    a.pushpull("w", torch.ones(3), out := torch.empty(3))
    for job in (0xB, 0):
        with pytest.raises(GradsyncError, match=r"serves job 000000000000000a, but this request is from") as e:
            PSKVStore(KVStoreConfig(servers=(served.endpoint,), job=job, timeout_s=5), sync=True, hybrid=False)
        assert "GRADSYNC_PS_JOB" in str(e.value)
    a.pushpull("w", torch.ones(3) * 2, out)
    assert torch.equal(out, torch.full((3,), 2.0)) and served.server.slots[("w", 0)].version == 2
    a.close()


def test_checkpoint_keeps_the_job_and_the_replay_window(tmp_path: Path) -> None:
    """A restarted server still serves its job and still refuses frames it accepted before the crash; a
    server given another job (a new `gradsync launch` resuming the checkpoint) serves that one."""
    s = _Served(secret=KEY, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    init = seal(encode(Op.INIT, key="w", tensor=torch.ones(2), count=1, job=5, session=9), seq=3, secret=KEY,
                incarnation=s.server.incarnation)
    try:
        assert s.ask(init).op == Op.ACK
    finally:
        s.close()
    restored = Server(ServerConfig(secret=KEY, checkpoint_dir=str(tmp_path)))
    assert restored.job == 5 and restored.sessions == {9: 3}
    restored.sock.close(linger=0)
    resumed = Server(ServerConfig(secret=KEY, checkpoint_dir=str(tmp_path), job=6))
    assert resumed.job == 6 and torch.equal(resumed.slots[("w", 0)].value, torch.ones(2))
    resumed.sock.close(linger=0)


def test_shutdown_needs_an_authenticated_peer(caplog: pytest.LogCaptureFixture) -> None:
    """No secret: SHUTDOWN is refused (and logged), the server keeps serving. With a secret: an unsigned or
    wrongly signed SHUTDOWN is rejected and logged; the job's own signed one stops it."""
    with caplog.at_level(logging.WARNING, logger="gradsync.ps"):
        s = _Served()
        try:
            m = s.ask(encode(Op.SHUTDOWN))
            assert m.op == Op.ERROR and "SHUTDOWN refused" in m.text() and not s.server.stopping
            assert s.ask(encode(Op.PING)).op == Op.ACK
        finally:
            s.close()
        s = _Served(secret=KEY)
        try:
            for frames in (encode(Op.SHUTDOWN, session=5), seal(encode(Op.SHUTDOWN, session=5), seq=1, secret=b"x")):
                s.send(frames)
                reply = decode(s.sock.recv_multipart()) if s.sock.poll(5000) else None
                assert reply is not None and reply.op == Op.ERROR and "rejected" in reply.text()
            assert not s.server.stopping
            assert s.ask(seal(encode(Op.SHUTDOWN, session=5), seq=1, secret=KEY,
                              incarnation=s.server.incarnation)).op == Op.ACK
            s.thread.join(timeout=5)
            assert not s.thread.is_alive()
        finally:
            s.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("refused SHUTDOWN" in m for m in messages) and sum("tag" in m for m in messages) >= 2
    assert any("SHUTDOWN by an authenticated peer" in m for m in messages)


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:0", "tcp://*:0"])
def test_no_secret_means_loopback_only(bind: str) -> None:
    with pytest.raises(GradsyncError, match="refusing to bind .* without a shared secret.*--insecure"):
        ServerConfig(bind=bind)
    for ok in (ServerConfig(bind=bind, insecure=True), ServerConfig(bind=bind, secret=KEY)):
        assert ok.bind == bind
    p = subprocess.run([sys.executable, "-m", "gradsync.ps.server", "--bind", bind], env={**ENV, "GRADSYNC_PS_SECRET": ""},
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "refusing to bind" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_launch_makes_a_per_job_secret_so_an_outsider_cannot_stop_the_server() -> None:
    """With no GRADSYNC_PS_SECRET set, `gradsync launch` gives the job its own secret and job id; raw frames
    from a process without them (SHUTDOWN, PUSH, INIT, STATUS, a guessed tag) are all rejected and the
    job's pushpull still works (tests/workers/ps_worker.py intruder)."""
    env = {k: v for k, v in ENV.items() if k not in ("GRADSYNC_PS_SECRET", "GRADSYNC_PS_JOB")}
    p = subprocess.run(_gradsync("launch", "-n", "1", "-s", "1", "--timeout", "120", "--", sys.executable,
                                 str(ROOT / "tests" / "workers" / "ps_worker.py"), "intruder"),
                       env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "OK intruder refused 5 times" in p.stdout, p.stdout[-3000:]
    assert "rejected a frame" in p.stdout  # the server logged each attempt


def test_job_env_keeps_what_the_user_set() -> None:
    from gradsync.ps.launch import job_env

    made = job_env({})
    assert len(made["GRADSYNC_PS_SECRET"]) == 64 and len(made["GRADSYNC_PS_JOB"]) == 16
    assert job_env({})["GRADSYNC_PS_SECRET"] != made["GRADSYNC_PS_SECRET"]  # random per job
    kept = job_env({"GRADSYNC_PS_SECRET": "mine", "GRADSYNC_PS_JOB": "run7"})
    assert kept["GRADSYNC_PS_SECRET"] == "mine" and kept["GRADSYNC_PS_JOB"] == "run7"


def test_rendezvous_store_listens_on_master_addr_only() -> None:
    """hybrid_sync's process group: rank 0's TCPStore listens on MASTER_ADDR=127.0.0.1, not on every
    interface (torch's env:// binds 0.0.0.0/::)."""
    code = ("import os\nfrom gradsync.comm import lifetime\n"
            "lifetime.init_process_group('gloo', 20, rank=0, world_size=1)\n"
            "port = int(os.environ['MASTER_PORT'])\n"
            "for f in ('/proc/net/tcp', '/proc/net/tcp6'):\n"
            "    for line in open(f).read().splitlines()[1:]:\n"
            "        p = line.split()\n"
            "        if p[3] == '0A' and int(p[1].split(':')[1], 16) == port: print('LISTEN', p[1])\n")
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    listening = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("LISTEN")]
    assert listening and all(a.split(":")[0] == "0100007F" for a in listening), listening  # 127.0.0.1 only


# ---- the CLI: closed pipes, mpirun, hostile files ----------------------------------------------------------
def test_closed_stdout_pipe_exits_quietly() -> None:
    """`gradsync plan --json | head -c 10`: the reader is gone before the JSON is written. No BrokenPipeError
    traceback (nor "Exception ignored" at exit): exit 141 as SIGPIPE would, stderr empty."""
    p = subprocess.Popen(_gradsync("plan", "-t", "p3.16xlarge", "--json"), env=ENV, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before the child has imported anything, let alone written
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert p.returncode == 141 and err == "", (p.returncode, err[-2000:])
    shell = subprocess.run(f"{sys.executable} -m gradsync plan -t p3.16xlarge --json | head -c 10", shell=True,
                           env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert shell.stdout == '{\n  "type"' and shell.stderr == "", shell.stderr


#: a stand-in for mpirun: starts -n copies of the command, each in its own session (so only mpirun's own
#: SIGTERM handling can end them), and ends them and what they started when it gets SIGTERM, as Open MPI does
FAKE_MPIRUN = """
import os, signal, subprocess, sys
n = int(sys.argv[sys.argv.index("-n") + 1]); cmd = sys.argv[sys.argv.index("-n") + 2:]
ranks = [subprocess.Popen(cmd, start_new_session=True) for _ in range(n)]
def stop(signum, frame):
    for r in ranks:
        os.killpg(r.pid, signal.SIGTERM)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
sys.exit(max(r.wait() for r in ranks))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_run_mpi_ends_mpirun_and_its_ranks(tmp_path: Path, sig: signal.Signals) -> None:
    from gradsync.comm.mpi import mpi_available

    reason = mpi_available()
    if reason is not None:
        pytest.skip(f"MPI unavailable: {reason}")
    fake = tmp_path / "fake_mpirun.py"
    fake.write_text(FAKE_MPIRUN)
    env = {**ENV, "GRADSYNC_MPIRUN": f"{sys.executable} {fake}"}
    launcher = subprocess.Popen(_gradsync("run", "--mpi", "-n", "2", "--", sys.executable, "-c", SLEEPER), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    started: set[int] = set()
    try:
        _await_children(launcher, 5, started)  # mpirun, 2 ranks, their 2 sleeps
        err = _signal_ends_everything(launcher, sig, started, 0.3)
    finally:
        _reap(started, launcher)
    assert launcher.returncode == 128 + sig, (launcher.returncode, err)
    assert f"stopped by {sig.name}" in err and "Traceback" not in err, err


def _valid_documents() -> dict[str, object]:
    from gradsync.plan import synthesize
    from gradsync.topology import get_topology

    topo = get_topology("ring:3")
    return {"topology": topo.to_dict(), "schedule": synthesize("ring", topo).to_dict()}


_DOCS = _valid_documents()
_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)


def _slots(doc: object) -> list[tuple[object, object]]:
    """Every (container, key or index) in a JSON document: where a mutation can land."""
    found: list[tuple[object, object]] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            found.append((node, k))
            stack.append(v)
    return found


@st.composite
def _hostile_file(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(which loader, file suffix, file bytes): raw bytes, or a valid topology/schedule with a few values
    replaced, deleted or retyped (what a hand-edited or corrupted file looks like)."""
    which = draw(st.sampled_from(["topology", "schedule"]))
    suffix = draw(st.sampled_from([".json", ".yaml"])) if which == "topology" else ".json"
    if draw(st.booleans()):
        return which, suffix, draw(st.binary(max_size=200))
    doc = json.loads(json.dumps(_DOCS[which]))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(doc)
        if not slots:
            break
        node, key = draw(st.sampled_from(slots))
        if draw(st.booleans()):
            node[key] = draw(_JSONISH)  # type: ignore[index]
        else:
            del node[key]  # type: ignore[attr-defined]
    return which, suffix, json.dumps(doc).encode()  # JSON is YAML too


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_hostile_file())
def test_fuzz_cli_file_loaders_exit_2_without_traceback(case: tuple[str, str, bytes]) -> None:
    """A corrupt topology (`topo show F`) or schedule (`simulate --schedule F`) file ends in one line
    `gradsync: error: ...` and exit 2 (or is accepted, exit 0): never another exception."""
    from gradsync.cli import main

    which, suffix, data = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{which}{suffix}"
        path.write_bytes(data)
        argv = (["topo", "show", str(path)] if which == "topology"
                else ["simulate", "-t", "ring:3", "-a", "ring", "--size", "1MB", "--schedule", str(path)])
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    assert code in (0, 2), (code, err.getvalue())
    if code == 2:
        assert err.getvalue().startswith("gradsync: error: ") and err.getvalue().count("\n") == 1, err.getvalue()
