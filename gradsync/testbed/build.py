"""Topology -> emulated network, as plain data (no root needed, so every decision here is unit-tested).

Mapping (derived from the :class:`~gradsync.topology.Topology` object, not from device names):

* every rank is a *server*: one network namespace ``gs-h{rank}``;
* every ``switch`` device is a Linux bridge ``gs-b{j}`` (STP off);
* a server-switch link is a NIC: a veth pair ``gs-nic{i}`` (inside the namespace) / ``gs-v{rank}-{i}``
  (root namespace, enslaved to the bridge); NICs are numbered in the order of the topology's links, so a
  BCube server's NIC ``l`` is its level-``l`` port;
* a server-server link (``ring:n``) is a cable: a 2-port bridge with one NIC on each server;
* a switch-switch link is a trunk: a veth pair ``gs-t{i}a``/``gs-t{i}b`` between two bridges. Bridges are
  L2 and STP is off, so switches joined by switch links form one flat L2 domain and only the links of a
  spanning tree of that domain are made (BFS from its centre); the others (a fat-tree's redundant
  uplinks) are listed in :attr:`TestbedPlan.dropped`. So ``fattree:k`` keeps its hosts, switches and
  per-link rates but not its multipath bisection bandwidth.

Address plan: each L2 domain or cable is one subnet ``10.213.<subnet>.0/24``, numbered in the order of
the topology's devices (a BCube level-``l`` switch ``j`` is subnet ``l * n**(k-1) + j``), and server
``rank`` is host ``rank + 1`` on every subnet it joins. A server's *primary* address (what it advertises
to torch.distributed, MASTER_ADDR for rank 0) is the address of its NIC 0.

Routing: servers on a common subnet talk directly over it. Others are relayed by servers (``ip_forward``
on in every multi-NIC namespace): each server gets ``/32`` host routes to every address it is not
directly connected to, via the next server on the path. The next hop follows BCube's routing when every
server carries BCube ``digits`` (correct the highest differing digit first, one hop per digit), else the
shortest path in the server graph (ties to the lower rank). Because routes are per address, traffic to a
neighbour's primary address leaves on the NIC of the level the two share.

Rates: the ``rate`` given is the rate of a unit link (the topology's ``unit_bandwidth_GBps``); a link of
``b`` GB/s gets ``rate * b / unit``. Every NIC and trunk is shaped in both directions.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx

from gradsync.testbed.errors import TestbedError
from gradsync.testbed.netns import DEFAULT_TCP_CC, PREFIX, TCP_CC
from gradsync.topology.model import Topology

__all__ = [
    "ADDRESS_PREFIX",
    "MAX_SERVERS",
    "MAX_SUBNETS",
    "Bridge",
    "Nic",
    "Route",
    "Server",
    "TCP_CC",
    "TestbedPlan",
    "Trunk",
    "build_plan",
    "parse_delay",
    "parse_rate",
    "sample_pairs",
]

#: First two octets of every testbed address: a private range unlikely to clash with real networks.
ADDRESS_PREFIX = "10.213"
#: Server ``rank`` is host ``rank + 1`` on a /24, so at most 253 servers (.254 stays free, .255 broadcast).
MAX_SERVERS = 253
#: One /24 per subnet in the third octet.
MAX_SUBNETS = 256
#: Linux interface names are at most 15 characters.
IFNAMSIZ = 15

_RATE_UNITS = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6}


def parse_rate(text: str | float | int) -> float:
    """``200mbit``, ``1gbit``, ``500kbit`` or a bare number of Mbit/s -> Mbit/s.

    ``mbps`` is refused: ``tc`` reads it as megaBYTES per second, a classic factor-8 mistake.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), "mbit"
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m[2].lower() not in {*_RATE_UNITS, ""}:
            raise TestbedError(f"cannot read rate {text!r}; write it as tc does, e.g. 200mbit, 1gbit or 500kbit")
        value, unit = float(m[1]), (m[2].lower() or "mbit")
    mbit = value * _RATE_UNITS[unit]
    if not 0.01 <= mbit <= 1e6:
        raise TestbedError(f"rate {text!r} is {mbit:g} Mbit/s; use something between 10kbit and 1tbit")
    return mbit


def parse_delay(text: str | float | int | None) -> float | None:
    """``5ms``, ``200us``, ``0.1s`` or a bare number of ms -> ms (``None``/0 = no delay)."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        ms = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s|)\s*", str(text))
        if not m:
            raise TestbedError(f"cannot read delay {text!r}; write e.g. 5ms, 200us or 0.1s")
        ms = float(m[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "": 1.0}[m[2]]
    if ms < 0 or ms > 10_000:
        raise TestbedError(f"delay {text!r} must be between 0 and 10s")
    return ms or None


@dataclass(frozen=True)
class Nic:
    """One server NIC: a veth pair from the namespace to a bridge, with one address."""

    rank: int
    index: int
    #: Name inside the server's namespace (``gs-nic0``): what GLOO_SOCKET_IFNAME names.
    ifname: str
    #: The other end, in the root namespace, enslaved to :attr:`bridge`.
    host_ifname: str
    bridge: str
    subnet: int
    address: str
    #: Topology device at the other end of the cable (a switch, or a server for a direct cable).
    peer: str
    rate_mbit: float

    @property
    def cidr(self) -> str:
        return f"{self.address}/24"


@dataclass(frozen=True)
class Route:
    """``ip route add DEST via VIA dev DEV`` inside a server's namespace."""

    dest: str
    via: str
    dev: str


@dataclass(frozen=True)
class Server:
    """One rank: a namespace, its NICs and its host routes."""

    rank: int
    device: str
    namespace: str
    nics: tuple[Nic, ...]
    routes: tuple[Route, ...] = ()
    #: Relays for others (``ip_forward=1``); true for every server with more than one NIC.
    forwarding: bool = False

    @property
    def address(self) -> str:
        """Primary address (NIC 0): what this server advertises to torch.distributed."""
        return self.nics[0].address

    @property
    def ifname(self) -> str:
        return self.nics[0].ifname


@dataclass(frozen=True)
class Bridge:
    """A switch (or a direct server-server cable) as a Linux bridge."""

    name: str
    #: Topology switch name, or ``"a|b"`` for a direct cable between servers ``a`` and ``b``.
    device: str
    subnet: int


@dataclass(frozen=True)
class Trunk:
    """A switch-switch link: a veth pair between two bridges, shaped in both directions."""

    a: str
    b: str
    a_ifname: str
    b_ifname: str
    rate_mbit: float
    link: tuple[str, str]


@dataclass(frozen=True)
class TestbedPlan:
    """Everything ``up`` makes, as plain data; it is also what the state file stores."""

    __test__ = False  # not a pytest test class

    topology: str
    rate_mbit: float
    delay_ms: float | None
    servers: tuple[Server, ...]
    bridges: tuple[Bridge, ...]
    trunks: tuple[Trunk, ...] = ()
    #: Switch-switch links left out so the flat L2 domain stays loop-free (STP is off).
    dropped: tuple[tuple[str, str], ...] = ()
    prefix: str = PREFIX
    #: TCP congestion control on every route of every server (:data:`TCP_CC`), or ``"host"``: the host's default
    tcp_cc: str = DEFAULT_TCP_CC
    #: ``net.ipv4.tcp_slow_start_after_idle`` in every namespace: True (Linux's default) restarts a connection's
    #: congestion window after it idles one RTO; False keeps it, as clusters tuned for training set it
    idle_restart: bool = True
    #: NICs whose link is cut, ``(rank, nic index)`` (:func:`gradsync.testbed.control.set_link`): they carry
    #: nothing, and :meth:`routes` go around them as a fabric's routing converges after a failure
    cut: tuple[tuple[int, int], ...] = ()
    _by_address: dict[str, Nic] = field(default_factory=dict, init=False, repr=False, compare=False)
    _routes: dict[int, tuple[Route, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for s in self.servers:
            for nic in s.nics:
                self._by_address[nic.address] = nic
        for rank, index in self.cut:
            if not 0 <= rank < len(self.servers) or not 0 <= index < len(self.servers[rank].nics):
                raise TestbedError(f"cut NIC ({rank}, {index}) is not a NIC of this testbed")
        self._routes.update(_reroute(self) if self.cut else {s.rank: s.routes for s in self.servers})

    # ---- lookups ------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.servers)

    @property
    def namespaces(self) -> list[str]:
        return [s.namespace for s in self.servers]

    @property
    def master_addr(self) -> str:
        return self.servers[0].address

    def server(self, rank: int) -> Server:
        if not isinstance(rank, int) or not 0 <= rank < len(self.servers):
            raise TestbedError(f"rank {rank!r} is out of range; this testbed has ranks 0..{len(self.servers) - 1}")
        return self.servers[rank]

    def owner(self, address: str) -> Nic:
        """The NIC that holds ``address``."""
        try:
            return self._by_address[address]
        except KeyError:
            raise TestbedError(f"no server of this testbed has address {address}") from None

    def routes(self, rank: int) -> tuple[Route, ...]:
        """Server ``rank``'s host routes as they are now: :attr:`Server.routes` as built, or, with NICs
        :attr:`cut`, those of the paths that crossed one replaced by a path around it."""
        self.server(rank)
        return self._routes[rank]

    def hops(self, src: int, dst: int) -> list[tuple[Nic, Nic]]:
        """(sending NIC, receiving NIC) per server-to-server hop from ``src`` to ``dst``'s primary address."""
        return self.walk(src, self.server(dst).address)

    def walk(self, src: int, target: str, routes: dict[int, tuple[Route, ...]] | None = None) -> list[tuple[Nic, Nic]]:
        """(sending NIC, receiving NIC) per hop from server ``src`` to the address ``target``, walking ``routes``
        (default :meth:`routes`) as the kernel does: the longest prefix, so a ``/32`` route before the subnet
        the server shares with the target."""
        table = self._routes if routes is None else routes
        dst = self.owner(target).rank
        subnet = self.owner(target).subnet
        here = self.server(src)
        out: list[tuple[Nic, Nic]] = []
        while here.rank != dst:
            if len(out) > len(self.servers):
                raise TestbedError(f"routes from rank {src} to {target} (rank {dst}) loop; this is a bug in the plan")
            route = next((r for r in table[here.rank] if r.dest == f"{target}/32"), None)
            if route is None:
                direct = [n for n in here.nics if n.subnet == subnet]
                if not direct:
                    raise TestbedError(f"rank {here.rank} has no route to {target} (rank {dst}); this is a bug in "
                                       f"the plan")
                out.append((direct[0], self.owner(target)))
                break
            nic = next(n for n in here.nics if n.ifname == route.dev)
            nxt = self.owner(route.via)
            out.append((nic, nxt))
            here = self.server(nxt.rank)
        return out

    def path(self, src: int, dst: int) -> list[int]:
        """Ranks a packet from ``src`` to ``dst`` visits, both ends included (relays in between)."""
        return [src] + [b.rank for _, b in self.hops(src, dst)]

    def expected_mbit(self, src: int, dst: int) -> float:
        """The bottleneck rate from ``src`` to ``dst``: min over the NICs and trunks on the path."""
        rates: list[float] = []
        tree = self._trunk_graph()
        for a, b in self.hops(src, dst):
            rates += [a.rate_mbit, b.rate_mbit]
            if a.bridge != b.bridge:
                walk = nx.shortest_path(tree, a.bridge, b.bridge)
                rates += [tree.edges[u, v]["rate"] for u, v in zip(walk[:-1], walk[1:])]
        return min(rates) if rates else float("inf")

    def _trunk_graph(self) -> nx.Graph:
        g = nx.Graph()
        g.add_nodes_from(b.name for b in self.bridges)
        for t in self.trunks:
            g.add_edge(t.a, t.b, rate=t.rate_mbit)
        return g

    def neighbours(self, rank: int) -> list[int]:
        """Servers sharing a subnet with ``rank`` (one hop, no relay)."""
        mine = {n.subnet for n in self.server(rank).nics}
        return sorted({s.rank for s in self.servers if s.rank != rank and mine & {n.subnet for n in s.nics}})

    def interface_names(self) -> list[str]:
        """Root-namespace interfaces this plan creates (bridges, veth ends, trunks)."""
        names = [b.name for b in self.bridges]
        names += [n.host_ifname for s in self.servers for n in s.nics]
        names += [x for t in self.trunks for x in (t.a_ifname, t.b_ifname)]
        return names

    # ---- plain data ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the state file): also a flat ``ranks`` view for programs that discover the testbed."""
        return {
            "type": "gradsync.testbed",
            "version": 1,
            "topology": self.topology,
            "prefix": self.prefix,
            "rate_mbit": self.rate_mbit,
            "delay_ms": self.delay_ms,
            "tcp_cc": self.tcp_cc,
            "tcp_idle_restart": self.idle_restart,
            "address_plan": f"{ADDRESS_PREFIX}.<subnet>.<rank+1>/24",
            "master_addr": self.master_addr,
            "namespaces": self.namespaces,
            "ranks": {
                str(s.rank): {
                    "device": s.device, "namespace": s.namespace, "address": s.address, "ifname": s.ifname,
                    "nics": {n.ifname: n.address for n in s.nics},
                }
                for s in self.servers
            },
            "servers": [
                {**{k: v for k, v in asdict(s).items() if k not in {"nics", "routes"}},
                 "nics": [asdict(n) for n in s.nics], "routes": [asdict(r) for r in s.routes]}
                for s in self.servers
            ],
            "bridges": [asdict(b) for b in self.bridges],
            "trunks": [asdict(t) for t in self.trunks],
            "dropped": [list(d) for d in self.dropped],
            "cut": [list(c) for c in self.cut],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TestbedPlan:
        if not isinstance(data, dict) or data.get("type") != "gradsync.testbed":
            raise TestbedError("not a gradsync testbed state file (missing type 'gradsync.testbed')")
        try:
            servers = tuple(
                Server(
                    rank=s["rank"], device=s["device"], namespace=s["namespace"],
                    nics=tuple(Nic(**n) for n in s["nics"]), routes=tuple(Route(**r) for r in s["routes"]),
                    forwarding=s["forwarding"],
                )
                for s in data["servers"]
            )
            return cls(
                topology=data["topology"], rate_mbit=data["rate_mbit"], delay_ms=data["delay_ms"],
                servers=servers, bridges=tuple(Bridge(**b) for b in data["bridges"]),
                trunks=tuple(Trunk(**{**t, "link": tuple(t["link"])}) for t in data["trunks"]),
                dropped=tuple(tuple(d) for d in data["dropped"]), prefix=data.get("prefix", PREFIX),
                tcp_cc=data.get("tcp_cc", "host"),  # states written before the choice existed kept the host's
                idle_restart=bool(data.get("tcp_idle_restart", True)),  # ... and Linux's idle restart
                cut=tuple((int(r), int(i)) for r, i in data.get("cut", ())),
            )
        except (KeyError, TypeError) as exc:
            raise TestbedError(f"testbed state is incomplete or from another version ({exc!r}); "
                               f"run 'gradsync testbed down' and bring it up again") from None


# ---- building -----------------------------------------------------------------------------------------
def _check_name(name: str) -> str:
    if len(name) > IFNAMSIZ:
        raise TestbedError(f"interface name {name!r} is longer than {IFNAMSIZ} characters; use a smaller topology")
    return name


def _spanning_tree(g: nx.Graph, order: dict[str, int]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """BFS tree from the component's centre (first in device order): (kept edges, dropped edges)."""
    kept: list[tuple[str, str]] = []
    root = min(nx.center(g), key=order.__getitem__)
    seen = {root}
    queue = deque([root])
    while queue:
        u = queue.popleft()
        for v in sorted(g.neighbors(u), key=order.__getitem__):
            if v not in seen:
                seen.add(v)
                kept.append((u, v))
                queue.append(v)
    kept_keys = {frozenset(e) for e in kept}
    dropped = [(u, v) for u, v in g.edges if frozenset((u, v)) not in kept_keys]
    return kept, dropped


def _digit_routing(topo: Topology, subnets_of: dict[int, set[int]]) -> list[tuple[int, ...]] | None:
    """BCube digits per rank when every server has them and every one-digit neighbour shares a subnet."""
    digits: list[tuple[int, ...]] = []
    for name in topo.ranks:
        d = topo.device(name).attrs.get("digits")
        if not isinstance(d, (list, tuple)) or not d:
            return None
        digits.append(tuple(int(x) for x in d))
    if len({len(d) for d in digits}) != 1 or len(set(digits)) != len(digits):
        return None
    index = {d: r for r, d in enumerate(digits)}
    for r, d in enumerate(digits):
        for pos in range(len(d)):
            for other, o in index.items():
                if o != r and sum(x != y for x, y in zip(d, other)) == 1 and other[pos] != d[pos]:
                    if not subnets_of[r] & subnets_of[o]:
                        return None
    return digits


def _next_hops(n: int, subnets_of: dict[int, set[int]], digits: list[tuple[int, ...]] | None) -> list[list[int]]:
    """``nh[dst][src]``: the server ``src`` hands a packet for ``dst`` to (``dst`` itself when adjacent)."""
    adj = {u: sorted(v for v in range(n) if v != u and subnets_of[u] & subnets_of[v]) for u in range(n)}
    nh = [[-1] * n for _ in range(n)]
    if digits is not None:
        index = {d: r for r, d in enumerate(digits)}
        for dst in range(n):
            for src in range(n):
                if src == dst:
                    continue
                d = list(digits[src])
                pos = next(i for i, (x, y) in enumerate(zip(d, digits[dst])) if x != y)  # highest level first
                d[pos] = digits[dst][pos]
                nh[dst][src] = index[tuple(d)]
        return nh
    for dst in range(n):
        nh[dst][dst] = dst
        queue = deque([dst])
        while queue:
            u = queue.popleft()
            for v in adj[u]:
                if nh[dst][v] == -1:
                    nh[dst][v] = u
                    queue.append(v)
        missing = [v for v in range(n) if nh[dst][v] == -1]
        if missing:
            raise TestbedError(f"servers {missing} cannot reach server {dst} through servers and switches; "
                               f"the testbed needs every rank reachable without non-rank compute devices")
    return nh


def _reroute(plan: TestbedPlan) -> dict[int, tuple[Route, ...]]:
    """Every server's routes with :attr:`TestbedPlan.cut` NICs carrying nothing, as a fabric's routing converges
    after a failure: a route whose path (as built) crosses no cut NIC stays; each other one goes to the next server
    on a shortest path around the cut NICs (ties to the lower rank), arriving on any live NIC of the target's server
    (its addresses are local on every NIC). Loop-free: a kept route's path is kept hop by hop, and a new one brings
    the packet a hop nearer its server on the surviving graph. A server the cut leaves unreachable: TestbedError."""
    cut = set(plan.cut)
    n = plan.world_size
    live = {s.rank: {x.subnet: x for x in s.nics if (s.rank, x.index) not in cut} for s in plan.servers}
    adj = {u: sorted(v for v in range(n) if v != u and live[u].keys() & live[v].keys()) for u in range(n)}
    built = {s.rank: s.routes for s in plan.servers}
    out: dict[int, tuple[Route, ...]] = {}
    towards: dict[int, list[int]] = {}
    for dst in range(n):  # BFS distances to dst on the surviving server graph
        dist = [-1] * n
        dist[dst] = 0
        queue = deque([dst])
        while queue:
            u = queue.popleft()
            for v in adj[u]:
                if dist[v] < 0:
                    dist[v] = dist[u] + 1
                    queue.append(v)
        towards[dst] = dist
    for src in plan.servers:
        routes: list[Route] = []
        for dst in plan.servers:
            if dst.rank == src.rank:
                continue
            dist = towards[dst.rank]
            for target in dst.nics:
                path = plan.walk(src.rank, target.address, built)
                if not any((a.rank, a.index) in cut or (b.rank, b.index) in cut for a, b in path):
                    routes += [r for r in built[src.rank] if r.dest == f"{target.address}/32"]
                    continue
                if dist[src.rank] < 0:
                    raise TestbedError(f"cutting NICs {sorted(cut)} leaves rank {src.rank} without a path to rank "
                                       f"{dst.rank}: no route around them")
                hop = min(v for v in adj[src.rank] if dist[v] == dist[src.rank] - 1)
                shared = min(live[src.rank].keys() & live[hop].keys())
                routes.append(Route(f"{target.address}/32", live[hop][shared].address, live[src.rank][shared].ifname))
        out[src.rank] = tuple(routes)
    return out


def build_plan(topology: Topology, rate: str | float = "200mbit", delay: str | float | None = None,
               prefix: str = PREFIX, tcp_cc: str = DEFAULT_TCP_CC, idle_restart: bool = True) -> TestbedPlan:
    """Turn a topology into namespaces, bridges, veths, addresses and routes (see the module docstring)."""
    rate_mbit = parse_rate(rate)
    delay_ms = parse_delay(delay)
    if tcp_cc not in TCP_CC:
        raise TestbedError(f"tcp_cc={tcp_cc!r}: choose one of {', '.join(TCP_CC)} (cubic is Linux's default; "
                           f"'host' keeps whatever this host's net.ipv4.tcp_congestion_control says)")
    if not isinstance(idle_restart, bool):
        raise TestbedError(f"idle_restart={idle_restart!r} must be True (Linux's default: slow start again after "
                           f"an idle RTO) or False (keep the window, net.ipv4.tcp_slow_start_after_idle=0)")
    topo = topology
    n = len(topo.ranks)
    if n > MAX_SERVERS:
        raise TestbedError(f"topology {topo.name!r} has {n} ranks; the testbed's address plan allows {MAX_SERVERS}")
    if not topo.symmetric:
        lk = next(lk for lk in topo.links if not lk.symmetric)
        raise TestbedError(f"topology {topo.name!r}: link {lk.a}-{lk.b} has different bandwidths per direction "
                           f"({lk.directed_GBps[0]:g}/{lk.directed_GBps[1]:g} GB/s); the testbed shapes both "
                           f"directions alike, so give it bandwidth_GBps")
    rank_of = topo.rank_index
    order = topo.device_index
    switches = [d.name for d in topo.devices if d.kind == "switch"]
    is_switch = set(switches)
    unit = float(topo.unit_bandwidth_GBps or 1.0)

    for lk in topo.links:
        for end in (lk.a, lk.b):
            if end not in rank_of and end not in is_switch:
                kind = topo.device(end).kind
                raise TestbedError(
                    f"topology {topo.name!r}: device {end!r} ({kind}) is neither a rank nor a switch; the testbed "
                    f"emulates servers (ranks) joined by switches or direct cables, e.g. switch:N, bcube:n,k, "
                    f"fattree:k or ring:n"
                )

    # L2 domains: switches joined by switch-switch links; each domain is one bridge tree and one subnet.
    sw_graph = nx.Graph()
    sw_graph.add_nodes_from(switches)
    sw_links = {}
    for lk in topo.links:
        if lk.a in is_switch and lk.b in is_switch:
            sw_graph.add_edge(lk.a, lk.b)
            sw_links[frozenset((lk.a, lk.b))] = lk
    domains = sorted((sorted(c, key=order.__getitem__) for c in nx.connected_components(sw_graph)),
                     key=lambda c: order[c[0]])
    subnet_of_switch: dict[str, int] = {}
    for i, comp in enumerate(domains):
        for sw in comp:
            subnet_of_switch[sw] = i
    bridges: list[Bridge] = []
    bridge_of: dict[str, str] = {}
    for sw in switches:
        name = _check_name(f"{prefix}b{len(bridges)}")
        bridges.append(Bridge(name, sw, subnet_of_switch[sw]))
        bridge_of[sw] = name
    trunks: list[Trunk] = []
    dropped: list[tuple[str, str]] = []
    for comp in domains:
        if len(comp) < 2:
            continue
        kept, drop = _spanning_tree(sw_graph.subgraph(comp), order)
        dropped += drop
        for u, v in kept:
            lk = sw_links[frozenset((u, v))]
            i = len(trunks)
            trunks.append(Trunk(bridge_of[u], bridge_of[v], _check_name(f"{prefix}t{i}a"), _check_name(f"{prefix}t{i}b"),
                                rate_mbit * lk.bandwidth_GBps / unit, (u, v)))

    # Direct server-server cables: a 2-port bridge and a subnet each.
    next_subnet = len(domains)
    cable_bridge: dict[frozenset[str], Bridge] = {}
    for lk in topo.links:
        if lk.a in rank_of and lk.b in rank_of:
            br = Bridge(_check_name(f"{prefix}b{len(bridges)}"), f"{lk.a}|{lk.b}", next_subnet)
            next_subnet += 1
            bridges.append(br)
            cable_bridge[lk.key] = br
    if next_subnet > MAX_SUBNETS:
        raise TestbedError(f"topology {topo.name!r} needs {next_subnet} subnets; the address plan allows {MAX_SUBNETS}")

    # NICs, in the order of the topology's links.
    nics: dict[int, list[Nic]] = {r: [] for r in range(n)}
    for lk in topo.links:
        for me, other in ((lk.a, lk.b), (lk.b, lk.a)):
            if me not in rank_of:
                continue
            r = rank_of[me]
            br = cable_bridge.get(lk.key) if other in rank_of else next(b for b in bridges if b.device == other)
            assert br is not None
            i = len(nics[r])
            if any(x.subnet == br.subnet for x in nics[r]):
                raise TestbedError(
                    f"topology {topo.name!r}: server {me!r} has two links into one switched network (subnet "
                    f"{br.subnet}); the testbed gives each server one NIC per subnet"
                )
            nics[r].append(Nic(
                rank=r, index=i, ifname=_check_name(f"{prefix}nic{i}"), host_ifname=_check_name(f"{prefix}v{r}-{i}"),
                bridge=br.name, subnet=br.subnet, address=f"{ADDRESS_PREFIX}.{br.subnet}.{r + 1}", peer=other,
                rate_mbit=rate_mbit * lk.bandwidth_GBps / unit,
            ))
    for r in range(n):
        if not nics[r]:
            raise TestbedError(f"rank {r} ({topo.ranks[r]!r}) of {topo.name!r} has no network link to emulate")

    subnets_of = {r: {x.subnet for x in nics[r]} for r in range(n)}
    nh = _next_hops(n, subnets_of, _digit_routing(topo, subnets_of))
    servers = []
    for src in range(n):
        routes: list[Route] = []
        for dst in range(n):
            if dst == src:
                continue
            hop = nh[dst][src]
            shared = min(subnets_of[src] & subnets_of[hop])
            out = next(x for x in nics[src] if x.subnet == shared)
            via = next(x for x in nics[hop] if x.subnet == shared)
            for target in nics[dst]:
                if target.subnet not in subnets_of[src]:
                    routes.append(Route(f"{target.address}/32", via.address, out.ifname))
        servers.append(Server(src, topo.ranks[src], f"{prefix}h{src}", tuple(nics[src]), tuple(routes),
                              forwarding=len(nics[src]) > 1))
    return TestbedPlan(topo.name, rate_mbit, delay_ms, tuple(servers), tuple(bridges), tuple(trunks),
                       tuple(dropped), prefix, tcp_cc, idle_restart)


def sample_pairs(plan: TestbedPlan, limit: int = 16) -> list[tuple[int, int]]:
    """Every unordered pair of servers, or for big testbeds ``limit`` of them (a fixed, reproducible sample
    that keeps neighbours and relayed pairs in the mix)."""
    pairs = [(a, b) for a in range(plan.world_size) for b in range(a + 1, plan.world_size)]
    if len(pairs) <= limit:
        return pairs
    near = [p for p in pairs if p[1] in plan.neighbours(p[0])]
    far = [p for p in pairs if p[1] not in plan.neighbours(p[0])]
    step_n = max(1, len(near) // (limit // 2 or 1))
    picked = near[::step_n][: limit // 2]
    step_f = max(1, len(far) // max(1, limit - len(picked)))
    picked += far[::step_f][: limit - len(picked)]
    return sorted(picked)
