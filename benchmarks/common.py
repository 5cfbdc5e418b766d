"""What several benchmarks share: where the checkout is, a worker process's ``PYTHONPATH``, starting workers on
loopback, and the seeded random regular graphs (``plan-scaling`` and ``plan-fabrics``). Light on purpose:
``--help`` stays fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from gradsync.topology import Topology

#: The source checkout: the directory that holds ``benchmarks/`` (and ``gradsync/``).
ROOT = Path(__file__).resolve().parents[1]
#: ForestColl's fabrics and other topology files (``a100x2.yaml``, ...).
TOPOLOGIES = ROOT / "benchmarks" / "topologies"

#: Link bandwidths of the random regular graphs (GB/s).
BANDWIDTHS_GBPS: tuple[float, ...] = (10.0, 20.0, 25.0, 50.0)
MAX_SEED_TRIES = 1000


#: What a measurement runs (pathspecs from the checkout's root): an uncommitted change elsewhere (docs, results
#: written by an earlier run, tests) does not make a result's code ``+dirty``.
CODE_PATHS = ("gradsync", "benchmarks", ":(exclude)benchmarks/results", "pyproject.toml")


def code_revision() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files of :data:`CODE_PATHS`;
    ``"unknown"`` outside git): what code a result was measured with."""
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--",
                                *CODE_PATHS], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def pythonpath(*first: str | Path) -> str:
    """``PYTHONPATH`` for a worker process: ``first``, then the checkout root (so ``benchmarks`` imports), then the
    caller's own ``PYTHONPATH``; empty entries dropped."""
    return os.pathsep.join(filter(None, [*map(str, first), str(ROOT), os.environ.get("PYTHONPATH")]))


def run_loopback_workers(cmd: Sequence[str], procs: int, *, timeout_s: float, what: str,
                         env: Mapping[str, str] | None = None) -> list[int] | None:
    """Run ``cmd`` once per rank, as ``torchrun`` would on one host (loopback, a free port), and wait for all of
    them up to ``timeout_s``; past it every worker is killed, ``what`` says so on stderr, and None is returned.
    Otherwise the exit codes. ``env`` adds to the caller's environment (``PYTHONPATH`` already names the checkout)."""
    from gradsync.launch import free_port, torchrun_env

    port = free_port()
    base = {**os.environ, "PYTHONPATH": pythonpath(), **(env or {})}
    workers = [subprocess.Popen(list(cmd), env=torchrun_env(r, procs, "127.0.0.1", port, base)) for r in range(procs)]
    try:
        return [w.wait(timeout=timeout_s) for w in workers]
    except subprocess.TimeoutExpired:
        print(f"gradsync: error: {what}: a worker ran past {timeout_s:g} s; killed", file=sys.stderr)
        return None
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


def loopback_report(cmd: Sequence[str], procs: int, report: Path, *, timeout_s: float, what: str,
                    env: Mapping[str, str] | None = None) -> Any | None:
    """:func:`run_loopback_workers`, then the JSON report rank 0 wrote to ``report``; None (said on stderr) when a
    worker timed out or failed, or the report is missing."""
    codes = run_loopback_workers(cmd, procs, timeout_s=timeout_s, what=what, env=env)
    if codes is None:
        return None
    if any(codes) or not report.exists():
        print(f"gradsync: error: {what}: worker exit codes {codes}", file=sys.stderr)
        return None
    return json.loads(report.read_text())


def replicas_identical(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are the same bits on every rank of the default process group: the elementwise
    minimum and maximum over ranks agree (two allreduces, no pickle). A collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def random_regular(n: int, degree: int, seed: int = 0) -> Topology:
    """A connected random ``degree``-regular graph on ``n`` GPUs with seeded random bandwidths.

    ``degree`` is clamped to ``n - 1`` and lowered by one when ``n * degree`` is odd.
    """
    import networkx as nx
    import numpy as np

    from gradsync.topology import Device, Link, Topology

    d = min(degree, n - 1)
    if (n * d) % 2:
        d -= 1
    if d < 1:
        raise ValueError(f"cannot build a connected regular graph on {n} nodes")
    for s in range(seed, seed + MAX_SEED_TRIES):
        graph = nx.random_regular_graph(d, n, seed=s)
        if nx.is_connected(graph):
            break
    else:
        raise RuntimeError(f"no connected {d}-regular graph on {n} nodes in {MAX_SEED_TRIES} seeds")
    rng = np.random.default_rng(s)
    edges = sorted(tuple(sorted(e)) for e in graph.edges())
    bws = rng.choice(BANDWIDTHS_GBPS, size=len(edges))
    devices = tuple(Device(f"g{i}", "gpu") for i in range(n))
    links = tuple(Link(f"g{a}", f"g{b}", float(bw)) for (a, b), bw in zip(edges, bws))
    return Topology(f"regular{d}:{n}", devices, links)
