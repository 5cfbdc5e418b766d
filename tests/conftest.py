"""Shared helpers for the tests: random connected graphs as topologies, one intra-op thread."""

from __future__ import annotations

import atexit
import itertools
import os
import random
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from gradsync.topology import Device, Link, Topology

# Calibrations and tuned choices (``gradsync.init`` caches them in $GRADSYNC_CACHE, ~/.cache/gradsync by default)
# go to a directory of this session's own, inherited by every worker it starts: a test never reads what an earlier
# run, or the user's own jobs, left there. Tests of the cache itself set their own.
os.environ["GRADSYNC_CACHE"] = _CACHE = tempfile.mkdtemp(prefix="gradsync-test-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# Triton (the fused codec kernels) picks its interpreter when it is imported: without a GPU, every import in this
# session is the interpreter, so tests/compress/test_kernels.py runs the kernels' own source on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def single_intraop_thread() -> Iterator[None]:
    """One intra-op thread for a module: the machine runs timing-sensitive benchmarks beside the tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_topology(n: int, extra_edges: int, seed: int, bandwidths: tuple[float, ...] = (1, 2, 3, 5, 8, 13)) -> Topology:
    """A connected switch-free graph: a random spanning tree plus ``extra_edges`` random chords."""
    rng = random.Random(seed)
    edges: set[tuple[int, int]] = set()
    for v in range(1, n):
        u = rng.randrange(v)
        edges.add((u, v))
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n) if (a, b) not in edges]
    rng.shuffle(pairs)
    edges |= set(pairs[:extra_edges])
    return Topology(
        f"random{n}-{seed}",
        tuple(Device(f"g{i}", "gpu") for i in range(n)),
        tuple(Link(f"g{a}", f"g{b}", float(rng.choice(bandwidths))) for a, b in sorted(edges)),
    )


def random_fabric(seed: int, max_nodes: int = 10, max_ranks: int = 7, max_switches: int = 4) -> Topology:
    """A connected random graph of 2..``max_ranks`` ranks and 0..``max_switches`` forwarding switches (at most
    ``max_nodes`` devices) with mixed bandwidths: a random spanning tree plus random chords."""
    rng = random.Random(seed)
    n_ranks = rng.randint(2, max_ranks)
    n_switches = rng.randint(0, min(max_switches, max_nodes - n_ranks))
    names = [f"g{i}" for i in range(n_ranks)] + [f"sw{i}" for i in range(n_switches)]
    order = names[:]
    rng.shuffle(order)
    edges = {frozenset((order[v], order[rng.randrange(v)])) for v in range(1, len(order))}
    pairs = [frozenset(p) for p in itertools.combinations(names, 2)]
    rng.shuffle(pairs)
    edges |= set(pairs[: rng.randint(0, len(names))])
    devices = tuple(Device(n, "gpu" if n.startswith("g") else "switch") for n in names)
    links = tuple(Link(*sorted(e), float(rng.choice((1, 2, 3, 5, 8)))) for e in sorted(edges, key=sorted))
    return Topology(f"fabric-{seed}", devices, links)


def set_partitions(items: list) -> Iterator[list[list]]:
    """Every partition of ``items`` into non-empty blocks (Bell(n) of them): the brute force for cut bounds."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1:]
        yield [[first], *part]
