"""Where a KVStore worker sits (:class:`KVStoreConfig`) and how it reads that from the environment that
``gradsync launch`` (or torchrun) sets, the job id included (:func:`job_from_env`). See
:mod:`gradsync.ps.kvstore` for the variables."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from gradsync.env import env_number
from gradsync.errors import GradsyncError
from gradsync.ps.client import PART_BYTES, SLICE_BYTES
from gradsync.ps.env import CLIENTS_ENV, ELASTIC_TIMEOUT_ENV, JOB_ENV, SECRET_ENV, SERVERS_ENV, TIMEOUT_ENV
from gradsync.ps.wire import job_id

__all__ = ["KVStoreConfig", "job_from_env"]


@dataclass(frozen=True)
class KVStoreConfig:
    """Where this worker sits. ``from_env`` reads what ``gradsync launch`` (or torchrun) sets."""

    rank: int = 0
    num_workers: int = 1
    servers: tuple[str, ...] = ()
    clients: int = 0  # 0: one client per worker
    secret: bytes | None = None
    timeout_s: float = 60.0
    retry_s: float = 1.0
    ordered: bool = False
    slice_bytes: int = SLICE_BYTES
    part_bytes: int = PART_BYTES  # the largest part of a key in one message (see gradsync.ps.client)
    job: int = 0  # the job id in every frame (0: none); see from_env
    #: sync rounds go on without a worker that stops answering (dist kinds; see PSKVStore)
    elastic: bool = False
    #: the servers' drop timeout (GRADSYNC_PS_ELASTIC_TIMEOUT, the same in every process of the job)
    elastic_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.num_workers:
            raise GradsyncError(f"rank {self.rank} is outside 0..{self.num_workers - 1} (WORLD_SIZE={self.num_workers})")
        c = self.num_clients
        if not 1 <= c <= self.num_workers or self.num_workers % c:
            raise GradsyncError(f"clients={self.clients} must divide the {self.num_workers} workers into equal groups")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0 and math.isfinite(self.retry_s)
                and self.retry_s > 0) or self.slice_bytes <= 0 or self.part_bytes <= 0:
            raise GradsyncError(f"timeout_s={self.timeout_s}, retry_s={self.retry_s}, slice_bytes="
                                f"{self.slice_bytes} and part_bytes={self.part_bytes} must be > 0")
        if self.elastic and not (math.isfinite(self.elastic_timeout_s)
                                 and 0 < self.elastic_timeout_s < self.timeout_s):
            raise GradsyncError(f"elastic: elastic_timeout_s={self.elastic_timeout_s} must be > 0 and below "
                                f"timeout_s={self.timeout_s}, or the survivors give up on a round before the servers "
                                f"drop the silent worker; raise {TIMEOUT_ENV} or lower {ELASTIC_TIMEOUT_ENV}")

    @property
    def num_clients(self) -> int:
        return self.clients or self.num_workers

    @property
    def client(self) -> int:
        """Which client (group of consecutive ranks) this worker belongs to."""
        return self.rank // (self.num_workers // self.num_clients)

    @property
    def is_master(self) -> bool:
        """Rank 0 of its client: the one that talks to the servers."""
        return self.rank % (self.num_workers // self.num_clients) == 0

    @classmethod
    def from_env(cls, **overrides: Any) -> KVStoreConfig:
        env = os.environ
        fields: dict[str, Any] = {
            "rank": env_number("RANK", 0, int), "num_workers": env_number("WORLD_SIZE", 1, int),
            "servers": tuple(s for s in env.get(SERVERS_ENV, "").split(",") if s),
            "clients": env_number(CLIENTS_ENV, 0, int), "timeout_s": env_number(TIMEOUT_ENV, 60.0, float),
            "elastic_timeout_s": env_number(ELASTIC_TIMEOUT_ENV, 10.0, float),
        }
        if env.get(SECRET_ENV):
            fields["secret"] = env[SECRET_ENV].encode()
        fields["job"] = job_from_env()
        fields.update(overrides)
        return cls(**fields)


def job_from_env() -> int:
    """The job id: ``GRADSYNC_PS_JOB``, else derived from what every rank of a torchrun job shares (its
    rendezvous address and run id), else 0 (no job id: a single process, or a hand-made setup)."""
    env = os.environ
    if env.get(JOB_ENV, "").strip():
        return job_id(env[JOB_ENV])
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        run = env.get("TORCHELASTIC_RUN_ID", "none")
        return job_id(f"torchrun:{run}:{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    return 0
