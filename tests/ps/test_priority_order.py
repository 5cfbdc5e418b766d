"""TicTac enforcement on the parameter server (issue 7), servers on threads.

What is observed is what arrives at the receiver: a spy on the client's socket handler decodes every frame
before the library sees it. Expectations are independent of the client's ranking code: the priority order
of the (key, part) slots each server actually holds, or the order in which the slowest worker made values
ready (priorities off: whatever arrives).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from gradsync.errors import GradsyncError
from gradsync.ps.client import PSClient
from gradsync.ps.kvstore import KVStoreConfig, PSKVStore
from gradsync.ps.wire import Flag, Op, decode, encode
from gradsync.train.ps_overlap import attach_pull_waits
from gradsync.train.ps_trainer import PSTrainer, create_trainer
from tests.ps.cluster import Cluster

# 10 keys: the "big*" ones (100 floats = 400 bytes >= slice_bytes 256) are sliced over both servers
KEYS = [f"small{i}" for i in range(6)] + [f"big{i}" for i in range(4)]
SIZES = {k: 100 if k.startswith("big") else 3 + i for i, k in enumerate(KEYS)}


@pytest.fixture
def cluster2() -> Iterator[Cluster]:
    c = Cluster(2)
    yield c
    c.stop()


def make_stores(cluster: Cluster, n: int, sync: bool = True, **cfg: Any) -> list[PSKVStore]:
    """``n`` stores (ranks 0..n-1) with KEYS initialised to rank-independent values; init's barrier needs threads."""
    stores: list[PSKVStore | None] = [None] * n

    def body(rank: int) -> None:
        config = KVStoreConfig(rank=rank, num_workers=n, servers=cluster.endpoints, slice_bytes=256, timeout_s=20,
                               retry_s=0.5, **cfg)
        kv = PSKVStore(config, sync=sync, hybrid=False)
        kv.init(KEYS, [torch.arange(SIZES[k], dtype=torch.float32) + j for j, k in enumerate(KEYS)])
        stores[rank] = kv

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(s is not None for s in stores)
    return stores  # type: ignore[return-value]


def spy(kv: PSKVStore) -> dict[int, list[tuple[str, int]]]:
    """Record (key, part) of every VALUE frame in arrival order, per server, before the client handles it."""
    seen: dict[int, list[tuple[str, int]]] = {}
    original = kv.client._on_frames

    def on_frames(server: int, frames: list[Any]) -> None:
        m = decode([f.buffer for f in frames])
        if m.op == Op.VALUE:
            seen.setdefault(server, []).append((m.key, m.part))  # type: ignore[arg-type]
        original(server, frames)

    kv.client._on_frames = on_frames  # type: ignore[method-assign]
    return seen


def per_server(cluster: Cluster, order: list[str]) -> dict[int, list[tuple[str, int]]]:
    """Each server's slots (what it really stores) listed in the order of ``order``."""
    out: dict[int, list[tuple[str, int]]] = {}
    for s, server in enumerate(cluster.servers):
        mine = sorted(server.slots, key=lambda kp: (order.index(kp[0]), kp[1]))
        out[s] = [(k, p) for k, p in mine if k in order]  # type: ignore[misc]
    return out


@pytest.mark.parametrize("ordered", [True, False])
def test_priority_order_holds_at_the_receiver_every_iteration(cluster2: Cluster, ordered: bool) -> None:
    """Worker 0 pushes, starts its pull, then worker 1 pushes key by key in a fresh random order: the values
    become ready in worker 1's order. With priorities on, worker 0 still receives every server's parts in
    priority order, every iteration; with priorities off, in the order they became ready."""
    kv0, kv1 = make_stores(cluster2, 2, ordered=ordered)
    rng = random.Random(7)
    prio_order = KEYS[:]
    rng.shuffle(prio_order)
    prio = {k: prio_order.index(k) for k in KEYS}
    seen = spy(kv0)
    slots = per_server(cluster2, KEYS)
    assert sum(map(len, slots.values())) == 6 + 2 * 4 and all(len(v) >= 5 for v in slots.values())  # big: 2 parts
    for it in range(1, 5):
        seen.clear()
        ready_order = KEYS[:]
        rng.shuffle(ready_order)
        kv0.push(KEYS, [torch.ones(SIZES[k]) for k in KEYS])
        outs = [torch.empty(SIZES[k]) for k in KEYS]
        handle = kv0.pull_async(KEYS, outs, [prio[k] for k in KEYS])
        kv0.client.progress(0.05)  # the pull requests are at the servers, deferred (round incomplete)
        assert seen == {}
        for k in ready_order:
            kv1.push(k, torch.ones(SIZES[k]) * 2)
        handle.wait_all()
        kv1.pull(KEYS, [torch.empty(SIZES[k]) for k in KEYS])
        expected = per_server(cluster2, prio_order if ordered else ready_order)
        assert seen == expected, (it, ordered)
        for k, o in zip(KEYS, outs):  # no server optimizer: the value is the round's sum, 1 + 2
            assert torch.equal(o, torch.full((SIZES[k],), 3.0)), (it, k)
    kv0.close()
    kv1.close()


def test_pull_async_equals_blocking_pull_and_waits_per_key(cluster2: Cluster) -> None:
    kv0, kv1 = make_stores(cluster2, 2)
    initial = [torch.arange(SIZES[k], dtype=torch.float32) + j for j, k in enumerate(KEYS)]
    a_outs = [torch.empty(SIZES[k]) for k in KEYS]
    kv0.pull_async(KEYS, a_outs, list(range(len(KEYS)))).wait_all()
    b_outs = [torch.empty(SIZES[k]) for k in KEYS]
    kv0.pull(KEYS, b_outs)
    for a, b, v in zip(a_outs, b_outs, initial):
        assert torch.equal(a, v) and torch.equal(b, v)
    # round 1: both workers push "small0"; "big0" only from worker 0 for now
    kv0.push(["small0", "big0"], [torch.ones(3), torch.ones(100)])
    kv1.push("small0", torch.ones(3) * 4)
    outs = [torch.empty(3), torch.empty(100)]
    h = kv0.pull_async(["small0", "big0"], outs)
    t0 = time.monotonic()
    h.wait("small0")  # returns although big0 is outstanding
    assert time.monotonic() - t0 < 5 and torch.equal(outs[0], torch.full((3,), 5.0))
    kv0.client.progress(0.1)
    assert h.ready("small0") and not h.ready("big0") and not h.done
    kv1.push("big0", torch.ones(100) * 4)
    h.wait("big0")
    assert torch.equal(outs[1], torch.full((100,), 5.0)) and h.done
    with pytest.raises(GradsyncError, match="not part of this pull"):
        h.wait("small1")
    kv0.close()
    kv1.close()


def test_ordered_wait_key_is_held_behind_higher_priorities(cluster2: Cluster) -> None:
    """With ordered pulls, a ready key ranked after one that is not ready stays behind it (the counter)."""
    kv0, kv1 = make_stores(cluster2, 2, ordered=True)
    server_of_small = [s for s, srv in enumerate(cluster2.servers) if ("small1", 0) in srv.slots][0]
    other = next(k for k in KEYS[:6] if k != "small1" and (k, 0) in cluster2.servers[server_of_small].slots)
    kv0.push([other, "small1"], [torch.ones(SIZES[other]), torch.ones(SIZES["small1"])])
    kv1.push("small1", torch.ones(SIZES["small1"]))  # small1 ready; `other` (same server, priority 0) not yet
    outs = [torch.empty(SIZES[other]), torch.empty(SIZES["small1"])]
    h = kv0.pull_async([other, "small1"], outs, [0, 1])
    kv0.client.progress(0.2)
    assert not h.ready("small1")
    kv1.push(other, torch.ones(SIZES[other]))
    h.wait("small1")
    assert torch.equal(outs[1], torch.full((SIZES["small1"],), 2.0)) and h.ready(other)
    kv0.close()
    kv1.close()


def test_restart_renumbers_outstanding_ordered_pulls() -> None:
    """A server that restarts (new incarnation) lost its counter: the client re-sends what is still
    outstanding as priorities 0..m-1 in the old order. A fake server on a raw ROUTER socket checks it."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    resent: list[tuple[str, int, int]] = []

    def fake() -> None:
        def recv() -> tuple[bytes, Any]:
            ident, *frames = router.recv_multipart()
            return ident, decode(frames)

        def reply(ident: bytes, m: Any, incarnation: int) -> None:
            router.send_multipart([ident, *encode(Op.VALUE, key=m.key, tensor=torch.ones(1), req_id=m.req_id,
                                                  incarnation=incarnation)])

        ident, ping = recv()
        router.send_multipart([ident, *encode(Op.ACK, req_id=ping.req_id, incarnation=11)])
        first = [recv()[1] for _ in range(4)]
        reply(ident, min(first, key=lambda m: m.priority), 11)  # priority 0 goes out, then "crash"
        router.send_multipart([ident, *encode(Op.ACK, req_id=0, incarnation=23)])  # a PING's ACK from the new process
        again = [recv()[1] for _ in range(3)]
        resent.extend((m.key, m.priority, m.count) for m in again)
        for m in sorted(again, key=lambda m: m.priority):
            reply(ident, m, 23)

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    client = PSClient([f"tcp://127.0.0.1:{port}"], sender=0, timeout_s=10, retry_s=5)
    client.connect()
    got: list[str] = []
    prio = {"a": 2, "b": 0, "c": 3, "d": 1}
    client.call([client.request(0, Op.PULL, what="pull", key=k, priority=p, count=4, flags=Flag.ORDERED,
                                on_reply=lambda m: got.append(m.key)) for k, p in prio.items()])
    t.join(timeout=5)
    router.close()
    client.close()
    assert got == ["b", "d", "a", "c"]
    assert sorted(resent, key=lambda r: r[1]) == [("d", 0, 3), ("a", 1, 3), ("c", 2, 3)]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("algorithm", ["dist-sgd", "dist-asgd"])
def test_trainer_priorities_and_overlap_match_plain_sgd(algorithm: str) -> None:
    """One switch: priorities turn ordered pulls on; with overlap the hooks finish each layer before it runs.
    One worker, so every algorithm is plain SGD: the reference is a local torch.optim.SGD run."""
    c = Cluster(1)
    try:
        lr, steps = 0.1, 4
        gen = torch.Generator().manual_seed(1)
        data = [(torch.randn(5, 8, generator=gen), torch.randint(0, 4, (5,), generator=gen)) for _ in range(steps)]
        reference = _mlp()
        opt = torch.optim.SGD(reference.parameters(), lr=lr)
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(reference(x), y).backward()
            opt.step()
        model = _mlp()
        trainer = create_trainer(algorithm, model, priorities="tac", example=data[0][0], overlap=True, lr=lr,
                                 servers=c.endpoints, num_workers=1, rank=0, timeout_s=20, prefix=f"{algorithm}/")
        assert isinstance(trainer.kv, PSKVStore) and trainer.kv.config.ordered
        assert sorted(trainer.priority) == list(range(4))
        for x, y in data:
            trainer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            trainer.step()
            assert trainer._handle is not None  # the pull is in flight when step() returns
        trainer.synchronize()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-6)
        trainer.waits.remove()
        trainer.close()
        with pytest.raises(GradsyncError, match="lack 1 trainable"):
            PSTrainer(algorithm, model.named_parameters(), priorities={"0.weight": 0, "0.bias": 1, "2.weight": 2},
                      servers=c.endpoints, num_workers=1, rank=0)
        with pytest.raises(GradsyncError, match="takes the list itself"):
            PSTrainer(algorithm, model.named_parameters(), priorities="tac", servers=c.endpoints)  # type: ignore[arg-type]
    finally:
        c.stop()


def test_attach_pull_waits_waits_per_module_and_removes(cluster2: Cluster) -> None:
    (kv,) = make_stores(cluster2, 1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 100, bias=False), torch.nn.Linear(100, 1, bias=False))
    names = ["0.weight", "1.weight"]
    kv.init(names, [torch.full((100, 3), 0.5), torch.full((1, 100), 2.0)])
    waited: list[str] = []
    h = kv.pull_async(names, [p.data for p in model.parameters()])
    with attach_pull_waits(model, h, on_ready=waited.append) as waits:
        out = model(torch.ones(1, 3))
        assert waited == names and set(waits.keys) == set(names)
    assert torch.allclose(out, torch.full((1, 1), 1.5 * 2.0 * 100))
    model(torch.ones(1, 3))
    assert waited == names  # hooks removed
    kv.close()
