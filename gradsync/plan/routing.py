"""Which path a flow between two ranks takes: a routing policy per topology family.

Synthesizers that send point-to-point flows across a network (``ps``, ``ring``) ask :func:`router_for` for
a route instead of picking "the first shortest path", which piles every flow onto one of many equal-cost
paths (on Fat-Tree(4) that triples PS's time). Families register a policy in :data:`ROUTERS`:

* ``fattree`` — destination-mod-k (D-mod-k) routing: a flow to server ``(pod, edge, port)`` climbs through
  aggregation switch ``port`` and core switch ``core{port}.{edge}``. Each downlink then carries the flows
  of exactly one destination and, by symmetry, each uplink an equal share, so uniform traffic (PS) loads
  every link at most as much as the server links.
* ``bcube`` — BCube's digit-correcting routing, levels corrected in the fixed order 0, 1, ..., k-1 and
  relayed by the intermediate servers. It commutes with digit-wise translation of addresses, so under
  uniform traffic every level-``l`` link carries the same load.
* ``switch`` — through the one switch.
* anything else — the fastest path by ``c_e`` (ties: fewest hops).
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

from gradsync.errors import PlanError
from gradsync.registry import Registry
from gradsync.topology.model import Topology

__all__ = ["ROUTERS", "Route", "router_for", "shortest_route"]

#: ``route(src_device, dst_device) -> device path`` (endpoints included).
Route = Callable[[str, str], tuple[str, ...]]
ROUTERS: Registry[Callable[[Topology], Route]] = Registry("routing family", PlanError)


def shortest_route(topology: Topology, src: str, dst: str) -> tuple[str, ...]:
    """Fastest path by ``c_e`` (ties: fewest hops)."""
    costs = topology.costs
    return tuple(nx.shortest_path(topology.graph, src, dst, weight=lambda u, v, d: costs[d["index"]] + 1e-9))


def router_for(topology: Topology) -> Route:
    """The family's policy when it has one, else :func:`shortest_route`; results are memoised."""
    family = topology.attrs.get("family")
    policy = ROUTERS.get(family)(topology) if family in ROUTERS else (lambda s, d: shortest_route(topology, s, d))
    cache: dict[tuple[str, str], tuple[str, ...]] = {}

    def route(src: str, dst: str) -> tuple[str, ...]:
        key = (src, dst)
        if key not in cache:
            cache[key] = policy(src, dst)
        return cache[key]

    return route


@ROUTERS.register("switch")
def _switch_router(topology: Topology) -> Route:
    """One switch: every flow goes host -> sw0 -> host (a generic search would scan all N hosts per route)."""
    return lambda src, dst: (src, "sw0", dst)


@ROUTERS.register("fattree")
def _fattree_router(topology: Topology) -> Route:
    from gradsync.topology.fattree import aggregation_switch_name, core_switch_name, edge_switch_name

    where = {d.name: (d.attrs["pod"], d.attrs["edge"], d.attrs["index"]) for d in topology.devices if d.kind == "host"}

    def route(src: str, dst: str) -> tuple[str, ...]:
        (p, e, _), (q, f, x) = where[src], where[dst]
        if (p, e) == (q, f):
            return (src, edge_switch_name(p, e), dst)
        up = (src, edge_switch_name(p, e), aggregation_switch_name(p, x))
        down = (aggregation_switch_name(q, x), edge_switch_name(q, f), dst)
        if p == q:
            return up + down[1:]
        return up + (core_switch_name(x, f),) + down

    return route


@ROUTERS.register("bcube")
def _bcube_router(topology: Topology) -> Route:
    from gradsync.topology.bcube import bcube_server_name, bcube_switch_name

    n, k = int(topology.attrs["n"]), int(topology.attrs["k"])
    digits = {d.name: tuple(d.attrs["digits"]) for d in topology.devices if d.kind == "host"}

    def route(src: str, dst: str) -> tuple[str, ...]:
        cur, goal = list(digits[src]), digits[dst]
        path = [src]
        for level in range(k):
            i = k - 1 - level  # digits are most significant first: v_level sits at index k-1-level
            if cur[i] != goal[i]:
                path.append(bcube_switch_name(level, tuple(cur), n))
                cur[i] = goal[i]
                path.append(bcube_server_name(tuple(cur), n))
        return tuple(path)

    return route
