"""One worker of ``gradsync bench mxnet-mpi``: LeNet-5 on the digits with one PS algorithm (MXNET-MPI §5).

Each worker trains on its shard of the training set for ``--epochs`` epochs; rank 0 measures every
epoch's wall time and the test accuracy after it, and writes them as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from gradsync.models import create
from gradsync.models.data import load_digits, shard
from gradsync.train.ps_trainer import ALGORITHMS, PSTrainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("algorithm", choices=ALGORITHMS.names())
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="per-worker batch")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--model", choices=["lenet5", "paper-lenet5"], default="lenet5",
                   help="lenet5: 61,706 parameters; paper-lenet5: BML's 3,274,634 (link-limited on the testbed)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = load_digits(size=28 if a.model == "paper-lenet5" else 32)
    x, y = shard(data.x_train, data.y_train, rank, world)
    torch.manual_seed(0)
    if a.model == "paper-lenet5":
        from benchmarks.bml_testbed_worker import PaperLeNet5

        model: torch.nn.Module = PaperLeNet5(num_classes=10)
    else:
        model = create("lenet5", num_classes=10)
    trainer = PSTrainer(a.algorithm, model.named_parameters(), lr=a.lr, interval=a.interval, alpha=a.alpha,
                        timeout_s=300)
    steps = x.shape[0] // a.batch
    gen = torch.Generator().manual_seed(rank)
    epochs = []
    t_start = time.perf_counter()
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        order = torch.randperm(x.shape[0], generator=gen)
        for s in range(steps):
            idx = order[s * a.batch:(s + 1) * a.batch]
            trainer.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            trainer.step()
        t1 = time.perf_counter()
        with torch.no_grad():
            acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        epochs.append({"epoch": epoch + 1, "seconds": t1 - t0, "elapsed": t1 - t_start, "accuracy": acc})
    if trainer.spec.kind != "collective":
        trainer.kv.barrier()
    trainer.close()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"algorithm": a.algorithm, "workers": world, "steps_per_epoch": steps,
                       "exchanges": trainer.exchanges, "epochs": epochs}, f)


if __name__ == "__main__":
    main()
