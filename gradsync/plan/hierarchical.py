"""Hierarchical allreduce by switch groups: BML §3.3's "BML-like" algorithm on Fat-Tree, and on BCube.

Ranks get mixed-radix addresses, one digit per level; the ranks that differ only in digit ``l`` form a
level-``l`` group (servers under one edge switch, ...). The buffer is cut into ``N`` pieces, piece ``q``
named by rank ``q``'s address. Reduce, level by level: in step ``w`` every rank sends each other member of
its level-``w`` group the pieces that agree with it on levels ``< w`` and with that member on level ``w``,
so each group member leads (sums) an equal share; after the last level rank ``q`` holds piece ``q`` summed
over all ranks. The broadcast runs the same groups backwards with copies. This is the single-thread
(``k = 1`` thread) form of BML's walk, so load stays balanced: each rank sends

    sum_l (m_l - 1) / (m_0 ... m_l) = 1 - 1/N      of the buffer in each stage,

hence every NIC link direction carries ``2 (N - 1) / N``.

* ``fattree:k``: level 0 = the ``k/2`` servers under an edge switch (digit: port), level 1 = the servers on
  the same port of the ``k/2`` edge switches of a pod, routed through aggregation switch ``port`` (the
  BML paper's "grouped by aggregation switches"), level 2 = the servers at the same (edge, port) in the ``k``
  pods, routed through core switch ``core{port}.{edge}``. Every uplink then carries one server's traffic
  only, so the host links bound the cost: ``2 (N - 1) / N``, the same GST as the parameter server (§3.3:
  "the single NIC at each server in Fat-Tree cannot speedup the synchronization").
* ``bcube:n,k``: level ``l`` = the servers under one level-``l`` switch. One thread uses one level per step,
  so the level-0 links carry ``2 (n - 1) / n`` while the other NICs idle; BML's ``k`` threads rotate the
  levels to spread exactly this load over all ``k`` NICs.

The levels come from the links (:mod:`gradsync.topology.hierarchy`), not from a builder's ``attrs``: a
topology file of the same fabric gets the same groups, routes and cost, and any two-tier leaf/spine file is
planned like ``racks:r,s,o`` (level 0 = a leaf's hosts, level 1 = the same port under every leaf).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gradsync.errors import PlanError, TopologyError
from gradsync.plan.schedule import Schedule, Transfer
from gradsync.plan.synthesizers import SYNTHESIZERS, PlanOptions, split_chunks, synthesizer, unless_raises
from gradsync.topology.hierarchy import SwitchHierarchy, group_of, rank_table, switch_hierarchy
from gradsync.topology.model import Topology

__all__ = ["HIERARCHY_SYNTHESIZERS", "Hierarchy", "bcube_hierarchy", "fattree_hierarchy", "racks_hierarchy", "hierarchy_of",
           "hierarchical_transfers", "others_that_apply", "plan_hierarchical", "switch_hierarchy_of"]

#: Synthesizers that need a switch hierarchy; a refusal names the others, which apply to any topology.
HIERARCHY_SYNTHESIZERS = ("hierarchical", "bml")


@dataclass(frozen=True)
class Hierarchy:
    """Ranks as mixed-radix addresses: ``digits[r][l]`` in ``[0, radices[l])``, level 0 reduced first.

    Every address belongs to one rank; piece ``q`` is named by address ``q`` and completes at the rank
    holding it (``rank_at[q]``, which is ``q`` when ranks are numbered in address order, as builders do).
    ``route(src, dst, level)`` is the device path between two ranks of one level-``level`` group.
    """

    radices: tuple[int, ...]
    digits: tuple[tuple[int, ...], ...]
    route: Callable[[int, int, int], tuple[str, ...]]
    #: What each level groups by, for reports (``edge``, ``aggregation``, ``pod``, ``level0``, ...).
    levels: tuple[str, ...]
    rank_at: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank_at", rank_table(self.digits, self.radices, PlanError))

    def group(self, a: int, level: int) -> list[int]:
        """The other ranks of ``a``'s level-``level`` group (only digit ``level`` differs)."""
        return group_of(self.digits, self.radices, self.rank_at, a, level)


def _pieces(hier: Hierarchy, fixed: dict[int, int]) -> list[int]:
    """Piece numbers whose digit ``l`` equals ``fixed[l]`` for every fixed level, all values elsewhere."""
    out = [0]
    stride = 1
    for level, m in enumerate(hier.radices):
        vals = [fixed[level]] if level in fixed else range(m)
        out = [o + v * stride for o in out for v in vals]
        stride *= m
    return sorted(out)


def hierarchical_transfers(hier: Hierarchy, sub: int = 1) -> list[Transfer]:
    """Reduce up the levels, then broadcast back down; piece ``g`` is chunks ``g*sub .. g*sub+sub-1``.

    Levels of radix 1 are skipped (nothing to exchange), so steps stay dense: with ``L`` real levels the
    reduce uses steps ``0 .. L-1`` and the broadcast ``L .. 2L-1``.
    """
    active = [lv for lv, m in enumerate(hier.radices) if m > 1]
    depth = len(active)
    out: list[Transfer] = []
    for w, level in enumerate(active):  # reduce: pieces agreeing with a on the levels already done
        for a in range(len(hier.digits)):
            done = {lv: hier.digits[a][lv] for lv in active[:w]}
            for s in hier.group(a, level):
                route = hier.route(a, s, level)
                for g in _pieces(hier, {**done, level: hier.digits[s][level]}):
                    out += [Transfer(c, a, s, route, True, w) for c in range(g * sub, g * sub + sub)]
    for w, level in enumerate(reversed(active)):  # broadcast: the finished pieces a holds go back down
        for a in range(len(hier.digits)):
            held = _pieces(hier, {lv: hier.digits[a][lv] for lv in active[: depth - w]})
            for s in hier.group(a, level):
                route = hier.route(a, s, level)
                for g in held:
                    out += [Transfer(c, a, s, route, False, depth + w) for c in range(g * sub, g * sub + sub)]
    return out


def others_that_apply(topology: Topology) -> str:
    """The synthesizers that plan ``topology`` without a switch hierarchy, for refusals to name."""
    able = [n for n in SYNTHESIZERS.names()
            if n not in HIERARCHY_SYNTHESIZERS and not SYNTHESIZERS.get(n).applicable(topology)]
    return f"use --algorithm with one of {', '.join(able)}, which apply to any topology" if able else "no other algorithm applies"


def switch_hierarchy_of(topology: Topology) -> SwitchHierarchy:
    """The switch hierarchy inferred from ``topology``'s links, or :class:`PlanError` saying there is none and
    which synthesizers apply instead."""
    try:
        return switch_hierarchy(topology)
    except TopologyError as exc:
        raise PlanError(f"{exc}; 'hierarchical' and 'bml' need hosts under leaf switches (racks, Fat-Tree pods) "
                        f"or BCube levels: {others_that_apply(topology)}") from None


def _from_switches(sh: SwitchHierarchy) -> Hierarchy:
    return Hierarchy(sh.radices, sh.digits, sh.route, sh.levels)


def _of_family(topology: Topology, family: str, example: str) -> Hierarchy:
    sh = switch_hierarchy_of(topology)
    if sh.family != family:
        raise PlanError(f"{topology.name!r} is a {sh.family} hierarchy ({', '.join(sh.levels)}), not {family}; "
                        f"use hierarchy_of, or a topology like {example!r}")
    return _from_switches(sh)


def fattree_hierarchy(topology: Topology) -> Hierarchy:
    """Edge switch, then aggregation switch, then pod groups of a Fat-Tree-like topology (see module doc)."""
    return _of_family(topology, "fattree", "fattree:4")


def bcube_hierarchy(topology: Topology) -> Hierarchy:
    """BCube levels 0, 1, .., k-1 in order: the level-``l`` group is the servers under one level-``l`` switch."""
    return _of_family(topology, "bcube", "bcube:3,2")


def racks_hierarchy(topology: Topology) -> Hierarchy:
    """Hosts of one rack, then the hosts with the same index in every rack (``racks:r,s,o`` or any two-tier file).

    Each host ends the rack stage owning 1/s of its rack's sum, then allreduces that share with its
    counterparts in the other racks: every uplink direction carries the buffer once, like a rack-first tree,
    but as ``s`` flows from ``s`` hosts instead of one flow into one root (whose NIC the rack's own traffic
    fills while the uplink flow waits behind it).
    """
    return _of_family(topology, "racks", "racks:2,3,4")


def hierarchy_of(topology: Topology) -> Hierarchy:
    """The switch-group hierarchy the links of ``topology`` form (racks, Fat-Tree, BCube), or :class:`PlanError`."""
    return _from_switches(switch_hierarchy_of(topology))


@synthesizer("hierarchical", applicable=unless_raises(hierarchy_of), halves=True)
def plan_hierarchical(topology: Topology, options: PlanOptions) -> Schedule:
    """Reduce within switch groups, then between groups, then broadcast back (BML §3.3; Fat-Tree, BCube, racks)."""
    hier = hierarchy_of(topology)
    n, sub = topology.world_size, options.pipeline
    chunks, _ = split_chunks([1.0 / n] * n, sub, hier.rank_at)
    transfers = hierarchical_transfers(hier, sub)
    meta = {"hierarchy": {"levels": list(hier.levels), "radices": list(hier.radices)}}
    return Schedule("hierarchical", topology.name, topology.ranks, tuple(chunks), tuple(transfers), meta=meta)
