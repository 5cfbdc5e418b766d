"""One server's process of ``gradsync bench vs-native``: started in each namespace by ``testbed.run``.

It joins gloo from the torchrun variables, starts ``gradsync.init(topology, "auto")`` with the cost model in
``$GRADSYNC_COST_MODEL`` (the testbed's rates and measured goodput), and measures, in the same processes,
methods alternating repetition by repetition so that drift hits both alike:

1. **allreduce** per size: ``torch.distributed.all_reduce`` on the default group (what a user calls
   today) against ``gradsync.allreduce`` (``auto``: the cost model's choice of algorithm and pipeline depth
   for that size, the native collective included). Each sample: refill, barrier, time on every rank, keep
   the slowest rank. The first result of each method is checked exactly (rank ``r`` fills ``r + 1``).
2. **train** (``--steps`` > 0): data-parallel SGD of BML's LeNet-5 (3,274,634 parameters) from the same
   weights on the same data, three replicas in the same processes: ``DistributedDataParallel`` (gloo),
   DDP with gradsync's allreduce hook, and :class:`gradsync.DistributedOptimizer`. Steps alternate
   between the three; a sample is the slowest rank's step time. At the end every replica's parameters are
   compared across ranks (bit-identical) and the losses across methods.

Rank 0 samples ``/proc/stat`` around each phase (system-wide CPU busy share: the namespaces share the
CPUs) and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.bml_testbed_worker import CpuMeter, PaperLeNet5, _gather_float
from gradsync.sim.cost import size_class


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="vs-native worker (run by benchmarks/vs_native.py)")
    p.add_argument("--out", required=True)
    p.add_argument("--topology", required=True)
    p.add_argument("--sizes", default="", help="comma-separated sizes in bytes (multiples of 4)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="time each method for at least this long per size (more reps where one is short), "
                        "at most 20x --reps")
    p.add_argument("--steps", type=int, default=0, help="training steps per method (0: no training phase)")
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the ranks")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (DDP's default 25)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--no-explore", dest="explore", action="store_false",
                   help="gradsync.init(explore=False): the model's pipeline depths from the first call")
    p.add_argument("--calibrate", choices=("yes", "no", "default"), default="no",
                   help="gradsync.init(calibrate=True / False / left out: init's default, which measures the wire "
                        "only where the choice turns on it)")
    return p.parse_args(argv)


#: Training steps beyond the first that may warm up while ``auto`` still measures its first calls per bucket size.
MAX_WARMUP_STEPS = 8


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return max(_gather_float(time.perf_counter() - t0))


#: The most warm-up calls per size while ``auto`` still explores: its first step times up to four plans (the
#: model's depth, its double and half, a rival algorithm) over four rounds, and up to two more steps follow;
#: timing before it settles would mix the candidates into the samples.
WARM_CAP = 64


def enough(samples: dict[str, list[float]], reps: int, min_seconds: float) -> bool:
    """Whether the alternating samples may stop: ``reps`` each at least, then until every method ran for
    ``min_seconds`` (short sizes are the noisy ones, and cheap to repeat), at most ``20 * reps`` each. Every
    rank holds the same samples (each is the slowest rank's), so every rank stops at the same one."""
    done = min(len(v) for v in samples.values())
    return done >= reps and (done >= 20 * reps or min(sum(v) for v in samples.values()) >= min_seconds)


def allreduce_phase(rt: Any, sizes: list[int], reps: int, min_seconds: float = 0.0) -> list[dict[str, Any]]:
    import gradsync

    rank, world = dist.get_rank(), dist.get_world_size()
    want = world * (world + 1) / 2
    rows = []
    for size in sizes:
        buf = torch.empty(size // 4, dtype=torch.float32)
        methods: dict[str, Callable[[], Any]] = {
            "native": lambda buf=buf: dist.all_reduce(buf),
            "gradsync": lambda buf=buf: gradsync.allreduce(buf),
        }
        correct = {name: True for name in methods}
        warm = 0
        while True:  # warm up both, until auto has settled on its plan for this size (Runtime.explore)
            for name, fn in methods.items():
                buf.fill_(rank + 1)
                fn()
                correct[name] &= min(_gather_float(float(bool(torch.all(buf == want))))) == 1.0
            warm += 1
            exploring = max(_gather_float(float(rt.exploring()))) > 0  # the same answer on every rank
            if warm >= WARM_CAP or not exploring:
                break
        choice = predicted = None
        used = rt.choice(size)  # what auto runs now: the model's choice, or what measuring replaced it with
        if rank == 0:  # rank 0 prices plans for every rank (the others would only repeat the simulation)
            choice = rt.chooser.choose(size)  # the model's choice for the size class
            algorithm, pipeline = used
            # predictions at this exact size (the class's choice is priced at the class's size)
            predicted = {"gradsync": rt.cost_model.predict(rt.chooser.schedule(algorithm, pipeline), rt.topology, size)
                         if algorithm != "native" else rt.cost_model.predict_native(rt.topology, size),
                         "native": rt.cost_model.predict_native(rt.topology, size)}
        samples: dict[str, list[float]] = {m: [] for m in methods}
        cpu = CpuMeter()
        while not enough(samples, reps, min_seconds):
            for name, fn in methods.items():
                buf.fill_(rank + 1)
                samples[name].append(_timed(fn))
        rows.append({
            "size_bytes": size, "choice": choice.to_dict() if choice else None, "predicted_s": predicted,
            "ran": list(used), "explored": rt.tuned.get(size_class(size)), "warmup_calls": warm, "timed_while_exploring": exploring,
            "correct": correct,
            "samples_s": samples,
            "median_s": {m: statistics.median(v) for m, v in samples.items()}, "cpu_busy_share": cpu.share(),
        })
        if choice is not None and predicted is not None:
            med = rows[-1]["median_s"]
            print(f"allreduce {size / 2**20:.2f} MiB: native {med['native']:.4f} s, gradsync "
                  f"{used[0]}/p{used[1]} {med['gradsync']:.4f} s "
                  f"(predicted {predicted['gradsync']:.4f}), x{med['native'] / med['gradsync']:.2f}", flush=True)
    return rows


def _step(model: nn.Module, optim: Any, x: torch.Tensor, y: torch.Tensor, losses: list[float]) -> None:
    optim.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    losses.append(float(loss.item()))


def train_phase(rt: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Three replicas from the same weights, stepping in turn on the same batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync
    from gradsync.models.data import load_digits, shard
    from gradsync.train.hooks import GradsyncHookState, allreduce_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_digits(28)
    torch.manual_seed(0)
    base = PaperLeNet5()
    replicas: dict[str, Any] = {}
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)
    replicas["ddp"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9))
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)
    hooked.register_comm_hook(GradsyncHookState(rt), allreduce_hook)
    replicas["gradsync_hook"] = (hooked, torch.optim.SGD(hooked.parameters(), lr=0.02, momentum=0.9))
    plain = copy.deepcopy(base)
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.02, momentum=0.9),
                                        plain.named_parameters(), runtime=rt,
                                        bucket_bytes=int(args.bucket_mb * 2**20))
    replicas["gradsync_optimizer"] = (plain, opt)
    n = data.x_train.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    samples: dict[str, list[float]] = {m: [] for m in replicas}
    losses: dict[str, list[float]] = {m: [] for m in replicas}
    cpu = CpuMeter()
    warm, step = 1, 0  # steps before ``warm`` warm up (buckets, plans) and are not timed
    while step < warm + args.steps:
        # ... nor those while auto still times its first calls of a bucket size (Runtime.explore); every
        # rank takes the same decision (the timed steps below hold barriers)
        if step == warm and warm <= MAX_WARMUP_STEPS and max(_gather_float(float(rt.exploring()))) > 0:
            warm += 1
        start = (step * args.batch) % (n - args.batch)
        x, y = shard(data.x_train[order[start:start + args.batch]], data.y_train[order[start:start + args.batch]],
                     rank, world)
        for name, (model, optim) in replicas.items():
            dt = _timed(lambda m=model, o=optim, n=name, x=x, y=y: _step(m, o, x, y, losses[n]))
            if step >= warm:
                samples[name].append(dt)
        step += 1
    share = cpu.share()
    identical = {}
    for name, (model, _) in replicas.items():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        identical[name] = min(_gather_float(float(torch.equal(ref, flat)))) == 1.0
    ref_loss = losses["ddp"]
    return {
        "steps": args.steps, "warmup_steps": warm, "still_exploring": rt.exploring(), "batch": args.batch,
        "explored": {str(k): v for k, v in rt.tuned.items() if v.get("online")},
        "parameters": sum(p.numel() for p in base.parameters()),
        "samples_s": samples, "median_s": {m: statistics.median(v) for m, v in samples.items()},
        "losses": losses, "replicas_identical": identical, "cpu_busy_share": share,
        "max_loss_gap_vs_ddp": {m: max(abs(a - b) for a, b in zip(v, ref_loss)) for m, v in losses.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    import gradsync

    args = _args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    calibrate = {"yes": True, "no": False, "default": None}[args.calibrate]
    if calibrate is None and args.explore:  # exactly what a user writes
        rt = gradsync.init(args.topology, timeout_s=args.timeout)
    else:
        rt = gradsync.init(args.topology, "auto", timeout_s=args.timeout, calibrate=calibrate,
                           explore=None if args.explore else False)
    out: dict[str, Any] = {"topology": args.topology, "world_size": rt.world_size,
                           "cost_model": rt.cost_model.to_dict(), "calibrated": args.calibrate, "explore": rt.explore,
                           "init_s": time.perf_counter() - t0,
                           "tuned": {str(k): v for k, v in rt.tuned.items()}}
    sizes = [int(s) for s in args.sizes.split(",") if s]
    out["allreduce"] = allreduce_phase(rt, sizes, args.reps, args.min_seconds) if sizes else []
    if args.steps:
        out["train"] = train_phase(rt, args)
    if rt.rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1), encoding="utf-8")
    gradsync.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
