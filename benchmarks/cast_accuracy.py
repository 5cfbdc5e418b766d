"""What a cast on the wire costs in accuracy, against what any change to the arithmetic costs (issue 40).

``compression="auto"`` with ``allow="cast"`` may send a group in fp16 or bf16. The compression sweep reads the test
accuracy after 40 steps and finds the fixed fp16 1.7-3.1 points below DDP on LeNet-5; this benchmark asks how much
of that is the cast and how much the training trajectory's sensitivity to any perturbation. One process emulates
``--world`` data-parallel ranks on the sweep's digits (each rank's shard of the same global batch, SGD with
momentum 0.9 as the sweep): each step every rank's gradient is computed, then combined by one of the variants of
:data:`COMBINE`, and every replica steps on the combined gradient:

* ``exact``: the float32 average (what DDP computes, to rounding);
* ``jitter``: ``exact`` with every element moved by one float32 ulp, up or down at random: the noise floor, a
  perturbation about 2^12 times smaller than an fp16 rounding and free of bias;
* ``fp16``, ``bf16``: each rank's gradient through gradsync's own codec (``gradsync.compress.create``), the
  payloads summed in the wire dtype as the allreduce sums them, then decoded and averaged;
* ``fp16-scaled``: fp16 with a power-of-two scale every rank shares (from the previous step's aggregate, which
  every rank holds), so no gradient flushes to zero: it separates fp16's underflow from its rounding.

For each of ``--seeds`` seeds (initial weights and data order) and each variant, the test accuracy at each step of
``--checkpoints``; per variant and checkpoint the mean over seeds, each seed's value, and the paired difference from
``exact`` (mean and the range over seeds). Writes ``cast_accuracy.json`` and ``cast_accuracy.png`` to ``--out``.

Run from the repository root::

    gradsync bench cast-accuracy                  # about 15 minutes on one core, the MLP most of it
    .venv/bin/python -m benchmarks.cast_accuracy --models lenet5 --seeds 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import code_revision
from gradsync.compress import TensorInfo, create

RESULT_TYPE = "gradsync.bench.cast_accuracy"
MOMENTUM = 0.9
IMAGE = 32
#: fp16-scaled: the aggregate's largest magnitude is kept this far below fp16's largest finite value (65504), so a
#: gradient that grows from one step to the next by less than this factor does not overflow.
SCALE_HEADROOM = 2.0**4
FP16_MAX = 65504.0
Combine = Callable[[list[torch.Tensor], dict[str, Any], torch.Generator], torch.Tensor]


def _exact(grads: list[torch.Tensor], state: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    return torch.stack(grads).sum(0) / len(grads)


def _jitter(grads: list[torch.Tensor], state: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    avg = _exact(grads, state, gen)
    sign = torch.randint(0, 2, avg.shape, generator=gen, dtype=torch.int8).to(avg.dtype) * 2 - 1
    return avg + sign * _ulp(avg)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One float32 ulp of each element (of the smallest normal where ``x`` is zero or subnormal)."""
    return torch.nextafter(x.abs(), torch.full_like(x, math.inf)) - x.abs()


def _codec(name: str) -> Combine:
    def combine(grads: list[torch.Tensor], state: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
        if "codec" not in state:  # one per tensor, as each exchange has its own
            state["codec"] = create(name)
        codec = state["codec"]
        info = TensorInfo(state["name"], tuple(grads[0].shape), grads[0].dtype)
        payloads, ctx = [], None
        for g in grads:
            payload, ctx = codec.compress(g, info)
            payloads.append(payload[0])
        total = torch.stack(payloads).sum(0)  # summed in the wire dtype, as the backend's allreduce sums them
        return codec.decompress([total], ctx).to(grads[0].dtype) / len(grads)
    return combine


def shared_scale(previous_max: float | None, world: int) -> float:
    """The power of two that puts ``world`` gradients of the previous aggregate's largest magnitude
    :data:`SCALE_HEADROOM` below fp16's largest value; 1 without a previous aggregate (or an all-zero one)."""
    if not previous_max or not math.isfinite(previous_max):
        return 1.0
    return 2.0 ** math.floor(math.log2(FP16_MAX / (SCALE_HEADROOM * world * previous_max)))


def _fp16_scaled(grads: list[torch.Tensor], state: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    scale = shared_scale(state.get("max"), len(grads))
    total = torch.stack([(g * scale).half() for g in grads]).sum(0).to(grads[0].dtype)
    out = total / scale / len(grads)
    if not bool(torch.isfinite(out).all()):  # overflow: every rank sees the same sum, so all send again exactly
        out = _exact(grads, state, gen)
        state["overflows"] = state.get("overflows", 0) + 1
    state["max"] = float(out.abs().max())
    return out


COMBINE: dict[str, Combine] = {"exact": _exact, "jitter": _jitter, "fp16": _codec("fp16"), "bf16": _codec("bf16"),
                               "fp16-scaled": _fp16_scaled}


def _model(name: str) -> nn.Module:
    from benchmarks.compression_sweep_worker import MODELS

    return MODELS.get(name)()


def train(model_name: str, variant: str, seed: int, checkpoints: Sequence[int], *, world: int, batch: int,
          lr: float, data: Any) -> dict[str, Any]:
    """One replica trained for ``max(checkpoints)`` steps with ``variant`` combining the ranks' gradients."""
    from gradsync.models.data import shard

    combine = COMBINE[variant]
    torch.manual_seed(seed)
    net = _model(model_name)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=MOMENTUM)
    n = data.x_train.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    gen = torch.Generator().manual_seed(seed + 2)
    names = [name for name, _ in net.named_parameters()]
    states: dict[str, dict[str, Any]] = {name: {"name": name} for name in names}
    accuracy: dict[int, float] = {}
    for step in range(max(checkpoints)):
        start = (step * batch) % (n - batch)
        idx = order[start:start + batch]
        per_rank: list[list[torch.Tensor]] = []
        for rank in range(world):
            x, y = shard(data.x_train[idx], data.y_train[idx], rank, world)
            net.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x), y).backward()
            per_rank.append([p.grad.detach().clone() for p in net.parameters()])
        for i, (name, p) in enumerate(zip(names, net.parameters())):
            p.grad = combine([g[i] for g in per_rank], states[name], gen)
        opt.step()
        if step + 1 in checkpoints:
            net.eval()
            with torch.no_grad():
                accuracy[step + 1] = float((net(data.x_test).argmax(1) == data.y_test).float().mean())
            net.train()
    return {"accuracy": accuracy, "overflows": sum(s.get("overflows", 0) for s in states.values())}


def summarize(runs: dict[str, dict[int, list[float]]], checkpoints: Sequence[int]) -> dict[str, Any]:
    """Per variant and checkpoint: mean accuracy over seeds, and the paired difference from ``exact`` in points."""
    out: dict[str, Any] = {}
    base = runs["exact"]
    for variant, by_step in runs.items():
        rows = {}
        for c in checkpoints:
            diffs = [100 * (a - b) for a, b in zip(by_step[c], base[c])]
            rows[str(c)] = {"mean": statistics.fmean(by_step[c]), "seeds": by_step[c],
                            "points_vs_exact": statistics.fmean(diffs), "range_vs_exact": [min(diffs), max(diffs)]}
        out[variant] = rows
    return out


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gradsync bench cast-accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="lenet5,mlp", help="comma-separated, of the compression sweep's models")
    p.add_argument("--variants", default=",".join(COMBINE), help=f"comma-separated, of {list(COMBINE)}")
    p.add_argument("--seeds", type=int, default=5, help="seeds (initial weights and data order) per variant")
    p.add_argument("--checkpoints", default="20,40,100,200", help="steps after which the test accuracy is read")
    p.add_argument("--world", type=int, default=2, help="emulated data-parallel ranks (the sweep's 2)")
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the ranks (the sweep's 64)")
    p.add_argument("--lr", type=float, default=0.05, help="the sweep's learning rate")
    p.add_argument("--out", default="benchmarks/results/cast_accuracy", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    args.model_list = [m for m in args.models.split(",") if m]
    args.variant_list = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variant_list if v not in COMBINE]
    if bad or "exact" not in args.variant_list:
        p.error(f"--variants {args.variants!r}: each of {list(COMBINE)}, and 'exact' among them (the reference)")
    try:
        args.checkpoint_list = sorted({int(c) for c in args.checkpoints.split(",") if c})
    except ValueError:
        p.error(f"--checkpoints {args.checkpoints!r} must be comma-separated step counts, e.g. 20,40,100,200")
    if not args.checkpoint_list or args.checkpoint_list[0] < 1:
        p.error(f"--checkpoints {args.checkpoints!r} must be step counts >= 1")
    for name in ("seeds", "world", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be >= 1")
    if args.batch < args.world:
        p.error(f"--batch {args.batch} must be at least --world {args.world} (one sample per rank)")
    return args


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(doc["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for variant, rows in doc["models"][model]["summary"].items():
            if variant == "exact":
                continue
            steps = [int(c) for c in rows]
            mean = [rows[c]["points_vs_exact"] for c in rows]
            lo = [rows[c]["range_vs_exact"][0] for c in rows]
            hi = [rows[c]["range_vs_exact"][1] for c in rows]
            line, = ax.plot(steps, mean, marker="o", label=variant)
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.12)
        ax.axhline(0, color="k", lw=0.8)
        ax.axhline(-0.5, color="grey", ls=":", lw=0.8)
        ax.set(title=f"{model}: test accuracy vs exact ({doc['args']['seeds']} seeds)", xlabel="steps",
               ylabel="points (mean; band: range over seeds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    from gradsync.models.data import load_digits

    args = _args(argv)
    torch.set_num_threads(1)
    data = load_digits(IMAGE)
    t0 = time.perf_counter()
    doc: dict[str, Any] = {"type": RESULT_TYPE, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "code": code_revision(),
                           "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")}, "models": {}}
    total = len(args.model_list) * len(args.variant_list) * args.seeds
    done = 0
    for model in args.model_list:
        runs: dict[str, dict[int, list[float]]] = {v: {c: [] for c in args.checkpoint_list} for v in args.variant_list}
        overflows: dict[str, int] = {v: 0 for v in args.variant_list}
        for seed in range(args.seeds):
            for variant in args.variant_list:
                got = train(model, variant, seed, args.checkpoint_list, world=args.world, batch=args.batch,
                            lr=args.lr, data=data)
                for c, acc in got["accuracy"].items():
                    runs[variant][c].append(acc)
                overflows[variant] += got["overflows"]
                done += 1
                print(f"[{done}/{total}] {model} seed {seed} {variant}: "
                      + ", ".join(f"{c}: {100 * a:.1f}" for c, a in got["accuracy"].items())
                      + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        summary = summarize(runs, args.checkpoint_list)
        doc["models"][model] = {"summary": summary, "overflows": overflows}
    doc["run_s"] = time.perf_counter() - t0
    lines = []
    for model, m in doc["models"].items():
        for variant, rows in m["summary"].items():
            if variant != "exact":
                lines.append(f"{model:7s} {variant:12s} points vs exact, mean over seeds [range]: " + ", ".join(
                    f"{c} steps {r['points_vs_exact']:+.1f} [{r['range_vs_exact'][0]:+.1f}, {r['range_vs_exact'][1]:+.1f}]"
                    for c, r in rows.items()))
    doc["summary_lines"] = lines
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cast_accuracy.json").write_text(json.dumps(doc, indent=1))
    _plot(doc, out / "cast_accuracy.png")
    print("\n".join(lines))
    print(f"wrote {out / 'cast_accuracy.json'} and {out / 'cast_accuracy.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
