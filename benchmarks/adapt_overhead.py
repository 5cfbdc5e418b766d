"""What the runtime's watch costs when nothing changes: ``gradsync bench adapt``.

Issue 39 wants the watch (:mod:`gradsync.comm.adapt`) cheap enough to stay on by default, and measured. Here
``--procs`` processes (default 3), gloo on loopback, one thread each, hold two runtimes over the same process
group and topology (``switch:N``, a planned ``--algorithm``, default ``ring``, so every collective runs
gradsync's executor and is watched): one with ``adapt=True``, one with ``adapt=False``. Every round runs one
``--size`` float32 allreduce on each, in ABBA order (:func:`gradsync.sim.bench.balanced_orders`), after
``--warmup`` rounds (past the watch's own warm-up). A sample is the slowest rank's time of the call; reported:
medians, the median of the per-round ratios on / off with a bootstrap 95 % interval (the goal's figure: <= 1.01),
every sum checked exact, and the switches and held switches the watch made on a wire that did not change
(each one would be noise: the goal is none). Writes ``adapt.json`` to ``--out``.

Run from the repository root::

    gradsync bench adapt                      # about a minute on 2 cores
    .venv/bin/python -m benchmarks.adapt_overhead --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULT_TYPE = "gradsync.bench.adapt"
METHODS = ("adapt_on", "adapt_off", "adapt_every1")
GOAL = 1.01


def worker(args: argparse.Namespace) -> int:
    """One rank: both runtimes, rounds alternating; rank 0 writes the report."""
    import torch
    import torch.distributed as dist

    from gradsync.comm.runtime import Runtime
    from gradsync.comm.transport import TorchTransport
    from gradsync.sim.bench import balanced_orders, bootstrap_median_ci, paired_ratios

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = f"switch:{world}"
    from gradsync.comm.adapt import AdaptOptions

    # adapt_on: the defaults (one allreduce in AdaptOptions.every watched); adapt_every1: every allreduce watched
    adapt = {"adapt_on": True, "adapt_off": False, "adapt_every1": AdaptOptions(every=1)}
    runtimes = {name: Runtime(TorchTransport(timeout_s=120), topology, args.algorithm, timeout_s=120,
                              adapt=adapt[name]) for name in METHODS}
    numel = args.size // 4
    want = float(world * (world + 1) // 2)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    exact = {m: True for m in METHODS}
    orders = balanced_orders(METHODS)
    buf = torch.empty(numel, dtype=torch.float32)
    for i in range(args.warmup + args.rounds):
        for name in orders[i % len(orders)]:
            buf.fill_(rank + 1)
            dist.barrier()
            t0 = time.perf_counter()
            runtimes[name].allreduce(buf)
            took = time.perf_counter() - t0
            exact[name] &= bool(torch.all(buf == want))
            if i >= args.warmup:
                times[name].append(took)
    stacked = torch.tensor([times[m] for m in METHODS], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    ok = torch.tensor([float(exact[m]) for m in METHODS])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    watch = runtimes["adapt_on"].adapt
    assert watch is not None
    if rank == 0:
        rows = {}
        for i, name in enumerate(METHODS):
            samples = stacked[i].tolist()
            rows[name] = {"median_s": statistics.median(samples), "samples_s": samples, "exact": bool(ok[i] == 1.0)}
        paired = paired_ratios(rows["adapt_on"]["samples_s"], rows["adapt_off"]["samples_s"])
        median = statistics.median(paired)
        low, high = bootstrap_median_ci(paired)
        every1 = paired_ratios(rows["adapt_every1"]["samples_s"], rows["adapt_off"]["samples_s"])
        out = {"type": RESULT_TYPE,
               "config": {"procs": world, "rounds": args.rounds, "warmup": args.warmup, "size_bytes": args.size,
                          "algorithm": args.algorithm, "topology": topology, "backend": "gloo", "threads": 1,
                          "torch": torch.__version__},
               "methods": rows, "paired_ratio_median": median, "paired_ratio_ci95": [low, high],
               "ratio_of_medians": rows["adapt_on"]["median_s"] / rows["adapt_off"]["median_s"],
               "every": watch.options.every, "every1_paired_ratio_median": statistics.median(every1),
               "every1_paired_ratio_ci95": list(bootstrap_median_ci(every1)),
               "watched": watch.watched, "switches": [s.message for s in watch.switches],
               "held": [s.message for s in watch.held], "goal": GOAL, "goal_met": median <= GOAL and not watch.switches,
               "load_avg": os.getloadavg()}
        Path(args.report).write_text(json.dumps(out, indent=1) + "\n")
    for rt in runtimes.values():
        rt.shutdown()
    dist.barrier()
    return 0


def plot(out: dict[str, Any], path: Path) -> None:
    """Per-round times of both runtimes and the paired ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, row in out["methods"].items():
        ax.plot([t * 1e3 for t in row["samples_s"]], label=f"{name} (median {row['median_s'] * 1e3:.1f} ms)")
    ax.set_xlabel("round")
    ax.set_ylabel("allreduce, slowest rank (ms)")
    ax.legend(fontsize=8)
    ratios = [a / b for a, b in zip(out["methods"]["adapt_on"]["samples_s"], out["methods"]["adapt_off"]["samples_s"])]
    bx.hist(ratios, bins=30)
    bx.axvline(out["paired_ratio_median"], color="k", label=f"median {out['paired_ratio_median']:.3f}")
    bx.axvline(GOAL, color="r", linestyle="--", label=f"goal {GOAL}")
    bx.set_xlabel("on / off, per round")
    bx.legend(fontsize=8)
    cfg = out["config"]
    fig.suptitle(f"the watch's cost: {cfg['procs']} ranks, {cfg['size_bytes'] / 2**20:g} MiB {cfg['algorithm']} on gloo "
                 f"loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gradsync bench adapt", description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=3, help="processes (gloo on loopback; default 3)")
    p.add_argument("--rounds", type=int, default=120, help="timed rounds, one allreduce per runtime (default 120)")
    p.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default 10: past the watch's 5)")
    p.add_argument("--size", type=int, default=4 << 20, help="bytes per allreduce (default 4 MiB)")
    p.add_argument("--algorithm", default="ring", help="a planned algorithm (default ring)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.procs < 2 or args.rounds < 2 or args.warmup < 0 or args.size < 4 or args.size % 4:
        p.error("need --procs >= 2, --rounds >= 2, --warmup >= 0 and --size a positive multiple of 4 bytes")
    if args.algorithm == "auto":
        p.error("--algorithm auto runs gloo's own allreduce on a flat switch, which nothing watches; name a planned "
                "algorithm (ring, tree, lp, forest, ...)")
    if args.worker:
        return worker(args)
    from benchmarks.common import loopback_report

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "adapt.json"
        cmd = [sys.executable, "-m", "benchmarks.adapt_overhead", "--worker", "--report", str(report),
               "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--size", str(args.size),
               "--algorithm", args.algorithm]
        out = loopback_report(cmd, args.procs, report, timeout_s=900, what="bench adapt", env={"OMP_NUM_THREADS": "1"})
        if out is None:
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adapt.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out, args.out / "adapt.png")
    for name, row in out["methods"].items():
        print(f"{name:>10s}: median {row['median_s'] * 1e3:8.2f} ms, sums exact: {row['exact']}")
    low, high = out["paired_ratio_ci95"]
    print(f"on / off, median of per-round ratios = {out['paired_ratio_median']:.3f} (95% CI {low:.3f}-{high:.3f}; "
          f"goal <= {GOAL}: {'met' if out['goal_met'] else 'NOT met'}); {out['watched']} collectives watched, "
          f"{len(out['switches'])} switches, {len(out['held'])} held; load {out['load_avg'][0]:.2f}; "
          f"wrote {args.out / 'adapt.json'} and adapt.png")
    for line in out["switches"] + out["held"]:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
