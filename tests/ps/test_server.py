"""A server that outlives its disk, refuses frames meant for another server or an earlier run of itself,
and caps what it stores (gradsync.ps.server; issue 42). Servers run on threads of this process."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

import gradsync.ps.client as client_mod
import gradsync.ps.server as server_mod
from gradsync.errors import CommError, GradsyncError
from gradsync.ps.client import PSClient
from gradsync.ps.kvstore import KVStoreConfig, PSKVStore
from gradsync.ps.server import Server, ServerConfig
from gradsync.ps.wire import Flag, Op, decode, encode, seal
from tests.ps.cluster import OneServer

KEY = b"s3cret"


class _Thread(OneServer):
    """One server on a thread whose ``stop`` must end its loop."""

    def stop(self, timeout_s: float = 10.0) -> bool:
        assert super().stop(timeout_s)
        return True


def _raw(endpoint: str, frames: list[bytes], secret: bytes | None = KEY, wait_ms: int = 5000):  # type: ignore[no-untyped-def]
    """Send ``frames`` as an outsider would (a DEALER of its own) and decode the one reply."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        assert sock.poll(wait_ms), "no reply"
        got = sock.recv_multipart()
        return decode(got, secret=secret if len(got) == 3 else None)  # a rejection is unsigned
    finally:
        sock.close()


# ---- a disk that fails --------------------------------------------------------------------------------------
@contextlib.contextmanager
def _small_disk(where: Path, size_kib: int) -> Iterator[bool]:
    """A tmpfs of ``size_kib`` at ``where`` when this process may mount one (root); else nothing (False)."""
    where.mkdir()
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount"):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "gradsync-test", str(where)],
                                 capture_output=True, timeout=30).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _fill(where: Path) -> None:
    """Write until the filesystem at ``where`` is full."""
    with open(where / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def _eventually(condition, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_full_checkpoint_disk_keeps_the_server_serving_and_the_worker_is_told(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The server checkpoints every update onto a small disk that then fills up: it keeps answering, each
    pull returns the last acknowledged round, the worker is warned (file and OS error named) and its errors
    say so too; once space is freed the retry writes a checkpoint that a restarted server restores whole.
    A tmpfs when root may mount one, else the same ENOSPC injected into the checkpoint writer."""
    disk = tmp_path / "disk"
    with _small_disk(disk, 512) as mounted:
        full = threading.Event()
        if not mounted:
            real = server_mod.write_checkpoint

            def writer(path: Path, *a: object, **kw: object) -> None:
                if full.is_set():
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                real(path, *a, **kw)  # type: ignore[arg-type]

            monkeypatch.setattr(server_mod, "write_checkpoint", writer)
        s = _Thread(checkpoint_dir=str(disk), checkpoint_every=1, checkpoint_retry_s=0.05)
        kv = PSKVStore(KVStoreConfig(servers=(s.endpoint,), timeout_s=10), sync=True, hybrid=False)
        try:
            n = 40_000  # 160 kB: a checkpoint and its tmp copy do not fit twice in 512 kB once filled
            kv.init("w", torch.zeros(n))
            out = torch.empty(n)
            kv.pushpull("w", torch.full((n,), 1.0), out)
            assert s.server.stats["checkpoints"] >= 2 and s.server.disk_error is None
            if mounted:
                _fill(disk)
            full.set()
            path = str(disk / "server-0.npz")
            with pytest.warns(RuntimeWarning, match="No space left on device") as warned:
                for r in range(2, 6):  # every round is acknowledged and pulled back from memory
                    kv.pushpull("w", torch.full((n,), float(r)), out)
                    assert torch.equal(out, torch.full((n,), float(r))), r
            message = str(warned[0].message)
            assert f"PS server 0 ({s.endpoint})" in message and path in message and "ENOSPC" in message, message
            assert kv.client.notices[0].startswith(f"server 0 cannot write its checkpoint {path}")
            assert s.thread.is_alive() and s.server.stats["checkpoint_failures"] >= 1
            with pytest.raises(GradsyncError, match="No space left on device") as e:  # an error names it too
                kv.client.call([kv.client.request(0, Op.PULL, what="pull", key="never-initialised")])
            assert path in str(e.value) and "serves on from memory" in str(e.value)
            # space again: the backed-off retry writes round 5, which a restarted server restores
            if mounted:
                (disk / "filler").unlink()
            full.clear()
            assert _eventually(lambda: s.server.disk_error is None), s.server.disk_error
        finally:
            kv.close()
            s.stop()
        restored = Server(ServerConfig(checkpoint_dir=str(disk)))
        try:
            slot = restored.slots[("w", 0)]
            assert slot.version == 5 and torch.equal(slot.value, torch.full((n,), 5.0))
        finally:
            restored.sock.close(linger=0)


def test_read_only_disk_is_reported_by_status_and_an_explicit_checkpoint(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """EROFS (injected: a read-only remount needs root): the server flags its replies, STATUS names the file
    and the error, a CHECKPOINT request fails saying why, and the server keeps serving."""
    def read_only(path: Path, *a: object, **kw: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(server_mod, "write_checkpoint", read_only)
    s = _Thread(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    try:
        first = _raw(s.endpoint, encode(Op.INIT, key="k", tensor=torch.ones(2), count=1), secret=None)
        assert first.op == Op.ACK  # the failed write comes after this reply was made: the next ones say so
        ping = _raw(s.endpoint, encode(Op.PING), secret=None)
        assert ping.op == Op.ACK and ping.flags & Flag.DISK_FAILING
        info = _raw(s.endpoint, encode(Op.STATUS), secret=None).json()
        assert info["disk"] == f"server 0 cannot write its checkpoint {tmp_path / 'server-0.npz'}: " \
                               f"Read-only file system (EROFS)", info
        m = _raw(s.endpoint, encode(Op.CHECKPOINT), secret=None)
        assert m.op == Op.ERROR and "checkpoint not written" in m.text() and "Read-only file system" in m.text()
        value = _raw(s.endpoint, encode(Op.PULL, key="k", version=0), secret=None)
        assert value.op == Op.VALUE and torch.equal(value.tensor(), torch.ones(2))
    finally:
        s.stop()


def test_checkpoint_dir_must_be_a_writable_directory(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(GradsyncError, match=r"--checkpoint-dir .* is a file, not a directory"):
        Server(ServerConfig(checkpoint_dir=str(a_file)))
    with pytest.raises(GradsyncError, match=r"--checkpoint-dir .* cannot be created"):
        Server(ServerConfig(checkpoint_dir=str(a_file / "below")))
    fresh = tmp_path / "new" / "dir"
    Server(ServerConfig(checkpoint_dir=str(fresh))).sock.close(linger=0)
    assert fresh.is_dir() and not list(fresh.iterdir())  # created, and the probe file removed


# ---- replays across restarts and servers -------------------------------------------------------------------
def test_captured_frame_is_refused_by_a_restarted_server_and_by_another_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A correctly signed SHUTDOWN captured on its way to server 0 stops server 0 once: sent again to server
    1 of the same job (same secret) it is refused as addressed elsewhere, and sent to server 0 restarted
    without a checkpoint (its replay window gone) it is refused as bound to the old incarnation."""
    sent: list[list[bytes]] = []
    real_seal = client_mod.seal

    def recording_seal(*args: object, **kw: object) -> list:  # type: ignore[type-arg]
        frames = real_seal(*args, **kw)  # type: ignore[arg-type]
        sent.append([bytes(f) for f in frames])
        return frames

    monkeypatch.setattr(client_mod, "seal", recording_seal)
    servers = [_Thread(server_id=i, secret=KEY) for i in range(2)]
    client = PSClient([s.endpoint for s in servers], sender=0, secret=KEY, timeout_s=10)
    try:
        client.connect()
        client.call([client.request(0, Op.SHUTDOWN, what="shutdown")])
        captured = sent[-1]
        servers[0].thread.join(timeout=10)
        assert not servers[0].thread.is_alive()

        other = _raw(servers[1].endpoint, captured)
        assert other.op == Op.ERROR and "addressed to server 0, but this is server 1" in other.text(), other.text()
        assert not servers[1].server.stopping and servers[1].server.stats["misrouted"] == 1

        servers[0] = _Thread(server_id=0, secret=KEY)  # a new run: an empty replay window
        again = _raw(servers[0].endpoint, captured)
        assert again.op == Op.ERROR and again.flags & Flag.STALE and "restarted" in again.text(), again.text()
        assert again.incarnation == servers[0].server.incarnation
        assert not servers[0].server.stopping and servers[0].server.stats["stale"] == 1
        assert _raw(servers[0].endpoint, seal(encode(Op.PING, session=7), seq=1, secret=KEY)).op == Op.ACK
    finally:
        client.close()
        for s in servers:
            s.stop()


def test_a_reply_captured_on_its_way_to_another_client_is_not_taken_for_ones_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two clients of one job number their requests alike. A signed VALUE that answered client A's request 3,
    sent to client B while B waits for its own request 3, is ignored (counted, warned once); B's own reply
    is taken."""
    s = _Thread(secret=KEY)
    a = PSClient([s.endpoint], sender=0, secret=KEY, timeout_s=10)
    b = PSClient([s.endpoint], sender=1, secret=KEY, timeout_s=10)
    replies: list[list[bytes]] = []
    real = a._on_message

    def recording(server: int, frames: list, expected: object) -> None:  # type: ignore[type-arg]
        replies.append([bytes(f) for f in frames])
        real(server, frames, expected)  # type: ignore[arg-type]

    monkeypatch.setattr(a, "_on_message", recording)
    try:
        for c in (a, b):
            c.connect()
        a.call([a.request(0, Op.INIT, key="k", tensor=torch.full((3,), 7.0), count=1, what="init")])
        got: list[torch.Tensor] = []
        pull = a.request(0, Op.PULL, key="k", version=0, what="pull", on_reply=lambda m: got.append(m.tensor()))
        a.call([pull])
        captured = next(r for r in reversed(replies) if decode(r, secret=KEY).op == Op.VALUE)
        assert decode(captured, secret=KEY).session == a.session and got
        mine: list[torch.Tensor] = []
        req = b.request(0, Op.PULL, key="k", version=0, what="pull", on_reply=lambda m: mine.append(m.tensor()))
        while req.req_id < pull.req_id:  # the same request number as the captured reply's
            req = b.request(0, Op.PULL, key="k", version=0, what="pull", on_reply=lambda m: mine.append(m.tensor()))
        assert req.req_id == decode(captured, secret=KEY).req_id
        b.inflight[req.req_id] = req
        with pytest.warns(RuntimeWarning, match="bound to session .* not this client's"):
            b._on_message(0, [memoryview(f) for f in captured], None)
        assert req.req_id in b.inflight and not mine and b.foreign_replies == 1
        del b.inflight[req.req_id]
        b.call([req])
        assert torch.equal(mine[0], torch.full((3,), 7.0))
    finally:
        a.close()
        b.close()
        s.stop()


def test_frames_must_name_this_run_of_this_server() -> None:
    """Signed frames with the wrong destination or incarnation are refused before they touch anything (the
    session's window included); only a PING may carry no incarnation (how a client first learns it)."""
    s = _Thread(server_id=3, secret=KEY)
    inc = s.server.incarnation
    try:
        init = encode(Op.INIT, key="k", tensor=torch.ones(2), count=1, session=5)
        wrong_dest = _raw(s.endpoint, seal(init, seq=10, secret=KEY, dest=2, incarnation=inc))
        assert wrong_dest.op == Op.ERROR and "addressed to server 2" in wrong_dest.text()
        no_incarnation = _raw(s.endpoint, seal(init, seq=11, secret=KEY, dest=3))
        assert no_incarnation.op == Op.ERROR and no_incarnation.flags & Flag.STALE
        assert not s.server.slots and 5 not in s.server.sessions
        ok = _raw(s.endpoint, seal(init, seq=1, secret=KEY, dest=3, incarnation=inc))
        assert ok.op == Op.ACK and ok.incarnation == inc and ("k", 0) in s.server.slots
        assert _raw(s.endpoint, seal(encode(Op.PING, session=6), seq=1, secret=KEY, dest=3)).op == Op.ACK
    finally:
        s.stop()


def test_client_goes_on_after_a_restart_it_learns_of_from_a_stale_refusal(tmp_path: Path) -> None:
    """The server restarts from its checkpoint on the same address between two rounds. The client's next
    request still names the old incarnation: refused as STALE, sent again bound to the new one, answered."""
    s = _Thread(secret=KEY, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    endpoint = s.endpoint
    kv = PSKVStore(KVStoreConfig(servers=(endpoint,), secret=KEY, timeout_s=20), sync=True, hybrid=False)
    try:
        kv.init("w", torch.zeros(4))
        out = torch.empty(4)
        kv.pushpull("w", torch.ones(4), out)
        old = s.server.incarnation
        s.stop()
        deadline = time.monotonic() + 10
        while True:  # ZeroMQ lets go of the old listener in its I/O thread, a moment after close
            try:
                s = _Thread(secret=KEY, checkpoint_dir=str(tmp_path), bind=endpoint)
                break
            except GradsyncError as e:
                assert "in use" in str(e) and time.monotonic() < deadline, e
                time.sleep(0.05)
        kv.pushpull("w", torch.full((4,), 2.0), out)
        assert torch.equal(out, torch.full((4,), 2.0)) and s.server.slots[("w", 0)].version == 2
        assert kv.client.incarnation[0] == s.server.incarnation != old
    finally:
        kv.close()
        s.stop()


# ---- capacity -----------------------------------------------------------------------------------------------
def test_keys_and_bytes_are_capped_with_a_clear_error() -> None:
    s = _Thread(max_keys=3, max_bytes=1024)
    try:
        def init(key: str, n: int):  # type: ignore[no-untyped-def]
            return _raw(s.endpoint, encode(Op.INIT, key=key, tensor=torch.ones(n), count=1), secret=None)

        assert init("a", 128).op == Op.ACK  # 512 bytes
        big = init("b", 129)  # 516 more: 1028 > 1024
        assert big.op == Op.ERROR and "would pass its limit of 1024 (--max-bytes, GRADSYNC_PS_MAX_BYTES)" in big.text()
        assert init("b", 1).op == Op.ACK and init("c", 1).op == Op.ACK
        many = init("d", 1)
        assert many.op == Op.ERROR and "already stores 3 key slices" in many.text() and "--max-keys" in many.text()
        assert init("a", 128).op == Op.ACK  # an existing key's INIT again is not a new one
        assert s.server.stored_bytes == 520 and len(s.server.slots) == 3
    finally:
        s.stop()


def test_capacity_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradsync.ps.server_config import argument_parser, config_from_args

    monkeypatch.setenv("GRADSYNC_PS_MAX_BYTES", "4096")
    monkeypatch.setenv("GRADSYNC_PS_MAX_KEYS", "7")
    cfg = config_from_args(argument_parser("x").parse_args([]))
    assert (cfg.max_bytes, cfg.max_keys) == (4096, 7)
    cfg = config_from_args(argument_parser("x").parse_args(["--max-bytes", "100"]))
    assert cfg.max_bytes == 100
    with pytest.raises(GradsyncError, match="max_bytes=0 must be >= 1"):
        ServerConfig(max_bytes=0)


def test_misordered_server_list_is_a_clear_error() -> None:
    """A worker whose server list is not in --id order reaches server 1 as if it were server 0."""
    s = _Thread(server_id=1, secret=KEY)
    client = PSClient([s.endpoint], sender=0, secret=KEY, timeout_s=5)
    try:
        with pytest.raises(CommError, match="addressed to server 0, but this is server 1.*--id order"):
            client.connect()
    finally:
        client.close()
        s.stop()
