"""One worker of ``gradsync bench tictac --processes`` (started per rank by benchmarks/tictac.py).

It reads the plan (``plan.json``, written by the parent): the VGG-16 parameter list (names, element counts
already divided by ``scale``), the synthetic forward time of each layer, the TAC priority list, the order
mode (``tac`` or ``random``), the iteration count and the seed. Per iteration:

1. start an ordered multi-key pull of every parameter (``KVStore.pull_async``): with ``tac`` the priority
   list computed once by ``gradsync.order.priorities``; with ``random`` a fresh random permutation drawn from
   ``random.Random(seed, rank, iteration)`` (TensorFlow's arrival order is effectively random, TicTac §6);
2. run the forward pass layer by layer: wait for that layer's weight and bias (``handle.wait(key)``), then
   compute for the layer's time (``time.sleep``: a synthetic compute that leaves the 2 shared CPU cores to
   the network stack; real VGG-16 convolutions at 224x224 would take seconds per image here);
3. training mode only: backward (2x the forward time, in reverse), then push every gradient (zeros) to the
   synchronous server, so the next pull waits for all 4 workers' pushes (a synchronous round).

Inference mode puts a barrier between iterations so all workers pull at once. The step time (pull start to
end of forward, or to the push's ACKs in training) of each iteration is written to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from gradsync import kvstore


def main(plan_path: str, out_dir: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    rank = int(os.environ["RANK"])
    training = plan["mode"] == "training"
    kv = kvstore.create("dist_sync" if training else "dist_async", ordered=True, timeout_s=120.0)
    params = plan["params"]  # [[name, numel], ...] in forward order
    names = [n for n, _ in params]
    bufs = [torch.zeros(n) for _, n in params]
    kv.init(names, bufs)
    layers = plan["layers"]  # [[[weight, bias], seconds], ...] forward order
    tac = plan["priorities"]
    steps: list[float] = []
    waits: list[float] = []
    grads = [torch.zeros(n) for _, n in params] if training else []
    for it in range(plan["warmup"] + plan["iterations"]):
        if not training:
            kv.barrier()
        if plan["order"] == "tac":
            prio = [tac[n] for n in names]
        else:
            rng = random.Random(f"{plan['seed']}/{rank}/{it}")
            perm = list(range(len(names)))
            rng.shuffle(perm)
            prio = perm
        t0 = time.perf_counter()
        handle = kv.pull_async(names, bufs, prio)
        blocked = 0.0
        for keys, seconds in layers:
            w0 = time.perf_counter()
            for k in keys:
                handle.wait(k)
            blocked += time.perf_counter() - w0
            time.sleep(seconds)
        handle.wait_all()
        if training:
            for _, seconds in reversed(layers):
                time.sleep(plan["backward_factor"] * seconds)
            kv.push(names, grads)
        if it >= plan["warmup"]:
            steps.append(time.perf_counter() - t0)
            waits.append(blocked)
    kv.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "step_s": steps, "blocked_s": waits}))
    print(f"OK rank {rank}: {len(steps)} steps, mean {sum(steps) / len(steps) * 1e3:.0f} ms", flush=True)
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
