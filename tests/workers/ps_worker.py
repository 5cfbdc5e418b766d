"""Worker scenarios for tests/ps/test_dist.py, started by ``gradsync launch`` (or the test) per rank.

Each prints ``OK <detail>`` on success; assertions use closed forms: each worker pushes ones*(rank+1),
so a sync round of W dist workers sums to W(W+1)/2 and so does a round of hybrid clients.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from gradsync import kvstore
from gradsync.errors import PeerError


def oracle(kind: str, rounds: int = 5) -> None:
    kv = kvstore.create(kind)
    W = kv.num_workers
    total = W * (W + 1) / 2
    kv.init(["w", 1], [torch.zeros(3000), torch.zeros(7, dtype=torch.float64)])  # "w" is sliced over servers
    for r in range(1, rounds + 1):
        outs = [torch.empty(3000), torch.empty(7, dtype=torch.float64)]
        kv.pushpull(["w", 1], [torch.ones(3000) * (kv.rank + 1), torch.ones(7, dtype=torch.float64) * (kv.rank + 1)], outs)
        for o in outs:
            assert torch.all(o == total), (kind, r, o[:4])
    kv.barrier()
    print(f"OK {kind} rank {kv.rank} of {W}", flush=True)
    kv.close()


def async_killed() -> None:
    kv = kvstore.create("dist_async", timeout_s=20)
    kv.init("acc", torch.ones(50))
    pushes = 3 if kv.rank == 2 else 20
    for _ in range(pushes):
        kv.push("acc", torch.ones(50) * (kv.rank + 1))
        kv.pull("acc", torch.empty(50))
        time.sleep(0.01)
    if kv.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    expected = 1 + 20 * 1 + 20 * 2 + 3 * 3
    out = torch.empty(50)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        kv.pull("acc", out)
        if torch.all(out == expected):
            print(f"OK async survivor {kv.rank} sees {expected}", flush=True)
            return
        time.sleep(0.05)
    raise SystemExit(f"rank {kv.rank}: value {out[0].item()} never reached {expected}")


def sync_killed() -> None:
    kv = kvstore.create("dist_sync", timeout_s=3.0)
    kv.init("w", torch.zeros(10))
    for r in range(1, 4):
        if kv.rank == 2 and r == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            kv.pushpull("w", torch.ones(10), torch.empty(10))
        except PeerError as e:
            assert r == 3 and e.peer == 2, (r, e)
            print(f"OK rank {kv.rank} round {r}: PeerError peer={e.peer} after {time.monotonic() - t0:.1f}s: {e}",
                  flush=True)
            return
    raise SystemExit("round 3 completed without rank 2")


def elastic(kill_round: int, kill_after_push: bool, rejoin: bool) -> None:
    """Elastic dist_sync, 3 workers; each pushes (rank+1)*r in round r, so a round's value (the default
    rule keeps its sum) is r times the sum of rank+1 over the workers that pushed it. Rank 2 SIGKILLs
    itself at ``kill_round`` (before its push, or after the server acknowledged it); started again with
    ``rejoin`` it joins, prints the current value, and takes part from the next round. Everyone stops
    4 rounds after the first round the rejoined worker pushed. Prints one line per round for the test."""
    kv = kvstore.create("dist_sync", elastic=True, timeout_s=60.0, retry_s=0.3)
    rank = kv.rank
    kv.init("w", torch.zeros(4))
    first, stop = 1, None
    if rejoin:
        out = torch.empty(4)
        kv.pull("w", out)
        version = kv.pushes["w"]
        print(f"JOINED version {version} value {out[0].item():g}", flush=True)
        first = version + 1
        stop = first + 4
    r = first
    while stop is None or r <= stop:
        if rank == 2 and not rejoin and r == kill_round:
            if kill_after_push:
                kv.push("w", torch.full((4,), float((rank + 1) * r)))
            print(f"KILL round {r} {'after' if kill_after_push else 'before'} push at {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        out = torch.empty(4)
        kv.pushpull("w", torch.full((4,), float((rank + 1) * r)), out)
        assert torch.all(out == out[0]), out
        print(f"ROUND {r} VALUE {out[0].item():g} AT {time.time():.6f}", flush=True)
        if stop is None and r > kill_round and out[0].item() == 6 * r:  # the rejoined worker pushed this round
            stop = r + 4
        if r > 100_000:
            raise SystemExit("no rejoin seen")
        r += 1
        time.sleep(0.02)
    print(f"OK elastic rank {rank} stopped after round {stop}", flush=True)
    kv.close()


def restart(rounds: int) -> None:
    kv = kvstore.create("dist_sync", timeout_s=60.0, retry_s=0.3)
    W = kv.num_workers
    kv.init("w", torch.zeros(20000))
    kv.set_optimizer("sgd", lr=1.0)
    for r in range(1, rounds + 1):
        out = torch.empty(20000)
        kv.pushpull("w", torch.ones(20000) * (kv.rank + 1), out)
        expected = -r * W * (W + 1) / 2
        assert torch.all(out == expected), (r, out[:3], expected)
        time.sleep(0.05)
    print(f"OK rank {kv.rank} finished {rounds} rounds across the restart", flush=True)


def intruder() -> None:
    """Under `gradsync launch` with no secret set by the user: a local process that did not get the job's
    secret (raw frames, no tag, or a wrong one) cannot stop, change or read the server; the job goes on."""
    import zmq

    from gradsync.ps.wire import Flag, Op, decode, encode, seal

    kv = kvstore.create("dist_sync", timeout_s=20)
    kv.init("w", torch.zeros(4))
    out = torch.empty(4)
    kv.pushpull("w", torch.ones(4), out)
    assert torch.equal(out, torch.ones(4)), out
    secret, job = os.environ.get("GRADSYNC_PS_SECRET", ""), os.environ.get("GRADSYNC_PS_JOB", "")
    assert len(secret) == 64 and len(job) == 16, (len(secret), job)  # made by launch, per job
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(os.environ["GRADSYNC_PS_SERVERS"].split(",")[0])
    attempts = [
        encode(Op.SHUTDOWN, session=7),
        encode(Op.PUSH, key="w", tensor=torch.full((4,), 100.0), version=2, session=7),
        encode(Op.INIT, key="evil", tensor=torch.ones(2), count=1, flags=Flag.SYNC, session=7),
        encode(Op.STATUS, session=7),
        seal(encode(Op.SHUTDOWN, session=7), seq=1, secret=b"guessed"),
    ]
    for frames in attempts:
        sock.send_multipart([bytes(f) for f in frames])
        assert sock.poll(5000), "no reply"
        reply = decode(sock.recv_multipart())
        assert reply.op == Op.ERROR and "rejected" in reply.text(), (reply.op, reply.text())
    sock.close()
    kv.pushpull("w", torch.ones(4), out)  # the server is still up, and "w" only saw the job's own round
    assert torch.equal(out, torch.ones(4)), out
    print(f"OK intruder refused {len(attempts)} times; the job's server still serves", flush=True)
    kv.close()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def algorithms(steps: int = 30, batch: int = 64, lr: float = 0.2) -> None:
    """Every algorithm on one set of servers (keys prefixed per algorithm). Synchronous ones must match
    single-process SGD on the union batch; asynchronous and elastic ones must learn (accuracy > 0.75)."""
    import torch.nn.functional as F

    from gradsync.models.data import load_digits, shard
    from gradsync.train.ps_trainer import ALGORITHMS, PSTrainer

    data = load_digits(size=8)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, data.x_train.shape[0], (batch,), generator=gen) for _ in range(steps)]
    reference = _mlp()
    for idx in batches:  # single-process SGD on the union batch
        reference.zero_grad()
        F.cross_entropy(reference(data.x_train[idx]), data.y_train[idx]).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(p.grad, alpha=-lr)
    for name in ALGORITHMS.names():
        spec = ALGORITHMS.get(name)
        clients = 2 if spec.kind.startswith("hybrid") else 0
        model = _mlp()
        trainer = PSTrainer(name, model.named_parameters(), lr=lr, interval=3, alpha=0.5, prefix=f"{name}/",
                            clients=clients, timeout_s=60)
        for i, idx in enumerate(batches * (1 if spec.pattern == "gradients" or spec.pattern == "allreduce" else 4)):
            x, y = shard(data.x_train[idx], data.y_train[idx], rank, world)
            trainer.zero_grad()
            # each rank's loss is its share of the union batch's mean loss, so gradients add up exactly
            (F.cross_entropy(model(x), y, reduction="sum") * world / batch).backward()
            trainer.step()
            del i
        acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        if spec.pattern in ("gradients", "allreduce"):
            diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
            assert diff < 1e-5, (name, diff)
            detail = f"max |w - w_ref| = {diff:.2e}"
        else:
            assert acc > 0.75, (name, acc)
            detail = f"accuracy {acc:.3f}"
        trainer.kv.barrier() if spec.kind != "collective" else None
        trainer.close()
        print(f"OK {name} rank {rank}: {detail} after {trainer.iteration} steps, {trainer.exchanges} exchanges",
              flush=True)


def compress_ps() -> None:
    """MergeComp's step through the PS equals the same step through allreduce (2 workers: sums are exact)."""
    import gradsync
    from gradsync.compress import TensorInfo
    from gradsync.train import CompressionStep

    rt = gradsync.init(timeout_s=60)
    torch.manual_seed(10 + rt.rank)
    infos = [TensorInfo("a", (64, 32), torch.float32, 0), TensorInfo("b", (100,), torch.float32, 1)]
    for name in ("none", "fp16", "powersgd"):
        via_ps, via_ar = CompressionStep(name, communicator="ps"), CompressionStep(name, communicator="allreduce")
        for step in range(3):
            grads = [torch.randn(i.shape) for i in infos]
            got = via_ps.step_async([g.clone() for g in grads], infos).wait()
            want = via_ar.step_async([g.clone() for g in grads], infos).wait()
            for g, w in zip(got, want):
                assert torch.equal(g, w), (name, step, (g - w).abs().max())
            if name == "none":  # and the plain mean of both ranks' gradients, computed independently
                both = [torch.empty_like(g) for g in grads]
                for g, b in zip(grads, both):
                    b.copy_(g)
                    torch.distributed.all_reduce(b)
                assert all(torch.allclose(g, b / 2) for g, b in zip(got, both))
    try:
        CompressionStep("topk", communicator="ps")
        raise SystemExit("topk through the PS should be refused")
    except gradsync.GradsyncError as e:
        assert "cannot add" in str(e), e
    print(f"OK compress through the PS on rank {rt.rank}", flush=True)
    gradsync.shutdown()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "oracle":
        oracle(sys.argv[2])
    elif what == "async_killed":
        async_killed()
    elif what == "sync_killed":
        sync_killed()
    elif what == "elastic":
        elastic(int(sys.argv[2]), sys.argv[3] == "after", sys.argv[4] == "rejoin")
    elif what == "restart":
        restart(int(sys.argv[2]))
    elif what == "algorithms":
        algorithms()
    elif what == "intruder":
        intruder()
    elif what == "compress_ps":
        compress_ps()
    else:
        raise SystemExit(f"unknown scenario {what!r}")

