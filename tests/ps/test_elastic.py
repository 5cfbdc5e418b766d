"""Elastic membership (issue 15, part 4): a sync job goes on without a worker that stops answering, and
the worker rejoins. Real processes for the SIGKILL; servers on threads for the protocol cases.

The reference is kept here: worker i pushes (i+1)*r in round r and the servers keep a round's sum, so
round r's value is r times the sum of i+1 over the workers whose push the round got.
"""

from __future__ import annotations

import io
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gradsync.errors import GradsyncError, PeerError
from gradsync.launch import free_port, kill_group, torchrun_env
from gradsync.ps.env import CLIENTS_ENV, ELASTIC_TIMEOUT_ENV, SERVERS_ENV
from gradsync.ps.kvstore import KVStoreConfig, PSKVStore, create
from gradsync.ps.launch import job_env, start_server
from gradsync.ps.wire import Flag, Op, encode
from tests.ps.cluster import Cluster, run_workers
from tests.test_faults import _Served

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, str(ROOT / "tests" / "workers" / "ps_worker.py"), "elastic"]
DROP_S = 2.0


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _rounds(path: Path) -> dict[int, tuple[float, float]]:
    """round -> (value, wall time it completed) from a worker's output."""
    out = {}
    for line in _lines(path):
        m = re.fullmatch(r"ROUND (\d+) VALUE (\S+) AT (\S+)", line)
        if m:
            out[int(m[1])] = (float(m[2]), float(m[3]))
    return out


@pytest.mark.parametrize("seed, when", [(1, "before"), (2, "after")])
def test_sigkilled_worker_is_dropped_survivors_go_on_and_it_rejoins(tmp_path: Path, seed: int, when: str) -> None:
    """3 workers, one server, elastic dist_sync. Rank 2 is SIGKILLed at a random round (before its push,
    or after the server acknowledged it). Ranks 0 and 1 complete every round; each round's value is the
    sum over the workers that pushed it (an acknowledged push is never lost); a restarted rank 2 joins,
    sees the current value, and the rounds after it include it again."""
    kill_round = random.Random(seed).randint(2, 6)
    out = io.StringIO()
    env = job_env({**os.environ, "PYTHONPATH": str(ROOT), ELASTIC_TIMEOUT_ENV: str(DROP_S)})
    server = start_server(0, f"tcp://127.0.0.1:{free_port()}", env=env, stream=out, lock=threading.Lock())
    base = {**env, SERVERS_ENV: server.endpoint, CLIENTS_ENV: "3"}
    port = free_port()
    logs = [tmp_path / f"rank{r}.txt" for r in range(3)] + [tmp_path / "rank2-rejoined.txt"]
    procs: list[subprocess.Popen[str]] = []

    def start(rank: int, log: Path, rejoin: bool) -> subprocess.Popen[str]:
        with open(log, "w") as f:
            p = subprocess.Popen([*WORKER, str(kill_round), when, "rejoin" if rejoin else "first"],
                                 env=torchrun_env(rank, 3, "127.0.0.1", port, base), stdout=f,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT)
        procs.append(p)
        return p

    try:
        for r in range(3):
            start(r, logs[r], False)
        deadline = time.monotonic() + 120
        # the survivors must get past the drop before the worker comes back
        while max(_rounds(logs[0]), default=0) < kill_round + 2:
            assert time.monotonic() < deadline and procs[0].poll() is None, _lines(logs[0])[-20:] + [out.getvalue()]
            time.sleep(0.1)
        assert procs[2].wait(timeout=10) == -9, _lines(logs[2])
        start(2, logs[3], True)
        for p in procs[:2] + procs[3:]:
            assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, [_lines(f)[-20:] for f in logs]
    finally:
        for p in procs:
            kill_group(p)
        server.stop()
    joined = next(line for line in _lines(logs[3]) if line.startswith("JOINED"))
    version, seen = int(joined.split()[2]), float(joined.split()[4])
    killed_at = float(next(line for line in _lines(logs[2]) if line.startswith("KILL")).split()[-1])

    def expected(r: int) -> float:
        """The reference: which workers pushed round r."""
        if r < kill_round or (r == kill_round and when == "after") or r > version:
            return 6.0 * r
        return 3.0 * r

    stop = version + 5
    for rank in (0, 1):
        got = _rounds(logs[rank])
        assert sorted(got) == list(range(1, stop + 1)), (rank, sorted(got)[-5:], stop)  # every round completed
        assert {r: v for r, (v, _) in got.items()} == {r: expected(r) for r in got}, (rank, kill_round, version)
    assert seen == expected(version) == 3.0 * version  # the rejoined worker saw the current value
    assert {r: v for r, (v, _) in _rounds(logs[3]).items()} == {r: 6.0 * r for r in range(version + 1, stop + 1)}
    first_without = kill_round + (1 if when == "after" else 0)  # the first round that had to drop rank 2
    recovery = _rounds(logs[0])[first_without][1] - killed_at
    print(f"elastic: rank 2 killed at round {kill_round} ({when} its push); survivors' next round completed "
          f"{recovery:.2f} s after its death (drop timeout {DROP_S:g} s); rejoined at version {version}")
    assert DROP_S - 0.5 < recovery < DROP_S + 5.0, recovery
    assert "dropped client(s) [2]" in out.getvalue() and "client 2 rejoined" in out.getvalue(), out.getvalue()[-3000:]


def _elastic_store(cluster: Cluster, rank: int, **cfg: object) -> PSKVStore:
    config = KVStoreConfig(rank=rank, num_workers=3, servers=cluster.endpoints, timeout_s=20, retry_s=0.2,
                           elastic=True, elastic_timeout_s=1.0, **cfg)  # type: ignore[arg-type]
    return PSKVStore(config, sync=True, hybrid=False)


def test_a_silent_member_is_dropped_and_its_later_push_is_refused_by_name() -> None:
    """Servers on threads: rank 2 inits and then says nothing (its heartbeat stopped, as a hung process's
    would): the others' round completes with their two pushes (sum 3) about a second later; a push from
    rank 2 afterwards gets an error naming it as dropped; its INIT makes it a member again."""
    cluster = Cluster(1, elastic_timeout_s=1.0)
    try:
        stores = {}

        def worker(rank: int) -> float:
            kv = stores[rank] = _elastic_store(cluster, rank)
            kv.init("w", torch.zeros(2))
            if rank == 2:
                assert kv.heartbeat is not None
                kv.heartbeat.close()
                return 0.0
            out = torch.empty(2)
            t0 = time.monotonic()
            kv.pushpull("w", torch.full((2,), rank + 1.0), out)
            assert torch.equal(out, torch.full((2,), 3.0)), out
            assert kv.round_pushers("w") == 2  # the mean of this round is over 2 workers, not 3
            return time.monotonic() - t0

        waited = run_workers(3, worker)
        assert 0.9 < max(waited[0], waited[1]) < 5.0, waited  # type: ignore[operator]
        zombie = stores[2]
        with pytest.raises(GradsyncError, match=r"client 2, which server 0 dropped .* Rejoin"):
            zombie.push("w", torch.full((2,), 3.0))
        slot = cluster.servers[0].slots[("w", 0)]
        assert slot.members == {0, 1} and slot.version == 1
        zombie.pushes["w"] = 0
        zombie._send_init(["w"], [torch.zeros(2)], join=True)  # what a restarted worker's init sends
        assert slot.members == {0, 1, 2} and zombie.pushes["w"] == 1
        for kv in stores.values():
            kv.close()
    finally:
        cluster.stop()


def test_elastic_barrier_goes_on_without_a_silent_worker_and_meets_it_again_after_it_rejoins() -> None:
    """Servers on threads, elastic_timeout 1 s. Rank 2 inits and goes silent (heartbeat stopped): ranks 0 and
    1's barrier is released about a second later without it. Rank 2 then comes back as a restarted worker
    does (a new store joining the key, its own barrier count at 1): the next barrier of 0 and 1 waits for
    it, and all three leave it together, after rank 2 arrived."""
    cluster = Cluster(1, elastic_timeout_s=1.0)
    passed, rejoined = threading.Event(), threading.Event()
    arrived: dict[int, float] = {}
    left: dict[int, float] = {}
    try:
        def worker(rank: int) -> float:
            kv = _elastic_store(cluster, rank)
            kv.init("w", torch.zeros(2))
            if rank == 2:
                assert kv.heartbeat is not None
                kv.heartbeat.close()
                assert passed.wait(20)
                kv.close()
                kv = _elastic_store(cluster, 2)  # restarted: joins the key, counts its barriers from 1 again
                kv.init("w", torch.zeros(2))
                rejoined.set()
                time.sleep(0.5)
                arrived[rank] = time.monotonic()
                kv.barrier()
                left[rank] = time.monotonic()
                kv.close()
                return 0.0
            t0 = time.monotonic()
            kv.barrier()
            waited = time.monotonic() - t0
            passed.set()
            assert rejoined.wait(20)
            kv.barrier()
            left[rank] = time.monotonic()
            kv.close()
            return waited

        waited = run_workers(3, worker)
        assert 0.8 < max(waited[0], waited[1]) < 5.0, waited  # type: ignore[operator]
        assert min(left.values()) >= arrived[2], (left, arrived)  # the second barrier waited for rank 2
        assert cluster.servers[0].elastic_barriers == 2 and cluster.servers[0].elastic_barrier is None
        assert not cluster.servers[0].parked
    finally:
        cluster.stop()


def test_join_waits_for_the_key_and_bad_elastic_use_is_named() -> None:
    s = _Served()
    try:
        s.send(encode(Op.INIT, key="w", tensor=torch.zeros(2), count=2, sender=1, flags=Flag.SYNC | Flag.JOIN, req_id=7))
        assert s.replies(first_ms=300) == []  # parked: the key does not exist yet
        s.send(encode(Op.INIT, key="w", tensor=torch.ones(2), count=2, flags=Flag.SYNC | Flag.ELASTIC, req_id=8))
        assert sorted((x.op, x.req_id, x.version) for x in s.replies()) == [(Op.ACK, 7, 0), (Op.ACK, 8, 0)]
        assert s.server.slots[("w", 0)].elastic and not s.server.parked
        for i in range(200):  # liveness is kept for clients a key counts (2 here), not for any sender id sent
            s.send(encode(Op.PING, sender=1000 + i))
        assert len(s.replies()) == 200 and set(s.server.seen) <= {0, 1}
    finally:
        s.close()
    with pytest.raises(GradsyncError, match="elastic=True is for dist_sync and dist_async, not 'hybrid_sync'"):
        create("hybrid_sync", elastic=True)
    with pytest.raises(GradsyncError, match="below timeout_s=5"):
        KVStoreConfig(elastic=True, elastic_timeout_s=10, timeout_s=5)


def test_without_elastic_a_silent_client_is_never_dropped() -> None:
    """The default stays as it was: the round waits, and the survivors get a PeerError naming the client."""
    cluster = Cluster(1, elastic_timeout_s=0.5)
    try:
        def worker(rank: int) -> str:
            config = KVStoreConfig(rank=rank, num_workers=3, servers=cluster.endpoints, timeout_s=2.0, retry_s=0.5)
            kv = PSKVStore(config, sync=True, hybrid=False)
            kv.init("w", torch.zeros(2))
            if rank == 2:
                return "silent"
            with pytest.raises(PeerError, match=r"waits for pushes from client\(s\) \[2\]") as e:
                kv.pushpull("w", torch.ones(2), torch.empty(2))
            assert e.value.peer == 2
            return "named"

        assert run_workers(3, worker) == {0: "named", 1: "named", 2: "silent"}
        assert cluster.servers[0].slots[("w", 0)].members == {0, 1, 2}
    finally:
        cluster.stop()
