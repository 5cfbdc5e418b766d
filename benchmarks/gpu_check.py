"""The GPU check anyone with a CUDA GPU can run: ``gradsync bench gpu`` (one JSON, one call).

Three parts, each case in its own try so one failure never hides the rest:

* ``codecs``: every compressor's compress, decompress, combine and in-place residual on the device: the same
  result as on the CPU where the codec is deterministic, and its time (median of ``--reps``, the device
  synchronised) beside GRACE's formulas for the same method on the same device (``benchmarks.codecs``; rand-k
  against both GRACE variants: a full ``randperm`` and ``randint`` with replacement);
* ``engines``: in fresh processes, every compressor (and ``"auto"`` under each ``allow`` policy) through
  ``DistributedOptimizer`` and through the DDP ``compression_hook`` for a few steps of a small CNN, on NCCL with one rank and on gloo with CUDA tensors with
  two ranks sharing the GPU; and ``gradsync.allreduce`` of a CUDA tensor with every synthesizer on gloo
  (exact sums). A case passes when it runs, its result is finite, the replicas are the same bits on every rank,
  and (allreduce) exact;
* ``hooks``: DDP step time on NCCL with one rank, methods interleaved: plain DDP; torch's ``allreduce_hook`` (what
  any Python comm hook costs); torch's ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 1) against gradsync's
  fp16 and powersgd hooks; ``compression="auto"``'s hook against plain DDP and ``allreduce_hook`` (one rank:
  nothing to gain on the wire, so auto's own cost shows);
  and ``DistributedOptimizer`` without a codec and with ``"auto"`` beside them (``paired_median_settled``: only the
  steps after both autos stopped choosing).
  ``GRADSYNC_GPU_PROFILE=1`` profiles the four fp16/powersgd hooks; a comma-separated list of method names, those.

Without a GPU it runs the same cases on the CPU with gloo (a dry run: NCCL cases are skipped and say so), which
is what the test suite does with ``--quick``. The file records the GPU's name, torch's and NCCL's versions.

Run from the repository root::

    gradsync bench gpu                               # a few minutes on one GPU
    python -m benchmarks.gpu_check --quick --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

RESULT_TYPE = "gradsync.bench.gpu"


def _device() -> Any:
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _median_time(fn: Callable[[], Any], device: Any, reps: int) -> float:
    for _ in range(5):  # warm-up: allocations, lazy initialisation, the clocks' ramp
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _stream_time(fn: Callable[[], Any], device: Any, reps: int, calls: int = 20) -> float:
    """Seconds per call with ``calls`` calls back to back between synchronisations: what a training step sees,
    where codec calls queue behind each other (the device stays busy and its clocks up; at 1e6 elements this is
    the host's launch rate), beside :func:`_median_time`'s one call and one wait."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _launches(fn: Callable[[], Any], device: Any) -> dict[str, int]:
    """What one call costs besides bytes: device operations (kernels, copies, fills) and host synchronisations,
    counted by torch.profiler (on a GPU only)."""
    import torch

    if device.type != "cuda":
        return {}

    def counted(fn: Callable[[], Any]) -> tuple[int, int]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        events = prof.events()
        return (sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                sum(1 for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")))

    kernels, syncs = counted(fn)
    _, closing = counted(lambda: None)  # what the closing synchronize itself counts
    return {"kernels": kernels, "host_syncs": max(0, syncs - closing)}


# ---- codecs on the device ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _torch_form() -> Iterator[None]:
    """The codecs' torch forms (the fused kernels off) inside the block."""
    from gradsync.compress import kernels

    before = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[kernels.ENV]
        else:
            os.environ[kernels.ENV] = before



def _grace_randk_randint(x: Any, ratio: float = 0.01) -> tuple[Any, int]:
    import torch

    k = max(1, int(x.numel() * ratio))
    idx = torch.randint(x.numel(), (k,), device=x.device)
    out = torch.zeros_like(x).scatter_(0, idx, x[idx])
    return out, k * (x.element_size() + 8)


def _grace_randk_randperm(x: Any, ratio: float = 0.01) -> tuple[Any, int]:
    import torch

    k = max(1, int(x.numel() * ratio))
    idx = torch.randperm(x.numel(), device=x.device)[:k]
    out = torch.zeros_like(x).scatter_(0, idx, x[idx])
    return out, k * (x.element_size() + 8)


def launch_costs(reps: int = 50) -> dict[str, float]:
    """Host microseconds per launch, 100 launches back to back: a fused kernel through gradsync's wrapper, and a
    torch kernel (what a codec at 1e6 elements, where the host is the bottleneck, pays per kernel)."""
    import torch

    from gradsync.compress import kernels

    device = _device()
    y = torch.randn(1024, device=device)
    out: dict[str, float] = {}
    cases = {"torch_kernel": lambda: y.add_(0.0)}
    if kernels.enabled_for(y):
        cases["fused_kernel"] = lambda: kernels.pack_nonnegative(y)
    for name, fn in cases.items():
        out[f"{name}_us"] = _median_time(lambda fn=fn: [fn() for _ in range(100)], device, reps) / 100 * 1e6
    return out


def codecs_part(sizes: Sequence[int], reps: int) -> list[dict[str, Any]]:
    import torch

    from benchmarks import codecs as ref
    from gradsync.compress import COMPRESSORS, create, kernels
    from gradsync.compress.base import TensorInfo

    device = _device()
    grace = {"fp16": [("grace", ref.grace_fp16)], "qsgd": [("grace", ref.grace_qsgd)],
             "terngrad": [("grace", ref.grace_terngrad)], "signsgd": [("grace", ref.grace_signsgd)],
             "efsignsgd": [("grace", ref.grace_efsignsgd)], "topk": [("grace", ref.grace_topk)],
             "randk": [("grace_randperm", _grace_randk_randperm), ("grace_randint", _grace_randk_randint)]}
    deterministic = {"none", "fp16", "topk", "signsgd", "signum", "efsignsgd", "onebit", "randk", "powersgd"}
    rows = []
    for n in sizes:
        x_cpu = torch.randn(n, generator=torch.Generator().manual_seed(0))
        x = x_cpu.to(device)
        info = TensorInfo("w", (n,), torch.float32)
        for name in COMPRESSORS.names():
            row: dict[str, Any] = {"codec": name, "elements": n, "device": str(device)}
            try:
                c, c_cpu = create(name), create(name)
                payload, ctx = c.compress(x, info)
                decoded = c.decompress(payload, ctx)
                combined = c.combine([payload, payload], ctx)
                residual = c.subtract_decoded(x.clone(), payload, ctx, inplace=True)
                on_device = all(t.device == device for t in (*payload, decoded, combined, residual))
                row["on_device"] = on_device
                if name in deterministic:
                    p_cpu, ctx_cpu = c_cpu.compress(x_cpu, info)
                    row["same_as_cpu"] = bool(torch.allclose(decoded.cpu(), c_cpu.decompress(p_cpu, ctx_cpu),
                                                             rtol=1e-5, atol=1e-6))
                row["fused"] = kernels.enabled_for(x)
                row["rel_error"] = float((decoded.reshape(-1) - x).norm() / x.norm())
                if row["fused"]:  # the fused kernels' decode against the torch form's, on the same payload
                    with _torch_form():
                        row["decode_same_as_torch"] = bool(torch.equal(decoded, c.decompress(payload, ctx)))
                        t_form = create(name)
                        row["torch_form_rel_error"] = float(
                            (t_form.decompress(*t_form.compress(x, info)).reshape(-1) - x).norm() / x.norm())
                timed = create(name)
                row["gradsync_s"] = _median_time(lambda c=timed, x=x, i=info: c.decompress(*c.compress(x, i)), device,
                                                 reps)
                if row["fused"]:  # the same codec without the kernels, side by side in this run
                    with _torch_form():
                        row["torch_form_s"] = _median_time(
                            lambda c=timed, x=x, i=info: c.decompress(*c.compress(x, i)), device, reps)
                row["bytes"] = sum(t.numel() * t.element_size() for t in payload)
                for label, fn in grace.get(name, []):
                    row[f"{label}_s"] = _median_time(lambda fn=fn, x=x: fn(x), device, reps)
                    row[f"ratio_{label}"] = row["gradsync_s"] / row[f"{label}_s"]
                if grace.get(name):  # back to back, the two in turn: the ratio a training step would see
                    label, fn = grace[name][-1] if name == "randk" else grace[name][0]
                    ours, theirs = [], []
                    for _ in range(3):
                        ours.append(_stream_time(lambda c=timed, x=x, i=info: c.decompress(*c.compress(x, i)),
                                                 device, max(3, reps // 3)))
                        theirs.append(_stream_time(lambda fn=fn, x=x: fn(x), device, max(3, reps // 3)))
                    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
                    row["gradsync_stream_s"], row[f"{label}_stream_s"] = ours_s, theirs_s
                    row[f"ratio_{label}_stream"] = ours_s / theirs_s
                row["copy_s"] = _median_time(x.clone, device, reps)
                row.update(_launches(lambda c=timed, x=x, i=info: c.decompress(*c.compress(x, i)), device))
                for label, fn in grace.get(name, [])[:1]:
                    row.update({f"{label}_{k}": v for k, v in _launches(lambda fn=fn, x=x: fn(x), device).items()})
                row["ok"] = on_device and row.get("same_as_cpu", True) and row.get("decode_same_as_torch", True)
            except Exception as exc:  # noqa: BLE001 - recorded, the next case runs
                row.update(ok=False, error=_first_line(exc))
            rows.append(row)
            print(f"  codec {name:9s} {n:>9d}: " + ("ok" if row["ok"] else f"FAIL {row.get('error', row)}"),
                  flush=True)
    return rows


# ---- engines in fresh processes ------------------------------------------------------------------------------
def _cnn() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 14 * 14, 10))


def _engine_rank(rank: int, world: int, backend: str, store: str, steps: int, out: str) -> None:
    """One rank of one engine: every compressor by optimizer and by hook, then allreduce per synthesizer."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync
    from benchmarks.common import replicas_identical
    from gradsync.compress import COMPRESSORS
    from gradsync.sim.choose import algorithms_for

    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    results = []

    def case(what: str, fn: Callable[[], bool]) -> None:
        try:
            ok = bool(fn())
            results.append({"case": what, "ok": ok})
        except Exception as exc:  # noqa: BLE001
            results.append({"case": what, "ok": False, "error": _first_line(exc),
                            "where": traceback.format_exc().strip().splitlines()[-3][:200]})

    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 3, 16, 16, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device))
               for _ in range(steps)]

    def train(model: Any, step: Callable[[], None], opt: Any) -> bool:
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            step()
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            return False
        # the replicas started alike (_cnn's seed): every rank's parameters must still be the same bits, which a
        # device kernel that sums in a rank-dependent or racy order (atomics in a scatter) would break
        if not replicas_identical(model):
            raise RuntimeError(f"replicas differ across ranks after {len(batches)} steps")
        return True

    # auto: compression chosen per group (issue 40), under each accuracy policy ("auto" alone: allow="cast")
    for name in [*COMPRESSORS.names(), "auto", "auto:lossless", "auto:any"]:
        codec, _, allow = name.partition(":")
        extra = {"allow": allow} if allow else {}

        def by_optimizer(codec: str = codec, extra: dict[str, str] = extra) -> bool:
            model = _cnn().to(device)
            opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                                compression=codec, **extra)
            return train(model, opt.step, opt)

        def by_hook(codec: str = codec, extra: dict[str, str] = extra) -> bool:
            net = _cnn().to(device)
            model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
            model.register_comm_hook(gradsync.CompressionHookState(codec, model=net, **extra), gradsync.compression_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            return train(model, opt.step, opt)

        case(f"optimizer/{name}", by_optimizer)
        case(f"hook/{name}", by_hook)
    # every synthesizer on both engines (on NCCL a named plan runs over its point-to-point messages), and auto
    rt = gradsync.get_runtime()
    for algorithm in [*algorithms_for(rt.topology), "auto"]:
        def exact(algorithm: str = algorithm) -> bool:
            x = torch.full((1000,), float(rank + 1), device=device)
            gradsync.allreduce(x, algorithm=algorithm)
            return bool((x == world * (world + 1) / 2).all()) and x.device == device

        case(f"allreduce/{algorithm}", exact)
    gradsync.shutdown()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))


def engines_part(steps: int) -> list[dict[str, Any]]:
    import torch
    import torch.multiprocessing as mp

    cuda = torch.cuda.is_available()
    runs = [("nccl", 1), ("gloo", 2)]
    rows = []
    for backend, world in runs:
        label = f"{backend}/{world}"
        if backend == "nccl" and not (cuda and torch.distributed.is_nccl_available()):
            rows.append({"engine": label, "skipped": "no CUDA GPU / NCCL here"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
            try:
                mp.start_processes(_spawned, args=(world, backend, os.path.join(tmp, "store"), steps, tmp),
                                   nprocs=world, join=True, start_method="spawn")
            except Exception as exc:  # noqa: BLE001 - a rank died: what the others wrote still counts
                rows.append({"engine": label, "ok": False, "error": _first_line(exc)})
            for r, path in enumerate(outs):
                if os.path.exists(path):
                    for res in json.loads(Path(path).read_text()):
                        rows.append({"engine": label, "rank": r, **res})
        print(f"  engine {label}: {sum(1 for x in rows if x.get('engine') == label and x.get('ok'))} cases ok, "
              f"{sum(1 for x in rows if x.get('engine') == label and x.get('ok') is False)} failed", flush=True)
    return rows


def _spawned(rank: int, world: int, backend: str, store: str, steps: int, tmp: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _engine_rank(rank, world, backend, store, steps, os.path.join(tmp, f"rank{rank}.json"))


# ---- trainers: Lightning's documented GPU recipe ---------------------------------------------------------------
def _staging_rank(rank: int, world: int, store: str, sizes: Sequence[int], reps: int, out: str) -> None:
    """One gloo rank: the same allreduce of host and of CUDA tensors, alternating, gradsync's ring (the executor's
    point-to-point messages, CUDA ones staged through pinned host buffers) and gloo's own allreduce."""
    import torch
    import torch.distributed as dist

    import gradsync

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    gradsync.init(algorithm="ring")
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if cuda else [])
    rows = []
    for n in sizes:
        times: dict[str, list[float]] = {}
        tensors = {d.type: torch.full((n,), float(rank + 1), device=d) for d in devices}
        for rep in range(reps + 1):
            for d in devices:
                for method in ("gradsync_ring", "gloo"):
                    x = tensors[d.type]
                    x.fill_(float(rank + 1))
                    _sync(d)
                    dist.barrier()
                    t0 = time.perf_counter()
                    if method == "gloo":
                        dist.all_reduce(x)
                    else:
                        gradsync.allreduce(x)
                    _sync(d)
                    if rep:  # the first round warms up
                        times.setdefault(f"{method}/{d.type}", []).append(time.perf_counter() - t0)
                    if not bool((x == world * (world + 1) / 2).all()):
                        raise RuntimeError(f"{method} on {d} gave a wrong sum")
        row: dict[str, Any] = {"bytes": 4 * n, **{k: statistics.median(v) for k, v in times.items()}}
        for method in ("gradsync_ring", "gloo"):
            if f"{method}/cuda" in row:
                row[f"{method}_cuda_over_host"] = row[f"{method}/cuda"] / row[f"{method}/cpu"]
        rows.append(row)
    gradsync.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def staging_part(sizes: Sequence[int], reps: int) -> list[dict[str, Any]]:
    """gloo with CUDA tensors against host tensors of the same bytes, 2 ranks: what the staging costs (gradsync's
    ring stages each message through pinned host memory, its copies overlapping the other messages' transfers)
    beside what gloo's own CUDA allreduce pays for the same."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "staging.json")
        mp.start_processes(_staging_rank, args=(2, os.path.join(tmp, "store"), list(sizes), reps, out), nprocs=2,
                           join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def trainers_part(steps: int) -> list[dict[str, Any]]:
    """``DDPStrategy(ddp_comm_state=<gradsync state built before any process group>, ddp_comm_hook=...)`` on one
    GPU, each hook in a fresh process: it passes when the hook ran (buckets > 0) and the weights are finite."""
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        return [{"skipped": "Lightning registers DDP hooks on CUDA only"}]
    try:
        import lightning  # noqa: F401
    except ImportError:
        return [{"skipped": "lightning is not installed"}]
    rows = []
    for hook in ("allreduce", "fp16", "powersgd"):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            try:
                mp.start_processes(_lightning_case, args=(hook, steps, out), nprocs=1, join=True, start_method="spawn")
                rows.append(json.loads(Path(out).read_text()))
            except Exception as exc:  # noqa: BLE001
                rows.append({"case": f"lightning/{hook}", "ok": False, "error": _first_line(exc)})
        print(f"  trainer lightning/{hook}: {'ok' if rows[-1].get('ok') else rows[-1]}", flush=True)
    return rows


def _lightning_case(rank: int, hook: str, steps: int, out: str, accelerator: str = "gpu") -> None:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    import gradsync

    states = {"allreduce": (gradsync.GradsyncHookState, (), gradsync.allreduce_hook),
              "fp16": (gradsync.CompressionHookState, ("fp16",), gradsync.compression_hook),
              "powersgd": (gradsync.CompressionHookState, ("powersgd",), gradsync.compression_hook)}
    cls, args, fn = states[hook]
    state = cls(*args)  # before any process group, as Lightning builds its strategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

        def training_step(self, batch: Any, _: int) -> Any:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(32 * steps, 32, generator=gen), torch.randint(0, 10, (32 * steps,), generator=gen)), batch_size=32)
    model = Net()
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=fn),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, data)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    Path(out).write_text(json.dumps({"case": f"lightning/{hook}", "ok": state.buckets > 0 and finite,
                                     "buckets": state.buckets}))


# ---- hook step time ------------------------------------------------------------------------------------------
def hooks_part(steps: int) -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return [{"skipped": "step times are measured on a GPU with NCCL"}]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hooks.json")
        mp.start_processes(_hooks_rank, args=(os.path.join(tmp, "store"), steps, out), nprocs=1, join=True,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def _timed_hook(fn: Callable[..., Any], sink: list[float]) -> Callable[..., Any]:
    """``fn`` with the host time of each call appended to ``sink``: what the hook costs the training thread in
    backward (the launch, and any callback that runs at once: NCCL's futures are complete when the work is queued),
    apart from the step time around it. ``functools.wraps`` keeps ``fn``'s signature, which DDP checks when the
    hook is registered."""

    @functools.wraps(fn)
    def hook(state: Any, bucket: Any) -> Any:
        t0 = time.perf_counter()
        fut = fn(state, bucket)
        sink.append(time.perf_counter() - t0)
        return fut

    return hook


def _hooks_rank(rank: int, store: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsync

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    device = torch.device("cuda", 0)

    def net() -> Any:
        torch.manual_seed(0)
        try:  # the model: ResNet-18 at 32x32, 10 classes
            import torchvision

            return torchvision.models.resnet18(num_classes=10).to(device)
        except ImportError:
            pass
        return torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(2048, 1000),
                                   torch.nn.ReLU(), torch.nn.Linear(1000, 10)).to(device)

    methods: dict[str, Any] = {}
    states: dict[str, Any] = {}
    # name -> (the hook's state, made from the plain model; the hook); plain DDP has none
    hooks: dict[str, tuple[Callable[[Any], Any], Callable[..., Any]]] = {
        # any Python hook's own cost: what auto's settled 'none' should match
        "torch_allreduce": (lambda base: None, default_hooks.allreduce_hook),
        "torch_fp16": (lambda base: None, default_hooks.fp16_compress_hook),
        "gradsync_fp16": (lambda base: gradsync.CompressionHookState("fp16", model=base), gradsync.compression_hook),
        "torch_powersgd": (lambda base: powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                                    start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook),
        "gradsync_powersgd": (lambda base: gradsync.CompressionHookState("powersgd", model=base),
                              gradsync.compression_hook),
        # one rank: nothing to save on the wire, so auto must cost about nothing
        "gradsync_auto": (lambda base: gradsync.CompressionHookState("auto", model=base), gradsync.compression_hook),
    }
    calls: dict[str, list[float]] = {name: [] for name in hooks}  # host seconds per hook call, the timed steps'
    for name in ("ddp", *hooks):
        base = net()
        model = DDP(base, device_ids=[0])
        if name in hooks:
            make, fn = hooks[name]
            state = make(base)
            if name == "gradsync_auto":
                states[name] = state
            model.register_comm_hook(state, _timed_hook(fn, calls[name]))
        methods[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    # DistributedOptimizer on the plain model (no DDP): its own exchange with no codec, and auto's choice
    for name, compression in (("optimizer_none", None), ("optimizer_auto", "auto")):
        base = net()
        opt = gradsync.DistributedOptimizer(torch.optim.SGD(base.parameters(), lr=0.01), base.named_parameters(),
                                            compression=compression)
        methods[name] = (base, opt)
        if compression == "auto":
            states[name] = opt
    x, y = torch.randn(64, 3, 32, 32, device=device), torch.randint(0, 10, (64,), device=device)
    times: dict[str, list[float]] = {m: [] for m in methods}
    settled: list[bool] = []  # per timed step: whether both autos had stopped choosing before it
    for step in range(steps + 5):
        order = list(methods) if step % 2 == 0 else list(reversed(methods))
        if step == 5:  # the hook calls of the timed steps only
            for sink in calls.values():
                sink.clear()
        if step >= 5:
            settled.append(not any(st.choosing for st in states.values()))
        for name in order:
            model, opt = methods[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            torch.cuda.synchronize()
            if step >= 5:
                times[name].append(time.perf_counter() - t0)
    if os.environ.get("GRADSYNC_GPU_PROFILE"):  # where a hook's step time goes: the top ops of 3 steps each
        for name in os.environ.get("GRADSYNC_GPU_PROFILE", "").split(",") if "_" in os.environ.get(
                "GRADSYNC_GPU_PROFILE", "") else ("torch_powersgd", "gradsync_powersgd", "torch_fp16", "gradsync_fp16"):
            model, opt = methods[name]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                torch.cuda.synchronize()
            print(f"---- profile {name}", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50),
                  flush=True)
    for name in ("gradsync_auto", "optimizer_auto"):  # what each chose; the hook's launches on the backend's allreduce
        auto = states[name].auto if name == "gradsync_auto" else states[name].compression
        print(f"  {name}: {auto.native_launches} native launches, step check {auto.step_check}\n{auto.report()}",
              flush=True)
    med = {m: statistics.median(t) for m, t in times.items()}
    rows: list[dict[str, Any]] = [{"method": m, "median_s": s} for m, s in med.items()]
    rows.append({"settled_steps": sum(settled), "timed_steps": len(settled)})
    rows.append({"hook_call_us": {m: statistics.median(c) * 1e6 for m, c in calls.items() if c},
                 "hook_calls_per_step": {m: len(c) / max(1, len(settled)) for m, c in calls.items()}})
    for ours, theirs in (("gradsync_fp16", "torch_fp16"), ("gradsync_powersgd", "torch_powersgd"),
                         ("gradsync_auto", "ddp"), ("gradsync_auto", "torch_allreduce"), ("torch_allreduce", "ddp"),
                         ("optimizer_none", "ddp"), ("optimizer_auto", "ddp"),
                         ("optimizer_auto", "optimizer_none")):
        paired = [a / b for a, b in zip(times[ours], times[theirs])]  # the same step, the two in turn
        row = {"ratio": f"{ours}/{theirs}", "value": med[ours] / med[theirs], "paired_median": statistics.median(paired)}
        if "auto" in ours and any(settled):  # what a settled auto costs, its choosing left out
            row["paired_median_settled"] = statistics.median(r for r, ok in zip(paired, settled) if ok)
        rows.append(row)
    gradsync.shutdown()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(rows))


# ---- main ------------------------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as exc:  # noqa: BLE001
            env["nccl"] = _first_line(exc)
    return env


def summary(doc: dict[str, Any]) -> None:
    """The figures a reader wants first: codec time over GRACE's and over a copy, hook step ratios."""
    for row in doc.get("codecs", []):
        if "gradsync_s" in row:
            ratios = " ".join(f"{k[6:]}={v:.2f}x" for k, v in row.items() if k.startswith("ratio_"))
            launches = (f" kernels={row['kernels']} syncs={row['host_syncs']}" if "kernels" in row else "") + "".join(
                f" {k}={v}" for k, v in row.items() if k.endswith("_kernels"))
            if "torch_form_s" in row:
                ratios += f" torch_form={row['gradsync_s'] / row['torch_form_s']:.2f}x"
            print(f"  {row['codec']:9s} {row['elements']:>9d}: {row['gradsync_s'] * 1e3:8.3f} ms "
                  f"({row['gradsync_s'] / row['copy_s']:.1f}x a copy) {ratios}{launches}", flush=True)
    if doc.get("launch"):
        print(f"  launch costs (host us per launch): {doc['launch']}", flush=True)
    for row in doc.get("staging", []):
        print(f"  staging: {row}", flush=True)
    for row in doc.get("hooks", []):
        print("  hooks:", row, flush=True)
    for row in doc.get("engines", []):
        if row.get("ok") is False:
            print("  FAILED:", row, flush=True)


def _write(doc: dict[str, Any], path: Path) -> None:
    failed = [r for part in ("codecs", "engines", "trainers") for r in doc.get(part, []) if r.get("ok") is False]
    doc["failed"] = len(failed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gradsync bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes and few steps (the test suite's dry run)")
    p.add_argument("--parts", default="codecs,engines,staging,hooks,trainers",
                   help="comma-separated: codecs, engines, staging, hooks, trainers")
    p.add_argument("--reps", type=int, default=None, help="timed runs per codec case (default 30, quick 3)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    parts = [s for s in args.parts.split(",") if s]
    unknown = set(parts) - {"codecs", "engines", "staging", "hooks", "trainers"}
    if unknown:
        print(f"unknown part(s) {sorted(unknown)}; use codecs, engines, staging, hooks, trainers", file=sys.stderr)
        return 2
    reps = args.reps or (3 if args.quick else 30)
    sizes = (1000, 100_000) if args.quick else (1_000_000, 25_000_000)
    doc: dict[str, Any] = {"type": RESULT_TYPE, "environment": environment(), "quick": args.quick}
    print(f"gradsync bench gpu on {doc['environment'].get('gpu', 'the CPU (no GPU: a dry run)')}", flush=True)
    gpu = doc["environment"].get("gpu", "cpu").lower().replace(" ", "_")
    path = args.out / f"gpu_check-{gpu}.json"
    runs: dict[str, Callable[[], None]] = {
        "codecs": lambda: doc.update(codecs=codecs_part(sizes, reps), launch=launch_costs()),
        "engines": lambda: doc.update(engines=engines_part(2 if args.quick else 4)),
        "staging": lambda: doc.update(staging=staging_part((1000,) if args.quick else (1_000_000, 16_000_000),
                                                           2 if args.quick else 7)),
        "hooks": lambda: doc.update(hooks=hooks_part(10 if args.quick else 100)),
        "trainers": lambda: doc.update(trainers=trainers_part(5)),
    }
    for part in runs:
        if part in parts:
            runs[part]()
            _write(doc, path)  # after each part: a run cut short keeps what it measured
    summary(doc)
    print(f"{doc['failed']} case(s) failed; wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
