"""The main job's training part: local workers train LeNet-5 on real digits, once per algorithm.

``run_demo()`` starts ``workers`` processes on loopback (torchrun-style, :mod:`gradsync.launch`). Each
runs :func:`worker` : for every algorithm it trains LeNet-5 from the same initial weights on the same
data order with :class:`~gradsync.train.optimizer.DistributedOptimizer` (gradients start travelling as
backward produces them), plus a baseline with ``torch.distributed.all_reduce``. ``auto`` (gradsync's default)
runs as a user would run it: the runtime is calibrated on this wire at start (message costs, rates, the
small sizes timed; cached per topology in ``$GRADSYNC_CACHE``), and the plan it ran for each gradient group
is reported. Rank 0 reports test
accuracy, time per step, communication time per step (time the communication thread was busy) and the
part of it training waited for. The parent prints the table and saves a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["BASELINE", "DemoConfig", "run_demo", "worker", "plot_results", "results_figure"]

#: Name of the reference run that uses torch.distributed.all_reduce (gloo's own algorithm) per step.
BASELINE = "torch.all_reduce"


def _args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradsync.train.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for rank 0's results.json")
    p.add_argument("--topology", default="bcube:2,2")
    p.add_argument("--algorithms", default="", help="comma-separated; default: every applicable one")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=64, help="global batch (split over the workers)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--bucket-bytes", type=int, default=64 * 1024)
    return p.parse_args(argv)


class DemoConfig:
    """Validated demo settings (shared by the parent and the CLI)."""

    def __init__(self, workers: int = 4, topology: str | None = None, algorithms: Sequence[str] | None = None,
                 steps: int = 120, batch: int = 64) -> None:
        from gradsync.errors import GradsyncError
        from gradsync.plan import SYNTHESIZERS
        from gradsync.topology.io import get_topology

        if workers < 2:
            raise GradsyncError(f"workers={workers}: the demo needs at least 2 workers")
        if steps < 1 or batch < workers:
            raise GradsyncError(f"steps={steps} must be >= 1 and batch={batch} >= workers={workers}")
        self.workers, self.steps, self.batch = workers, steps, batch
        self.topology = topology or ("bcube:2,2" if workers == 4 else f"switch:{workers}")
        topo = get_topology(self.topology)
        if topo.world_size != workers:
            raise GradsyncError(f"topology {self.topology!r} has {topo.world_size} ranks, not workers={workers}")
        usable = [a for a in SYNTHESIZERS.names() if not SYNTHESIZERS.get(a).applicable(topo)]
        if algorithms:
            for a in algorithms:
                if a not in (BASELINE, "auto") and a not in usable:
                    raise GradsyncError(f"algorithm {a!r} does not run on {self.topology!r}; choose from {usable} or {BASELINE!r}")
            self.algorithms = list(algorithms)
        else:
            self.algorithms = [BASELINE, "auto", *usable]


def worker(argv: Sequence[str] | None = None) -> int:
    """One worker process (RANK/WORLD_SIZE/MASTER_* in the environment, as torchrun sets them)."""
    import torch
    import torch.distributed as dist

    from gradsync.comm import init, shutdown
    from gradsync.models import create
    from gradsync.models.data import load_digits, shard
    from gradsync.train.optimizer import DistributedOptimizer

    args = _args(argv)
    torch.set_num_threads(1)
    algorithms = [a for a in args.algorithms.split(",") if a]
    # calibrated as a user of ``auto`` would run it: the wire's message costs and rates, the small sizes
    # timed (cached per topology in $GRADSYNC_CACHE, so a second run skips it)
    rt = init(topology=args.topology, algorithm="auto", timeout_s=120, calibrate="auto" in algorithms)
    rank, world = rt.rank, rt.world_size
    data = load_digits(32)
    results: dict[str, Any] = {}
    n_train = data.x_train.shape[0]
    for alg in algorithms:
        torch.manual_seed(0)
        model = create("lenet5", num_classes=10)
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        opt = base if alg == BASELINE else DistributedOptimizer(
            base, model.named_parameters(), runtime=rt, algorithm=alg, bucket_bytes=args.bucket_bytes)
        gen = torch.Generator().manual_seed(1)
        order = torch.randperm(n_train, generator=gen)  # host: the data's order
        comm0 = rt.comm_seconds
        comm_baseline = 0.0
        curve = []
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(args.steps):
            start = (step * args.batch) % (n_train - args.batch)
            idx = order[start : start + args.batch]
            x, y = shard(data.x_train[idx], data.y_train[idx], rank, world)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if alg == BASELINE:
                tc = time.perf_counter()  # fused into one buffer, as DDP buckets do: a fair baseline
                grads = [p.grad for p in model.parameters()]
                flat_grads = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat_grads)
                flat_grads.div_(world)
                offset = 0
                for g in grads:
                    g.copy_(flat_grads[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                comm_baseline += time.perf_counter() - tc
            opt.step()
            if (step + 1) % max(1, args.steps // 6) == 0 or step + 1 == args.steps:
                curve.append((step + 1, _accuracy(model, data.x_test, data.y_test)))
        dist.barrier()
        wall = time.perf_counter() - t0
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        spread = flat.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        same = bool(torch.equal(spread, flat))
        same_t = torch.tensor([1.0 if same else 0.0])  # host: the demo runs on gloo
        dist.all_reduce(same_t, op=dist.ReduceOp.MIN)
        comm = comm_baseline if alg == BASELINE else rt.comm_seconds - comm0
        waited = comm_baseline if alg == BASELINE else opt.wait_seconds
        results[alg] = {
            "accuracy": curve[-1][1], "curve": curve, "step_ms": 1e3 * wall / args.steps,
            "comm_ms": 1e3 * comm / args.steps, "wait_ms": 1e3 * waited / args.steps,
            "replicas_identical": bool(same_t.item() == 1.0),
        }
        if alg == "auto":  # what auto ran for each group size of the last step (the groups are the same every step)
            results[alg]["groups"] = opt.group_bytes
            results[alg]["plans"] = {str(n): "/".join(map(str, rt.choice(n))) for n in sorted(set(opt.group_bytes))}
        if alg != BASELINE:
            opt.remove_hooks()
        if rank == 0:
            r = results[alg]
            print(f"{alg:18s} acc {r['accuracy']:.3f}  step {r['step_ms']:6.2f} ms  comm {r['comm_ms']:6.2f} ms  "
                  f"waited {r['wait_ms']:6.2f} ms", flush=True)
    if rank == 0:
        meta = {"workers": world, "topology": args.topology, "steps": args.steps, "batch": args.batch,
                "model": "lenet5", "dataset": "sklearn digits 8x8 -> 32x32", "params": sum(p.numel() for p in model.parameters())}
        Path(args.out, "results.json").write_text(json.dumps({"type": "gradsync.train_demo", **meta, "results": results}))
    shutdown()
    dist.barrier()
    return 0


def _accuracy(model: Any, x: Any, y: Any) -> float:
    import torch

    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def plot_results(report: dict[str, Any], path: str | Path) -> Path:
    """Accuracy over steps per algorithm, and time per step split into waited-for comm and the rest (a PNG)."""
    out = Path(path)
    results_figure(report).savefig(out, dpi=110)
    return out


def results_figure(report: dict[str, Any]) -> Any:
    """The matplotlib Figure :func:`plot_results` saves."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    res = report["results"]
    names = list(res)
    fig = Figure(figsize=(12, 4.5))  # its own canvas: no process-wide backend is chosen
    FigureCanvasAgg(fig)
    a1, a2 = fig.subplots(1, 2)
    # exact allreduces train identically: one line per distinct curve, labelled with every method that drew it
    curves: dict[tuple[tuple[float, float], ...], list[str]] = {}
    for n in names:
        curves.setdefault(tuple((float(s), float(a)) for s, a in res[n]["curve"]), []).append(n)
    for curve, same in curves.items():
        steps, acc = zip(*curve)
        label = same[0] if len(same) == 1 else f"{', '.join(same)} (identical: exact sums)"
        a1.plot(steps, acc, marker="o", ms=3, label=label)
    a1.set_xlabel("step")
    a1.set_ylabel("test accuracy")
    a1.set_title(f"LeNet-5 on digits, {report['workers']} workers, global batch {report['batch']}")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    step = [res[n]["step_ms"] for n in names]
    waited = [min(res[n]["wait_ms"], res[n]["step_ms"]) for n in names]
    comm = [res[n]["comm_ms"] for n in names]
    xs = range(len(names))
    a2.bar(xs, [s - w for s, w in zip(step, waited)], label="compute + overlapped comm")
    a2.bar(xs, waited, bottom=[s - w for s, w in zip(step, waited)], label="waiting for comm")
    a2.scatter(xs, comm, color="k", marker="_", s=300, zorder=3, label="comm thread busy")
    a2.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    a2.set_ylabel("ms per step")
    a2.set_title(f"time per step (topology {report['topology']} planned; loopback wire)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def run_demo(config: DemoConfig, plot: str | Path | None = "gradsync-demo.png", timeout_s: float = 600) -> dict[str, Any]:
    """Launch the workers, print their table, save the plot; return rank 0's report."""
    from gradsync.errors import CommError
    from gradsync.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="gradsync-demo-") as tmp:
        cmd = [sys.executable, "-m", "gradsync.train.demo", "--out", tmp, "--topology", config.topology,
               "--algorithms", ",".join(config.algorithms), "--steps", str(config.steps), "--batch", str(config.batch)]
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
        code = launch_local(cmd, config.workers, env=env, timeout=timeout_s)
        result = Path(tmp, "results.json")
        if code != 0 or not result.exists():
            raise CommError(f"demo workers failed (exit code {code}); their output is above")
        report = json.loads(result.read_text())
    if plot:
        report["plot"] = str(plot_results(report, plot))
    return report


if __name__ == "__main__":
    sys.exit(worker())
