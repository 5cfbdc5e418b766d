"""Planning thousand-host fabrics (issue 18): ``gradsync bench plan-fabrics`` or ``plan_scaling --fabrics``.

Every case is planned the way ``gradsync plan --topology SPEC --algorithm ALG`` plans it — ``synthesize``
(which includes the schedule's self-check) and ``evaluate`` (loads, cost and the certifying lower bound) — in
a fresh Python process, so the peak resident memory (``ru_maxrss``) is the case's own. Cases:

* Fat-Trees ``fattree:8/12/16/24`` (128 to 3456 hosts) and BCubes ``bcube:8,2/16,2/8,3/16,3`` (64 to 4096);
* ForestColl's GPU fabrics transcribed as files (``benchmarks/topologies/``): 2/4/8 boxes of 8 A100s on an
  NVSwitch with a NIC per GPU on two IB rails, and 1/2/4 boxes of 16 MI250 GCDs (xGMI mesh, one IB switch);
* random 6-regular graphs (``regular6:N``, :func:`benchmarks.common.random_regular`, the same graph on every run)
  on 64 to 512 nodes;
* ``ring`` on ``fattree:16`` (the O(N²) transfers the compact schedule no longer spells out).

``--baseline REV`` plans the same cases, in the same run, with the gradsync of git revision ``REV`` (its
``gradsync/`` alone, extracted to a temporary directory; the benchmark code stays this checkout's), so each speed-up is measured side by side; a baseline case that exceeds
``--baseline-limit`` is recorded as ``> limit``. Cheap cases run up to ``--repeats`` times (median); a case
stops repeating once it has used ``--repeat-budget`` seconds. The published figures of the anchors (TACOS,
ForestColl's Python release) are quoted beside, not re-measured: neither is installable here.

Goals (issue 18): ``fattree:16`` ≤ 30 s, ≤ 1 GB, certified gap ≤ 1 %; ``fattree:24`` or ``bcube:16,3`` ≤ 5
minutes with gap ≤ 1 %; ``regular6:128`` ≤ 1 s and exact; ``ring`` on ``fattree:16`` ≤ 3 s. Writes
``plan_fabrics.json`` and ``plan_fabrics.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT as _ROOT
from benchmarks.common import TOPOLOGIES as FILES

RESULT_TYPE = "gradsync.bench.plan_fabrics"

#: (spec, algorithm); file fabrics are named by their stem and read from :data:`FILES`.
CASES: tuple[tuple[str, str], ...] = (
    ("fattree:8", "lp"), ("fattree:12", "lp"), ("fattree:16", "lp"), ("fattree:24", "lp"),
    ("bcube:8,2", "lp"), ("bcube:16,2", "lp"), ("bcube:8,3", "lp"), ("bcube:16,3", "lp"),
    ("a100x2", "lp"), ("a100x4", "lp"), ("a100x8", "lp"),
    ("mi250x1", "lp"), ("mi250x2", "lp"), ("mi250x4", "lp"),
    ("regular6:64", "lp"), ("regular6:128", "lp"), ("regular6:256", "lp"), ("regular6:512", "lp"),
    ("fattree:16", "ring"),
)
GOALS: dict[str, float] = {"fattree16_s": 30.0, "fattree16_mb": 1024.0, "gap": 0.01, "large_s": 300.0,
                           "regular128_s": 1.0, "ring_fattree16_s": 3.0}
#: Published figures, quoted (not measured here).
ANCHORS: tuple[dict[str, Any], ...] = (
    {"who": "TACOS", "ranks": 128, "seconds": 1.08, "certified": False, "note": "all-reduce synthesis, 128 NPUs"},
    {"who": "TACOS", "ranks": 512, "seconds": 360.0, "certified": False, "note": "about 6 minutes, 512 NPUs"},
    {"who": "TACOS", "ranks": 40000, "seconds": 9000.0, "certified": False, "note": "2.5 hours, 40K NPUs"},
    {"who": "ForestColl (Python)", "ranks": 64, "seconds": 240.0, "certified": True, "note": "> 240 s for 64 A100s"},
)


# --------------------------------------------------------------------------- the worker (one case, one process)
def build(spec: str):  # noqa: ANN201 - a Topology; imported lazily so --help stays fast
    from gradsync.topology import get_topology

    if spec.startswith("regular6:"):
        from benchmarks.common import random_regular

        return random_regular(int(spec.split(":")[1]), 6, 0)
    path = FILES / f"{spec}.yaml"
    return get_topology(str(path) if path.exists() else spec)


def plan_once(spec: str, algorithm: str) -> dict[str, Any]:
    """Plan and evaluate one case as ``gradsync plan`` does; the numbers the table and the plot need."""
    from gradsync.plan import evaluate, synthesize

    topo = build(spec)
    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    schedule = synthesize(algorithm, topo)
    t1 = time.perf_counter()
    report = evaluate(schedule, topo, 1e8)
    t2 = time.perf_counter()
    num = getattr(schedule, "num_transfers", None)
    return {
        "spec": spec, "algorithm": algorithm, "ranks": topo.world_size, "devices": len(topo.devices),
        "links": len(topo.links), "plan_s": t1 - t0, "bound_s": t2 - t1, "total_s": t2 - t0,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "base_mb": base_mb,
        "cost": report.cost, "lower_bound": report.lower_bound, "gap": report.gap,
        "bound_method": report.limits.method, "trees": len(schedule.trees),
        "transfers": num if num is not None else len(schedule.transfers),
        "method": dict(schedule.meta).get("method"),
    }


# --------------------------------------------------------------------------- the driver
def run_case(spec: str, algorithm: str, limit_s: float, pythonpath: Path, repeats: int, budget_s: float) -> dict[str, Any]:
    """Median over up to ``repeats`` fresh processes (fewer once ``budget_s`` is used); skipped past ``limit_s``.

    ``pythonpath`` holds the ``gradsync`` to plan with (this checkout, or a baseline's); the checkout root follows
    it, for the ``benchmarks`` package."""
    path = os.pathsep.join(dict.fromkeys([str(pythonpath), str(_ROOT)]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    runs: list[dict[str, Any]] = []
    used = 0.0
    while len(runs) < repeats and (not runs or used < budget_s):
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--worker", spec, algorithm], env=env, cwd=_ROOT,
                               capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return {"spec": spec, "algorithm": algorithm, "skipped": f"> {limit_s:g} s", "total_s": None}
        used += time.perf_counter() - t0
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            return {"spec": spec, "algorithm": algorithm, "skipped": f"failed: {tail}", "total_s": None}
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    out = dict(runs[len(runs) // 2])
    for key in ("plan_s", "bound_s", "total_s"):
        out[key] = statistics.median(r[key] for r in runs)
    out["runs_s"] = [r["total_s"] for r in runs]
    out["peak_mb"] = max(r["peak_mb"] for r in runs)
    return out


def baseline_tree(rev: str) -> Path:
    """``rev``'s ``gradsync/`` package alone, in a temporary directory (removed at exit by the caller): on a worker's
    ``PYTHONPATH`` ahead of the checkout it supplies ``gradsync``, while ``benchmarks`` stays this checkout's."""
    where = Path(tempfile.mkdtemp(prefix="gradsync-baseline-"))
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "gradsync"], cwd=_ROOT, check=True,
                             capture_output=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(where)
    return where


def _fmt(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row.get("skipped"):
        return str(row["skipped"])
    return f"{row['total_s']:.3g} s {row['peak_mb']:.0f} MB gap {row['gap']:.2%}"


def goals(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per issue-18 goal, met or NOT met, with the figure."""
    by = {(r["spec"], r["algorithm"]): r for r in rows}

    def ok(key: tuple[str, str], seconds: float, mb: float | None = None, gap: float | None = None) -> tuple[bool, str]:
        r = by.get(key)
        if r is None or r.get("skipped"):
            return False, "not planned" if r is None else str(r["skipped"])
        met = r["total_s"] <= seconds and (mb is None or r["peak_mb"] <= mb) and (gap is None or r["gap"] <= gap)
        return met, _fmt(r)

    lines = []
    met, text = ok(("fattree:16", "lp"), GOALS["fattree16_s"], GOALS["fattree16_mb"], GOALS["gap"])
    lines.append(f"fattree:16 lp <= 30 s, <= 1 GB, gap <= 1%: {'met' if met else 'NOT met'} ({text})")
    big = [ok((s, "lp"), GOALS["large_s"], None, GOALS["gap"]) for s in ("fattree:24", "bcube:16,3")]
    lines.append(f"fattree:24 or bcube:16,3 <= 5 min, gap <= 1%: {'met' if any(m for m, _ in big) else 'NOT met'} "
                 f"(fattree:24 {big[0][1]}; bcube:16,3 {big[1][1]})")
    met, text = ok(("regular6:128", "lp"), GOALS["regular128_s"], None, 1e-6)
    lines.append(f"regular6:128 <= 1 s, exact: {'met' if met else 'NOT met'} ({text}; TACOS 1.08 s, uncertified)")
    met, text = ok(("fattree:16", "ring"), GOALS["ring_fattree16_s"])
    lines.append(f"fattree:16 ring <= 3 s: {'met' if met else 'NOT met'} ({text})")
    return lines


def plot(path: Path, rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = {"fattree": "tab:blue", "bcube": "tab:orange", "a100x": "tab:green", "mi250x": "tab:red",
                "regular6": "tab:purple"}
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    for fam, color in families.items():
        for series, marker, fill in ((rows, "o", True), (base, "s", False)):
            pts = sorted((r["ranks"], r["total_s"]) for r in series if r["spec"].startswith(fam) and r["algorithm"] == "lp"
                         and not r.get("skipped") and r.get("ranks"))
            if pts:
                label = f"{fam} lp" + ("" if fill else " (baseline)")
                ax.plot(*zip(*pts), marker=marker, color=color, ls="-" if fill else ":", label=label,
                        mfc=color if fill else "none")
    for a in ANCHORS:
        ax.scatter([a["ranks"]], [a["seconds"]], marker="*", s=120, color="black", zorder=3)
        ax.annotate(f"{a['who']}", (a["ranks"], a["seconds"]), textcoords="offset points", xytext=(5, -10), fontsize=7)
    for key, y in (("30 s (fattree:16)", GOALS["fattree16_s"]), ("5 min (3456-4096 hosts)", GOALS["large_s"])):
        ax.axhline(y, ls="--", color="gray", lw=1)
        ax.text(0.01, y, f"goal {key}", transform=ax.get_yaxis_transform(), va="bottom", fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("plan + bound time (s), fresh process")
    ax.set_title("gradsync lp planning on large fabrics (stars: published anchors, not certified except ForestColl)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gradsync bench plan-fabrics", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    p.add_argument("--cases", default=None,
                   help="comma-separated SPEC/ALG (e.g. fattree:16/lp,regular6:128/lp); default: all of CASES")
    p.add_argument("--limit", type=float, default=600.0, help="seconds one case may take (default 600)")
    p.add_argument("--baseline", default=None, help="git revision to plan the same cases with, side by side")
    p.add_argument("--baseline-limit", type=float, default=120.0, help="seconds one baseline case may take (default 120)")
    p.add_argument("--repeats", type=int, default=3, help="runs of a cheap case; the median is reported (default 3)")
    p.add_argument("--repeat-budget", type=float, default=20.0, help="stop repeating a case after this many seconds")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "ALG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} must be >= 1")
    return args


def _selected(text: str | None) -> list[tuple[str, str]]:
    if text is None:
        return list(CASES)
    out = []
    for item in text.split(","):
        spec, _, alg = item.strip().rpartition("/")
        if not spec or not alg:
            raise SystemExit(f"gradsync bench plan-fabrics: error: --cases item {item!r} must be SPEC/ALG, e.g. fattree:16/lp")
        out.append((spec, alg))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        print(json.dumps(plan_once(*args.worker)))
        return 0
    cases = _selected(args.cases)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []
    tree = baseline_tree(args.baseline) if args.baseline else None
    try:
        for i, (spec, alg) in enumerate(cases, 1):
            row = run_case(spec, alg, args.limit, _ROOT, args.repeats, args.repeat_budget)
            rows.append(row)
            old = None
            if tree is not None:
                old = run_case(spec, alg, args.baseline_limit, tree, args.repeats, args.repeat_budget)
                base.append(old)
            print(f"[{i}/{len(cases)}] {spec:14s} {alg:5s} now: {_fmt(row):34s} baseline: {_fmt(old)}", flush=True)
    finally:
        if tree is not None:
            shutil.rmtree(tree, ignore_errors=True)
    lines = goals(rows)
    doc = {"type": RESULT_TYPE, "machine": {"python": sys.version.split()[0], "cpus": os.cpu_count(),
                                            "load": os.getloadavg()},
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
           "goals": GOALS, "summary": lines, "anchors": list(ANCHORS), "cases": rows, "baseline": base}
    (args.out / "plan_fabrics.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(args.out / "plan_fabrics.png", rows, base)
    print(f"wrote {args.out / 'plan_fabrics.json'} and {args.out / 'plan_fabrics.png'}")
    for line in lines:
        print("SUMMARY:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
