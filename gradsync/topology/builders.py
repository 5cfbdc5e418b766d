"""Named topology factories (msccl-style: each result names itself, e.g. ``ring:8``).

``BUILDERS`` is the registry the CLI lists. A spec string is ``name``, ``name:arg,arg`` or either followed
by a rank selection ``[i,j,...]``; :func:`gradsync.topology.get_topology` parses it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from gradsync.errors import TopologyError
from gradsync.registry import Registry
from gradsync.topology.model import Device, Link, Topology

__all__ = ["BUILDERS", "Builder", "DGX1_NVLINKS", "NVLINK_GBPS", "PCIE3_X16_GBPS", "builder"]

#: NVIDIA DGX-1 (V100) NVLink count between GPU i and GPU j; also AWS p3.16xlarge.
DGX1_NVLINKS: tuple[tuple[int, ...], ...] = (
    (0, 2, 1, 1, 2, 0, 0, 0),
    (2, 0, 1, 2, 0, 1, 0, 0),
    (1, 1, 0, 2, 0, 0, 2, 0),
    (1, 2, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 2, 1, 1),
    (0, 1, 0, 0, 2, 0, 1, 2),
    (0, 0, 2, 0, 1, 1, 0, 2),
    (0, 0, 0, 1, 1, 2, 2, 0),
)
#: NVLink 2.0 bandwidth per link per direction.
NVLINK_GBPS = 25.0
#: 16-lane PCIe 3.0, per direction.
PCIE3_X16_GBPS = 12.0
#: P100 NVLink 1.0 (Minsky): two links of 20 GB/s between each pair in a socket's 3-clique.
MINSKY_NVLINK_GBPS = 40.0
#: POWER8 X-bus between the two sockets of a Minsky node.
MINSKY_XBUS_GBPS = 38.4
#: InfiniBand EDR (CX5, 100 Gbit/s) per node.
MINSKY_IB_GBPS = 12.5
#: Default per-host network link of ``switch:n`` (10 Gbit/s Ethernet).
ETHERNET_10G_GBPS = 1.25


@dataclass(frozen=True)
class Builder:
    """A named factory; ``params`` are its positional integer arguments."""

    name: str
    fn: Callable[..., Topology]
    summary: str
    params: tuple[str, ...]
    example: str

    def build(self, args: tuple[int, ...]) -> Topology:
        if len(args) != len(self.params):
            want = f"{self.name}:{','.join(self.params)}" if self.params else self.name
            raise TopologyError(
                f"topology {self.name!r} takes {len(self.params)} argument(s) ({want}), got {len(args)}; "
                f"for example {self.example!r}"
            )
        return self.fn(*args)


BUILDERS: Registry[Builder] = Registry("topology", TopologyError)


def builder(name: str, *, aliases: tuple[str, ...] = (), example: str | None = None) -> Callable:
    """Register a factory; its docstring's first line becomes the summary shown by ``gradsync topo list``."""

    def deco(fn: Callable[..., Topology]) -> Callable[..., Topology]:
        params = tuple(inspect.signature(fn).parameters)
        summary = (fn.__doc__ or "").strip().splitlines()[0]
        ex = example or (f"{name}:{','.join('4' for _ in params)}" if params else name)
        BUILDERS.add(name, Builder(name, fn, summary, params, ex), aliases=aliases)
        return fn

    return deco


def _need(name: str, value: int, minimum: int, what: str) -> None:
    if value < minimum:
        raise TopologyError(f"{name} needs {what} >= {minimum}, got {value}")


# ---- switch-free graphs ------------------------------------------------------------------------------
@builder("ring", example="ring:8")
def ring(n: int) -> Topology:
    """n GPUs in a cycle, one 25 GB/s link between neighbours."""
    _need("ring", n, 2, "n")
    devs = tuple(Device(f"gpu{i}", "gpu") for i in range(n))
    pairs = [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, 1)]
    links = tuple(Link(f"gpu{i}", f"gpu{j}", NVLINK_GBPS, kind="link") for i, j in pairs)
    return Topology(f"ring:{n}", devs, links, unit_bandwidth_GBps=NVLINK_GBPS)


@builder("full", example="full:8")
def full(n: int) -> Topology:
    """n GPUs, every pair joined by one 25 GB/s link."""
    _need("full", n, 2, "n")
    devs = tuple(Device(f"gpu{i}", "gpu") for i in range(n))
    links = tuple(
        Link(f"gpu{i}", f"gpu{j}", NVLINK_GBPS, kind="link") for i in range(n) for j in range(i + 1, n)
    )
    return Topology(f"full:{n}", devs, links, unit_bandwidth_GBps=NVLINK_GBPS)


def _nvlink_box(name: str, gpus: list[int]) -> Topology:
    devs = tuple(Device(f"gpu{i}", "gpu") for i in range(len(gpus)))
    links = []
    for a, i in enumerate(gpus):
        for b, j in enumerate(gpus):
            if a < b and DGX1_NVLINKS[i][j]:
                links.append(Link(f"gpu{a}", f"gpu{b}", DGX1_NVLINKS[i][j] * NVLINK_GBPS, kind="nvlink"))
    return Topology(name, devs, tuple(links), unit_bandwidth_GBps=NVLINK_GBPS)


@builder("p3.16xlarge", aliases=("dgx1",))
def p3_16xlarge() -> Topology:
    """AWS p3.16xlarge / NVIDIA DGX-1 (V100): 8 GPUs, hybrid cube-mesh NVLink, 25 GB/s per NVLink."""
    return _nvlink_box("p3.16xlarge", list(range(8)))


@builder("p3.8xlarge")
def p3_8xlarge() -> Topology:
    """AWS p3.8xlarge: GPUs 0-3 of the DGX-1 NVLink mesh."""
    return _nvlink_box("p3.8xlarge", [0, 1, 2, 3])


# ---- PCIe trees (OMS §3, Fig. 2) -----------------------------------------------------------------
def _k80_box(name: str, boards_per_half: int, halves: int) -> Topology:
    """K80 boards (2 GPUs behind an on-board PLX) under central PLX switches joined by one link."""
    devs: list[Device] = []
    links: list[Link] = []
    centrals = [f"plx_c{h}" for h in range(halves)]
    devs += [Device(c, "switch", {"role": "central"}) for c in centrals]
    g = 0
    for h in range(halves):
        for b in range(boards_per_half):
            board = f"plx_b{h * boards_per_half + b}"
            devs.append(Device(board, "switch", {"role": "board"}))
            links.append(Link(board, centrals[h], PCIE3_X16_GBPS, kind="pcie-board"))
            for _ in range(2):
                devs.append(Device(f"gpu{g}", "gpu", {"board": board}))
                links.append(Link(f"gpu{g}", board, PCIE3_X16_GBPS, kind="pcie-card"))
                g += 1
    for h in range(halves - 1):
        links.append(Link(centrals[h], centrals[h + 1], PCIE3_X16_GBPS, kind="pcie-central"))
    gpus = tuple(f"gpu{i}" for i in range(g))
    # Devices in a readable order: GPUs first (rank order), then switches.
    devs.sort(key=lambda d: (d.kind != "gpu", 0))
    return Topology(name, tuple(devs), tuple(links), ranks=gpus, unit_bandwidth_GBps=PCIE3_X16_GBPS)


@builder("p2.16xlarge")
def p2_16xlarge() -> Topology:
    """AWS p2.16xlarge: 8 K80 boards (2 GPUs + PLX each), 4 per central PLX, one PCIe link between halves."""
    return _k80_box("p2.16xlarge", 4, 2)


@builder("p2.8xlarge")
def p2_8xlarge() -> Topology:
    """AWS p2.8xlarge: one half of p2.16xlarge (4 K80 boards under one central PLX)."""
    return _k80_box("p2.8xlarge", 4, 1)


# ---- networks ------------------------------------------------------------------------------------------
@builder("switch", example="switch:9")
def switch(n: int) -> Topology:
    """n hosts on one non-blocking switch, 10 Gbit/s (1.25 GB/s) per host link."""
    _need("switch", n, 1, "n")
    devs = [Device(f"host{i}", "host") for i in range(n)] + [Device("sw0", "switch")]
    links = tuple(Link(f"host{i}", "sw0", ETHERNET_10G_GBPS, kind="network") for i in range(n))
    return Topology(f"switch:{n}", tuple(devs), links, unit_bandwidth_GBps=ETHERNET_10G_GBPS, attrs={"family": "switch"})


@builder("racks", example="racks:2,3,4")
def racks(r: int, s: int, o: int) -> Topology:
    """r racks of s hosts, 10 Gbit/s host links to a rack switch, each rack one uplink at 1/o of that to a core.

    The two-tier cluster where topology matters most: a rank-order ring crosses every uplink with
    ``2 (N-1)/N`` of the buffer per direction, a plan that reduces inside racks first crosses it once.
    Hosts are ranked rack by rack (``host0..host{s-1}`` in rack 0), as a scheduler places them.
    """
    _need("racks", r, 1, "r (racks)")
    _need("racks", s, 1, "s (hosts per rack)")
    _need("racks", o, 1, "o (host rate / uplink rate)")
    devs = [Device(f"host{i * s + j}", "host", {"rack": i, "index": j}) for i in range(r) for j in range(s)]
    devs += [Device(f"tor{i}", "switch") for i in range(r)]
    links = [Link(f"host{i * s + j}", f"tor{i}", ETHERNET_10G_GBPS, kind="network") for i in range(r) for j in range(s)]
    if r > 1:
        devs.append(Device("core", "switch"))
        links += [Link(f"tor{i}", "core", ETHERNET_10G_GBPS / o, kind="uplink") for i in range(r)]
    return Topology(f"racks:{r},{s},{o}", tuple(devs), tuple(links), unit_bandwidth_GBps=ETHERNET_10G_GBPS,
                    attrs={"family": "racks", "racks": r, "hosts_per_rack": s, "oversubscription": o})


@builder("minsky", example="minsky:2")
def minsky(m: int) -> Topology:
    """m IBM Minsky nodes: per socket a CPU and 2 P100s in an NVLink 3-clique; X-bus between sockets; IB between nodes.

    As in MXNET-MPI §6.1/Fig. 10 the network reaches host memory, not the GPUs: each node's NIC hangs off
    socket 0's CPU and all NICs share one InfiniBand switch. The GPUs are the ranks; CPUs relay.
    """
    _need("minsky", m, 1, "m (nodes)")
    devs: list[Device] = []
    links: list[Link] = []
    ranks: list[str] = []
    for node in range(m):
        cpus = []
        for s in range(2):
            cpu = f"n{node}.cpu{s}"
            cpus.append(cpu)
            devs.append(Device(cpu, "cpu", {"node": node, "socket": s}))
            gpus = [f"n{node}.gpu{2 * s + j}" for j in range(2)]
            for gname in gpus:
                devs.append(Device(gname, "gpu", {"node": node, "socket": s}))
                links.append(Link(cpu, gname, MINSKY_NVLINK_GBPS, kind="nvlink-cpu"))
                ranks.append(gname)
            links.append(Link(gpus[0], gpus[1], MINSKY_NVLINK_GBPS, kind="nvlink-gpu"))
        links.append(Link(cpus[0], cpus[1], MINSKY_XBUS_GBPS, kind="xbus"))
        if m > 1:
            nic = f"n{node}.nic0"
            devs.append(Device(nic, "nic", {"node": node}))
            links.append(Link(cpus[0], nic, 16.0, kind="pcie-nic"))
            links.append(Link(nic, "ib0", MINSKY_IB_GBPS, kind="network"))
    if m > 1:
        devs.append(Device("ib0", "switch"))
    unit = MINSKY_IB_GBPS if m > 1 else MINSKY_XBUS_GBPS
    return Topology(f"minsky:{m}", tuple(devs), tuple(links), ranks=tuple(ranks), unit_bandwidth_GBps=unit)
