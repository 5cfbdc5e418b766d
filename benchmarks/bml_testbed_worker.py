"""One server's process of ``gradsync bench bml-testbed``: started inside each namespace by ``testbed.run``.

It joins the gloo process group from the torchrun variables the testbed sets (``GLOO_SOCKET_IFNAME`` makes
gloo use the server's primary NIC), plans ``--algorithm`` for ``--topology`` with ``gradsync.init`` and

1. **GST** -- for every size: one float32 buffer of that many bytes; ``--warmup`` allreduces (the first
   result is checked: every rank fills ``rank + 1``, so every element must be ``N (N + 1) / 2``), then
   ``--reps`` timed ones. Each repetition: refill, ``dist.barrier()``, time ``rt.allreduce(buf)`` on every
   rank; the sample is the slowest rank's time (the collective is done when the last rank has its result).
2. **JCT** -- ``--steps`` steps of data-parallel SGD on the digits with the seed's LeNet-5 (the TensorFlow
   MNIST LeNet-5 the seed measured: conv5x5 32, conv5x5 64, fc 1024, fc 10 on 28x28 input, 3,274,634
   parameters = 12.49 MiB of float32 gradient, the seed's "3.27 million parameters ... about 12.5MB") or
   the registry's ``lenet5`` (61,706 parameters). Same initial weights, same data order on every testbed;
   gradients are averaged by :class:`gradsync.DistributedOptimizer` (buckets start while backward runs).
   JCT is the wall time from a barrier before the first step to a barrier after the last; a second pass
   without any communication (each rank trains alone on its shard) gives the compute time per step.

Rank 0 samples ``/proc/stat`` around every phase (system-wide CPU busy share: namespaces share the CPUs)
and writes everything as JSON to ``--out`` (the namespaces share the filesystem). One intra-op thread per
process: nine processes share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class PaperLeNet5(nn.Module):
    """The LeNet-5 of the seed's experiments (TensorFlow's MNIST model): 3,274,634 parameters at 10 classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),  # 32x14x14
            nn.Conv2d(32, 64, kernel_size=5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),  # 64x7x7
        )
        self.classifier = nn.Sequential(nn.Linear(7 * 7 * 64, 1024), nn.ReLU(inplace=True), nn.Linear(1024, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


#: model name -> input side in pixels (digits are upsampled to it)
MODELS = {"paper-lenet5": 28, "lenet5": 32}


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="bml-testbed worker (run by benchmarks/bml_testbed.py)")
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--topology", required=True)
    p.add_argument("--algorithm", required=True)
    p.add_argument("--sizes", default="", help="comma-separated buffer sizes in bytes (multiples of 4)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=30, help="training steps (0: no JCT phase)")
    p.add_argument("--batch", type=int, default=72, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--model", choices=sorted(MODELS), default="paper-lenet5")
    p.add_argument("--bucket-bytes", type=int, default=4 * 2**20)
    p.add_argument("--pipeline", type=int, default=1, help="PlanOptions.pipeline: sub-chunks per chunk")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any single wait may take")
    return p.parse_args(argv)


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (iowait and idle count as not busy)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


class CpuMeter:
    """System-wide CPU busy share between construction and :meth:`share`, plus this process's CPU seconds."""

    def __init__(self) -> None:
        self.ticks = _cpu_ticks()
        self.proc = time.process_time()

    def share(self) -> float:
        busy, total = _cpu_ticks()
        return (busy - self.ticks[0]) / max(1, total - self.ticks[1])

    def process_s(self) -> float:
        return time.process_time() - self.proc


def _gather_float(value: float) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64)
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]


def measure_gst(rt: Any, algorithm: str, size_bytes: int, reps: int, warmup: int) -> dict[str, Any]:
    """Warm-up (first result checked) and ``reps`` timed allreduces of one ``size_bytes`` float32 buffer."""
    rank, world = rt.rank, rt.world_size
    numel = size_bytes // 4
    buf = torch.empty(numel, dtype=torch.float32)
    want = world * (world + 1) / 2
    correct = True
    ex = rt.executor(algorithm)
    for i in range(max(1, warmup)):
        buf.fill_(rank + 1)
        dist.barrier()
        rt.allreduce(buf, algorithm=algorithm)
        if i == 0:
            correct = bool(torch.all(buf == want))
    ok = min(_gather_float(1.0 if correct else 0.0)) == 1.0
    sent0 = ex.stats.bytes_sent
    runs0 = ex.stats.runs
    samples: list[float] = []
    fastest: list[float] = []
    cpu = CpuMeter()
    t_phase = time.perf_counter()
    for _ in range(reps):
        buf.fill_(rank + 1)
        dist.barrier()
        t0 = time.perf_counter()
        rt.allreduce(buf, algorithm=algorithm)
        dt = time.perf_counter() - t0
        per_rank = _gather_float(dt)
        samples.append(max(per_rank))
        fastest.append(min(per_rank))
    wall = time.perf_counter() - t_phase
    share = cpu.share()
    proc_cpu = sum(_gather_float(cpu.process_s()))
    sent = (ex.stats.bytes_sent - sent0) / max(1, ex.stats.runs - runs0)
    return {
        "size_bytes": numel * 4, "samples_s": samples, "fastest_rank_s": fastest,
        "median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
        "correct": ok, "bytes_sent_rank0": sent, "cpu_busy_share": share,
        "workers_cpu_s_per_wall_s": proc_cpu / max(wall, 1e-9),
    }


def _model(name: str) -> nn.Module:
    if name == "paper-lenet5":
        return PaperLeNet5()
    from gradsync.models import create

    return create("lenet5", num_classes=10)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(rt: Any, args: argparse.Namespace, communicate: bool) -> dict[str, Any]:
    """``args.steps`` SGD steps from fixed weights on fixed data; with or without gradient averaging."""
    import gradsync
    from gradsync.models.data import load_digits, shard

    rank, world = rt.rank, rt.world_size
    data = load_digits(MODELS[args.model])
    torch.manual_seed(0)
    model = _model(args.model)
    params = sum(p.numel() for p in model.parameters())
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt: Any = base
    if communicate:
        opt = gradsync.DistributedOptimizer(base, model.named_parameters(), runtime=rt, algorithm=args.algorithm,
                                            bucket_bytes=args.bucket_bytes)
    n_train = data.x_train.shape[0]
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(1))
    comm0 = rt.comm_seconds
    step_s: list[float] = []
    losses: list[float] = []
    cpu = CpuMeter()
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.steps):
        ts = time.perf_counter()
        start = (step * args.batch) % (n_train - args.batch)
        idx = order[start : start + args.batch]
        x, y = shard(data.x_train[idx], data.y_train[idx], rank, world)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
        step_s.append(time.perf_counter() - ts)
    dist.barrier()
    wall = time.perf_counter() - t0
    share = cpu.share()
    out: dict[str, Any] = {
        "jct_s": max(_gather_float(wall)), "step_s_median": statistics.median(step_s), "step_s": step_s,
        "params": params, "gradient_bytes": params * 4, "cpu_busy_share": share,
        "loss_first": losses[0], "loss_last": losses[-1],
    }
    if communicate:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        spread = flat.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        same = 1.0 if torch.equal(spread, flat) else 0.0
        out["replicas_identical"] = min(_gather_float(same)) == 1.0
        out["comm_busy_s"] = rt.comm_seconds - comm0
        out["comm_waited_s"] = opt.wait_seconds
        out["test_accuracy"] = _accuracy(model, data.x_test, data.y_test)
        opt.remove_hooks()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import gradsync
    from gradsync.plan import PlanOptions

    args = _args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    rt = gradsync.init(topology=args.topology, algorithm=args.algorithm, timeout_s=args.timeout,
                       options=PlanOptions(pipeline=args.pipeline))
    rank = rt.rank
    sched = rt.schedule(args.algorithm)
    result: dict[str, Any] = {
        "topology": args.topology, "algorithm": args.algorithm, "pipeline": args.pipeline, "world_size": rt.world_size,
        "transfers": len(sched.transfers), "chunks": len(sched.chunks),
        "address": os.environ.get("GRADSYNC_TESTBED_ADDR"), "gst": [], "jct": None, "compute_only": None,
    }
    for size in [int(s) for s in args.sizes.split(",") if s]:
        r = measure_gst(rt, args.algorithm, size, args.reps, args.warmup)
        result["gst"].append(r)
        if rank == 0:
            print(f"{args.algorithm} on {args.topology}: {r['size_bytes'] / 2**20:.2f} MiB  median "
                  f"{r['median_s']:.4f} s  (min {r['min_s']:.4f}, max {r['max_s']:.4f}; correct {r['correct']}; "
                  f"CPU busy {r['cpu_busy_share']:.0%})", flush=True)
    if args.steps > 0:
        result["jct"] = train(rt, args, communicate=True)
        if rank == 0:
            j = result["jct"]
            print(f"{args.algorithm} on {args.topology}: JCT {j['jct_s']:.2f} s for {args.steps} steps of "
                  f"{args.model} ({j['params']} params), loss {j['loss_first']:.3f} -> {j['loss_last']:.3f}, "
                  f"replicas identical {j['replicas_identical']}", flush=True)
        result["compute_only"] = train(rt, args, communicate=False)
        if rank == 0:
            print(f"{args.algorithm} on {args.topology}: compute only {result['compute_only']['jct_s']:.2f} s "
                  f"for {args.steps} steps", flush=True)
    result["worker_wall_s"] = time.perf_counter() - t_start
    if rank == 0:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.out)
    gradsync.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
