"""Worker program for test_compress_dist.py, launched once per rank with torchrun's environment.

``python tests/workers/compress_worker.py SCENARIO OUT_DIR``: runs the scenario, writes ``OUT_DIR/rank{R}.json``
and exits 0. Expectations are computed independently of the communicators: closed-form contents for the
allgather, and :func:`gradsync.compress.simulate_step` run in this process over every rank's gradients
(each rank can regenerate all ranks' inputs from seeds) for the compressed steps.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

import gradsync
from gradsync.compress import (
    COMPRESSORS,
    TensorInfo,
    create,
    create_memory,
    default_memory,
    resolve_merge,
    simulate_step,
)
from gradsync.train import CompressionHookState, CompressionStep, MergedGroups, compression_hook
from tests.compress.seeded import step_tensors
from tests.dist_launch import counting_native, run_scenario

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])

#: Parameters per compressor: seeded where a compressor draws random numbers, so the reference can redo it.
PARAMS = {"qsgd": {"levels": 15}, "topk": {"ratio": 0.2}, "randk": {"ratio": 0.2}, "dgc": {"ratio": 0.2, "seed": 3}}
SEEDED_PER_WORKER = ("qsgd", "terngrad")  # each worker draws its own noise: seed = worker + 1


def _compressor(name: str, worker: int):
    params = dict(PARAMS.get(name, {}))
    if name in SEEDED_PER_WORKER:
        params["seed"] = worker + 1
    return create(name, **params)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / (b.abs().max() + 1e-30)) if b.numel() else 0.0


# ---- allgather with uneven sizes -----------------------------------------------------------------------------


def _pattern(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + 13 * rank) % 251).to(dtype)


def scenario_allgather() -> dict:
    """Uneven 1-D allgathers (an empty one too), interleaved with allreduces, and a packed mixed payload."""
    rt = gradsync.init(algorithm="ring", timeout_s=60)
    sizes = {r: [0, 1, 5 + 1000 * r, 3 - r if r < 3 else 0, 70_000 * (r % 2)] for r in range(WORLD)}
    failures = []
    works = []
    for k in range(len(sizes[0])):
        x = torch.full((11,), float(RANK + 1))
        works.append(("allreduce", k, x, rt.allreduce_async(x)))
        mine = _pattern(RANK, sizes[RANK][k], torch.uint8)
        works.append(("allgather", k, mine, rt.allgather_async(mine)))
    for kind, k, x, work in works:
        got = work.wait()
        if kind == "allreduce":
            if not torch.equal(x, torch.full((11,), float(sum(range(1, WORLD + 1))))):
                failures.append(f"allreduce {k}")
        else:
            want = [_pattern(r, sizes[r][k], torch.uint8) for r in range(WORLD)]
            if len(got) != WORLD or not all(torch.equal(g, w) for g, w in zip(got, want)):
                failures.append(f"allgather {k}: sizes {[g.numel() for g in got]} want {[w.numel() for w in want]}")
    # Equal sizes announced (a fixed-size payload): one all_gather, no sizes round; empty too.
    for n in (0, 3, 70_000):
        mine = _pattern(RANK, n, torch.uint8)
        got = rt.submit(lambda mine=mine: rt.run_allgather(mine, equal_sizes=True)).wait()
        if not all(torch.equal(g, _pattern(r, n, torch.uint8)) for r, g in enumerate(got)) or len(got) != WORLD:
            failures.append(f"equal-size allgather of {n}")
    # A payload of mixed dtypes and shapes whose length differs per rank, through the allgather communicator.
    from gradsync.compress import pack_payload, unpack_payload

    def payload(r: int) -> list[torch.Tensor]:
        return [
            torch.arange(3 + r, dtype=torch.float32).reshape(1, -1) * (r + 1),
            _pattern(r, 9 * r + 2, torch.uint8),
            torch.tensor([r, -r], dtype=torch.int64),
            torch.full((2, 2), r + 0.5, dtype=torch.float16),
        ]

    gathered = rt.allgather(pack_payload(payload(RANK)))
    for r, buf in enumerate(gathered):
        got, want = unpack_payload(buf), payload(r)
        if len(got) != len(want) or not all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)):
            failures.append(f"packed payload of rank {r}")
    gradsync.shutdown()
    return {"failures": failures, "gathers": sum(1 for w in works if w[0] == "allgather")}


# ---- merged vs layer-wise against simulate_step --------------------------------------------------------------

SHAPES = [(16, 8), (16,), (32, 16), (32,), (4, 4, 3, 3), (10, 32), (10,)]  # backward order


def _grads(worker: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    return [torch.randn(s, generator=g) for s in SHAPES]


def scenario_merged() -> dict:
    """Every compressor, layer-wise and merged (y = 3, y = 1), 3 steps: the distributed result equals
    simulate_step over the same groups; fp16 and the sign methods give the same bits merged or not."""
    rt = gradsync.init(algorithm="ring", timeout_s=60)
    names = [f"t{i}" for i in range(len(SHAPES))]
    sizes = [torch.Size(s).numel() for s in SHAPES]
    report: dict = {}
    for comp in COMPRESSORS.names():
        per_merge = {}
        for merge in ("layerwise", 3, 1):
            partition = resolve_merge(merge, sizes)
            step = CompressionStep(_compressor(comp, RANK), runtime=rt)
            groups = MergedGroups(step, names, SHAPES, torch.float32, partition)
            refs = [_compressor(comp, w) for w in range(WORLD)]
            mems = [create_memory(default_memory(comp)) for _ in range(WORLD)]
            worst, results = 0.0, []
            for s in range(3):
                mine = _grads(RANK, s)
                for i in reversed(range(len(SHAPES))):  # any arrival order: a group goes when complete
                    groups.add(i, mine[i].clone())
                out = groups.wait()
                everyone = [_grads(w, s) for w in range(WORLD)]
                # Reversed arrival completes the groups in reverse order: seeded compressors draw in that order.
                for g in reversed(groups.groups):
                    if g.parts:  # a batch (PowerSGD keeps shapes): each member compressed alone, under its own name
                        ref = torch.cat([simulate_step(refs, mems, [everyone[w][i] for w in range(WORLD)], info).reshape(-1)
                                         for i, info in zip(g.members, g.parts)])
                    else:
                        flat = [
                            torch.cat([everyone[w][i].reshape(-1) for i in g.members]) if len(g.members) > 1 else everyone[w][g.members[0]]
                            for w in range(WORLD)
                        ]
                        ref = simulate_step(refs, mems, flat, g.info).reshape(-1)
                    got = torch.cat([out[i].reshape(-1) for i in g.members])
                    worst = max(worst, _rel(got, ref))
                results.append(torch.cat([o.reshape(-1) for o in out]))
            per_merge[str(merge)] = (worst, torch.stack(results))
        layer = per_merge["layerwise"][1]
        report[comp] = {
            "vs_simulate": {m: v[0] for m, v in per_merge.items()},
            "merged_equals_layerwise": {m: bool(torch.equal(v[1], layer)) for m, v in per_merge.items()},
        }
    gradsync.shutdown()
    return report


# ---- non-finite gradients (issue 42) ---------------------------------------------------------------------------

def scenario_nonfinite() -> dict:
    """Every compressor (its own memory and ``residual``), two tensors per step in two exchanges: at step 2 rank 0's
    ``a`` (first exchange) holds one NaN, or for every other compressor ``b`` (second exchange) one inf. Against a
    run that skipped step 2 altogether: the bad tensor comes back all NaN at step 2, the other one finite, and every
    later step is bit for bit the never-bad run's for both tensors (the step is one transaction, issue 42); the
    step counts once on every rank."""
    rt = gradsync.init(algorithm="ring", timeout_s=60)
    shapes = {"a": (40, 25), "b": (30, 10)}
    report: dict = {}
    for index, comp in enumerate(COMPRESSORS.names()):
        bad, where, other = (float("nan"), "a", "b") if index % 2 == 0 else (float("inf"), "b", "a")
        for memory in (default_memory(comp), "residual"):
            runs = []
            for skip in (False, True):
                step = CompressionStep(_compressor(comp, RANK), memory, runtime=rt)
                outs = []
                for s in range(5):
                    if s == 2 and skip:
                        outs.append({})
                        continue
                    grads = step_tensors(shapes, s, RANK, per_step=100, bad=(2, where, 3, bad))
                    works = {n: step.step_async([grads[n]], [TensorInfo(n, shapes[n], torch.float32)]) for n in shapes}
                    step.close_step()
                    outs.append({n: w.wait()[0] for n, w in works.items()})
                runs.append((outs, step.nonfinite_steps, step.memory.nonfinite_steps))
            (seen, count, dropped), (never, count_never, _) = runs
            report[f"{comp}/{memory}"] = {
                "bad_step_all_nan": bool(torch.isnan(seen[2][where]).all()),
                "other_finite": bool(torch.isfinite(seen[2][other]).all()),
                "later_equal": all(torch.equal(seen[s][n], never[s][n]) for s in (3, 4) for n in shapes),
                "later_finite": all(bool(torch.isfinite(seen[s][n]).all()) for s in (3, 4) for n in shapes),
                "counts": [count, dropped, count_never],
            }
    gradsync.shutdown()
    return report


# ---- DDP hook: PowerSGD with several buckets ------------------------------------------------------------------


def _ddp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 96), torch.nn.ReLU(), torch.nn.Linear(96, 2800), torch.nn.ReLU(), torch.nn.Linear(2800, 5)
    )


def _ddp_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + 10 * step + worker)
    return torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)


def _local_grads(model: torch.nn.Module, worker: int, step: int) -> dict[str, torch.Tensor]:
    model.zero_grad()
    x, y = _ddp_batch(worker, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def scenario_ddp() -> dict:
    """DDP + compression_hook with PowerSGD (and Top-k, bucket-merged) on several buckets, 3 backward passes:
    each parameter's gradient equals simulate_step over every rank's local gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rt = gradsync.init(algorithm="ring", timeout_s=60)
    report = {}
    for comp, params, merge in (("powersgd", {"rank": 2}, "layerwise"), ("topk", {"ratio": 0.1}, "bucket")):
        net = _ddp_model()
        plain = _ddp_model()  # the same initial weights, never updated: each rank's local gradients
        # 0.25 MB buckets over 1.1 MB of gradients; DDP's rebuilt first bucket is capped at 1 MB: several either way.
        model = DDP(net, bucket_cap_mb=0.25)
        state = CompressionHookState(create(comp, **params), runtime=rt, model=net, merge=merge)
        model.register_comm_hook(state, compression_hook)
        refs = [create(comp, **params) for _ in range(WORLD)]
        mems = [create_memory("residual") for _ in range(WORLD)]
        worst, buckets = 0.0, []
        for s in range(3):
            model.zero_grad()
            state.bucket_members.clear()
            before = state.buckets
            x, y = _ddp_batch(RANK, s)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            buckets.append(state.buckets - before)
            everyone = [_local_grads(plain, w, s) for w in range(WORLD)]
            if merge == "layerwise":
                for n, p in net.named_parameters():
                    info = TensorInfo(n, tuple(p.shape), p.dtype)
                    ref = simulate_step(refs, mems, [e[n] for e in everyone], info)
                    worst = max(worst, _rel(p.grad, ref))
            else:
                worst = max(worst, _bucket_reference(state, net, everyone, refs, mems))
        report[comp] = {"vs_simulate": worst, "buckets": buckets, "payload_ratio": state.payload_bytes / state.dense_bytes}
    gradsync.shutdown()
    return report


def _bucket_reference(state, net, everyone, refs, mems) -> float:
    """For merge='bucket' the hook compressed DDP's buckets whole; rebuild them from the names it recorded."""
    worst = 0.0
    params = dict(net.named_parameters())
    for key, members in state.bucket_members.items():
        flat = [torch.cat([e[n].reshape(-1) for n in members]) for e in everyone]
        info = TensorInfo(key, (flat[0].numel(),), torch.float32)
        ref = simulate_step(refs, mems, flat, info)
        got = torch.cat([params[n].grad.reshape(-1) for n in members])
        worst = max(worst, _rel(got, ref))
    return worst


# ---- training LeNet-5 on digits --------------------------------------------------------------------------------

#: (label, compressor, params, merge): the FP32 baseline, then every error-feedback compressor. SGD lr 0.1,
#: momentum 0.5 for all; DGC keeps its momentum (0.5) in its memory. Each run sends LeNet-5's 10 gradients as
#: one merged group (MergeComp's one-group partition): a step then costs one compression and one exchange instead
#: of ten (per-tensor work was most of a step: 67 ms of CPU for both ranks layer-wise, 40 ms merged, at this
#: batch), and error feedback faces the same test -- its memory carries what each step left out. The baseline
#: sends its group uncompressed (``none``): on two workers each element's sum is one addition, so it has the bits
#: of the optimizer's layer-wise exchange without a codec.
TRAIN_RUNS = [
    ("fp32", "none", {}, 1),
    ("topk", "topk", {"ratio": 0.1}, 1),
    ("randk", "randk", {"ratio": 0.5}, 1),
    ("dgc", "dgc", {"ratio": 0.1}, 1),
    ("efsignsgd", "efsignsgd", {}, 1),
    ("onebit", "onebit", {}, 1),
    ("powersgd", "powersgd", {"rank": 2}, 1),
]
#: SGD with momentum, the learning rate annealed to zero (cosine) over the run, so every run ends on a plateau
#: instead of wherever SGD's noise left it; 128 digits per step (64 per worker).
LR, MOMENTUM, BATCH = 0.1, 0.5, 128
#: Steps between the replicas' checks in :func:`scenario_train`.
CHECK_EVERY = 20


def scenario_train(steps: str = "200", seeds: str = "0") -> dict:
    """LeNet-5 on digits, 2 workers, ``steps`` steps from each of ``seeds`` (comma-separated): every method
    starts from the seed's weights and sees the seed's data order; replicas checked identical on every rank
    every :data:`CHECK_EVERY` steps and at the end (a check is a collective of every weight; replicas that part
    stay apart but for rounding, since both then add the same averaged update). Reports test accuracy and mean
    test cross-entropy per seed, in seed order."""
    from gradsync.models import create as create_model
    from gradsync.models.data import load_digits, shard

    n_steps = int(steps)
    rt = gradsync.init(algorithm="ring", timeout_s=120)
    data = load_digits(32)
    n_train = data.x_train.shape[0]
    batch = BATCH
    report: dict = {}
    for seed in (int(s) for s in seeds.split(",")):
        for label, comp, params, merge in TRAIN_RUNS:
            torch.manual_seed(seed)
            model = create_model("lenet5", num_classes=10)
            # DGC's memory carries the momentum (momentum correction), so its optimizer runs without.
            base = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0 if comp == "dgc" else MOMENTUM)
            kw = {} if comp is None else {"compression": create(comp, **params), "merge": merge}
            if comp == "dgc":
                kw["memory"] = create_memory("dgc", momentum=MOMENTUM)
            opt = gradsync.DistributedOptimizer(base, model.named_parameters(), runtime=rt, **kw)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(base, n_steps)
            order = torch.randperm(n_train, generator=torch.Generator().manual_seed(1000 + seed))
            identical = True
            for step in range(n_steps):
                start = (step * batch) % (n_train - batch)
                idx = order[start : start + batch]
                x, y = shard(data.x_train[idx], data.y_train[idx], RANK, WORLD)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
                if step % CHECK_EVERY == CHECK_EVERY - 1 or step == n_steps - 1:
                    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                    spread = flat.clone()
                    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
                    identical = identical and bool(torch.equal(spread, flat))
            with torch.no_grad():
                logits = model(data.x_test)
                acc = float((logits.argmax(1) == data.y_test).float().mean())
                loss = float(torch.nn.functional.cross_entropy(logits, data.y_test))
            part = getattr(opt, "partition", None)
            r = report.setdefault(label, {"accuracy": [], "loss": [], "replicas_identical": True, "groups": None,
                                          "tensors": None})
            r["accuracy"].append(acc)
            r["loss"].append(loss)
            r["replicas_identical"] = r["replicas_identical"] and identical
            r["groups"] = None if part is None else part.num_groups
            r["tensors"] = None if part is None else part.n
            opt.remove_hooks()
    gradsync.shutdown()
    return report


def scenario_auto() -> dict:
    """DistributedOptimizer(merge="auto") and merge=3 on a small MLP: after the timed first step every rank
    plans the same partition, and each step's update equals simulate_step over the same groups."""
    rt = gradsync.init(algorithm="ring", timeout_s=60)
    report = {}
    for merge in ("auto", 3):
        model = _ddp_model()
        plain = _ddp_model()
        opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                                            runtime=rt, compression="efsignsgd", merge=merge)
        refs = [create("efsignsgd") for _ in range(WORLD)]
        mems = [create_memory("residual") for _ in range(WORLD)]
        worst, cuts = 0.0, []
        for s in range(3):
            opt.zero_grad()
            x, y = _ddp_batch(RANK, s)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            groups = opt._groups  # the groups this step is sent in (auto re-plans after step 0)
            opt.step()
            if merge == "auto" and s == 0:
                # The calibration step is layer-wise and its state is dropped afterwards: re-create the reference.
                refs = [create("efsignsgd") for _ in range(WORLD)]
                mems = [create_memory("residual") for _ in range(WORLD)]
                continue
            everyone = [_local_grads(plain, w, s) for w in range(WORLD)]
            params = dict(model.named_parameters())
            for g in groups.groups:
                names = [groups.names[i] for i in g.members]
                flat = [torch.cat([e[n].reshape(-1) for n in names]).reshape(g.info.shape) for e in everyone]
                ref = simulate_step(refs, mems, flat, g.info).reshape(-1)
                got = torch.cat([params[n].grad.reshape(-1) for n in names])
                worst = max(worst, _rel(got, ref))
            cuts.append(list(opt.partition.cuts))
        report[str(merge)] = {"vs_simulate": worst, "cuts": cuts, "groups": opt.partition.num_groups,
                              "profiled": opt.cost_model is not None}
        opt.remove_hooks()
    gradsync.shutdown()
    return report


def scenario_lazy() -> dict:
    """The compressed hook on a process group the user made, with no gradsync.init(): the runtime starts on
    first use; replicas stay bit-identical across ranks and equal a run after an explicit gradsync.init()."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    before = gradsync.is_initialized()

    def train() -> torch.Tensor:
        net = _ddp_model()
        model = DDP(net, bucket_cap_mb=0.25)
        model.register_comm_hook(gradsync.CompressionHookState("fp16", model=net), gradsync.compression_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for s in range(3):
            opt.zero_grad()
            x, y = _ddp_batch(RANK, s)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    lazy = train()
    started = gradsync.is_initialized()
    gradsync.shutdown()
    gradsync.init()  # on the same process group
    explicit = train()
    everyone = [torch.empty_like(lazy) for _ in range(WORLD)]
    dist.all_gather(everyone, lazy)
    gradsync.shutdown()
    return {"before": before, "started": started, "same_as_init": bool(torch.equal(lazy, explicit)),
            "replicas_identical": all(torch.equal(e, lazy) for e in everyone),
            "moved": float((lazy - torch.cat([p.detach().reshape(-1) for p in _ddp_model().parameters()])).abs().max())}


def scenario_fp16hook() -> dict:
    """The fp16 hook's native path (the bucket cast at once, the process group's async allreduce) is taken
    where the runtime sums natively, and gives the bits of the general per-tensor path and of the closed
    form float(fp16(g_0) + fp16(g_1)) / 2, over several buckets and steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rt = gradsync.init(algorithm="native")
    counting, taken = counting_native(rt)
    rt.native_allreduce_async = counting  # type: ignore[method-assign]
    groups: list[object] = []  # the group of every allreduce the hook issues on this (the caller's) thread
    real_all_reduce = dist.all_reduce

    def recording(tensor: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if threading.current_thread() is threading.main_thread():
            groups.append(kwargs.get("group"))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording  # the runtime looks it up on the module at each call

    def grads(fast: bool) -> list[torch.Tensor]:
        net = _ddp_model()
        model = DDP(net, bucket_cap_mb=0.25)
        state = CompressionHookState("fp16", runtime=rt, model=net)
        if not fast:
            state.cast_dtype = None  # the general path: per-tensor compress, the communication thread
        model.register_comm_hook(state, compression_hook)
        out = []
        for s in range(3):  # no optimizer step: every step's reference uses the initial weights
            model.zero_grad()
            x, y = _ddp_batch(RANK, s)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            out.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        return out

    fast = grads(True)
    fast_calls = list(taken)
    dist.all_reduce = real_all_reduce
    general = grads(False)
    plain = _ddp_model()
    closed = []
    for s in range(3):
        local = [_local_grads(plain, w, s) for w in range(WORLD)]
        closed.append(torch.cat([(sum(e[n].half() for e in local) if WORLD == 2 else None).float().reshape(-1) / WORLD
                                 for n in local[0]]))
    gradsync.shutdown()
    return {"fast_calls": len(fast_calls), "fast_taken": all(fast_calls), "general_calls": len(taken) - len(fast_calls),
            "native_groups": len(groups), "on_user_group": all(g is dist.group.WORLD for g in groups),
            "dedicated_group_differs": rt.transport.group is not dist.group.WORLD,
            "same_as_general": all(torch.equal(a, b) for a, b in zip(fast, general)),
            "same_as_closed_form": all(torch.equal(a, b) for a, b in zip(fast, closed))}


SCENARIOS = {"nonfinite": scenario_nonfinite, "fp16hook": scenario_fp16hook, "lazy": scenario_lazy, "auto": scenario_auto, "allgather": scenario_allgather, "merged": scenario_merged, "ddp": scenario_ddp, "train": scenario_train}


def main() -> None:
    run_scenario(SCENARIOS, RANK)  # argv: NAME OUT_DIR ARGS...


if __name__ == "__main__":
    main()
