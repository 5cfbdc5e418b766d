"""Worker program for tests/train/test_dist.py, launched once per rank with torchrun's environment.

``python tests/workers/train_worker.py SCENARIO OUT_DIR``: runs the scenario, writes ``OUT_DIR/rank{R}.json`` with
what it observed (the test process asserts on it), exits 0. Expectations are single-process references computed
here (every rank can regenerate every rank's micro-batches) or rank 0's values gathered from it.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import gradsync
from tests.dist_launch import run_scenario

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
MICRO = 2  # micro-batches per rank per step
PER = 3  # samples per micro-batch


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()


def _micro(step: int, rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``k`` of ``rank`` at ``step``: any rank can make any rank's."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    return torch.randn(PER, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (PER,), generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def scenario_accumulate() -> dict:
    """2 micro-batches per rank per step (losses scaled by 1/2) == single-process training on every rank's micro-batches
    concatenated, for the plain path (two bucket sizes), no_sync(), and the compressed path with merged groups; a last
    step with one pass of two still sends (at step()). Reports the worst difference to the reference and across ranks."""
    rt = gradsync.init(algorithm="ring", timeout_s=60)
    variants = {
        "plain": {"backward_passes_per_step": MICRO},
        "plain_buckets": {"backward_passes_per_step": MICRO, "bucket_bytes": 200},
        "no_sync": {},
        "compressed_merged": {"backward_passes_per_step": MICRO, "compression": "none", "merge": 2},
        "fp16_layerwise": {"backward_passes_per_step": MICRO, "compression": "fp16"},
    }
    result = {}
    for name, kwargs in variants.items():
        model, ref = _model(), _model()
        opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                            model.named_parameters(), runtime=rt, **kwargs)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            passes = MICRO if step < 3 else 1  # the last step: fewer passes than backward_passes_per_step
            opt.zero_grad()
            for k in range(passes):
                x, y = _micro(step, RANK, k)
                if name == "no_sync" and k < passes - 1:
                    with opt.no_sync():
                        (_loss(model, x, y) / MICRO).backward()
                else:
                    (_loss(model, x, y) / MICRO).backward()
            opt.step()
            ref_opt.zero_grad()
            batches = [_micro(step, r, k) for r in range(WORLD) for k in range(passes)]
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            # the mean over all WORLD * passes micro-batches, scaled as the ranks' losses are (passes / MICRO)
            (_loss(ref, x, y) * passes / MICRO).backward()
            ref_opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        everyone = [torch.zeros_like(flat) for _ in range(WORLD)]
        dist.all_gather(everyone, flat)
        result[name] = {
            "vs_reference": float((flat - ref_flat).abs().max()),
            "moved": float((ref_flat - torch.cat([p.detach().reshape(-1) for p in _model().parameters()])).abs().max()),
            "across_ranks": float(max((e - flat).abs().max() for e in everyone)),
        }
        opt.remove_hooks()
    gradsync.shutdown()
    return result


def scenario_too_many_passes() -> dict:
    """A third backward pass with backward_passes_per_step=2 raises naming the count and the fix, on every rank."""
    rt = gradsync.init(algorithm="ring", timeout_s=60)
    out = {}
    for name, kwargs in (("plain", {}), ("compressed", {"compression": "none", "merge": 2})):
        model = _model()
        opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                            runtime=rt, backward_passes_per_step=2, **kwargs)
        error, at = None, 0
        for k in range(3):
            try:
                _loss(model, *_micro(0, RANK, k)).backward()
            except gradsync.GradsyncError as exc:
                error, at = str(exc), k + 1
                break
        opt.zero_grad()  # drops the step: what was sent is waited for on every rank
        # and the optimizer goes on: one correct step afterwards
        for k in range(2):
            _loss(model, *_micro(1, RANK, k)).backward()
        opt.step()
        out[name] = {"error": error, "passes_at_error": at}
        opt.remove_hooks()
    gradsync.shutdown()
    return out


def scenario_broadcast() -> dict:
    """Ranks start from different seeds and take different local steps with Adam; after broadcast_parameters (a
    state_dict and named_parameters) and broadcast_optimizer_state, everything equals rank 0's. Rank 1 also starts
    with a fresh optimizer (no state): it gets rank 0's state created."""
    gradsync.init(algorithm="ring", timeout_s=60)
    model = _model(seed=RANK + 5)
    model.register_buffer("count", torch.tensor([RANK * 7 + 1], dtype=torch.int64))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (RANK + 1), betas=(0.9, 0.99 - 0.01 * RANK))
    if RANK == 0:
        for step in range(2):
            opt.zero_grad()
            _loss(model, *_micro(step, RANK, 0)).backward()
            opt.step()
    gradsync.broadcast_parameters(model.state_dict(), root_rank=0)
    gradsync.broadcast_optimizer_state(opt, root_rank=0)
    # a second time with named_parameters and a list: nothing changes
    gradsync.broadcast_parameters(model.named_parameters(), root_rank=0)
    gradsync.broadcast_parameters(list(model.parameters()), root_rank=0)
    values = [v.double().reshape(-1) for v in model.state_dict().values()]
    state = [v.double().reshape(-1) for p in model.parameters() for v in opt.state[p].values() if torch.is_tensor(v)]
    flat = torch.cat(values + state)
    mine = torch.tensor([float(len(state))], dtype=torch.float64)
    everyone = [torch.zeros_like(flat) for _ in range(WORLD)]
    dist.all_gather(everyone, flat)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    # one more step from the shared start gives the same weights everywhere
    opt.zero_grad()
    _loss(model, *_micro(9, 0, 0)).backward()
    opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    after_all = [torch.zeros_like(after) for _ in range(WORLD)]
    dist.all_gather(after_all, after)
    error = None
    try:
        gradsync.broadcast_parameters([torch.zeros(3 + RANK)], root_rank=0)
    except gradsync.GradsyncError as exc:
        error = str(exc)
    gradsync.shutdown()
    return {
        "vs_root": float((everyone[0] - flat).abs().max()),
        "state_tensors": int(mine),
        "hyper": json.loads(json.dumps(hyper)),
        "after_step_vs_root": float((after_all[0] - after).abs().max()),
        "mismatch_error": error,
    }


def scenario_auto() -> dict:
    """compression="auto" through the optimizer and the DDP hook on a slow (fake) wire: each replica's parameters,
    hashed, the codecs chosen and those run (the same on every rank), and how far training moved them."""
    import hashlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradsync.compress.auto import AlphaBeta
    from gradsync.train import AutoCompression

    rt = gradsync.init()
    wire = AlphaBeta(1e-4, 1e6)  # 1 MB/s: compressing pays on the model's side
    out = {}
    for path in ("optimizer", "hook"):
        model = _model()
        auto = AutoCompression("any", runtime=rt, wire=wire, codec_cost=lambda codec, numel: 0.0, probe_steps=1)
        if path == "optimizer":
            # two groups: one group's decision must not wait on the other's exchange in flight
            opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                                runtime=rt, compression=auto, merge=2)
            net = model
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            net = DDP(model)
            net.register_comm_hook(gradsync.CompressionHookState(auto, runtime=rt, model=model), gradsync.compression_hook)
        tried = set()
        for step in range(6):  # the timed first step (merge="auto"), a codec, a rival, "none", the review, one more
            _loss(net, *_micro(step, RANK, 0)).backward()
            opt.step()
            opt.zero_grad()
            tried.add(auto.current)  # the codec the step's last group ran: "none" while probing, then the trial's
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        start = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
        out[path] = {"hash": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "settled": auto.settled,
                     "codecs": {k: c.codec for k, c in auto.choices.items()}, "report": auto.report(),
                     "tried": sorted(tried), "moved": float((flat - start).abs().max()),
                     "native": auto.native_launches, "record_timeouts": auto.record_timeouts}
    gradsync.shutdown()
    return out


def scenario_auto_handed() -> dict:
    """compression="auto" through the optimizer with a merged group settled on a codec that encodes each member as it
    is (allow="any" on a slow fake wire, "none" slow on the local tests' fake clock): its gradients are handed to the codec and get
    their aggregates in place (AutoCompression.needs_flat). Each rank's parameters hashed, the codecs, the launches
    handed over."""
    import hashlib

    from gradsync.compress.auto import AlphaBeta
    from gradsync.train import AutoCompression
    from tests.train.fake_clock import FakeClock

    rt = gradsync.init()
    model = _model()
    clock = FakeClock({"none": 1e-2, "other": 1e-5})
    auto = AutoCompression("any", runtime=rt, wire=AlphaBeta(1e-4, 1e6), codec_cost=lambda codec, numel: 0.0,
                           probe_steps=1, clock=clock, cache=False)
    clock.auto = auto
    handed: list[str] = []
    real = auto.step_async

    def spy(tensors, infos, **kw):
        if kw.get("flat") is None and len(infos) > 1:
            handed.append(kw.get("key") or infos[0].name)
        return real(tensors, infos, **kw)

    auto.step_async = spy  # type: ignore[method-assign]
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                        runtime=rt, compression=auto, merge=2)
    for step in range(12):
        _loss(model, *_micro(step, RANK, 0)).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = {"hash": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "settled": auto.settled,
           "codecs": {k: c.codec for k, c in auto.choices.items()},
           "merged": [k for k, g in auto._groups.items() if len(g.names) > 1], "handed": handed,
           "report": auto.report()}
    gradsync.shutdown()
    return out


_HOOK_SHAPES = {"w1": (32, 16), "b1": (32,), "w2": (16, 32), "b2": (16,), "w3": (4, 16), "b3": (4,)}
#: (compressor, merge, the bad value, the parameter that gets it): NaN and inf, in a weight's bucket or a bias's
HOOK_CASES = (("topk", "layerwise", "nan", "w2"), ("powersgd", "layerwise", "inf", "b1"),
              ("signum", "layerwise", "nan", "b1"), ("qsgd", "layerwise", "inf", "w2"), ("dgc", "layerwise", "nan", "w2"),
              ("fp16", "layerwise", "inf", "w2"), ("randk", "bucket", "nan", "w2"))


class _LinearLoss(torch.nn.Module):
    """The loss is linear in the parameters: each gradient is a tensor the rank chose, NaN where it put one."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in _HOOK_SHAPES.items():
            setattr(self, name, torch.nn.Parameter(torch.zeros(shape)))

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, n) * coeffs[n]).sum() for n in _HOOK_SHAPES)  # type: ignore[return-value]


def scenario_nonfinite_hook() -> dict:
    """The compressed DDP hook over several buckets, per case: at iteration 2 one element of one parameter's gradient
    on rank 0 is NaN or inf. Against a run that skipped iteration 2: iterations 3 and 4 give every gradient bit for
    bit, so no bucket's error feedback or compressor state took iteration 2 (issue 42), and it counts once."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.compress.seeded import seeded, step_tensors

    rt = gradsync.init(algorithm="ring", timeout_s=60)
    out = {}
    for comp, merge, bad, where in HOOK_CASES:
        runs = []
        for skip in (False, True):
            module = _LinearLoss()
            net = DDP(module, bucket_cap_mb=0.002)  # ~2 KB: a bucket per weight once DDP rebuilds them after step 0
            memory = "dgc" if comp == "dgc" else "residual"
            state = gradsync.CompressionHookState(seeded(comp), memory=memory, runtime=rt, model=module, merge=merge)
            net.register_comm_hook(state, gradsync.compression_hook)
            grads, buckets = [], 0
            for s in range(5):
                if skip and s == 2:
                    grads.append({})
                    continue
                coeffs = step_tensors(_HOOK_SHAPES, s, RANK, bad=(2, where, 1, float(bad)))
                module.zero_grad()
                before = state.buckets
                net(coeffs).backward()
                buckets = max(buckets, state.buckets - before)
                grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
            runs.append((grads, state.nonfinite_steps, state.step.memory.nonfinite_steps, buckets))
        (seen, count, dropped, buckets), (never, count_never, _, _) = runs
        out[f"{comp}/{merge}/{bad}"] = {
            "buckets": buckets,
            "bad_nonfinite": not bool(torch.isfinite(seen[2][where]).all()),
            "later_equal": all(torch.equal(seen[s][n], never[s][n]) for s in (3, 4) for n in _HOOK_SHAPES),
            "later_finite": all(bool(torch.isfinite(seen[s][n]).all()) for s in (3, 4) for n in _HOOK_SHAPES),
            "counts": [count, dropped, count_never],
        }
    gradsync.shutdown()
    return out


def scenario_auto_native_nonfinite() -> dict:
    """compression="auto" on an infinitely fast wire through the DDP hook: every bucket runs "none" by DDP's own
    allreduce of the bucket. At iterations 2 (still choosing) and 6 (settled: every bucket launched by
    ``settled_launch``) one gradient element on rank 0 is NaN (or inf): every rank's gradient there is non-finite,
    iteration 2 counts once on every rank (iteration 6 has no codec state to guard and is not counted, as on the
    fixed fp16 hook's native path), and the other iterations are those of a run that skipped both."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradsync.compress.auto import AlphaBeta
    from gradsync.train import AutoCompression
    from tests.compress.seeded import step_tensors

    rt = gradsync.init(timeout_s=60)  # on loopback the runtime runs these sizes natively
    out = {}
    for bad in ("nan", "inf"):
        runs = []
        for skip in (False, True):
            module = _LinearLoss()
            net = DDP(module, bucket_cap_mb=0.002)
            auto = AutoCompression("cast", runtime=rt, wire=AlphaBeta(0.0, 1e18), codec_cost=lambda c, n: 0.0 if c == "none" else 1.0,
                                   probe_steps=1, cache=False)  # any codec costs more than the wire saves
            state = gradsync.CompressionHookState(auto, runtime=rt, model=module)
            net.register_comm_hook(state, gradsync.compression_hook)
            grads, settled = [], []
            for s in range(8):
                if skip and s in (2, 6):
                    grads.append({})
                    continue
                coeffs = step_tensors(_HOOK_SHAPES, s, RANK, bad=(2, "w2", 1, float(bad)))
                if s == 6:
                    coeffs = {**coeffs, **step_tensors(_HOOK_SHAPES, 2, RANK, bad=(2, "w2", 1, float(bad)))}
                module.zero_grad()
                before = auto.settled_launches
                net(coeffs).backward()
                settled.append(auto.settled_launches - before)
                grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
            state.close_step()
            runs.append((grads, state.nonfinite_steps, (auto.native_launches, state.buckets), auto.report(), settled))
        (seen, count, native, report, settled), (never, count_never, _, _, _) = runs
        kept = (0, 1, 3, 4, 5, 7)
        out[bad] = {
            "bad_nonfinite": [not bool(torch.isfinite(seen[s]["w2"]).all()) for s in (2, 6)],
            "later_equal": all(torch.equal(seen[s][n], never[s][n]) for s in kept for n in _HOOK_SHAPES),
            "counts": [count, count_never],
            "native": native,
            "settled": settled,
            "diff": [n for s in kept for n in _HOOK_SHAPES if not torch.equal(seen[s][n], never[s][n])],
            "report": report,
        }
    gradsync.shutdown()
    return out


SCENARIOS = {"auto": scenario_auto, "auto_handed": scenario_auto_handed, "auto_native_nonfinite": scenario_auto_native_nonfinite, "accumulate": scenario_accumulate, "too_many_passes": scenario_too_many_passes, "broadcast": scenario_broadcast,
             "nonfinite_hook": scenario_nonfinite_hook}


def main() -> None:
    run_scenario(SCENARIOS, RANK)  # argv: NAME OUT_DIR ARGS...


if __name__ == "__main__":
    main()
