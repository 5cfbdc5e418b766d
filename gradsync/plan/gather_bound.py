"""The cut bound of allgather and reduce-scatter on any fabric (ForestColl), exact.

Units as in :mod:`gradsync.plan.forest`: the buffer is the full tensor, size 1; rank ``r`` owns the shard
``[r/N, (r+1)/N)``; ``w_uv = 1 / c_uv`` is the capacity of the directed link ``u -> v`` in buffers per cost
unit (:attr:`Topology.directed_costs`).

Bound (ForestColl: L. Zhao and A. Krishnamurthy, "Bandwidth Optimal Pipeline Schedule for Collective
Communication", arXiv:2305.18461, §1.1; L. Zhao et al., "ForestColl", arXiv:2402.06787; the README of
github.com/liangyuRain/ForestColl states it as ``(M/N) max_{S ⊂ V, S ⊉ V_c} |S ∩ V_c| / B+(S)``). For every
vertex set ``S`` (switches anywhere) holding some but not all ranks ``R``::

    allgather:       cost >= |S ∩ R| / (N w_out(S))
    reduce_scatter:  cost >= |R \\ S| / (N w_out(S))  =  |S' ∩ R| / (N w_in(S'))  with S' = V \\ S.

Proof. Allgather: a rank outside ``S`` must end with the shard of every rank in ``S``, ``|S ∩ R| / N`` of
the buffer that exists only inside ``S`` at the start; a message carries values of single elements (copies,
no coding across elements), so every element of those shards crosses a link leaving ``S`` at least once, and
those links carry ``w_out(S)`` per cost unit. Reduce-scatter: a rank ``t`` outside ``S`` must end with the sum
over all ranks of its shard, which depends on the contributions of the ranks in ``S`` (at least one); so for
each of the ``|R \\ S|`` shards owned outside ``S`` some message about every element leaves ``S``. Taking the
max over ``S`` gives :func:`gather_cut_bound`; reduce-scatter's bound is allgather's on the reversed links.

:mod:`gradsync.plan.forest` packs out-trees that attain it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import maximum_flow

from gradsync.errors import PlanError
from gradsync.plan.cut_bound import _integer_capacities
from gradsync.topology.model import Topology

__all__ = ["GatherBound", "brute_force_gather_bound", "gather_cut_bound"]

_INT_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class GatherBound:
    """``max_S |S ∩ R| / (N w(S))`` and a vertex set ``S`` attaining it (device names)."""

    value: float
    cut: tuple[str, ...]
    collective: str
    flows: int


def _weights(topology: Topology, collective: str) -> np.ndarray:
    """``(m, 2)`` capacities ``a -> b``, ``b -> a``; reversed for reduce-scatter (its bound is allgather's on them)."""
    if collective not in ("allgather", "reduce_scatter"):
        raise PlanError(f"collective {collective!r} has no gather bound; use 'allgather' or 'reduce_scatter'")
    w = 1.0 / topology.directed_costs if topology.links else np.zeros((0, 2))
    return w if collective == "allgather" else w[:, ::-1].copy()


def _out_capacity(topology: Topology, w: np.ndarray, inside: np.ndarray) -> float:
    idx = topology.device_index
    a = np.array([idx[lk.a] for lk in topology.links], dtype=np.int64)
    b = np.array([idx[lk.b] for lk in topology.links], dtype=np.int64)
    return float(w[inside[a] & ~inside[b], 0].sum() + w[inside[b] & ~inside[a], 1].sum())


def gather_cut_bound(topology: Topology, collective: str = "allgather") -> GatherBound:
    """The module docstring's bound, exactly: Dinkelbach on the ratio, each round ``N`` integer max-flows.

    At the best ratio so far ``A / W`` (``A`` ranks, ``W`` scaled capacity) a set beats it iff
    ``A w_out(S) + W |R \\ S| < W N``; for each rank ``t`` kept outside ``S`` that minimum is one s-t cut
    (source -> rank ``j`` at ``W``, paid when ``j`` is outside; links at ``A w``; ``t`` -> sink unbounded).
    A set that beats it holds a rank (else its value is ``>= W N``). Capacities are scaled to integers
    exactly when commensurable (every built-in fabric); the returned value is re-evaluated in floating point
    from the set found, so it is a valid bound either way.
    """
    n = topology.world_size
    w = _weights(topology, collective)
    if n < 2:
        return GatherBound(0.0, (), collective, 0)
    idx = topology.device_index
    nd = len(topology.devices)
    a = np.array([idx[lk.a] for lk in topology.links], dtype=np.int64)
    b = np.array([idx[lk.b] for lk in topology.links], dtype=np.int64)
    ranks = np.array([idx[r] for r in topology.ranks], dtype=np.int64)
    tails, heads = np.concatenate([a, b]), np.concatenate([b, a])
    budget = _INT_LIMIT / (8.0 * n * n)
    caps, _, _ = _integer_capacities(np.concatenate([w[:, 0], w[:, 1]]), budget)
    deg = np.bincount(tails, weights=caps, minlength=nd).astype(np.int64)
    # Start from the best single rank: {r} leaves at w_out(r).
    best = int(np.argmin(deg[ranks]))
    count, cap = 1, int(deg[ranks[best]])
    best_set = np.zeros(nd, dtype=bool)
    best_set[ranks[best]] = True
    flows = 0
    s_node, t_node = nd, nd + 1
    while True:
        improved = False
        for t in ranks:
            big = cap * n + 1
            rows = np.concatenate([tails, np.full(n, s_node), [t]])
            cols = np.concatenate([heads, ranks, [t_node]])
            data = np.concatenate([caps * count, np.full(n, cap), [big]])
            if int(data.max()) >= _INT_LIMIT or big >= _INT_LIMIT:  # pragma: no cover - budget keeps it small
                raise PlanError("gather cut bound: capacities overflow int32; report this topology")
            graph = sp.csr_array((data.astype(np.int32), (rows, cols)), shape=(nd + 2, nd + 2))
            result = maximum_flow(graph, s_node, t_node)
            flows += 1
            if int(result.flow_value) >= cap * n:
                continue
            residual = (graph - result.flow).tocsr()
            residual.data[residual.data < 0] = 0
            residual.eliminate_zeros()
            side = np.zeros(nd + 2, dtype=bool)
            side[sp.csgraph.breadth_first_order(residual, s_node, directed=True, return_predecessors=False)] = True
            inside = side[:nd]
            k = int(inside[ranks].sum())
            out = int(caps[inside[tails] & ~inside[heads]].sum())
            if 0 < k < n and k * cap > count * out:
                count, cap, best_set, improved = k, out, inside, True
        if not improved:
            break
    value = count / (n * _out_capacity(topology, w, best_set)) if _out_capacity(topology, w, best_set) > 0 else np.inf
    names = tuple(topology.devices[i].name for i in np.flatnonzero(best_set))
    return GatherBound(float(value), names, collective, flows)


def brute_force_gather_bound(topology: Topology, collective: str = "allgather") -> float:
    """The same bound by enumerating every vertex set (small fabrics only: tests)."""
    n, nd = topology.world_size, len(topology.devices)
    if nd > 20:
        raise PlanError(f"brute force over 2^{nd} vertex sets is too slow; use gather_cut_bound")
    w = _weights(topology, collective)
    is_rank = np.array([d.name in topology.rank_index for d in topology.devices])
    best = 0.0
    for mask in range(1, 2**nd - 1):
        inside = np.array([(mask >> i) & 1 for i in range(nd)], dtype=bool)
        k = int((inside & is_rank).sum())
        if 0 < k < n:
            out = _out_capacity(topology, w, inside)
            best = max(best, k / (n * out) if out > 0 else np.inf)
    return best
