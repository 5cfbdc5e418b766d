"""gradsync against what a user would otherwise pick, on the emulated cluster: ``gradsync bench vs-native``.

For every case a testbed is brought up (``gradsync.testbed``: namespaces, veth NICs, bridges, ``tc tbf`` at
``--rate`` per unit link and direction), a few pairs are probed, and the probe becomes the runtime's cost
model (:func:`gradsync.testbed.probe.cost_model`: the testbed's link rates × the measured TCP goodput).
``benchmarks/vs_native_worker.py`` then runs once per server with that model, starts gradsync as a user
would on a new cluster (``gradsync.init(calibrate=True)``: the per-message costs measured on this wire;
``--no-calibrate`` keeps the defaults), and measures, methods
alternating in the same processes (slowest rank per sample, medians):

* allreduce of each ``--sizes``: ``torch.distributed.all_reduce`` (gloo) against ``gradsync.allreduce``
  with ``auto`` (algorithm and pipeline depth chosen per size class; the native collective is a candidate);
* ``--steps`` training steps of BML's LeNet-5 (3,274,634 parameters): ``DistributedDataParallel``,
  DDP with gradsync's hook, and ``gradsync.DistributedOptimizer``, from the same weights on the same data;
  replicas are compared bit for bit across ranks and losses across methods.

Beside every allreduce figure: the cost model's prediction for the chosen schedule and for the native ring
(the same simulation the runtime chose with). CPU busy share is recorded: at ~100 % the 2 cores, not the
emulated network, are the bottleneck (lower ``--rate``).

Cases (``--cases``): ``racks`` (racks:2,3,4: two racks of three servers, uplinks at 1/4 of a NIC),
``bcube`` (bcube:3,2, 9 servers with 2 NICs), ``switch`` (switch:8, flat), ``fattree`` (fattree:4, 16
servers: heavy for 2 cores, not in the default set). Writes ``<--name>.json`` and ``<--name>.png`` (default
``vs_native``) to ``--out``. Needs root; exits 2 where the testbed cannot run.

Topology files (``--topology FILE,...``, or ``--cases fabrics``: the hand-written files in
``benchmarks/fabrics/`` beside the built-in each one describes) run as a new user runs them:
``gradsync.init(topology=file)`` with nothing else, no probe and no cost model given (``init``'s defaults
decide whether to measure the wire). A file's unit link (its slowest) runs at ``--rate``; a built-in's unit
link is its NIC, so a built-in twin runs at ``rate × o`` to give both the same uplinks. Each such case
sweeps ``--sizes`` and reports the smallest size from which gradsync stays ahead of gloo
(``advantage_from_bytes``).

TCP is cubic, without slow start after idle (``net.ipv4.tcp_slow_start_after_idle=0`` in every
namespace; ``--idle-restart`` keeps Linux's default). The methods alternate call by call, so each one's
connections sit idle for seconds while the others run, longer than the retransmission timeout (200 ms at
least) after which Linux shrinks an idle connection's window toward its initial 10 segments; a training
loop that runs one method leaves its connections idle only for a forward pass. With the restart, the interleaving itself moved the
samples: on bcube:3,2 at 12.5 MiB gradsync's between 0.53 and 0.59 s (0.516-0.527 s without; the model
says 0.509), and on racks at 4 MiB gloo's between 0.61 and 0.73 s (0.59-0.65 s without).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT as _ROOT
from benchmarks.common import pythonpath

RESULT_TYPE = "gradsync.bench.vs_native"
MIB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    topology: str
    rate: str
    pairs: tuple[tuple[int, int], ...]
    #: allreduce speed-up over gloo the issue asks for (at the sizes in ``goal_sizes``; None: every size)
    goal: float
    goal_sizes: tuple[int, ...] | None = None
    train_goal: float | None = None
    #: start gradsync as a user does (``init(topology)`` alone: no probe, no cost model, default calibration)
    as_user: bool = False
    #: the built-in case describing the same fabric (its speed-up should be within BUILTIN_REL of this one's)
    twin: str | None = None
    #: the speed-up goal applies from this size up (``goal_sizes`` lists exact sizes instead)
    goal_from: int | None = None


FABRICS = _ROOT / "benchmarks" / "fabrics"
#: Rate of a hand-written file's unit (slowest) link on the testbed: 60 Mbit/s keeps 6-9 ranks network-bound
#: on 2 shared cores.
FABRIC_RATE_MBIT = 60
#: A hand-written file's speed-up should be within this share of its built-in twin's.
BUILTIN_REL = 0.10
#: Sizes a fabric case sweeps unless ``--sizes`` is given: where the advantage starts, and the 4 MiB goal.
FABRIC_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _file_case(name: str, path: Path, twin: str | None = None, goal: float = 0.97,
               goal_from: int | None = None) -> Case:
    return Case(name, str(path), f"{FABRIC_RATE_MBIT}mbit", (), goal, None, None, True, twin, goal_from)


def _builtin_case(name: str, spec: str, oversubscription: int) -> Case:
    return Case(name, spec, f"{FABRIC_RATE_MBIT * oversubscription}mbit", (), 0.97, None, None, True)


CASES = {
    "racks": Case("racks", "racks:2,3,4", "400mbit", ((0, 1), (0, 3), (3, 5)), 1.6, (13107200, 50 * MIB), 1.4),
    "bcube": Case("bcube", "bcube:3,2", "200mbit", ((0, 1), (0, 3), (4, 8)), 1.8, None, 1.4),
    "switch": Case("switch", "switch:8", "400mbit", ((0, 1), (4, 7)), 0.97),
    # full bisection: no topology advantage to win, so the goal is the flat switch's "never slower"
    "fattree": Case("fattree", "fattree:4", "200mbit", ((0, 1), (0, 2), (0, 15)), 0.97),
    # hand-written files (benchmarks/fabrics/, no attrs), each beside the built-in of the same fabric
    "file-4to1": _file_case("file-4to1", FABRICS / "two-tier-4to1.yaml", "builtin-4to1", 1.5, 4 << 20),
    "builtin-4to1": _builtin_case("builtin-4to1", "racks:2,3,4", 4),
    "file-3to1": _file_case("file-3to1", FABRICS / "two-tier-3to1.yaml", "builtin-3to1"),
    "builtin-3to1": _builtin_case("builtin-3to1", "racks:2,3,3", 3),
    "file-3racks": _file_case("file-3racks", FABRICS / "three-rack.yaml", "builtin-3racks"),
    "builtin-3racks": _builtin_case("builtin-3racks", "racks:3,3,3", 3),
    "file-slowrack": _file_case("file-slowrack", FABRICS / "slow-rack.yaml"),
}
#: ``--cases fabrics``
FABRIC_CASES = ("file-4to1", "builtin-4to1", "file-3to1", "builtin-3to1", "file-3racks", "builtin-3racks",
                "file-slowrack")
#: Allowed deviation of a measured median from the cost model's prediction.
GOAL_REL_ERR = 0.15


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gradsync bench vs-native", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="racks,bcube,switch",
                   help=f"comma-separated, of {sorted(CASES)}, or 'fabrics' ({', '.join(FABRIC_CASES)})")
    p.add_argument("--topology", default="",
                   help="comma-separated topology files to run as a user would (gradsync.init(topology=file), "
                        f"nothing else), their slowest link at --rate (default {FABRIC_RATE_MBIT}mbit); "
                        "replaces --cases")
    p.add_argument("--sizes", default=None,
                   help=f"allreduce sizes in bytes (default {4 * MIB},13107200,{50 * MIB}; with --topology or "
                        f"fabric cases {','.join(map(str, FABRIC_SIZES))})")
    p.add_argument("--name", default="vs_native", help="stem of the JSON and PNG written to --out")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per method and size (at least)")
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="time each method for at least this long per size: short sizes, the noisy ones, get more "
                        "repetitions (at most 20x --reps)")
    p.add_argument("--steps", type=int, default=4, help="timed training steps per method (0: none)")
    p.add_argument("--rate", default=None, help="override every case's rate (tc syntax, e.g. 200mbit)")
    p.add_argument("--quick", action="store_true", help="racks only, 4 MiB, 2 reps, 2 steps")
    p.add_argument("--no-explore", dest="explore", action="store_false",
                   help="run the model's pipeline depth from the first call (default: auto times the depths "
                        "beside it on each size's first calls after calibrating, Runtime.explore)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="price with the probe's rates and default message costs (default: gradsync.init("
                        "calibrate=True) measures the message costs on the testbed first, as a user would)")
    p.add_argument("--idle-restart", action="store_true",
                   help="keep Linux's slow start after an idle RTO on the testbeds (default: off, "
                        "net.ipv4.tcp_slow_start_after_idle=0: the methods alternate, so each one's connections "
                        "idle for the others' turns, seconds that a training loop does not leave them)")
    p.add_argument("--out", default=str(_ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.cases, args.sizes, args.reps, args.steps = "racks", str(4 * MIB), 2, 2
    if args.topology:
        args.cases = ""
        args.case_list = []
        for f in args.topology.split(","):
            path = Path(f).resolve()
            if not path.is_file():
                p.error(f"topology file {f!r} does not exist; give .json or .yaml files (see docs/topology-format.md)")
            args.case_list.append(_file_case(path.stem, path))
    else:
        names = [n for c in args.cases.split(",") for n in (FABRIC_CASES if c == "fabrics" else (c,))]
        unknown = [c for c in names if c not in CASES]
        if unknown:
            p.error(f"unknown cases {unknown}; choose from {sorted(CASES)} or 'fabrics'")
        args.case_list = [CASES[n] for n in names]
    if args.sizes is None:
        fabric = any(c.as_user for c in args.case_list)
        args.sizes = ",".join(map(str, FABRIC_SIZES)) if fabric else f"{4 * MIB},13107200,{50 * MIB}"
    return args


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    from gradsync import testbed
    from gradsync.testbed.control import load_state
    from gradsync.testbed.probe import cost_model

    rate = _rate(case, args)
    print(f"[{case.name}] testbed up: {case.topology} at {rate} ...", flush=True)
    testbed.up(case.topology, rate, idle_restart=args.idle_restart)
    try:
        rows = testbed.probe(case.pairs, seconds=1.0) if case.pairs else []
        with tempfile.TemporaryDirectory(prefix="gradsync-vs-native-") as tmp:
            os.chmod(tmp, 0o755)
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "benchmarks.vs_native_worker", "--out", str(out), "--topology",
                   case.topology, "--sizes", args.sizes, "--reps", str(args.reps), "--steps", str(args.steps),
                   "--min-seconds", str(args.min_seconds)]
            env = {"OMP_NUM_THREADS": "1", "GRADSYNC_CACHE": tmp, "PYTHONPATH": pythonpath()}
            if case.as_user:  # gradsync.init(topology=file) alone: its defaults decide what to measure
                cmd += ["--calibrate", "default"]
            else:  # the probe becomes the runtime's cost model, then calibration as asked
                model_file = Path(tmp) / "cost_model.json"
                model_file.write_text(json.dumps(cost_model(load_state(), [r for r in rows if r["ok"]]).to_dict()))
                env["GRADSYNC_COST_MODEL"] = str(model_file)
                cmd += ["--calibrate", "yes" if args.calibrate else "no"]
            cmd += [] if args.explore else ["--no-explore"]
            t0 = time.perf_counter()
            code = testbed.run(cmd, env=env, timeout=args.timeout)
            if code != 0 or not out.is_file():
                raise RuntimeError(f"{case.name}: workers failed (exit {code}); their output is above")
            data = json.loads(out.read_text())
            data["run_s"] = time.perf_counter() - t0
    finally:
        testbed.down()
    path = Path(case.topology)
    if path.is_absolute() and path.is_relative_to(_ROOT):  # a shipped file: named from the checkout, not this machine
        data["topology"] = str(path.relative_to(_ROOT))
    data.update(case=case.name, rate=rate, tcp_idle_restart=args.idle_restart, probe=rows, as_user=case.as_user,
                goal=case.goal, goal_sizes=case.goal_sizes, goal_from=case.goal_from, twin=case.twin)
    return data


def _rate(case: Case, args: argparse.Namespace) -> str:
    """``--rate`` for a case's unit link; a built-in twin scales it as its own rate scales the file rate."""
    if not args.rate:
        return case.rate
    from gradsync.testbed.build import parse_rate

    return f"{parse_rate(args.rate) * parse_rate(case.rate) / parse_rate(CASES['file-4to1'].rate):g}mbit" \
        if case.name.startswith("builtin-") else args.rate


def advantage_from(rows: list[dict[str, Any]], floor: float = 1.0) -> int | None:
    """The smallest swept size from which gradsync's median beats gloo's (speed-up above ``floor``) at that
    size and every larger one swept; None when it does not at the largest."""
    start = None
    for a in sorted(rows, key=lambda a: a["size_bytes"]):
        ahead = a["median_s"]["native"] / a["median_s"]["gradsync"] > floor
        start = (start if start is not None else a["size_bytes"]) if ahead else None
    return start


def _ran(row: dict[str, Any]) -> dict[str, Any]:
    """The plan gradsync ran for one allreduce row: ``ran`` (what ``auto`` settled on after measuring its
    first calls), or the model's choice in results written before it was recorded."""
    if "ran" in row:
        return {"algorithm": row["ran"][0], "pipeline": row["ran"][1]}
    return row["choice"]


def summarize(results: list[dict[str, Any]]) -> tuple[list[str], bool]:
    lines, met = [], True
    by_name = {r["case"]: r for r in results}
    for r in results:
        case = CASES.get(r["case"]) or Case(r["case"], r["topology"], r["rate"], (), r.get("goal", 0.97), None)
        goal_from = r.get("goal_from")
        for a in r["allreduce"]:
            med, ch, pred = a["median_s"], _ran(a), a["predicted_s"]
            native_pred = pred["native"]
            ratio = med["native"] / med["gradsync"]
            a["speedup"] = ratio
            a["gradsync_over_predicted"] = med["gradsync"] / pred["gradsync"]
            a["native_over_predicted"] = med["native"] / native_pred
            goal_here = (a["size_bytes"] >= goal_from if goal_from is not None
                         else case.goal_sizes is None or a["size_bytes"] in case.goal_sizes)
            ok = ratio >= case.goal or not goal_here
            within = abs(a["gradsync_over_predicted"] - 1) <= GOAL_REL_ERR
            met &= ok and within and all(a["correct"].values())
            lines.append(
                f"{r['case']:8s} {a['size_bytes'] / MIB:6.2f} MiB  native {med['native']:.4f} s (pred {native_pred:.4f}, "
                f"x{a['native_over_predicted']:.2f})"
                f"  gradsync {ch['algorithm']}/p{ch['pipeline']} {med['gradsync']:.4f} s (pred {pred['gradsync']:.4f}, "
                f"x{a['gradsync_over_predicted']:.2f})  speed-up {ratio:.2f}"
                + (f" (goal {case.goal}: {'met' if ok else 'NOT met'})" if goal_here else "")
                + f"  CPU {a['cpu_busy_share']:.0%}" + ("" if all(a["correct"].values()) else "  WRONG RESULT")
                + ("  (timed while auto still explored)" if a.get("timed_while_exploring") else ""))
        if r.get("as_user"):
            start = r["advantage_from_bytes"] = advantage_from(r["allreduce"])
            lines.append(f"{r['case']:8s} gradsync ahead of gloo from "
                         + (f"{start / MIB:g} MiB" if start is not None else "no swept size")
                         + f" (init {r.get('init_s', 0):.1f} s: {r['cost_model'].get('source', '')[:60]}...)")
            twin = by_name.get(r.get("twin") or "")
            if twin is not None:
                mine = {a["size_bytes"]: a["speedup"] for a in r["allreduce"]}
                for a in twin["allreduce"]:
                    if a["size_bytes"] in mine:
                        theirs = a["median_s"]["native"] / a["median_s"]["gradsync"]
                        rel = mine[a["size_bytes"]] / theirs - 1
                        ok = abs(rel) <= BUILTIN_REL or rel > 0
                        met &= ok
                        lines.append(f"{r['case']:8s} {a['size_bytes'] / MIB:6.2f} MiB  speed-up {mine[a['size_bytes']]:.2f} "
                                     f"vs built-in {twin['case']} {theirs:.2f} ({rel:+.0%}; within {BUILTIN_REL:.0%}: "
                                     f"{'met' if ok else 'NOT met'})")
        tr = r.get("train")
        if tr:
            med = tr["median_s"]
            for m in ("gradsync_hook", "gradsync_optimizer"):
                sp = med["ddp"] / med[m]
                ok = case.train_goal is None or sp >= case.train_goal
                met &= ok and tr["replicas_identical"][m]
                lines.append(f"{r['case']:8s} train step: DDP {med['ddp']:.3f} s, {m} {med[m]:.3f} s, speed-up {sp:.2f}"
                             + (f" (goal {case.train_goal}: {'met' if ok else 'NOT met'})" if case.train_goal else "")
                             + f"; replicas identical {tr['replicas_identical'][m]}, max |loss - DDP loss| "
                             f"{tr['max_loss_gap_vs_ddp'][m]:.2e}, CPU {tr['cpu_busy_share']:.0%}")
    lines.append(f"all goals met (speed-ups, within {GOAL_REL_ERR:.0%} of the prediction, exact): {'yes' if met else 'NO'}")
    return lines, met


def plot(path: Path, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        labels, x = [], 0.0
        for a in r["allreduce"]:
            med, ch, pred = a["median_s"], _ran(a), a["predicted_s"]
            b1 = ax.bar([x], [med["native"]], 0.8, color="tab:gray", label="gloo all_reduce" if x == 0 else None)
            b2 = ax.bar([x + 0.9], [med["gradsync"]], 0.8, color="tab:blue", label="gradsync auto" if x == 0 else None)
            ax.scatter([x, x + 0.9], [pred["native"], pred["gradsync"]], marker="_", s=400, color="black", zorder=3,
                       label="cost model" if x == 0 else None)
            ax.bar_label(b2, labels=[f"x{a['speedup']:.2f}\n{ch['algorithm']}/p{ch['pipeline']}"], fontsize=7)
            ax.bar_label(b1, labels=[f"{med['native']:.2f}s"], fontsize=7)
            labels.append((x + 0.45, f"{a['size_bytes'] / MIB:g} MiB"))
            x += 2.4
        tr = r.get("train")
        if tr:
            for j, m in enumerate(("ddp", "gradsync_hook", "gradsync_optimizer")):
                b = ax.bar([x + 0.9 * j], [tr["median_s"][m]], 0.8, color=("tab:gray", "tab:cyan", "tab:blue")[j])
                ax.bar_label(b, labels=[m.replace("gradsync_", "gs ")], fontsize=6, rotation=90, padding=2)
            labels.append((x + 0.9, "train step"))
        ax.set_xticks([p for p, _ in labels], [s for _, s in labels], fontsize=8)
        ax.set_title(f"{Path(r['topology']).name} at {r['rate']}", fontsize=10)
        ax.set_ylabel("seconds (median; black: cost model)")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path: Path, results: list[dict[str, Any]]) -> None:
    """Speed-up over gloo against size, measured (markers) and predicted by the cost model (dotted), one line per
    case: a hand-written file solid, its built-in twin dashed in the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colours: dict[str, Any] = {}
    palette = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3)
    twins = {r["twin"]: r["case"] for r in results if r.get("twin")}
    for r in results:
        key = twins.get(r["case"], r["case"])
        colour = colours.setdefault(key, next(palette))
        rows = sorted(r["allreduce"], key=lambda a: a["size_bytes"])
        x = [a["size_bytes"] / MIB for a in rows]
        measured = [a["median_s"]["native"] / a["median_s"]["gradsync"] for a in rows]
        predicted = [a["predicted_s"]["native"] / a["predicted_s"]["gradsync"] for a in rows]
        builtin = r["case"] in twins
        label = f"{r['case']} ({Path(r['topology']).name} at {r['rate']})"
        ax.plot(x, measured, "s--" if builtin else "o-", color=colour, label=label, alpha=0.8 if builtin else 1.0)
        ax.plot(x, predicted, ":", color=colour, alpha=0.6)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("allreduce size (MiB)")
    ax.set_ylabel("gloo time / gradsync time (median)")
    ax.set_title("gradsync.init(topology=...) defaults vs gloo; dotted: cost model", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    from gradsync import testbed

    args = _args(argv)
    why = testbed.available()
    if why:
        print(f"vs-native cannot run here: {why}", file=sys.stderr)
        return 2
    args.timeout = 1800.0
    results = []
    for case in args.case_list:
        results.append(run_case(case, args))
    lines, met = summarize(results)
    print("\n".join(lines), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"type": RESULT_TYPE, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(),
           "cpus": os.cpu_count(), "args": {k: v for k, v in vars(args).items() if k != "case_list"},
           "summary": lines,
           "goals_met": met, "results": results,
           "median_note": "every figure is a median of alternating samples in the same processes"}
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    (plot_sweep if all(r.get("as_user") for r in results) else plot)(out / f"{args.name}.png", results)
    print(f"wrote {out / f'{args.name}.json'} and {out / f'{args.name}.png'}", flush=True)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
