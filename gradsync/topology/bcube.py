"""BCube(n, k): the server-centric network BML runs on (§3.1, Fig. 3).

BCube(n, k) has ``N = n**k`` servers and ``k`` levels of n-port switches, ``n**(k-1)`` switches per level.
A server is named by its address ``[v_{k-1}, ..., v_1, v_0]`` (digits ``v_i`` in ``[0, n)``); at level ``l``
it connects to the switch whose ID is its address with digit ``v_l`` removed, so the ``n`` servers under
one level-``l`` switch differ only in digit ``l`` (BML's 1-hop neighbours ``N_l(a)``). Switches are
never joined to each other: a path between servers that differ in ``q`` digits crosses ``q`` switches and
``q - 1`` relaying servers.

Modelling choices:

* Each server has ``k`` NICs, one per level. NICs are not separate devices: a server is linked straight to
  its level-``l`` switch by a link of kind ``level{l}`` (the NIC's port), so ``counts()["links"] == k * N``
  is also the NIC count. Servers are ``host`` devices, so routes may relay through them.
* Names: server ``s`` + digits ``v_{k-1} ... v_0`` (``s12`` is ``[1, 2]``); when ``n > 10`` a digit can
  have two characters, so the digits are joined by dots (``s31.0`` in BCube(32, 2)). Level-``l`` switch
  ``j`` is ``L{l}.sw{j}``, where ``j`` is the integer whose base-``n`` digits are the address without
  digit ``l``.
* Rank ``r`` is the server whose address is the base-``n`` digits of ``r`` (``s12`` is rank 5 in BCube(3, 2)).
* Every link runs at 10 Gbit/s (1.25 GB/s) per direction, also the cost unit: cost 1 = one T_F.

``attrs`` hold ``family="bcube"``, ``n``, ``k``, the server/switch/NIC counts and, per server, its
``digits`` ``[v_{k-1}, ..., v_0]`` (a list, so the topology round-trips through JSON and YAML).
"""

from __future__ import annotations

from gradsync.errors import TopologyError
from gradsync.topology.builders import ETHERNET_10G_GBPS, builder
from gradsync.topology.model import Device, Link, Topology

__all__ = [
    "MAX_BCUBE_SERVERS",
    "bcube",
    "bcube_digits",
    "bcube_server_name",
    "bcube_switch_index",
    "bcube_switch_name",
]

#: Refuse to build more servers than this: the planner's schedules grow as k * N**2 transfers.
MAX_BCUBE_SERVERS = 1 << 16


def bcube_digits(index: int, n: int, k: int) -> tuple[int, ...]:
    """Address ``(v_{k-1}, ..., v_0)`` of the server with rank ``index``: its base-``n`` digits, most significant first."""
    out = []
    for _ in range(k):
        index, d = divmod(index, n)
        out.append(d)
    return tuple(reversed(out))


def bcube_server_name(digits: tuple[int, ...], n: int) -> str:
    """``s12`` for ``[1, 2]``; dot-separated digits when ``n > 10`` so names stay unambiguous."""
    sep = "." if n > 10 else ""
    return "s" + sep.join(str(d) for d in digits)


def bcube_switch_index(level: int, digits: tuple[int, ...], n: int) -> int:
    """Which level-``level`` switch a server uses: its address with digit ``v_level`` removed, read in base ``n``."""
    k = len(digits)
    j = 0
    for i, d in enumerate(digits):
        if i != k - 1 - level:  # digits[k-1-l] is v_l
            j = j * n + d
    return j


def bcube_switch_name(level: int, digits: tuple[int, ...], n: int) -> str:
    """``L{level}.sw{j}`` with ``j`` = :func:`bcube_switch_index`."""
    return f"L{level}.sw{bcube_switch_index(level, digits, n)}"


@builder("bcube", example="bcube:3,2")
def bcube(n: int, k: int) -> Topology:
    """BCube(n,k): n**k servers with k NICs each, k levels of n**(k-1) n-port switches, 10 Gbit/s links."""
    if n < 2:
        raise TopologyError(f"bcube needs n >= 2 switch ports, got n={n}; try bcube:3,2")
    if k < 1:
        raise TopologyError(f"bcube needs k >= 1 levels (NICs per server), got k={k}; try bcube:3,2")
    servers = n**k
    if servers > MAX_BCUBE_SERVERS:
        raise TopologyError(
            f"bcube:{n},{k} has n**k = {servers} servers, more than {MAX_BCUBE_SERVERS}; use a smaller n or k"
        )
    devices: list[Device] = []
    links: list[Link] = []
    ranks: list[str] = []
    switches: dict[str, Device] = {}
    for r in range(servers):
        digits = bcube_digits(r, n, k)
        name = bcube_server_name(digits, n)
        devices.append(Device(name, "host", {"digits": list(digits), "rank": r}))
        ranks.append(name)
        for level in range(k):
            sw = bcube_switch_name(level, digits, n)
            if sw not in switches:
                switches[sw] = Device(sw, "switch", {"level": level, "index": bcube_switch_index(level, digits, n)})
            links.append(Link(name, sw, ETHERNET_10G_GBPS, kind=f"level{level}"))
    devices += sorted(switches.values(), key=lambda d: (d.attrs["level"], d.attrs["index"]))
    attrs = {
        "family": "bcube",
        "n": n,
        "k": k,
        "servers": servers,
        "switches": k * n ** (k - 1),
        "nics": k * servers,
    }
    return Topology(
        f"bcube:{n},{k}", tuple(devices), tuple(links), ranks=tuple(ranks),
        unit_bandwidth_GBps=ETHERNET_10G_GBPS, attrs=attrs,
    )
