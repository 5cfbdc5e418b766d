"""Shared helpers for the tests: random connected graphs as topologies."""

from __future__ import annotations

import random

from gradsync.topology import Device, Link, Topology


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
