"""``gradsync plan``: synthesize a schedule for a topology and report its cost, bounds and time."""

from __future__ import annotations

import argparse
from typing import Any

from gradsync.commands._output import emit_json
from gradsync.commands._sizes import parse_size
from gradsync.errors import GradsyncError
from gradsync.paths import check_output, write_text
from gradsync.plan import PlanOptions, evaluate
from gradsync.sim.choose import algorithm_names, synthesize  # every synthesizer, and auto
from gradsync.topology import get_topology

__all__ = ["MAX_RUNTIME_PREDICT_TRANSFERS", "add_parser", "cmd_plan"]

#: ``plan`` prices the schedule with the runtime's cost model (an event simulation) only up to this many
#: transfers: on fattree:6 lp (5,724 transfers, 54 concurrent trees) it takes far longer than planning did.
MAX_RUNTIME_PREDICT_TRANSFERS = 4000


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
    pl.set_defaults(func=cmd_plan)
    return pl
