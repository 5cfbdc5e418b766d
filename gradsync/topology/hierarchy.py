"""The switch hierarchy of a topology, read from its links alone (BML §3: Fat-Tree, BCube; two-tier racks).

The hierarchical walk and BML need the ranks as mixed-radix addresses, one digit per level, where the ranks
that differ only in digit ``l`` form a level-``l`` group, plus a route for each pair inside a group. Builders
know this by construction, a topology file does not say it, and rates do not define it: links do. So it is
inferred from the graph, for any topology:

* **tree** (every rank has one link, to a *leaf* switch): level 0 = the ranks under one leaf, ordered by rank
  (digit: *port*). If some switches are linked to every leaf (a core, or the spines of a two-tier Clos) the
  second level is the ranks with the same port under every leaf, routed ``leaf -> spine[port mod spines] ->
  leaf`` (``racks:r,s,o``). Otherwise the leaves must split into *pods* (leaves joined through their uplink
  switches) whose common uplinks (*aggregation* switches) are joined across pods by *core* switches: level 1
  = the same port under each leaf of a pod, through one aggregation switch per port; level 2 = the same (leaf,
  port) in every pod, through one core per (port, leaf), as D-mod-k routes a ``fattree:k``.
* **BCube-like** (every rank linked to ``k > 1`` switches, switches joined only to ranks): the switches must
  fall into ``k`` levels, each rank on one switch per level and the switches of a level partitioning the
  ranks; digit ``l`` of a rank is which of the ``n`` hyperplanes it lies in (the ranks still connected without
  level-``l`` switches), and the result is checked to be BCube(n, k) exactly.

Labels follow rank order (pods, leaves and hyperplanes by their smallest rank, ports by rank) and device order
(spines, aggregation and core switches, BCube levels by rank 0's switches), which is how the builders number
theirs: on a builder's topology the inferred addresses and routes are the builder's. A rank order that is
not mixed-radix (hosts interleaved across racks) still gets a hierarchy: addresses are then a permutation.

A builder's ``attrs`` are a hint only: ``family`` ``racks`` or ``bcube`` admits the one-switch case
(``racks:1,s,o``, ``bcube:n,1``), which a bare graph does not count as a hierarchy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod

import networkx as nx

from gradsync.errors import GradsyncError, TopologyError
from gradsync.topology.model import Topology

__all__ = ["HIERARCHY_FAMILIES", "SwitchHierarchy", "address_index", "group_of", "infer_hierarchy", "rank_table",
           "switch_hierarchy"]

#: The shapes :func:`infer_hierarchy` recognises (and the builder families that hint at them).
HIERARCHY_FAMILIES = ("racks", "fattree", "bcube")


@dataclass(frozen=True)
class SwitchHierarchy:
    """Ranks as mixed-radix addresses (level 0 least significant) and the device path up to each level's meeting point.

    ``digits[r][l]`` is rank ``r``'s digit at level ``l``, in ``[0, radices[l])``; every address occurs once.
    ``paths[r][l]`` runs from rank ``r``'s device up to the switch where its level-``l`` group meets, so two
    members of one group talk along ``paths[a][l]`` then ``paths[b][l]`` reversed.
    """

    family: str
    levels: tuple[str, ...]
    radices: tuple[int, ...]
    digits: tuple[tuple[int, ...], ...]
    paths: tuple[tuple[tuple[str, ...], ...], ...]
    #: ``rank_at[address]``: the rank holding each address (the inverse of ``digits``).
    rank_at: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.levels) == len(self.radices) and all(m >= 1 for m in self.radices)):
            raise TopologyError(f"hierarchy levels {self.levels} and radices {self.radices} must pair up, radices >= 1")
        if len(self.paths) != len(self.digits):
            raise TopologyError(f"hierarchy has {len(self.digits)} addresses but {len(self.paths)} ranks' paths")
        object.__setattr__(self, "rank_at", rank_table(self.digits, self.radices))

    @property
    def world_size(self) -> int:
        return len(self.digits)

    def address(self, rank: int) -> int:
        """Rank ``rank``'s address as one number (mixed radix, level 0 least significant)."""
        return address_index(self.digits[rank], self.radices)

    def group(self, rank: int, level: int) -> list[int]:
        """The other ranks of ``rank``'s level-``level`` group (only digit ``level`` differs), by digit."""
        return group_of(self.digits, self.radices, self.rank_at, rank, level)

    def groups(self, level: int) -> list[frozenset[int]]:
        """Every level-``level`` group as a set of ranks (for comparing hierarchies whatever their labels)."""
        out: dict[tuple[int, ...], set[int]] = {}
        for r, d in enumerate(self.digits):
            out.setdefault(d[:level] + d[level + 1:], set()).add(r)
        return sorted((frozenset(g) for g in out.values()), key=min)

    def route(self, a: int, b: int, level: int) -> tuple[str, ...]:
        """Device path from rank ``a`` to rank ``b`` of its level-``level`` group: up to where they meet, down again."""
        up, down = self.paths[a][level], self.paths[b][level]
        if up[-1] != down[-1]:
            raise TopologyError(f"ranks {a} and {b} do not meet at one switch on level {level} ({up[-1]!r}, {down[-1]!r})")
        return up + down[-2::-1]


def rank_table(digits: Sequence[tuple[int, ...]], radices: tuple[int, ...],
               error: type[GradsyncError] = TopologyError) -> tuple[int, ...]:
    """``rank_at[address]``: the rank holding each mixed-radix address, checked to be a one-to-one numbering of every
    address (``error`` names the first fault)."""
    if not all(m >= 1 for m in radices):
        raise error(f"hierarchy radices {radices} must all be >= 1")
    size = prod(radices)
    if len(digits) != size:
        raise error(f"hierarchy radices {radices} describe {size} ranks, got {len(digits)}")
    rank_at = [-1] * size
    for r, d in enumerate(digits):
        if len(d) != len(radices) or not all(0 <= x < m for x, m in zip(d, radices)):
            raise error(f"rank {r} has address {d}, outside radices {radices}")
        a = address_index(d, radices)
        if rank_at[a] >= 0:
            raise error(f"ranks {rank_at[a]} and {r} share address {d}; every rank needs its own")
        rank_at[a] = r
    return tuple(rank_at)


def group_of(digits: Sequence[tuple[int, ...]], radices: tuple[int, ...], rank_at: Sequence[int], rank: int,
             level: int) -> list[int]:
    """The other ranks of ``rank``'s level-``level`` group (only digit ``level`` differs), by digit."""
    stride = prod(radices[:level])
    mine = digits[rank][level]
    base = address_index(digits[rank], radices) - mine * stride
    return [rank_at[base + x * stride] for x in range(radices[level]) if x != mine]


def address_index(digits: tuple[int, ...], radices: tuple[int, ...]) -> int:
    """The mixed-radix number of an address, level 0 least significant."""
    out, stride = 0, 1
    for x, m in zip(digits, radices):
        out += x * stride
        stride *= m
    return out


class _NoHierarchy(TopologyError):
    """Internal: why the graph has no hierarchy (the public error adds the topology's name)."""


def switch_hierarchy(topology: Topology) -> SwitchHierarchy:
    """The hierarchy of ``topology``, taking its builder's ``family`` attr as a hint (see module doc)."""
    family = topology.attrs.get("family")
    return infer_hierarchy(topology, one_switch=family if family in ("racks", "bcube") else None)


def infer_hierarchy(topology: Topology, *, one_switch: str | None = None) -> SwitchHierarchy:
    """The switch hierarchy the links of ``topology`` form, or :class:`TopologyError` saying why there is none.

    ``one_switch`` (``"racks"`` or ``"bcube"``) accepts every rank under one switch as a one-level hierarchy
    of that family; otherwise that case has no hierarchy.
    """
    try:
        return _infer(topology, one_switch)
    except _NoHierarchy as exc:
        raise TopologyError(f"topology {topology.name!r} has no switch hierarchy: {exc}") from None


def _infer(topology: Topology, one_switch: str | None) -> SwitchHierarchy:
    g = topology.graph
    rank_of = topology.rank_index
    uplinks: list[list[str]] = []
    for name in topology.ranks:
        peers = sorted(g[name], key=topology.device_index.__getitem__)
        direct = [p for p in peers if p in rank_of]
        if not peers:
            raise _NoHierarchy(f"rank {name!r} has no links" + (" (one rank: nothing to aggregate)"
                                                                 if len(topology.ranks) == 1 else ""))
        if direct:
            raise _NoHierarchy(f"rank {name!r} is linked straight to rank {direct[0]!r}, not through a switch")
        uplinks.append(peers)
    if all(len(u) == 1 for u in uplinks):
        return _tree(topology, [u[0] for u in uplinks], one_switch)
    return _bcube(topology, uplinks)


# ---- single-homed ranks: leaves, then spines or pods ---------------------------------------------------------------
def _tree(topology: Topology, leaf_of: list[str], one_switch: str | None) -> SwitchHierarchy:
    g, order, names = topology.graph, topology.device_index, topology.ranks
    members: dict[str, list[int]] = {}
    for r, leaf in enumerate(leaf_of):
        members.setdefault(leaf, []).append(r)
    leaves = sorted(members, key=lambda x: members[x][0])
    sizes = sorted({len(members[x]) for x in leaves})
    if len(sizes) > 1:
        detail = ", ".join(f"{x} {len(members[x])}" for x in leaves[:6])
        raise _NoHierarchy(f"its leaf switches hold unequal numbers of ranks ({detail}); groups must be equal")
    s = sizes[0]
    port = {r: x for leaf in leaves for x, r in enumerate(members[leaf])}
    leaf_no = {leaf: i for i, leaf in enumerate(leaves)}
    if len(leaves) == 1:
        if one_switch == "bcube":
            return SwitchHierarchy("bcube", ("level0",), (s,), tuple((port[r],) for r in range(s)),
                                   tuple(((names[r], leaves[0]),) for r in range(s)))
        if one_switch == "racks":
            return SwitchHierarchy("racks", ("rack", "across racks"), (s, 1), tuple((port[r], 0) for r in range(s)),
                                   tuple(((names[r], leaves[0]),) * 2 for r in range(s)))
        raise _NoHierarchy(f"every rank hangs off one switch {leaves[0]!r}: a single level, nothing to group")
    up: dict[str, set[str]] = {}
    for leaf in leaves:
        up[leaf] = {v for v in g[leaf] if v not in topology.rank_index}
    if len(leaves) == 2 and up[leaves[0]] == {leaves[1]} and up[leaves[1]] == {leaves[0]}:
        # two racks whose switches are linked straight to each other (no spine): they meet at the second one
        digits = tuple((port[r], leaf_no[leaf_of[r]]) for r in range(len(names)))
        paths = tuple(((names[r], leaf_of[r]), (names[r], *leaves) if leaf_of[r] == leaves[0] else (names[r], leaves[1]))
                      for r in range(len(names)))
        return SwitchHierarchy("racks", ("rack", "across racks"), (s, 2), digits, paths)
    for leaf in leaves:
        linked = sorted(up[leaf] & set(leaves), key=order.__getitem__)
        if linked:
            raise _NoHierarchy(f"leaf switches {leaf!r} and {linked[0]!r} are linked to each other, not through a spine"
                               f" (only two racks may link their switches straight to each other)")
    spines = sorted(set.intersection(*up.values()), key=order.__getitem__)
    if spines:
        digits = tuple((port[r], leaf_no[leaf_of[r]]) for r in range(len(names)))
        paths = tuple(((names[r], leaf_of[r]), (names[r], leaf_of[r], spines[port[r] % len(spines)]))
                      for r in range(len(names)))
        return SwitchHierarchy("racks", ("rack", "across racks"), (s, len(leaves)), digits, paths)
    return _pods(topology, leaf_of, leaves, members, up, port)


def _pods(topology: Topology, leaf_of: list[str], leaves: list[str], members: dict[str, list[int]],
          up: dict[str, set[str]], port: dict[int, int]) -> SwitchHierarchy:
    """Three tiers: leaves joined through their uplinks into pods, pods joined by core switches."""
    g, order, names = topology.graph, topology.device_index, topology.ranks
    joined = nx.Graph([(leaf, v) for leaf in leaves for v in up[leaf]])
    pods = sorted((sorted(set(c) & set(up), key=lambda x: members[x][0]) for c in nx.connected_components(joined)),
                  key=lambda pod: members[pod[0]][0])
    if len(pods) < 2:
        raise _NoHierarchy("no switch is linked to every leaf switch, and the leaves do not split into pods")
    if len({len(p) for p in pods}) > 1:
        raise _NoHierarchy(f"its pods hold unequal numbers of leaf switches ({', '.join(str(len(p)) for p in pods)})")
    aggs = [sorted(set.intersection(*(up[leaf] for leaf in pod)), key=order.__getitem__) for pod in pods]
    for pod, common in zip(pods, aggs):
        if not common:
            raise _NoHierarchy(f"no switch is linked to every leaf of the pod of {pod[0]!r}")
    in_pod = {a: p for p, common in enumerate(aggs) for a in common}
    leaf_set = set(leaves)
    # A core meets every pod at one of its aggregation switches (Fat-Tree: core{a}.{j} meets p{p}.agg{a}).
    reach: dict[str, dict[int, str]] = {}
    for a in sorted(in_pod, key=order.__getitem__):
        for c in g[a]:
            if c not in in_pod and c not in leaf_set and c not in topology.rank_index:
                reach.setdefault(c, {}).setdefault(in_pod[a], a)
    cores = {c: via for c, via in reach.items() if len(via) == len(pods)}
    by_agg = [sorted((c for c, via in cores.items() if via[0] == a), key=order.__getitem__) for a in aggs[0]]
    if not all(by_agg):
        lone = aggs[0][[bool(c) for c in by_agg].index(False)]
        raise _NoHierarchy(f"aggregation switch {lone!r} reaches no core switch that is linked to every pod")
    pod_of = {leaf: p for p, pod in enumerate(pods) for leaf in pod}
    edge_no = {leaf: e for pod in pods for e, leaf in enumerate(pod)}
    digits, paths = [], []
    for r, name in enumerate(names):
        leaf = leaf_of[r]
        p, e, x = pod_of[leaf], edge_no[leaf], port[r]
        cls = by_agg[x % len(by_agg)]
        core = cls[e % len(cls)]
        digits.append((x, e, p))
        paths.append(((name, leaf), (name, leaf, cores[cls[0]][p]), (name, leaf, cores[core][p], core)))
    radices = (len(members[leaves[0]]), len(pods[0]), len(pods))
    return SwitchHierarchy("fattree", ("edge", "aggregation", "pod"), radices, tuple(digits), tuple(paths))


# ---- multi-homed ranks: BCube levels ---------------------------------------------------------------------------
def _bcube(topology: Topology, uplinks: list[list[str]]) -> SwitchHierarchy:
    g, names = topology.graph, topology.ranks
    k = len(uplinks[0])
    odd = next((r for r, u in enumerate(uplinks) if len(u) != k), None)
    if odd is not None:
        raise _NoHierarchy(f"ranks {names[0]!r} and {names[odd]!r} have {k} and {len(uplinks[odd])} switch links; "
                           f"a BCube-like network gives every rank one link per level")
    members: dict[str, list[int]] = {}
    for r, u in enumerate(uplinks):
        for sw in u:
            members.setdefault(sw, []).append(r)
    for sw in members:
        other = [v for v in g[sw] if v not in topology.rank_index]
        if other:
            raise _NoHierarchy(f"ranks have {k} switch links each, but switch {sw!r} is linked to {other[0]!r}; "
                               f"BCube-like switches join only ranks")
    n = len(members[uplinks[0][0]])
    if any(len(m) != n for m in members.values()) or n**k != len(names):
        raise _NoHierarchy(f"its {len(members)} switches do not hold {n} ranks each over n**k = {n}**{k} ranks "
                           f"(it has {len(names)}): not BCube-like")
    sets = [set(u) for u in uplinks]
    level = {sw: lv for lv, sw in enumerate(uplinks[0])}
    seen, queue = {0}, deque([0])
    while queue:  # b, one switch away from a: its switch parallel to a's level-m switch U is level m
        a = queue.popleft()
        for hop in uplinks[a]:
            for b in members[hop]:
                if b in seen:
                    continue
                for sw in uplinks[a]:
                    if sw == hop:
                        continue
                    c = next(x for x in members[sw] if x != a)
                    match = [t for t in uplinks[b] if t != hop and any(sets[d] & sets[c] for d in members[t])]
                    if len(match) != 1 or level.setdefault(match[0], level[sw]) != level[sw]:
                        raise _NoHierarchy(f"the switches of {names[b]!r} do not line up in levels with those of "
                                           f"{names[a]!r}: not BCube-like")
                seen.add(b)
                queue.append(b)
    digits = [[0] * k for _ in names]
    for lv in range(k):  # digit lv: which hyperplane, i.e. component without level-lv switches
        planes = nx.Graph()
        planes.add_nodes_from(range(len(names)))
        for sw, ms in members.items():
            if level[sw] != lv:
                nx.add_path(planes, ms)
        comps = sorted((min(c), c) for c in nx.connected_components(planes))
        if len(comps) != n:
            raise _NoHierarchy(f"its level-{lv} switches do not split the ranks into {n} parts: not BCube-like")
        for x, (_, comp) in enumerate(comps):
            for r in comp:
                digits[r][lv] = x
    for sw, ms in members.items():
        lv = level[sw]
        rest = {tuple(digits[r][:lv] + digits[r][lv + 1:]) for r in ms}
        if len(rest) != 1 or sorted(digits[r][lv] for r in ms) != list(range(n)):
            raise _NoHierarchy(f"switch {sw!r} does not join ranks that differ in one digit only: not BCube-like")
    paths = []
    for r, u in enumerate(uplinks):
        by_level = sorted(u, key=level.__getitem__)
        if [level[sw] for sw in by_level] != list(range(k)):
            raise _NoHierarchy(f"rank {names[r]!r} is not on one switch per level: not BCube-like")
        paths.append(tuple((names[r], sw) for sw in by_level))
    return SwitchHierarchy("bcube", tuple(f"level{lv}" for lv in range(k)), (n,) * k,
                           tuple(tuple(d) for d in digits), tuple(paths))
