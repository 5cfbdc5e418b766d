"""``gradsync order MODEL``: the TicTac ordering wizard on the command line; :func:`add_parser` plugs it in.

Captures the model's DAG (or loads a saved one), profiles its ops (minimum of 5 runs), orders the
parameters with ``--method`` and reports the order, the bounds U and L, efficiency E and speedup S, and the
simulated makespan against random orders (TicTac's baseline), on 1 worker and on ``--workers``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from gradsync.errors import GradsyncError
from gradsync.order.priorities import ORDERINGS
from gradsync.paths import check_output

__all__ = ["add_parser", "cmd_order", "load_dag"]


def load_dag(args: argparse.Namespace) -> Any:
    """The DAG with profiled times: from a ``.json`` file, or captured and profiled from a registered model."""
    from gradsync.order.dag import Dag

    if str(args.model).endswith(".json"):
        return Dag.load(args.model)
    from gradsync.models import MODELS, create
    from gradsync.order.capture import capture, example_input
    from gradsync.order.oracle import profile_ops

    name = MODELS.canonical(args.model)
    model = create(name)
    example = example_input(name, batch=args.batch, image_size=args.image_size)
    dag = capture(model, example, training=not args.inference, name=name)
    return dag.with_times(profile_ops(model, example, dag, runs=args.runs), backward_factor=args.backward_factor)


def cmd_order(args: argparse.Namespace) -> int:
    from gradsync.order.oracle import bandwidth_for_ratio, time_oracle
    from gradsync.order.priorities import order_of, ordering
    from gradsync.order.tictac import metrics
    from gradsync.sim.iteration import IterationConfig, plot_iteration, simulate_iteration

    if args.workers < 1:
        raise GradsyncError(f"--workers {args.workers} must be >= 1")
    if args.random_runs < 1:
        raise GradsyncError(f"--random-runs {args.random_runs} must be >= 1")
    if args.gantt and Path(args.gantt).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise GradsyncError(f"--gantt {args.gantt!r} must end in .png, .svg or .pdf")
    check_output(args.gantt, "--gantt")
    check_output(args.save_dag, "--save-dag")
    dag = load_dag(args)
    if args.save_dag:
        dag.save(args.save_dag)
    bandwidth = args.bandwidth if args.bandwidth is not None else bandwidth_for_ratio(dag, args.ratio, alpha_s=args.latency)
    # E is defined for one PS worker (TicTac §3.2); an allreduce among 1 worker would move nothing.
    one = IterationConfig(1, "ps", bandwidth, None, args.latency, args.partition, args.credit)
    many = IterationConfig(args.workers, args.mode, bandwidth, args.server_bandwidth, args.latency, args.partition, args.credit)
    oracle = time_oracle(dag, one.link)
    prio = ordering(dag, args.method, oracle, seed=args.seed)
    chosen = simulate_iteration(dag, prio, one, seed=args.seed, record=False)
    chosen_w = simulate_iteration(dag, prio, many, seed=args.seed, record=bool(args.gantt))
    rand = [simulate_iteration(dag, "random", one, seed=s, record=False).makespan_s for s in range(args.random_runs)]
    rand_w = [simulate_iteration(dag, "random", many, seed=s, record=False) for s in range(args.random_runs)]
    m = metrics(dag, oracle, chosen.makespan_s)
    rand_e = [metrics(dag, oracle, r).efficiency for r in rand]
    report: dict[str, Any] = {
        "type": "gradsync.order", "dag": dag.name, "method": args.method, "training": dag.training,
        "params": len(dag.params), "ops": len(dag.ops), "bytes": dag.total_bytes, "bandwidth_GBps": bandwidth,
        "priorities": prio, "metrics": m.to_dict(),
        "random": {"makespan_s_mean": statistics.fmean(rand), "E_mean": statistics.fmean(rand_e),
                   "workers_makespan_s_mean": statistics.fmean(r.makespan_s for r in rand_w),
                   "straggler_percent_max": max(r.straggler_percent for r in rand_w)},
        "workers": {"count": args.workers, "makespan_s": chosen_w.makespan_s,
                    "straggler_percent": chosen_w.straggler_percent},
    }
    if args.gantt:
        plot_iteration(chosen_w, args.gantt, title=f"{dag.name}, {args.method}, {args.workers} worker(s)")
        report["gantt"] = str(args.gantt)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(dag.summary() + f"; link {bandwidth:.4g} GB/s" + (f" + {args.latency:g} s" if args.latency else ""))
    ordered = order_of(prio)
    shown = ordered if args.top <= 0 else ordered[: args.top]
    print(f"{args.method} order ({len(ordered)} parameters" + ("" if len(shown) == len(ordered) else f", first {len(shown)}") + "):")
    for name in shown:
        print(f"  {prio[name]:5d}  {name}")
    print(f"U = {m.upper_s * 1e3:.4g} ms, L = {m.lower_s * 1e3:.4g} ms, S = {m.speedup:.3f}")
    print(f"1 worker (ps): {args.method} makespan {m.makespan_s * 1e3:.4g} ms (E = {m.efficiency:.3f}); random "
          f"{statistics.fmean(rand) * 1e3:.4g} ms (E = {statistics.fmean(rand_e):.3f}, mean of {len(rand)})")
    print(f"{args.workers} workers ({args.mode}): {args.method} makespan {chosen_w.makespan_s * 1e3:.4g} ms, "
          f"straggler {chosen_w.straggler_percent:.1f}%; random {report['random']['workers_makespan_s_mean'] * 1e3:.4g} ms, "
          f"straggler up to {report['random']['straggler_percent_max']:.1f}%")
    if args.gantt:
        print(f"Gantt chart written to {args.gantt}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``order`` to the main CLI's subparsers."""
    from gradsync.sim.iteration import ITERATION_MODES

    p = subparsers.add_parser(
        "order", help="TicTac: order parameter transfers (tic/tac), report U/L/E/S and the simulated makespan",
        description="Capture MODEL's DAG, profile its ops (min of --runs runs), order its parameters and simulate "
                    "one iteration against random orders (TicTac).",
    )
    p.add_argument("model", help="registered model (gradsync models) or a saved DAG .json")
    p.add_argument("--method", "-m", default="tac", choices=ORDERINGS.names(), help="ordering (default tac)")
    p.add_argument("--workers", "-w", type=int, default=4, help="workers in the multi-worker simulation (default 4)")
    p.add_argument("--mode", default="ps", choices=ITERATION_MODES.names(), help="network model (default ps)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="per-worker link in GB/s (default: the rate at which communication/computation = --ratio)")
    p.add_argument("--ratio", type=float, default=1.0, help="communication/computation ratio when --bandwidth is not given")
    p.add_argument("--server-bandwidth", type=float, default=None, help="PS NIC in GB/s shared by all workers (default: unlimited)")
    p.add_argument("--latency", type=float, default=0.0, help="per-transfer latency α in seconds")
    p.add_argument("--partition", type=int, default=None, help="split transfers into chunks of this many bytes")
    p.add_argument("--credit", type=int, default=None, help="bytes a channel may keep in flight (default one chunk)")
    p.add_argument("--inference", action="store_true", help="inference iteration (no backward, no pushes)")
    p.add_argument("--image-size", type=int, default=None, help="input pixels per side for capture/profiling (default the model's)")
    p.add_argument("--batch", type=int, default=2, help="batch size for capture/profiling (default 2)")
    p.add_argument("--runs", type=int, default=5, help="profiling runs per op; the oracle keeps the minimum (default 5)")
    p.add_argument("--backward-factor", type=float, default=2.0, help="backward op time / forward op time (default 2)")
    p.add_argument("--random-runs", type=int, default=5, help="random orders to compare with (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed for random orders and priority ties")
    p.add_argument("--top", type=int, default=10, help="print the first N of the order (0: all)")
    p.add_argument("--save-dag", help="also write the profiled DAG as JSON")
    p.add_argument("--gantt", help="write a Gantt chart of the multi-worker iteration (.png/.svg)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_order)
    return p
