"""One server's process of ``gradsync bench compression-sweep`` (issue 40): started in each namespace by
``testbed.run`` (or as a local process on loopback).

For each configuration ``MODEL/PATH`` of ``--configs``, in turn, it trains one replica per method from the same
weights on the same batches, in the same processes: ``ddp`` (torch's DDP, no compression), :data:`ANCHOR` (DDP with
torch's own ``allreduce_hook``: what any Python hook costs), ``none`` (the path's own
exchange, no compression), each fixed codec of :data:`FIXED` (the same codecs, with the same parameters, that
``compression="auto"`` chooses from: :data:`gradsync.compress.auto.CODECS`) and ``auto``. ``PATH`` is
``optimizer`` (``gradsync.DistributedOptimizer``, layer-wise groups) or ``hook`` (DDP with
``gradsync.compression_hook``, DDP's buckets). Every step each method takes its step in turn, the order rotating
step by step; a sample is the slowest rank's time for zero_grad + forward + backward + ``step()``. A configuration
runs ``--steps`` steps, and with ``--budget-s`` more while it stays inside that time at the pace of its timed
steps (up to ``--max-steps``; rank 0 decides, every rank runs the same count): a paired interval narrows with the
square root of its pairs, and a configuration of quick steps buys many more pairs for the same time. The first
``--warmup`` steps are trained but not timed, and then the steps while a method is still choosing (``auto``: probing,
reviewing, checking DDP's buckets, or waiting on its runtime's explorers; the replicas agree on it), up to
``--first``: the timed steps are the pace each method settled on, which is what the paired ratios compare, and what
choosing cost before shows in ``first_steps_s``. A configuration whose timing starts later runs that many steps more,
so that ``--steps`` less ``--warmup`` steps are timed whenever it starts (``timed_from``). ``auto`` keeps no cache: every
configuration chooses from scratch, and ``first_steps_s`` (its first steps' times, and every method's) shows what
choosing cost.

After ``--steps`` steps, and again after the last, rank 0 evaluates every replica on the test digits (accuracy,
loss: ``accuracy`` at ``--steps``, the same count in every configuration whatever its budget added, and
``accuracy_final``; uncompressed replicas whose sums differ only in order drift apart over hundreds of steps,
see docs/mergecomp.md). Every replica's parameters are compared across ranks (bit-identical, by min/max allreduce; no
pickle). Rank 0 writes JSON to ``--out`` and prints a progress line every few steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import replicas_identical
from benchmarks.compress_testbed_worker import Replica, _timed, _train_step, leave
from gradsync.errors import GradsyncError
from gradsync.registry import Registry

__all__ = ["ANCHOR", "DDP_WAYS", "FIXED", "MODELS", "PATHS", "Setup", "extra_steps", "method_names", "main", "own_runtimes", "tuned_at_init"]

#: The fixed codecs every configuration runs beside ``auto`` (names of :data:`gradsync.compress.auto.CODECS`).
FIXED = ("fp16", "powersgd-r1", "topk-1%", "efsignsgd", "qsgd")
MOMENTUM = 0.9
#: The digits' side for every model (LeNet-5 and ResNet-18 at 32x32; the MLP reads the same 1,024 pixels).
IMAGE = 32


#: DDP with torch's own ``allreduce_hook`` (a method of the default ``--methods``): what any Python comm hook costs
#: against DDP without one, measured beside ``auto`` (whose settled "none" on the hook path should match it, not DDP).
#: An anchor, not a fixed choice ``auto`` is judged against: never in the sweep's "best fixed" pool.
ANCHOR = "torch-hook"
#: The methods that are DDP itself (no gradsync runtime), on either path.
DDP_WAYS = ("ddp", ANCHOR)


def method_names() -> list[str]:
    """Every method of a configuration, in the order they are reported."""
    return ["ddp", ANCHOR, "none", *FIXED, "auto"]


# -- models ------------------------------------------------------------------------------------------------------

def _lenet5() -> nn.Module:
    from gradsync.models import create

    return create("lenet5", num_classes=10)


def _resnet18() -> nn.Module:
    from gradsync.models import create

    return create("resnet18", num_classes=10, in_channels=1)


def _mlp() -> nn.Module:
    """Large dense matrices: 1024-2048-2048-10, 6.3M parameters (4.2M in one matrix)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(IMAGE * IMAGE, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 10))


MODELS: Registry[Callable[[], nn.Module]] = Registry("compression-sweep model", GradsyncError)
MODELS.add("lenet5", _lenet5)
MODELS.add("resnet18", _resnet18)
MODELS.add("mlp", _mlp)


# -- the two paths ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """What every builder may use: the runtime and the run's hyper-parameters."""

    runtime: Any
    lr: float
    allow: str
    probe_steps: int


def _sgd(params: Any, setup: Setup) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=setup.lr, momentum=MOMENTUM)


def _compression(method: str, setup: Setup) -> Any:
    """What the gradsync side runs for ``method``: a fresh compressor, or an AutoCompression without a cache (every
    configuration chooses from scratch; the optimizer's and the hook's models share a parameter signature)."""
    from gradsync.compress.auto import CODECS
    from gradsync.train import AutoCompression

    if method == "auto":
        return AutoCompression(setup.allow, runtime=setup.runtime, probe_steps=setup.probe_steps, cache=False)
    return CODECS.get(method).create()


def _ddp(net: nn.Module, setup: Setup, hooked: bool = False) -> Replica:
    """DDP as it comes (``ddp``), or with torch's ``allreduce_hook`` registered (``hooked``: :data:`ANCHOR`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net)
    if hooked:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = _sgd(model.parameters(), setup)
    return Replica(model, opt, opt)


def _optimizer_path(method: str, net: nn.Module, setup: Setup) -> Replica:
    import gradsync

    if method in DDP_WAYS:
        return _ddp(net, setup, hooked=method == ANCHOR)
    base = _sgd(net.parameters(), setup)
    comp = _compression(method, setup)
    opt = gradsync.DistributedOptimizer(base, net.named_parameters(), runtime=setup.runtime, compression=comp)
    return Replica(net, opt, base, lambda: {**_runtime_stats(setup.runtime, opt.partition), **_auto_stats(comp)},
                   lambda: opt.choosing)


def _hook_path(method: str, net: nn.Module, setup: Setup) -> Replica:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync

    if method in DDP_WAYS:
        return _ddp(net, setup, hooked=method == ANCHOR)
    comp = _compression(method, setup)
    model = DDP(net)
    state = gradsync.CompressionHookState(comp, runtime=setup.runtime, model=net)
    model.register_comm_hook(state, gradsync.compression_hook)
    opt = _sgd(model.parameters(), setup)
    return Replica(model, opt, opt, lambda: {**_runtime_stats(setup.runtime), **_auto_stats(comp),
                                             "payload_bytes": state.payload_bytes,
                                             "dense_bytes": state.dense_bytes}, lambda: state.choosing)


def _runtime_stats(runtime: Any, partition: Any = None) -> dict[str, Any]:
    """What any gradsync method settled besides its codec: the optimizer's partition (tensors per group, backward
    order) and what its runtime measured of its size classes (the explorers' candidates, calls and times), so that a
    fixed codec and ``auto`` on the same codec can be told apart where their paces differ."""
    return {"partition": None if partition is None else [int(g) for g in partition.counts],
            "runtime_tuned": {str(size): record for size, record in runtime.tuned.items()}}


def _auto_stats(comp: Any) -> dict[str, Any]:
    from gradsync.train import AutoCompression

    if not isinstance(comp, AutoCompression):
        return {}
    rows = comp.table()
    return {"settled": comp.settled, "choices": rows, "native_launches": comp.native_launches,
            "step_check": comp.step_check, "buckets": comp.buckets, "trials": comp.trials,
            "trial_times": comp.trial_times,
            "joint": None if comp.joint is None else comp.joint.to_dict(),
            "codecs": {c: sum(r["codec"] == c for r in rows) for c in sorted({r["codec"] for r in rows})}}


PATHS: Registry[Callable[[str, nn.Module, Setup], Replica]] = Registry("compression-sweep path", GradsyncError)
PATHS.add("optimizer", _optimizer_path)
PATHS.add("hook", _hook_path)


def own_runtimes(rt: Any, start: dict[str, Any] | None, methods: Sequence[str],
                 transport: Callable[[], Any] | None = None) -> dict[str, Any]:
    """A runtime of its own for each gradsync method of one configuration (not :data:`DDP_WAYS`): the job's calibrated cost
    model and the small classes tuning measured at init (``start``: :func:`tuned_at_init`), nothing any method's
    calls settled since. A user's job runs one method, so a size class one method's calls explored (the fixed
    ``none`` optimizer's 25 MB payload, say) must not reach another's, least of all ``auto``, whose first steps
    are what choosing costs; nor a configuration's the next one's. Each on a transport of its own (a dedicated
    process group, as ``gradsync.init`` makes, over the same processes; ``transport`` makes one): a job-wide
    decision is keyed by its group (decided once per group), and one runtime's communication thread must never meet
    another's on a group."""
    from gradsync.comm.runtime import Runtime
    from gradsync.comm.transport import create_transport

    out: dict[str, Any] = {}
    try:
        for m in methods:
            if m in DDP_WAYS:
                continue
            out[m] = own = Runtime(
                transport() if transport is not None else create_transport("torch", timeout_s=rt.timeout_s),
                rt.topology, rt.algorithm, options=rt.options, mapping=rt.mapping, timeout_s=rt.timeout_s,
                cost_model=rt.cost_model, adapt=False)
            if start is not None:
                own.tuning.use_tuned(start)
            own.explore = rt.explore
            own.start_pricing()  # as gradsync.init starts it, once the runtime is set up
    except BaseException:
        for made in out.values():  # every thread we start, we also end
            made.shutdown()
        raise
    return out


def tuned_at_init(rt: Any) -> dict[str, Any] | None:
    """The runtime's tuned classes right after ``gradsync.init`` (what calibration's tuning measured, or an earlier
    job cached: a cell's cache directory is its own), as :meth:`~gradsync.comm.tuning.Tuning.use_tuned` takes them;
    None where there are none."""
    return rt.tuning.tuned_doc() if rt.tuning.tuned else None


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Test accuracy and loss of the module itself (not DDP's wrapper: its forward may sync buffers, a collective
    rank 0 would run alone), in eval mode (batch norm's running statistics)."""
    net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    net.eval()
    try:
        with torch.no_grad():
            logits = net(x)
    finally:
        net.train()
    return float((logits.argmax(1) == y).float().mean()), float(nn.functional.cross_entropy(logits, y))


# -- the run -----------------------------------------------------------------------------------------------------

def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="compression-sweep worker (run by benchmarks/compression_sweep.py)")
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--topology", default=None, help="gradsync.init topology (default: switch:<world>)")
    p.add_argument("--configs", required=True, help="comma-separated MODEL/PATH")
    p.add_argument("--methods", default=",".join(method_names()))
    p.add_argument("--allow", default="any", help="auto's policy")
    p.add_argument("--probe-steps", type=int, default=2, help="auto's timed launches per codec")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="after --steps, more steps while the configuration's time stays under this (0: none)")
    p.add_argument("--max-steps", type=int, default=0, help="the most steps --budget-s may run to (0: no limit)")
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--first", type=int, default=50, help="steps whose total time shows what choosing cost")
    p.add_argument("--label", default="", help="where it runs, for the progress lines")
    p.add_argument("--index", type=int, default=0, help="configurations done before this run (progress lines)")
    p.add_argument("--total", type=int, default=0, help="configurations in the whole sweep (progress lines)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--calibrate", action="store_true", help="gradsync.init(calibrate=True)")
    p.add_argument("--share-runtime", action="store_true",
                   help="every method and configuration on gradsync.init's one runtime (before: a size class one "
                        "method explored ran settled for the others)")
    return p.parse_args(argv)


def extra_steps(elapsed_s: float, pace_s: float, budget_s: float, steps: int, max_steps: int) -> int:
    """Steps to add to ``steps`` done in ``elapsed_s``, at ``pace_s`` a step (every method's), to fill ``budget_s``:
    as many whole steps as fit, none past ``max_steps`` (0: no limit); 0 without a budget."""
    if budget_s <= 0 or pace_s <= 0:
        return 0
    fit = max(0, int((budget_s - elapsed_s) / pace_s))
    return min(fit, max(0, max_steps - steps)) if max_steps else fit


def _choosing(replicas: Mapping[str, Replica]) -> bool:
    """Whether some replica is still choosing on some rank (a MAX all-reduce: every rank starts timing at the same
    step)."""
    flag = torch.tensor([float(any(rep.choosing() for rep in replicas.values()))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _agreed_extra(elapsed_s: float, pace_s: float, steps: int, args: argparse.Namespace) -> int:
    """:func:`extra_steps` to ``steps`` on rank 0's clock, the same count on every rank (a broadcast): the replicas'
    collectives must pair up step for step."""
    extra = torch.tensor([extra_steps(elapsed_s, pace_s, args.budget_s, steps, args.max_steps)],
                         dtype=torch.int64)
    dist.broadcast(extra, 0)
    return int(extra.item())


def run_config(rt: Any, model_name: str, path: str, methods: Sequence[str], args: argparse.Namespace,
               progress: Callable[[str], None], start: dict[str, Any] | None = None) -> dict[str, Any]:
    """One configuration: every method's replica from the same weights, stepping in turn on the same batches, each
    gradsync method on a runtime of its own (:func:`own_runtimes`, from ``start``) unless ``--share-runtime``."""
    own = {} if args.share_runtime else own_runtimes(rt, start, methods)
    try:
        return _run_config(rt, own, model_name, path, methods, args, progress)
    finally:
        for runtime in own.values():
            runtime.shutdown()


def _run_config(rt: Any, own: dict[str, Any], model_name: str, path: str, methods: Sequence[str],
                args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    from gradsync.models.data import load_digits, shard

    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_digits(IMAGE)
    torch.manual_seed(0)
    base = MODELS.get(model_name)()
    setup = Setup(rt, args.lr, args.allow, args.probe_steps)
    build = PATHS.get(path)
    replicas = {m: build(m, copy.deepcopy(base), replace(setup, runtime=own.get(m, rt))) for m in methods}
    n_train = data.x_train.shape[0]
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(1))
    samples: dict[str, list[float]] = {m: [] for m in methods}
    first: dict[str, list[float]] = {m: [] for m in methods}
    losses: dict[str, list[float]] = {m: [] for m in methods}
    chose = dict.fromkeys(methods, 0)  # steps until each method stopped choosing (auto; 0: never chose)
    at_steps: dict[str, tuple[float | None, float | None]] = dict.fromkeys(methods, (None, None))
    t0 = time.perf_counter()
    total, t_warm, step = args.steps, t0, 0
    timed_from: int | None = None  # the first timed step: --warmup on, once no method is choosing (at --first at most)
    budgeted = False  # whether --budget-s has added its steps
    while step < total or timed_from is None:
        if timed_from is None and step >= args.warmup and (step >= args.first or not _choosing(replicas)):
            timed_from, t_warm = step, time.perf_counter()
            total = max(total, step + args.steps - args.warmup)
        start = (step * args.batch) % (n_train - args.batch)
        x, y = shard(data.x_train[order[start:start + args.batch]], data.y_train[order[start:start + args.batch]],
                     rank, world)
        for m in list(methods[step % len(methods):]) + list(methods[:step % len(methods)]):
            got: list[float] = []
            dt = _timed(lambda rep=replicas[m], got=got, x=x, y=y: got.append(_train_step(rep, x, y)))
            losses[m].append(got[0])
            if replicas[m].choosing():
                chose[m] = step + 1
            if step < args.first:
                first[m].append(dt)
            if timed_from is not None:
                samples[m].append(dt)
        step += 1
        now = time.perf_counter()  # before the evaluation: the pace is the steps' own
        if step == args.steps:
            if rank == 0:  # the accuracy every configuration reports at the same count
                at_steps = {m: _evaluate(rep.model, data.x_test, data.y_test) for m, rep in replicas.items()}
            dist.barrier()  # the others wait here, not inside the next step's timed collectives
        if not budgeted and step >= args.steps and timed_from is not None and step > timed_from:
            budgeted = True  # once, at --steps or at the first timed step after it: the pace is the timed steps'
            if args.budget_s > 0:
                total += _agreed_extra(now - t0, (now - t_warm) / (step - timed_from), total, args)
        if step % 5 == 0 or step == total:
            progress(f"step {step}/{total}{'' if timed_from is not None else '+, untimed while choosing'} "
                     f"({time.perf_counter() - t0:.0f} s)")
    rows = {}
    for m, rep in replicas.items():
        acc, loss = _evaluate(rep.model, data.x_test, data.y_test) if rank == 0 else (None, None)
        rows[m] = {"median_s": statistics.median(samples[m]), "samples_s": samples[m], "first_steps_s": first[m],
                   "losses": losses[m], "accuracy": at_steps[m][0], "test_loss": at_steps[m][1],
                   "accuracy_final": acc, "test_loss_final": loss, "choosing_steps": chose[m],
                   "replicas_identical": replicas_identical(rep.model), "stats": rep.stats()}
    return {"model": model_name, "path": path, "steps": total, "accuracy_steps": args.steps, "timed_from": timed_from,
            "parameters": sum(p.numel() for p in base.parameters()),
            "model_bytes": sum(p.numel() * p.element_size() for p in base.parameters()), "methods": rows,
            "run_s": time.perf_counter() - t0}


def main(argv: Sequence[str] | None = None) -> int:
    import gradsync

    args = _args(argv)
    configs = [tuple(c.split("/", 1)) for c in args.configs.split(",") if c]
    methods = [m for m in args.methods.split(",") if m]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rt = gradsync.init(args.topology, timeout_s=args.timeout, calibrate=args.calibrate)
    start = tuned_at_init(rt)
    if not args.share_runtime:  # every method prices on a runtime of its own: init's child would only take CPU
        rt.plans.stop_ahead("the sweep's methods run on runtimes of their own")
    out: dict[str, Any] = {"topology": rt.topology.name, "world_size": rt.world_size, "torch": torch.__version__,
                           "cost_model": rt.cost_model.to_dict(), "calibrated": args.calibrate,
                           "runtimes": "shared" if args.share_runtime else "one per method and configuration",
                           "init_s": time.perf_counter() - t0, "steps": args.steps, "warmup": args.warmup,
                           "batch": args.batch, "lr": args.lr, "allow": args.allow, "configs": []}
    total = args.total or len(configs)
    for i, (model_name, path) in enumerate(configs):
        tag = f"[{args.index + i + 1}/{total}] {model_name}/{path}" + (f" on {args.label}" if args.label else "")

        def progress(text: str, tag: str = tag) -> None:
            if rt.rank == 0:
                print(f"{tag}: {text}", flush=True)

        result = run_config(rt, model_name, path, methods, args, progress, start)
        med = {m: r["median_s"] for m, r in result["methods"].items()}
        progress("done, median s/step " + ", ".join(f"{m} {v:.3f}" for m, v in med.items()))
        out["configs"].append(result)
    if rt.rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1), encoding="utf-8")
    gradsync.shutdown()
    return 0


if __name__ == "__main__":
    leave(main())
