"""Does ``compression="auto"`` ever lose? ``gradsync bench compression-sweep`` (issue 40 part 3).

The grid: 3 link rates (:data:`RATES`, from bandwidth-bound to compute-bound on 2 cores) x 2 fabrics
(:data:`FABRICS`: ``switch:4``, and ``benchmarks/fabrics/two-tier-4to1.yaml``, two racks of three whose 1 GB/s
uplink -- its unit link -- runs at the rate and its NICs at 4x) x 3 models (LeNet-5, ResNet-18 at 32x32, an MLP
of large dense matrices) x 2 paths (``DistributedOptimizer`` and the DDP hook) = 36 configurations. Per fabric and
rate the testbed comes up once, a few pairs are probed (the probe is the runtime's cost model), and one worker
(``benchmarks/compression_sweep_worker.py``) runs the six configurations of that cell in turn. In each, every
method trains from the same weights on the same batches in the same processes, alternating step by step:
``ddp`` (torch's DDP), ``none`` (the path's own uncompressed exchange), the fixed codecs ``fp16``,
``powersgd-r1``, ``topk-1%``, ``efsignsgd``, ``qsgd`` (those ``auto`` chooses from, same parameters) and ``auto``
(``--allow``, default ``any``).

Per configuration: each method's median step time (slowest rank per step, after ``--warmup`` untimed steps and any
more while ``auto`` is still choosing, up to 50: its settled pace; as many steps are then timed as ``--steps`` less
``--warmup``), the test accuracy and loss after the same ``--steps`` (and after the last), and ``auto`` against the
best fixed method its policy allows ("none" and DDP included) and against DDP, each as the median of the per-step
paired ratios ``other / auto`` (> 1: auto is faster) with a 95 % interval: a percentile bootstrap of that median
(2,000 resamples, seeded) over the paired steps (``--steps``, and more while the configuration stays inside
``--budget-s`` at its pace, up to ``--max-steps``: quick configurations, whose steps spread the most for their
length, get the most pairs); also against ``none`` alone (the uncompressed exchange of the same path). Choosing's cost: the share of
``auto``'s first ``min(steps, 50)`` steps beyond its settled pace (the mean of its timed steps), less the same
excess of ``ddp`` (``none`` where DDP was not run): the one-time costs of starting a job that are not choosing
(first allocations and collectives, DDP's bucket rebuild), paid by the run a user would make without ``auto``. Beside it, the same share less the
quickest fixed gradsync codec's excess instead (``choose_share_vs_fixed``): that codec pays the same runtime start-up
(plans priced and explored), so the rest is what choosing codecs and a partition costs. The
issue's goals are checked: the interval's lower bound >= 0.97 everywhere; >= 1.3x DDP where the wire is the
bottleneck (DDP's median at least :data:`WIRE_BOUND` x the fastest method's); accuracy within 0.5 points of DDP's
for ``allow="cast"`` (what ``"any"`` costs is reported); choosing <= 2 %.

Writes ``compression_sweep.json`` (rewritten after every cell, so a stopped sweep keeps what it measured) and
``compression_sweep.png`` (heat maps: auto / best fixed and auto / DDP per configuration) to ``--out``.
``--quick``: one configuration (LeNet-5, optimizer path), 8 steps, 2 local processes on gloo over loopback, no
testbed and no root: it checks the machinery in seconds, not the goals. The full sweep needs root::

    sudo gradsync bench compression-sweep          # 36 configurations, about 2 hours on 2 cores (see below)
    gradsync bench compression-sweep --quick       # seconds, no root

Duration of the default full sweep (30 steps, 8 methods): the 100 Mbit/s cells dominate. ResNet-18's 45 MB of
gradient takes ~5.4 s a dense step on switch:4 (ring: 1.5 x 45 MB at 12.5 MB/s) for ``ddp`` and ``none`` and
~2.7 s for fp16, ~10 s a step of all methods with compute; the MLP's 25 MB about half that; so ~10 min per
configuration there, ~45 min for the 100 Mbit/s cells of both fabrics, ~15 min for 1 Gbit/s, and the compute-bound
10 Gbit/s cells (~2 s a step of all methods for ResNet-18 on 4-6 ranks sharing 2 cores) ~20 min: about 1.5-2.5 hours
with testbed set-up and probes. ``--budget-s`` (45 s a configuration by default) adds steps only where a
configuration's ``--steps`` took less: LeNet-5's (tens of milliseconds a step) run to ``--max-steps``.
A configuration where ``auto`` chooses past ``--warmup`` runs that many steps more before it is timed (up to 50 in
all), and then its ``--steps`` less ``--warmup``: on the two-tier file at 300 Mbit/s the MLP's optimizer chose until
step 25-50 in single runs, most of it its runtime's explorers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT as _ROOT
from benchmarks.common import code_revision, pythonpath
from gradsync.errors import GradsyncError

RESULT_TYPE = "gradsync.bench.compression_sweep"
RATES = ("100mbit", "1gbit", "10gbit")
#: name -> what ``testbed.up`` and ``gradsync.init`` take
FABRICS = {"switch:4": "switch:4", "two-tier-4to1": str(_ROOT / "benchmarks" / "fabrics" / "two-tier-4to1.yaml")}
MODEL_NAMES = ("lenet5", "resnet18", "mlp")
PATH_NAMES = ("optimizer", "hook")
#: Issue 40's goals.
GOAL_VS_BEST_LOW = 0.97
GOAL_VS_DDP = 1.3
GOAL_ACCURACY_POINTS = 0.5
GOAL_CHOOSE_SHARE = 0.02
#: A configuration is wire-bound when DDP's median step is at least this many times the fastest method's.
WIRE_BOUND = 2.0
#: Methods that are neither ``auto`` nor a codec of the policy, always in the "best fixed" pool.
UNCOMPRESSED = ("ddp", "none")
INTERVAL = ("percentile bootstrap (2000 resamples, seed 0) of the median of the per-step paired ratios other / auto "
            "(> 1: auto is faster)")
PROBE_PAIRS = ((0, 1), (0, 3))
QUICK = {"models": "lenet5", "paths": "optimizer", "steps": 8, "warmup": 4, "probe_steps": 1, "budget_s": 0.0,
         "max_steps": 0}


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    from benchmarks.compression_sweep_worker import MODELS, PATHS, method_names
    from gradsync.compress.auto import POLICIES

    p = argparse.ArgumentParser(prog="gradsync bench compression-sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default=",".join(RATES), help=f"comma-separated tc rates (default {','.join(RATES)})")
    p.add_argument("--fabrics", default=",".join(FABRICS), help=f"comma-separated, of {list(FABRICS)}")
    p.add_argument("--models", default=None, help=f"comma-separated, of {MODELS.names()} (default all; --quick lenet5)")
    p.add_argument("--paths", default=None, help=f"comma-separated, of {PATHS.names()} (default both; --quick optimizer)")
    p.add_argument("--methods", default=",".join(method_names()), help="comma-separated; 'auto' is always run")
    p.add_argument("--allow", default="any", choices=sorted(POLICIES), help="auto's policy (default any)")
    p.add_argument("--steps", type=int, default=None, help="steps per configuration (default 30; --quick 8)")
    p.add_argument("--warmup", type=int, default=None, help="leading steps not timed (default 8; --quick 4)")
    p.add_argument("--probe-steps", type=int, default=None, help="auto's timed launches per codec (default 2; --quick 1)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds a configuration may run: after --steps, more steps while it fits, for narrower "
                        "intervals where steps are quick (default 45; --quick 0: exactly --steps)")
    p.add_argument("--max-steps", type=int, default=None, help="the most steps --budget-s runs to (default 300)")
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--quick", action="store_true", help="one configuration, 8 steps, loopback: checks the machinery")
    p.add_argument("--loopback", action="store_true", help="no testbed: --procs local processes on gloo over loopback")
    p.add_argument("--procs", type=int, default=2, help="loopback processes (default 2)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="testbed: skip gradsync.init(calibrate=True)")
    p.add_argument("--share-runtime", action="store_true",
                   help="every method and configuration of a cell on one runtime, as before: a size class one "
                        "method's calls explored runs settled for the others (default: one runtime each)")
    p.add_argument("--timeout", type=float, default=14400.0, help="seconds one cell's workers may run (default 14400)")
    p.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results" / "compression_sweep")
    args = p.parse_args(argv)
    quick = QUICK if args.quick else {"models": ",".join(MODEL_NAMES), "paths": ",".join(PATH_NAMES), "steps": 30,
                                      "warmup": 8, "probe_steps": 2, "budget_s": 45.0, "max_steps": 300}
    for key, value in quick.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.loopback = args.loopback or args.quick

    def names(text: str, known: Sequence[str], what: str) -> list[str]:
        got = [n for n in text.split(",") if n]
        bad = [n for n in got if n not in known]
        if bad or not got:
            p.error(f"--{what} {text!r}: unknown {bad}; choose from {list(known)}")
        return got

    args.model_list = names(args.models, MODELS.names(), "models")
    args.path_list = names(args.paths, PATHS.names(), "paths")
    args.fabric_list = names(args.fabrics, list(FABRICS), "fabrics")
    args.method_list = names(args.methods, method_names(), "methods")
    if "auto" not in args.method_list:
        args.method_list.append("auto")
    args.rate_list = [r for r in args.rates.split(",") if r]
    if not args.rate_list:
        p.error("--rates: give at least one rate, e.g. 100mbit")
    if not 0 <= args.warmup < args.steps:
        p.error(f"need 0 <= --warmup ({args.warmup}) < --steps ({args.steps})")
    if args.budget_s < 0 or (args.max_steps and args.max_steps < args.steps):
        p.error(f"need --budget-s >= 0 (got {args.budget_s:g}) and --max-steps 0 or >= --steps ({args.steps}), "
                f"got {args.max_steps}")
    if args.probe_steps < 1 or args.batch < max(2, args.procs) or args.lr <= 0 or args.timeout <= 0:
        p.error("need --probe-steps >= 1, --batch >= the number of ranks, --lr > 0 and --timeout > 0")
    if args.loopback and args.procs < 2:
        p.error(f"--procs {args.procs}: need at least 2 processes")
    return args


# ---- the arithmetic (pure) -----------------------------------------------------------------------------------

def compare(auto: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """``other`` against ``auto``, step by step: the median of ``other[i] / auto[i]``, its bootstrap 95 % interval
    and the ratio of the medians (> 1: auto is faster)."""
    from gradsync.sim.bench import bootstrap_median_ci, paired_ratios

    ratios = paired_ratios(other, auto)
    low, high = bootstrap_median_ci(ratios)
    return {"median": statistics.median(ratios), "ci95": [low, high],
            "ratio_of_medians": statistics.median(other) / statistics.median(auto), "pairs": len(ratios)}


def fixed_pool(methods: Sequence[str], allow: str) -> list[str]:
    """The fixed methods ``auto`` is held against: DDP, "none", and each codec the policy allows."""
    import torch

    from gradsync.compress.auto import allowed

    permitted = {o.name for o in allowed(allow, torch.float32)}
    return [m for m in methods if m != "auto" and (m in UNCOMPRESSED or m in permitted)]


def _excess(row: dict[str, Any], n: int) -> float:
    """Seconds a method's first ``n`` steps took beyond ``n`` steps at its settled pace, the mean of its timed steps
    (a median would charge the steps' right skew -- a slow step now and then -- to the first ones)."""
    return sum(row["first_steps_s"][:n]) - n * statistics.fmean(row["samples_s"])


def summarize_config(config: dict[str, Any], allow: str) -> dict[str, Any]:
    """One configuration's verdict: the best fixed method, auto against it and against DDP (and against DDP with torch's
    own hook, the worker's ``ANCHOR``, where it ran), accuracy, choosing."""
    from benchmarks.compression_sweep_worker import ANCHOR

    rows = config["methods"]
    auto = rows["auto"]
    pool = fixed_pool(list(rows), allow)
    best = min(pool, key=lambda m: rows[m]["median_s"])
    fastest = min(r["median_s"] for r in rows.values())
    ddp, none = rows.get("ddp"), rows.get("none")
    first = auto["first_steps_s"]
    choose, ref_name = None, None
    if first:
        extra = _excess(auto, len(first))  # beyond its settled pace: choosing, and the job's one-time costs
        ref_name = next((m for m in ("ddp", "none") if m in rows and len(rows[m]["first_steps_s"]) == len(first)), None)
        if ref_name is not None:  # the one-time costs a job pays without choosing
            extra -= _excess(rows[ref_name], len(first))
        choose = extra / sum(first)
    # the same excess of the quickest fixed codec on gradsync's runtime: its start-up (plans priced and explored) is
    # the same, so what auto spends beyond it is the choosing of codecs and partition alone
    own = sorted((m for m in pool if m not in ("ddp", ANCHOR) and len(rows[m]["first_steps_s"]) == len(first)),
                 key=lambda m: rows[m]["median_s"])
    fixed_ref = own[0] if first and own else None
    choose_fixed = None if fixed_ref is None else (
        (_excess(auto, len(first)) - _excess(rows[fixed_ref], len(first))) / sum(first))
    acc = auto.get("accuracy")
    return {
        "model": config["model"], "path": config["path"], "parameters": config["parameters"],
        "medians_s": {m: r["median_s"] for m, r in rows.items()},
        "accuracy": {m: r.get("accuracy") for m, r in rows.items()},
        "accuracy_steps": config.get("accuracy_steps"),
        "accuracy_final": {m: r.get("accuracy_final") for m, r in rows.items()},
        "test_loss": {m: r.get("test_loss") for m, r in rows.items()},
        "replicas_identical": all(r["replicas_identical"] for r in rows.values()),
        "best_fixed": best, "auto_vs_best": compare(auto["samples_s"], rows[best]["samples_s"]),
        "auto_vs_ddp": compare(auto["samples_s"], ddp["samples_s"]) if ddp else None,
        "auto_vs_none": compare(auto["samples_s"], none["samples_s"]) if none else None,
        "auto_vs_anchor": compare(auto["samples_s"], rows[ANCHOR]["samples_s"]) if ANCHOR in rows else None,
        "anchor_vs_ddp": compare(rows[ANCHOR]["samples_s"], ddp["samples_s"]) if ANCHOR in rows and ddp else None,
        "wire_bound": bool(ddp) and ddp["median_s"] >= WIRE_BOUND * fastest,
        "accuracy_points_vs_ddp": 100 * (acc - ddp["accuracy"]) if ddp and acc is not None
        and ddp.get("accuracy") is not None else None,
        "timed_from": config.get("timed_from"),
        "choose_share": choose, "choose_steps": len(first), "choose_reference": ref_name,
        "choose_share_vs_fixed": choose_fixed, "choose_fixed_reference": fixed_ref,
        "auto_codecs": auto.get("stats", {}).get("codecs"),
        "auto_choosing_steps": auto.get("choosing_steps"),
    }


def goals(rows: Sequence[dict[str, Any]], allow: str) -> dict[str, Any]:
    """The issue's goals over every configuration summarized."""
    lows = [r["auto_vs_best"]["ci95"][0] for r in rows]
    bound = [r for r in rows if r["wire_bound"] and r["auto_vs_ddp"]]
    gaps = [r["accuracy_points_vs_ddp"] for r in rows if r["accuracy_points_vs_ddp"] is not None]
    shares = [r["choose_share"] for r in rows if r["choose_share"] is not None]
    fixed = [r["choose_share_vs_fixed"] for r in rows if r.get("choose_share_vs_fixed") is not None]
    out = {
        "never_loses": {"worst_ci_low": min(lows) if lows else None, "goal": GOAL_VS_BEST_LOW,
                        "met": bool(lows) and min(lows) >= GOAL_VS_BEST_LOW},
        "wire_bound_vs_ddp": {"configs": len(bound), "worst": min((r["auto_vs_ddp"]["median"] for r in bound),
                                                                  default=None), "goal": GOAL_VS_DDP,
                              "met": all(r["auto_vs_ddp"]["median"] >= GOAL_VS_DDP for r in bound)},
        "accuracy_points_vs_ddp": {"worst": min(gaps) if gaps else None, "goal": -GOAL_ACCURACY_POINTS,
                                   "applies": allow == "cast",
                                   "met": allow != "cast" or all(g >= -GOAL_ACCURACY_POINTS for g in gaps)},
        "choose_share": {"worst": max(shares) if shares else None, "goal": GOAL_CHOOSE_SHARE,
                         "met": all(s <= GOAL_CHOOSE_SHARE for s in shares)},
        # reported beside the goal: the share less the start-up a fixed codec on gradsync's runtime pays too
        "choose_share_vs_fixed": {"worst": max(fixed) if fixed else None},
        "replicas_identical": all(r["replicas_identical"] for r in rows),
    }
    out["met"] = out["replicas_identical"] and all(out[k]["met"] for k in
                                                   ("never_loses", "wire_bound_vs_ddp", "accuracy_points_vs_ddp",
                                                    "choose_share"))
    return out


def summary_lines(rows: Sequence[dict[str, Any]], g: dict[str, Any], allow: str) -> list[str]:
    lines = []
    for r in rows:
        b, d = r["auto_vs_best"], r["auto_vs_ddp"]
        acc = r["accuracy_points_vs_ddp"]
        lines.append(f"{r['where']:>24} {r['model'] + '/' + r['path']:<18} auto/best fixed ({r['best_fixed']}) "
                     f"x{b['median']:.3f} [{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]"
                     + (f", vs DDP x{d['median']:.2f}" if d else "")
                     + (f", vs none x{r['auto_vs_none']['median']:.2f}" if r["auto_vs_none"] else "")
                     + (f", vs DDP with torch's allreduce_hook x{a_['median']:.3f} [{a_['ci95'][0]:.3f}, "
                        f"{a_['ci95'][1]:.3f}] (that hook vs DDP x{r['anchor_vs_ddp']['median']:.3f})"
                        if (a_ := r.get("auto_vs_anchor")) and r.get("anchor_vs_ddp") else "")
                     + (f", accuracy {acc:+.1f} points vs DDP" if acc is not None else "")
                     + (" (wire-bound)" if r["wire_bound"] else "")
                     + _timing_note(r))

    def val(v: float | None, fmt: str) -> str:
        return "not measured" if v is None else format(v, fmt)

    lines.append(f"auto never loses (worst lower bound {val(g['never_loses']['worst_ci_low'], '.3f')}, goal >= "
                 f"{GOAL_VS_BEST_LOW}): {'met' if g['never_loses']['met'] else 'NOT met'}")
    w = g["wire_bound_vs_ddp"]
    worst = "not measured" if w["worst"] is None else f"x{w['worst']:.2f}"
    lines.append(f"wire-bound configurations: {w['configs']}, worst auto vs DDP {worst} (goal >= "
                 f"{GOAL_VS_DDP}x): {'met' if w['met'] else 'NOT met'}")
    a = g["accuracy_points_vs_ddp"]
    lines.append(f"accuracy, worst {val(a['worst'], '+.1f')} points vs DDP with allow={allow!r}"
                 + (f" (goal >= -{GOAL_ACCURACY_POINTS}: {'met' if a['met'] else 'NOT met'})" if a["applies"]
                    else " (what 'any' costs; the 0.5-point goal is allow='cast''s)"))
    c = g["choose_share"]
    lines.append(f"choosing, worst share of the first steps {val(c['worst'] and 100 * c['worst'], '.1f')} % "
                 f"(goal <= {100 * GOAL_CHOOSE_SHARE:g} %): {'met' if c['met'] else 'NOT met'}")
    f = g.get("choose_share_vs_fixed", {}).get("worst")
    if f is not None:
        lines.append(f"  of which beyond the quickest fixed codec's own start-up on gradsync's runtime (choosing alone): "
                     f"worst {100 * f:.1f} %")
    lines.append(f"replicas identical across ranks: {'yes' if g['replicas_identical'] else 'NO'}; goals met: "
                 f"{'yes' if g['met'] else 'NO'}")
    return lines


# ---- running ---------------------------------------------------------------------------------------------------

def _configs(args: argparse.Namespace) -> list[str]:
    return [f"{m}/{p}" for m in args.model_list for p in args.path_list]


def _worker_cmd(args: argparse.Namespace, out: Path, topology: str | None, label: str, index: int,
                total: int) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.compression_sweep_worker", "--out", str(out), "--configs",
           ",".join(_configs(args)), "--methods", ",".join(args.method_list), "--allow", args.allow,
           "--probe-steps", str(args.probe_steps), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--budget-s", str(args.budget_s), "--max-steps", str(args.max_steps), "--batch", str(args.batch),
           "--lr", str(args.lr), "--label", label, "--index", str(index),
           "--total", str(total), "--timeout", "300"]
    cmd += ["--topology", topology] if topology else []
    cmd += ["--share-runtime"] if args.share_runtime else []
    return cmd + (["--calibrate"] if args.calibrate and topology else [])


def _env(tmp: str) -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "GRADSYNC_CACHE": tmp, "PYTHONPATH": pythonpath()}


def run_loopback(args: argparse.Namespace, index: int, total: int) -> dict[str, Any]:
    from gradsync.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="gradsync-compression-sweep-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = _worker_cmd(args, out, None, "loopback", index, total)
        code = launch_local(cmd, args.procs, env=_env(tmp), timeout=args.timeout)
        if code != 0 or not out.is_file():
            raise GradsyncError(f"compression-sweep on loopback: workers failed (exit {code}); their output is above")
        data = json.loads(out.read_text())
    data.update(fabric="loopback", rate=None, mode="loopback", probe=[])
    return data


def run_cell(args: argparse.Namespace, fabric: str, rate: str, index: int, total: int) -> dict[str, Any]:
    """Testbed up for ``fabric`` at ``rate``, probe, the worker on every server, testbed down."""
    from gradsync import testbed
    from gradsync.testbed.control import load_state
    from gradsync.testbed.probe import cost_model

    topology = FABRICS[fabric]
    print(f"testbed up: {fabric} at {rate} ...", flush=True)
    testbed.up(topology, rate)
    try:
        world = load_state().world_size
        rows = testbed.probe([p for p in PROBE_PAIRS if max(p) < world], seconds=1.0)
        model = cost_model(load_state(), [r for r in rows if r["ok"]])
        with tempfile.TemporaryDirectory(prefix="gradsync-compression-sweep-") as tmp:
            os.chmod(tmp, 0o755)
            model_file, out = Path(tmp) / "cost_model.json", Path(tmp) / "result.json"
            model_file.write_text(json.dumps(model.to_dict()))
            env = {**_env(tmp), "GRADSYNC_COST_MODEL": str(model_file)}
            cmd = _worker_cmd(args, out, topology, f"{fabric} at {rate}", index, total)
            code = testbed.run(cmd, env=env, timeout=args.timeout)
            if code != 0 or not out.is_file():
                raise GradsyncError(f"compression-sweep on {fabric} at {rate}: workers failed (exit {code}); "
                                    "their output is above")
            data = json.loads(out.read_text())
    finally:
        testbed.down()
    data.update(fabric=fabric, rate=rate, mode="testbed", probe=rows)
    return data


def _timing_note(r: dict[str, Any]) -> str:
    """When timing started, where it was not after ``--warmup``: auto still chose then (and, past ``--first``,
    even after the timed steps began)."""
    chose, warmup, start = r.get("auto_choosing_steps") or 0, r.get("warmup") or 0, r.get("timed_from")
    if chose <= warmup:
        return ""
    if start is None:  # a result written before timing waited for the choices
        return f" (auto chose until step {chose}, after the {warmup} untimed)"
    if chose <= start:
        return f" (timed from step {start}, once auto had chosen)"
    return f" (timed from step {start}; auto chose until step {chose})"


def _rows(cells: Sequence[dict[str, Any]], allow: str) -> list[dict[str, Any]]:
    out = []
    for cell in cells:
        where = cell["fabric"] + (f" at {cell['rate']}" if cell["rate"] else "")
        for config in cell["configs"]:
            out.append({"where": where, "fabric": cell["fabric"], "rate": cell["rate"], "warmup": cell.get("warmup"),
                        **summarize_config(config, allow)})
    return out


def plot(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Heat maps, configurations (model/path) down, fabric and rate across: auto / best fixed, auto / DDP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    ys = list(dict.fromkeys(f"{r['model']}/{r['path']}" for r in rows))
    xs = list(dict.fromkeys(r["where"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(4 + 2.6 * len(xs), 1.6 + 0.7 * len(ys)), squeeze=False)
    for ax, key, title in ((axes[0][0], "auto_vs_best", "auto / best fixed\n(paired median, 95 % interval)"),
                           (axes[0][1], "auto_vs_ddp", "auto / DDP\n(paired median, 95 % interval)")):
        grid = np.full((len(ys), len(xs)), np.nan)
        for r in rows:
            if r[key] is None:
                continue
            i, j = ys.index(f"{r['model']}/{r['path']}"), xs.index(r["where"])
            grid[i, j] = r[key]["median"]
            text = f"{r[key]['median']:.2f}\n[{r[key]['ci95'][0]:.2f}, {r[key]['ci95'][1]:.2f}]"
            if key == "auto_vs_best":
                text += f"\n{r['best_fixed']}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
        finite = grid[np.isfinite(grid)]
        span = max(0.05, float(np.max(np.abs(finite - 1.0)))) if finite.size else 0.5
        im = ax.imshow(grid, cmap="RdYlGn", norm=TwoSlopeNorm(1.0, 1.0 - span, 1.0 + span), aspect="auto")
        ax.set_xticks(range(len(xs)), xs, rotation=20, fontsize=8)
        ax.set_yticks(range(len(ys)), ys, fontsize=8)
        ax.set_title(title + ", > 1: auto faster", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(args: argparse.Namespace, cells: list[dict[str, Any]], complete: bool, t0: float) -> dict[str, Any]:
    rows = _rows(cells, args.allow)
    g = goals(rows, args.allow)
    lines = summary_lines(rows, g, args.allow)
    doc = {"type": RESULT_TYPE, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "code": code_revision(),
           "host": platform.node(),
           "cpus": os.cpu_count(), "load_avg": list(os.getloadavg()), "complete": complete,
           "run_s": time.perf_counter() - t0, "allow": args.allow, "interval": INTERVAL,
           "wire_bound": f"DDP's median step >= {WIRE_BOUND:g}x the fastest method's",
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "configs": rows, "goals": g, "summary": lines, "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{_stem(args)}.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def _stem(args: argparse.Namespace) -> str:
    return "compression_sweep" + ("_quick" if args.quick else "_loopback" if args.loopback else "")


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    if not args.loopback:
        from gradsync import testbed

        why = testbed.available()
        if why:
            raise GradsyncError(f"compression-sweep needs the emulated cluster, which cannot run here: {why} "
                                "(--quick or --loopback run the workers as local processes)")
    per_cell = len(_configs(args))
    plan = [("loopback", None)] if args.loopback else [(f, r) for r in args.rate_list for f in args.fabric_list]
    total = per_cell * len(plan)
    print(f"compression-sweep: {total} configurations ({len(plan)} cells x {per_cell}), {len(args.method_list)} "
          f"methods, {args.steps} steps ({args.warmup} untimed)"
          + (f", more up to {args.max_steps or 'any number'} while a configuration takes under {args.budget_s:g} s"
             if args.budget_s else "") + f", allow={args.allow!r}", flush=True)
    t0 = time.perf_counter()
    cells: list[dict[str, Any]] = []
    doc: dict[str, Any] = {}
    for k, (fabric, rate) in enumerate(plan):
        cell = run_loopback(args, k * per_cell, total) if rate is None else run_cell(args, fabric, rate,
                                                                                    k * per_cell, total)
        cells.append(cell)
        doc = _write(args, cells, k + 1 == len(plan), t0)
        print(f"cell {k + 1}/{len(plan)} done ({time.perf_counter() - t0:.0f} s so far)", flush=True)
    print("\n".join(doc["summary"]), flush=True)
    png = args.out / f"{_stem(args)}.png"
    plot(png, doc["configs"])
    print(f"wrote {args.out / (_stem(args) + '.json')} and {png}", flush=True)
    return 0 if doc["goals"]["met"] or args.loopback else 1


if __name__ == "__main__":
    raise SystemExit(main())
