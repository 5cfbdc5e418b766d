"""Worker program for test_comm_dist.py, launched once per rank with torchrun's environment.

``python tests/workers/comm_worker.py SCENARIO OUT_DIR``: runs the scenario, writes ``OUT_DIR/rank{R}.json`` with
what it observed (the test process asserts on it), exits 0. Each scenario computes its expectation
independently of the executor: closed-form sums of known inputs, or a single-process reference.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

import gradsync
from gradsync.sim.choose import algorithms_for
from tests.dist_launch import counting_native, run_scenario

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def _inputs(rank: int, numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    return [((torch.arange(n, dtype=torch.float64) % 89) * (rank + 1) - 7 * i).to(dtype) for i, n in enumerate(numels)]


def scenario_sums(topology: str, only: str = "") -> dict:
    """Every applicable synthesizer (or those in ``only``): the result equals the exact sum on every rank."""
    rt = gradsync.init(topology=topology, algorithm="ring", timeout_s=60)
    checked, failures = [], []
    names = [*algorithms_for(rt.topology), "native"]  # native: the backend's all_reduce, which auto may choose
    for alg in names:
        if only and alg not in only.split(","):
            continue
        dtypes = (torch.float32, torch.float64, torch.int64) if alg in ("auto", "native") else (torch.float32, torch.float64)
        for dtype in dtypes:
            for numels in ([0], [1], [2], [13], [1009], [65537], [7, 0, 31, 2]):
                xs = _inputs(RANK, numels, dtype)
                rt.allreduce(xs if len(xs) > 1 else xs[0], algorithm=alg)
                exp = [sum(_inputs(r, numels, torch.float64)[i] for r in range(WORLD)) for i in range(len(numels))]
                if not all(torch.equal(x.to(torch.float64), e) for x, e in zip(xs, exp)):
                    failures.append(f"{alg} {dtype} {numels}")
        checked.append(alg)
    for alg in () if only else ("auto", "native"):
        x = torch.ones(10, dtype=torch.float64) * (RANK + 1)
        gradsync.allreduce(x, op="avg", algorithm=alg)
        if not torch.allclose(x, torch.full((10,), (WORLD + 1) / 2, dtype=torch.float64)):
            failures.append(f"avg {alg}")
    sizes = () if only else (4096, 1 << 20, 1 << 26)
    chosen = {str(n): [rt.chooser.choose(n).algorithm, rt.chooser.choose(n).pipeline] for n in sizes}
    gradsync.shutdown()
    return {"checked": checked, "failures": failures, "auto": chosen}


def scenario_sharded(topology: str) -> dict:
    """Every synthesizer that plans reduce-scatter and allgather: torch's reduce_scatter_tensor and
    all_gather_into_tensor results exactly (expected from the known inputs, and from gloo's own all_gather)."""
    rt = gradsync.init(topology=topology, algorithm="ring", timeout_s=60)
    checked, failures = [], []
    for alg in algorithms_for(rt.topology, "allgather"):
        for dtype in (torch.float32, torch.float64, torch.int64):
            for k in (0, 1, 13, 1009):
                x = ((torch.arange(WORLD * k, dtype=torch.float64) % 89) * (RANK + 1) - 7).to(dtype)
                out = torch.empty(k, dtype=dtype)
                gradsync.reduce_scatter_tensor(out, x, algorithm=alg)
                full = sum(((torch.arange(WORLD * k, dtype=torch.float64) % 89) * (r + 1) - 7) for r in range(WORLD))
                if not torch.equal(out.to(torch.float64), full[RANK * k:(RANK + 1) * k]):
                    failures.append(f"reduce_scatter {alg} {dtype} {k}")
                mine = (torch.arange(k, dtype=torch.float64) * (RANK + 2)).to(dtype)
                got = torch.empty(WORLD * k, dtype=dtype)
                gradsync.all_gather_into_tensor(got, mine, algorithm=alg)
                ref = [torch.empty(k, dtype=dtype) for _ in range(WORLD)]
                dist.all_gather(ref, mine)
                if not torch.equal(got, torch.cat(ref)):
                    failures.append(f"allgather {alg} {dtype} {k}")
        checked.append(alg)
    gradsync.shutdown()
    return {"checked": checked, "failures": failures}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 16),
        torch.nn.ReLU(), torch.nn.Linear(16, 3),
    )


def _batch(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _shard(x: torch.Tensor) -> torch.Tensor:
    per = x.shape[0] // WORLD
    return x[RANK * per : (RANK + 1) * per]


def scenario_ddp(topology: str) -> dict:
    """DDP with the gradsync hook gives the same gradients as DDP without it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rt = gradsync.init(topology=topology, algorithm="lp", timeout_s=60)
    x, y = _batch()
    grads = {}
    for use_hook in (False, True):
        for dtype in (torch.float32, torch.float64):
            model = DDP(_model().to(dtype), bucket_cap_mb=0.002)  # tiny buckets: several buckets per backward
            if use_hook:
                model.register_comm_hook(gradsync.GradsyncHookState(rt), gradsync.allreduce_hook)
            loss = torch.nn.functional.cross_entropy(model(_shard(x).to(dtype)), _shard(y))
            loss.backward()
            grads[(use_hook, str(dtype))] = [p.grad.clone() for p in model.parameters()]
    out = {}
    for dtype, tol in (("torch.float32", 1e-6), ("torch.float64", 1e-12)):
        a, b = grads[(False, dtype)], grads[(True, dtype)]
        out[dtype] = max(float((ga - gb).abs().max() / (ga.abs().max() + 1e-30)) for ga, gb in zip(a, b))
        out[dtype + "_ok"] = out[dtype] <= tol
    gradsync.shutdown()
    return out


def scenario_ddp_native(topology: str) -> dict:
    """Where the runtime sums natively, the hook issues the process group's allreduce itself (no hand-off to
    the communication thread): the bits of the queued path, DDP's gradients within rounding."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rt = gradsync.init(topology=topology, algorithm="native", timeout_s=60)
    x, y = _batch()
    native = rt.native_allreduce_async
    counting, taken = counting_native(rt)
    grads, buckets = {}, {}
    for how in ("ddp", "native", "queued"):
        rt.native_allreduce_async = counting if how == "native" else (lambda tensor, algorithm=None: None)  # type: ignore[method-assign]
        model = DDP(_model().double(), bucket_cap_mb=0.002)  # tiny buckets: several per backward
        state = gradsync.GradsyncHookState(rt)
        if how != "ddp":
            model.register_comm_hook(state, gradsync.allreduce_hook)
        for _ in range(2):  # DDP rebuilds its buckets after the first iteration
            if RANK == 0:  # one rank's queue busy (a local job) while its buckets come: the group must not depend on it
                rt.submit(lambda: time.sleep(0.3), "busy")
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(_shard(x).double()), _shard(y)).backward()
        grads[how] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        buckets[how] = state.buckets
    rt.native_allreduce_async = native  # type: ignore[method-assign]
    sync = _sync_native(rt)
    gradsync.shutdown()
    return {**sync, "native_calls": len(taken), "all_native": all(taken), "buckets": buckets["native"],
            "same_as_queued": bool(torch.equal(grads["native"], grads["queued"])),
            "vs_ddp": float((grads["native"] - grads["ddp"]).abs().max() / grads["ddp"].abs().max())}


def _sync_native(rt: gradsync.Runtime) -> dict:
    """``gradsync.allreduce`` of one tensor at a natively planned size goes to the user's group on the caller's
    thread, even while rank 0's queue is busy; a tensor list goes to gradsync's own group. Every sum exact."""
    real, groups = dist.all_reduce, []

    def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        groups.append("user" if group is rt.caps.user_group else "own" if group is rt.caps.group else repr(group))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = spy
    try:
        if RANK == 0:
            rt.submit(lambda: time.sleep(0.3), "busy")
        one = gradsync.allreduce(torch.full((1001,), float(RANK + 1)))
        avg = gradsync.allreduce(torch.full((7,), float(RANK + 1), dtype=torch.float64), op="avg")
        ints = gradsync.allreduce(torch.arange(5) * (RANK + 1))
        pair = gradsync.allreduce([torch.full((3,), float(RANK)), torch.full((4,), 1.0)])
        try:
            gradsync.allreduce(torch.arange(3), op="avg")
            int_avg = "ran"
        except TypeError as exc:
            int_avg = str(exc)
    finally:
        dist.all_reduce = real
    total = WORLD * (WORLD + 1) / 2
    return {"sync_groups": groups, "int_avg": int_avg,
            "sync_exact": bool(torch.all(one == total) and torch.all(avg == total / WORLD)
                               and torch.equal(ints, torch.arange(5) * int(total))
                               and torch.all(pair[0] == WORLD * (WORLD - 1) / 2) and torch.all(pair[1] == WORLD))}


def scenario_optimizer(topology: str) -> dict:
    """3 steps with DistributedOptimizer == single-process training on the union batch, on every rank."""
    rt = gradsync.init(topology=topology, algorithm="ring", timeout_s=60)
    x, y = _batch()
    result = {}
    for bucket_bytes in (0, 2000):
        model = _model().double()
        ref = _model().double()
        opt = gradsync.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(),
            runtime=rt, bucket_bytes=bucket_bytes,
        )
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            xs, ys = x + step, y
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(_shard(xs).double()), _shard(ys)).backward()
            opt.step()
            ref_opt.zero_grad()
            # the mean over shards of per-shard means is the union-batch mean (equal shards)
            torch.nn.functional.cross_entropy(ref(xs[: WORLD * (xs.shape[0] // WORLD)].double()), ys[: WORLD * (xs.shape[0] // WORLD)]).backward()
            ref_opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        everyone = [torch.zeros_like(flat) for _ in range(WORLD)]
        dist.all_gather(everyone, flat)
        result[str(bucket_bytes)] = {
            "vs_reference": float((flat - ref_flat).abs().max()),
            "across_ranks": float(max((e - flat).abs().max() for e in everyone)),
        }
        opt.remove_hooks()
    gradsync.shutdown()
    return result


def scenario_kill(topology: str) -> dict:
    """The last rank dies in the middle of an allreduce; survivors must raise PeerError naming it."""
    victim = WORLD - 1
    timeout_s = 10.0
    rt = gradsync.init(topology=topology, algorithm="ring", timeout_s=timeout_s)
    x = torch.ones(2_000_000)
    rt.allreduce(x)  # everyone is connected and warm
    dist.barrier()
    if RANK == victim:
        threading.Timer(0.3, lambda: os._exit(17)).start()
    t0 = time.monotonic()
    try:
        for _ in range(10_000):
            rt.allreduce(x)
    except gradsync.PeerError as exc:
        out = {"error": str(exc), "peer": exc.peer, "seconds": time.monotonic() - t0 - 0.3, "timeout_s": timeout_s}
        # Stay until every survivor has posted to the failure board (bounded): a survivor waiting on this rank
        # learns of the failure only by its own timeout, and rank 0 hosts the store that holds the board; leaving
        # after a fixed second let the other survivor see only "rank 0 closed its connection" (flaky in CI).
        board = rt.transport.failures
        deadline = time.monotonic() + timeout_s + 5.0
        while len(board.read()) < WORLD - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the last reader's read after its post
        return out
    return {"error": None}


def scenario_mismatch(topology: str, what: str, algorithm: str = "ring") -> dict:
    """Ranks whose collectives differ (issue 42): ``size`` (rank 1 sends half as many elements), ``dtype``
    (rank 1 sends float16) or ``count`` (rank 1 makes one allreduce fewer, then shuts down). A short timeout;
    every rank that fails reports the error, which must name the difference and the rank. (gloo aborts the rank
    that receives more bytes than it expects -- here rank 1 -- so rank 0, which hosts the store, survives.)"""
    timeout_s = 3.0
    rt = gradsync.init(topology=topology, algorithm=algorithm, timeout_s=timeout_s)
    for _ in range(4):
        rt.allreduce(torch.ones(1000))
    n = 500 if what == "size" and RANK == 1 else 1000
    dtype = torch.float16 if what == "dtype" and RANK == 1 else torch.float32
    t0 = time.monotonic()
    try:
        if not (what == "count" and RANK == 1):
            rt.allreduce(torch.ones(n, dtype=dtype))
    except gradsync.CommError as exc:
        out = {"error": str(exc), "seconds": time.monotonic() - t0, "timeout_s": timeout_s}
        # rank 0 hosts the store: stay until the peer had its chance to read (bounded)
        time.sleep(1.0 if RANK else timeout_s + 3.0)
        return out
    gradsync.shutdown()
    if RANK == 0:
        time.sleep(timeout_s + 3.0)
    return {"error": None}


def scenario_calibrate(topology: str, cache: str) -> dict:
    """init(calibrate=True) measures α on this wire once and caches it; a second init reads the cache."""
    os.environ["GRADSYNC_CACHE"] = cache
    rt = gradsync.init(topology=topology, calibrate=True, timeout_s=60)
    first = rt.cost_model.to_dict()
    tuned = {str(k): v["choice"] for k, v in rt.tuned.items()}
    kept = sorted(f"{a}/{p}" for a, p in rt.plans.built())  # what tuning left cached
    measured = {str(k): sorted(v["measured_s"]) for k, v in rt.tuned.items()}
    used = {str(k): list(rt.plans.choice(k)) for k in rt.tuned}  # what auto now runs per tuned class
    exact = True
    for n in (1, 1000, 1 << 15, 1 << 16):  # 4 B .. 256 KB: every tuned class's choice, and one above
        x = torch.full((n,), float(RANK + 1))
        gradsync.allreduce(x)
        exact &= bool(torch.all(x == WORLD * (WORLD + 1) / 2))
    gradsync.shutdown()
    t0 = time.perf_counter()
    rt = gradsync.init(topology=topology, calibrate=True, timeout_s=60)
    second = rt.cost_model.to_dict()
    tuned_again = {str(k): v["choice"] for k, v in rt.tuned.items() if v.get("cached")}
    again_s = time.perf_counter() - t0
    gradsync.shutdown()
    dist.barrier()  # rank 0 holds the store the others just read from: leave together
    return {"first": first, "second": second, "exact": exact, "again_s": again_s, "tuned": tuned, "measured": measured,
            "used": used, "tuned_again": tuned_again, "kept": kept,
            "files": sorted(os.listdir(cache)) if os.path.isdir(cache) else []}


def scenario_default_init(topology: str, cache: str) -> dict:
    """gradsync.init(topology) with nothing else: on racks the quick calibration runs once and is cached (the
    second init reads it back), auto then explores; on a flat switch of as many ranks nothing is measured."""
    os.environ["GRADSYNC_CACHE"] = cache
    rt = gradsync.init(topology=topology, timeout_s=60)
    first, explore = rt.cost_model.to_dict(), rt.explore
    x = torch.full((100_001,), float(RANK + 1))
    gradsync.allreduce(x)
    exact = bool(torch.all(x == WORLD * (WORLD + 1) / 2))
    gradsync.shutdown()
    files = sorted(os.listdir(cache)) if os.path.isdir(cache) else []
    second = gradsync.init(topology=topology, timeout_s=60).cost_model.to_dict()
    gradsync.shutdown()
    flat = gradsync.init(topology=f"switch:{WORLD}", timeout_s=60)
    flat_model, flat_explore = flat.cost_model.to_dict(), flat.explore
    gradsync.shutdown()
    dist.barrier()  # rank 0 holds the store the others just read from: leave together
    return {"first": first, "second": second, "explore": explore, "exact": exact, "files": files,
            "flat": flat_model, "flat_explore": flat_explore,
            "files_after": sorted(os.listdir(cache)) if os.path.isdir(cache) else []}


def scenario_explore(topology: str) -> dict:
    """auto's first calls of a large class time the model's depth beside its half and double, then keep one:
    every call exact (queued or inline), the same decision on every rank, and later calls run it."""
    from gradsync.comm.tuning import EXPLORE_REPS

    rt = gradsync.init(topology=topology, mapping=list(range(WORLD)), timeout_s=60)  # a mapping: no native
    rt.explore = True
    n = 200_001  # 800 KB: the 1 MiB class, an odd size
    size = 1 << 20
    model = list(rt.plans.choice(size))
    want = WORLD * (WORLD + 1) / 2
    exact, exploring, calls = True, [], 0
    rt.executor(None, 64 << 20)  # planned only (as a hook's set-up does): no call measured, nothing pending
    planned_only = rt.exploring()
    before = sorted(f"{a}/{p}" for a, p in rt.plans.built())
    while rt.exploring() or calls == 0:
        xs = [torch.full((n,), float(RANK + 1)) for _ in range(2)]
        works = [gradsync.allreduce_async(x) for x in xs]  # queued: the comm thread runs them in order
        for w in works:
            w.wait()
        exact &= all(bool(torch.all(x == want)) for x in xs)
        calls += 2
        exploring.append(rt.exploring())
        if calls > 40:
            break
    record = rt.tuned.get(size, {})
    pick = rt.choice(n * 4)
    after = rt.executor(None, n * 4)
    x = torch.full((n,), float(RANK + 1))
    gradsync.allreduce(x)  # inline, after the decision
    exact &= bool(torch.all(x == want))
    out = {"model": model, "exact": exact, "calls": calls, "exploring": exploring, "record": record,
           "pick": list(pick), "runs_pick": tuple(pick) in rt.plans.built() and after is rt.plans.executor(*pick, size),
           "kept": sorted(f"{a}/{p}" for a, p in rt.plans.built()), "before": before, "planned_only": planned_only, "reps": EXPLORE_REPS,
           "pipelines": list(rt.cost_model.pipelines)}
    gradsync.shutdown()
    dist.barrier()
    return out


def scenario_late_native(topology: str, calls: str = "16") -> dict:
    """The last rank arrives ``late_s`` late at allreduces 4-9 of ``calls`` of a size ``auto`` runs on the backend's own
    ring: the watch sees it in each rank's time in the collective (that ring gives no pair rates), every rank
    switches at the same collective to the plan the model prices fastest for that late arrival, and back once it
    is on time; every sum exact (integers in float32). α = 1 µs: bandwidth decides, so the straggler schedule
    wins in the model (with the default α a 1 MiB loopback allreduce is α-bound and the ring stays)."""
    from dataclasses import replace

    from gradsync.comm.adapt import AdaptOptions
    from gradsync.comm.watch import Hysteresis
    from gradsync.sim.cost import CostModel

    model = replace(CostModel(), message_s=1e-6, native_message_s=1e-6)
    # enter at 80% of a collective, leave below 50%: a loopback collective of a few ms jitters by a few ms; its
    # pairs' rates jitter too, so the link side is off (100x slower to enter): this is about the late rank
    options = AdaptOptions(link=Hysteresis(100.0, 50.0, 3), late=Hysteresis(0.8, 0.5, 3), warmup=2, every=1,
                           min_bytes=1 << 20)
    rt = gradsync.init(topology, timeout_s=60, adapt=options, cost_model=model)
    numel = (1 << 20) // 4
    late_s, exact, plans = 0.25, True, []
    for i in range(int(calls)):
        if RANK == WORLD - 1 and 4 <= i < 10:
            time.sleep(late_s)
        x = torch.arange(numel, dtype=torch.float32) % 97 + RANK + i
        gradsync.allreduce(x)
        want = (torch.arange(numel, dtype=torch.float32) % 97) * WORLD + WORLD * (WORLD - 1) / 2 + WORLD * i
        exact &= bool(torch.equal(x, want))
        plans.append("/".join(map(str, rt.choice(numel * 4))))
    switches = [{"generation": s.generation, "collective": s.collective, "straggler": s.conditions.straggler,
                 "delay_s": s.conditions.straggler_delay_s, "old": s.old_plan, "new": s.new_plan,
                 "message": s.message} for s in rt.adapt.switches]
    out = {"plans": plans, "switches": switches, "exact": exact, "watched": rt.adapt.watched, "late_s": late_s,
           "slowdown": rt.adapt.slowdown, "message_s": rt.cost_model.message_s}
    gradsync.shutdown()
    return out


def scenario_tcp_rates(topology: str, calls: str = "4") -> dict:
    """A planned ring watched on gloo, ``calls`` allreduces: at its first watched allreduce every rank maps its TCP
    connections to the ranks they lead to, and the pair rates of each watched allreduce come from the kernel's
    counters."""
    from gradsync.comm.adapt import AdaptOptions

    options = AdaptOptions(warmup=2, every=1, min_bytes=1 << 20)
    rt = gradsync.init(topology, "ring", timeout_s=60, adapt=options)
    numel = (2 << 20) // 4
    exact, tcp = True, []
    for i in range(int(calls)):
        x = torch.full((numel,), float(RANK + i))
        gradsync.allreduce(x)
        exact &= bool((x == sum(r + i for r in range(WORLD))).all())
        tcp.append(rt.adapt.tcp_pairs)
    peers = sorted(set((rt.adapt._tcp_peers or {}).values()))
    out = {"exact": exact, "tcp_pairs": tcp, "peers": peers, "watched": rt.adapt.watched,
           "message_s": rt.cost_model.message_s, "source": rt.cost_model.source,
           "built": sorted(name for name, _ in rt.plans.built())}
    gradsync.shutdown()
    return out


SCENARIOS = {"tcp_rates": scenario_tcp_rates, "mismatch": scenario_mismatch, "calibrate": scenario_calibrate, "default_init": scenario_default_init, "explore": scenario_explore, "sums": scenario_sums, "sharded": scenario_sharded, "ddp": scenario_ddp, "ddp_native": scenario_ddp_native, "optimizer": scenario_optimizer, "kill": scenario_kill, "late_native": scenario_late_native}


def main() -> None:
    run_scenario(SCENARIOS, RANK)  # argv: NAME OUT_DIR TOPOLOGY ARGS...


if __name__ == "__main__":
    main()
