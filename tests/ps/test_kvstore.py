"""The KVStore against parameter servers on threads in one process (gradsync.ps.kvstore, .server, .client).

Expectations are independent: closed forms of the push/pull rounds and raw frames written without the client
library. The wire format, the update rules and placement have their own files beside this one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from gradsync.errors import CommError, GradsyncError
from gradsync.ps.client import PSClient, place
from gradsync.ps.kvstore import KVSTORES, KVStoreConfig, LocalKVStore, PSKVStore, create
from gradsync.ps.server import Server, ServerConfig
from gradsync.ps.wire import Flag, Op, decode, encode
from tests.ps.cluster import Cluster, run_workers


# ---- servers on threads --------------------------------------------------------------------------------
@pytest.fixture
def cluster2() -> Iterator[Cluster]:
    c = Cluster(2)
    yield c
    c.stop()


def store(cluster: Cluster, rank: int, n: int, sync: bool, **cfg: object) -> PSKVStore:
    cfg = {"slice_bytes": 256, "timeout_s": 20, **cfg}
    config = KVStoreConfig(rank=rank, num_workers=n, servers=cluster.endpoints, **cfg)  # type: ignore[arg-type]
    return PSKVStore(config, sync=sync, hybrid=False)


def test_sync_oracle_replace_and_sgd(cluster2: Cluster) -> None:
    """W workers push ones*(rank+1) per round: without an optimizer every pull equals the round's sum; with
    server SGD the value after round r is w0 - lr*r*W(W+1)/2 (checked on a key sliced over both servers)."""
    W, rounds, lr = 3, 4, 0.5
    total = W * (W + 1) / 2

    def worker(rank: int) -> list[tuple[float, float]]:
        kv = store(cluster2, rank, W, sync=True)
        kv.init(["plain", "big"], [torch.zeros(5), torch.zeros(300)])
        got = []
        for r in range(1, rounds + 1):
            kv.push("plain", torch.ones(5) * (rank + 1))
            out = torch.empty(5)
            kv.pull("plain", out)
            assert torch.equal(out, torch.full((5,), total)), (rank, r, out)
            got.append(float(out[0]))
        kv.close()
        return got

    assert all(v == [total] * rounds for v in run_workers(W, worker).values())

    def worker_sgd(rank: int) -> None:
        kv = store(cluster2, rank, W, sync=True)
        kv.init("w", torch.full((300,), 10.0))
        kv.set_optimizer("sgd", lr=lr)
        for r in range(1, rounds + 1):
            out = torch.empty(300)
            kv.pushpull("w", torch.ones(300) * (rank + 1), out)
            assert torch.allclose(out, torch.full((300,), 10.0 - lr * r * total)), (rank, r, out[:3])
        kv.close()

    for s in cluster2.servers:
        s.updater = None
    run_workers(W, worker_sgd)
    assert {p.server for p in place("w", 300, 4, 2, 256)} == {0, 1}


def test_async_keeps_the_sum_of_all_pushes(cluster2: Cluster) -> None:
    W, rounds = 3, 20

    def worker(rank: int) -> None:
        kv = store(cluster2, rank, W, sync=False)
        kv.init("acc", torch.full((100,), 1.0))
        for _ in range(rounds):
            kv.push("acc", torch.ones(100) * (rank + 1))
            kv.pull("acc", torch.empty(100))
        kv.barrier()
        out = torch.empty(100)
        kv.pull("acc", out)
        assert torch.equal(out, torch.full((100,), 1.0 + rounds * W * (W + 1) / 2))
        kv.close()

    run_workers(W, worker)


def test_list_values_are_summed_and_every_out_filled() -> None:
    kv = create("local")
    kv.init(3, torch.zeros(4))
    kv.push(3, [torch.ones(4), torch.ones(4) * 2])
    outs = [torch.empty(4), torch.empty(4)]
    kv.pull(3, outs)
    assert all(torch.equal(o, torch.full((4,), 3.0)) for o in outs)
    kv.set_optimizer("sgd", lr=1.0)
    kv.push(3, torch.ones(4))
    kv.pull(3, outs[0])
    assert torch.equal(outs[0], torch.full((4,), 2.0))
    with pytest.raises(GradsyncError, match="not initialised"):
        kv.push("nope", torch.ones(1))
    with pytest.raises(GradsyncError, match=r"holds torch.float32 \(4,\)"):
        kv.push(3, torch.ones(5))
    assert set(KVSTORES.names()) == {"local", "dist_sync", "dist_async", "hybrid_sync", "hybrid_async", "collective"}
    assert isinstance(kv, LocalKVStore)


def raw_request(endpoint: str, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes]:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        if not s.poll(timeout_ms):
            raise AssertionError("no reply")
        return s.recv_multipart()
    finally:
        s.close()


def test_bad_input_gets_an_error_and_the_server_keeps_serving() -> None:
    c = Cluster(1, max_payload=4096)
    ep = c.endpoints[0]
    try:
        def ask(frames: list[bytes]) -> tuple[Op, str]:
            m = decode(raw_request(ep, [bytes(f) for f in frames]))
            return m.op, m.text() if m.op == Op.ERROR else ""

        init = encode(Op.INIT, key="w", tensor=torch.zeros(4), count=1, flags=Flag.SYNC)
        assert ask(encode(Op.PUSH, key="w", tensor=torch.ones(4), version=1))[1].find("not initialised") > 0
        assert ask(init)[0] == Op.ACK
        op, text = ask(encode(Op.PUSH, key="w", tensor=torch.ones(5), version=1))
        assert op == Op.ERROR and "initialised as torch.float32 shape (4,)" in text
        op, text = ask(encode(Op.PUSH, key="w", tensor=torch.ones(4, dtype=torch.float64), version=1))
        assert op == Op.ERROR and "float64" in text
        assert "not initialised" in ask(encode(Op.PULL, key="unknown"))[1]
        assert "rejected" in ask([b"garbage", b"bytes"])[1]
        assert "rejected" in ask([bytes(encode(Op.PUSH, key="w", tensor=torch.ones(4))[0])[:20], b""])[1]
        assert "exceeds" in ask(encode(Op.PUSH, key="w", tensor=torch.ones(2000), version=1))[1]
        assert "rounds start at 1" in ask(encode(Op.PUSH, key="w", tensor=torch.ones(4), version=0))[1]
        assert "sender 5" in ask(encode(Op.PUSH, key="w", tensor=torch.ones(4), version=1, sender=5))[1]
        # after all that, the stored value is intact and a good round still works
        assert ask(encode(Op.PUSH, key="w", tensor=torch.ones(4) * 7, version=1))[0] == Op.ACK
        m = decode(raw_request(ep, [bytes(f) for f in encode(Op.PULL, key="w", version=1)]))
        assert m.op == Op.VALUE and torch.equal(m.tensor(), torch.full((4,), 7.0))
        assert c.servers[0].stats["rejected"] >= 3
    finally:
        c.stop()


def test_shared_secret_authenticates_every_frame(caplog: pytest.LogCaptureFixture) -> None:
    c = Cluster(1, secret=b"s3cret")
    try:
        good = KVStoreConfig(rank=0, num_workers=1, servers=c.endpoints, secret=b"s3cret", timeout_s=5)
        kv = PSKVStore(good, sync=True, hybrid=False)
        kv.init("w", torch.ones(3))
        out = torch.empty(3)
        kv.pull("w", out)
        assert torch.equal(out, torch.ones(3))
        kv.close()
        with caplog.at_level(logging.WARNING, logger="gradsync.ps"):
            for secret in (None, b"wrong"):
                bad = KVStoreConfig(rank=0, num_workers=1, servers=c.endpoints, secret=secret, timeout_s=5)
                with pytest.raises(CommError, match="rejected"):
                    PSKVStore(bad, sync=True, hybrid=False)
        assert sum("tag" in r.getMessage() for r in caplog.records) >= 2
    finally:
        c.stop()


def test_ordered_pulls_arrive_in_priority_order() -> None:
    """TicTac enforcement: requests sent in reverse priority order come back in priority order when ordered,
    and in request order when not (observed at the receiver)."""
    c = Cluster(1)
    try:
        client = PSClient(c.endpoints, sender=0, timeout_s=10)
        keys = [f"k{i}" for i in range(6)]
        client.call([client.request(0, Op.INIT, what="init", key=k, tensor=torch.ones(2), count=1) for k in keys])
        for it in range(3):
            prio = {k: p for p, k in enumerate(reversed(keys))} if it % 2 else {k: p for p, k in enumerate(keys)}
            perm = sorted(keys, key=lambda k: -prio[k])  # send lowest priority first
            for ordered in (True, False):
                seen: list[str] = []
                reqs = [client.request(0, Op.PULL, what="pull", key=k, priority=prio[k], count=len(keys),
                                       flags=Flag.ORDERED if ordered else Flag.NONE,
                                       on_reply=lambda m, seen=seen: seen.append(m.key)) for k in perm]
                client.call(reqs)
                assert seen == (sorted(keys, key=prio.get) if ordered else perm), (it, ordered, seen)
        client.close()
    finally:
        c.stop()


def test_sync_round_names_the_missing_client() -> None:
    from gradsync.errors import PeerError

    c = Cluster(1)
    try:
        def worker(rank: int) -> str:
            kv = store(c, rank, 3, sync=True, timeout_s=1.5, retry_s=0.5)
            kv.init("w", torch.zeros(2))
            if rank == 2:
                return "gone"  # never pushes: as if it crashed
            kv.push("w", torch.ones(2))
            t0 = time.monotonic()
            with pytest.raises(PeerError, match=r"waits for pushes from client\(s\) \[2\]") as e:
                kv.pull("w", torch.empty(2))
            assert e.value.peer == 2 and time.monotonic() - t0 < 6
            return "ok"

        assert run_workers(3, worker) == {0: "ok", 1: "ok", 2: "gone"}
    finally:
        c.stop()


def test_checkpoint_restores_values_and_optimizer_state(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = {"checkpoint_dir": str(tmp_path), "checkpoint_every": 1}
    c = Cluster(1, **cfg)
    kv = PSKVStore(KVStoreConfig(rank=0, num_workers=1, servers=c.endpoints, timeout_s=10), sync=True, hybrid=False)
    kv.init(["a", 5], [torch.arange(6, dtype=torch.float64), torch.ones(3, dtype=torch.bfloat16)])
    kv.set_optimizer("sgd", lr=0.1, momentum=0.5)
    kv.pushpull("a", torch.ones(6, dtype=torch.float64), torch.empty(6, dtype=torch.float64))
    kv.close()
    c.stop()
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == ["server-0.npz"]  # no temporary file left behind
    (tmp_path / "server-0.tmp4242").write_bytes(b"half a checkpoint")  # a predecessor killed mid-write
    (tmp_path / "server-1.tmp4242").write_bytes(b"another server's")
    restored = Server(ServerConfig(checkpoint_dir=str(tmp_path)))
    assert sorted(f.name for f in tmp_path.iterdir()) == ["server-0.npz", "server-1.tmp4242"]  # its own removed
    slot = restored.slots[("a", 0)]
    assert torch.allclose(slot.value, torch.arange(6, dtype=torch.float64) - 0.1)
    assert slot.version == 1 and torch.equal(slot.state["momentum"], torch.ones(6, dtype=torch.float64))
    assert restored.slots[(5, 0)].value.dtype == torch.bfloat16
    assert restored.updater is not None and restored.updater.momentum == 0.5  # type: ignore[attr-defined]
    restored.sock.close()
    (tmp_path / "server-0.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(GradsyncError, match="move the file away"):
        Server(ServerConfig(checkpoint_dir=str(tmp_path)))


@pytest.mark.parametrize("value, match", [
    ("abc", r"GRADSYNC_PS_TIMEOUT='abc' is not a number"), ("nan", "timeout_s=nan"), ("-1", "timeout_s=-1.0"),
    ("inf", "timeout_s=inf"),
])
def test_bad_request_timeout_from_the_environment_is_named(monkeypatch: pytest.MonkeyPatch, value: str,
                                                           match: str) -> None:
    monkeypatch.setenv("GRADSYNC_PS_TIMEOUT", value)
    with pytest.raises(GradsyncError, match=match):
        KVStoreConfig.from_env()


def test_workers_and_servers_read_numeric_variables_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """One reader (gradsync.env.env_number): empty or blank means the default on both sides; text is an error
    naming the variable."""
    from gradsync.env import env_number

    for blank in ("", "  "):
        monkeypatch.setenv("GRADSYNC_PS_TIMEOUT", blank)
        monkeypatch.setenv("GRADSYNC_PS_ELASTIC_TIMEOUT", blank)
        assert KVStoreConfig.from_env().timeout_s == 60.0
        assert env_number("GRADSYNC_PS_ELASTIC_TIMEOUT", 10.0, float) == 10.0
    monkeypatch.setenv("GRADSYNC_PS_MAX_AHEAD", " 12 ")
    assert env_number("GRADSYNC_PS_MAX_AHEAD", 8, int) == 12
    monkeypatch.setenv("GRADSYNC_PS_MAX_AHEAD", "1.5")
    with pytest.raises(GradsyncError, match=r"GRADSYNC_PS_MAX_AHEAD='1.5' is not an integer; unset it or set e.g. "
                                            r"GRADSYNC_PS_MAX_AHEAD=8"):
        env_number("GRADSYNC_PS_MAX_AHEAD", 8, int)


def test_port_in_use_and_bad_endpoints_are_named() -> None:
    """A second server on a taken port, or an endpoint ZeroMQ cannot parse, is a GradsyncError naming it."""
    first = Server(ServerConfig(bind="tcp://127.0.0.1:0"))
    try:
        with pytest.raises(GradsyncError, match=rf"cannot bind the server to '{first.endpoint}'.*another process"):
            Server(ServerConfig(bind=first.endpoint))
    finally:
        first.sock.close(linger=0)
    with pytest.raises(GradsyncError, match="cannot bind the server to 'tcp://127.0.0.1:notaport'"):
        Server(ServerConfig(bind="tcp://127.0.0.1:notaport"))
    with pytest.raises(GradsyncError, match="endpoint 'garbage' cannot be connected to.*GRADSYNC_PS_SERVERS"):
        PSClient(["garbage"], 0)


def test_server_command_on_a_taken_port_exits_2_without_traceback() -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        p = subprocess.run([sys.executable, "-m", "gradsync.ps.server", "--bind", endpoint], capture_output=True,
                           text=True, timeout=60)
    assert p.returncode == 2 and "Address already in use" in p.stderr and "Traceback" not in p.stderr, p.stderr
