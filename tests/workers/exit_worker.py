"""A worker that uses gradsync as the README shows and then simply ends (issue 21).

``python exit_worker.py USAGE ENDING``: USAGE is ``allreduce`` (``gradsync.init`` + ``allreduce``),
``train`` (the DDP hook and ``DistributedOptimizer`` on one model), ``kvstore`` (the collective
KVStore) or ``hybrid_sync`` (a parameter server with collective clients, under ``gradsync launch``); ENDING is how the script stops: ``none`` (it just returns, as the README's examples do),
``shutdown`` (``gradsync.shutdown()`` then ``destroy_process_group()``) or ``destroy`` (the other order).
It prints ``ok <sum>``; the test asserts that every rank printed it and exited 0.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import gradsync


def allreduce() -> float:
    rt = gradsync.init(algorithm="ring", timeout_s=60)
    x = torch.full((7,), float(rt.rank + 1))
    gradsync.allreduce(x)
    return float(x[0])


def train() -> float:
    rt = gradsync.init(timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp.register_comm_hook(gradsync.GradsyncHookState(rt), gradsync.allreduce_hook)
    opt = gradsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x = torch.full((3, 4), float(rt.rank + 1))
    ddp(x).sum().backward()
    model(x).sum().backward()
    opt.step()
    return float(ddp.module.bias.grad[0])  # the mean over ranks of 3 (rows) per rank


def kvstore(kind: str = "collective") -> float:
    from gradsync import kvstore as kvs

    kv = kvs.create(kind)
    v = torch.zeros(5)
    kv.init("w", v)
    kv.pushpull("w", torch.full((5,), float(kv.rank + 1)), v)
    return float(v[0])


USAGES = {"allreduce": allreduce, "train": train, "kvstore": kvstore,
          "hybrid_sync": lambda: kvstore("hybrid_sync")}  # the last under `gradsync launch --servers 1`

if __name__ == "__main__":
    usage, ending = sys.argv[1], sys.argv[2]
    print("ok", USAGES[usage](), flush=True)
    if ending == "shutdown":
        gradsync.shutdown()
        dist.destroy_process_group()
    elif ending == "destroy":
        dist.destroy_process_group()
        gradsync.shutdown()
