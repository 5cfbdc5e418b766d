"""The topology model: devices, duplex links, and the ranks that hold data.

A topology is plain data (OMS §2-3, BML §3): compute devices that can aggregate (GPUs, CPUs,
hosts), forwarding devices that cannot (PCIe/PLX and network switches, NICs), and duplex links with a
bandwidth per direction and a latency. Two parallel physical links (two NVLinks) are one link with the
summed bandwidth, so a link is identified by its unordered pair of endpoints.

The *ranks* are the devices that hold a buffer and take part in a collective, in rank order: rank ``i``
runs on device ``ranks[i]``. Other compute devices (Minsky's CPUs) and all switches only forward.

Costs use OMS's units: ``c_e = unit_bandwidth / bandwidth_e``, the time to push the whole buffer
through link ``e`` once, measured in units of the time over one reference link.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import networkx as nx
import numpy as np

from gradsync.errors import TopologyError

__all__ = [
    "COMPUTE_KINDS",
    "FORWARD_KINDS",
    "DEVICE_KINDS",
    "Device",
    "Link",
    "Topology",
]

#: Devices that can hold a buffer and add into it.
COMPUTE_KINDS = frozenset({"gpu", "cpu", "host"})
#: Devices that only forward bytes: they neither aggregate nor replicate (OMS §3).
FORWARD_KINDS = frozenset({"switch", "nic"})
DEVICE_KINDS = COMPUTE_KINDS | FORWARD_KINDS
#: ``Topology.attrs`` key of the scales a runtime's belief put on links (``(a, b, a->b scale, b->a scale)`` each):
#: what a cost model with measured class rates applies after them (``gradsync.comm.watch.scaled_topology``).
LINK_SCALE = "link_scale"


def recorded_link_scales(topology: Topology) -> dict[tuple[str, str], tuple[float, float]]:
    """``attrs[LINK_SCALE]`` as ``{(a, b): (a->b scale, b->a scale)}`` (empty where no belief scaled a link)."""
    return {(a, b): (float(u), float(d)) for a, b, u, d in topology.attrs.get(LINK_SCALE, ())}


@dataclass(frozen=True)
class Device:
    """One node of the topology graph."""

    name: str
    kind: str = "gpu"
    #: Free-form labels a builder wants to keep (BCube digits, socket, board, ...).
    attrs: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"device name {self.name!r} must be a non-empty string")
        if self.kind not in DEVICE_KINDS:
            raise TopologyError(
                f"device {self.name!r} has kind {self.kind!r}; use one of {sorted(DEVICE_KINDS)}"
            )

    @property
    def can_aggregate(self) -> bool:
        return self.kind in COMPUTE_KINDS


@dataclass(frozen=True)
class Link:
    """A duplex link: ``bandwidth_GBps`` from ``a`` to ``b`` and, unless ``bandwidth_down_GBps`` says
    otherwise, from ``b`` to ``a`` too, at once; ``latency_s`` per message.

    Asymmetric links (PCIe up/down, an oversubscribed uplink, a direction degraded) set
    ``bandwidth_down_GBps``; the file format then names the directions ``bandwidth_up_GBps`` (``a -> b``)
    and ``bandwidth_down_GBps`` (``b -> a``). Both directions must be positive: a one-way link is refused.
    """

    a: str
    b: str
    bandwidth_GBps: float
    latency_s: float = 0.0
    #: Link class used to report utilisation (``nvlink``, ``pcie-card``, ``network``, ...).
    kind: str = "link"
    #: Bandwidth from ``b`` to ``a`` where it differs from ``bandwidth_GBps``; ``None``: symmetric.
    bandwidth_down_GBps: float | None = None

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise TopologyError(f"link {self.a}-{self.b} connects a device to itself; remove it")
        for label, bw in (("bandwidth_GBps", self.bandwidth_GBps), ("bandwidth_down_GBps", self.bandwidth_down_GBps)):
            if label == "bandwidth_down_GBps" and bw is None:
                continue
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
                direction = f" ({self.b} -> {self.a})" if label == "bandwidth_down_GBps" else ""
                raise TopologyError(
                    f"link {self.a}-{self.b} has {label}={bw!r}{direction}; it must be a positive number of GB/s "
                    f"(one-way links are not supported: give both directions a bandwidth)"
                )
        if self.bandwidth_down_GBps == self.bandwidth_GBps:
            object.__setattr__(self, "bandwidth_down_GBps", None)
        lat = self.latency_s
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not math.isfinite(lat) or lat < 0:
            raise TopologyError(
                f"link {self.a}-{self.b} has latency_s={lat!r}; it must be a number of seconds >= 0"
            )

    @property
    def directed_GBps(self) -> tuple[float, float]:
        """Bandwidths ``(a -> b, b -> a)``."""
        down = self.bandwidth_GBps if self.bandwidth_down_GBps is None else self.bandwidth_down_GBps
        return float(self.bandwidth_GBps), float(down)

    @property
    def symmetric(self) -> bool:
        return self.bandwidth_down_GBps is None

    def scaled(self, factor: float) -> Link:
        """The same link with both directions' bandwidth multiplied by ``factor``."""
        down = None if self.bandwidth_down_GBps is None else self.bandwidth_down_GBps * factor
        return replace(self, bandwidth_GBps=self.bandwidth_GBps * factor, bandwidth_down_GBps=down)

    @property
    def key(self) -> frozenset[str]:
        return frozenset((self.a, self.b))

    def other(self, name: str) -> str:
        return self.b if name == self.a else self.a


@dataclass(frozen=True)
class Topology:
    """Devices, links and ranks; validated on construction.

    ``ranks`` defaults to every GPU, or every compute device when there is no GPU.
    ``unit_bandwidth_GBps`` is the reference link of OMS's cost units; it defaults to the
    smallest link bandwidth.
    """

    name: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    ranks: tuple[str, ...] = ()
    unit_bandwidth_GBps: float | None = None
    #: Free-form facts about the topology (BCube n and k, switch counts, ...).
    attrs: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(self.links))
        names = [d.name for d in self.devices]
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise TopologyError(f"topology {self.name!r}: device name {n!r} appears twice; names must be unique")
            seen.add(n)
        pairs: set[frozenset[str]] = set()
        for link in self.links:
            for end in (link.a, link.b):
                if end not in seen:
                    raise TopologyError(
                        f"topology {self.name!r}: link {link.a}-{link.b} names unknown device {end!r}; "
                        f"declare it under devices"
                    )
            if link.key in pairs:
                raise TopologyError(
                    f"topology {self.name!r}: two links join {link.a} and {link.b}; "
                    f"merge them into one link with the summed bandwidth"
                )
            pairs.add(link.key)
        kinds = {d.name: d.kind for d in self.devices}
        if not self.ranks:
            gpus = tuple(d.name for d in self.devices if d.kind == "gpu")
            ranks = gpus or tuple(d.name for d in self.devices if d.kind in COMPUTE_KINDS)
            object.__setattr__(self, "ranks", ranks)
        else:
            object.__setattr__(self, "ranks", tuple(self.ranks))
        if not self.ranks:
            raise TopologyError(f"topology {self.name!r} has no compute device (gpu, cpu or host) to hold data")
        if len(set(self.ranks)) != len(self.ranks):
            raise TopologyError(f"topology {self.name!r}: a device is listed twice in ranks {list(self.ranks)}")
        for r in self.ranks:
            if r not in kinds:
                raise TopologyError(f"topology {self.name!r}: rank {r!r} is not a declared device")
            if kinds[r] not in COMPUTE_KINDS:
                raise TopologyError(
                    f"topology {self.name!r}: rank {r!r} is a {kinds[r]}, which cannot hold or add data; "
                    f"ranks must be gpu, cpu or host devices"
                )
        ub = self.unit_bandwidth_GBps
        if ub is None:
            ub = min((min(lk.directed_GBps) for lk in self.links), default=1.0)
            object.__setattr__(self, "unit_bandwidth_GBps", float(ub))
        elif isinstance(ub, bool) or not isinstance(ub, (int, float)) or not math.isfinite(ub) or ub <= 0:
            raise TopologyError(f"topology {self.name!r}: unit_bandwidth_GBps={ub!r} must be a positive number")
        self._check_connected()

    def _check_connected(self) -> None:
        g = self.graph
        comp = nx.node_connected_component(g, self.ranks[0])
        missing = [r for r in self.ranks if r not in comp]
        if missing:
            raise TopologyError(
                f"topology {self.name!r} is disconnected: ranks {missing} cannot reach {self.ranks[0]!r}; "
                f"add links so every rank is reachable"
            )

    # ---- derived views (computed once) -------------------------------------------------------------
    @cached_property
    def graph(self) -> nx.Graph:
        """Undirected networkx view; edge attribute ``index`` is the position in :attr:`links`."""
        g = nx.Graph()
        for d in self.devices:
            g.add_node(d.name, kind=d.kind)
        for i, lk in enumerate(self.links):
            g.add_edge(lk.a, lk.b, index=i, bandwidth=lk.bandwidth_GBps)
        return g

    @cached_property
    def device_index(self) -> dict[str, int]:
        return {d.name: i for i, d in enumerate(self.devices)}

    @cached_property
    def rank_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.ranks)}

    @cached_property
    def _link_lookup(self) -> dict[tuple[str, str], tuple[int, int]]:
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for i, lk in enumerate(self.links):
            out[(lk.a, lk.b)] = (i, 0)
            out[(lk.b, lk.a)] = (i, 1)
        return out

    @cached_property
    def costs(self) -> np.ndarray:
        """``c_e = unit_bandwidth / bandwidth_e`` for every link (OMS eq. 1 units).

        On an asymmetric link ``bandwidth_e`` is its slower direction: a tree edge reduces one way and
        broadcasts the other, so a tree schedule loads both directions alike and the slower one binds.
        """
        return self.directed_costs.max(axis=1) if self.links else np.zeros(0)

    @cached_property
    def directed_costs(self) -> np.ndarray:
        """``(links, 2)`` costs of each direction, ``a -> b`` then ``b -> a``."""
        assert self.unit_bandwidth_GBps is not None
        bw = np.array([lk.directed_GBps for lk in self.links], dtype=float).reshape(-1, 2)
        return self.unit_bandwidth_GBps / bw

    @property
    def symmetric(self) -> bool:
        """True when every link has the same bandwidth both ways."""
        return all(lk.symmetric for lk in self.links)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def has_forwarders(self) -> bool:
        """True when some device is not a rank: routes may then cross devices that cannot aggregate."""
        return len(self.devices) > len(self.ranks)

    def device(self, name: str) -> Device:
        try:
            return self.devices[self.device_index[name]]
        except KeyError:
            raise TopologyError(f"topology {self.name!r} has no device {name!r}") from None

    def directed_link(self, u: str, v: str) -> tuple[int, int]:
        """``(link index, direction)`` of the hop u -> v; direction 0 is ``a -> b``."""
        try:
            return self._link_lookup[(u, v)]
        except KeyError:
            raise TopologyError(f"topology {self.name!r} has no link between {u!r} and {v!r}") from None

    @property
    def link_pairs(self) -> Set[tuple[str, str]]:
        """Every hop ``(u, v)`` a route may take (both directions of every link), for set arithmetic."""
        return self._link_lookup.keys()

    def has_link(self, u: str, v: str) -> bool:
        return (u, v) in self._link_lookup

    def route_links(self, route: Sequence[str]) -> list[tuple[int, int]]:
        """Directed links crossed by a route given as a device path."""
        return [self.directed_link(u, v) for u, v in zip(route[:-1], route[1:])]

    def counts(self) -> dict[str, int]:
        """Device counts by kind plus link count (BCube vs Fat-Tree cost claims read these)."""
        out: dict[str, int] = {}
        for d in self.devices:
            out[d.kind] = out.get(d.kind, 0) + 1
        out["links"] = len(self.links)
        out["ranks"] = len(self.ranks)
        return out

    def summary(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in self.counts().items())
        return f"{self.name}: {counts}; unit {self.unit_bandwidth_GBps:g} GB/s"

    # ---- plain-data conversion ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The documented file format (see README), tagged with ``type``."""
        out: dict[str, Any] = {
            "type": "gradsync.topology",
            "version": 1,
            "name": self.name,
            "unit_bandwidth_GBps": self.unit_bandwidth_GBps,
            "ranks": list(self.ranks),
            "devices": [
                {"name": d.name, "kind": d.kind, **({"attrs": dict(d.attrs)} if d.attrs else {})}
                for d in self.devices
            ],
            "links": [
                {
                    "a": lk.a,
                    "b": lk.b,
                    **({"bandwidth_GBps": lk.bandwidth_GBps} if lk.symmetric else
                       {"bandwidth_up_GBps": lk.bandwidth_GBps, "bandwidth_down_GBps": lk.bandwidth_down_GBps}),
                    "latency_s": lk.latency_s,
                    "kind": lk.kind,
                }
                for lk in self.links
            ],
        }
        if self.attrs:
            out["attrs"] = dict(self.attrs)
        return out

    def select(self, ranks: Iterable[int], name: str | None = None) -> Topology:
        """Keep only some ranks (by rank index), the forwarding devices between them, and their links.

        Forwarding devices that end up as dead ends are pruned, so ``p2.16xlarge[0,1]`` keeps one board.
        """
        idx = list(ranks)
        if not idx:
            raise TopologyError(f"empty selection of {self.name!r}; name at least one rank, e.g. {self.name}[0,1]")
        for i in idx:
            if not isinstance(i, int) or not 0 <= i < len(self.ranks):
                raise TopologyError(
                    f"rank index {i!r} is out of range for {self.name!r}, which has ranks 0..{len(self.ranks) - 1}"
                )
        if len(set(idx)) != len(idx):
            raise TopologyError(f"selection {idx} of {self.name!r} names a rank twice")
        keep_ranks = [self.ranks[i] for i in idx]
        dropped = set(self.ranks) - set(keep_ranks)
        keep = {d.name for d in self.devices if d.name not in dropped}
        # Non-rank devices only forward: prune those with one (or no) neighbour left, repeatedly.
        g = self.graph.subgraph(keep).copy()
        changed = True
        while changed:
            changed = False
            for n in list(g.nodes):
                if n not in keep_ranks and g.degree(n) <= 1:
                    g.remove_node(n)
                    changed = True
        devices = tuple(d for d in self.devices if d.name in g)
        links = tuple(lk for lk in self.links if lk.a in g and lk.b in g)
        label = name or f"{self.name}[{','.join(map(str, idx))}]"
        return Topology(
            label, devices, links, ranks=tuple(keep_ranks), unit_bandwidth_GBps=self.unit_bandwidth_GBps,
            attrs=dict(self.attrs),
        )
