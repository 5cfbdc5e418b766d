"""Allreduce around one persistently late rank (StragglAR, 2025): the others reduce while it is late.

A ring allreduce cannot start the late rank's share of the work before that rank arrives: every chunk
passes through it, and its link carries ``2 (N - 1) / N`` of the buffer *after* it arrives, so with one rank
late by Δ a ring takes ``Δ + T_ring`` however long Δ is. StragglAR's observation is that the ``N - 1``
ranks that are on time can spend Δ on a reduce-scatter among themselves, so that only the late rank's own
contribution is left to fold in when it arrives. Here, with ``s`` the late rank and ``P`` the others
(``m = N - 1`` of them, in depth-first order of the device graph, so ring neighbours are close):

1. **Reduce-scatter among P** (steps ``0 .. m-2``): a ring over P only; the buffer is cut into ``m`` equal
   shards and shard ``q`` ends, summed over P, at its owner ``p_q``. Rank ``s`` takes no part.
2. **The late rank joins** (step ``m - 1``): ``s`` sends its shard ``q`` straight to ``p_q`` along the
   route the topology's router gives (the shortest path), which adds it: ``p_q`` now holds the full sum.
3. **Results out**: ``p_q`` copies shard ``q`` to ``s`` and to every other rank of P, either straight from
   ``p_q`` (*fan-out*, all at step ``m``) or, for the others, around the ring over P (an allgather, steps
   ``m .. 2m-2``). The bytes on a rank's own link are the same either way; they differ on shared links (a
   rack's uplink carries a shard once per rank beyond it with fan-out, at most twice with the ring), so the
   plan takes fan-out unless its busiest link direction carries more (:meth:`Schedule.link_loads`). On a switch
   fan-out wins: each copy is one hop, not ``m - 1`` store-and-forward hops, and no rank relays, so a rank
   waits on a message only to keep it, not to pass it on (on the 2-core testbed, ``switch:8`` at 100 Mbit/s, 4
   MiB, the rank late by one ring allreduce: the time after it arrives fell from 0.52 to 0.48 s, docs/runtime.md).

After ``s`` arrives its link carries the buffer once each way (``M`` out in step 2, ``M`` in in step 3),
against ``2 (N - 1) / N · M`` each way for a ring, and every on-time rank's link carries ``M`` each way too
(``M / m`` to and from ``s``, ``(m - 1) / m · M`` of allgather). When Δ covers phase 1 (``Δ >= (m - 1) /
m · M / β``) the allreduce therefore ends at ``Δ + M / β`` once ``s``'s send and receive overlap, against
``Δ + 2 (N - 1) / N · M / β`` for the ring: the 2× of StragglAR's theory for large N. Steps order transfers
per chunk only, so the overlap comes from sub-chunks (``PlanOptions.pipeline`` P): the copy of sub-chunk k
back to ``s`` runs while ``s`` still sends sub-chunk k + 1, and a store-and-forward run ends near
``Δ + (P + 1) / P · M / β``. With nobody late it is a valid but slower allreduce (an on-time rank's link
carries ``(2m - 1) / m`` of the buffer, more than a ring's ``2 (N - 1) / N``), so it is worth planning only
for a rank that a watcher (:mod:`gradsync.comm.watch`) has seen late for several collectives.

StragglAR's own post-arrival phase is a round-by-round exchange schedule; this module expresses the same
data movement (each shard folded in at its owner, then spread) in the one schedule representation, so it
is self-checked, simulated (:func:`gradsync.sim.simulate` models the late arrival with ``start_delay_s``) and
executed like every other plan. Reference: A. Devraj, E. Ding, A. Vijaya Kumar, R. Kleinberg, R. Singh,
*Efficient AllReduce with Stragglers* (first version: *Accelerating AllReduce with a Persistent
Straggler*), arXiv:2505.23523, 2025.
"""

from __future__ import annotations

import networkx as nx

from gradsync.errors import PlanError
from gradsync.plan.routing import router_for
from gradsync.plan.schedule import Chunk, Schedule, Transfer, ring_transfers
from gradsync.plan.synthesizers import PlanOptions, split_chunks, synthesizer
from gradsync.topology.model import Topology

__all__ = ["late_rank", "plan_straggler"]


def late_rank(topology: Topology, options: PlanOptions) -> int:
    """The rank the schedule lets join last: ``options.straggler``, or the last rank when none is named
    (so the synthesizer plans for any options, as every registered one must)."""
    n = topology.world_size
    s = n - 1 if options.straggler is None else options.straggler
    if not 0 <= s < n:
        raise PlanError(f"straggler={s} is not a rank of {topology.name!r} (ranks 0..{n - 1}); "
                        f"name the late rank's index in the topology's rank order")
    return s


@synthesizer("straggler", candidate_when=lambda options: options.straggler is not None)
def plan_straggler(topology: Topology, options: PlanOptions) -> Schedule:
    """Straggler-tolerant allreduce (StragglAR): the others reduce-scatter while one rank is late, then it joins."""
    n = topology.world_size
    s = late_rank(topology, options)
    if n == 1:
        return Schedule("straggler", topology.name, topology.ranks, (Chunk(0.0, 1.0, 0),), (), meta={"straggler": 0})
    fanout = _results_out(topology, options, s, fanout=True)
    if n < 4:  # one or two on-time ranks: the ring's allgather is the fan-out
        return fanout
    ring = _results_out(topology, options, s, fanout=False)
    costs = topology.directed_costs
    return fanout if fanout.link_loads(topology).cost(costs) <= ring.link_loads(topology).cost(costs) * (1 + 1e-9) else ring


def _results_out(topology: Topology, options: PlanOptions, s: int, *, fanout: bool) -> Schedule:
    """The schedule for late rank ``s`` with the results sent out from each owner straight to every rank
    (``fanout``), or straight to ``s`` and around the ring over the on-time ranks to the others."""
    idx = topology.rank_index
    others = [idx[v] for v in nx.dfs_preorder_nodes(topology.graph, topology.ranks[0]) if v in idx and idx[v] != s]
    m = len(others)
    route = router_for(topology)
    names = [topology.ranks[r] for r in others]
    ring_routes = [route(names[i], names[(i + 1) % m]) for i in range(m)] if m > 1 else [(names[0], names[0])]
    chunks, ids = split_chunks([1.0 / m] * m, options.pipeline)
    roots: dict[int, int] = {}
    transfers: list[Transfer] = []
    late = topology.ranks[s]
    for sub in range(options.pipeline):
        chunk_ids = [ids[q][sub] for q in range(m)]
        ring, owner = ring_transfers(others, chunk_ids, ring_routes)
        roots.update(owner)
        if fanout:
            transfers += [t for t in ring if t.step < m - 1]
        else:  # the ring's allgather (steps m-1 ..) moves one step later, behind the join at step m - 1
            transfers += [t if t.step < m - 1 else Transfer(t.chunk, t.src, t.dst, t.route, t.reduce, t.step + 1) for t in ring]
        for c in chunk_ids:
            p = owner[c]
            there = route(late, topology.ranks[p])
            transfers.append(Transfer(c, s, p, there, True, m - 1))
            transfers.append(Transfer(c, p, s, tuple(reversed(there)), False, m))
            if fanout:
                transfers += [Transfer(c, p, o, route(topology.ranks[p], topology.ranks[o]), False, m)
                              for o in others if o != p]
    chunks = [Chunk(ch.offset, ch.size, roots[i]) for i, ch in enumerate(chunks)]
    meta = {"straggler": s, "straggler_name": late, "on_time_order": names, "results": "fanout" if fanout else "ring"}
    return Schedule("straggler", topology.name, topology.ranks, tuple(chunks), tuple(transfers), meta=meta)
