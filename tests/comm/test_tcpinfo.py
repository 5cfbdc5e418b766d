"""The kernel's per-connection counters the watch reads (gradsync.comm.tcpinfo, issue 39): the struct offsets, the
endpoint codes, which rank a connection leads to, and the wire rate, against synthetic counters and one real
loopback connection."""

from __future__ import annotations

import socket
import struct
import sys
import threading

import pytest
import torch

from gradsync.comm.tcpinfo import (
    Connection,
    TcpCounters,
    TcpReader,
    decode_endpoint,
    encode_endpoint,
    parse_tcp_info,
    peer_ranks,
    read_connections,
    wire_rates,
)


def _raw(acked: int, busy: int, rwnd: int, sndbuf: int, *, pad: int = 232) -> bytes:
    """A ``struct tcp_info`` laid out as linux/tcp.h: 8 bytes, 24 u32, 4 u64, 6 u32, 4 u64 (delivery_rate first)."""
    head = bytes(8) + struct.pack("=24I", *range(24))
    return (head + struct.pack("=QQQQ", 7, 8, acked, 9) + struct.pack("=6I", *range(6))
            + struct.pack("=QQQQ", 10, busy, rwnd, sndbuf)).ljust(pad, b"\0")


def test_the_counters_are_read_at_the_kernels_offsets_and_a_short_struct_gives_none() -> None:
    assert parse_tcp_info(_raw(123456789, 4000, 300, 20)) == TcpCounters(123456789, 4000, 300, 20)
    assert parse_tcp_info(_raw(1, 2, 3, 4)[:190]) is None  # a kernel before busy_time (4.10) has no such fields


@pytest.mark.parametrize("address, port", [("0.0.0.0", 1), ("10.213.0.7", 29500), ("255.255.255.255", 65535)])
def test_an_endpoint_travels_exactly_as_one_float64(address: str, port: int) -> None:
    code = encode_endpoint(address, port)
    summed = torch.tensor([0.0, code], dtype=torch.float64).sum().item()  # what the sum-allreduce does to it
    assert decode_endpoint(summed) == (address, port)


def test_each_connection_maps_to_the_one_other_rank_that_lists_its_peer_endpoint() -> None:
    mine = [Connection(("10.0.0.1", 40000), ("10.0.0.2", 50000)),   # to rank 1
            Connection(("10.0.0.1", 40001), ("10.0.0.3", 50001)),   # to rank 2
            Connection(("10.0.0.1", 40002), ("10.0.0.9", 29500)),   # a store nobody lists
            Connection(("10.0.0.1", 40003), ("10.0.0.4", 7))]       # listed by two ranks: ambiguous
    listed = {0: [("10.0.0.1", 40000), ("10.0.0.1", 40001)], 1: [("10.0.0.2", 50000), ("10.0.0.4", 7)],
              2: [("10.0.0.3", 50001), ("10.0.0.4", 7)]}
    assert peer_ranks(mine, listed, rank=0) == {("10.0.0.2", 50000): 1, ("10.0.0.3", 50001): 2}


def test_the_wire_rate_is_bytes_acked_over_busy_time_less_receiver_stalls_on_the_busiest_connection() -> None:
    a, b, c = (Connection(("h", i), ("p", i)) for i in range(3))
    peers = {("p", 0): 1, ("p", 1): 1, ("p", 2): 2}
    before = {a: TcpCounters(0, 0, 0, 0), b: TcpCounters(100, 10, 0, 0), c: TcpCounters(0, 0, 0, 0)}
    after = {a: TcpCounters(4_000_000, 2_000_000, 1_000_000, 0),  # 4 MB in 2 s busy, 1 s of it the receiver's
             b: TcpCounters(1_100, 1_010, 0, 0),                  # another group's connection to rank 1: fewer bytes
             c: TcpCounters(10, 5, 0, 0)}                          # rank 2: too few bytes to say
    assert wire_rates(before, after, peers, min_bytes=1000) == {1: pytest.approx(4e6)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO's counters are Linux's")
def test_a_loopback_connection_reports_what_it_moved_and_a_rate() -> None:
    """One real connection: the kernel's acknowledged bytes grow by what was sent, and the rate is finite."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    payload = b"x" * (4 << 20)
    got = bytearray()

    def drain() -> None:
        while len(got) < len(payload):
            got.extend(conn.recv(1 << 20))

    try:
        me = Connection(client.getsockname()[:2], client.getpeername()[:2])
        before = read_connections()
        assert me in before, sorted(before)
        reader = threading.Thread(target=drain)
        reader.start()
        client.sendall(payload)
        reader.join(timeout=30)
        assert len(got) == len(payload)
        after = read_connections()
        assert after[me].bytes_acked - before[me].bytes_acked == len(payload)
        rates = wire_rates(before, after, {me.peer: 1}, min_bytes=1 << 20)
        wire_us = (after[me].busy_us - before[me].busy_us) - (after[me].rwnd_limited_us - before[me].rwnd_limited_us)
        if wire_us > 0:  # the bytes over the time the wire, not the reader, held them
            assert rates == {1: pytest.approx(len(payload) / (wire_us * 1e-6))}
        else:  # every busy microsecond a window stall (a reader that fell behind), or none counted busy at all
            assert rates == {}  # (seen on a loaded CI machine: busy_us 0 for the whole 4 MiB on loopback)
    finally:
        for s in (client, conn, server):
            s.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO's counters are Linux's")
def test_the_reader_asks_the_known_fds_alone_leaves_them_open_and_walks_again_when_one_is_gone() -> None:
    """TcpReader: its first reading walks every fd, later ones read the same counters from the fds it kept (no
    walk), the borrowed fds stay open and usable, and a connection closed since makes the next reading walk."""
    server = socket.create_server(("127.0.0.1", 0))
    pairs = []
    for _ in range(2):
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        pairs.append((client, conn))
    try:
        peers = [c.getpeername()[:2] for c, _ in pairs]
        reader = TcpReader(peers)
        first = reader.read()
        assert reader.walks == 1 and {c.peer for c in first} == set(peers)
        pairs[0][0].sendall(b"y" * 100_000)
        got = bytearray()
        while len(got) < 100_000:
            got.extend(pairs[0][1].recv(1 << 16))
        again = reader.read()
        assert reader.walks == 1  # the kept fds, no walk
        assert again == {c: v for c, v in read_connections().items() if c.peer in set(peers)}
        me = Connection(pairs[0][0].getsockname()[:2], pairs[0][0].getpeername()[:2])
        assert again[me].bytes_acked - first[me].bytes_acked == 100_000
        pairs[0][0].sendall(b"z")  # still the owner's, open
        assert pairs[0][1].recv(1) == b"z"
        pairs[1][0].close()
        third = reader.read()
        assert reader.walks == 2 and {c.peer for c in third} == {peers[0]}
    finally:
        for a, b in pairs:
            a.close()
            b.close()
        server.close()
