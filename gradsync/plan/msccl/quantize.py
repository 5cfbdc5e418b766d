"""How an MSCCL export quantizes a schedule's chunk fractions into whole MSCCL chunks.

MSCCL cuts the buffer into ``K = nchunksperloop`` equal chunks; schedule chunk ``c``
(a fraction ``f_c``) gets ``k_c`` of them (``sum k_c = K``; a chunk with ``k_c = 0`` is dropped and its
share goes to the others). Its transfers become steps of ``cnt = k_c``, so a tree's weight costs no extra
steps however fine ``K`` is. With ``L_c`` the cost-weighted load chunk ``c`` puts on every link direction
per unit of buffer, the schedule's cost is ``max(sum_c f_c L_c)`` and the exported one's
``max(sum_c k_c / K L_c)``; the loss is their ratio minus one and algorithmic bandwidth is
``unit_bandwidth / cost`` (bandwidth term only, as ``gradsync plan`` reports it). ``k`` starts at
``floor(f K)`` (at least 1 when ``K`` is at least the number of chunks, so every tree or ring of the
plan is kept) and each remaining chunk goes where it raises the maximum load least; a negative loss means
the re-weighting found a cheaper mix than the plan's own weights (plans that are not LP-optimal). Without
``K`` the smallest ``K`` from the number of chunks up to ``max(64, 2 x chunks)`` within ``max_loss`` is
taken, else the cheapest (the executor runs an algorithm only on buffers whose element count ``K``
divides, so small is better); on p3.16xlarge the LP's ten trees weigh multiples of 1/24: ``K = 17`` is
within 0.84%, ``K = 24`` exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradsync.errors import MscclError
from gradsync.plan.schedule import SHARDED, Schedule
from gradsync.topology.model import Topology

__all__ = ["MAX_AUTO_CHUNKS", "Quantization", "quantize"]

#: The largest chunk count per loop the automatic choice tries.
MAX_AUTO_CHUNKS = 64


@dataclass(frozen=True)
class Quantization:
    """Integer chunk counts per schedule chunk and what they cost (see the module docstring)."""

    nchunksperloop: int
    counts: tuple[int, ...]
    #: Cost of the schedule's exact fractions and of ``counts / nchunksperloop`` (the schedule's cost units;
    #: relative sizes only when no topology was given).
    cost: float
    quantized_cost: float

    @property
    def loss(self) -> float:
        return self.quantized_cost / self.cost - 1.0 if self.cost > 0 else 0.0


def _chunk_loads(schedule: Schedule, topology: Topology | None) -> np.ndarray:
    """``L[c]``: cost-weighted load per link direction of chunk ``c`` per unit of buffer.

    Without a topology each chunk is its own 'link' of cost ``1 / f_c``, so the quantized cost is the
    largest over-weight ``k_c / (K f_c)``, an upper bound on the loss on any topology.
    """
    sizes = np.array([c.size for c in schedule.chunks])
    if topology is None:
        return np.diag(np.where(sizes > 0, 1.0 / np.maximum(sizes, 1e-300), 0.0))
    m = len(topology.links)
    loads = np.zeros((len(schedule.chunks), m, 2))
    cache: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for t in schedule.transfers:
        hops = cache.get(t.route)
        if hops is None:
            hops = cache[t.route] = topology.route_links(t.route)
        for e, d in hops:
            loads[t.chunk, e, d] += topology.costs[e]
    return loads.reshape(len(schedule.chunks), 2 * m)


def _round(sizes: np.ndarray, loads: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    counts = np.floor(sizes * k + 1e-9).astype(np.int64)
    if k >= np.count_nonzero(sizes > 0):  # room for every chunk: keep each tree / ring chunk of the plan
        keep = np.where(sizes > 0, np.maximum(counts, 1), 0)
        counts = keep if keep.sum() <= k else counts
    cur = counts @ loads / k
    for _ in range(int(k - counts.sum())):
        worst = np.max(cur[None, :] + loads / k, axis=1)
        remainder = sizes * k - counts
        c = int(np.lexsort((-remainder, worst))[0])
        counts[c] += 1
        cur += loads[c] / k
    return counts, float(cur.max()) if cur.size else 0.0


def _round_shards(sizes: np.ndarray, loads: np.ndarray, k: int, roots: Sequence[int], n: int) -> tuple[np.ndarray, float]:
    """:func:`_round` with every rank's shard getting exactly ``k / n`` of the chunks (its chunks' counts sum
    to it), so shard boundaries fall on MSCCL chunk boundaries as a sharded collective needs."""
    per = k // n
    owner = np.array(roots)
    counts = np.zeros(len(sizes), dtype=np.int64)
    for r in range(n):
        mine = np.flatnonzero(owner == r)
        share = sizes[mine] * n  # fractions of the shard
        base = np.floor(share * per + 1e-9).astype(np.int64)
        if per >= np.count_nonzero(share > 0):
            keep = np.where(share > 0, np.maximum(base, 1), 0)
            base = keep if keep.sum() <= per else base
        counts[mine] = base
    cur = counts @ loads / k
    for r in range(n):
        mine = np.flatnonzero(owner == r)
        for _ in range(int(per - counts[mine].sum())):
            worst = np.max(cur[None, :] + loads[mine] / k, axis=1)
            remainder = sizes[mine] * k - counts[mine]
            c = int(mine[np.lexsort((-remainder, worst))[0]])
            counts[c] += 1
            cur += loads[c] / k
    return counts, float(cur.max()) if cur.size else 0.0


def quantize(schedule: Schedule, topology: Topology | None = None, nchunksperloop: int | None = None, *,
             max_loss: float = 0.01, max_auto: int = MAX_AUTO_CHUNKS) -> Quantization:
    """Chunk counts for ``nchunksperloop`` (or the smallest count within ``max_loss``, else the best <= ``max_auto``).

    A reduce-scatter or allgather needs ``nchunksperloop`` a multiple of the GPU count, each shard getting
    an equal number of chunks (MSCCL's buffers are ``nchunksperloop / ngpus`` chunks per rank)."""
    sizes = np.array([c.size for c in schedule.chunks])
    loads = _chunk_loads(schedule, topology)
    cost = float((sizes @ loads).max()) if loads.size else 0.0
    n = schedule.world_size
    sharded = schedule.collective in SHARDED
    if sharded:
        roots = [int(c.root) for c in schedule.chunks]  # type: ignore[arg-type]  # check() requires roots

        def rounding(k: int) -> tuple[np.ndarray, float]:
            return _round_shards(sizes, loads, k, roots, n)
    else:
        def rounding(k: int) -> tuple[np.ndarray, float]:
            return _round(sizes, loads, k)
    if nchunksperloop is not None:
        if sharded and nchunksperloop % n:
            raise MscclError(f"nchunksperloop={nchunksperloop} is not a multiple of the {n} GPUs; a {schedule.collective} "
                             f"gives every GPU's shard nchunksperloop / {n} chunks: use "
                             f"{max(n, nchunksperloop // n * n)} or {(nchunksperloop // n + 1) * n}")
        counts, q = rounding(nchunksperloop)
        return Quantization(nchunksperloop, tuple(int(x) for x in counts), cost, q)
    best: Quantization | None = None
    nonzero = max(1, int(np.count_nonzero(sizes > 0)))
    step = n if sharded else 1
    first = -(-nonzero // step) * step
    for k in range(first, max(max_auto, 2 * first) + 1, step):
        counts, q = rounding(k)
        cand = Quantization(k, tuple(int(x) for x in counts), cost, q)
        if cand.loss <= max_loss + 1e-12:
            return cand
        if best is None or cand.quantized_cost < best.quantized_cost - 1e-12:
            best = cand
    assert best is not None
    return best
