"""Parameter servers on threads in the test process, and worker functions run on threads: shared by the ps tests."""

from __future__ import annotations

import threading

from gradsync.ps.server import Server, ServerConfig


class OneServer:
    """One server on a thread: ``stop`` ends its loop (it writes its final checkpoint, if it has a directory)."""

    def __init__(self, **cfg: object) -> None:
        self.server = Server(ServerConfig(**cfg))  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()
        self.endpoint = self.server.endpoint

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Whether the loop ended within ``timeout_s``."""
        self.server.stopping = True
        self.thread.join(timeout=timeout_s)
        return not self.thread.is_alive()


class Cluster:
    def __init__(self, n: int, **cfg: object) -> None:
        self.servers = [Server(ServerConfig(server_id=i, **cfg)) for i in range(n)]  # type: ignore[arg-type]
        self.threads = [threading.Thread(target=s.serve, daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()
        self.endpoints = tuple(s.endpoint for s in self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.stopping = True
        for t in self.threads:
            t.join(timeout=5)


def run_workers(n: int, fn) -> dict[int, object]:  # type: ignore[no-untyped-def]
    out: dict[int, object] = {}
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out
