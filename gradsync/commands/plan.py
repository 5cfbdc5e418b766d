"""``gradsync plan``: synthesize a schedule for a topology and report its cost, bounds and time."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from gradsync.commands._output import emit_json
from gradsync.commands._progress import heartbeat
from gradsync.commands._sizes import parse_size
from gradsync.env import env_number
from gradsync.errors import GradsyncError
from gradsync.paths import check_output, write_text
from gradsync.plan import PlanOptions, evaluate
from gradsync.plan.estimate import PlanEstimate, estimate_plan
from gradsync.plan.synthesizers import SYNTHESIZERS
from gradsync.sim.choose import algorithm_names, synthesize  # every synthesizer, and auto
from gradsync.topology import get_topology

__all__ = ["FORCE_ENV", "MAX_BYTES_ENV", "MAX_SECONDS_ENV", "MAX_PLAN_SECONDS", "MAX_RUNTIME_PREDICT_TRANSFERS",
           "add_parser", "check_estimate", "cmd_plan"]

#: ``plan`` prices the schedule with the runtime's cost model (an event simulation) only up to this many
#: transfers: on fattree:6 lp (5,724 transfers, 54 concurrent trees) it takes far longer than planning did.
MAX_RUNTIME_PREDICT_TRANSFERS = 4000
#: Planning estimated to take longer than this (seconds) is refused unless forced (issue 42).
MAX_PLAN_SECONDS = 600.0
#: Environment overrides: the time limit, the memory limit (default: half the machine's RAM), and force.
MAX_SECONDS_ENV = "GRADSYNC_PLAN_MAX_SECONDS"
MAX_BYTES_ENV = "GRADSYNC_PLAN_MAX_BYTES"
FORCE_ENV = "GRADSYNC_PLAN_FORCE"
#: Planning estimated past this many seconds announces itself on stderr before it starts.
ANNOUNCE_AFTER_S = 3.0


def _env_limit(name: str, default: float) -> float:
    """``name`` as a positive number (the project's one environment reader, :func:`env_number`), else ``default``."""
    value = env_number(name, default, float)
    if not value > 0:
        raise GradsyncError(f"{name}={os.environ.get(name, '').strip()!r} must be > 0; unset it or set e.g. {name}={default:g}")
    return value


def _half_ram() -> float:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2
    except (ValueError, OSError):  # no sysconf: no memory limit beyond the synthesizers' own floor cap
        return float("inf")


def check_estimate(est: PlanEstimate, topology_name: str, *, forced: bool,
                   alternatives: Sequence[PlanEstimate] = ()) -> None:
    """Refuse planning estimated past the memory or time limit, naming the estimate, an algorithm among
    ``alternatives`` that fits in memory (the quickest estimated), and the overrides."""
    if forced:
        return
    max_bytes = _env_limit(MAX_BYTES_ENV, _half_ram())
    max_s = _env_limit(MAX_SECONDS_ENV, MAX_PLAN_SECONDS)
    fitting = sorted((a for a in alternatives if a.algorithm != est.algorithm and a.memory_bytes <= max_bytes),
                     key=lambda a: (a.time_s == 0, a.time_s, a.memory_bytes))  # estimated times first
    if fitting:
        alt = fitting[0]
        took = f", ~{alt.time_s:.3g} s estimated" if alt.time_s else ""
        instead = (f"{alt.algorithm!r} fits (about {alt.memory_bytes / 2**30:.3g} GiB{took}): use --algorithm "
                   f"{alt.algorithm}")
    else:
        instead = "use fewer ranks"
    over = []
    if est.memory_bytes > max_bytes:
        over.append(f"at least {est.memory_bytes / 2**30:.3g} GiB of memory ({est.memory_what}), over the "
                    f"{max_bytes / 2**30:.3g} GiB limit ({MAX_BYTES_ENV}; default half the RAM)")
    if est.time_s > max_s:
        over.append(f"about {est.time_s:.3g} s, over the {max_s:g} s limit ({MAX_SECONDS_ENV})")
    if over:
        raise GradsyncError(f"planning {est.algorithm} on {topology_name} ({est.ranks} ranks) is estimated to take "
                            f"{' and '.join(over)}; {instead}, or plan it anyway with --force (or {FORCE_ENV}=1)")


def _synthesize(args: argparse.Namespace, topo: Any, options: PlanOptions, forced: bool) -> Any:
    """Estimate, refuse past the limits, announce long runs and keep a heartbeat while planning."""
    est = estimate_plan(args.algorithm, topo, options)
    others = [estimate_plan(name, topo, options) for name in SYNTHESIZERS.names()
              if name != args.algorithm and not SYNTHESIZERS.get(name).applicable(topo)]
    check_estimate(est, topo.name, forced=forced, alternatives=others)
    what = f"planning {args.algorithm} on {topo.world_size} ranks"
    if est.time_s > ANNOUNCE_AFTER_S:
        print(f"{what}: ~{est.time_s:.0f} s estimated (a rough bound; gradsync.plan.estimate), memory at least "
              f"{est.memory_bytes / 2**20:.3g} MiB", file=sys.stderr, flush=True)
    with heartbeat(what):
        if forced:
            return synthesize(args.algorithm, topo, options, max_bytes=float("inf"))
        return synthesize(args.algorithm, topo, options)


def cmd_plan(args: argparse.Namespace) -> int:
    check_output(args.output, "-o/--output")
    topo = get_topology(args.topology)
    options = PlanOptions(pipeline=args.pipeline, size_bytes=parse_size(args.size), latency_s=args.latency,
                          collective=args.collective)
    if args.chunks_per_loop is not None and args.export != "msccl":
        raise GradsyncError("--chunks-per-loop sets the MSCCL chunk count; use it with --export msccl -o FILE.xml")
    if args.export == "msccl" and not args.output:
        raise GradsyncError("--export msccl needs -o FILE.xml, the MSCCL algorithm file to write (with --algorithm "
                            "auto: -o DIR, the directory of one algorithm per size range)")
    if args.export == "msccl" and args.algorithm == "auto":
        return _export_sizes(args, topo)
    forced = args.force or os.environ.get(FORCE_ENV, "").strip() not in ("", "0")
    schedule = _synthesize(args, topo, options, forced)
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
        emit_json({**report.to_dict(), "runtime_model": {**model.to_dict(), "time_s": runtime_s, "native_time_s": native_s},
                    **extra})
        return 0
    b = report.limits
    coll = schedule.collective
    what = "" if coll == "allreduce" else f" {coll}"
    print(f"{report.algorithm}{what} on {topo.name}: cost C = {report.cost:.6g} (OMS units: the buffer once over the unit link of "
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


def _export_sizes(args: argparse.Namespace, topo: Any) -> int:
    """``--algorithm auto --export msccl -o DIR``: the fastest algorithm per size range, one replayed file each."""
    import os

    from gradsync.plan.msccl import export_msccl_sizes

    if args.chunks_per_loop is not None or args.collective != "allreduce":
        raise GradsyncError("--algorithm auto --export msccl writes allreduce algorithms with their own chunk counts; "
                            "drop --chunks-per-loop and --collective, or name one --algorithm")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise GradsyncError(f"-o {args.output!r} is a file; with --algorithm auto the export is a directory")
    sized = export_msccl_sizes(topo, largest=max(1 << 12, int(parse_size(args.size))), latency_s=args.latency)
    os.makedirs(args.output, exist_ok=True)
    for e in sized:
        write_text(os.path.join(args.output, e.filename), e.export.xml, "MSCCL algorithm file")
    if args.json:
        emit_json({"topology": topo.name, "directory": args.output,
                   "algorithms": [{"algorithm": e.algorithm, "min_bytes": e.min_bytes, "max_bytes": e.max_bytes,
                                   "file": e.filename, "algbw_GBps": e.export.algbw_GBps,
                                   "predicted_s": e.predicted_s} for e in sized]})
        return 0
    print(f"MSCCL allreduce algorithms for {topo.name} by message size (replayed; the ranges tile every size), "
          f"written to {args.output}:")
    for e in sized:
        top = "no limit" if e.max_bytes == 0 else f"{e.max_bytes} B"
        print(f"  [{e.min_bytes} B, {top}): {e.algorithm:12s} algbw {e.export.algbw_GBps:.4g} GB/s  {e.filename}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to the main CLI's subparsers."""
    pl = subparsers.add_parser("plan", help="plan an allreduce (reduce-scatter, allgather) schedule and report its "
                                            "cost, bounds and time")
    pl.add_argument("--topology", "-t", required=True, help="registry spec or .json/.yaml file")
    pl.add_argument("--algorithm", "-a", default="lp", choices=algorithm_names(),
                    help="the synthesizer: lp (optimal spanning trees), ring, multiring, tree, ps, hierarchical, "
                         "bml, or auto (the least predicted time at --size)")
    pl.add_argument("--size", default="100MB", help="message size in bytes (e.g. 548MB, 1GiB)")
    pl.add_argument("--latency", type=float, default=None, help="per-hop latency in seconds (default: the links' own)")
    pl.add_argument("--pipeline", type=int, default=1, help="sub-chunks per tree or ring chunk")
    pl.add_argument("--collective", "-c", default="allreduce", metavar="COLLECTIVE",
                    help="allreduce (default), reduce_scatter or allgather (equal shards in rank order, as "
                         "torch.distributed's reduce_scatter_tensor / all_gather_into_tensor)")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.add_argument("-o", "--output", help="also write the schedule as tagged JSON to this file (with --export: the export)")
    pl.add_argument("--export", choices=["msccl"], help="write the schedule for a GPU executor instead: msccl = an "
                    "MSCCL algorithm XML (RCCL/MSCCL, MSCCL_ALGO_DIR), replayed before it is written; with "
                    "--algorithm auto, -o is a directory of one algorithm per size range up to --size")
    pl.add_argument("--chunks-per-loop", type=int, default=None,
                    help="MSCCL nchunksperloop (default: the smallest within 1%% of the plan's bandwidth)")
    pl.add_argument("--force", action="store_true", help=f"plan even when the estimate is past the memory or time "
                    f"limit ({MAX_BYTES_ENV}, {MAX_SECONDS_ENV}; also {FORCE_ENV}=1)")
    pl.set_defaults(func=cmd_plan)
    return pl
