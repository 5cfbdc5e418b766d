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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradsync.errors import PlanError
from gradsync.plan.bml import bcube_shape
from gradsync.plan.routing import router_for
from gradsync.plan.schedule import Schedule, Transfer
from gradsync.plan.synthesizers import PlanOptions, split_chunks, synthesizer, unless_raises
from gradsync.topology.model import Topology

__all__ = ["Hierarchy", "bcube_hierarchy", "fattree_hierarchy", "racks_hierarchy", "hierarchy_of", "hierarchical_transfers",
           "plan_hierarchical"]


@dataclass(frozen=True)
class Hierarchy:
    """Ranks as mixed-radix addresses: ``digits[r][l]`` in ``[0, radices[l])``, level 0 reduced first.

    Rank ``r``'s address must be the mixed-radix digits of ``r`` (level 0 least significant), so the
    address of piece ``q`` is rank ``q``'s. ``route(src, dst, level)`` is the device path between two
    ranks of one level-``level`` group.
    """

    radices: tuple[int, ...]
    digits: tuple[tuple[int, ...], ...]
    route: Callable[[int, int, int], tuple[str, ...]]
    #: What each level groups by, for reports (``edge``, ``aggregation``, ``pod``, ``level0``, ...).
    levels: tuple[str, ...]

    def __post_init__(self) -> None:
        size = 1
        for m in self.radices:
            if m < 1:
                raise PlanError(f"hierarchy radices {self.radices} must all be >= 1")
            size *= m
        if size != len(self.digits):
            raise PlanError(f"hierarchy radices {self.radices} describe {size} ranks, got {len(self.digits)}")
        for r, d in enumerate(self.digits):
            if _index(d, self.radices) != r:
                raise PlanError(f"rank {r} has address {d}, not the mixed-radix digits of {r} in radices {self.radices}")

    def group(self, a: int, level: int) -> list[int]:
        """The other ranks of ``a``'s level-``level`` group (only digit ``level`` differs)."""
        stride = 1
        for m in self.radices[:level]:
            stride *= m
        base = a - self.digits[a][level] * stride
        return [base + x * stride for x in range(self.radices[level]) if x != self.digits[a][level]]


def _index(d: tuple[int, ...], radices: tuple[int, ...]) -> int:
    out, stride = 0, 1
    for x, m in zip(d, radices):
        out += x * stride
        stride *= m
    return out


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


def fattree_hierarchy(topology: Topology) -> Hierarchy:
    """Edge switch, then aggregation switch, then pod groups of a ``fattree:k`` topology (see module doc)."""
    k = topology.attrs.get("k")
    if topology.attrs.get("family") != "fattree" or not isinstance(k, int) or k < 2 or k % 2:
        raise PlanError(
            f"{topology.name!r} is not a Fat-Tree (attrs family={topology.attrs.get('family')!r}, k={k!r}); "
            f"build one with get_topology('fattree:k'), e.g. 'fattree:4'"
        )
    half = k // 2
    if topology.world_size != k * half * half:
        raise PlanError(
            f"{topology.name!r} has {topology.world_size} ranks but fattree:{k} has k**3/4 = {k * half * half} "
            f"servers; plan on the whole Fat-Tree, not on a rank selection"
        )
    digits = []
    for r, name in enumerate(topology.ranks):
        at = topology.device(name).attrs
        d = (at.get("index"), at.get("edge"), at.get("pod"))
        if not all(isinstance(x, int) for x in d) or _index(d, (half, half, k)) != r:
            raise PlanError(
                f"rank {r} ({name!r}) of {topology.name!r} has pod/edge/index {d[::-1]}; ranks must be the "
                f"Fat-Tree servers in (pod, edge, index) order"
            )
        digits.append(d)
    names = topology.ranks
    via = router_for(topology)  # D-mod-k: level 1 climbs to aggregation switch `port`, level 2 to core `core{port}.{edge}`

    def route(a: int, s: int, level: int) -> tuple[str, ...]:
        return via(names[a], names[s])

    return Hierarchy((half, half, k), tuple(digits), route, ("edge", "aggregation", "pod"))


def bcube_hierarchy(topology: Topology) -> Hierarchy:
    """BCube levels 0, 1, .., k-1 in order: the level-``l`` group is the servers under one level-``l`` switch."""
    shape = bcube_shape(topology)

    def route(a: int, s: int, level: int) -> tuple[str, ...]:
        return shape.route(a, s, level)

    return Hierarchy((shape.n,) * shape.k, shape.digits, route, tuple(f"level{lv}" for lv in range(shape.k)))


def racks_hierarchy(topology: Topology) -> Hierarchy:
    """Hosts of one rack, then the hosts with the same index in every rack (``racks:r,s,o``).

    Each host ends the rack stage owning 1/s of its rack's sum, then allreduces that share with its
    counterparts in the other racks: every uplink direction carries the buffer once, like a rack-first tree,
    but as ``s`` flows from ``s`` hosts instead of one flow into one root (whose NIC the rack's own traffic
    fills while the uplink flow waits behind it).
    """
    r, s = topology.attrs.get("racks"), topology.attrs.get("hosts_per_rack")
    if topology.attrs.get("family") != "racks" or not isinstance(r, int) or not isinstance(s, int):
        raise PlanError(f"{topology.name!r} is not a racks:r,s,o topology; build one with get_topology('racks:2,3,4')")
    if topology.world_size != r * s:
        raise PlanError(f"{topology.name!r} has {topology.world_size} ranks, not r*s = {r * s}; plan on the whole cluster")
    digits = []
    for q, name in enumerate(topology.ranks):
        at = topology.device(name).attrs
        d = (at.get("index"), at.get("rack"))
        if not all(isinstance(x, int) for x in d) or _index(d, (s, r)) != q:
            raise PlanError(f"rank {q} ({name!r}) of {topology.name!r} has rack/index {d[::-1]}; ranks must be in rack order")
        digits.append(d)
    names = topology.ranks
    via = router_for(topology)

    def route(a: int, b: int, level: int) -> tuple[str, ...]:
        return via(names[a], names[b])

    return Hierarchy((s, r), tuple(digits), route, ("rack", "across racks"))


_HIERARCHIES: dict[str, Callable[[Topology], Hierarchy]] = {
    "fattree": fattree_hierarchy, "bcube": bcube_hierarchy, "racks": racks_hierarchy,
}


def hierarchy_of(topology: Topology) -> Hierarchy:
    """The switch-group hierarchy of a Fat-Tree or BCube topology, or :class:`PlanError`."""
    family = topology.attrs.get("family")
    make = _HIERARCHIES.get(family) if isinstance(family, str) else None
    if make is None:
        raise PlanError(
            f"{topology.name!r} has no switch hierarchy the planner knows (attrs family={family!r}); "
            f"use a 'fattree:k', 'bcube:n,k' or 'racks:r,s,o' topology"
        )
    return make(topology)


@synthesizer("hierarchical", applicable=unless_raises(hierarchy_of), halves=True)
def plan_hierarchical(topology: Topology, options: PlanOptions) -> Schedule:
    """Reduce within switch groups, then between groups, then broadcast back (BML §3.3; Fat-Tree, BCube, racks)."""
    hier = hierarchy_of(topology)
    n, sub = topology.world_size, options.pipeline
    chunks, _ = split_chunks([1.0 / n] * n, sub, range(n))
    transfers = hierarchical_transfers(hier, sub)
    meta = {"hierarchy": {"levels": list(hier.levels), "radices": list(hier.radices)}}
    return Schedule("hierarchical", topology.name, topology.ranks, tuple(chunks), tuple(transfers), meta=meta)
