"""What the kernel says each TCP connection of this process moved, and for how long it was busy (issue 39).

The watch (:mod:`gradsync.comm.adapt`) compares each rank pair's rate with the cost model's. Timed from the
executor's side (a send's post to its completion), a rate also holds the time the sending process was not
scheduled and the time its message queued behind others: with six ranks on two cores, pairs that a NIC cut did
not touch read 0.2x to 60x of their warm-up rate, and the pairs through the cut NIC could not be told from them
(docs/runtime.md). Linux keeps, per connection, the bytes the peer acknowledged and the time the connection was
busy sending (``TCP_INFO``: ``tcpi_bytes_acked``, ``tcpi_busy_time``, and, inside it, the time stalled by the
receiver's window ``tcpi_rwnd_limited``). Bytes acknowledged over busy time less the receiver's stalls is the
wire's rate for that connection, whatever the processes at either end were doing in between: measured on the
testbed, the four pairs through a NIC cut to a quarter read 0.15-0.17x of their healthy rate and no other
rack-local pair read below 0.79x.

Which connection leads to which rank: every rank lists the local endpoints (IPv4 address and port) of its TCP
connections; a connection's peer endpoint is then found in the peer rank's list (:func:`peer_ranks`). The
lists travel as float64 codes (address << 16 | port, below 2**48: exact in a float64) in one sum-allreduce.

Linux only; anywhere else, or on a kernel without these fields, :func:`read_connections` returns nothing and
the watch keeps the executor's own timings.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from typing import NamedTuple

__all__ = ["MAX_ENDPOINTS", "Connection", "TcpCounters", "TcpReader", "decode_endpoint", "encode_endpoint",
           "parse_tcp_info", "peer_ranks", "read_connections", "wire_rates"]

#: Endpoints a rank lists for the mapping (its connections beyond these are not mapped, and their peers keep
#: the executor's timings). gloo keeps one connection per peer and process group, so this covers 20 peers
#: in three groups.
MAX_ENDPOINTS = 64
#: ``struct tcp_info`` (linux/tcp.h): 8 one-byte fields, 24 u32 (to ``tcpi_total_retrans``), then u64
#: ``pacing_rate``, ``max_pacing_rate``, ``bytes_acked``, ``bytes_received``, six u32 (``segs_out`` ..
#: ``data_segs_out``), then u64 ``delivery_rate``, ``busy_time``, ``rwnd_limited``, ``sndbuf_limited``.
_U64_AT = 8 + 24 * 4
_ACKED_AT = _U64_AT + 2 * 8
_BUSY_AT = _U64_AT + 4 * 8 + 6 * 4 + 8
_NEEDED = _BUSY_AT + 3 * 8
_TCP_INFO = getattr(socket, "TCP_INFO", None)


class TcpCounters(NamedTuple):
    """One connection's running totals: bytes the peer acknowledged, microseconds busy sending (stalls included),
    of those the microseconds stalled by the receiver's window and by this side's send buffer."""

    bytes_acked: int
    busy_us: int
    rwnd_limited_us: int
    sndbuf_limited_us: int


class Connection(NamedTuple):
    """A TCP connection of this process: its local and peer endpoints (address, port)."""

    local: tuple[str, int]
    peer: tuple[str, int]


def parse_tcp_info(raw: bytes) -> TcpCounters | None:
    """The counters in a ``TCP_INFO`` answer; None where the kernel's struct is too short to hold them."""
    if len(raw) < _NEEDED:
        return None
    (acked,) = struct.unpack_from("=Q", raw, _ACKED_AT)
    busy, rwnd, sndbuf = struct.unpack_from("=QQQ", raw, _BUSY_AT)
    return TcpCounters(acked, busy, rwnd, sndbuf)


def read_connections() -> dict[Connection, TcpCounters]:
    """Every connected TCP socket of this process with its counters (empty where the platform gives none)."""
    return {conn: counters for conn, (_, counters) in _scan().items()}


def _scan() -> dict[Connection, tuple[int, TcpCounters]]:
    """Every connected IPv4 TCP socket of this process: its fd and counters (a walk over every fd)."""
    if _TCP_INFO is None:
        return {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    out: dict[Connection, tuple[int, TcpCounters]] = {}
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            fd = os.dup(int(name))  # a duplicate: closing it leaves the owner's fd alone
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # the number was closed and reused for something else in between
            os.close(fd)
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family != socket.AF_INET:
                continue
            conn = Connection(sock.getsockname()[:2], sock.getpeername()[:2])
            counters = parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256))
        except OSError:  # not connected (a listening socket), or closed in between
            continue
        finally:
            sock.close()
        if counters is not None:
            out[conn] = (int(name), counters)
    return out


class TcpReader:
    """Reads the counters of the connections to ``peers`` (peer endpoints) without walking every fd of the
    process each time: the first reading walks them (:func:`read_connections`) and keeps those connections' fd
    numbers; later readings ask those fds alone (the owner's fd, borrowed and handed back, never closed), each
    checked to still be the same connection. A fd closed or reused since, or a connection gone: the next reading
    walks again. The walk costs a few system calls per fd of the process (gloo, the store, files), twice per watched
    collective (docs/runtime.md)."""

    def __init__(self, peers: Iterable[tuple[str, int]]) -> None:
        self.peers = frozenset(peers)
        self._fds: dict[Connection, int] | None = None
        #: full walks so far (a test reads it)
        self.walks = 0

    def read(self) -> dict[Connection, TcpCounters]:
        if self._fds:
            got = self._read_known(self._fds)
            if got is not None:
                return got
        self.walks += 1
        found = {c: v for c, v in _scan().items() if c.peer in self.peers}
        self._fds = {c: fd for c, (fd, _) in found.items()}
        return {c: counters for c, (_, counters) in found.items()}

    @staticmethod
    def _read_known(fds: Mapping[Connection, int]) -> dict[Connection, TcpCounters] | None:
        assert _TCP_INFO is not None  # a reader with fds found them through it
        out: dict[Connection, TcpCounters] = {}
        for conn, fd in fds.items():
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0, fileno=fd)
            except OSError:
                return None
            try:
                if Connection(sock.getsockname()[:2], sock.getpeername()[:2]) != conn:
                    return None
                counters = parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256))
            except OSError:  # not a socket any more, or not connected
                return None
            finally:
                sock.detach()  # the fd is the owner's: never closed here
            if counters is None:
                return None
            out[conn] = counters
        return out


def encode_endpoint(address: str, port: int) -> float:
    """An IPv4 endpoint as one exact float64 (``address << 16 | port`` < 2**48)."""
    return float((int(ipaddress.IPv4Address(address)) << 16) | int(port))


def decode_endpoint(code: float) -> tuple[str, int]:
    value = int(code)
    return str(ipaddress.IPv4Address(value >> 16)), value & 0xFFFF


def peer_ranks(mine: Iterable[Connection], listed: Mapping[int, Iterable[tuple[str, int]]],
               rank: int) -> dict[tuple[str, int], int]:
    """Per peer endpoint of this rank's connections, the other rank whose list holds it as a local endpoint.
    ``listed``: each rank's local endpoints. An endpoint listed by no other rank (a store, a connection within
    this process) or by several is left out."""
    owners: dict[tuple[str, int], set[int]] = {}
    for r, endpoints in listed.items():
        for e in endpoints:
            owners.setdefault(tuple(e), set()).add(r)  # type: ignore[arg-type]
    out: dict[tuple[str, int], int] = {}
    for conn in mine:
        got = owners.get(conn.peer, set()) - {rank}
        if len(got) == 1:
            out[conn.peer] = next(iter(got))
    return out


def wire_rates(before: Mapping[Connection, TcpCounters], after: Mapping[Connection, TcpCounters],
               peers: Mapping[tuple[str, int], int], min_bytes: float) -> dict[int, float]:
    """Per peer rank, bytes per second on the wire between two readings: the bytes acknowledged over the busy
    time less the receiver-window stalls, of the connection to that peer that moved the most bytes (the process
    group that carried the collective), where it moved at least ``min_bytes``."""
    best: dict[int, tuple[int, float]] = {}
    for conn, end in after.items():
        peer = peers.get(conn.peer)
        start = before.get(conn)
        if peer is None or start is None:
            continue
        nbytes = end.bytes_acked - start.bytes_acked
        wire_s = ((end.busy_us - start.busy_us) - (end.rwnd_limited_us - start.rwnd_limited_us)) * 1e-6
        if nbytes < min_bytes or nbytes <= 0 or wire_s <= 0:
            continue
        if peer not in best or nbytes > best[peer][0]:
            best[peer] = (nbytes, nbytes / wire_s)
    return {peer: rate for peer, (_, rate) in best.items()}
