"""Allreduce over loopback: gradsync's executor against gloo's and MPI's own allreduce, in the same processes.

What is compared, for every world size (``--worlds``, default 2 and 4 processes on this machine) and message
size (``--sizes``, default 4 KB ... 64 MB of float32 in powers of 4):

* ``gs-<alg>``: :class:`gradsync.comm.Executor` running the schedule ``gradsync.plan.synthesize(alg,
  switch:W, PlanOptions(pipeline=P))`` over :class:`gradsync.comm.TorchTransport` (``torch.distributed`` gloo
  point-to-point), for each of ``--algorithms`` (default ``ring,tree,lp,multiring``) at ``--pipeline`` P;
* ``gloo``: ``torch.distributed.all_reduce`` on the same gloo process group;
* ``mpi``: mpi4py's ``COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` on the tensor's numpy view;
* ``gs-mpi-ring``: the executor running the ring schedule over :class:`gradsync.comm.mpi.MPITransport`;
* ``gs-ring-p<k>``: the ring at other pipeline depths (``--sweep``), only for messages >= ``--sweep-min``;
* ``gs-auto``: what a user gets by default, ``gradsync.init()``-style :class:`gradsync.comm.Runtime` with
  ``algorithm="auto"`` on ``switch:W`` and ``Runtime.allreduce(buf)`` (size-aware choice, native included).
  Its ratio to gloo is reported at *every* size (issue 13's goal: >= 0.97x from 4 KB to 64 MB).

Method. The workers are started with ``mpirun`` when MPI is usable here (:func:`gradsync.comm.mpi.mpirun_command`;
each rank takes its rank and size from mpi4py and joins the gloo group on ``MASTER_ADDR=127.0.0.1`` and a
``MASTER_PORT`` the parent chose), so every method runs in the very same processes; without MPI (or with
``--no-mpi``) they are started with :func:`gradsync.launch.launch_local` and the MPI series are skipped.
Per size: every method runs once as a warm-up, and that run's result is checked against the closed form
(rank r contributes ``(i mod 1024) + 1024 r`` at position i, so the sum is ``W (i mod 1024) + 512 W (W-1)``,
exact in float32 whatever the order of additions). Then, per repetition, every rank waits at a
barrier and the methods take turns in a shuffled order (the same on every rank; a fixed rotation would
make each method always follow the same one), each timing one allreduce of a zeroed buffer; messages under
16 MB run up to 16 such rounds per sample (:func:`inner_iterations`) and take each method's mean per call.
A sample is the slowest rank's time. Reported: the median of ``--reps`` samples (default 15;
``--large-reps``, default 9, for messages >= 64 MB) and algorithmic bandwidth = bytes / median time. Rank 0
writes each world's results; the parent merges them, prints the tables and, for messages >= 16 MB, the ratios
of the best gradsync series to gloo and to MPI (median algbw), plus the like-for-like ratios (best gradsync
over gloo p2p / gloo, gradsync over MPI p2p / MPI), and writes ``allreduce_loopback.json`` and
``allreduce_loopback.png`` to ``--out``.

Loopback numbers measure CPU, memory bandwidth and the engines' software paths, not a network; with more
processes than cores (4 on a 2-core machine) they include scheduling noise.

Run from the repository root::

    gradsync bench allreduce-loopback                       # defaults: 1-3 minutes on 2 cores
    .venv/bin/python -m benchmarks.allreduce_loopback --worlds 2 --sizes 64K,16M --reps 5
    .venv/bin/python -m benchmarks.allreduce_loopback --no-mpi --algorithms ring,tree --pipeline 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import pythonpath

RESULT_TYPE = "gradsync.bench.allreduce_loopback"
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
RATIO_MIN_BYTES = 16 * 2**20
INNER_BYTES = 16 << 20  # a timed sample moves at least this many bytes per method (up to INNER_MAX calls)
INNER_MAX = 16
LARGE_BYTES = 64 * 2**20
PATTERN = 1024  # rank r holds (i % PATTERN) + PATTERN * r
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


# ---- options ------------------------------------------------------------------------------------------------
def parse_bytes(text: str) -> int:
    """``"4K"`` -> 4096, ``"64M"`` -> 67108864, ``"1000"`` -> 1000 (binary units; a trailing B is allowed)."""
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4K, 16M or 1000") from exc
    n = int(value)
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} = {n} bytes must be a positive multiple of 4 (float32)")
    return n


def human(n: int) -> str:
    """4096 -> 4K, 67108864 -> 64M, 1000 -> 1000."""
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def _ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gradsync bench allreduce-loopback",
        description="gradsync's executor (planned ring/tree/lp/multiring over gloo p2p) against "
                    "torch.distributed.all_reduce (gloo) and MPI Allreduce, side by side on loopback.",
    )
    p.add_argument("--worlds", default="2,4", help="process counts, comma-separated (default 2,4)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes in bytes, K/M suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per size and method (default 15)")
    p.add_argument("--large-reps", type=int, default=None,
                   help=f"repetitions for messages >= {human(LARGE_BYTES)} (default: --reps, at most 9)")
    p.add_argument("--algorithms", default="ring,tree,lp,multiring", help="gradsync algorithms (default ring,tree,lp,multiring)")
    p.add_argument("--pipeline", type=int, default=4, help="sub-chunks per chunk for the gradsync schedules (default 4)")
    p.add_argument("--sweep", default="1,2,4,8",
                   help="ring pipeline depths to compare at large sizes (default 1,2,4,8; '' to skip)")
    p.add_argument("--sweep-min", type=parse_bytes, default=RATIO_MIN_BYTES,
                   help=f"smallest message the sweep runs at (default {human(RATIO_MIN_BYTES)})")
    p.add_argument("--no-mpi", action="store_true", help="launch without mpirun and skip the MPI series")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one world's launch may take (default 900)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory (default benchmarks/results)")
    args = p.parse_args(argv)
    args.world_list = sorted(set(_ints(args.worlds)))
    args.size_list = sorted({parse_bytes(s) for s in args.sizes.split(",") if s.strip()})
    args.algorithm_list = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    args.sweep_list = sorted(set(_ints(args.sweep)))
    if not args.world_list or min(args.world_list) < 2:
        p.error(f"--worlds {args.worlds!r}: give process counts >= 2")
    if not args.size_list:
        p.error("--sizes: give at least one size")
    if args.large_reps is None:
        args.large_reps = min(args.reps, 9)
    if args.reps < 1 or args.large_reps < 1:
        p.error("--reps and --large-reps must be >= 1")
    if args.pipeline < 1 or any(k < 1 for k in args.sweep_list):
        p.error("pipeline depths must be >= 1")
    return args


# ---- worker (one per rank) ----------------------------------------------------------------------------------
@dataclass
class Method:
    """One series: ``op(buf)`` allreduces ``buf`` in place; runs only for messages >= ``min_bytes``."""

    name: str
    engine: str  # "gradsync-gloo", "gradsync-mpi", "gloo", "mpi"
    algorithm: str
    pipeline: int | None
    op: Callable[[Any], Any]
    min_bytes: int = 0
    messages: int | None = None  # point-to-point messages this rank posts per run (gradsync only)


def _methods(cfg: dict[str, Any], comm: Any, world: int) -> list[Method]:
    import torch.distributed as dist

    from gradsync.comm import Executor, Runtime, TorchTransport
    from gradsync.plan import PlanOptions, synthesize
    from gradsync.topology import get_topology

    topo = get_topology(f"switch:{world}")
    timeout = float(cfg["op_timeout_s"])
    transport = TorchTransport(timeout_s=timeout)
    main_p = int(cfg["pipeline"])
    methods: list[Method] = []

    def executor_method(name: str, engine: str, alg: str, p: int, tr: Any, min_bytes: int = 0) -> Method:
        ex = Executor(synthesize(alg, topo, PlanOptions(pipeline=p)), tr, timeout_s=timeout)
        return Method(name, engine, alg, p, ex.run, min_bytes, ex.program.num_messages)

    for alg in cfg["algorithms"]:
        methods.append(executor_method(f"gs-{alg}", "gradsync-gloo", alg, main_p, transport))
    methods.append(Method("gloo", "gloo", "gloo", None, dist.all_reduce))
    runtime = Runtime(transport, topo, "auto", timeout_s=timeout)
    methods.append(Method("gs-auto", "gradsync-auto", "auto", None, runtime.allreduce))
    # the very same call as "gloo" again: its ratio to "gloo" is this machine's noise floor for gs-auto's
    methods.append(Method("gloo-again", "gloo", "gloo", None, dist.all_reduce))
    if comm is not None:
        from mpi4py import MPI

        from gradsync.comm.mpi import MPITransport

        def mpi_allreduce(buf: Any) -> None:
            comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)

        methods.append(Method("mpi", "mpi", "mpi", None, mpi_allreduce))
        methods.append(executor_method("gs-mpi-ring", "gradsync-mpi", "ring", main_p, MPITransport(timeout_s=timeout)))
    if "ring" in cfg["algorithms"]:
        for p in cfg["sweep"]:
            if p != main_p:
                methods.append(executor_method(f"gs-ring-p{p}", "gradsync-gloo", "ring", p, transport, cfg["sweep_min"]))
    return methods


def inner_iterations(nbytes: int) -> int:
    """Rounds per timed sample: a small message's allreduce is shorter than the barrier's skew and than one
    scheduler time slice, so a sample interleaves several rounds of every method (shuffled each round, so
    the methods share the same scheduler weather) and reports each method's mean per call."""
    return max(1, min(INNER_MAX, INNER_BYTES // max(1, nbytes)))


def _measure_size(nbytes: int, methods: list[Method], reps: int, rank: int, world: int,
                  barrier: Callable[[], None]) -> dict[str, dict[str, Any]]:
    """Warm up and verify every method once, then time ``reps`` rounds of all methods, taking turns."""
    import torch
    import torch.distributed as dist

    n = nbytes // 4
    base = (torch.arange(n, dtype=torch.int64) % PATTERN).to(torch.float32)
    template = base + float(PATTERN * rank)
    expected = base * world + float(PATTERN * world * (world - 1) // 2)
    del base
    buf = torch.empty(n, dtype=torch.float32)
    active = [m for m in methods if nbytes >= m.min_bytes]
    ok = torch.ones(len(active), dtype=torch.float32)
    for j, m in enumerate(active):  # warm-up run, checked against the closed form
        buf.copy_(template)
        barrier()
        m.op(buf)
        ok[j] = float(torch.equal(buf, expected))
    del expected
    times = torch.zeros(reps, len(active), dtype=torch.float64)
    iters = inner_iterations(nbytes)
    buf.zero_()  # timed runs add zeros: the sum cannot overflow however many run back to back
    for r in range(reps):
        rng = random.Random(nbytes * 1009 + r)  # the same turns on every rank
        barrier()
        for _ in range(iters):
            turns = list(range(len(active)))
            rng.shuffle(turns)  # no method always follows the same one
            for j in turns:
                t0 = time.perf_counter()
                active[j].op(buf)
                times[r, j] += time.perf_counter() - t0
    times /= iters
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a sample is the slowest rank's time
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # verified only if every rank got the right sum
    out: dict[str, dict[str, Any]] = {}
    for j, m in enumerate(active):
        samples = times[:, j].tolist()
        med = statistics.median(samples)
        out[m.name] = {"median_s": med, "algbw_GBps": nbytes / med / 1e9, "samples_s": samples,
                       "verified": bool(ok[j] > 0)}
    return out


def worker(cfg: dict[str, Any]) -> int:
    """Body of one rank: join gloo (and MPI), measure every size, rank 0 writes the world's results."""
    comm = None
    if cfg["launcher"] == "mpirun":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        return _worker_body(cfg, comm, rank, world)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        if comm is not None:
            comm.Abort(1)  # otherwise the peers wait on this rank until their timeouts
        raise


def _worker_body(cfg: dict[str, Any], comm: Any, rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(cfg["op_timeout_s"])))
    methods = _methods(cfg, comm, world)
    barrier: Callable[[], None] = comm.Barrier if comm is not None else dist.barrier
    tag = f"[W={world}]"
    if rank == 0:
        print(f"{tag} {cfg['launcher']}: methods " + ", ".join(m.name for m in methods), flush=True)
    sizes: dict[str, dict[str, dict[str, Any]]] = {}
    t_all = time.perf_counter()
    for nbytes in cfg["sizes"]:
        reps = cfg["large_reps"] if nbytes >= LARGE_BYTES else cfg["reps"]
        t0 = time.perf_counter()
        res = _measure_size(nbytes, methods, reps, rank, world, barrier)
        sizes[str(nbytes)] = res
        if rank == 0:
            cells = "  ".join(f"{name} {r['algbw_GBps']:.3g}{'' if r['verified'] else ' WRONG'}" for name, r in res.items())
            print(f"{tag} {human(nbytes):>4s} x{reps} in {time.perf_counter() - t0:5.1f} s, GB/s: {cells}", flush=True)
    if rank == 0:
        info = {m.name: {"engine": m.engine, "algorithm": m.algorithm, "pipeline": m.pipeline,
                         "min_bytes": m.min_bytes, "messages_per_run": m.messages} for m in methods}
        Path(cfg["result"]).write_text(json.dumps({
            "world_size": world, "launcher": cfg["launcher"], "methods": info, "sizes": sizes,
            "measure_s": time.perf_counter() - t_all, "torch": torch.__version__,
        }) + "\n")
    barrier()
    dist.destroy_process_group()
    return 0


# ---- parent -------------------------------------------------------------------------------------------------
def _launch_world(world: int, args: argparse.Namespace, use_mpi: bool) -> dict[str, Any] | None:
    """Start ``world`` workers (mpirun or launch_local) and return rank 0's results, or None on failure."""
    from gradsync.launch import TIMEOUT_EXIT, free_port, launch_local

    with tempfile.TemporaryDirectory(prefix="gradsync-allreduce-") as tmp:
        result = Path(tmp) / "result.json"
        cfg = {"launcher": "mpirun" if use_mpi else "local", "sizes": args.size_list, "reps": args.reps,
               "large_reps": args.large_reps, "algorithms": args.algorithm_list, "pipeline": args.pipeline,
               "sweep": args.sweep_list, "sweep_min": args.sweep_min, "op_timeout_s": 120.0, "result": str(result)}
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()),
               "PYTHONPATH": pythonpath()}
        if use_mpi:
            from gradsync.comm.mpi import mpirun_command

            proc = subprocess.Popen(mpirun_command(world, argv), env=env, start_new_session=True)
            try:
                rc = proc.wait(args.timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()  # mpirun forwards it to its ranks
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # the session started above holds only this launch
                    proc.wait()
                rc = TIMEOUT_EXIT
        else:
            rc = launch_local(argv, world, env=env, timeout=args.timeout)
        if rc != 0 or not result.is_file():
            print(f"[W={world}] workers failed (exit code {rc})", flush=True)
            return None
        return json.loads(result.read_text())


def _machine() -> dict[str, Any]:
    import numpy as np

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "numpy": np.__version__}


def _best(cell: dict[str, dict[str, Any]], methods: dict[str, dict[str, Any]], engine: str) -> str | None:
    """The series of ``cell`` with the highest median algbw among engines starting with ``engine``."""
    names = [n for n in cell if methods[n]["engine"].startswith(engine)]
    return max(names, key=lambda n: cell[n]["algbw_GBps"]) if names else None


def ratios(worlds: dict[str, dict[str, Any]], min_bytes: int = RATIO_MIN_BYTES) -> list[dict[str, Any]]:
    """Per world and size >= ``min_bytes``: the best gradsync series and its median-algbw ratios to gloo and MPI.

    Also the like-for-like ratios: best gradsync over gloo p2p / gloo allreduce, and gradsync over MPI p2p /
    MPI Allreduce.
    """
    rows = []
    for w, data in worlds.items():
        for size, cell in data["sizes"].items():
            if int(size) < min_bytes:
                continue
            best = _best(cell, data["methods"], "gradsync")
            if best is None:
                continue
            bw = cell[best]["algbw_GBps"]
            gloo = cell["gloo"]["algbw_GBps"] if "gloo" in cell else None
            mpi = cell["mpi"]["algbw_GBps"] if "mpi" in cell else None
            over_gloo = _best(cell, data["methods"], "gradsync-gloo")
            over_mpi = _best(cell, data["methods"], "gradsync-mpi")
            rows.append({
                "world_size": int(w), "bytes": int(size), "best_gradsync": best, "best_algbw_GBps": bw,
                "vs_gloo": bw / gloo if gloo else None, "vs_mpi": bw / mpi if mpi else None,
                "best_over_gloo_p2p": over_gloo,
                "gloo_p2p_vs_gloo": cell[over_gloo]["algbw_GBps"] / gloo if over_gloo and gloo else None,
                "best_over_mpi_p2p": over_mpi,
                "mpi_p2p_vs_mpi": cell[over_mpi]["algbw_GBps"] / mpi if over_mpi and mpi else None,
            })
    return rows


def auto_ratios(worlds: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world and size: gloo's median time over ``gs-auto``'s (> 1: gradsync's default is faster), and
    over ``gloo-again``'s (the same call as gloo: how far two identical series differ on this machine)."""
    rows = []
    for w, data in worlds.items():
        for size, cell in data["sizes"].items():
            if "gs-auto" in cell and "gloo" in cell:
                gloo = cell["gloo"]["median_s"]
                rows.append({"world_size": int(w), "bytes": int(size), "auto_vs_gloo": gloo / cell["gs-auto"]["median_s"],
                             "gloo_again_vs_gloo": gloo / cell["gloo-again"]["median_s"] if "gloo-again" in cell else None})
    return rows


def print_tables(worlds: dict[str, dict[str, Any]]) -> None:
    for w, data in worlds.items():
        names = list(data["methods"])
        for title, key, fmt in (("median time (ms)", "median_s", lambda v: f"{v * 1e3:.3f}"),
                                ("algbw (GB/s)", "algbw_GBps", lambda v: f"{v:.4g}")):
            width = max(9, *(len(n) + 1 for n in names))
            print(f"\nW={w} processes ({data['launcher']}), {title}:")
            print(f"{'size':>5s}" + "".join(f"{n:>{width}s}" for n in names))
            for size, cell in data["sizes"].items():
                row = "".join(
                    f"{(fmt(cell[n][key]) + ('' if cell[n]['verified'] else '!')) if n in cell else '-':>{width}s}"
                    for n in names)
                print(f"{human(int(size)):>5s}{row}")


def plot(path: Path, worlds: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(worlds), figsize=(6.4 * len(worlds), 4.8), squeeze=False, sharey=True)
    styles = {"gloo": ("black", "-", "s"), "mpi": ("tab:red", "-", "D")}
    palette = iter(plt.get_cmap("tab10").colors[:3] + plt.get_cmap("tab10").colors[4:])
    colors: dict[str, Any] = {}
    for ax, (w, data) in zip(axes[0], worlds.items()):
        for name, info in data["methods"].items():
            xs = [int(s) for s, cell in data["sizes"].items() if name in cell]
            ys = [data["sizes"][str(s)][name]["algbw_GBps"] for s in xs]
            if not xs:
                continue
            if name in styles:
                color, ls, marker = styles[name]
            else:
                if name not in colors:
                    colors[name] = next(palette, "gray")
                color, ls, marker = colors[name], ("--" if info["min_bytes"] else ":" if "mpi" in name else "-"), "o"
            ax.plot(xs, ys, ls=ls, marker=marker, ms=4, color=color, lw=1.5 if name in styles else 1.2,
                    label=name + (f" (p{info['pipeline']})" if info["pipeline"] else ""))
        sizes = sorted(int(s) for s in data["sizes"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([human(s) for s in sizes], fontsize=8)
        ax.set_xlabel("message size (bytes, float32)")
        ax.set_title(f"{w} processes, loopback ({data['launcher']})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("algorithmic bandwidth (GB/s, median)")
    fig.suptitle("allreduce on one host: gradsync executor (gloo p2p / MPI p2p) vs gloo and MPI allreduce", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every world size; print progress, tables and ratios; write JSON and PNG. 1 if anything failed."""
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) >= 2 and argv[0] == "--worker":
        return worker(json.loads(argv[1]))
    args = _parse(argv)
    from gradsync.plan import SYNTHESIZERS
    from gradsync.topology import get_topology

    unknown = [a for a in args.algorithm_list if a not in SYNTHESIZERS]
    if unknown:
        print(f"unknown algorithm(s) {unknown}; known: {', '.join(SYNTHESIZERS.names())}", file=sys.stderr)
        return 2
    for w in args.world_list:
        for a in args.algorithm_list:
            why = SYNTHESIZERS.get(a).applicable(get_topology(f"switch:{w}"))
            if why:
                print(f"algorithm {a!r} does not apply to switch:{w}: {why}", file=sys.stderr)
                return 2
    reason = "--no-mpi"
    if not args.no_mpi:
        from gradsync.comm.mpi import mpi_available

        reason = mpi_available() or ""
    use_mpi = not reason
    print(f"worlds={args.world_list} sizes={[human(s) for s in args.size_list]} reps={args.reps}/{args.large_reps} "
          f"algorithms={args.algorithm_list} pipeline={args.pipeline} sweep={args.sweep_list}>={human(args.sweep_min)} "
          f"launcher={'mpirun' if use_mpi else 'launch_local (no MPI series: ' + reason + ')'}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    worlds: dict[str, dict[str, Any]] = {}
    failed = []
    for w in args.world_list:
        t0 = time.perf_counter()
        print(f"[W={w}] launching {w} workers ...", flush=True)
        data = _launch_world(w, args, use_mpi)
        if data is None:
            failed.append(w)
            continue
        data["wall_s"] = time.perf_counter() - t0
        worlds[str(w)] = data
        print(f"[W={w}] done in {data['wall_s']:.1f} s", flush=True)
    wall = time.perf_counter() - t_all
    print_tables(worlds)
    rows = ratios(worlds)
    if rows:
        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        print(f"\nbest gradsync series vs gloo and MPI allreduce (median algbw ratios), messages >= {human(RATIO_MIN_BYTES)};"
              f"\nlike for like: best gradsync over gloo p2p / gloo, gradsync over MPI p2p / MPI:")
        print(f"{'W':>2s} {'size':>5s} {'best gradsync':>14s} {'GB/s':>7s} {'/gloo':>6s} {'/MPI':>6s}   "
              f"{'best on gloo p2p':>16s} {'/gloo':>6s}   {'on MPI p2p':>12s} {'/MPI':>6s}")
        for r in rows:
            print(f"{r['world_size']:>2d} {human(r['bytes']):>5s} {r['best_gradsync']:>14s} {r['best_algbw_GBps']:7.3f} "
                  f"{f(r['vs_gloo']):>6s} {f(r['vs_mpi']):>6s}   {r['best_over_gloo_p2p'] or '-':>16s} "
                  f"{f(r['gloo_p2p_vs_gloo']):>6s}   {r['best_over_mpi_p2p'] or '-':>12s} {f(r['mpi_p2p_vs_mpi']):>6s}")
    autos = auto_ratios(worlds)
    if autos:
        print("\ngradsync's default (gs-auto: Runtime, algorithm='auto') vs gloo all_reduce, median time ratio "
              "(gloo / auto; goal >= 0.97), beside gloo / gloo-again (the same call twice: the noise floor):")
        for r in autos:
            again = r["gloo_again_vs_gloo"]
            print(f"{r['world_size']:>2d} {human(r['bytes']):>5s} {r['auto_vs_gloo']:6.2f} "
                  f"{'-' if again is None else f'{again:.2f}':>6s}")
    wrong = [(w, human(int(s)), n) for w, d in worlds.items() for s, c in d["sizes"].items()
             for n, v in c.items() if not v["verified"]]
    if wrong:
        print(f"\nWRONG RESULTS (marked ! above): {wrong}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["launcher"] = "mpirun" if use_mpi else "launch_local"
    config["mpi_unavailable"] = reason or None
    json_path, png_path = args.out / "allreduce_loopback.json", args.out / "allreduce_loopback.png"
    json_path.write_text(json.dumps({"type": RESULT_TYPE, "machine": _machine(), "config": config, "worlds": worlds,
                                     "ratios": rows, "auto_vs_gloo": autos, "failed_worlds": failed, "wrong": wrong, "wall_s": wall},
                                    indent=1) + "\n")
    wrote = [json_path]
    if worlds:
        plot(png_path, worlds)
        wrote.append(png_path)
    print(f"\nwrote {' and '.join(map(str, wrote))} ({wall:.0f} s in all)", flush=True)
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
