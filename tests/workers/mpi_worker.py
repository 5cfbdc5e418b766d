"""Worker program for test_mpi.py, started on every rank by the MPI launcher.

``mpirun -n N python tests/workers/mpi_worker.py CASE[,CASE...] N``: runs the cases in order on this rank (one launch
serves several tests: starting Python and torch dominates the cost) and prints ``OK CASE rank R`` after each
case whose checks all passed. On any failure it prints the traceback to stderr and aborts the whole MPI job
(``MPI_Abort``), so the launcher exits non-zero at once instead of leaving peers waiting. Each check compares
with values every rank computes on its own (closed-form patterns and sums), never with a received value.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

from gradsync.comm.mpi import MPITransport
from gradsync.comm.transport import create_transport
from gradsync.errors import GradsyncError, PeerError

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.float16, torch.int32, torch.uint8, torch.bool)
SIZES = (0, 1, 7, 100_003)


def pattern(src: int, dst: int, tag: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The message ``src`` sends ``dst`` under ``tag``: distinct per pair, tag and position, exact in ``dtype``."""
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        return (i + src + 2 * dst + tag) % 3 == 0
    if dtype == torch.uint8:
        return ((i * 7 + src * 31 + dst * 17 + tag) % 256).to(torch.uint8)
    if dtype == torch.int64:
        return i * 1_000_003 + (src << 40) + (dst << 20) + tag  # high bits set: a 32-bit path would lose them
    if dtype == torch.int32:
        return (i * 101 + src * 1_000_000 + dst * 10_000 + tag).to(torch.int32)
    # floats: the cast rounds the same way on every rank, so bfloat16/float16 compare bit for bit too
    return ((i % 1013).to(torch.float64) * 0.25 - (i // 1013) + src * 100 + dst * 10 + tag / 8).to(dtype)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def expect_error(kind: type[BaseException], fn, *needles: str) -> BaseException:
    try:
        fn()
    except kind as exc:
        for needle in needles:
            check(needle in str(exc), f"{kind.__name__} message {str(exc)!r} lacks {needle!r}")
        return exc
    raise AssertionError(f"expected {kind.__name__} from {fn}")


# ---- cases ---------------------------------------------------------------------------------------------------
def case_p2p(t: MPITransport) -> None:
    """Every pair exchanges every dtype and size; receives are posted in reverse tag order."""
    me, n = t.rank, t.world_size
    combos = [(d, s) for d in DTYPES for s in SIZES]
    tag_of = {c: 1 + k for k, c in enumerate(combos)}
    recvs, sends = [], []
    for peer in range(n):
        if peer == me:
            continue
        for d, s in reversed(combos):  # receiver posts the highest tag first
            buf = torch.zeros(s, dtype=d)
            recvs.append((peer, d, s, buf, t.irecv(buf, peer, tag_of[(d, s)])))
    for peer in range(n):
        if peer == me:
            continue
        for d, s in combos:
            msg = pattern(me, peer, tag_of[(d, s)], s, d)
            sends.append(t.isend(msg, peer, tag_of[(d, s)]))
    for peer, d, s, buf, h in recvs:  # and waits in that order too
        h.wait(30)
        check(torch.equal(buf, pattern(peer, me, tag_of[(d, s)], s, d)), f"{d} x {s} from rank {peer} differs")
    for h in sends:
        h.wait(30)

    # a 0-dim tensor and a multi-dimensional one travel as they are
    right, left = (me + 1) % n, (me - 1) % n
    scalar, grid = torch.zeros(()), torch.zeros(3, 4, 5, dtype=torch.float64)
    hs = [t.irecv(scalar, left, 900), t.irecv(grid, left, 901)]
    hs += [t.isend(torch.tensor(me + 0.5), right, 900), t.isend(pattern(me, right, 901, 60, torch.float64).view(3, 4, 5), right, 901)]
    for h in hs:
        h.wait(30)
    check(float(scalar) == left + 0.5, f"scalar from rank {left}: {float(scalar)}")
    check(torch.equal(grid.view(-1), pattern(left, me, 901, 60, torch.float64)), "3x4x5 tensor differs")

    # rendezvous-sized messages: rank 1 completes tag 2 before it even posts tag 1
    big = 100_003
    if me == 0:
        a, b = pattern(0, 1, 1001, big, torch.float64), pattern(0, 1, 1002, big, torch.float64)
        h1, h2 = t.isend(a, 1, 1001), t.isend(b, 1, 1002)
        h1.wait(30)
        h2.wait(30)
    elif me == 1:
        second = torch.zeros(big, dtype=torch.float64)
        t.irecv(second, 0, 1002).wait(30)
        first = torch.zeros(big, dtype=torch.float64)
        t.irecv(first, 0, 1001).wait(30)
        check(torch.equal(first, pattern(0, 1, 1001, big, torch.float64)), "tag 1001 differs")
        check(torch.equal(second, pattern(0, 1, 1002, big, torch.float64)), "tag 1002 differs")

    # same (peer, tag) twice: MPI's non-overtaking rule keeps them in order (the executor reuses tags per run)
    if me == 0:
        for k in range(3):
            t.isend(torch.full((5,), float(k)), 1, 1100).wait(30)
    elif me == 1:
        outs = [torch.zeros(5) for _ in range(3)]
        hs = [t.irecv(o, 0, 1100) for o in outs]
        for h in reversed(hs):
            h.wait(30)
        check([float(o[0]) for o in outs] == [0.0, 1.0, 2.0], f"same-tag messages overtook: {outs}")

    # size mismatches name the peer: a short message, then a too-long one (MPI_ERR_TRUNCATE)
    if me == 0:
        t.isend(torch.ones(3), 1, 1200).wait(30)
        t.isend(torch.ones(7), 1, 1201).wait(30)
    elif me == 1:
        e = expect_error(PeerError, lambda: t.irecv(torch.zeros(5), 0, 1200).wait(30), "rank 0", "3 elements", "5 were")
        check(e.peer == 0, f"peer {e.peer}")
        e = expect_error(PeerError, lambda: t.irecv(torch.zeros(5), 0, 1201).wait(30), "rank 0", "larger message")
        check(e.peer == 0, f"peer {e.peer}")

    # bad input fails before anything is posted, with a hint how to fix it
    other = (me + 1) % n
    expect_error(TypeError, lambda: t.isend(torch.zeros(4, 4).t(), other, 1), "not contiguous", "contiguous()")
    expect_error(TypeError, lambda: t.irecv(torch.zeros(4, device="meta"), other, 1), "CPU", "cpu()")
    expect_error(TypeError, lambda: t.isend(torch.zeros(4, dtype=torch.uint16), other, 1), "not supported")
    expect_error(TypeError, lambda: t.isend([1.0, 2.0], other, 1), "torch.Tensor")
    expect_error(GradsyncError, lambda: t.isend(torch.zeros(1), other, t.tag_ub + 1), "MPI_TAG_UB", str(t.tag_ub))
    expect_error(GradsyncError, lambda: t.irecv(torch.zeros(1), other, -1), "outside")
    expect_error(GradsyncError, lambda: t.isend(torch.zeros(1), n, 1), "not a rank")
    t.barrier()


def case_timeout(t: MPITransport) -> None:
    """A receive from a silent peer, and a large send nobody takes, raise PeerError naming it after ~1 s."""
    me = t.rank
    if me == 1:
        h = t.irecv(torch.zeros(10), 0, 7)
        t0 = time.monotonic()
        e = expect_error(PeerError, lambda: h.wait(1.0), "rank 0", "sent nothing for 1 s")
        dt = time.monotonic() - t0
        check(e.peer == 0 and 1.0 <= dt < 3.0, f"peer {e.peer}, raised after {dt:.2f} s")
        expect_error(PeerError, lambda: h.wait(1.0), "rank 0")  # the cancelled receive stays failed
    if me == 0:
        big = pattern(0, 1, 8, 1 << 18, torch.float64)  # 2 MiB: above every eager limit, so it needs the receiver
        h = t.isend(big, 1, 8)
        t0 = time.monotonic()
        e = expect_error(PeerError, lambda: h.wait(1.0), "rank 1", "did not receive")
        dt = time.monotonic() - t0
        check(e.peer == 1 and 1.0 <= dt < 3.0, f"peer {e.peer}, raised after {dt:.2f} s")
    t.barrier()
    # the timed-out send is still alive: once the peer receives, it completes and the data is intact
    if me == 1:
        got = torch.zeros(1 << 18, dtype=torch.float64)
        t.irecv(got, 0, 8).wait(30)
        check(torch.equal(got, pattern(0, 1, 8, 1 << 18, torch.float64)), "late-received message differs")
    if me == 0:
        h.wait(30)
    t.barrier()


def case_executor(t: MPITransport) -> None:
    """ring, ps and tree schedules for switch:N run on MPI and give the exact allreduce sum on every rank."""
    from gradsync.comm.executor import Executor
    from gradsync.plan import synthesize
    from gradsync.topology import get_topology

    me, n = t.rank, t.world_size

    def inputs(rank: int, numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        return [((torch.arange(k, dtype=torch.float64) % 89) * (rank + 1) - 7 * j).to(dtype) for j, k in enumerate(numels)]

    topo = get_topology(f"switch:{n}")
    for alg in ("ring", "ps", "tree"):
        ex = Executor(synthesize(alg, topo), t, timeout_s=30)
        for dtype in (torch.float32, torch.float64, torch.int64):
            for numels in ([0], [1], [7], [100_003], [5, 0, 11, 2]):
                xs = inputs(me, numels, dtype)
                ex.run(xs if len(xs) > 1 else xs[0])
                for j, x in enumerate(xs):
                    want = sum(inputs(r, numels, torch.float64)[j] for r in range(n))
                    check(torch.equal(x.to(torch.float64), want), f"{alg} {dtype} {numels}: tensor {j} is not the sum")
        x = torch.full((10,), float(me + 1), dtype=torch.float64)
        ex.run(x, op="avg")
        check(torch.allclose(x, torch.full((10,), (n + 1) / 2, dtype=torch.float64)), f"{alg} avg: {x}")
    t.barrier()


def case_dead(t: MPITransport) -> None:
    """The last rank dies; the survivors must not hang (PeerError after the timeout, or the launcher aborts)."""
    victim = t.world_size - 1
    t.barrier()
    if t.rank == victim:
        time.sleep(0.3)
        os._exit(3)
    try:
        t.irecv(torch.zeros(10), victim, 1).wait(5.0)
    except PeerError as exc:
        print(f"rank {t.rank} PeerError peer={exc.peer}: {exc}", flush=True)
        os._exit(0)  # MPI_Finalize would wait for the dead rank
    raise AssertionError("a receive from a dead rank completed")


CASES = {"p2p": case_p2p, "timeout": case_timeout, "executor": case_executor, "dead": case_dead}


def main() -> None:
    torch.set_num_threads(1)
    case, expected = sys.argv[1], int(sys.argv[2])
    try:
        t = create_transport("mpi", timeout_s=30)  # through the registry, as the runtime does
        check(isinstance(t, MPITransport), f"registry built {type(t).__name__}")
        check(
            t.world_size == expected,
            f"world_size {t.world_size} != {expected}: the launcher and mpi4py's MPI library do not match",
        )
        check(t.name == "mpi" and t.ordered is False, "transport attributes")
        for name in case.split(","):
            CASES[name](t)
            print(f"OK {name} rank {t.rank}", flush=True)
        t.close()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    main()
