"""``gradsync simulate``: run a schedule on the flow-level network simulator and compare it with the planner."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gradsync.commands._output import emit_json
from gradsync.commands._sizes import parse_sizes
from gradsync.errors import GradsyncError
from gradsync.plan import PlanOptions, Schedule, predicted_time
from gradsync.sim.choose import algorithm_names, synthesize  # every synthesizer, and auto
from gradsync.topology import get_topology

__all__ = ["add_parser", "cmd_simulate"]


def cmd_simulate(args: argparse.Namespace) -> int:
    from gradsync.sim import plot_timeline, simulate

    topo = get_topology(args.topology)
    sizes = parse_sizes(args.size)
    if args.timeline and Path(args.timeline).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise GradsyncError(f"--timeline {args.timeline!r} must end in .png, .svg or .pdf")
    if args.trace and Path(args.trace).suffix.lower() != ".json":
        raise GradsyncError(f"--trace {args.trace!r} must end in .json (Chrome trace-event JSON, opens in Perfetto)")
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
    if not args.burst_s >= 0:
        raise GradsyncError(f"--burst-s {args.burst_s!r} must be >= 0 seconds (of tokens at each link's rate)")
    if args.runtime_model:
        from gradsync.sim.cost import CostModel

        args.store_and_forward, args.fifo, args.message_s = True, True, CostModel().message_s
    result = simulate(
        schedule, topo, sizes if len(sizes) > 1 else total, streaming=not args.store_and_forward,
        latency_s=args.latency, message_s=args.message_s, merge_tensors=not args.per_tensor, fairness=args.fairness,
        fifo=args.fifo, burst_s=args.burst_s, progress=True if args.progress else None,
    )
    cost = schedule.link_loads(topo).cost(topo.directed_costs)
    planned_s = predicted_time(schedule, topo, total, args.latency, cost=cost)
    if args.timeline:
        plot_timeline(result, args.timeline, by=args.timeline_by)
    if args.trace:
        from gradsync.sim.trace import simulation_trace

        simulation_trace(result, args.trace)
    if args.json:
        out = result.to_dict()
        out["planned"] = {"cost": cost, "time_s": planned_s, "gst_over_tf": planned_s / result.t_f_s}
        out["sim_over_planned"] = result.time_s / planned_s if planned_s > 0 else None
        if args.timeline:
            out["timeline"] = str(args.timeline)
        if args.trace:
            out["trace"] = str(args.trace)
        emit_json(out)
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
    if args.trace:
        print(f"  trace written to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to the main CLI's subparsers."""
    sm = subparsers.add_parser("simulate", help="simulate a schedule on the flow-level network simulator and compare with the planner")
    sm.add_argument("--topology", "-t", required=True, help="registry spec or .json/.yaml file")
    sm.add_argument("--algorithm", "-a", default="lp", choices=algorithm_names())
    sm.add_argument("--schedule", help="simulate this saved schedule (from 'gradsync plan -o') instead of planning")
    sm.add_argument("--size", default="100MB", help="bytes (548MB, 1GiB) or a tensor list (4MB,16MB,1MB)")
    sm.add_argument("--latency", type=float, default=None, help="per-hop latency in seconds (default: the links' own)")
    sm.add_argument("--store-and-forward", action="store_true", help="a transfer waits for its inputs to finish (default: streaming)")
    sm.add_argument("--message-s", type=float, default=0.0,
                    help="software cost per message in seconds (the runtime's alpha; see gradsync.sim.cost)")
    sm.add_argument("--burst-s", type=float, default=0.0,
                    help="a token bucket per link direction, in seconds of its rate (a shaper's burst; default 0)")
    sm.add_argument("--fifo", action="store_true",
                    help="one message at a time per connection and per receiver (as gloo's one TCP connection per peer)")
    sm.add_argument("--runtime-model", action="store_true",
                    help="simulate as the runtime executes: store-and-forward, --fifo, the cost model's message cost")
    sm.add_argument("--pipeline", type=int, default=1, help="sub-chunks per tree or ring chunk")
    sm.add_argument("--fairness", default="size", choices=["size", "flow"],
                    help="link sharing: max-min fair per byte (default) or per flow")
    sm.add_argument("--per-tensor", action="store_true", help="a flow per (tensor, transfer) instead of merged tensors")
    sm.add_argument("--timeline", help="write a Gantt chart (.png/.svg/.pdf)")
    sm.add_argument("--trace", help="write the flows as a Chrome trace-event .json (Perfetto, chrome://tracing), "
                    "the format of the runtime's GRADSYNC_TRACE")
    sm.add_argument("--timeline-by", default="link", choices=["link", "rank"], help="timeline rows (default link)")
    sm.add_argument("--progress", action="store_true", help="progress line on stderr every 2 s (default: only on a terminal)")
    sm.add_argument("--json", action="store_true", help="print one JSON object")
    sm.set_defaults(func=cmd_simulate)
    return sm
