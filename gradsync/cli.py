"""The ``gradsync`` command: topologies, plans and simulations (topo, plan, simulate, bench), runs (run, launch, testbed, demo), transfer ordering (order), compressors (compress) and models.

Choices come from the registries, so ``--help`` lists them. Bad input prints one line
``gradsync: error: ...`` naming the fix and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gradsync.commands.launch import add_parser as add_launch_parser
from gradsync.commands.order import add_parser as add_order_parser
from gradsync.commands.testbed import add_parser as add_testbed_parser
from gradsync.errors import GradsyncError
from gradsync.launch import Terminated
from gradsync.paths import check_output, write_text
from gradsync.plan import SYNTHESIZERS, PlanOptions, Schedule, evaluate, limits, predicted_time, synthesize
from gradsync.sim.cost import plan_auto  # noqa: F401 - registers the "auto" synthesizer before --algorithm's choices
from gradsync.topology import BUILDERS, get_topology, save

__all__ = ["main", "parse_size", "parse_sizes", "DEMO_TOPOLOGIES"]

#: What ``gradsync demo`` plans: one of each built-in family, at sizes a laptop plans in seconds.
DEMO_TOPOLOGIES = (
    "p3.16xlarge", "p3.8xlarge", "p2.16xlarge", "p2.8xlarge", "minsky:2",
    "ring:8", "full:8", "switch:8", "p3.16xlarge[0,1,2,3,7]", "bcube:3,2", "fattree:4",
)
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> float:
    """``548MB``, ``1GiB``, ``4096``, ``1e9`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m[2].upper() not in _UNITS:
        raise GradsyncError(f"cannot read size {text!r}; write bytes like 4096, 548MB or 1GiB")
    value = float(m[1]) * _UNITS[m[2].upper()]
    if value <= 0:
        raise GradsyncError(f"size {text!r} must be positive")
    return value


def parse_sizes(text: str) -> list[float]:
    """``548MB`` -> one buffer; ``4MB,16MB,1MB`` -> a tensor list (per-layer pieces)."""
    parts = [p for p in str(text).split(",")]
    if any(not p.strip() for p in parts):
        raise GradsyncError(f"cannot read sizes {text!r}; write one size (548MB) or a comma-separated list (4MB,16MB)")
    return [parse_size(p) for p in parts]


def _finite(obj: object) -> object:
    """``obj`` with every infinite or NaN float as None: JSON has no Infinity (a one-rank plan's algbw)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _emit_json(obj: object) -> None:
    print(json.dumps(_finite(obj), indent=2, allow_nan=False))


# ---- topo ----------------------------------------------------------------------------------------------
def cmd_topo(args: argparse.Namespace) -> int:
    if args.action == "list":
        for name, entry in BUILDERS.items():
            alias = BUILDERS.aliases_of(name)
            label = entry.example + (f" (alias {', '.join(alias)})" if alias else "")
            print(f"{label:28s} {entry.summary}")
        print("\nAny of these accepts a rank selection, e.g. p3.16xlarge[0,1,2,3,7]; or give a .json/.yaml file.")
        return 0
    if not args.spec:
        raise GradsyncError(f"'gradsync topo {args.action}' needs a topology, e.g. 'gradsync topo {args.action} p3.16xlarge'")
    check_output(args.output, "-o/--output")
    topo = get_topology(args.spec)
    if args.action == "show":
        if args.json:
            _emit_json(topo.to_dict())
        else:
            print(topo.summary())
            print("ranks: " + " ".join(topo.ranks))
            for lk in topo.links:
                print(f"  {lk.a:>10s} -- {lk.b:<10s} {lk.bandwidth_GBps:8.2f} GB/s  {lk.kind}")
        return 0
    if args.action == "export":
        out = Path(args.output or f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', topo.name)}.yaml")
        save(topo, out)
        print(f"wrote {out}")
        return 0
    if args.action == "draw":
        from gradsync.topology.draw import draw

        out = Path(args.output or f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', topo.name)}.png")
        draw(topo, out)
        print(f"wrote {out}")
        return 0
    raise GradsyncError(f"unknown topo action {args.action!r}")  # pragma: no cover - argparse restricts it


# ---- plan ----------------------------------------------------------------------------------------------
#: ``plan`` prices the schedule with the runtime's cost model (an event simulation) only up to this many
#: transfers: on fattree:6 lp (5,724 transfers, 54 concurrent trees) it takes over a minute, 30x the plan.
MAX_RUNTIME_PREDICT_TRANSFERS = 4000


def cmd_plan(args: argparse.Namespace) -> int:
    check_output(args.output, "-o/--output")
    topo = get_topology(args.topology)
    options = PlanOptions(pipeline=args.pipeline, size_bytes=parse_size(args.size), latency_s=args.latency,
                          collective=args.collective)
    if args.chunks_per_loop is not None and args.export != "msccl":
        raise GradsyncError("--chunks-per-loop sets the MSCCL chunk count; use it with --export msccl -o FILE.xml")
    if args.export == "msccl" and not args.output:
        raise GradsyncError("--export msccl needs -o FILE.xml, the MSCCL algorithm file to write")
    schedule = synthesize(args.algorithm, topo, options)
    report = evaluate(schedule, topo, options.size_bytes, options.latency_s)
    export = None
    if args.export == "msccl":
        from gradsync.plan.msccl import export_msccl

        export = export_msccl(schedule, topo, nchunksperloop=args.chunks_per_loop)  # replayed before it is written
    from gradsync.sim.cost import CostModel

    model = CostModel()
    runtime_s = native_s = None
    if schedule.num_transfers <= MAX_RUNTIME_PREDICT_TRANSFERS:  # the event simulator is slow on big multi-tree plans
        runtime_s = model.predict(schedule, topo, options.size_bytes)  # as the runtime executes it
        if schedule.collective == "allreduce":  # the backend's own collective is priced for allreduce only
            native_s = model.predict_native(topo, options.size_bytes)
    if export is not None:
        write_text(args.output, export.xml, "MSCCL algorithm file")
    elif args.output:
        schedule.save(args.output)
    if args.json:
        extra = {"msccl": {**export.to_dict(), "file": args.output}} if export is not None else {}
        _emit_json({**report.to_dict(), "runtime_model": {**model.to_dict(), "time_s": runtime_s, "native_time_s": native_s},
                    **extra})
        return 0
    b = report.limits
    coll = schedule.collective
    what = "" if coll == "allreduce" else f" {coll}"
    print(f"{report.algorithm}{what} on {topo.name}: cost C = {report.cost:.6g} (seed units, unit link "
          f"{report.unit_bandwidth_GBps:g} GB/s)")
    if coll == "allreduce":
        how = "" if b.method == "lp" else " (cut bound only: too many ranks for the LP)"
        print(f"  lower bound {report.lower_bound:.6g}{how} (gap {report.gap:.2%}); cut bound {b.cut:.6g}, "
              f"{b.aggregation_cut:.6g} if switches could aggregate")
    else:
        print(f"  lower bound {report.lower_bound:.6g} (ForestColl's cut bound; gap {report.gap:.2%}), "
              f"{b.aggregation_cut:.6g} if switches could copy or add")
    if b.optimum is not None:
        print(f"  Lemma 2.1: max c_e {b.max_link_cost:.6g} >= C(T_MWST) {b.tree:.6g} >= C(G) {b.optimum:.6g} >= (n-1)/sum 1/c_e {b.sum_bound:.6g}")
    buffer = "" if coll == "allreduce" else " (the full buffer; each rank's shard is 1/N of it)"
    print(f"  {coll} of {report.size_bytes:.6g} B{buffer}: {report.time_s * 1e3:.4g} ms, algbw {report.algbw_GBps:.4g} GB/s")
    if runtime_s is None:
        print(f"  runtime cost model: skipped ({report.transfers} transfers > {MAX_RUNTIME_PREDICT_TRANSFERS}; "
              f"'gradsync simulate --runtime-model' runs it on a plan saved with -o)")
    else:
        native = "" if native_s is None else (f"; torch.distributed.all_reduce (rank-order ring): "
                                              f"{native_s * 1e3:.4g} ms")
        print(f"  runtime cost model (store-and-forward, {model.message_s * 1e6:g} us/message): "
              f"{runtime_s * 1e3:.4g} ms{native}")
    print(f"  {report.chunks} chunks, {report.transfers} transfers, {report.steps} steps, {len(report.trees)} trees")
    print("  link class       links  max busy (C units)  max util  mean util")
    for kind, c in sorted(report.link_classes.items()):
        print(f"  {kind:16s} {c['links']:5d}  {c['max_busy_cost']:18.6g}  {c['max_utilisation']:8.1%}  {c['mean_utilisation']:9.1%}")
    if export is not None:
        q, prog = export.quantization, export.program
        print(f"  MSCCL: {q.nchunksperloop} chunks per loop, {prog.nchannels} channels, up to {export.thread_blocks} "
              f"thread blocks per GPU and {export.max_steps_per_tb} steps per thread block, {export.fused_steps} fused steps")
        print(f"  MSCCL algbw {export.algbw_GBps:.4g} GB/s quantized vs {export.optimal_algbw_GBps:.4g} GB/s planned "
              f"(quantization loss {q.loss:.2%}); runs on buffers whose element count {q.nchunksperloop} divides")
        if export.relayed_transfers:
            print(f"  note: {export.relayed_transfers} transfers are routed through another GPU; MSCCL sends them "
                  f"GPU to GPU and NCCL picks the path")
        ends = {"allreduce": "every GPU ends with the full sum", "reduce_scatter": "every GPU ends with its shard's "
                "full sum", "allgather": "every GPU ends with every shard"}[coll]
        print(f"  MSCCL {export.program.coll} algorithm (replayed: {ends}) written to {args.output}")
    elif args.output:
        print(f"  schedule written to {args.output}")
    return 0


# ---- simulate ------------------------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from gradsync.sim import plot_timeline, simulate

    topo = get_topology(args.topology)
    sizes = parse_sizes(args.size)
    if args.timeline and Path(args.timeline).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise GradsyncError(f"--timeline {args.timeline!r} must end in .png, .svg or .pdf")
    total = sum(sizes)
    if args.latency is not None and not args.latency >= 0:
        raise GradsyncError(f"--latency {args.latency!r} must be >= 0 seconds (per hop)")
    if args.schedule:
        schedule = Schedule.load(args.schedule)
        schedule.check(topo)
    else:
        schedule = synthesize(args.algorithm, topo, PlanOptions(pipeline=args.pipeline, size_bytes=total, latency_s=args.latency))
    if not args.message_s >= 0:
        raise GradsyncError(f"--message-s {args.message_s!r} must be >= 0 seconds")
    if args.runtime_model:
        from gradsync.sim.cost import CostModel

        args.store_and_forward, args.fifo, args.message_s = True, True, CostModel().message_s
    result = simulate(
        schedule, topo, sizes if len(sizes) > 1 else total, streaming=not args.store_and_forward,
        latency_s=args.latency, message_s=args.message_s, merge_tensors=not args.per_tensor, fairness=args.fairness,
        fifo=args.fifo, progress=True if args.progress else None,
    )
    cost = schedule.link_loads(topo).cost(topo.directed_costs)
    planned_s = predicted_time(schedule, topo, total, args.latency, cost=cost)
    if args.timeline:
        plot_timeline(result, args.timeline, by=args.timeline_by)
    if args.json:
        out = result.to_dict()
        out["planned"] = {"cost": cost, "time_s": planned_s, "gst_over_tf": planned_s / result.t_f_s}
        out["sim_over_planned"] = result.time_s / planned_s if planned_s > 0 else None
        if args.timeline:
            out["timeline"] = str(args.timeline)
        _emit_json(out)
        return 0
    mode = "streaming" if result.streaming else "store-and-forward"
    lat = "links' own latency" if args.latency is None else f"latency {args.latency:g} s per hop"
    print(f"{schedule.algorithm} on {topo.name}, {total:.6g} B in {len(sizes)} tensor(s), {mode}, {lat}")
    print(f"  simulated {result.time_s * 1e3:.6g} ms = {result.gst_over_tf:.6g} T_F "
          f"(T_F = {result.t_f_s * 1e3:.6g} ms at {result.unit_bandwidth_GBps:g} GB/s)")
    print(f"  planner   {planned_s * 1e3:.6g} ms = {planned_s / result.t_f_s:.6g} T_F (cost C = {cost:.6g}); "
          f"simulated / planned = {result.time_s / planned_s if planned_s > 0 else float('nan'):.6g}")
    print(f"  {result.num_flows} flows, {result.max_active_flows} active at once, {result.events} events, "
          f"simulated in {result.wall_s:.3g} s")
    print("  link class       links  max util  mean util")
    for kind, c in sorted(result.link_classes().items()):
        print(f"  {kind:16s} {c['links']:5d}  {c['max_utilisation']:8.1%}  {c['mean_utilisation']:9.1%}")
    if args.timeline:
        print(f"  timeline written to {args.timeline}")
    return 0


# ---- bench ---------------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from gradsync.sim.bench import BENCHMARKS

    if not args.name:
        for name, entry in BENCHMARKS.items():
            print(f"{name:16s} {entry.summary}")
        print("\nRun one with 'gradsync bench NAME [its options]'; 'gradsync bench NAME --help' lists them.")
        return 0
    return BENCHMARKS.get(args.name).run(args.args)


# ---- run ----------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from gradsync.launch import check_command, end_on_signals, launch_local, run_launcher, worker_command

    cmd = worker_command(args.cmd, "nothing to run: gradsync run --workers 4 -- python train.py")
    if args.mpi:
        from gradsync.comm.mpi import mpi_available, mpirun_command

        reason = mpi_available()
        if reason:
            raise GradsyncError(f"--mpi: {reason}")
        check_command(cmd)
        with end_on_signals():
            return run_launcher(mpirun_command(args.workers, cmd), timeout=args.timeout)
    env = {"GRADSYNC_TOPOLOGY": args.topology} if args.topology else {}
    with end_on_signals():
        return launch_local(cmd, args.workers, env=env, timeout=args.timeout)


# ---- compress -----------------------------------------------------------------------------------------
def cmd_compress(args: argparse.Namespace) -> int:
    import torch

    from gradsync.compress import COMPRESSORS, create

    shape = (1024, 1024)  # a 4 MiB float32 matrix: the size the ratios are quoted for
    rows = []
    for name, cls in COMPRESSORS.items():
        comp = create(name)
        nbytes = comp.payload_bytes(shape, torch.float32)
        rows.append({"name": name, "aliases": COMPRESSORS.aliases_of(name), "communicator": comp.communicator,
                     "payload_bytes_1Mi_fp32": nbytes, "ratio": 4 * 1024 * 1024 / nbytes,
                     "summary": (cls.__doc__ or "").strip().splitlines()[0]})
    if args.json:
        print(json.dumps({"type": "gradsync.compressors", "rows": rows}, indent=2))
        return 0
    print(f"{'compressor':11s} {'communicator':12s} {'payload':>10s} {'ratio':>7s}  summary (payload for a 1024x1024 fp32 tensor)")
    for r in rows:
        print(f"{r['name']:11s} {r['communicator']:12s} {r['payload_bytes_1Mi_fp32']:10,d} {r['ratio']:7.1f}  {r['summary'][:70]}")
    return 0


# ---- models -------------------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> int:
    from gradsync.models import describe  # imports torch: only when asked

    rows = describe()
    if args.json:
        print(json.dumps({"type": "gradsync.models", "models": rows}, indent=2))
        return 0
    print(f"{'model':10s} {'params':>12s} {'input':>12s} {'classes':>8s}  summary")
    for r in rows:
        shape = "x".join(str(d) for d in r["input_shape"])
        print(f"{r['name']:10s} {r['params']:12,d} {shape:>12s} {r['num_classes']:8d}  {r['summary']}")
    return 0


# ---- demo ----------------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    check_output(args.output, "-o/--output")
    if not args.no_train:
        check_output(args.plot, "--plot")
    size = parse_size(args.size)
    algorithms = [a for a in SYNTHESIZERS.names() if a != "auto"]
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
    print("costs are the seed's C: time of the allreduce in units of sending the buffer once over the unit link.")
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


# ---- parser --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("topo", help="list, show, export or draw a topology")
    t.add_argument("action", choices=["list", "show", "export", "draw"])
    t.add_argument("spec", nargs="?", help="registry name (" + ", ".join(BUILDERS.names()) + ") or a .json/.yaml file")
    t.add_argument("-o", "--output", help="file to write (export: .json/.yaml; draw: .png/.svg)")
    t.add_argument("--json", action="store_true", help="show as JSON")
    t.set_defaults(func=cmd_topo)

    pl = sub.add_parser("plan", help="plan an allreduce (reduce-scatter, allgather) schedule and report its cost, "
                                     "bounds and time")
    pl.add_argument("--topology", "-t", required=True, help="registry spec or .json/.yaml file")
    pl.add_argument("--algorithm", "-a", default="lp", choices=SYNTHESIZERS.names())
    pl.add_argument("--size", default="100MB", help="message size in bytes (e.g. 548MB, 1GiB)")
    pl.add_argument("--latency", type=float, default=None, help="per-hop latency in seconds (default: the links' own)")
    pl.add_argument("--pipeline", type=int, default=1, help="sub-chunks per tree or ring chunk")
    pl.add_argument("--collective", "-c", default="allreduce", metavar="COLLECTIVE",
                    help="allreduce (default), reduce_scatter or allgather (equal shards in rank order, as "
                         "torch.distributed's reduce_scatter_tensor / all_gather_into_tensor)")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.add_argument("-o", "--output", help="also write the schedule as tagged JSON to this file (with --export: the export)")
    pl.add_argument("--export", choices=["msccl"], help="write the schedule for a GPU executor instead: msccl = an "
                    "MSCCL algorithm XML (RCCL/MSCCL, MSCCL_ALGO_DIR), replayed before it is written")
    pl.add_argument("--chunks-per-loop", type=int, default=None,
                    help="MSCCL nchunksperloop (default: the smallest within 1%% of the plan's bandwidth)")
    pl.set_defaults(func=cmd_plan)

    sm = sub.add_parser("simulate", help="simulate a schedule on the flow-level network simulator and compare with the planner")
    sm.add_argument("--topology", "-t", required=True, help="registry spec or .json/.yaml file")
    sm.add_argument("--algorithm", "-a", default="lp", choices=SYNTHESIZERS.names())
    sm.add_argument("--schedule", help="simulate this saved schedule (from 'gradsync plan -o') instead of planning")
    sm.add_argument("--size", default="100MB", help="bytes (548MB, 1GiB) or a tensor list (4MB,16MB,1MB)")
    sm.add_argument("--latency", type=float, default=None, help="per-hop latency in seconds (default: the links' own)")
    sm.add_argument("--store-and-forward", action="store_true", help="a transfer waits for its inputs to finish (default: streaming)")
    sm.add_argument("--message-s", type=float, default=0.0,
                    help="software cost per message in seconds (the runtime's alpha; see gradsync.sim.cost)")
    sm.add_argument("--fifo", action="store_true",
                    help="one message at a time per connection and per receiver (as gloo's one TCP connection per peer)")
    sm.add_argument("--runtime-model", action="store_true",
                    help="simulate as the runtime executes: store-and-forward, --fifo, the cost model's message cost")
    sm.add_argument("--pipeline", type=int, default=1, help="sub-chunks per tree or ring chunk")
    sm.add_argument("--fairness", default="size", choices=["size", "flow"],
                    help="link sharing: max-min fair per byte (default) or per flow")
    sm.add_argument("--per-tensor", action="store_true", help="a flow per (tensor, transfer) instead of merged tensors")
    sm.add_argument("--timeline", help="write a Gantt chart (.png/.svg/.pdf)")
    sm.add_argument("--timeline-by", default="link", choices=["link", "rank"], help="timeline rows (default link)")
    sm.add_argument("--progress", action="store_true", help="progress line on stderr every 2 s (default: only on a terminal)")
    sm.add_argument("--json", action="store_true", help="print one JSON object")
    sm.set_defaults(func=cmd_simulate)

    bn = sub.add_parser("bench", help="list or run a named benchmark", add_help=True)
    bn.add_argument("name", nargs="?", help="benchmark name; leave out to list them")
    bn.add_argument("args", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    bn.set_defaults(func=cmd_bench)

    add_testbed_parser(sub)
    add_launch_parser(sub)
    add_order_parser(sub)

    rn = sub.add_parser("run", help="start N local workers with torchrun's environment (or under mpirun)")
    rn.add_argument("--workers", "-n", type=int, default=2, help="number of worker processes")
    rn.add_argument("--topology", help="sets GRADSYNC_TOPOLOGY, the default topology of gradsync.init()")
    rn.add_argument("--timeout", type=float, default=None, help="kill the workers after this many seconds (exit 124)")
    rn.add_argument("--mpi", action="store_true", help="launch with Open MPI's mpirun instead (for transport='mpi')")
    rn.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run, e.g. -- python train.py")
    rn.set_defaults(func=cmd_run)

    cp = sub.add_parser("compress", help="list the gradient compressors (MergeComp, seed 004)")
    cp.add_argument("action", choices=["list"])
    cp.add_argument("--json", action="store_true", help="print one JSON object")
    cp.set_defaults(func=cmd_compress)

    md = sub.add_parser("models", help="list the model definitions (LeNet-5, ResNet, VGG, Inception)")
    md.add_argument("--json", action="store_true", help="print one JSON object")
    md.set_defaults(func=cmd_models)

    d = sub.add_parser("demo", help="plan every built-in topology, then train LeNet-5 with 4 workers per algorithm")
    d.add_argument("--size", default="100MB")
    d.add_argument("-o", "--output", help="write the table (and training results) as JSON")
    d.add_argument("--no-train", action="store_true", help="only the planning table, no training run")
    d.add_argument("--workers", type=int, default=4, help="local worker processes for the training run")
    d.add_argument("--steps", type=int, default=120, help="training steps per algorithm")
    d.add_argument("--algorithms", default="", help="comma-separated (default: torch.all_reduce, auto and every applicable one)")
    d.add_argument("--plot", default="gradsync-demo.png", help="where to save the training plot (.png/.svg)")
    d.set_defaults(func=cmd_demo)
    return p


def _stdout_closed() -> int:
    """The reader of our output went away (``gradsync plan --json | head``): stop quietly, as a command
    killed by SIGPIPE would, instead of a BrokenPipeError traceback. stdout is pointed at /dev/null so the
    interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (captured in-process): nothing left to flush into
        pass
    return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except GradsyncError as exc:
        print(f"gradsync: error: {exc}", file=sys.stderr)
        return 2
    except Terminated as exc:  # raised by a launcher's signal handler once its children are ended
        print(f"gradsync: {exc}; every process it started was ended", file=sys.stderr)
        return 128 + exc.signum


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
