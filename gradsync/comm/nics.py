"""Which topology links this host sees dead: its NICs, the links they are the ends of, and their carrier.

A link that stops carrying anything (a failed cable, a dead switch port) is something the host at its end knows
at once: its NIC loses the carrier (``/sys/class/net/<nic>/carrier`` reads 0, or cannot be read once the
interface is down). Rates cannot tell it from a slow link when the fabric routes around it, and a dead link
without a route around it shows only as a timeout. So each rank reads its own NICs' carrier, and the watch
(:mod:`gradsync.comm.adapt`) sums every rank's dead links into its agreement round, so every rank drops the same
links at the same collective.

Which NIC is which link: ``AdaptOptions(nics=...)`` or ``$GRADSYNC_NICS``, a comma-separated list of
``interface=device/peer`` (this rank's topology device, the device at the link's other end), e.g.
``GRADSYNC_NICS=eth0=s00/L0.sw0,eth1=s00/L1.sw0``. ``gradsync testbed run`` sets it for every server.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from gradsync.errors import GradsyncError
from gradsync.topology.model import Topology

__all__ = ["MAX_NICS", "NICS_ENV", "Nic", "carrier", "decode_down", "encode_down", "interfaces", "nics_from_env",
           "parse_nics"]

#: The environment variable naming this host's NICs and their links.
NICS_ENV = "GRADSYNC_NICS"
#: NICs per rank the agreement round has room for.
MAX_NICS = 8
#: One NIC: (interface, this rank's device, the device at the other end).
Nic = tuple[str, str, str]
#: Where the kernel lists interfaces (a test points it at a folder of fake ones).
SYS_NET = Path("/sys/class/net")


def parse_nics(text: str) -> tuple[Nic, ...]:
    """``eth0=s00/L0.sw0,eth1=s00/L1.sw0`` -> ``(("eth0", "s00", "L0.sw0"), ("eth1", "s00", "L1.sw0"))``."""
    out: list[Nic] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        ifname, eq, link = part.partition("=")
        device, slash, peer = link.partition("/")
        if not (eq and slash and ifname.strip() and device.strip() and peer.strip()):
            raise GradsyncError(f"cannot read NIC {part!r} of {NICS_ENV}={text!r}; write interface=device/peer "
                                f"pairs, e.g. eth0=s00/L0.sw0,eth1=s00/L1.sw0")
        out.append((ifname.strip(), device.strip(), peer.strip()))
    if len({n[0] for n in out}) != len(out):
        raise GradsyncError(f"{NICS_ENV}={text!r} names an interface twice")
    return tuple(out)


def nics_from_env() -> tuple[Nic, ...]:
    """This host's NICs as ``$GRADSYNC_NICS`` names them (none when unset)."""
    return parse_nics(os.environ.get(NICS_ENV, ""))


def interfaces() -> list[str]:
    """This host's interfaces (those of its network namespace)."""
    try:
        return sorted(p.name for p in SYS_NET.iterdir())
    except OSError:
        return []


def carrier(ifname: str) -> bool:
    """Whether interface ``ifname`` has its carrier: False when it reads 0, and when it cannot be read (the kernel
    refuses the read while the interface is down; a NIC that disappeared has no carrier either)."""
    try:
        return (SYS_NET / ifname / "carrier").read_text().strip() == "1"
    except OSError:
        return False


def encode_down(nics: tuple[Nic, ...], topology: Topology, up: Callable[[str], bool]) -> list[float]:
    """This rank's row of the agreement round: per NIC (at most :data:`MAX_NICS`), its peer's device index in
    ``topology`` + 1 when its carrier is gone, else 0 (float64 holds it exactly)."""
    row = [0.0] * MAX_NICS
    for i, (ifname, _, peer) in enumerate(nics[:MAX_NICS]):
        if not up(ifname):
            row[i] = float(topology.device_index[peer] + 1)
    return row


def decode_down(rows: list[list[float]], topology: Topology) -> frozenset[frozenset[str]]:
    """The links every rank's row says are dead: rank ``r``'s device and device ``code - 1`` per nonzero code."""
    return frozenset(frozenset((topology.ranks[r], topology.devices[int(c) - 1].name))
                     for r, row in enumerate(rows) for c in row if c > 0)
