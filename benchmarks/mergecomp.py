"""MergeComp on this machine: codec cost per tensor, step time of ResNet-50's 161 gradients, accuracy.

Three parts, written to ``--out`` as ``mergecomp.json`` and ``mergecomp.png``:

1. **Codec** (MergeComp Fig. 3): encode and decode time of one flat float32 tensor per size, every compressor
   (:func:`gradsync.compress.measure_codec`, minimum of ``--reps`` runs, in this process).
2. **Step time**: ``--worlds`` gloo processes on loopback hold ResNet-50's 161 gradient tensors (shapes from
   ``gradsync.models``; values synthetic, element counts divided by ``--scale``). Backward is emulated: the
   tensors become ready in backward order, ``--backward-ms`` in total spread by size, with ``time.sleep``
   (compute elsewhere, as a GPU's; the CPU stays free for the codec and the wire). Each group goes out when
   complete (:class:`gradsync.train.MergedGroups`). Per compressor: layer-wise, ``y`` in 1, 2, 4, 8 equal
   groups, Algorithm 2 (Y = 4, alpha = 0.05) and the exact search, both planned on the profiled cost model
   (:func:`gradsync.train.profile_cost_model`) fitted, as the optimizer's calibration does, to the measured
   layer-wise step (its per-group overhead, :func:`gradsync.compress.fit_group_overhead`), and beside them
   the exact search on the unfitted profile (``exact_unfitted``, the anchor); FP32 is ``none`` layer-wise.
   A sample is the slowest rank's time from backward start until every aggregate is back; the distinct
   partitions are measured in rounds, alternating. Reported: the median of ``--reps``, the speedup over
   layer-wise, whether the exact choice is within 5% of the best measured configuration, and the model's
   mean error with and without the fit.
3. **Accuracy** (MergeComp Table 4 in miniature): LeNet-5 on digits, 2 workers, FP32 against DGC and EFSignSGD
   layer-wise and merged (``merge="auto"``), test accuracy every 20 steps.

Run from the repository root::

    gradsync bench mergecomp --quick          # scaled-down sizes, 2 processes, a minute or two
    gradsync bench mergecomp                  # full ResNet-50 sizes, 2 and 4 processes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import pythonpath

RESULT_TYPE = "gradsync.bench.mergecomp"
STEP_COMPRESSORS = "fp16,dgc,efsignsgd,topk"
CONFIGS = ("layerwise", "y1", "y2", "y4", "y8", "alg2", "exact", "exact_unfitted")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gradsync bench mergecomp", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/mergecomp"))
    p.add_argument("--quick", action="store_true", help="sizes / 32, 2 processes, fewer repetitions")
    p.add_argument("--worlds", default=None, help="process counts (default 2,4; --quick: 2)")
    p.add_argument("--compressors", default=STEP_COMPRESSORS, help=f"for the step time (default {STEP_COMPRESSORS})")
    p.add_argument("--scale", type=int, default=None, help="divide every tensor's elements by this (default 1; --quick 32)")
    p.add_argument("--backward-ms", type=float, default=None, help="emulated backward time (default 200; --quick 60)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per configuration (default 7; --quick 3)")
    p.add_argument("--steps", type=int, default=120, help="training steps for the accuracy part (0 skips it)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.worlds = args.worlds or ("2" if args.quick else "2,4")
    args.scale = args.scale or (32 if args.quick else 1)
    args.backward_ms = args.backward_ms if args.backward_ms is not None else (60.0 if args.quick else 200.0)
    args.reps = args.reps or (3 if args.quick else 7)
    return args


# ---- part 1: codec ----------------------------------------------------------------------------------------------
def codec_part(quick: bool) -> dict[str, Any]:
    import torch

    from gradsync.compress import COMPRESSORS, create, measure_codec

    torch.set_num_threads(1)
    sizes = [2**k for k in range(6, 21 if quick else 23, 2)]
    out = {"sizes": sizes}
    for name in COMPRESSORS.names():
        c = create(name)
        enc = measure_codec(c, sizes, repeats=3, part="encode")
        dec = measure_codec(c, sizes, repeats=3, part="decode")
        out[name] = {"encode_s": list(enc.seconds), "decode_s": list(dec.seconds)}
        print(f"codec {name:10s} encode {enc.seconds[0] * 1e6:8.1f} us @ {sizes[0]}  "
              f"{enc.seconds[-1] * 1e3:8.2f} ms @ {sizes[-1]}", flush=True)
    return out


# ---- part 2: step time (worker) -----------------------------------------------------------------------------------
def _resnet50_shapes(scale: int) -> list[tuple[int, ...]]:
    from gradsync.models import create as create_model

    shapes = [tuple(p.shape) for p in create_model("resnet50").parameters()][::-1]  # backward order
    if scale == 1:
        return shapes
    return [(max(1, int(torch_numel(s)) // scale),) for s in shapes]


def torch_numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def step_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import gradsync
    from gradsync.compress import Partition, fit_group_overhead, resolve_merge, search_mergecomp, search_optimal
    from gradsync.train import CompressionStep, MergedGroups, profile_cost_model

    torch.set_num_threads(1)
    rt = gradsync.init(algorithm="ring", timeout_s=300)
    rank = rt.rank
    shapes = _resnet50_shapes(cfg["scale"])
    sizes = [torch_numel(s) for s in shapes]
    names = [f"g{i}" for i in range(len(shapes))]
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    total = sum(sizes)
    backward_s = cfg["backward_ms"] / 1e3
    compute = [backward_s * (0.2 / len(sizes) + 0.8 * n / total) for n in sizes]
    ready = list(__import__("itertools").accumulate(compute))

    def timed_step(groups: MergedGroups) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i, g in enumerate(grads):
            time.sleep(compute[i])
            groups.add(i, g)
        groups.wait()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def measure(step: CompressionStep, part: Partition) -> dict[str, Any]:
        groups = MergedGroups(step, names, shapes, torch.float32, part)
        timed_step(groups)  # warm-up
        samples = [timed_step(groups) for _ in range(cfg["reps"])]
        return {"median_s": statistics.median(samples), "samples_s": samples, "groups": part.num_groups}

    results: dict[str, Any] = {}
    fp32 = measure(CompressionStep("none", runtime=rt), Partition.layerwise(len(sizes)))
    results["fp32"] = {"layerwise": fp32}
    if rank == 0:
        print(f"[W={rt.world_size}] fp32 layer-wise {fp32['median_s'] * 1e3:.1f} ms", flush=True)
    for comp in cfg["compressors"]:
        # layer-wise first: as the optimizer's calibration step, its time fits the model's per-group overhead
        layerwise = Partition.layerwise(len(sizes))
        row = {"layerwise": measure(CompressionStep(comp, runtime=rt), layerwise)}
        step = CompressionStep(comp, runtime=rt)
        # one profile, searched as it is (the anchor) and fitted to the layer-wise step (the max over ranks,
        # the same on every rank), as profile_cost_model(observed=...) fits it for the optimizer
        unfitted = profile_cost_model(step, sizes, ready, ready[-1], repeats=3)
        model, overhead = fit_group_overhead(unfitted, layerwise, row["layerwise"]["median_s"])
        row["layerwise"]["fitted_group_overhead_s"] = overhead
        plans = {
            "layerwise": layerwise,
            **{f"y{y}": resolve_merge(y, sizes) for y in (1, 2, 4, 8)},
            "alg2": search_mergecomp(model, 4, 0.05),
            "exact": search_optimal(model),
            "exact_unfitted": search_optimal(unfitted),
        }
        # Every distinct partition (labels naming the same one share it: "exact" is often "y1") is measured in
        # rounds, configurations alternating, so drift in the machine's load hits them alike.
        distinct = list(dict.fromkeys(part for label, part in plans.items() if label != "layerwise"))
        groups = {part: MergedGroups(CompressionStep(comp, runtime=rt), names, shapes, torch.float32, part)
                  for part in distinct}  # fresh compressor state per configuration
        for g in groups.values():
            timed_step(g)  # warm-up
        samples: dict[Partition, list[float]] = {part: [] for part in distinct}
        for r in range(cfg["reps"]):
            for part in distinct[r % len(distinct):] + distinct[:r % len(distinct)]:
                samples[part].append(timed_step(groups[part]))
        for label, part in plans.items():
            if label != "layerwise":
                row[label] = {"median_s": statistics.median(samples[part]), "samples_s": samples[part],
                              "groups": part.num_groups}
            row[label]["predicted_s"] = model.iteration_time(part)
            row[label]["predicted_unfitted_s"] = unfitted.iteration_time(part)
        results[comp] = row
        if rank == 0:
            print(f"[W={rt.world_size}] {comp:10s} " + "  ".join(f"{k} {v['median_s'] * 1e3:7.1f}" for k, v in row.items())
                  + f"   (exact: {plans['exact'].num_groups} groups)", flush=True)
    gradsync.shutdown()
    return {"world": rt.world_size, "sizes": sizes, "backward_ms": cfg["backward_ms"], "results": results}


# ---- part 3: accuracy (worker) --------------------------------------------------------------------------------------
ACCURACY_RUNS = [
    ("fp32", None, "layerwise"),
    ("dgc layer-wise", "dgc", "layerwise"),
    ("dgc merged (auto)", "dgc", "auto"),
    ("efsignsgd layer-wise", "efsignsgd", "layerwise"),
    ("efsignsgd merged (auto)", "efsignsgd", "auto"),
]


def accuracy_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import gradsync
    from gradsync.compress import create, create_memory
    from gradsync.models import create as create_model
    from gradsync.models.data import load_digits, shard

    torch.set_num_threads(1)
    rt = gradsync.init(algorithm="ring", timeout_s=120)
    data = load_digits(32)
    n_train, batch = data.x_train.shape[0], 64
    out = {}
    for label, comp, merge in ACCURACY_RUNS:
        torch.manual_seed(0)
        model = create_model("lenet5", num_classes=10)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if comp == "dgc" else 0.5)
        kw: dict[str, Any] = {}
        if comp is not None:
            kw = {"compression": create(comp, **({"ratio": 0.1} if comp == "dgc" else {})), "merge": merge}
            if comp == "dgc":
                kw["memory"] = create_memory("dgc", momentum=0.5)
        opt = gradsync.DistributedOptimizer(base, model.named_parameters(), runtime=rt, **kw)
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(1))
        curve = []
        t0 = time.perf_counter()
        for step in range(cfg["steps"]):
            start = (step * batch) % (n_train - batch)
            idx = order[start : start + batch]
            x, y = shard(data.x_train[idx], data.y_train[idx], rt.rank, rt.world_size)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if (step + 1) % 20 == 0 or step + 1 == cfg["steps"]:
                with torch.no_grad():
                    curve.append((step + 1, float((model(data.x_test).argmax(1) == data.y_test).float().mean())))
        part = getattr(opt, "partition", None)
        out[label] = {"curve": curve, "accuracy": curve[-1][1], "seconds": time.perf_counter() - t0,
                      "groups": None if part is None else part.num_groups}
        opt.remove_hooks()
        if rt.rank == 0:
            print(f"accuracy {label:24s} {curve[-1][1]:.3f}", flush=True)
    gradsync.shutdown()
    return out


def _worker_main(args: argparse.Namespace) -> int:
    cfg = json.loads(Path(args.worker).read_text())
    result = step_worker(cfg) if cfg["part"] == "step" else accuracy_worker(cfg)
    if int(os.environ["RANK"]) == 0:
        Path(cfg["result"]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def _launch(cfg: dict[str, Any], world: int, tmp: Path) -> dict[str, Any]:
    from gradsync.errors import GradsyncError
    from gradsync.launch import launch_local

    cfg_path = tmp / f"cfg-{cfg['part']}-{world}.json"
    cfg = {**cfg, "result": str(tmp / f"result-{cfg['part']}-{world}.json")}
    cfg_path.write_text(json.dumps(cfg))
    env = {"PYTHONPATH": pythonpath()}
    code = launch_local([sys.executable, str(Path(__file__).resolve()), "--worker", str(cfg_path)], world, env=env, timeout=1800)
    if code != 0 or not Path(cfg["result"]).exists():
        raise GradsyncError(f"mergecomp workers failed (exit code {code}); their output is above")
    return json.loads(Path(cfg["result"]).read_text())


# ---- summary and plot --------------------------------------------------------------------------------------------------
def summarize(step: dict[str, Any]) -> dict[str, Any]:
    """Per compressor: speedup of each configuration over layer-wise, the best measured, exact within 5%."""
    out = {}
    for comp, row in step["results"].items():
        if comp == "fp32":
            continue
        med = {k: v["median_s"] for k, v in row.items()}
        best = min(med, key=med.get)
        out[comp] = {
            "speedup_over_layerwise": {k: med["layerwise"] / v for k, v in med.items()},
            "speedup_over_fp32": {k: step["results"]["fp32"]["layerwise"]["median_s"] / v for k, v in med.items()},
            "best": best,
            "exact_over_best": med["exact"] / med[best],
            "exact_within_5pct": med["exact"] <= 1.05 * med[best],
            "exact_not_slower_than_layerwise_or_y1": med["exact"] <= min(med["layerwise"], med["y1"]) * 1.05,
            "exact_groups": row["exact"]["groups"],
            "alg2_groups": row["alg2"]["groups"],
        }
        if "exact_unfitted" in row:  # the search on the model without the fitted per-group overhead
            out[comp].update({
                "exact_unfitted_over_best": med["exact_unfitted"] / med[best],
                "exact_unfitted_groups": row["exact_unfitted"]["groups"],
                # mean |predicted / measured - 1| over the configurations, with and without the fit
                # (layer-wise left out: the fit matches it by construction)
                "model_error": statistics.fmean(abs(v["predicted_s"] / v["median_s"] - 1)
                                                for k, v in row.items() if k != "layerwise"),
                "model_error_unfitted": statistics.fmean(abs(v["predicted_unfitted_s"] / v["median_s"] - 1)
                                                         for k, v in row.items() if k != "layerwise"),
            })
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 + len(report["step"]) + (1 if report.get("accuracy") else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.5))
    codec = report["codec"]
    for ax, part in zip(axes[:2], ("encode_s", "decode_s")):
        for name, v in codec.items():
            if name != "sizes":
                ax.loglog(codec["sizes"], [t * 1e3 for t in v[part]], marker="o", ms=3, label=name)
        ax.set_xlabel("elements (float32)")
        ax.set_ylabel("ms")
        ax.set_title(f"{part[:-2]} time per tensor (MergeComp Fig. 3)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    for ax, step in zip(axes[2:], report["step"]):
        comps = [c for c in step["results"] if c != "fp32"]
        width = 0.8 / len(CONFIGS)
        for j, cfg in enumerate(CONFIGS):
            ax.bar([i + j * width for i in range(len(comps))], [step["results"][c][cfg]["median_s"] * 1e3 for c in comps],
                   width, label=cfg)
        ax.axhline(step["results"]["fp32"]["layerwise"]["median_s"] * 1e3, color="k", ls="--", label="fp32 layer-wise")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(comps))], comps)
        ax.set_ylabel("step time, median (ms)")
        ax.set_title(f"ResNet-50 161 tensors, {step['world']} gloo processes")
        ax.legend(fontsize=7, ncol=2)
    if report.get("accuracy"):
        ax = axes[-1]
        for label, r in report["accuracy"].items():
            s, a = zip(*r["curve"])
            ax.plot(s, a, marker="o", ms=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("test accuracy")
        ax.set_title("LeNet-5 on digits, 2 workers (MergeComp Table 4 in miniature)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        return _worker_main(args)
    comps = [c.strip() for c in args.compressors.split(",") if c.strip()]
    worlds = sorted({int(w) for w in args.worlds.split(",") if w.strip()})
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"type": RESULT_TYPE, "quick": args.quick, "scale": args.scale, "reps": args.reps,
                              "backward_ms": args.backward_ms, "compressors": comps}
    report["codec"] = codec_part(args.quick)
    with tempfile.TemporaryDirectory(prefix="gradsync-mergecomp-") as tmp:
        report["step"] = []
        for w in worlds:
            cfg = {"part": "step", "scale": args.scale, "backward_ms": args.backward_ms, "reps": args.reps,
                   "compressors": comps}
            step = _launch(cfg, w, Path(tmp))
            step["summary"] = summarize(step)
            report["step"].append(step)
            for comp, s in step["summary"].items():
                print(f"[W={w}] {comp:10s} best {s['best']:9s} exact/best {s['exact_over_best']:.3f} "
                      f"(within 5%: {s['exact_within_5pct']})  speedup over layer-wise: exact "
                      f"{s['speedup_over_layerwise']['exact']:.2f}x, best {s['speedup_over_layerwise'][s['best']]:.2f}x")
        if args.steps > 0:
            report["accuracy"] = _launch({"part": "accuracy", "steps": args.steps}, 2, Path(tmp))
    (args.out / "mergecomp.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "mergecomp.png")
    print(f"wrote {args.out / 'mergecomp.json'} and {args.out / 'mergecomp.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
