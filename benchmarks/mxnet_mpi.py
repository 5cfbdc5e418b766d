"""``gradsync bench mxnet-mpi``: MXNET-MPI's Figs. 11–14 in miniature (time per epoch, accuracy vs time).

8 workers and 2 servers on this machine (``gradsync launch``), LeNet-5 on scikit-learn's digits; the
number of clients goes from pure PS (8) through collective clients (4, 2, 1) to no servers at all:

    dist-sgd, dist-asgd (8 clients) | mpi-sgd, mpi-asgd (4, 2, 1) | mpi-esgd (2) | allreduce (collective)

Each configuration is one launch; rank 0 reports per-epoch wall time and test accuracy. Writes
``mxnet_mpi.json`` and ``mxnet_mpi.png`` (time per epoch per configuration; accuracy vs time) to ``--out``.
On loopback the links are not the bottleneck the seed's cluster had, so the contention effect (fewer
clients -> less time per epoch) shows mostly as fewer, larger messages. ``--testbed`` runs every
configuration on the emulated cluster instead (``gradsync launch --testbed``): ``switch:10`` at ``--rate``,
workers on hosts 0-7, the 2 servers on hosts 8-9, each behind one NIC. That makes the servers' links the
bottleneck exactly as in the seed: a synchronous round moves ``C * M / S`` bytes through each server NIC
per direction (``C`` clients, model ``M``, ``S`` servers) while a worker's NIC carries at most ``2M`` (its
client's ring allreduce), so fewer clients relieve the servers. Beside every measured epoch goes the cost
model's prediction of its communication (:func:`ps_round`: one round as a schedule, priced like the
runtime's plans). ``--quick`` runs fewer configurations and epochs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT

WORKER = ROOT / "benchmarks" / "mxnet_mpi_worker.py"

CONFIGS: list[tuple[str, int]] = [
    ("dist-sgd", 8), ("mpi-sgd", 4), ("mpi-sgd", 2), ("mpi-sgd", 1),
    ("dist-asgd", 8), ("mpi-asgd", 4), ("mpi-asgd", 2), ("mpi-asgd", 1),
    ("mpi-esgd", 2), ("allreduce", 0),
]
QUICK: list[tuple[str, int]] = [("dist-sgd", 8), ("mpi-sgd", 2), ("mpi-asgd", 2), ("mpi-esgd", 2), ("allreduce", 0)]


#: Rounds between elastic exchanges in mpi-ESGD (the worker's ``--interval`` default).
ESGD_INTERVAL = 4


def ps_round(topology: Any, workers: int, servers: int, clients: int) -> list[Any]:
    """One synchronous round of MXNET-MPI's hybrid parameter server as the schedules of its phases, on
    ``workers + servers`` hosts (workers first), for pricing with the runtime's cost model.

    Clients are ``clients`` groups of consecutive workers (0: one group, no servers: pure allreduce). The
    KVStore runs the phases one after another (each a blocking call), so each is its own schedule and the
    round costs their sum: the client's ring allreduce (gloo's ``all_reduce``: reduce-scatter, then
    allgather, of one piece per member); the push of one slice per server (keys >= 1 MiB are sliced,
    :mod:`gradsync.ps.client`) from each client's rank 0, and the pull the server answers once every
    client pushed (the schedule's dependencies); and the broadcast of what rank 0 pulled to its members
    down a binomial tree, ``ceil(log2 n)`` rounds in which every member that has the value sends it on once
    (gloo's broadcast sends to one child at a time).
    """
    from gradsync.plan.routing import router_for
    from gradsync.plan.schedule import Chunk, Schedule, Transfer

    n = workers // clients if clients else workers
    groups = [list(range(b, b + n)) for b in range(0, workers, n)]
    route, names = router_for(topology), topology.ranks

    def phase(name: str, chunks: list[Chunk], moves: list[tuple[int, int, int, bool, int]]) -> Schedule:
        transfers = tuple(Transfer(c, a, b, route(names[a], names[b]), red, step) for c, a, b, red, step in moves)
        return Schedule(name, topology.name, topology.ranks, tuple(chunks), transfers)

    pieces = [Chunk(p / n, 1 / n, p) for p in range(n)]
    ring = [(p, g[(p + k) % n], g[(p + k + 1) % n], True, k) for g in groups for p in range(n) for k in range(n - 1)]
    ring += [(p, g[(p + k - 1) % n], g[(p + k) % n], False, n - 1 + k) for g in groups for p in range(n)
             for k in range(n - 1)]
    out = [phase("client-allreduce", pieces, ring)] if n > 1 else []
    if not servers:
        return out
    slices = [Chunk(s / servers, 1 / servers, workers + s) for s in range(servers)]
    out.append(phase("push-pull", slices, [(s, g[0], workers + s, True, 0) for g in groups for s in range(servers)]
                     + [(s, workers + s, g[0], False, 1) for g in groups for s in range(servers)]))
    for k in range((n - 1).bit_length()):  # a sender sends its children one after another: a phase per round
        out.append(phase(f"client-broadcast-{k}", [Chunk(0.0, 1.0, 0)],
                         [(0, g[i], g[i + (1 << k)], False, 0) for g in groups for i in range(min(1 << k, n - (1 << k)))]))
    return out


def predicted_comm_s(alg: str, clients: int, workers: int, servers: int, model_bytes: int, steps: int,
                     topology: Any, cost: Any) -> float:
    """The cost model's communication time for one epoch of ``steps`` rounds (ESGD exchanges every
    :data:`ESGD_INTERVAL` rounds; asynchronous rounds move the same bytes as synchronous ones)."""
    phases = ps_round(topology, workers, 0 if clients == 0 else servers, clients)
    rounds = steps / ESGD_INTERVAL if alg.endswith("esgd") else steps
    return rounds * sum(cost.predict(p, topology, model_bytes) for p in phases)


def _label(alg: str, clients: int) -> str:
    return f"{alg} (collective)" if clients == 0 else f"{alg} C={clients}"


def run_config(alg: str, clients: int, workers: int, servers: int, epochs: int, lr: float, batch: int = 8,
               testbed: bool = False, model: str = "lenet5") -> dict[str, Any]:
    from gradsync.ps.launch import PSJob, launch

    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        out = Path(tmp) / "rank0.json"
        cmd = [sys.executable, str(WORKER), alg, "--epochs", str(epochs), "--lr", str(lr), "--batch", str(batch),
               "--model", model, "--out", str(out)]
        job = PSJob(workers=workers, servers=0 if clients == 0 else servers, clients=clients, timeout_s=1800,
                    testbed=testbed)
        log = io.StringIO()
        t0 = time.perf_counter()
        rc = launch(cmd, job, env={"PYTHONPATH": str(ROOT)}, stream=log)
        wall = time.perf_counter() - t0
        if rc != 0 or not out.exists():
            raise RuntimeError(f"{_label(alg, clients)} failed (exit {rc}):\n{log.getvalue()[-3000:]}")
        result = json.loads(out.read_text())
    result.update(clients=clients, label=_label(alg, clients), job_seconds=wall)
    secs = sorted(e["seconds"] for e in result["epochs"])
    result["median_epoch_seconds"] = secs[len(secs) // 2]
    result["final_accuracy"] = result["epochs"][-1]["accuracy"]
    return result


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [r["label"] for r in results]
    a.barh(labels, [r["median_epoch_seconds"] for r in results], color="tab:blue", label="measured")
    if all(r.get("predicted_comm_s") is not None for r in results):
        a.scatter([r["predicted_comm_s"] for r in results], labels, color="tab:red", marker="|", s=300, zorder=3,
                  label="cost model: communication")
        a.legend(fontsize=7)
    a.invert_yaxis()
    a.set_xlabel("median time per epoch (s)")
    a.set_title("time per epoch (MXNET-MPI Fig. 12)")
    for r in results:
        b.plot([0] + [e["elapsed"] for e in r["epochs"]], [0.1] + [e["accuracy"] for e in r["epochs"]], marker="o",
               label=r["label"])
    b.set_xlabel("wall time (s)")
    b.set_ylabel("test accuracy")
    b.set_title("accuracy vs time (MXNET-MPI Figs. 11, 13)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gradsync bench mxnet-mpi", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="default: benchmarks/results/mxnet_mpi (_testbed with --testbed)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=8, help="per-worker batch")
    p.add_argument("--quick", action="store_true", help="5 configurations, 2 epochs")
    p.add_argument("--testbed", action="store_true",
                   help="run on the emulated cluster (switch:W+S, servers' links the bottleneck); needs root")
    p.add_argument("--rate", default="400mbit", help="with --testbed: every NIC's rate (tc syntax)")
    p.add_argument("--model", choices=["lenet5", "paper-lenet5"], default=None,
                   help="default: lenet5 (61,706 parameters) on loopback, paper-lenet5 (BML's 3,274,634, "
                        "13 MB of gradients a round) on the testbed, so that communication dominates a step")
    a = p.parse_args(argv)
    configs = QUICK if a.quick else CONFIGS
    epochs = 2 if a.quick else a.epochs
    out = Path(a.out or ROOT / "benchmarks" / "results" / ("mxnet_mpi_testbed" if a.testbed else "mxnet_mpi"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    topo = cost = None
    model = a.model or ("paper-lenet5" if a.testbed else "lenet5")
    if a.testbed:
        from benchmarks.bml_testbed_worker import PaperLeNet5
        from gradsync import testbed
        from gradsync.models import create
        from gradsync.testbed.control import load_state
        from gradsync.testbed.probe import cost_model
        from gradsync.topology import get_topology

        spec = f"switch:{a.workers + a.servers}"
        net = PaperLeNet5(10) if model == "paper-lenet5" else create("lenet5", num_classes=10)
        model_bytes = 4 * sum(p.numel() for p in net.parameters())
        print(f"testbed up: {spec} at {a.rate} ...", flush=True)
        testbed.up(spec, a.rate)  # last before the try whose finally takes it down
    try:
        if a.testbed:
            rows = testbed.probe([(0, a.workers), (1, 2)], seconds=1.0)
            topo, cost = get_topology(spec), cost_model(load_state(), [r for r in rows if r["ok"]])
        for i, (alg, clients) in enumerate(configs):
            c = a.workers if clients == 8 else clients
            print(f"[{i + 1}/{len(configs)}] {_label(alg, c)}: {a.workers} workers, {epochs} epochs ...", flush=True)
            r = run_config(alg, c, a.workers, a.servers, epochs, a.lr, a.batch, a.testbed, model)
            r["predicted_comm_s"] = None if cost is None else predicted_comm_s(
                alg, c, a.workers, a.servers, model_bytes, r["steps_per_epoch"], topo, cost)
            pred = "" if cost is None else f" (cost model: communication {r['predicted_comm_s']:.2f} s)"
            print(f"    median epoch {r['median_epoch_seconds']:.2f} s{pred}, accuracy {r['final_accuracy']:.3f}, "
                  f"{r['exchanges']} exchanges", flush=True)
            results.append(r)
    finally:
        if a.testbed:
            testbed.down()
    doc = {"benchmark": "mxnet-mpi", "workers": a.workers, "servers": a.servers, "epochs": epochs, "lr": a.lr,
           "batch": a.batch, "model": model, "data": "sklearn digits 32x32", "host": platform.node(),
           "cpus": os.cpu_count(), "testbed": {"topology": spec, "rate": a.rate, "cost_model": cost.to_dict()}
           if cost is not None else None, "results": results}
    (out / "mxnet_mpi.json").write_text(json.dumps(doc, indent=1))
    plot(results, out / "mxnet_mpi.png")
    print(f"wrote {out / 'mxnet_mpi.json'} and {out / 'mxnet_mpi.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
