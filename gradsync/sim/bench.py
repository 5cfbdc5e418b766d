"""Named benchmarks for ``gradsync bench``, and the simulator's own: ``sim-scaling``.

The registry maps a name to a ``target``, ``"package.module:function"``, imported only when run, so registering
costs nothing and a benchmark's heavy imports stay out of the CLI. The function takes ``argv`` (the arguments
after the name) and returns an exit code. Other issues add theirs with :func:`register_benchmark`.

The rule for where a benchmark lives: ``sim-scaling`` ships with gradsync (this module); every other one is a
module of the source checkout's ``benchmarks`` package (``benchmarks/``, which the installed package does not
ship: the benchmarks read ``benchmarks/topologies``, write ``benchmarks/results`` and some plan against git
revisions) and is registered with ``checkout=True``. Run from a checkout (an editable install, ``pip install
-e .``), ``gradsync bench NAME`` imports ``benchmarks.NAME`` from that checkout, whatever the working directory;
from an installed gradsync without one it stops with an error that says so and names the fix.

``sim-scaling`` measures :func:`gradsync.sim.simulate` on large step-synchronous schedules: BML on BCube
(when the ``bml`` synthesizer is registered), the parameter server on ``switch:N`` and ring allreduce on
``ring:N``, each streaming and store-and-forward, without and with a per-hop latency. The goal is a schedule
of ~250k transfers with ~60k flows active at once simulated in < 30 s on 2 cores (planning not counted).
It writes ``sim_scaling.json`` and ``sim_scaling.png`` to ``--out``::

    gradsync bench sim-scaling                 # default cases (about a minute)
    gradsync bench sim-scaling --quick         # small cases, seconds
    gradsync bench sim-scaling --large         # also BML on BCube(32, 2): 4.2M transfers, needs ~8 GB
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradsync.errors import GradsyncError
from gradsync.registry import Registry

__all__ = ["Benchmark", "BENCHMARKS", "register_benchmark", "CHECKOUT_PACKAGE", "SimCase", "SIM_CASES",
           "sim_scaling_main", "checkout_available", "balanced_orders", "paired_ratios", "bootstrap_median_ci"]

#: Where a source checkout would be, were gradsync imported from one (an editable install).
_ROOT = Path(__file__).resolve().parents[2]
#: The checkout's package of benchmarks (``benchmarks/__init__.py`` beside ``gradsync/``); not installed.
CHECKOUT_PACKAGE = "benchmarks"


def checkout_available() -> bool:
    """Whether gradsync runs from a source checkout whose ``benchmarks/`` package the ``checkout`` ones need."""
    return (_ROOT / CHECKOUT_PACKAGE / "__init__.py").is_file()


# ---- side by side: the order methods run in, and what their paired samples say -------------------------------
def balanced_orders(methods: Sequence[str]) -> list[tuple[str, ...]]:
    """Orders to run two or three ``methods`` in, one per round, cycling: each method takes each position equally
    often and follows each other method equally often (three: never itself; two: ABBA).

    Why: on a machine with few cores the round before shapes the next (gloo's threads, caches, the allocator). In
    ``bench hooks`` a plain rotation (d t g, t g d, g d t) had ``torch_fp16`` follow ``ddp`` twice as often as
    ``gradsync_fp16``, and that alone moved their ratio by several percent. A carry-over-balanced (Williams-type) sequence
    gives every method the same neighbours; for three it is found among the 5! sequences of the six orders.
    """
    methods = tuple(methods)
    if len(set(methods)) != len(methods) or len(methods) not in (2, 3):
        raise GradsyncError(f"balanced_orders takes 2 or 3 distinct methods, got {list(methods)}")
    perms = list(itertools.permutations(methods))
    if len(methods) == 2:
        return perms
    for rest in itertools.permutations(perms[1:]):
        flat = [m for order in (perms[0], *rest) for m in order]
        counts = collections.Counter(zip(flat[-1:] + flat[:-1], flat))
        if all(a != b for a, b in counts) and len(counts) == 6 and len(set(counts.values())) == 1:
            return [perms[0], *rest]
    raise AssertionError("unreachable: a balanced sequence of three methods' orders exists")  # pragma: no cover


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]``: each step's two methods ran back to back, so a slow spell of the shared machine
    (another process, a frequency change) scales both and cancels in their ratio, where it would move
    either median alone."""
    if len(a) != len(b) or not a:
        raise GradsyncError(f"paired samples need equal, non-zero lengths (got {len(a)} and {len(b)})")
    return [x / y for x, y in zip(a, b)]


def bootstrap_median_ci(values: Sequence[float], level: float = 0.95, resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap confidence interval for the median of ``values`` (seeded: the same samples give
    the same interval)."""
    if not values or not 0 < level < 1 or isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise GradsyncError(f"bootstrap_median_ci needs samples ({len(values)} given), 0 < level < 1 (got {level!r}) "
                            f"and an integer resamples >= 1 (got {resamples!r})")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


@dataclass(frozen=True)
class Benchmark:
    """A named benchmark: ``target`` is ``module:function``; ``checkout`` marks a module of the source checkout's
    :data:`CHECKOUT_PACKAGE` (``benchmarks.plan_scaling``), which an installed gradsync does not have."""

    name: str
    target: str
    summary: str
    checkout: bool = False

    def load(self) -> Callable[[Sequence[str] | None], int]:
        where, _, func = self.target.rpartition(":")
        if not where or not func or where.endswith(".py") or "/" in where:
            raise GradsyncError(f"benchmark {self.name!r} has target {self.target!r}; write module:function")
        if self.checkout:
            if where.split(".")[0] != CHECKOUT_PACKAGE:
                raise GradsyncError(f"benchmark {self.name!r}: a checkout benchmark's module is in the "
                                    f"{CHECKOUT_PACKAGE!r} package, not {where!r}")
            _checkout_package(self.name, where)
        module = importlib.import_module(where)
        fn = getattr(module, func, None)
        if not callable(fn):
            raise GradsyncError(f"benchmark {self.name!r}: {where} has no function {func!r}")
        return fn

    def run(self, argv: Sequence[str]) -> int:
        return int(self.load()(list(argv)) or 0)


def _checkout_package(name: str, module: str) -> None:
    """Make ``import benchmarks.x`` find the checkout's ``benchmarks/``, from any working directory.

    Already imported (``python -m benchmarks.x`` from the checkout root, pytest): it must be this checkout's.
    Otherwise the package is imported from its directory by location, under its own name, so its modules
    import each other as ``benchmarks.x``; ``sys.path`` is left as it is. No such directory: gradsync is
    installed without its checkout, and the error says what to do."""
    package_dir = _ROOT / CHECKOUT_PACKAGE
    loaded = sys.modules.get(CHECKOUT_PACKAGE)
    if loaded is not None:
        paths = [Path(p).resolve() for p in getattr(loaded, "__path__", ())]
        if package_dir.resolve() not in paths:
            raise GradsyncError(
                f"benchmark {name!r}: the imported {CHECKOUT_PACKAGE!r} package ({', '.join(map(str, paths)) or loaded!r}) "
                f"is not the one of the gradsync checkout at {_ROOT}; run it from that checkout")
        return
    init = package_dir / "__init__.py"
    if not init.is_file():
        raise GradsyncError(
            f"benchmark {name!r} needs a gradsync source checkout: it is {module}, a module of the checkout's "
            f"{CHECKOUT_PACKAGE}/ package, which an installed gradsync ({_ROOT / 'gradsync'}) does not ship. "
            f"Clone the gradsync repository (git clone), install that clone with 'pip install -e .' and run it "
            f"from there: 'gradsync bench {name}', or 'python -m {module}' in the clone's root")
    spec = importlib.util.spec_from_file_location(CHECKOUT_PACKAGE, init, submodule_search_locations=[str(package_dir)])
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[CHECKOUT_PACKAGE] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[CHECKOUT_PACKAGE]
        raise


BENCHMARKS: Registry[Benchmark] = Registry("benchmark", GradsyncError)


def register_benchmark(name: str, target: str, summary: str, *, checkout: bool = False) -> Benchmark:
    """Add a benchmark to ``gradsync bench``; ``target`` (``module:function``) is imported only when it runs.
    ``checkout=True``: the module is in the source checkout's ``benchmarks`` package (see the module's rule)."""
    return BENCHMARKS.add(name, Benchmark(name, target, summary, checkout))


register_benchmark("sim-scaling", "gradsync.sim.bench:sim_scaling_main",
                   "simulator time on large schedules (BML/BCube, ps, ring); writes sim_scaling.{json,png}")
register_benchmark("plan-scaling", "benchmarks.plan_scaling:main",
                   "lp planner time as topologies grow; writes plan_scaling.{json,png}", checkout=True)
register_benchmark("plan-fabrics", "benchmarks.plan_fabrics:main",
                   "issue 18: lp (and ring) planning of Fat-Trees, BCubes, ForestColl's A100/MI250 fabrics and random "
                   "regular graphs to 4096 ranks in fresh processes: time, peak memory, cost, certified gap; "
                   "--baseline REV side by side; writes plan_fabrics.{json,png}", checkout=True)
register_benchmark("bml-fig5", "benchmarks.bml_fig5:main",
                   "BML Fig. 5: GST of BML/PS on BCube vs hierarchical/PS on Fat-Tree; writes bml_fig5.{json,png}", checkout=True)
register_benchmark("allreduce-loopback", "benchmarks.allreduce_loopback:main",
                   "gradsync executor (ring/tree/lp/multiring) vs gloo and MPI allreduce, 2 and 4 processes on "
                   "loopback; writes allreduce_loopback.{json,png}", checkout=True)
register_benchmark("bml-testbed", "benchmarks.bml_testbed:main",
                   "BML in miniature on the emulated cluster (root): GST and JCT of BML on BCube(3,2) vs PS on "
                   "switch:9 over TCP, measured and simulated; writes bml_testbed.{json,png}", checkout=True)
register_benchmark("vs-native", "benchmarks.vs_native:main",
                   "gradsync auto vs gloo all_reduce and DDP on the emulated cluster (root): racks:2,3,4, bcube:3,2, "
                   "switch:8; allreduce 4/12.5/50 MiB and LeNet-5 steps, with the cost model's predictions; writes "
                   "vs_native.{json,png}", checkout=True)
register_benchmark("mergecomp", "benchmarks.mergecomp:main", "MergeComp: codec time vs size, ResNet-50 step time layer-wise/y/Algorithm 2/exact on gloo, accuracy; writes mergecomp.{json,png}", checkout=True)
register_benchmark("codecs", "benchmarks.codecs:main",
                   "every compressor vs GRACE's algorithm at 1e4/1e6/2.5e7 elements: compress+decompress time, "
                   "error, bytes; writes codecs.{json,png}", checkout=True)
register_benchmark("hooks", "benchmarks.hooks:main",
                   "gradsync's fp16 DDP hook vs torch's fp16_compress_hook (and plain DDP), 2 processes on gloo "
                   "loopback, steps alternating; writes hooks.json", checkout=True)
register_benchmark("tictac", "benchmarks.tictac:main",
                   "TicTac: makespan, E and stragglers of random/TIC/TAC orders per model in the iteration "
                   "simulator; writes tictac.{json,png}", checkout=True)
register_benchmark("mxnet-mpi", "benchmarks.mxnet_mpi:main",
                   "MXNET-MPI in miniature: 8 workers, 2 servers, clients 8/4/2/1/collective; time per epoch and "
                   "accuracy vs time of dist/mpi SGD, ASGD, ESGD; writes mxnet_mpi.{json,png}", checkout=True)
register_benchmark("gpu", "benchmarks.gpu_check:main",
                   "the GPU check: every compressor by optimizer and DDP hook on NCCL and on gloo with CUDA tensors, "
                   "the executor's CUDA path, codecs and hooks against GRACE and torch; writes gpu_check-GPU.json "
                   "(a CPU dry run without a GPU)", checkout=True)
register_benchmark("compress-testbed", "benchmarks.compress_testbed:main",
                   "issue 20: DDP, torch's fp16/PowerSGD hooks and gradsync's compressors with MergeComp on the "
                   "emulated racks:2,2,2 cluster (root; --loopback without): step time and accuracy; writes "
                   "compress_testbed.{json,png}", checkout=True)
register_benchmark("compression-sweep", "benchmarks.compression_sweep:main",
                   "issue 40: compression='auto' vs DDP, 'none' and each fixed codec over 36 configurations (3 rates x "
                   "switch:4/two-tier racks x LeNet-5/ResNet-18/MLP x optimizer/hook) on the emulated cluster (root; "
                   "--quick on loopback without); writes compression_sweep.{json,png}", checkout=True)
register_benchmark("cast-accuracy", "benchmarks.cast_accuracy:main",
                   "issue 40: test accuracy of fp16/bf16 on the wire (and fp16 with a shared scale) against the exact "
                   "average and a one-ulp jitter, LeNet-5 and the MLP over seeds, one process; writes "
                   "cast_accuracy.{json,png}", checkout=True)
register_benchmark("adapt", "benchmarks.adapt_overhead:main",
                   "issue 39: what the runtime's watch costs on a wire that does not change: the same 4 MiB allreduce "
                   "with adapt on and off, alternating in the same 3 processes on gloo loopback; writes adapt.{json,png}",
                   checkout=True)
register_benchmark("adapt-testbed", "benchmarks.adapt_testbed:main",
                   "issue 39 (a): one server's NIC cut to 1/4 mid-job on the emulated cluster (root): static gradsync, "
                   "gradsync with the watch, and gloo's all_reduce side by side, per round; writes "
                   "adapt_testbed.{json,png}", checkout=True)
register_benchmark("price-ahead", "benchmarks.price_ahead:main",
                   "issue 40: a job's first calls of the 8 and 16 MiB classes on the two-tier file, priced when first "
                   "needed or adopted from a child that priced them during the steps before, alternating in one "
                   "process; writes price_ahead.{json,png}", checkout=True)
register_benchmark("ps-loopback", "benchmarks.ps_loopback:main",
                   "PS pushpull round trip on loopback (authenticated, without a secret, and push + pull) vs a gloo send/recv round "
                   "trip of the same size, in one run; writes ps_loopback.{json,png}", checkout=True)


# ---- sim-scaling -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimCase:
    """One schedule to simulate: ``algorithm`` on ``topology`` with ``pipeline`` sub-chunks."""

    name: str
    topology: str
    algorithm: str
    pipeline: int = 1


SIM_CASES: dict[str, tuple[SimCase, ...]] = {
    "quick": (
        SimCase("bml-bcube4", "bcube:4,2", "bml"),
        SimCase("ps-switch16", "switch:16", "ps"),
        SimCase("ring-ring16", "ring:16", "ring"),
    ),
    "default": (
        SimCase("bml-bcube16", "bcube:16,2", "bml"),
        SimCase("ps-switch128", "switch:128", "ps"),
        SimCase("ring-ring250", "ring:250", "ring"),
        SimCase("ring-switch64-p8", "switch:64", "ring", 8),
    ),
    "large": (SimCase("bml-bcube32", "bcube:32,2", "bml"),),
}
GOAL_S = 30.0
GOAL_TRANSFERS = 200_000
RESULT_TYPE = "gradsync.bench.sim_scaling"


@dataclass
class SimRun:
    case: str
    topology: str
    algorithm: str
    pipeline: int
    mode: str
    latency_s: float
    transfers: int = 0
    flows: int = 0
    max_active_flows: int = 0
    events: int = 0
    fill_rounds: int = 0
    plan_s: float = 0.0
    sim_s: float = 0.0
    gst_over_tf: float = 0.0
    planned_cost: float = 0.0
    planned_time_s: float = 0.0
    time_s: float = 0.0
    skipped: str | None = None


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gradsync bench sim-scaling",
        description="Time gradsync.sim.simulate on large schedules (BML/BCube, ps, ring), both modes, with and "
                    "without latency; goal: ~250k transfers in < 30 s on 2 cores.",
    )
    p.add_argument("--quick", action="store_true", help="small cases only (seconds)")
    p.add_argument("--large", action="store_true", help="also BML on BCube(32, 2) (4.2M transfers, minutes, ~8 GB)")
    p.add_argument("--cases", default="", help="comma-separated case names (see --list); default: the default set")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--latency", type=float, default=1e-6, help="per-hop latency of the latency runs (s, default 1e-6)")
    p.add_argument("--size", type=float, default=1e9, help="allreduce size in bytes (default 1e9)")
    p.add_argument("--modes", default="streaming,store-and-forward", help="modes to run (default both)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    return p.parse_args(argv)


def _machine() -> dict[str, Any]:
    import numpy as np
    import scipy

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "numpy": np.__version__, "scipy": scipy.__version__}


def _count(n: int) -> str:
    """4190208 -> 4.2M, 261120 -> 261k, 1200 -> 1.2k, 480 -> 480."""
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 10_000:
        return f"{n / 1e3:.0f}k"
    return f"{n / 1e3:.1f}k" if n >= 1000 else str(n)


def _plot(path: Path, runs: Sequence[SimRun]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r.skipped is None]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.32 * max(len(done), 3)))
    mode = {"streaming": "stream", "store-and-forward": "s&f"}
    labels = [f"{r.case} {mode[r.mode]}{' +α' if r.latency_s else ''} ({_count(r.transfers)} transfers, "
              f"{_count(r.max_active_flows)} active)" for r in done]
    colors = ["tab:blue" if r.mode == "streaming" else "tab:orange" for r in done]
    ax.barh(range(len(done)), [max(r.sim_s, 1e-3) for r in done], color=colors)
    ax.axvline(GOAL_S, color="gray", ls="--", lw=1)
    ax.text(GOAL_S, -0.6, f" goal {GOAL_S:g} s", color="gray", fontsize=8, va="bottom")
    ax.set_yticks(range(len(done)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("simulate() wall time (s), planning excluded")
    ax.set_title("gradsync.sim: simulate() time\nblue: streaming, orange: store-and-forward; +α: per-hop latency", fontsize=10)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sim_scaling_main(argv: Sequence[str] | None = None) -> int:
    """Run the sim-scaling cases; print one line per run and a summary; write JSON and PNG."""
    from gradsync.plan import SYNTHESIZERS, PlanOptions, predicted_time, synthesize
    from gradsync.sim.engine import simulate
    from gradsync.topology import BUILDERS, get_topology

    args = _parse(argv)
    every = {c.name: c for group in SIM_CASES.values() for c in group}
    if args.list:
        for group, cases in SIM_CASES.items():
            for c in cases:
                print(f"{c.name:18s} {group:8s} {c.algorithm} on {c.topology}" + (f", pipeline {c.pipeline}" if c.pipeline > 1 else ""))
        return 0
    if args.cases:
        unknown = [n for n in args.cases.split(",") if n not in every]
        if unknown:
            raise GradsyncError(f"unknown sim-scaling case(s) {unknown}; known: {', '.join(every)}")
        cases = [every[n] for n in args.cases.split(",")]
    else:
        cases = list(SIM_CASES["quick" if args.quick else "default"]) + (list(SIM_CASES["large"]) if args.large else [])
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("streaming", "store-and-forward") for m in modes):
        raise GradsyncError(f"--modes {args.modes!r}: use streaming and/or store-and-forward")
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(" ".join(f"{k}={v}" for k, v in config.items()), flush=True)
    print(f"{'case':18s} {'mode':18s} {'alpha':>7s} {'transfers':>9s} {'max act':>8s} {'events':>6s} "
          f"{'plan_s':>7s} {'sim_s':>7s} {'GST/T_F':>9s} {'planned':>9s}", flush=True)
    runs: list[SimRun] = []
    for case in cases:
        if case.algorithm not in SYNTHESIZERS or case.topology.split(":")[0] not in BUILDERS:
            runs.append(SimRun(case.name, case.topology, case.algorithm, case.pipeline, "-", 0.0,
                               skipped=f"{case.algorithm} or {case.topology} is not registered"))
            print(f"{case.name:18s} SKIPPED ({runs[-1].skipped})", flush=True)
            continue
        topo = get_topology(case.topology)
        t0 = time.perf_counter()
        schedule = synthesize(case.algorithm, topo, PlanOptions(pipeline=case.pipeline), check=False)
        plan_s = time.perf_counter() - t0
        cost = schedule.link_loads(topo).cost(topo.directed_costs)
        for mode in modes:
            for lat in (0.0, args.latency):
                run = SimRun(case.name, case.topology, case.algorithm, case.pipeline, mode, lat,
                             transfers=schedule.num_transfers, plan_s=plan_s, planned_cost=cost,
                             planned_time_s=predicted_time(schedule, topo, args.size, lat, cost=cost))
                t0 = time.perf_counter()
                r = simulate(schedule, topo, args.size, streaming=mode == "streaming", latency_s=lat, progress=False)
                run.sim_s = time.perf_counter() - t0
                run.flows, run.max_active_flows, run.events = r.num_flows, r.max_active_flows, r.events
                run.fill_rounds, run.gst_over_tf, run.time_s = r.fill_rounds, r.gst_over_tf, r.time_s
                runs.append(run)
                print(f"{case.name:18s} {mode:18s} {lat:7.1e} {run.transfers:9d} {run.max_active_flows:8d} "
                      f"{run.events:6d} {plan_s:7.2f} {run.sim_s:7.2f} {run.gst_over_tf:9.5f} {cost:9.5f}", flush=True)
                del r
    big = [r for r in runs if r.skipped is None and r.transfers >= GOAL_TRANSFERS]
    if big:
        worst = max(big, key=lambda r: r.sim_s)
        verdict = "yes" if worst.sim_s < GOAL_S else "NO"
        summary = (f"SUMMARY: schedules with >= {GOAL_TRANSFERS // 1000}k transfers simulate in < {GOAL_S:g} s: {verdict} "
                   f"(slowest {worst.case} {worst.mode} α={worst.latency_s:g}: {worst.sim_s:.2f} s, "
                   f"{worst.transfers} transfers, {worst.max_active_flows} active at once)")
    else:
        summary = f"SUMMARY: no case with >= {GOAL_TRANSFERS // 1000}k transfers was run"
    json_path, png_path = args.out / "sim_scaling.json", args.out / "sim_scaling.png"
    json_path.write_text(json.dumps({"type": RESULT_TYPE, "machine": _machine(), "config": config,
                                     "goal": {"seconds": GOAL_S, "transfers": GOAL_TRANSFERS},
                                     "runs": [asdict(r) for r in runs], "summary": summary}, indent=2) + "\n")
    _plot(png_path, runs)
    print(f"wrote {json_path} and {png_path}", flush=True)
    print(summary, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(sim_scaling_main())
