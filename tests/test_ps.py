"""Parameter server in one process: wire format, update rules, placement, and servers on threads.

Expectations are independent: closed forms of the push/pull rounds, torch.optim as the reference for the
server's SGD/Adam, seed 002 eq. (2) by hand, and raw frames written without the client library.
"""

from __future__ import annotations

import hmac as hmac_lib
import logging
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.errors import CommError, GradsyncError
from gradsync.ps import wire
from gradsync.ps.client import PSClient, place
from gradsync.ps.kvstore import KVSTORES, KVStoreConfig, LocalKVStore, PSKVStore, create
from gradsync.ps.server import Server, ServerConfig
from gradsync.ps.updaters import create_updater
from gradsync.ps.wire import DTYPES, HEADER, Flag, Op, WireError, decode, encode, seal


# ---- wire ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_frame_round_trip_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    frames = encode(Op.PUSH, key="layer.0", tensor=t, version=5, priority=-2, sender=3, secret=b"k")
    m = decode([bytes(f) for f in frames], secret=b"k")
    assert (m.op, m.key, m.dtype, m.shape, m.version, m.priority, m.sender) == (Op.PUSH, "layer.0", dtype, (3, 4), 5, -2, 3)
    assert torch.equal(m.tensor().reshape(3, 4), t)


def test_int_and_str_keys_stay_distinct() -> None:
    assert decode(encode(Op.PULL, key=7)).key == 7
    assert decode(encode(Op.PULL, key="7")).key == "7"
    with pytest.raises(TypeError, match="int or str"):
        encode(Op.PULL, key=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("mutate, match", [
    (lambda f: [f[0][:10], f[1]], "truncated"),
    (lambda f: [b"XXXX" + f[0][4:], f[1]], "magic"),
    (lambda f: [f[0], f[1][:-1]], "payload"),
    (lambda f: [f[0]], "2 or 3 frames"),
    (lambda f: [f[0][:5] + bytes([99]) + f[0][6:], f[1]], "op code"),
])
def test_decode_rejects_bad_frames(mutate, match) -> None:  # type: ignore[no-untyped-def]
    frames = [bytes(f) for f in encode(Op.PUSH, key="a", tensor=torch.ones(4))]
    with pytest.raises(WireError, match=match):
        decode(mutate(frames))


def test_seal_numbers_each_send_under_the_tag() -> None:
    frames = encode(Op.PUSH, key="a", tensor=torch.ones(4), job=0xAB, session=77)
    first, second = seal(frames, seq=1, secret=b"s"), seal(frames, seq=2, secret=b"s")
    m1, m2 = decode(first, secret=b"s"), decode(second, secret=b"s")
    assert (m1.job, m1.session, m1.seq, m2.seq) == (0xAB, 77, 1, 2) and first[1] is frames[1]  # payload not copied
    assert first[2] != second[2]
    forged = [second[0], first[1], first[2]]  # a new seq under an old tag
    with pytest.raises(WireError, match="tag does not match"):
        decode(forged, secret=b"s")


def test_protocol_1_peer_is_named() -> None:
    old = struct.pack("<4sBBBBHHBBHIIQQQQQiI", b"GSPS", 1, int(Op.PING), 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
    with pytest.raises(WireError, match=f"protocol version 1; this build speaks {wire.PROTO}"):
        decode([old, b""])


def test_decode_enforces_payload_limit_and_tag() -> None:
    frames = [bytes(f) for f in encode(Op.PUSH, key="a", tensor=torch.ones(64), secret=b"s")]
    with pytest.raises(WireError, match="exceeds"):
        decode(frames, secret=b"s", max_payload=100)
    with pytest.raises(WireError, match="tag does not match"):
        decode(frames, secret=b"other")
    with pytest.raises(WireError, match="no authentication tag"):
        decode(frames[:2], secret=b"s")
    tampered = [frames[0], b"\x00" * len(frames[1]), frames[2]]
    with pytest.raises(WireError, match="tag does not match"):
        decode(tampered, secret=b"s")


def test_gmac_tag_equals_aes_gcm_computed_through_the_streaming_api() -> None:
    """The tag is AES-256-GCM's over (associated data = payload, plaintext = header) under the derived key,
    recomputed here through cryptography's other (streaming) interface; every field of the frame is covered."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    frames = encode(Op.PUSH, key="w", tensor=torch.arange(1000, dtype=torch.float32), secret=b"k3y")
    head, body, tag = bytes(frames[0]), bytes(frames[1]), frames[2]
    assert tag[0] == wire.MAC_GMAC and len(tag) == 29
    key = hmac_lib.digest(b"k3y", b"gradsync-ps-gmac-v1", "sha256")
    enc = Cipher(algorithms.AES(key), modes.GCM(tag[1:13])).encryptor()
    enc.authenticate_additional_data(body)
    enc.update(head)
    enc.finalize()
    assert enc.tag == tag[13:]
    decode(frames, secret=b"k3y")
    for i in (0, 1, 2):  # header, payload, and the nonce or tag: one flipped bit anywhere is refused
        for at in (0, len(bytes(frames[i])) - 1):
            bad = [bytearray(bytes(f)) for f in frames]
            bad[i][at] ^= 1
            with pytest.raises(WireError, match="tag does not match|protocol|magic|algorithm"):
                decode([bytes(b) for b in bad], secret=b"k3y")


def test_gmac_nonces_never_repeat_in_a_process_or_a_forked_child() -> None:
    import os

    nonces = {bytes(encode(Op.PING, secret=b"s")[2][1:13]) for _ in range(2000)}
    assert len(nonces) == 2000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's first nonce (its prefix must differ from the parent's)
        os.write(write, bytes(encode(Op.PING, secret=b"s")[2][1:13]))
        os._exit(0)
    os.close(write)
    child = os.read(read, 12)
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 12 and child[:8] != next(iter(nonces))[:8] and child not in nonces


def test_hmac_sender_without_cryptography_is_accepted_and_a_gmac_tag_needs_it(monkeypatch) -> None:
    gmac = encode(Op.PUSH, key="a", tensor=torch.ones(8), secret=b"s")
    monkeypatch.setattr(wire, "AESGCM", None)
    assert wire.mac_algorithm() == wire.MAC_HMAC
    frames = encode(Op.PUSH, key="a", tensor=torch.ones(8), secret=b"s")
    assert frames[2][0] == wire.MAC_HMAC and frames[2][1:] == hmac_lib.digest(
        b"s", bytes(frames[0]) + bytes(frames[1]), "sha256")
    assert decode(frames, secret=b"s").key == "a"
    with pytest.raises(WireError, match="pip install cryptography"):
        decode(gmac, secret=b"s")
    monkeypatch.undo()
    assert decode(frames, secret=b"s").key == "a"  # a GMAC-capable receiver still takes HMAC
    with pytest.raises(WireError, match="expected 2 .AES-GMAC, 29 bytes. or 1"):
        decode([frames[0], frames[1], frames[2][:20]], secret=b"s")


def _detached_pair(secret: bytes = b"s", n: int = wire.DETACH_BYTES // 4) -> tuple[list, bytes]:
    frames = seal(encode(Op.PUSH, key="a", tensor=torch.arange(n, dtype=torch.float32), session=5), seq=1,
                  secret=secret, detach=True)
    return frames, wire.tag_frame(frames, secret)


def test_large_payloads_detach_their_mac_and_small_ones_keep_it_inline() -> None:
    frames, mac = _detached_pair()
    assert wire.is_detached(frames) and len(frames[2]) == 13 and len(mac) == 16  # prefix: algorithm + nonce
    small = seal(encode(Op.PUSH, key="a", tensor=torch.ones(8), flags=Flag.DETACHED), seq=1, secret=b"s", detach=True)
    assert not wire.is_detached(small) and len(small[2]) == 29  # a flag a caller passed is not ours to keep
    assert not decode(small, secret=b"s").flags & Flag.DETACHED
    unsecured = encode(Op.PUSH, key="a", tensor=torch.ones(1 << 17), detach=True)
    assert len(unsecured) == 2 and not wire.is_detached(unsecured)
    joined = [frames[0], frames[1], frames[2] + mac]
    assert torch.equal(decode(joined, secret=b"s").tensor(), torch.arange(wire.DETACH_BYTES // 4, dtype=torch.float32))


def test_tag_joiner_joins_checks_early_and_refuses_what_never_got_its_mac() -> None:
    frames, mac = _detached_pair()
    joiner = wire.TagJoiner(b"s")
    assert joiner.feed("p", frames) == [] and joiner.feed("q", [b"other peer"]) == [([b"other peer"], None)]
    [(joined, expected)] = joiner.feed("p", [mac])
    assert expected == mac and joiner.joined == 1  # hashed when the payload came, before the MAC
    assert decode(joined, secret=b"s", expected=expected).key == "a"
    bad = bytearray(mac)
    bad[0] ^= 1
    joiner.feed("p", frames)
    [(joined, expected)] = joiner.feed("p", [bytes(bad)])
    with pytest.raises(WireError, match="tag does not match"):
        decode(joined, secret=b"s", expected=expected)
    # the next message is not the MAC: the held one comes out untagged (refused), the new one as it is
    joiner.feed("p", frames)
    small = encode(Op.PING, secret=b"s")
    (held, none), (nxt, _) = joiner.feed("p", small)
    assert none is None and len(held) == 2 and nxt is small
    with pytest.raises(WireError, match="no authentication tag"):
        decode(held, secret=b"s")
    # bounded: the oldest waiting peer is given up on; without a secret the pair is joined and not checked
    few = wire.TagJoiner(b"s", max_peers=2)
    assert few.feed(1, frames) == few.feed(2, frames) == []
    [(evicted, _)] = few.feed(3, frames)
    assert len(evicted) == 2 and set(few.pending) == {2, 3}
    open_joiner = wire.TagJoiner(None)
    open_joiner.feed("p", frames)
    [(plain, expected)] = open_joiner.feed("p", [mac])
    assert expected is None and decode(plain).key == "a"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_fuzz_decoder_only_raises_wire_error(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=HEADER.size, max_size=HEADER.size + 40), st.binary(max_size=64))
def test_fuzz_headers_with_valid_magic(rest: bytes, body: bytes) -> None:
    head = b"GSPS\x01" + rest[5:]
    try:
        m = decode([head, body])
    except WireError:
        return
    if m.dtype is not None:  # a frame that decodes also yields a tensor of exactly its payload
        assert m.tensor().numel() == m.numel


# ---- update rules ---------------------------------------------------------------------------------------
def test_server_sgd_momentum_matches_torch() -> None:
    torch.manual_seed(0)
    w0 = torch.randn(10)
    grads = [torch.randn(10) for _ in range(5)]
    rule = create_updater("sgd", lr=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5)
    w, state = w0.clone(), {}
    for g in grads:
        rule.apply(w, g, 1, state)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    for g in grads:
        p.grad = g * 0.5
        opt.step()
    assert torch.allclose(w, p.detach(), atol=1e-6)


def test_server_adam_matches_torch() -> None:
    torch.manual_seed(1)
    w0 = torch.randn(10, dtype=torch.float64)
    grads = [torch.randn(10, dtype=torch.float64) for _ in range(6)]
    rule = create_updater("adam", lr=0.01)
    w, state = w0.clone(), {}
    for g in grads:
        rule.apply(w, g, 1, state)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adam([p], lr=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert torch.allclose(w, p.detach(), atol=1e-12)


def test_elastic_is_seed_equation_2() -> None:
    center, w = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    create_updater("elastic", alpha=0.25).apply(center, w, 1, {})
    assert torch.equal(center, torch.tensor([1.0 + 0.25 * 2.0, 2.0 + 0.25 * -4.0]))


def test_updater_errors_name_the_value() -> None:
    with pytest.raises(GradsyncError, match="lr=-1"):
        create_updater("sgd", lr=-1)
    with pytest.raises(GradsyncError, match="no hyper-parameter beta"):
        create_updater("sgd", beta=0.3)
    with pytest.raises(GradsyncError, match="unknown server update rule 'sgdd'.*Did you mean 'sgd'"):
        create_updater("sgdd")
    assert create_updater("momentum").momentum == 0.9  # type: ignore[attr-defined]


# ---- placement --------------------------------------------------------------------------------------------
def test_large_keys_are_sliced_evenly_over_all_servers() -> None:
    parts = place("big", 1_000_003, 4, 3)
    assert sorted(p.server for p in parts) == [0, 1, 2]
    assert [p.offset for p in parts] == [0, parts[0].numel, parts[0].numel + parts[1].numel]
    assert sum(p.numel for p in parts) == 1_000_003 and max(p.numel for p in parts) - min(p.numel for p in parts) <= 1
    small = place("bias", 10, 4, 3)
    assert len(small) == 1 and small == place("bias", 10, 4, 3)  # stable across calls (and processes: crc32)
    servers = {place(f"k{i}", 10, 4, 4)[0].server for i in range(40)}
    assert servers == {0, 1, 2, 3}


# ---- servers on threads --------------------------------------------------------------------------------
class Cluster:
    def __init__(self, n: int, **cfg: object) -> None:
        self.servers = [Server(ServerConfig(server_id=i, **cfg)) for i in range(n)]  # type: ignore[arg-type]
        self.threads = [threading.Thread(target=s.serve, daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()
        self.endpoints = tuple(s.endpoint for s in self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.stopping = True
        for t in self.threads:
            t.join(timeout=5)


@pytest.fixture
def cluster2() -> Iterator[Cluster]:
    c = Cluster(2)
    yield c
    c.stop()


def run_workers(n: int, fn) -> dict[int, object]:  # type: ignore[no-untyped-def]
    out: dict[int, object] = {}
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


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


def test_struct_header_is_documented_size() -> None:
    assert HEADER.size == 96 and struct.calcsize("<Q") == 8


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
    """One reader (gradsync.ps.env.env_number): empty or blank means the default on both sides; text is an error
    naming the variable."""
    from gradsync.ps.env import env_number

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
