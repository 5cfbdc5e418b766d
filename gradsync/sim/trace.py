"""Chrome trace-event JSON (the format chrome://tracing, Perfetto and torch.profiler's export share).

One writer for both timelines, so a plan's simulation and a run's collectives open side by side:

* :func:`simulation_trace`: a :class:`~gradsync.sim.engine.SimResult`, one complete event (``"ph": "X"``) per
  flow from its first byte on the wire to its last byte received, on process ``rank <src>`` and thread
  ``-> <dst>`` (``gradsync simulate --trace``);
* the runtime's recorder (:mod:`gradsync.comm.trace`) writes its collectives with :func:`write_trace`.

Times are microseconds (the format's unit). Only the fields of the trace-event format are used: ``name``,
``cat``, ``ph``, ``ts``, ``dur``, ``pid``, ``tid``, ``args``, and ``M`` (metadata) events naming processes and
threads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gradsync.sim.engine import SimResult
from gradsync.sim.flows import SimulationError

__all__ = ["complete_event", "into_lanes", "name_event", "simulation_trace", "write_trace"]


def complete_event(name: str, cat: str, ts_us: float, dur_us: float, pid: int, tid: int,
                   args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A complete event (``ph: X``): a span ``[ts, ts + dur]`` on thread ``tid`` of process ``pid``."""
    event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": float(ts_us), "dur": max(0.0, float(dur_us)),
                             "pid": int(pid), "tid": int(tid)}
    if args:
        event["args"] = dict(args)
    return event


def name_event(kind: str, name: str, pid: int, tid: int = 0) -> dict[str, Any]:
    """A metadata event naming a process (``kind="process_name"``) or a thread (``"thread_name"``)."""
    if kind not in ("process_name", "thread_name"):
        raise ValueError(f"kind={kind!r} must be 'process_name' or 'thread_name'")
    return {"name": kind, "ph": "M", "pid": int(pid), "tid": int(tid), "args": {"name": name}}


def into_lanes(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``events`` with every complete event that overlaps an earlier one on its thread moved to a lane of its own
    (a new ``tid``, named ``<thread> #<k>``): viewers draw a thread's spans as a stack, and spans that overlap
    without nesting (a pipelined flow, a native allreduce issued before the last one finished) are dropped or
    misdrawn there."""
    out = [dict(e) for e in events]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in out if e.get("ph") == "M" and e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in out if "tid" in e}
    spans = sorted((e for e in out if e.get("ph") == "X"), key=lambda e: (e["pid"], e["tid"], e["ts"]))
    lanes: dict[tuple[int, int], list[list[float]]] = {}  # (pid, tid) -> per lane [its end, its tid]
    extra: list[dict[str, Any]] = []
    for e in spans:
        key = (e["pid"], e["tid"])
        free = lanes.setdefault(key, [])
        for lane in free:
            if lane[0] <= e["ts"]:
                break
        else:
            tid = key[1] if not free else max(t for p, t in used if p == key[0]) + 1
            if free:
                used.add((key[0], tid))
                extra.append(name_event("thread_name", f"{names.get(key, key[1])} #{len(free)}", key[0], tid))
            lane = [0.0, tid]
            free.append(lane)
        lane[0] = e["ts"] + e["dur"]
        e["tid"] = int(lane[1])
    return extra + out


def write_trace(path: str | Path, events: Iterable[Mapping[str, Any]], metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": metadata}`` to ``path`` (overlapping
    spans of a thread in lanes, :func:`into_lanes`); returns it."""
    out = Path(path)
    if out.suffix.lower() != ".json":
        raise ValueError(f"trace file {str(out)!r} must end in .json (Chrome trace-event JSON)")
    doc = {"traceEvents": into_lanes(events), "displayTimeUnit": "ms", "otherData": dict(metadata or {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc))
    return out


def simulation_trace(result: SimResult, path: str | Path) -> Path:
    """Write ``result``'s flows as a trace: process = sending rank, thread = receiving rank, one span per flow
    (``start_s`` to ``finish_s``), named by the schedule's step; ``args`` hold transfer, tensor, chunk and step."""
    if result.num_flows == 0:
        raise SimulationError(f"simulation of {result.algorithm} on {result.topology} has no flows to trace")
    events: list[dict[str, Any]] = []
    ranks = sorted(set(result.flow_src.tolist()) | set(result.flow_dst.tolist()))
    for r in ranks:
        events.append(name_event("process_name", f"rank {r} (simulated)", r))
    for src, dst in sorted(set(zip(result.flow_src.tolist(), result.flow_dst.tolist()))):
        events.append(name_event("thread_name", f"-> rank {dst}", src, dst))
    for f in range(result.num_flows):
        src, dst, step = int(result.flow_src[f]), int(result.flow_dst[f]), int(result.flow_step[f])
        start, finish = float(result.start_s[f]), float(result.finish_s[f])
        events.append(complete_event(
            f"step {step}: {src}->{dst}", "gradsync.sim", start * 1e6, (finish - start) * 1e6, src, dst,
            {"algorithm": result.algorithm, "transfer": int(result.flow_transfer[f]),
             "tensor": int(result.flow_tensor[f]), "chunk": int(result.flow_chunk[f]), "step": step},
        ))
    meta = {"source": "gradsync simulate", "topology": result.topology, "algorithm": result.algorithm,
            "size_bytes": result.size_bytes, "time_s": result.time_s, "streaming": result.streaming}
    return write_trace(path, events, meta)
