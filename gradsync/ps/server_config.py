"""How one parameter server is configured: its limits' defaults, :class:`ServerConfig`, and the command line
and environment of ``python -m gradsync.ps.server`` that fill it in (:mod:`gradsync.ps.server` runs it)."""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from gradsync.env import env_number
from gradsync.errors import GradsyncError
from gradsync.ps.env import (
    ELASTIC_TIMEOUT_ENV,
    INSECURE_ENV,
    JOB_ENV,
    MAX_AHEAD_ENV,
    MAX_BYTES_ENV,
    MAX_KEYS_ENV,
    MAX_PARKED_ENV,
    MAX_PARKED_PER_CLIENT_ENV,
    SECRET_ENV,
)
from gradsync.ps.wire import MAX_PAYLOAD, job_id

__all__ = ["ServerConfig", "is_loopback", "argument_parser", "config_from_args", "MAX_AHEAD", "MAX_PARKED",
           "MAX_PARKED_PER_CLIENT", "ELASTIC_TIMEOUT", "MAX_KEYS", "MAX_BYTES", "CHECKPOINT_RETRY_S"]

#: Default rounds ahead of a key's current round that pushes are buffered and pulls parked for. A worker
#: that pushes and pulls each round is at most one ahead; eight leaves room for push-only stretches.
MAX_AHEAD = 8
#: Default cap on pulls parked per key (a legitimate key has about one per client).
MAX_PARKED = 1024
#: Default cap on requests parked per client connection (about one per key slot it pulls).
MAX_PARKED_PER_CLIENT = 16384
#: Default seconds of silence after which an elastic key drops a client from its rounds.
ELASTIC_TIMEOUT = 10.0
#: Default cap on key slices stored per server (a whole key is one; a sliced key one per part here).
MAX_KEYS = 1 << 20
#: Default cap on bytes of stored values per server: half of this machine's memory, so that a flood of
#: INITs is refused with a message instead of ending in the OOM killer.
MAX_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
#: Default first wait (seconds) before a failed checkpoint write is tried again (doubled per failure).
CHECKPOINT_RETRY_S = 1.0


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` is reachable from this host only: ipc/inproc, or tcp on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: other machines may reach it
        return False


@dataclass(frozen=True)
class ServerConfig:
    """How one server runs. ``bind``: a ZeroMQ endpoint (loopback unless told otherwise; port 0 = any)."""

    bind: str = "tcp://127.0.0.1:0"
    server_id: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_interval_s: float = 0.0
    secret: bytes | None = None
    max_payload: int = MAX_PAYLOAD
    insecure: bool = False  # allow a non-loopback bind without a secret
    job: int = 0  # the job served (0: the first job id a request carries)
    max_ahead: int = MAX_AHEAD
    max_parked_per_key: int = MAX_PARKED
    max_parked_per_client: int = MAX_PARKED_PER_CLIENT
    elastic_timeout_s: float = ELASTIC_TIMEOUT  # silence after which elastic keys drop a client
    max_keys: int = MAX_KEYS
    max_bytes: int = MAX_BYTES
    checkpoint_retry_s: float = CHECKPOINT_RETRY_S  # first backoff after a failed checkpoint write

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise GradsyncError(f"bind={self.bind!r} is not a ZeroMQ endpoint; write e.g. tcp://127.0.0.1:5555")
        if not self.secret and not self.insecure and not is_loopback(self.bind):
            raise GradsyncError(
                f"refusing to bind {self.bind!r} without a shared secret: any host that reaches it could push, "
                f"overwrite or stop this server. Set {SECRET_ENV} (the same in every worker; `gradsync launch` makes "
                f"one), bind to tcp://127.0.0.1:PORT, or pass --insecure ({INSECURE_ENV}=1) on a trusted network")
        for name in ("max_ahead", "max_parked_per_key", "max_parked_per_client", "max_keys", "max_bytes"):
            if getattr(self, name) < 1:
                raise GradsyncError(f"{name}={getattr(self, name)} must be >= 1")
        if self.checkpoint_every < 0 or self.checkpoint_interval_s < 0:
            raise GradsyncError(f"checkpoint_every={self.checkpoint_every} and checkpoint_interval_s="
                                f"{self.checkpoint_interval_s} must be >= 0 (0 = off)")
        if self.max_payload <= 0:
            raise GradsyncError(f"max_payload={self.max_payload} must be > 0")
        if not self.checkpoint_retry_s > 0:
            raise GradsyncError(f"checkpoint_retry_s={self.checkpoint_retry_s} must be > 0")
        if not self.elastic_timeout_s > 0:
            raise GradsyncError(f"elastic_timeout_s={self.elastic_timeout_s} must be > 0 ({ELASTIC_TIMEOUT_ENV})")

    @property
    def checkpoint_path(self) -> Path | None:
        return None if self.checkpoint_dir is None else Path(self.checkpoint_dir) / f"server-{self.server_id}.npz"


def argument_parser(description: str) -> argparse.ArgumentParser:
    """The flags of ``python -m gradsync.ps.server`` (the limits fall back to the environment, then the defaults)."""
    p = argparse.ArgumentParser(prog="python -m gradsync.ps.server", description=description)
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint (default: loopback, any port)")
    p.add_argument("--id", type=int, default=0, help="this server's index (names its checkpoint file)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint after this many updates (0: off)")
    p.add_argument("--checkpoint-interval", type=float, default=0.0, help="checkpoint every S seconds (0: off)")
    p.add_argument("--max-payload", type=int, default=MAX_PAYLOAD, help="largest payload accepted, bytes")
    p.add_argument("--max-ahead", type=int, default=None,
                   help=f"rounds ahead of a key's round that pushes are buffered for ({MAX_AHEAD_ENV}; {MAX_AHEAD})")
    p.add_argument("--max-parked-per-key", type=int, default=None,
                   help=f"pulls waiting per key ({MAX_PARKED_ENV}; default {MAX_PARKED})")
    p.add_argument("--max-parked-per-client", type=int, default=None,
                   help=f"requests waiting per client ({MAX_PARKED_PER_CLIENT_ENV}; default {MAX_PARKED_PER_CLIENT})")
    p.add_argument("--job", default=None, help=f"serve only this job id ({JOB_ENV}; default: the first one seen)")
    p.add_argument("--elastic-timeout", type=float, default=None,
                   help=f"seconds of silence after which elastic keys drop a client ({ELASTIC_TIMEOUT_ENV}; "
                        f"default {ELASTIC_TIMEOUT:g})")
    p.add_argument("--max-keys", type=int, default=None,
                   help=f"key slices stored at most ({MAX_KEYS_ENV}; default {MAX_KEYS})")
    p.add_argument("--max-bytes", type=int, default=None,
                   help=f"bytes of stored values at most ({MAX_BYTES_ENV}; default half of this machine's memory)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for the update rules (default 1: see below)")
    p.add_argument("--insecure", action="store_true",
                   help=f"allow a non-loopback --bind without {SECRET_ENV} ({INSECURE_ENV}=1): anyone who reaches it "
                        f"can use and stop it")
    return p


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    """The :class:`ServerConfig` that parsed flags ``a`` and the environment give (the secret only from
    ``GRADSYNC_PS_SECRET``, never a flag)."""
    secret = os.environ.get(SECRET_ENV)
    return ServerConfig(
        bind=a.bind, server_id=a.id, checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every,
        checkpoint_interval_s=a.checkpoint_interval, secret=secret.encode() if secret else None,
        max_payload=a.max_payload, insecure=a.insecure or os.environ.get(INSECURE_ENV, "") == "1",
        job=job_id(a.job if a.job is not None else os.environ.get(JOB_ENV, "")),
        max_ahead=a.max_ahead if a.max_ahead is not None else env_number(MAX_AHEAD_ENV, MAX_AHEAD, int),
        max_parked_per_key=(a.max_parked_per_key if a.max_parked_per_key is not None
                            else env_number(MAX_PARKED_ENV, MAX_PARKED, int)),
        max_parked_per_client=(a.max_parked_per_client if a.max_parked_per_client is not None
                               else env_number(MAX_PARKED_PER_CLIENT_ENV, MAX_PARKED_PER_CLIENT, int)),
        elastic_timeout_s=(a.elastic_timeout if a.elastic_timeout is not None
                           else env_number(ELASTIC_TIMEOUT_ENV, ELASTIC_TIMEOUT, float)),
        max_keys=a.max_keys if a.max_keys is not None else env_number(MAX_KEYS_ENV, MAX_KEYS, int),
        max_bytes=a.max_bytes if a.max_bytes is not None else env_number(MAX_BYTES_ENV, MAX_BYTES, int))
