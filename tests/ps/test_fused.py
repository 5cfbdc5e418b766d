"""The fused push-and-pull exchange (``PUSHPULL``) and replies sent without a copy (issue 15, part 3).

Expectations are closed forms (a sync round of W workers pushing rank+1 sums to W(W+1)/2), brute force
over the orders an async server may apply pushes in, and raw frames written without the client library.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from gradsync.ps import wire
from gradsync.ps.client import PSClient, place
from gradsync.ps.kvstore import KVStoreConfig, PSKVStore
from gradsync.ps.server import Slot
from gradsync.ps.wire import Flag, Op, encode
from tests.ps.cluster import Cluster, run_workers
from tests.test_faults import _Served

W, ROUNDS = 3, 4
TOTAL = W * (W + 1) // 2


@pytest.fixture
def served() -> Iterator[_Served]:
    s = _Served()
    yield s
    s.close()


def _store(cluster: Cluster, rank: int, sync: bool, secret: bytes | None, **cfg: object) -> PSKVStore:
    config = KVStoreConfig(rank=rank, num_workers=W, servers=cluster.endpoints, slice_bytes=256, timeout_s=20,
                           secret=secret, **cfg)  # type: ignore[arg-type]
    return PSKVStore(config, sync=sync, hybrid=False)


def _async_values(rank: int, r: int) -> set[int]:
    """Every value an async pull after this worker's r-th push may see (brute force): the initial 0, its
    own r pushes of rank+1, and 0..ROUNDS pushes of each other worker."""
    others = [j + 1 for j in range(W) if j != rank]
    return {r * (rank + 1) + sum(c * v for c, v in zip(counts, others))
            for counts in itertools.product(range(ROUNDS + 1), repeat=len(others))}


@pytest.mark.parametrize("secret", [None, b"s3cret"], ids=["plain", "hmac"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_pushpull_is_one_exchange_and_meets_the_oracle(sync: bool, secret: bytes | None) -> None:
    """W workers pushpull ones*(rank+1) into a key sliced over 2 servers and a whole one: sync, every
    round's value is W(W+1)/2; async, each value is one an order of the pushes allows, never decreasing
    within a part (parts on different servers may apply another worker's push at different times), and
    after a barrier the sum of all pushes. The servers saw PUSHPULL requests only (one per part and round),
    no PUSH or PULL."""
    cluster = Cluster(2, secret=secret)
    assert len(place("big", 300, 4, 2, 256)) == 2 and len(place("small", 5, 4, 2, 256)) == 1
    try:
        def worker(rank: int) -> None:
            kv = _store(cluster, rank, sync, secret)
            kv.init(["big", "small"], [torch.zeros(300), torch.zeros(5)])
            last: dict[tuple[int, int], float] = {}  # per key and part: each lives on one server
            for r in range(1, ROUNDS + 1):
                outs = [torch.empty(300), torch.empty(5)]
                kv.pushpull(["big", "small"], [torch.full((300,), rank + 1.0), torch.full((5,), rank + 1.0)], outs)
                for k, o in enumerate(outs):
                    if sync:
                        assert torch.equal(o, torch.full_like(o, TOTAL)), (rank, r, o[:3])
                    else:
                        assert o.min() == o.max() or o.numel() == 300, (rank, r, o)  # one value per part
                        for i, part in enumerate((o[:150], o[150:]) if o.numel() == 300 else (o,)):
                            v = float(part[0])
                            assert torch.all(part == v) and int(v) in _async_values(rank, r), (r, v)
                            assert v >= last.get((k, i), 0.0), (rank, r, k, i, v, last)
                            last[(k, i)] = v
                assert kv.round_pushers("big") == (W if sync else 0) == kv.round_pushers("small")
            kv.barrier()
            if not sync:
                out = torch.empty(300)
                kv.pull("big", out)
                assert torch.equal(out, torch.full((300,), float(ROUNDS * TOTAL)))
            kv.close()

        run_workers(W, worker)
        ops = [s.ops for s in cluster.servers]
        assert sum(o.get("PUSHPULL", 0) for o in ops) == W * ROUNDS * 3, ops  # "big": 2 parts, "small": 1
        assert not any(o.get("PUSH") for o in ops), ops
        assert sum(o.get("PULL", 0) for o in ops) == (0 if sync else W * 2), ops  # the final check
    finally:
        cluster.stop()


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_detached_macs_meet_the_oracle_both_ways(sync: bool) -> None:
    """Parts of DETACH_BYTES and more travel with their MAC as a message of its own, requests and replies:
    W workers pushpull a key of two such parts over 2 servers with a secret twice; the sync oracle holds and
    a pull then gives the round's sum (async: the sum of all pushes after a barrier), and both servers and
    every client joined detached pairs."""
    cluster = Cluster(2, secret=b"s3cret")
    n = 2 * wire.DETACH_BYTES // 4  # float32: one part of DETACH_BYTES per server
    try:
        def worker(rank: int) -> None:
            config = KVStoreConfig(rank=rank, num_workers=W, servers=cluster.endpoints, timeout_s=20,
                                   secret=b"s3cret", slice_bytes=wire.DETACH_BYTES)
            kv = PSKVStore(config, sync=sync, hybrid=False)
            kv.init("huge", torch.zeros(n))
            for _ in range(2):
                out = torch.empty(n)
                kv.pushpull("huge", torch.full((n,), rank + 1.0), out)
                if sync:
                    assert torch.equal(out, torch.full((n,), float(TOTAL)))
            kv.barrier()
            out = torch.empty(n)
            kv.pull("huge", out)
            assert torch.equal(out, torch.full((n,), float(TOTAL if sync else 2 * TOTAL)))  # sync: the round's sum
            assert kv.client.joiner.joined >= 3, kv.client.joiner.joined  # two VALUEs and the pull's
            kv.close()

        run_workers(W, worker)
        assert all(s.joiner.joined >= 2 * W for s in cluster.servers), [s.joiner.joined for s in cluster.servers]
    finally:
        cluster.stop()


def test_ordered_pushpull_replies_in_priority_order() -> None:
    """ORDERED PUSHPULLs sent lowest priority first come back in priority order (at the receiver), each
    with the value its push produced; an ordered kvstore's pushpull_async meets the sync oracle."""
    cluster = Cluster(1)
    keys = [f"k{i}" for i in range(5)]
    prio = {"k0": 4, "k1": 2, "k2": 0, "k3": 3, "k4": 1}
    try:
        client = PSClient(cluster.endpoints, sender=0, timeout_s=10)
        client.call([client.request(0, Op.INIT, what="init", key=k, tensor=torch.zeros(2), count=1) for k in keys])
        for it in range(1, 3):
            seen: list[tuple[str, float]] = []
            client.call([client.request(0, Op.PUSHPULL, what="pushpull", key=k, tensor=torch.full((2,), 1.0),
                                        version=it, priority=prio[k], count=len(keys), flags=Flag.ORDERED,
                                        on_reply=lambda m, seen=seen: seen.append((m.key, float(m.tensor()[0]))))
                         for k in sorted(keys, key=lambda k: -prio[k])])
            assert seen == [(k, float(it)) for k in sorted(keys, key=prio.get)], (it, seen)
        client.close()

        def worker(rank: int) -> None:
            kv = _store(cluster, rank, True, None, ordered=True)
            kv.init([f"s{k}" for k in keys], [torch.zeros(3) for _ in keys])
            for r in range(1, ROUNDS + 1):
                outs = [torch.empty(3) for _ in keys]
                kv.pushpull_async([f"s{k}" for k in keys], [torch.full((3,), rank + 1.0) for _ in keys], outs,
                                  [prio[k] for k in keys]).wait_all()
                assert all(torch.equal(o, torch.full((3,), float(TOTAL))) for o in outs), (r, outs)
            kv.close()

        run_workers(W, worker)
        assert cluster.servers[0].ops.get("PUSHPULL") == 2 * len(keys) + W * ROUNDS * len(keys)
    finally:
        cluster.stop()


def test_reply_sent_without_copy_keeps_the_value_it_was_sent_with() -> None:
    """Thirty 1 MB PUSHPULLs to an async key sent before any reply is read: ZeroMQ still holds earlier
    replies (sent from the stored tensor's memory) while later pushes change the value, so each reply
    must still be exactly the prefix sum at its own push: 1, 1+2, ..., i.e. n(n+1)/2."""
    s = _Served()
    try:
        n = 1 << 18  # 1 MiB of float32: above pyzmq's copy threshold, so sent without a copy
        assert s.ask(encode(Op.INIT, key="a", tensor=torch.zeros(n), count=1)).op == Op.ACK
        for i in range(1, 31):
            s.send(encode(Op.PUSHPULL, key="a", tensor=torch.full((n,), float(i)), version=i, req_id=i))
        replies = s.replies(quiet_ms=500)
        assert [m.req_id for m in replies] == list(range(1, 31))
        for m in replies:
            t = m.tensor()
            want = m.req_id * (m.req_id + 1) / 2
            assert m.op == Op.VALUE and t.min() == t.max() == want, (m.req_id, t.min(), t.max(), want)
    finally:
        s.close()


class _Pending:
    done = False


def test_writable_copies_only_while_a_reply_still_sends() -> None:
    slot = Slot(value=torch.zeros(4), shape=(4,), offset=0, parts=1, sync=False, pushers=1)
    before = slot.value
    assert slot.writable() is before  # nothing in flight: changed in place
    slot.sending.append(_Pending())
    after = slot.writable()
    after.add_(1.0)
    assert after is not before and torch.equal(before, torch.zeros(4)) and not slot.sending
    assert slot.writable() is after


def test_no_part_is_larger_than_part_bytes_and_servers_stay_balanced() -> None:
    """Brute force over sizes and server counts: parts tile the key, none exceeds part_bytes, and a sliced
    key has the same number of parts on every server (sizes within one element)."""
    for numel in (1, 7, 1000, 1_000_003, 10_000_000, 16 << 20):
        for servers in (1, 2, 3, 4):
            parts = place("k", numel, 4, servers, slice_bytes=1 << 20, part_bytes=4 << 20)
            assert [p.offset for p in parts] == [sum(q.numel for q in parts[:i]) for i in range(len(parts))]
            assert sum(p.numel for p in parts) == numel and all(p.parts == len(parts) for p in parts)
            assert all(p.numel * 4 <= 4 << 20 for p in parts), (numel, servers)
            assert max(p.numel for p in parts) - min(p.numel for p in parts) <= 1
            if len(parts) > 1 and numel * 4 >= 1 << 20:
                per = [sum(p.server == s for p in parts) for s in range(servers)]
                assert len(set(per)) == 1, (numel, servers, per)
    assert len(place("k", 16 << 20, 4, 1, part_bytes=4 << 20)) == 16  # 64 MiB on one server: 16 messages


def test_parts_on_one_server_meet_the_oracle() -> None:
    """A 1200-byte key with part_bytes=256 needs 5 parts; sliced over 2 servers they become 6, 3 on each,
    and every round still sums to W(W+1)/2 times the pushed pattern."""
    cluster = Cluster(2)
    try:
        def worker(rank: int) -> None:
            kv = _store(cluster, rank, True, None, part_bytes=256)
            kv.init("w", torch.zeros(300))
            for r in range(1, ROUNDS + 1):
                out = torch.empty(300)
                kv.pushpull("w", torch.arange(300.0) * (rank + 1), out)
                assert torch.equal(out, torch.arange(300.0) * TOTAL), (rank, r)
            kv.close()

        run_workers(W, worker)
        assert [sum(s.server == i for s in place("w", 300, 4, 2, 256, 256)) for i in (0, 1)] == [3, 3]
        assert sum(s.ops["PUSHPULL"] for s in cluster.servers) == W * ROUNDS * 6
    finally:
        cluster.stop()


def _sync_key(s: _Served) -> None:
    assert s.ask(encode(Op.INIT, key="w", tensor=torch.zeros(8), count=2, flags=Flag.SYNC)).op == Op.ACK


def _status(s: _Served) -> dict:  # type: ignore[type-arg]
    (info,) = s.ask(encode(Op.STATUS, key="w")).json()
    return info  # type: ignore[no-any-return]


@pytest.mark.parametrize("frames, match", [
    (encode(Op.PUSHPULL, key="w", tensor=torch.ones(5), version=1), "initialised as torch.float32 shape (8,)"),
    (encode(Op.PUSHPULL, key="w", tensor=torch.ones(8, dtype=torch.float64), version=1), "float64"),
    (encode(Op.PUSHPULL, key="w", tensor=torch.ones(8), version=0), "rounds start at 1"),
    (encode(Op.PUSHPULL, key="w", tensor=torch.ones(8), version=1, sender=7), "sender 7"),
    (encode(Op.PUSHPULL, key="w", tensor=torch.ones(8), version=50), "--max-ahead"),
    (encode(Op.PUSHPULL, key="nope", tensor=torch.ones(8), version=1), "not initialised"),
    (encode(Op.PUSHPULL, key="w", tensor=torch.ones(8), version=1, flags=Flag.ORDERED, priority=3, count=2),
     "priority 3 must be in 0..1"),
])
def test_bad_pushpull_gets_an_error_and_leaves_the_round_untouched(served: _Served, frames: list,  # type: ignore[type-arg]
                                                                   match: str) -> None:
    _sync_key(served)
    m = served.ask(frames)
    assert m.op == Op.ERROR and match in m.text(), m.text()
    assert _status(served)["pushed"] == [] and _status(served)["version"] == 0
    # the key still works: a good round through the fused exchange
    served.send(encode(Op.PUSHPULL, key="w", tensor=torch.full((8,), 2.0), version=1, sender=0, req_id=1))
    served.send(encode(Op.PUSHPULL, key="w", tensor=torch.full((8,), 3.0), version=1, sender=1, req_id=2))
    values = served.replies()
    assert sorted(v.req_id for v in values) == [1, 2]
    assert all(v.op == Op.VALUE and torch.equal(v.tensor(), torch.full((8,), 5.0)) for v in values)


def test_pushpull_past_the_parking_cap_says_its_push_was_kept() -> None:
    s = _Served(max_parked_per_key=1)
    try:
        _sync_key(s)
        s.send(encode(Op.PULL, key="w", version=1, req_id=9))  # parks: round 1 is not complete
        m = s.ask(encode(Op.PUSHPULL, key="w", tensor=torch.ones(8), version=1, sender=0, req_id=10))
        assert m.op == Op.ERROR and "--max-parked-per-key" in m.text() and "its push was applied" in m.text()
        assert _status(s)["pushed"] == [0]
        # a retry of the same request is a repeat of the push: sender 1 completes the round with 1 + 1
        s.send(encode(Op.PUSHPULL, key="w", tensor=torch.ones(8), version=1, sender=1, req_id=11))
        values = {m.req_id: m for m in s.replies()}
        assert set(values) == {9, 11} and all(torch.equal(v.tensor(), torch.full((8,), 2.0)) for v in values.values())
    finally:
        s.close()


def test_status_reports_the_ops_the_workers_use(served: _Served) -> None:
    client = PSClient([served.endpoint], sender=0, timeout_s=5)
    try:
        info: list[dict] = []  # type: ignore[type-arg]
        client.call([client.request(0, Op.STATUS, what="status", on_reply=lambda m: info.append(m.json()))])
        assert info[0]["ops"] == {"STATUS": 1}
    finally:
        client.close()
