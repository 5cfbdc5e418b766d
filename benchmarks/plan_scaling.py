"""How long the ``lp`` planner takes to synthesize a schedule, as topologies grow.

Times :func:`gradsync.plan.lp.pack_trees` (the exact multi-tree LP solved by column generation) with
``time.perf_counter()`` on three families of topologies:

* ``builtin``: the named machines ``p3.16xlarge`` (DGX-1), ``p3.8xlarge``, ``p2.16xlarge``, ``p2.8xlarge``,
  ``minsky:4`` and ``switch:64``;
* ``full``: complete graphs ``full:n`` for ``--full-sizes``;
* ``random``: connected random ``--degree``-regular graphs on ``--sizes`` GPUs, link bandwidths drawn
  from {10, 20, 25, 50} GB/s with a seeded RNG (the same graph on every run).

Each case is planned ``--repeats`` times on a freshly built topology (construction is not timed) and the
median is reported. A run that exceeds ``--time-limit`` seconds is interrupted (SIGALRM, where available),
recorded as skipped with the time it had used, and the larger sizes of its family are not attempted.

Goals checked in the summary: DGX-1 (``p3.16xlarge``) in <= 0.1 s; the 64-node random graph and
``full:64`` in <= 2 s each.

Writes ``plan_scaling.json`` and ``plan_scaling.png`` to ``--out`` (default ``benchmarks/results``).

Collectives (issue 14 part 3; ``--collectives``, or ``--collectives-only`` for just these): on DGX-1, 2x8 and
4x8 A100 (NVSwitch + one NIC per GPU on two IB rails, ForestColl's ``a100_topology``), BCube(4,2) and
Fat-Tree(8), the time to plan ``lp`` reduce-scatter and allgather (ForestColl's out-tree packing; through the
automorphism group on the fat tree and BCube, :func:`gradsync.plan.forest.forest_packing`) and to export
them as MSCCL XML, their cost against the cut bound, and allreduce run as reduce-scatter + allgather against
the tree-packing allreduce (algbw = S / time; the trees win where GPUs have unequal bandwidth, p3.8xlarge
75.0 vs 66.7 GB/s). Written to ``plan_collectives.json``. Goals: every case under 10 s, DGX-1 under 0.1 s.

Large fabrics (issue 18: Fat-Trees to 3456 hosts, BCubes to 4096, ForestColl's A100/MI250 files, random graphs
to 512 nodes, in fresh processes with peak memory and certified gaps): ``plan_scaling --fabrics [OPTIONS]``
runs :mod:`benchmarks.plan_fabrics` (``gradsync bench plan-fabrics``); its options follow the flag.

Run from the repository root::

    .venv/bin/python -m benchmarks.plan_scaling
    .venv/bin/python -m benchmarks.plan_scaling --sizes 8,16,32,64 --full-sizes 4,8,16,32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import networkx as nx  # noqa: E402
import numpy as np  # noqa: E402
import scipy  # noqa: E402

from benchmarks.common import TOPOLOGIES, random_regular  # noqa: E402
from gradsync.errors import MscclError  # noqa: E402
from gradsync.plan import PlanOptions, gather_cut_bound, synthesize  # noqa: E402
from gradsync.plan.forest import forest_packing  # noqa: E402
from gradsync.plan.lp import TreePacking, pack_trees  # noqa: E402
from gradsync.plan.msccl import export_msccl  # noqa: E402
from gradsync.topology import Topology, get_topology  # noqa: E402

BUILTINS: tuple[str, ...] = ("p3.16xlarge", "p3.8xlarge", "p2.16xlarge", "p2.8xlarge", "minsky:4", "switch:64")
GOALS: dict[str, float] = {"dgx1_s": 0.1, "nodes64_s": 2.0}
DGX1 = "p3.16xlarge"
RESULT_TYPE = "gradsync.bench.plan_scaling"


class PlanTimeout(Exception):
    """Raised inside a run that has used up its time limit."""


@dataclass
class Case:
    """One measured topology; ``median_s`` etc. are ``None`` when the case was skipped."""

    family: str
    name: str
    nodes: int
    links: int
    devices: int
    median_s: float | None = None
    runs_s: list[float] = field(default_factory=list)
    cost: float | None = None
    lower_bound: float | None = None
    gap: float | None = None
    iterations: int | None = None
    columns: int | None = None
    trees: int | None = None
    skipped: bool = False
    reason: str | None = None


# --------------------------------------------------------------------------- topologies


def parse_sizes(text: str) -> list[int]:
    """``"8,16,32"`` -> ``[8, 16, 32]`` (sorted, de-duplicated, empty string -> [])."""
    sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    if any(s < 2 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be >= 2, got {text!r}")
    return sizes


# --------------------------------------------------------------------------- timing


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`PlanTimeout` in the main thread after ``seconds`` (no-op without SIGALRM)."""
    if not hasattr(signal, "setitimer") or seconds <= 0:
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise PlanTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed_plan(topology: Topology, limit_s: float) -> tuple[float, TreePacking | None]:
    """Seconds spent in ``pack_trees(topology)`` and its result (``None`` when interrupted)."""
    start = time.perf_counter()
    try:
        with time_limit(limit_s):
            result = pack_trees(topology)
    except PlanTimeout:
        return time.perf_counter() - start, None
    return time.perf_counter() - start, result


def fill_result(case: Case, result: TreePacking) -> None:
    case.cost = result.cost
    case.lower_bound = result.lower_bound
    case.gap = (result.cost - result.lower_bound) / result.cost if result.cost > 0 else 0.0
    case.iterations = result.iterations
    case.columns = result.columns
    case.trees = len(result.trees)


def measure(family: str, build: Callable[[], Topology], repeats: int, limit_s: float) -> Case:
    """Plan ``build()`` ``repeats`` times, each on a fresh topology; stop early past ``limit_s``."""
    first = build()
    case = Case(family, first.name, first.world_size, len(first.links), len(first.devices))
    topology: Topology | None = first
    for _ in range(repeats):
        seconds, result = timed_plan(topology or build(), limit_s)
        topology = None
        case.runs_s.append(seconds)
        if result is not None:
            fill_result(case, result)
        if result is None or seconds > limit_s:
            case.skipped = True
            case.reason = f"a run took {seconds:.3g} s, over the {limit_s:g} s limit"
            return case
    case.median_s = statistics.median(case.runs_s)
    return case


# --------------------------------------------------------------------------- reporting


HEADER = f"{'family':<8} {'name':<14} {'nodes':>5} {'links':>6} {'median_s':>10} {'cost':>10} {'lower':>10} {'iters':>5}"


def format_case(case: Case) -> str:
    head = f"{case.family:<8} {case.name:<14} {case.nodes:>5} {case.links:>6}"
    if case.skipped:
        return f"{head} {'SKIPPED':>10}  ({case.reason})"
    return (
        f"{head} {case.median_s:>10.4f} {case.cost:>10.5g} {case.lower_bound:>10.5g} {case.iterations:>5}"
    )


def report(case: Case) -> None:
    print(format_case(case), flush=True)


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "networkx": nx.__version__,
    }


def find(cases: Sequence[Case], family: str, nodes: int | None = None, name: str | None = None) -> Case | None:
    for c in cases:
        if c.family == family and (nodes is None or c.nodes == nodes) and (name is None or c.name == name):
            return c
    return None


def verdict(case: Case | None, goal_s: float) -> str:
    if case is None:
        return "not measured"
    if case.skipped:
        return f"NO (skipped: {case.runs_s[-1]:.3g} s)"
    met = case.median_s is not None and case.median_s <= goal_s
    return f"{'yes' if met else 'NO'} ({case.median_s:.3g} s)"


def summary(cases: Sequence[Case]) -> str:
    dgx1 = find(cases, "builtin", name=DGX1)
    rand64 = find(cases, "random", nodes=64)
    full64 = find(cases, "full", nodes=64)
    return (
        f"SUMMARY: DGX-1 <= {GOALS['dgx1_s']:g} s: {verdict(dgx1, GOALS['dgx1_s'])}; "
        f"random 64-node <= {GOALS['nodes64_s']:g} s: {verdict(rand64, GOALS['nodes64_s'])}; "
        f"full:64 <= {GOALS['nodes64_s']:g} s: {verdict(full64, GOALS['nodes64_s'])}"
    )


def write_json(path: Path, cases: Sequence[Case], config: dict[str, Any]) -> None:
    doc = {
        "type": RESULT_TYPE,
        "machine": machine_info(),
        "config": config,
        "goals": GOALS,
        "cases": [asdict(c) for c in cases],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def case_seconds(case: Case) -> float:
    """The median, or for a skipped case the time its last run used before it was stopped."""
    return case.runs_s[-1] if case.skipped or case.median_s is None else case.median_s


def plot(path: Path, cases: Sequence[Case]) -> None:
    """Log-log seconds vs ranks: a line per scaling family, built-ins as labelled points, goal lines."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {"full": ("tab:blue", "o"), "random": ("tab:orange", "s")}
    for family, (color, marker) in styles.items():
        done = [c for c in cases if c.family == family and not c.skipped]
        if done:
            label = family if family == "full" else f"random {done[0].name.split(':')[0]}"
            ax.plot([c.nodes for c in done], [c.median_s for c in done], marker=marker, color=color, label=label)
        for c in cases:
            if c.family == family and c.skipped:
                ax.scatter([c.nodes], [c.runs_s[-1]], marker="x", s=70, color=color)
                ax.annotate(f"{c.name} > limit", (c.nodes, c.runs_s[-1]), textcoords="offset points",
                            xytext=(5, 5), fontsize=8, color=color)
    builtins = sorted((c for c in cases if c.family == "builtin"), key=lambda c: (c.nodes, case_seconds(c)))
    for i, c in enumerate(builtins):
        y = case_seconds(c)
        # Of several built-ins at the same node count, label the slower one above and the others below.
        above = i > 0 and builtins[i - 1].nodes == c.nodes
        ax.scatter([c.nodes], [y], marker="x" if c.skipped else "D", color="tab:green", zorder=3)
        ax.annotate(c.name, (c.nodes, y), textcoords="offset points", xytext=(6, 4 if above else -11),
                    fontsize=8, color="tab:green")
    if builtins:
        ax.scatter([], [], marker="D", color="tab:green", label="built-in")
    ax.axhline(GOALS["dgx1_s"], ls="--", color="gray", lw=1)
    ax.axhline(GOALS["nodes64_s"], ls="--", color="gray", lw=1)
    ax.text(0.99, GOALS["dgx1_s"], "DGX-1 goal 0.1 s", transform=ax.get_yaxis_transform(), va="bottom",
            ha="right", fontsize=8, color="gray")
    ax.text(0.99, GOALS["nodes64_s"], "64-node goal 2 s", transform=ax.get_yaxis_transform(), va="bottom",
            ha="right", fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("pack_trees time, median (s)")
    ax.set_title("lp planner: schedule synthesis time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- collectives


def a100_boxes(boxes: int) -> Topology:
    """ForestColl's ``a100_topology`` (8 GPUs on an NVSwitch, 300 GB/s, one 25 GB/s NIC each, two IB rails),
    transcribed in ``benchmarks/topologies/a100x{2,4,8}.yaml``."""
    return get_topology(str(TOPOLOGIES / f"a100x{boxes}.yaml"))


COLLECTIVE_CASES: dict[str, Callable[[], Topology]] = {
    "p3.8xlarge": lambda: get_topology("p3.8xlarge"),
    DGX1: lambda: get_topology(DGX1),
    "a100x2": lambda: a100_boxes(2),
    "a100x4": lambda: a100_boxes(4),
    "bcube:4,2": lambda: get_topology("bcube:4,2"),
    "fattree:8": lambda: get_topology("fattree:8"),
}
COLLECTIVE_GOALS = {"dgx1_s": 0.1, "every_s": 10.0}


def measure_collectives(name: str, build: Callable[[], Topology], limit_s: float, repeats: int = 1) -> dict[str, Any]:
    """Plan (a fresh topology each time, so nothing is memoised) and export rs/ag with lp, ``repeats`` times
    each (medians reported, every sample kept); compare the allreduces."""
    out: dict[str, Any] = {"name": name}
    topo = build()
    unit = float(topo.unit_bandwidth_GBps or 1.0)
    total = 0.0
    for collective in ("reduce_scatter", "allgather"):
        plans: list[float] = []
        for i in range(repeats):
            fresh = topo if i == repeats - 1 else build()  # the last run plans the topology used below
            start = time.perf_counter()
            try:
                with time_limit(limit_s):
                    packing = forest_packing(fresh, reverse=collective == "reduce_scatter")
            except PlanTimeout:
                out[collective] = {"skipped": f"over the {limit_s:g} s limit"}
                return out
            plans.append(time.perf_counter() - start)
        schedule = synthesize("lp", topo, PlanOptions(collective=collective))  # memoised packing: builds + checks
        exports: list[float] = []
        for _ in range(repeats):
            start = time.perf_counter()
            try:
                export = export_msccl(schedule, topo)
                msccl: dict[str, Any] = {"msccl_nchunksperloop": export.quantization.nchunksperloop,
                                         "msccl_loss": export.quantization.loss, "msccl_algbw_GBps": export.algbw_GBps}
            except MscclError as exc:  # the executor's limits (thread blocks per GPU) stated, not hidden
                msccl = {"msccl_error": str(exc)}
            exports.append(time.perf_counter() - start)
        plan_s, export_s = statistics.median(plans), statistics.median(exports)
        bound = gather_cut_bound(topo, collective).value
        total += packing.cost
        out[collective] = {"plan_s": plan_s, "export_s": export_s, "plan_samples_s": plans, "export_samples_s": exports,
                           "cost": packing.cost, "cut_bound": bound,
                           "method": packing.method, "iterations": packing.iterations, "trees": len(packing.trees),
                           "algbw_GBps": unit / packing.cost, **msccl}
    trees = pack_trees(topo).cost
    out["allreduce"] = {"rs_plus_ag_algbw_GBps": unit / total, "tree_packing_algbw_GBps": unit / trees}
    return out


def collective_goals_met(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """Issue 14's goals on the medians: DGX-1 plans each collective in under 0.1 s; every case plans and
    exports each in under 10 s (a skipped case misses both)."""
    runs = [(row["name"], row.get(c, {})) for row in rows for c in ("reduce_scatter", "allgather")]
    every = all("plan_s" in r and r["plan_s"] + r["export_s"] < COLLECTIVE_GOALS["every_s"] for _, r in runs)
    dgx1 = [r for name, r in runs if name == DGX1]
    return {"dgx1_s": bool(dgx1) and all("plan_s" in r and r["plan_s"] < COLLECTIVE_GOALS["dgx1_s"] for r in dgx1),
            "every_s": every}


def run_collectives(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    print(f"{'topology':<12} {'coll':<15} {'plan_s':>8} {'export_s':>8} {'cost':>9} {'bound':>9} {'algbw':>8} "
          f"{'K':>4} {'loss':>7}", flush=True)
    for name, build in COLLECTIVE_CASES.items():
        row = measure_collectives(name, build, args.time_limit, args.repeats)
        rows.append(row)
        for c in ("reduce_scatter", "allgather"):
            r = row.get(c, {})
            if "skipped" in r:
                print(f"{name:<12} {c:<15} SKIPPED ({r['skipped']})", flush=True)
            elif r:
                tail = (f"{r['msccl_nchunksperloop']:>4} {r['msccl_loss']:>7.2%}" if "msccl_error" not in r
                        else f"  MSCCL: {r['msccl_error'].split(': ', 1)[-1]}")
                print(f"{name:<12} {c:<15} {r['plan_s']:>8.3f} {r['export_s']:>8.3f} {r['cost']:>9.5g} "
                      f"{r['cut_bound']:>9.5g} {r['algbw_GBps']:>8.4g} {tail}", flush=True)
        if "allreduce" in row:
            a = row["allreduce"]
            print(f"{name:<12} allreduce: rs+ag {a['rs_plus_ag_algbw_GBps']:.4g} GB/s vs tree packing "
                  f"{a['tree_packing_algbw_GBps']:.4g} GB/s", flush=True)
    return rows


# --------------------------------------------------------------------------- main


def run_family(family: str, builders: Sequence[Callable[[], Topology]], args: argparse.Namespace,
               cases: list[Case], stop_on_skip: bool) -> None:
    for build in builders:
        case = measure(family, build, args.repeats, args.time_limit)
        cases.append(case)
        report(case)
        if case.skipped and stop_on_skip:
            print(f"# {family}: stopping after {case.name} (time limit)", flush=True)
            return


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("8,16,32,64,128,256"),
                   help="node counts of the random regular graphs (default 8,16,32,64,128,256)")
    p.add_argument("--full-sizes", type=parse_sizes, default=parse_sizes("4,8,16,32,64"),
                   help="n of the full:n complete graphs (default 4,8,16,32,64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the median is reported (default 3)")
    p.add_argument("--degree", type=int, default=6, help="degree of the random regular graphs (default 6)")
    p.add_argument("--time-limit", type=float, default=120.0,
                   help="seconds a single run may take before the case is skipped (default 120)")
    p.add_argument("--seed", type=int, default=0, help="first seed tried for each random graph (default 0)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    p.add_argument("--collectives", action="store_true",
                   help="also time lp reduce-scatter/allgather planning and MSCCL export (plan_collectives.json)")
    p.add_argument("--collectives-only", action="store_true", help="only the collectives")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--fabrics"]:  # issue 18's large fabrics: benchmarks/plan_fabrics.py, its own options
        from benchmarks.plan_fabrics import main as fabrics_main

        return fabrics_main(argv[1:])
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print(" ".join(f"{k}={v}" for k, v in config.items()), flush=True)
    if args.collectives or args.collectives_only:
        rows = run_collectives(args)
        met = collective_goals_met(rows)
        print("goals (every case under 10 s, DGX-1 under 0.1 s): " + ", ".join(f"{k}: {'met' if v else 'NOT met'}"
                                                                               for k, v in met.items()), flush=True)
        path = args.out / "plan_collectives.json"
        path.write_text(json.dumps({"type": RESULT_TYPE + ".collectives", "machine": machine_info(), "config": config,
                                    "goals": COLLECTIVE_GOALS, "goals_met": met, "cases": rows}, indent=2) + "\n")
        print(f"wrote {path}", flush=True)
        if args.collectives_only:
            return 0
    print(HEADER, flush=True)
    cases: list[Case] = []
    run_family("builtin", [lambda s=s: get_topology(s) for s in BUILTINS], args, cases, stop_on_skip=False)
    run_family("full", [lambda n=n: get_topology(f"full:{n}") for n in args.full_sizes], args, cases, True)
    run_family("random", [lambda n=n: random_regular(n, args.degree, args.seed) for n in args.sizes],
               args, cases, True)
    json_path = args.out / "plan_scaling.json"
    png_path = args.out / "plan_scaling.png"
    write_json(json_path, cases, config)
    plot(png_path, cases)
    print(f"wrote {json_path} and {png_path}", flush=True)
    print(summary(cases), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
