"""Worker program for tests/integrations: gradsync's hooks inside Lightning and Accelerate, through the recipes the
docs give (docs/trainers.md), launched once per rank with torchrun's environment.

``python tests/workers/trainer_worker.py lightning|accelerate OUT_DIR``: fits the same tiny model three times, with
the plain hook (planned allreduce), fp16 and PowerSGD, and writes ``OUT_DIR/rank{R}.json``: per hook, the buckets the
hook handled, the final parameters, the largest distance from a single-process reference (SGD on the mean of every
rank's loss, computed here from the same data split) and how far the parameters moved.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradsync
from tests.dist_launch import run_scenario

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
N, BATCH, STEPS, LR = 16, 4, 4, 0.1


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(N, 16, generator=g), torch.randn(N, 4, generator=g))


def _loader() -> DataLoader:
    """This rank's batches: the split :func:`_reference` replays."""
    ds = _data()
    return DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, num_replicas=WORLD, rank=RANK, shuffle=False))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _states(net: torch.nn.Module) -> dict[str, object]:
    """The three hook states, built before any process group exists (as a trainer's configuration is)."""
    return {
        "plain": gradsync.GradsyncHookState(),
        "fp16": gradsync.CompressionHookState("fp16", model=net),
        "powersgd": gradsync.CompressionHookState("powersgd", model=net),
    }


def _reference(init: dict[str, torch.Tensor]) -> torch.Tensor:
    """Single-process SGD on the mean of the ranks' batch losses: what an averaging hook gives DDP."""
    net = _net()
    net.load_state_dict(init)
    ds = _data()
    order = [list(DistributedSampler(ds, num_replicas=WORLD, rank=r, shuffle=False)) for r in range(WORLD)]
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    per_epoch = len(order[0]) // BATCH
    for step in range(STEPS):
        at = (step % per_epoch) * BATCH
        opt.zero_grad()
        loss = sum(F.mse_loss(net(ds[idx[at:at + BATCH]][0]), ds[idx[at:at + BATCH]][1]) for idx in order) / WORLD
        loss.backward()
        opt.step()
    return _flat(net)


def _flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _report(state: object, net: torch.nn.Module, init: torch.Tensor, ref: torch.Tensor) -> dict:
    flat = _flat(net)
    return {"buckets": state.buckets, "params": flat.tolist(), "moved": float((flat - init).abs().max()),  # type: ignore[attr-defined]
            "vs_reference": float((flat - ref).abs().max())}


def scenario_lightning() -> dict:
    import lightning as L

    from gradsync.integrations.lightning import GradsyncCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    out = {}
    for name in ("plain", "fp16", "powersgd"):
        module = Module()
        init = {k: v.clone() for k, v in module.net.state_dict().items()}
        state = _states(module.net)[name]
        trainer = L.Trainer(  # the recipe: the callback carries the state (Lightning drops ddp_comm_hook on the CPU)
            accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=STEPS, callbacks=[GradsyncCallback(state)],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False,  # the test's split, so the reference knows each rank's batches
        )
        trainer.fit(module, _loader())
        out[name] = _report(state, module.net, _flat(_net()), _reference(init))
    return out


def scenario_accelerate() -> dict:
    from accelerate import Accelerator

    from gradsync.integrations.ddp import register_comm_hook

    accelerator = Accelerator(cpu=True)
    out = {}
    for name in ("plain", "fp16", "powersgd"):
        net = _net()
        init = {k: v.clone() for k, v in net.state_dict().items()}
        state = _states(net)[name]
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        model, opt, data = accelerator.prepare(net, opt, DataLoader(_data(), batch_size=BATCH, shuffle=False))
        if name == "plain":  # the recipe: torch's own line on the prepared model ...
            model.register_comm_hook(state, gradsync.allreduce_hook)
        else:                # ... or gradsync's, which picks the state's hook
            assert register_comm_hook(model, state)
        step = 0
        while step < STEPS:
            for x, y in data:
                opt.zero_grad()
                accelerator.backward(F.mse_loss(model(x), y))
                opt.step()
                step += 1
                if step == STEPS:
                    break
        out[name] = _report(state, net, _flat(_net()), _reference(init))
    return out


SCENARIOS = {"lightning": scenario_lightning, "accelerate": scenario_accelerate}

if __name__ == "__main__":
    run_scenario(SCENARIOS, RANK)  # argv: NAME OUT_DIR
