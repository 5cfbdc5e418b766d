"""A NIC that slows down, or a rank that comes late, mid-job on the emulated cluster: ``gradsync bench
adapt-testbed`` (issue 39, scenarios a and b).

The testbed comes up for ``--topology`` (default ``racks:2,3,4``; ``switch:8`` with ``--scenario late``); every server holds three allreduces over the
same process group: gradsync as it runs today (``static``: ``adapt=False``), gradsync with the watch on every
qualifying collective (``adaptive``: ``AdaptOptions(every=1)``), and ``torch.distributed.all_reduce`` (``gloo``).
Each round runs one ``--size`` float32 allreduce of each, in a rotating order; a sample is the slowest rank's
time. Before round ``--degrade-at`` the driver cuts server ``--slow-rank``'s NICs to ``1/--factor`` of their rate
in both directions (:func:`gradsync.testbed.control.set_server_rate`, ``tc qdisc change``); before round
``--restore-at`` it puts them back. Rank 0 asks for each change through a file and waits (bounded) until the
driver has made it, so every method sees it from the same round on.

``--scenario late`` (b): no rate changes; from round ``--degrade-at`` to ``--restore-at`` server ``--slow-rank``
(default the last) enters every method's allreduce ``Δ`` late (a sleep after the round's barrier), where ``Δ`` is
one gloo ring allreduce's time (the median of gloo's warm-up rounds; ``--delay`` sets it). Goals: adaptive
>= 1.2x gloo and >= 1.15x static while late. Written as ``adapt_testbed_late.json`` and ``.png``.

Reported per method: the per-round series, the medians before, while degraded (the first ``--settle`` rounds
after each change left out) and after; adaptive / static and adaptive / gloo while degraded (the issue's goal:
>= 1.3x both) and adaptive after against before (goal: within 5 %); the watch's switches and held switches; every
sum checked exact. Writes ``adapt_testbed.json`` and ``.png`` to ``--out``. Needs root (the testbed).

Run from the repository root::

    sudo gradsync bench adapt-testbed                       # a few minutes on 2 cores
    sudo gradsync bench adapt-testbed --topology bcube:3,2 --slow-rank 4
    sudo gradsync bench adapt-testbed --scenario late      # one of 8 ranks on a flat switch, late every step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULT_TYPE = "gradsync.bench.adapt_testbed"
METHODS = ("static", "adaptive", "gloo")
#: Untimed rounds past ``--warmup`` while a runtime still explores or the watch warms up: the phases compare steady
#: states (the watch's warm-up and ``auto``'s exploration are once per job; docs/runtime.md has what they cost).
MAX_SETTLE_ROUNDS = 30
#: How long rank 0 waits for the driver to change the rate, and the driver for the workers to finish.
HANDSHAKE_S = 60.0
#: Per scenario (the issue's): adaptive against static and gloo while degraded, and after against before.
#: ``dead``: the step time after the reroute within this share of the model's prediction for the surviving graph.
GOALS = {"nic": {"degraded_vs_static": 1.3, "degraded_vs_gloo": 1.3, "recovered_within": 0.05},
         "late": {"degraded_vs_static": 1.15, "degraded_vs_gloo": 1.2, "recovered_within": 0.05},
         "dead": {"predicted_within": 0.15}}
DEFAULT_TOPOLOGY = {"nic": "racks:2,3,4", "late": "switch:8", "dead": "bcube:3,2"}
#: The unit link rate per scenario: the late one runs where one ring allreduce of 4 MiB is wire-bound, not where the
#: executor's own costs decide it (docs/runtime.md, "Plans that follow the cluster"); the dead one at bcube's rate in
#: ``bench vs-native``.
DEFAULT_RATE = {"nic": "400mbit", "late": "100mbit", "dead": "200mbit"}


def _ask(control: Path, what: str, round_: int) -> None:
    """Rank 0: ask the driver for ``what`` before ``round_`` and wait until it says done (bounded)."""
    (control / "ask.tmp").write_text(f"{what} {round_}\n")
    (control / "ask.tmp").replace(control / "ask")
    deadline = time.monotonic() + HANDSHAKE_S
    while time.monotonic() < deadline:
        done = control / "done"
        if done.is_file() and done.read_text().strip() == f"{what} {round_}":
            return
        time.sleep(0.02)
    raise TimeoutError(f"the driver did not {what} the NIC within {HANDSHAKE_S:.0f} s")


def worker(args: argparse.Namespace) -> int:
    """One rank: the three methods, rounds rotating; rank 0 asks for the rate changes and writes the report."""
    import torch
    import torch.distributed as dist

    import gradsync
    from gradsync.comm.adapt import AdaptOptions
    from gradsync.comm.runtime import Runtime
    from gradsync.comm.transport import TorchTransport

    torch.set_num_threads(1)
    static = gradsync.init(args.topology, timeout_s=120, adapt=False)  # today's defaults: calibration, explore
    adaptive = Runtime(TorchTransport(timeout_s=120), static.topology, timeout_s=120,
                       cost_model=static.cost_model, adapt=AdaptOptions(every=1))
    adaptive.explore = static.explore
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = {"static": lambda b: static.allreduce(b), "adaptive": lambda b: adaptive.allreduce(b),
             "gloo": lambda b: dist.all_reduce(b)}
    buf = torch.empty(args.size // 4, dtype=torch.float32)
    want = float(world * (world + 1) // 2)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    warm_gloo: list[float] = []
    exact = {m: True for m in METHODS}
    control = Path(args.control)
    late = args.scenario == "late"
    delay = float(args.delay or 0.0)
    predicted: dict[str, float | None] = {}

    def settled() -> bool:  # the same on every rank: explorers pick, and watches count, job-wide
        watch = adaptive.adapt
        return (not static.exploring() and not adaptive.exploring()
                and (watch is None or watch.watched >= watch.options.warmup))

    plans: dict[str, list[str]] = {"static": [], "adaptive": []}
    settled_in: dict[str, list[bool]] = {"static": [], "adaptive": []}
    settling = {"static": static.settling, "adaptive": adaptive.settling}
    start: int | None = None  # the first timed round
    r = -1
    while start is None or r + 1 - start < args.rounds:
        r += 1
        if start is None and r >= args.warmup and (settled() or r >= args.warmup + MAX_SETTLE_ROUNDS):
            start = r
        timed = -1 if start is None else r - start
        if timed == 0 and late and not args.delay:  # Δ: one ring allreduce's time, the same on every rank
            got = torch.tensor([statistics.median(warm_gloo)], dtype=torch.float64)
            dist.broadcast(got, 0)
            delay = float(got)
        if rank == 0 and not late and timed in (args.degrade_at, args.restore_at):
            _ask(control, "degrade" if timed == args.degrade_at else "restore", timed)
        if timed == args.restore_at - 1 and adaptive.adapt is not None:  # every rank: the steady state's price
            predicted = {"adaptive_plan": "/".join(map(str, adaptive.choice(args.size))),
                         "adaptive": adaptive.adapt.predicted_s(args.size)}
            rerouted = [s for s in adaptive.adapt.switches if "no carrier" in s.message]
            if rerouted:  # the model's price of the surviving graph's plan: when chosen (before it ran), and as it runs
                predicted.update(reroute_plan=rerouted[-1].new_plan, at_reroute=rerouted[-1].predicted_s,
                                 model=adaptive.cost_model.predict(
                                     adaptive.schedule(None, args.size), adaptive.topology, args.size,
                                     native=adaptive.choice(args.size)[0] == "native"))
        sleep = delay if late and rank == args.slow_rank and args.degrade_at <= timed < args.restore_at else 0.0
        order = METHODS[r % 3:] + METHODS[:r % 3]
        for name in order:
            buf.fill_(rank + 1)
            dist.barrier()
            t0 = time.perf_counter()
            if sleep:
                time.sleep(sleep)
            calls[name](buf)
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            exact[name] &= bool(torch.all(buf == want))
            if timed >= 0:
                times[name].append(float(took))
            elif name == "gloo":
                warm_gloo.append(float(took))
        if timed >= 0:  # what each runtime ran, and whether it settled something (planned, explored) this round
            for name, rt in (("static", static), ("adaptive", adaptive)):
                plans[name].append("/".join(map(str, rt.choice(args.size))))
                settled_in[name].append(rt.settling != settling[name])
                settling[name] = rt.settling
        if rank == 0 and timed >= 0 and timed % 10 == 0:
            print(f"round {timed}/{args.rounds}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in METHODS),
                  flush=True)
    ok = torch.tensor([float(exact[m]) for m in METHODS])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    watch = adaptive.adapt
    if rank == 0 and watch is not None:
        out = {"type": RESULT_TYPE,
               "config": {"scenario": args.scenario, "topology": args.topology, "world": world,
                          "size_bytes": args.size, "rounds": args.rounds,
                          "warmup": args.warmup, "warmup_rounds": start, "degrade_at": args.degrade_at, "restore_at": args.restore_at,
                          "settle": args.settle, "slow_rank": args.slow_rank, "factor": args.factor,
                          "delay_s": delay if late else None, "rate": args.rate, "peer": args.peer,
                          "torch": torch.__version__},
               "predicted_degraded_s": predicted,
               "samples_s": times, "exact": {m: bool(ok[i] == 1.0) for i, m in enumerate(METHODS)},
               "plans": plans, "settling_rounds": {m: [i for i, x in enumerate(v) if x] for m, v in settled_in.items()},
               "static_plan": "/".join(map(str, static.choice(args.size))),
               "adaptive_plan_end": "/".join(map(str, adaptive.choice(args.size))),
               "switches": [{"generation": s.generation, "collective": s.collective, "old": s.old_plan,
                             "new": s.new_plan, "message": s.message} for s in watch.switches],
               "held": [s.message for s in watch.held], "watched": watch.watched}
        Path(args.report).write_text(json.dumps(out, indent=1) + "\n")
    adaptive.shutdown()
    gradsync.shutdown()
    return 0


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Medians per phase and the goals' ratios (larger is faster for adaptive)."""
    cfg = out["config"]
    a, b, settle, n = cfg["degrade_at"], cfg["restore_at"], cfg["settle"], cfg["rounds"]
    phases = {"before": range(0, a), "degraded": range(a + settle, b), "after": range(b + settle, n)}
    med = {m: {p: statistics.median([out["samples_s"][m][i] for i in rs]) for p, rs in phases.items() if len(rs)}
           for m in METHODS}
    deg = med["adaptive"].get("degraded")
    scenario = cfg.get("scenario", "nic")
    goals = GOALS[scenario]
    ratios = {"degraded_vs_static": med["static"]["degraded"] / deg if deg else None,
              "degraded_vs_gloo": med["gloo"]["degraded"] / deg if deg else None,
              "recovered": med["adaptive"]["after"] / med["adaptive"]["before"] if "after" in med["adaptive"] else None}
    predicted = out.get("predicted_degraded_s") or {}
    pred = predicted.get("adaptive")
    anchor = predicted.get("model") or predicted.get("at_reroute")  # the plan as it runs, else as first chosen
    over = deg / anchor if deg and anchor else None
    if scenario == "dead":
        met = {"predicted": over is not None and abs(over - 1) <= goals["predicted_within"],
               "logged": sum("no carrier" in s["message"] for s in out["switches"]) == 1}
    else:
        met = {"degraded_vs_static": (ratios["degraded_vs_static"] or 0) >= goals["degraded_vs_static"],
               "degraded_vs_gloo": (ratios["degraded_vs_gloo"] or 0) >= goals["degraded_vs_gloo"],
               "recovered": ratios["recovered"] is not None and abs(ratios["recovered"] - 1) <= goals["recovered_within"]}
    return {"medians_s": med, "ratios": ratios, "goals": goals, "met": met, "all_exact": all(out["exact"].values()),
            "adaptive_degraded_over_predicted": deg / pred if deg and pred else None,
            "adaptive_degraded_over_predicted_at_reroute": over}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = out["config"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for m in METHODS:
        ax.plot(out["samples_s"][m], marker=".", linewidth=1, label=m)
    scenario = cfg.get("scenario", "nic")
    change = {"late": lambda: f"rank {cfg['slow_rank']} late by {cfg['delay_s']:.3f} s",
              "dead": lambda: f"link {cfg['slow_rank']}-{cfg.get('peer')} cut",
              "nic": lambda: f"rank {cfg['slow_rank']}'s NIC at 1/{cfg['factor']:g}"}[scenario]()
    back = {"late": "on time", "dead": "mended", "nic": "restored"}[scenario]
    for at, what in ((cfg["degrade_at"], change), (cfg["restore_at"], back)):
        ax.axvline(at - 0.5, color="k", linestyle="--", linewidth=0.8)
        ax.text(at, ax.get_ylim()[1] * 0.95, what, fontsize=8, va="top")
    for s in out["switches"]:
        ax.annotate(f"switch -> {s['new']}", xy=(0.01, 0.9 - 0.07 * s["generation"]), xycoords="axes fraction",
                    fontsize=7)
    ax.set_xlabel("round (one allreduce per method)")
    ax.set_ylabel("allreduce, slowest rank (s)")
    ax.set_title(f"{cfg['size_bytes'] / 2**20:g} MiB on {cfg['topology']} at {cfg['rate']}, testbed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _drive(control: Path, args: argparse.Namespace, stop: threading.Event) -> list[dict[str, Any]]:
    """The driver's side of the handshake: make each change rank 0 asks for, then say done."""
    from gradsync.testbed.build import parse_rate
    from gradsync.testbed.control import set_link, set_server_rate

    log = []
    seen = ""
    slow = parse_rate(args.rate) / args.factor
    while not stop.is_set():
        ask = control / "ask"
        text = ask.read_text().strip() if ask.is_file() else ""
        if text and text != seen:
            what = text.split()[0]
            if args.scenario == "dead":
                plan = set_link(args.slow_rank, args.peer, up=what != "degrade")
                log.append({"ask": text, "cut": [list(c) for c in plan.cut], "at": time.time()})
            else:
                mbit = set_server_rate(args.slow_rank, f"{slow}mbit" if what == "degrade" else None)
                log.append({"ask": text, "rate_mbit": mbit, "at": time.time()})
            (control / "done.tmp").write_text(text + "\n")
            (control / "done.tmp").replace(control / "done")
            seen = text
        time.sleep(0.02)
    return log


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gradsync bench adapt-testbed", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=sorted(GOALS), default="nic",
                   help="nic: a server's NICs slow down (a); late: a rank enters every allreduce late (b); dead: a "
                        "server's link stops carrying anything and the fabric routes around it (c)")
    p.add_argument("--peer", default=None,
                   help="dead: the device at the cut link's other end (default: --slow-rank's level-0 switch, its "
                        "NIC 0's)")
    p.add_argument("--topology", default=None,
                   help="testbed topology (default racks:2,3,4; switch:8 for late; bcube:3,2 for dead)")
    p.add_argument("--rate", default=None, help="unit link rate (default 400mbit; 100mbit for late; 200mbit for dead)")
    p.add_argument("--size", type=int, default=4 << 20, help="bytes per allreduce (default 4 MiB)")
    p.add_argument("--rounds", type=int, default=60, help="timed rounds (default 60)")
    p.add_argument("--warmup", type=int, default=8,
                   help="untimed rounds first (default 8; more until neither runtime explores and the watch has "
                        f"warmed up, at most {MAX_SETTLE_ROUNDS} more)")
    p.add_argument("--degrade-at", type=int, default=20, help="round before which the NIC slows (default 20)")
    p.add_argument("--restore-at", type=int, default=40, help="round before which it is back (default 40)")
    p.add_argument("--settle", type=int, default=5, help="rounds after each change left out of its phase (default 5)")
    p.add_argument("--slow-rank", type=int, default=None,
                   help="the server whose NICs slow down (default 0), or that comes late (default the last)")
    p.add_argument("--delay", type=float, default=None,
                   help="late: seconds the rank comes late (default: one gloo allreduce, its warm-up median)")
    p.add_argument("--factor", type=float, default=4.0, help="the slow NIC runs at 1/factor (default 4)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", default="", help=argparse.SUPPRESS)
    p.add_argument("--control", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.topology = args.topology or DEFAULT_TOPOLOGY[args.scenario]
    args.rate = args.rate or DEFAULT_RATE[args.scenario]
    if args.slow_rank is None:
        from gradsync.topology.io import get_topology

        args.slow_rank = get_topology(args.topology).world_size - 1 if args.scenario == "late" else 0
    if args.scenario == "dead" and args.peer is None:
        from gradsync.testbed.build import build_plan
        from gradsync.topology.io import get_topology

        args.peer = build_plan(get_topology(args.topology), args.rate).server(args.slow_rank).nics[0].peer
    if args.worker:
        return worker(args)
    if not 0 <= args.degrade_at < args.restore_at <= args.rounds or args.factor <= 1:
        p.error(f"need 0 <= --degrade-at < --restore-at <= --rounds and --factor > 1 (got {args.degrade_at}, "
                f"{args.restore_at}, {args.rounds}, {args.factor})")
    from benchmarks.common import pythonpath
    from gradsync import testbed

    testbed.up(args.topology, args.rate, idle_restart=False)
    try:
        with tempfile.TemporaryDirectory(prefix="gradsync-adapt-testbed-") as tmp:
            os.chmod(tmp, 0o777)
            control, report = Path(tmp), Path(tmp) / "report.json"
            stop = threading.Event()
            log: list[dict[str, Any]] = []
            driver = threading.Thread(target=lambda: log.extend(_drive(control, args, stop)), daemon=True)
            driver.start()
            cmd = [sys.executable, "-m", "benchmarks.adapt_testbed", "--worker", "--report", str(report),
                   "--control", str(control), *(argv if argv is not None else sys.argv[1:])]
            env = {"OMP_NUM_THREADS": "1", "GRADSYNC_CACHE": tmp, "PYTHONPATH": pythonpath()}
            try:
                code = testbed.run(cmd, env=env, timeout=1800)
            finally:
                stop.set()
                driver.join(timeout=5)
            if code != 0 or not report.is_file():
                print(f"adapt-testbed: workers failed (exit {code}); their output is above", file=sys.stderr)
                return 1
            out = json.loads(report.read_text())
    finally:
        testbed.down()
    out.update(rate_changes=log, summary=summarize(out))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "adapt_testbed" if args.scenario == "nic" else f"adapt_testbed_{args.scenario}"
    (args.out / f"{stem}.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out, args.out / f"{stem}.png")
    s = out["summary"]
    for m in METHODS:
        print(f"{m:9s} " + ", ".join(f"{ph} {v:.3f} s" for ph, v in s["medians_s"][m].items()))
    for line in (_dead_lines if args.scenario == "dead" else _degraded_lines)(out):
        print(line)
    for sw in out["switches"]:
        print("  " + sw["message"])
    print(f"wrote {args.out / (stem + '.json')} and .png")
    return 0


def _degraded_lines(out: dict[str, Any]) -> list[str]:
    """Scenarios (a) and (b): adaptive against static and gloo while degraded, recovery, the prediction."""
    s = out["summary"]
    r, g = s["ratios"], s["goals"]
    lines = [f"degraded: adaptive {r['degraded_vs_static']:.2f}x static (goal >= {g['degraded_vs_static']}x), "
             f"{r['degraded_vs_gloo']:.2f}x gloo (goal >= {g['degraded_vs_gloo']}x); "
             f"after / before {r['recovered']:.3f} (goal within 5 %); switches {len(out['switches'])}, held "
             f"{len(out['held'])}; exact: {s['all_exact']}"]
    pred = out.get("predicted_degraded_s") or {}
    if s["adaptive_degraded_over_predicted"] is not None:
        lines.append(f"adaptive while degraded: {pred['adaptive_plan']} predicted {pred['adaptive']:.3f} s, measured / "
                     f"predicted {s['adaptive_degraded_over_predicted']:.2f}")
    return lines


def _dead_lines(out: dict[str, Any]) -> list[str]:
    """Scenario (c): adaptive against static and gloo while cut, and the reroute's prediction against the time."""
    s = out["summary"]
    r, pred = s["ratios"], out.get("predicted_degraded_s") or {}
    lines = [f"cut: adaptive {r['degraded_vs_static']:.2f}x static, {r['degraded_vs_gloo']:.2f}x gloo; after / before "
             f"{r['recovered']:.3f}; exact: {s['all_exact']}"]
    over = s["adaptive_degraded_over_predicted_at_reroute"]
    if over is not None:
        first = pred.get("at_reroute")
        lines.append(f"after the reroute: {pred['adaptive_plan']} ran, the model prices it at {pred.get('model', 0):.3f} s "
                     f"on the surviving graph (at the reroute it chose {pred.get('reroute_plan')}, priced "
                     f"{first if first is None else f'{first:.3f}'} s); measured / predicted {over:.2f} (goal within "
                     f"{s['goals']['predicted_within']:.0%}: {'met' if s['met']['predicted'] else 'NOT met'})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
