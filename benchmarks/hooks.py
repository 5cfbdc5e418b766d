"""gradsync's fp16 DDP hook against PyTorch's ``fp16_compress_hook``, step time side by side: ``gradsync bench hooks``.

Issue 20's goal: gradsync's fp16 hook at most 1.02x the step time of ``torch``'s
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``. On loopback with gloo the
network is nearly free, so what differs is the hooks' own overhead (compress, hand-off, allreduce call,
decompress, future).

``--procs`` processes (default 2), gloo on loopback, one thread each, train the same MLP (784-1024-256-10,
1.07M parameters) from the same weights on the same batches with three DDP replicas in the same processes:

* ``ddp``: no hook (fp32 allreduce), for scale;
* ``torch_fp16``: ``model.register_comm_hook(None, fp16_compress_hook)``;
* ``gradsync_fp16``: ``model.register_comm_hook(gradsync.CompressionHookState("fp16", model=net),
  gradsync.compression_hook)``, on the process group as a user would (no ``gradsync.init()``).

Every step runs each method once, in an order from :func:`gradsync.sim.bench.balanced_orders` (each method in each position
and after each other method equally often over 6 steps), after ``--warmup`` steps each. A sample is the slowest
rank's step (forward, backward with the hook, optimizer step); reported: medians, the median of the per-step
ratios gradsync_fp16 / torch_fp16 with a bootstrap 95 % interval (the goal's figure), the ratio of medians and the
same for CPU time (every thread of every rank: less
sensitive to other work on a shared machine), and whether each method's replicas are bit-identical across
ranks. Writes
``hooks.json`` to ``--out``.

Run from the repository root::

    gradsync bench hooks                      # about 20 s on 2 cores
    .venv/bin/python -m benchmarks.hooks --steps 40
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULT_TYPE = "gradsync.bench.hooks"
METHODS = ("ddp", "torch_fp16", "gradsync_fp16")
GOAL = 1.02


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def worker(args: argparse.Namespace) -> int:
    """One rank: every method's replica, steps alternating; rank 0 writes the report."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync
    from benchmarks.common import replicas_identical
    from gradsync.sim.bench import balanced_orders, bootstrap_median_ci, paired_ratios

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = _model()
    replicas: dict[str, tuple[Any, Any]] = {}
    for name in METHODS:
        net = copy.deepcopy(base)
        model = DDP(net, bucket_cap_mb=args.bucket_mb)
        if name == "torch_fp16":
            model.register_comm_hook(None, fp16_compress_hook)
        elif name == "gradsync_fp16":
            state = gradsync.CompressionHookState("fp16", model=net)
            model.register_comm_hook(state, gradsync.compression_hook)
        replicas[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, 784, generator=gen), torch.randint(10, (args.batch,), generator=gen))
               for _ in range(8)]
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    orders = balanced_orders(METHODS)
    for step in range(args.warmup + args.steps):
        x, y = batches[step % len(batches)]
        order = orders[step % len(orders)]
        for name in order:
            model, opt = replicas[name]
            c0, t0 = time.process_time(), time.perf_counter()
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    # slowest rank per sample (a float tensor, not pickled objects); CPU time: this process, all its threads,
    # summed over ranks -- what the hook itself costs, less sensitive to other work on a shared machine
    stacked = torch.tensor([times[m] for m in METHODS], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    cpu_sum = torch.tensor([cpu[m] for m in METHODS], dtype=torch.float64)
    dist.all_reduce(cpu_sum)
    identical = {name: replicas_identical(replicas[name][0]) for name in METHODS}
    if rank == 0:
        rows = {}
        for i, name in enumerate(METHODS):
            samples = stacked[i].tolist()
            rows[name] = {"median_s": statistics.median(samples), "samples_s": samples,
                          "cpu_median_s": statistics.median(cpu_sum[i].tolist()), "replicas_identical": identical[name]}
        ratio = rows["gradsync_fp16"]["median_s"] / rows["torch_fp16"]["median_s"]
        cpu_ratio = rows["gradsync_fp16"]["cpu_median_s"] / rows["torch_fp16"]["cpu_median_s"]
        paired = paired_ratios(rows["gradsync_fp16"]["samples_s"], rows["torch_fp16"]["samples_s"])
        paired_median = statistics.median(paired)
        low, high = bootstrap_median_ci(paired)
        out = {"type": RESULT_TYPE,
               "config": {"procs": world, "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
                          "bucket_mb": args.bucket_mb, "backend": "gloo", "threads": 1, "torch": torch.__version__,
                          "parameters": sum(p.numel() for p in base.parameters())},
               "gradsync_buckets": {"all": state.buckets, "native": state.native_buckets},
               "methods": rows, "ratio_gradsync_over_torch_fp16": ratio, "cpu_ratio_gradsync_over_torch_fp16": cpu_ratio,
               "paired_ratio_median": paired_median, "paired_ratio_ci95": [low, high],
               "goal": GOAL, "goal_met": paired_median <= GOAL,
               "load_avg": os.getloadavg()}
        Path(args.report).write_text(json.dumps(out, indent=1) + "\n")
    gradsync.shutdown()
    dist.barrier()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gradsync bench hooks", description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2, help="processes (gloo on loopback; default 2)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per method (default 300: a multiple of 6, the balanced cycle)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per method first (default 5)")
    p.add_argument("--batch", type=int, default=32, help="batch per rank (default 32)")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb (default 1: several buckets)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.procs < 2 or args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.bucket_mb <= 0:
        p.error("need --procs >= 2, --steps >= 1, --warmup >= 0, --batch >= 1 and --bucket-mb > 0")
    if args.worker:
        return worker(args)
    from benchmarks.common import loopback_report

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "hooks.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--report", str(report),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--bucket-mb", str(args.bucket_mb)]
        out = loopback_report(cmd, args.procs, report, timeout_s=900, what="bench hooks")
        if out is None:
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hooks.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, row in out["methods"].items():
        print(f"{name:>14s}: median step {row['median_s'] * 1e3:7.2f} ms (CPU, all ranks {row['cpu_median_s'] * 1e3:7.2f} ms)"
              f"  replicas identical: {row['replicas_identical']}")
    print(f"gradsync's hook: {out['gradsync_buckets']['native']} of {out['gradsync_buckets']['all']} buckets on the native path")
    low, high = out["paired_ratio_ci95"]
    print(f"gradsync_fp16 / torch_fp16, median of per-step ratios = {out['paired_ratio_median']:.3f} "
          f"(95% CI {low:.3f}-{high:.3f}; goal <= {GOAL}: {'met' if out['goal_met'] else 'NOT met'}); "
          f"ratio of medians {out['ratio_gradsync_over_torch_fp16']:.3f}, CPU time {out['cpu_ratio_gradsync_over_torch_fp16']:.3f}; "
          f"load {out['load_avg'][0]:.2f}; wrote {args.out / 'hooks.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
