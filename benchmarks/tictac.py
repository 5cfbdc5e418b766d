"""``gradsync bench tictac``: TicTac's experiments on gradsync's models, in the iteration simulator.

Simulation section (this file): for every model in ``gradsync models`` the DAG is captured, each op profiled
(minimum of 5 runs, the seed's time oracle) and the link set so that pulling all parameters takes as long as
the iteration's compute (communication/computation ratio ``--ratio``, default 1). Then, on one worker, the
makespan and scheduling efficiency E of random orders (mean over ``--random-runs``), TIC (ties broken at
random, mean) and TAC; and on ``--workers`` workers (default 4) with a different random order each, the
straggler percentage (TicTac §6.3), against every worker following TAC.

Writes ``tictac.json`` (type ``gradsync.bench.tictac``; one key per section, so the real-process section, a
PS with priorities on and off, can be merged in by :func:`write_results`) and ``tictac.png`` to ``--out``::

    gradsync bench tictac --quick          # 32x32 inputs, 3 random orders: a minute on 2 cores
    gradsync bench tictac                  # 64x64 inputs, 10 random orders

Real-process section (``--processes``, run instead of the simulation): a PS with 1 server and 4 workers
moving VGG-16's 32 parameter tensors, each shrunk by ``--scale`` (default 64: 2.16 M floats, 8.6 MB per
worker per iteration, with VGG-16's relative sizes: the first classifier layer holds 74 % of the bytes),
50 iterations with TAC enforcement (``gradsync.order.priorities("vgg16", ..., method="tac")``, computed once,
sent as ordered pulls) and 50 with a fresh random order per worker and iteration (seeded): mean, p95 and a
CDF of the step time (TicTac Fig. 12b) in ``tictac_processes.png``. See ``benchmarks/tictac_ps_worker.py``
for one iteration. Shaping (``--shaping``):

* ``testbed`` (default; root): ``gradsync.testbed`` builds ``switch:5`` (network namespaces, veth pairs, a
  bridge, ``tc tbf`` at ``--rate`` on every NIC in both directions); the server runs in host 0's
  namespace, worker r in host r's. The server's NIC is the shared bottleneck, as a PS's NIC is.
* ``none``: ``gradsync.ps.launch.launch`` on loopback, no rate limit (CPU-bound; for a smoke test only).

Compute is synthetic (``time.sleep`` per layer, proportional to the layer's FLOPs at 224x224), its forward
total set to ``--comp-ratio`` times the estimated time the shaped server NIC needs for one iteration's
pulls: real VGG-16 convolutions would take seconds per image on the 2 shared cores and starve the network::

    gradsync bench tictac --processes --quick   # 10 iterations per order, scale 128: about a minute
    gradsync bench tictac --processes           # 50 iterations per order: a few minutes
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULT_TYPE = "gradsync.bench.tictac"
DEFAULT_OUT = Path("benchmarks/results/tictac")


def simulate_model(name: str, *, ratio: float = 1.0, workers: int = 4, image_size: int = 64, random_runs: int = 10,
                   runs: int = 5, training: bool = True) -> dict[str, Any]:
    """One model's row: makespan and E of random / TIC / TAC on one worker, straggler % on ``workers``."""
    from gradsync.models import create
    from gradsync.order import (
        bandwidth_for_ratio,
        capture,
        example_input,
        metrics,
        profile_ops,
        tac,
        tic,
        time_oracle,
    )
    from gradsync.sim import IterationConfig, simulate_iteration

    t0 = time.perf_counter()
    model = create(name)
    example = example_input(name, batch=2, image_size=None if name == "lenet5" else image_size)
    dag = capture(model, example, training=training, name=name)
    dag = dag.with_times(profile_ops(model, example, dag, runs=runs))
    capture_s = time.perf_counter() - t0
    bandwidth = bandwidth_for_ratio(dag, ratio)
    one = IterationConfig(1, "ps", bandwidth)
    many = IterationConfig(workers, "ps", bandwidth)
    oracle = time_oracle(dag, one.link)
    t0 = time.perf_counter()
    tac_prio = tac(dag, oracle)
    tac_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tic_prio = tic(dag)
    tic_s = time.perf_counter() - t0

    def one_worker(order: Any, seed: int) -> dict[str, float]:
        m = metrics(dag, oracle, simulate_iteration(dag, order, one, seed=seed, record=False).makespan_s)
        return {"makespan_s": m.makespan_s, "E": m.efficiency}

    def summary(rows: list[dict[str, float]]) -> dict[str, float]:
        spans = [r["makespan_s"] for r in rows]
        return {"makespan_s": statistics.fmean(spans), "makespan_min_s": min(spans), "makespan_max_s": max(spans),
                "E": statistics.fmean(r["E"] for r in rows)}

    rand = summary([one_worker("random", s) for s in range(random_runs)])
    tic_row = summary([one_worker(tic_prio, s) for s in range(random_runs)])  # ties broken at random per seed
    tac_row = summary([one_worker(tac_prio, 0)])
    rand_w = [simulate_iteration(dag, "random", many, seed=s, record=False) for s in range(random_runs)]
    tac_w = simulate_iteration(dag, tac_prio, many, record=False)
    m = metrics(dag, oracle, tac_row["makespan_s"])
    return {
        "model": name, "params": len(dag.params), "ops": len(dag.ops), "bytes": dag.total_bytes,
        "training": training, "image_size": image_size, "bandwidth_GBps": bandwidth, "ratio": ratio,
        "U_s": m.upper_s, "L_s": m.lower_s, "S": m.speedup,
        "random": rand, "tic": tic_row, "tac": tac_row,
        "tac_over_random": tac_row["makespan_s"] / rand["makespan_s"],
        "tic_over_random": tic_row["makespan_s"] / rand["makespan_s"],
        "workers": {
            "count": workers,
            "random_makespan_s": statistics.fmean(r.makespan_s for r in rand_w),
            "random_straggler_percent_mean": statistics.fmean(r.straggler_percent for r in rand_w),
            "random_straggler_percent_max": max(r.straggler_percent for r in rand_w),
            "tac_makespan_s": tac_w.makespan_s, "tac_straggler_percent": tac_w.straggler_percent,
        },
        "timing_s": {"capture_and_profile": capture_s, "tac": tac_s, "tic": tic_s},
    }


def simulate_models(names: Sequence[str], **kw: Any) -> list[dict[str, Any]]:
    """:func:`simulate_model` for each name, printing one line per model as it finishes."""
    rows = []
    print(f"{'model':10s} {'params':>6s} {'ops':>5s} {'rand ms':>9s} {'TIC ms':>9s} {'TAC ms':>9s} {'TAC/rand':>8s} "
          f"{'E rand':>6s} {'E TIC':>6s} {'E TAC':>6s} {'strag% rand':>11s} {'strag% TAC':>10s} {'TAC s':>6s}", flush=True)
    for name in names:
        r = simulate_model(name, **kw)
        w = r["workers"]
        print(f"{name:10s} {r['params']:6d} {r['ops']:5d} {r['random']['makespan_s'] * 1e3:9.3f} "
              f"{r['tic']['makespan_s'] * 1e3:9.3f} {r['tac']['makespan_s'] * 1e3:9.3f} {r['tac_over_random']:8.3f} "
              f"{r['random']['E']:6.3f} {r['tic']['E']:6.3f} {r['tac']['E']:6.3f} "
              f"{w['random_straggler_percent_max']:11.1f} {w['tac_straggler_percent']:10.1f} {r['timing_s']['tac']:6.2f}",
              flush=True)
        rows.append(r)
    return rows


def plot_simulation(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Three panels per model: makespan relative to random, efficiency E, straggler % on W workers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["model"] for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.27
    for k, (key, color) in enumerate((("random", "tab:gray"), ("tic", "tab:orange"), ("tac", "tab:blue"))):
        axes[0].bar(x + (k - 1) * width, [r[key]["makespan_s"] / r["random"]["makespan_s"] for r in rows], width,
                    color=color, label=key.upper() if key != "random" else "random")
        axes[1].bar(x + (k - 1) * width, [r[key]["E"] for r in rows], width, color=color, label=key)
    axes[0].set_ylabel("makespan / random order's")
    axes[0].set_title(f"one worker, comm/comp ratio {rows[0]['ratio']:g}", fontsize=10)
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("scheduling efficiency E (Eq. 3)")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title("E: 1 = perfect overlap, 0 = fully serial", fontsize=10)
    w = rows[0]["workers"]["count"]
    axes[2].bar(x - width / 2, [r["workers"]["random_straggler_percent_max"] for r in rows], width, color="tab:gray", label="random (max)")
    axes[2].bar(x + width / 2, [r["workers"]["tac_straggler_percent"] for r in rows], width, color="tab:blue", label="TAC")
    axes[2].set_ylabel("straggler time (% of iteration)")
    axes[2].set_title(f"{w} workers, each its own random order", fontsize=10)
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("TicTac in the iteration simulator (training, PS, profiled op times)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(out: Path, sections: dict[str, Any]) -> Path:
    """Merge ``sections`` (e.g. ``{"simulation": ...}`` or ``{"processes": ...}``) into ``out/tictac.json``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tictac.json"
    data: dict[str, Any] = {"type": RESULT_TYPE}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if old.get("type") == RESULT_TYPE:
                data.update(old)
        except json.JSONDecodeError:
            pass
    data.update(sections)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


# ---- real processes -------------------------------------------------------------------------------------
GOODPUT = 1448 / 1514  # TCP payload share of a shaped Ethernet frame (MTU 1500, timestamps)


def vgg16_plan(scale: int) -> tuple[list[list[Any]], list[list[Any]]]:
    """VGG-16's parameters ``[name, numel // scale]`` and layers ``[[weight, bias], flops at 224x224]``,
    in forward order (shapes propagated on the meta device: nothing is allocated)."""
    import torch

    from gradsync.models import create

    with torch.device("meta"):
        model = create("vgg16")
    flops: dict[str, float] = {}

    def hook(name: str) -> Any:
        def fn(mod: Any, args: Any, out: Any) -> None:
            w = mod.weight
            per_out = w[0].numel()  # multiply-adds per output element
            flops[name] = 2.0 * per_out * out.numel()
        return fn

    hooks = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
             if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    with torch.device("meta"):
        model(torch.empty(1, 3, 224, 224))
    for h in hooks:
        h.remove()
    params = [[n, max(1, -(-p.numel() // scale))] for n, p in model.named_parameters()]
    layers = [[[f"{n}.weight", f"{n}.bias"], flops[n]] for n in flops]
    return params, layers


def _percentile(xs: Sequence[float], q: float) -> float:
    ys = sorted(xs)
    k = (len(ys) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def _stats(xs: Sequence[float]) -> dict[str, float]:
    return {"mean_s": statistics.fmean(xs), "p50_s": _percentile(xs, 0.5), "p95_s": _percentile(xs, 0.95),
            "min_s": min(xs), "max_s": max(xs), "samples": len(xs)}


def _run_job(shaping: str, plan_path: Path, out_dir: Path, workers: int, timeout_s: float, tb: Any) -> int:
    """Start 1 server and ``workers`` workers (testbed namespaces or loopback) and wait for them."""
    import os
    import signal
    import subprocess

    from benchmarks.common import ROOT
    from gradsync.launch import free_port, run_workers
    from gradsync.ps.env import CLIENTS_ENV, SERVERS_ENV
    from gradsync.ps.launch import PSJob, launch

    worker = [sys.executable, str(ROOT / "benchmarks" / "tictac_ps_worker.py"), str(plan_path), str(out_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if shaping == "none":
        return launch(worker, PSJob(workers=workers, servers=1, timeout_s=timeout_s), env=env)
    from gradsync.testbed import netns

    host0 = tb.server(0)
    endpoint = f"tcp://{host0.address}:{free_port()}"
    server = subprocess.Popen(netns.ns_exec(host0.namespace, [sys.executable, "-m", "gradsync.ps.server", "--bind",
                                                              endpoint]), env=env, start_new_session=True)
    try:
        time.sleep(1.0)
        if server.poll() is not None:
            raise RuntimeError(f"the PS server exited at start with code {server.returncode}")
        envs = [{**env, "RANK": str(r), "WORLD_SIZE": str(workers), "LOCAL_RANK": "0", SERVERS_ENV: endpoint,
                 CLIENTS_ENV: str(workers)} for r in range(workers)]
        cmds = [netns.ns_exec(tb.server(r + 1).namespace, worker) for r in range(workers)]
        return run_workers(cmds, envs, timeout=timeout_s)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()


def run_processes(args: argparse.Namespace) -> dict[str, Any]:
    """The real-process section: TAC vs random order on 1 server + 4 workers; returns its JSON section."""
    import tempfile

    from gradsync.errors import GradsyncError
    from gradsync.order import example_input, priorities

    workers = 4
    params, layers = vgg16_plan(args.scale)
    nbytes = 4 * sum(n for _, n in params)
    rate_bps = _rate_bits(args.rate)
    comm_s = workers * nbytes * 8 / (rate_bps * GOODPUT)  # the server NIC sends every worker its pull
    total_flops = sum(f for _, f in layers)
    fwd_s = args.comp_ratio * comm_s if args.compute_s is None else args.compute_s
    layers_s = [[keys, fwd_s * f / total_flops] for keys, f in layers]
    t0 = time.perf_counter()
    tac_prio = priorities("vgg16", example_input("vgg16", batch=1, image_size=32), method="tac")
    tac_s = time.perf_counter() - t0
    print(f"processes: {len(params)} tensors, {nbytes / 1e6:.2f} MB per worker (VGG-16 / {args.scale}), "
          f"{workers} workers, rate {args.rate} ({args.shaping}), est. server-NIC time {comm_s * 1e3:.0f} ms/iter, "
          f"synthetic forward {fwd_s * 1e3:.0f} ms, TAC computed in {tac_s:.1f} s", flush=True)
    tb = None
    if args.shaping == "testbed":
        from gradsync.testbed import available, control

        reason = available()
        if reason:
            raise GradsyncError(f"--shaping testbed: {reason}; use --shaping none for an unshaped loopback run")
        tb = control.up("switch:5", rate=args.rate)
    results: dict[str, Any] = {}
    try:
        for order in ("random", "tac"):
            with tempfile.TemporaryDirectory(prefix="tictac-") as tmp:
                plan_path = Path(tmp) / "plan.json"
                plan_path.write_text(json.dumps({
                    "mode": args.mode, "order": order, "params": params, "layers": layers_s, "priorities": tac_prio,
                    "iterations": args.iterations, "warmup": args.warmup, "seed": args.seed,
                    "backward_factor": 2.0}))
                t1 = time.perf_counter()
                rc = _run_job(args.shaping, plan_path, Path(tmp), workers, 600.0, tb)
                if rc != 0:
                    raise GradsyncError(f"the {order} run failed with exit code {rc} (see the [rank N] lines above)")
                ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(workers)]
            steps = [s for r in ranks for s in r["step_s"]]
            per_iter = [max(r["step_s"][i] for r in ranks) for i in range(args.iterations)]
            results[order] = {"step": _stats(steps), "iteration_max": _stats(per_iter),
                              "blocked_mean_s": statistics.fmean(b for r in ranks for b in r["blocked_s"]),
                              "step_s_by_rank": [r["step_s"] for r in ranks], "wall_s": time.perf_counter() - t1}
            st = results[order]["step"]
            print(f"  {order:6s}: step mean {st['mean_s'] * 1e3:7.1f} ms  p50 {st['p50_s'] * 1e3:7.1f}  "
                  f"p95 {st['p95_s'] * 1e3:7.1f}  (forward blocked on pulls {results[order]['blocked_mean_s'] * 1e3:.0f} ms)",
                  flush=True)
    finally:
        if tb is not None:
            from gradsync.testbed import control

            control.down()
    r, t = results["random"]["step"], results["tac"]["step"]
    section = {
        "config": {"workers": workers, "servers": 1, "model": "vgg16", "scale": args.scale, "bytes_per_worker": nbytes,
                   "mode": args.mode, "shaping": args.shaping, "rate": args.rate, "comp_ratio": args.comp_ratio,
                   "forward_compute_s": fwd_s, "est_server_nic_s": comm_s, "iterations": args.iterations,
                   "warmup": args.warmup, "seed": args.seed, "tac_compute_s": tac_s,
                   "compute": "synthetic: time.sleep per layer, proportional to its FLOPs at 224x224"},
        "tac_priorities": tac_prio, **results,
        "mean_gain": 1 - t["mean_s"] / r["mean_s"], "p95_gain": 1 - t["p95_s"] / r["p95_s"],
        "goal": {"mean_gain": 0.15, "p95_gain": 0.30},
    }
    section["goal_met"] = section["mean_gain"] >= 0.15 and section["p95_gain"] >= 0.30
    return section


def _rate_bits(text: str) -> float:
    from gradsync.testbed.build import parse_rate

    return parse_rate(text) * 1e6  # parse_rate gives Mbit/s


def plot_processes(section: dict[str, Any], path: Path) -> Path:
    """CDF of the step time, TAC vs random order (TicTac Fig. 12b)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for order, color in (("random", "tab:gray"), ("tac", "tab:blue")):
        xs = sorted(s for rank in section[order]["step_s_by_rank"] for s in rank)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        st = section[order]["step"]
        ax.step([x * 1e3 for x in xs], ys, where="post", color=color,
                label=f"{order.upper() if order == 'tac' else order}: mean {st['mean_s'] * 1e3:.0f} ms, "
                      f"p95 {st['p95_s'] * 1e3:.0f} ms")
    c = section["config"]
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("CDF")
    ax.set_title(f"PS, 1 server + {c['workers']} workers, VGG-16/{c['scale']} params, {c['rate']} "
                 f"({c['shaping']}), {c['mode']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from gradsync.models import MODELS

    p = argparse.ArgumentParser(prog="gradsync bench tictac", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="32x32 inputs and 3 random orders (about a minute); "
                   "with --processes: 10 iterations, scale 128")
    p.add_argument("--models", default=",".join(MODELS.names()), help="comma-separated models (default: all)")
    p.add_argument("--ratio", type=float, default=1.0, help="communication/computation ratio (default 1)")
    p.add_argument("--workers", type=int, default=4, help="workers for the straggler experiment (default 4)")
    p.add_argument("--random-runs", type=int, default=None, help="random orders per model (default 10, quick 3)")
    p.add_argument("--image-size", type=int, default=None, help="input pixels per side (default 64, quick 32)")
    p.add_argument("--runs", type=int, default=5, help="profiling runs per op, minimum kept (default 5, as the seed)")
    p.add_argument("--inference", action="store_true", help="inference iterations instead of training")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    g = p.add_argument_group("real processes (--processes)")
    g.add_argument("--processes", action="store_true", help="run the PS section (1 server, 4 workers) instead")
    g.add_argument("--shaping", choices=("testbed", "none"), default="testbed",
                   help="testbed: namespaces + tc at --rate (root); none: unshaped loopback")
    g.add_argument("--rate", default="400mbit", help="link rate of every testbed NIC (default 400mbit)")
    g.add_argument("--scale", type=int, default=None, help="divide every VGG-16 tensor's size by this (default 64, quick 128)")
    g.add_argument("--iterations", type=int, default=None, help="measured iterations per order (default 50, quick 10)")
    g.add_argument("--warmup", type=int, default=2, help="unmeasured iterations first (default 2)")
    g.add_argument("--mode", choices=("inference", "training"), default="inference",
                   help="inference: pull + forward; training: + backward and a synchronous push")
    g.add_argument("--comp-ratio", type=float, default=1.0, help="synthetic forward time / estimated pull time")
    g.add_argument("--compute-s", type=float, default=None, help="synthetic forward time in seconds (overrides ratio)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random orders")
    args = p.parse_args(argv)
    args.scale = args.scale or (128 if args.quick else 64)
    args.iterations = args.iterations or (10 if args.quick else 50)
    args.random_runs = args.random_runs or (3 if args.quick else 10)
    args.image_size = args.image_size or (32 if args.quick else 64)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulation section; write ``tictac.json`` and ``tictac.png``."""
    from gradsync.errors import GradsyncError
    from gradsync.models import MODELS

    args = _parse(argv)
    if args.processes:
        if args.scale < 1 or args.iterations < 1 or args.warmup < 0 or args.comp_ratio < 0:
            raise GradsyncError(f"--scale {args.scale} and --iterations {args.iterations} must be >= 1, --warmup "
                                f"{args.warmup} and --comp-ratio {args.comp_ratio} >= 0")
        print(" ".join(f"{k}={v}" for k, v in vars(args).items()), flush=True)
        section = run_processes(args)
        machine = {"platform": platform.platform(), "python": platform.python_version()}
        json_path = write_results(args.out, {"machine": machine, "processes": section})
        png_path = plot_processes(section, args.out / "tictac_processes.png")
        print(f"wrote {json_path} and {png_path}", flush=True)
        print(f"SUMMARY: TAC mean step {section['tac']['step']['mean_s'] * 1e3:.0f} ms vs random "
              f"{section['random']['step']['mean_s'] * 1e3:.0f} ms ({section['mean_gain']:.1%} faster; goal 15%), "
              f"p95 {section['tac']['step']['p95_s'] * 1e3:.0f} vs {section['random']['step']['p95_s'] * 1e3:.0f} ms "
              f"({section['p95_gain']:.1%} lower; goal 30%)", flush=True)
        return 0
    names = [MODELS.canonical(n.strip()) for n in args.models.split(",") if n.strip()]
    if not names:
        raise GradsyncError("--models is empty; name at least one model from 'gradsync models'")
    if args.workers < 1 or args.random_runs < 1:
        raise GradsyncError(f"--workers {args.workers} and --random-runs {args.random_runs} must be >= 1")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(" ".join(f"{k}={v}" for k, v in config.items()), flush=True)
    t0 = time.perf_counter()
    rows = simulate_models(names, ratio=args.ratio, workers=args.workers, image_size=args.image_size,
                           random_runs=args.random_runs, runs=args.runs, training=not args.inference)
    gain = [1 - r["tac_over_random"] for r in rows]
    summary = (f"SUMMARY: TAC makespan is {statistics.fmean(gain):.1%} below random on average "
               f"(best {max(gain):.1%}, worst {min(gain):.1%}); mean E random {statistics.fmean(r['random']['E'] for r in rows):.3f}, "
               f"TIC {statistics.fmean(r['tic']['E'] for r in rows):.3f}, TAC {statistics.fmean(r['tac']['E'] for r in rows):.3f}; "
               f"straggler with random orders up to {max(r['workers']['random_straggler_percent_max'] for r in rows):.1f}%, "
               f"with TAC {max(r['workers']['tac_straggler_percent'] for r in rows):.1f}%")
    machine = {"platform": platform.platform(), "python": platform.python_version()}
    json_path = write_results(args.out, {"machine": machine, "simulation": {
        "config": config, "rows": rows, "summary": summary, "wall_s": time.perf_counter() - t0}})
    png_path = plot_simulation(rows, args.out / "tictac.png")
    print(f"wrote {json_path} and {png_path}", flush=True)
    print(summary, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
