"""The classic 3-layer k-ary Fat-Tree (Al-Fares et al., SIGCOMM'08), BML's baseline network (§2, Fig. 2).

``fattree:k`` (k even) is built from k-port switches: ``k`` pods, each with ``k/2`` edge and ``k/2``
aggregation switches; every edge switch serves ``k/2`` servers and joins every aggregation switch of its
pod; aggregation switch ``a`` of every pod joins the ``k/2`` core switches ``core{a}.{j}``. So there are
``k**3/4`` servers, ``(k/2)**2`` core switches and ``5 k**2 / 4`` switches in all, i.e. ``5 N / k``: the
BML's "a Fat-Tree needs 5N/n switches" (§3.1), against BCube's ``k N / n``.

All links run at the same rate (10 Gbit/s, 1.25 GB/s per direction, also the cost unit), which with these
counts makes the network non-blocking (full bisection). Each server has one NIC, modelled as its single
link to the edge switch.

Names and attributes (all indices 0-based):

* server ``h{p}.{e}.{x}``: pod ``p``, edge switch ``e`` in the pod, port ``x`` on it; attrs ``pod``,
  ``edge``, ``index``. Rank ``p * (k/2)**2 + e * k/2 + x``, i.e. servers in (pod, edge, port) order.
* edge switch ``p{p}.edge{e}``, aggregation switch ``p{p}.agg{a}`` (attrs ``pod``, ``edge``/``agg``,
  ``layer``), core switch ``core{a}.{j}`` (attrs ``group`` = a, ``index`` = j, ``layer``).
* link kinds: ``host`` (server - edge), ``aggregation`` (edge - aggregation), ``core`` (aggregation - core).
"""

from __future__ import annotations

from gradsync.errors import TopologyError
from gradsync.topology.builders import ETHERNET_10G_GBPS, builder
from gradsync.topology.model import Device, Link, Topology

__all__ = [
    "MAX_FATTREE_K",
    "aggregation_switch_name",
    "core_switch_name",
    "edge_switch_name",
    "fattree",
    "fattree_server_name",
]

#: Largest k accepted: fattree:64 already has 65536 servers.
MAX_FATTREE_K = 64


def fattree_server_name(pod: int, edge: int, index: int) -> str:
    return f"h{pod}.{edge}.{index}"


def edge_switch_name(pod: int, edge: int) -> str:
    return f"p{pod}.edge{edge}"


def aggregation_switch_name(pod: int, agg: int) -> str:
    return f"p{pod}.agg{agg}"


def core_switch_name(group: int, index: int) -> str:
    """Core switch ``index`` of group ``group``: linked to aggregation switch ``group`` of every pod."""
    return f"core{group}.{index}"


@builder("fattree", example="fattree:4")
def fattree(k: int) -> Topology:
    """k-ary Fat-Tree: k pods of k/2 edge + k/2 aggregation switches, (k/2)**2 core, k**3/4 servers, one NIC each."""
    if k < 2 or k % 2:
        raise TopologyError(f"fattree needs an even k >= 2 (switch ports), got k={k}; try fattree:4")
    if k > MAX_FATTREE_K:
        raise TopologyError(f"fattree:{k} is too large (k**3/4 = {k**3 // 4} servers); use k <= {MAX_FATTREE_K}")
    half = k // 2
    servers: list[Device] = []
    switches: list[Device] = []
    links: list[Link] = []
    for p in range(k):
        for e in range(half):
            edge = edge_switch_name(p, e)
            switches.append(Device(edge, "switch", {"pod": p, "edge": e, "layer": "edge"}))
            for x in range(half):
                name = fattree_server_name(p, e, x)
                servers.append(Device(name, "host", {"pod": p, "edge": e, "index": x}))
                links.append(Link(name, edge, ETHERNET_10G_GBPS, kind="host"))
        for a in range(half):
            agg = aggregation_switch_name(p, a)
            switches.append(Device(agg, "switch", {"pod": p, "agg": a, "layer": "aggregation"}))
            for e in range(half):
                links.append(Link(edge_switch_name(p, e), agg, ETHERNET_10G_GBPS, kind="aggregation"))
            for j in range(half):
                links.append(Link(agg, core_switch_name(a, j), ETHERNET_10G_GBPS, kind="core"))
    for a in range(half):
        for j in range(half):
            switches.append(Device(core_switch_name(a, j), "switch", {"group": a, "index": j, "layer": "core"}))
    attrs = {
        "family": "fattree",
        "k": k,
        "pods": k,
        "servers": k**3 // 4,
        "switches": 5 * k * k // 4,
        "core_switches": half * half,
        "nics": k**3 // 4,
    }
    return Topology(
        f"fattree:{k}", tuple(servers + switches), tuple(links), ranks=tuple(d.name for d in servers),
        unit_bandwidth_GBps=ETHERNET_10G_GBPS, attrs=attrs,
    )
