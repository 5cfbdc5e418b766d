"""``gradsync demo``: plan every built-in topology with every algorithm, then train LeNet-5 on local workers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gradsync.commands._sizes import parse_size
from gradsync.paths import check_output
from gradsync.plan import SYNTHESIZERS, evaluate, limits, synthesize
from gradsync.topology import get_topology

__all__ = ["DEMO_TOPOLOGIES", "add_parser", "cmd_demo"]

#: What ``gradsync demo`` plans: one of each built-in family, at sizes a laptop plans in seconds.
DEMO_TOPOLOGIES = (
    "p3.16xlarge", "p3.8xlarge", "p2.16xlarge", "p2.8xlarge", "minsky:2",
    "ring:8", "full:8", "switch:8", "p3.16xlarge[0,1,2,3,7]", "bcube:3,2", "fattree:4",
)


def cmd_demo(args: argparse.Namespace) -> int:
    check_output(args.output, "-o/--output")
    if not args.no_train:
        check_output(args.plot, "--plot")
    size = parse_size(args.size)
    algorithms = SYNTHESIZERS.names()
    rows = []
    print(f"gradsync demo: every built-in topology x every applicable algorithm, allreduce of {args.size}")
    width = {a: max(9, len(a)) for a in algorithms}
    print(f"{'topology':24s} {'bound':>8s} " + " ".join(f"{a:>{width[a]}s}" for a in algorithms) + "   best          algbw GB/s")
    for spec in DEMO_TOPOLOGIES:
        topo = get_topology(spec)
        bounds = limits(topo)
        cells = {}
        for alg in algorithms:
            if SYNTHESIZERS.get(alg).applicable(topo):
                continue
            schedule = synthesize(alg, topo)
            cells[alg] = evaluate(schedule, topo, size, bounds=bounds)
        best = min(cells, key=lambda a: cells[a].time_s)
        print(f"{topo.name:24s} {bounds.lower_bound:8.4f} "
              + " ".join(f"{cells[a].cost:{width[a]}.4f}" if a in cells else f"{'-':>{width[a]}s}" for a in algorithms)
              + f"   {best:12s}  {cells[best].algbw_GBps:10.2f}", flush=True)
        rows.append({"topology": topo.name, "lower_bound": bounds.lower_bound,
                     "cost": {a: r.cost for a, r in cells.items()},
                     "time_s": {a: r.time_s for a, r in cells.items()}, "best": best})
    print("costs are OMS's C: time of the allreduce in units of sending the buffer once over the unit link.")
    report: dict = {"type": "gradsync.demo", "size_bytes": size, "rows": rows}
    if not args.no_train:
        from gradsync.train.demo import DemoConfig, run_demo

        algorithms = [a for a in args.algorithms.split(",") if a] if args.algorithms else None
        config = DemoConfig(workers=args.workers, algorithms=algorithms, steps=args.steps)
        print(f"\ntraining LeNet-5 on scikit-learn's digits with {config.workers} local workers (gloo, loopback), "
              f"{config.steps} steps per algorithm, schedules planned for {config.topology}:", flush=True)
        train = run_demo(config, plot=args.plot)
        report["training"] = train
        print(f"\n{'algorithm':18s} {'accuracy':>8s} {'ms/step':>8s} {'comm ms':>8s} {'waited':>8s}  replicas equal")
        for name, r in train["results"].items():
            print(f"{name:18s} {r['accuracy']:8.3f} {r['step_ms']:8.2f} {r['comm_ms']:8.2f} {r['wait_ms']:8.2f}  "
                  f"{'yes' if r['replicas_identical'] else 'NO'}")
        print("comm ms: time the communication thread was busy per step; waited: the part training waited for.")
        plans = train["results"].get("auto", {}).get("plans")
        if plans:
            print("auto (calibrated on this wire) ran, per gradient group: "
                  + ", ".join(f"{int(n) / 1024:.1f} KiB {plan}" for n, plan in plans.items()))
        print(f"plot: {train['plot']}")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to the main CLI's subparsers."""
    d = subparsers.add_parser("demo", help="plan every built-in topology, then train LeNet-5 with 4 workers per algorithm")
    d.add_argument("--size", default="100MB")
    d.add_argument("-o", "--output", help="write the table (and training results) as JSON")
    d.add_argument("--no-train", action="store_true", help="only the planning table, no training run")
    d.add_argument("--workers", type=int, default=4, help="local worker processes for the training run")
    d.add_argument("--steps", type=int, default=120, help="training steps per algorithm")
    d.add_argument("--algorithms", default="", help="comma-separated (default: torch.all_reduce, auto and every applicable one)")
    d.add_argument("--plot", default="gradsync-demo.png", help="where to save the training plot (.png/.svg)")
    d.set_defaults(func=cmd_demo)
    return d
