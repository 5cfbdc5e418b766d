"""Stdlib-only TCP sender/receiver that :mod:`gradsync.testbed.probe` starts inside namespaces.

Run as a script (``python _probe_worker.py recv ADDR`` / ``send ADDR PORT SECONDS``) so it starts fast and
imports nothing from gradsync or torch. The receiver prints ``PORT n`` once it listens (port 0: the kernel
picks a free one, so concurrent probes never collide) and, at the end, one JSON line with what it measured.
"""

from __future__ import annotations

import json
import socket
import sys
import time

__all__ = ["receive", "send", "main"]

_CHUNK = 1 << 18


def receive(addr: str, accept_timeout: float = 20.0) -> dict[str, float]:
    """Accept one connection, read to EOF; rate = bytes after the first chunk / time from first to last byte."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, 0))
        srv.listen(1)
        srv.settimeout(accept_timeout)
        print(f"PORT {srv.getsockname()[1]}", flush=True)
        conn, _ = srv.accept()
    buf = bytearray(_CHUNK)
    total = first_len = 0
    t_first = t_last = 0.0
    with conn:
        conn.settimeout(accept_timeout)
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            now = time.perf_counter()
            if not total:
                t_first, first_len = now, n
            total += n
            t_last = now
    seconds = t_last - t_first
    counted = total - first_len
    mbit = counted * 8 / seconds / 1e6 if seconds > 0 else 0.0
    return {"bytes": total, "seconds": seconds, "mbit": mbit}


def send(addr: str, port: int, seconds: float) -> dict[str, float]:
    """Push zeros for ``seconds``, then half-close and wait until the receiver has read everything."""
    payload = bytes(_CHUNK)
    sent = 0
    with socket.create_connection((addr, port), timeout=20.0) as sock:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sock.sendall(payload)
            sent += len(payload)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)
    return {"bytes": sent}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "recv":
        out = receive(argv[1])
    elif len(argv) == 4 and argv[0] == "send":
        out = send(argv[1], int(argv[2]), float(argv[3]))
    else:
        print("usage: _probe_worker.py recv ADDR | send ADDR PORT SECONDS", file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
