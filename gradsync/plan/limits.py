"""Physical limits of allreduce on a topology (OMS Lemma 2.1 and the Nash-Williams-Tutte optimum).

All values are in OMS's cost units (``c_e = unit_bw / bw_e``; the allreduce of S bytes takes at least
``value * S / unit_bw`` with reduce and broadcast overlapped on duplex links).

* Lemma 2.1: ``max_e c_e >= C(T_MWST) >= C(G) >= (n - 1) / sum_e c_e^-1`` on switch-free graphs.
* Switch-free optimum: ``C(G) = max over partitions P of (|P| - 1) / sum_{e crossing P} c_e^-1`` (the
  fractional spanning-tree packing number, Nash-Williams-Tutte). The ``lp`` schedule attains it; its
  column generation returns it with a certificate.
* With switches there are three bounds:

  - ``cut``: the exact cut bound of :mod:`gradsync.plan.cut_bound`, ``max over rank partitions
    {A_1..A_q} of 2 (q - 1) / sum_i h(A_i)`` with ``h(A)`` the min cut between ``A`` and the other ranks.
    It holds for every schedule whose switches only forward (routed trees, rings, PS, anything gradsync
    plans); found by max-flows, it certifies the optimum of fat trees and BCubes of any size without the LP.
    On switch-free graphs it is the Nash-Williams-Tutte optimum.
  - ``no_aggregation``: the column-generation certificate ``min_T sum_e y_e c_e L_eT`` with duals ``y``
    (``y >= 0``, ``sum y = 1``). It bounds every schedule in which switches only forward: each element is
    reduced along a tree of ranks and broadcast back along it, and by the symmetry of duplex links mixing a
    schedule with its mirror image never hurts, so such schedules are mixes of routed trees. The ``lp``
    schedule attains it; ``lower_bound`` is the larger of this and ``cut``.
  - ``aggregation_cut``: the partition formula over partitions of *all* devices in which every part holds a
    rank (tried for singleton partitions only). Each element must leave every part but the root's once
    (reduce) and enter it once (broadcast), so every partition is crossed ``|P| - 1`` times per direction.
    This holds for *any* schedule, even one whose switches could aggregate (in-network reduction), so it
    is the hardware's limit; the gap to ``cut`` is the price of switches that cannot aggregate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from gradsync.plan.cut_bound import cut_bound
from gradsync.plan.lp import bottleneck_tree, optimal_packing, partition_bound
from gradsync.topology.model import Topology

__all__ = ["MAX_LP_RANKS", "Limits", "limits"]


@dataclass(frozen=True)
class Limits:
    """Bounds in cost units; ``None`` where a bound does not apply to this kind of topology."""

    #: Best lower bound for schedules whose switches only forward (what gradsync's schedules are).
    lower_bound: float
    #: Exact cut bound for schedules whose switches only forward (:mod:`gradsync.plan.cut_bound`).
    cut: float
    #: Lemma 2.1 quantities (switch-free graphs only).
    max_link_cost: float | None
    tree: float | None
    optimum: float | None
    sum_bound: float | None
    #: How ``lower_bound`` was obtained: ``"lp"`` (the larger of the column-generation certificate and the
    #: cut bound) or ``"cut"`` (topology too large for the LP within ``max_lp_ranks``: the cut bound alone,
    #: which is tight on fat trees, BCubes and switch-free graphs).
    method: str = "lp"
    #: Singleton-partition bound valid for any schedule, even with aggregating switches.
    aggregation_cut: float = 0.0

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)


def _singleton_cut(topology: Topology, tries: int = 8) -> float:
    """Cut bound of 'every rank alone, all forwarding devices with one collector rank' partitions."""
    if topology.world_size < 2:
        return 0.0
    best = 0.0
    # Any collector gives a valid bound; a few spread over the ranks are enough on regular networks.
    step = max(1, topology.world_size // tries)
    for collector in topology.ranks[::step]:
        part_of = {r: i for i, r in enumerate(topology.ranks)}
        for d in topology.devices:
            if d.name not in part_of:
                part_of[d.name] = part_of[collector]
        best = max(best, partition_bound(topology, part_of))
    return best


#: Above this many ranks :func:`limits` skips the LP (minutes on BCube(32,2)) and reports the cut bound.
MAX_LP_RANKS = 256


def limits(topology: Topology, max_lp_ranks: int = MAX_LP_RANKS, *, achieved: float | None = None) -> Limits:
    """Compute every bound of the module docstring for ``topology``.

    ``achieved`` is the cost of a schedule in hand: on a fabric with switches, when the cut bound already
    meets it the schedule is certified optimal and the LP (slow on large fabrics: ``gradsync bench plan-fabrics``) is skipped.
    """
    aggregation = _singleton_cut(topology)
    cut = cut_bound(topology).value
    certified = achieved is not None and topology.has_forwarders and cut >= achieved * (1 - 1e-9)
    if topology.world_size > max_lp_ranks or certified:
        return Limits(cut, cut, None, None, None, None, method="cut", aggregation_cut=aggregation)
    packing = optimal_packing(topology)
    # On asymmetric links the LP's certificate bounds only schedules that reduce and broadcast along the same
    # trees (it sees each link at its slower direction); the cut bound holds for every schedule.
    lower = max(packing.lower_bound, min(cut, packing.cost)) if topology.symmetric else cut
    method = "lp" if topology.symmetric else "cut"
    if topology.has_forwarders:
        return Limits(lower, cut, None, None, None, None, method=method, aggregation_cut=aggregation)
    costs = topology.costs
    n = topology.world_size
    tree = bottleneck_tree(topology)
    return Limits(
        lower_bound=lower,
        cut=cut,
        max_link_cost=float(costs.max()) if costs.size else 0.0,
        tree=float((costs * tree.loads).max()) if costs.size else 0.0,
        optimum=packing.cost,
        sum_bound=(n - 1) / float(np.sum(1.0 / costs)) if costs.size else 0.0,
        method=method,
        aggregation_cut=aggregation,
    )
