"""A parameter server: one process, one ZeroMQ ROUTER socket, the slices of the keys placed on it.

Each stored slice (a key, or one part of a large key sliced over servers) keeps its value, a version and,
in synchronous mode, the round being summed. The loop is single-threaded, so updates are atomic with
respect to requests: a pull sees a value before or after an update, never half of one.

* **Sync** (``dist_sync``/``hybrid_sync``): a round completes when each of the key's ``pushers`` has
  pushed once; the rule then runs on the round's sum and the version goes up by one. A pull asks for a
  version (its sender's push count) and is answered once the store has it. Pushes name their round, so a
  retried push is recognised and a push for a later round waits for it.
* **Async**: every push is applied at once (a delta without an optimizer); pulls are answered at once.
* **Ordered pulls** (TicTac, seed 003 §5): a sender that marks its pulls ``ORDERED`` with priorities
  0..n−1 gets the replies in exactly that order; a per-sender counter releases reply ``p`` only after
  ``p − 1`` has gone out, whatever order the values became ready in.
* **Failures**: a bad request gets an ``ERROR`` reply naming what was wrong, and the server keeps serving.
  State is checkpointed atomically (write, fsync, rename) every ``checkpoint_every`` updates and/or
  ``checkpoint_interval_s`` seconds, before the replies those updates release go out; a restarted server
  loads it, and workers re-send what it lost (see :mod:`gradsync.ps.client`). Checkpoints are ``.npz``
  files of raw bytes plus a JSON index, read with ``allow_pickle=False``.

Run one with ``python -m gradsync.ps.server --bind tcp://127.0.0.1:5555``; the shared secret, if any, comes
from the environment variable ``GRADSYNC_PS_SECRET`` (never the command line, which other users can read).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from gradsync.errors import GradsyncError
from gradsync.ps.env import SECRET_ENV
from gradsync.ps.updaters import Updater, create_updater, default_updater, describe
from gradsync.ps.wire import DTYPES, MAX_PAYLOAD, Flag, Key, Message, Op, WireError, decode, encode, key_name

__all__ = ["ServerConfig", "Server", "Slot", "main", "SECRET_ENV"]

log = logging.getLogger("gradsync.ps")

_CODES = {dt: c for c, dt in DTYPES.items()}


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

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise GradsyncError(f"bind={self.bind!r} is not a ZeroMQ endpoint; write e.g. tcp://127.0.0.1:5555")
        if self.checkpoint_every < 0 or self.checkpoint_interval_s < 0:
            raise GradsyncError(f"checkpoint_every={self.checkpoint_every} and checkpoint_interval_s="
                                f"{self.checkpoint_interval_s} must be >= 0 (0 = off)")
        if self.max_payload <= 0:
            raise GradsyncError(f"max_payload={self.max_payload} must be > 0")

    @property
    def checkpoint_path(self) -> Path | None:
        return None if self.checkpoint_dir is None else Path(self.checkpoint_dir) / f"server-{self.server_id}.npz"


@dataclass
class Slot:
    """One stored slice: elements ``[offset, offset + value.numel())`` of a tensor of ``shape``."""

    value: torch.Tensor
    shape: tuple[int, ...]
    offset: int
    parts: int
    sync: bool
    pushers: int
    version: int = 0
    pending: torch.Tensor | None = None
    pending_from: set[int] = field(default_factory=set)
    future: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # sync: round -> sender -> push
    last_seq: dict[int, int] = field(default_factory=dict)  # async: sender -> last applied push
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    def missing(self) -> list[int]:
        return sorted(set(range(self.pushers)) - self.pending_from)


@dataclass
class _Ordered:
    """Per-sender counter of the ordered-pull protocol: reply ``next`` is the only one allowed out."""

    n: int
    next: int = 0
    ready: dict[int, list[Any]] = field(default_factory=dict)


class Server:
    """The server loop. ``serve()`` runs until SHUTDOWN or SIGTERM; ``endpoint`` is the bound address."""

    def __init__(self, config: ServerConfig, *, context: zmq.Context | None = None) -> None:
        self.config = config
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            self.sock.bind(config.bind)
        except zmq.ZMQError as e:
            self.sock.close(linger=0)
            hint = ("another process listens there: pick another port, or port 0 for any free one"
                    if e.errno == zmq.EADDRINUSE else "write e.g. tcp://127.0.0.1:5555 (an address of this host)")
            raise GradsyncError(f"cannot bind the server to {config.bind!r}: {e}; {hint}") from None
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.incarnation = random.getrandbits(31) | 1  # tells workers a restarted server from the old one
        self.slots: dict[tuple[Key, int], Slot] = {}
        self.updater: Updater | None = None
        self.deferred: dict[tuple[Key, int], dict[tuple[bytes, int], Message]] = {}
        self.ordered: dict[bytes, _Ordered] = {}
        self.barriers: dict[int, dict[int, tuple[bytes, int]]] = {}
        self.outbox: list[list[Any]] = []
        self.updates = 0
        self.updates_at_checkpoint = 0
        self.checkpointed_at = time.monotonic()
        self.stopping = False
        self.stats = {"requests": 0, "errors": 0, "rejected": 0, "checkpoints": 0}
        self._restore()

    # ---- loop -----------------------------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stopping:
            if poller.poll(100):
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.handle(frames)
                    self._finish()
                    if self.stopping:
                        break
            elif self._checkpoint_due():
                self.checkpoint()
        if self.config.checkpoint_path is not None:
            self.checkpoint()
        self.sock.close(linger=1000)

    def _finish(self) -> None:
        """After each request: checkpoint if due, then send what it released (never the reverse)."""
        if self._checkpoint_due():
            self.checkpoint()
        for frames in self.outbox:
            self.sock.send_multipart(frames, copy=True)
        self.outbox.clear()

    def handle(self, frames: Sequence[Any]) -> None:
        """Process one request (``frames[0]`` is the ROUTER identity). Never raises for bad input."""
        if len(frames) < 2:
            self.stats["rejected"] += 1
            return
        ident = bytes(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
        self.stats["requests"] += 1
        try:
            msg = decode([f.buffer if hasattr(f, "buffer") else f for f in frames[1:]], secret=self.config.secret,
                         max_payload=self.config.max_payload)
        except WireError as e:
            self.stats["rejected"] += 1
            log.warning("server %d: rejected a frame from %r: %s", self.config.server_id, ident, e)
            # unsigned: the sender may not hold the secret, and the reply carries no data, only why
            self.outbox.append([ident, *encode(Op.ERROR, payload=f"rejected: {e}".encode(),
                                               sender=self.config.server_id, count=self.incarnation)])
            return
        try:
            handler = _HANDLERS.get(msg.op)
            if handler is None:
                raise GradsyncError(f"op {msg.op.name} is a reply, not a request")
            handler(self, ident, msg)
        except GradsyncError as e:
            self.stats["errors"] += 1
            self._reply(ident, Op.ERROR, msg, payload=str(e).encode())
        except Exception as e:  # noqa: BLE001 - a bug must not take the server (and every key) down
            self.stats["errors"] += 1
            log.exception("server %d: internal error on %s", self.config.server_id, msg.op.name)
            self._reply(ident, Op.ERROR, msg, payload=f"internal server error: {type(e).__name__}: {e}".encode())

    def _reply(self, ident: bytes, op: Op, msg: Message | None = None, **kw: Any) -> None:
        if msg is not None:
            kw.setdefault("key", msg.key)
            kw.setdefault("part", msg.part)
            kw.setdefault("parts", msg.parts)
            kw.setdefault("req_id", msg.req_id)
        kw.setdefault("sender", self.config.server_id)
        kw.setdefault("count", self.incarnation)
        self.outbox.append([ident, *encode(op, secret=self.config.secret, **kw)])

    # ---- requests -------------------------------------------------------------------------------
    def _slot(self, msg: Message) -> Slot:
        slot = self.slots.get((msg.key, msg.part))  # type: ignore[arg-type]
        if slot is None:
            raise GradsyncError(f"key {key_name(msg.key)} (part {msg.part}) is not initialised on server "
                                f"{self.config.server_id}: call init(key, value) before push or pull")
        return slot

    def _check_tensor(self, slot: Slot, msg: Message) -> None:
        if msg.dtype != slot.value.dtype or msg.numel != slot.value.numel() or msg.offset != slot.offset \
                or msg.shape != slot.shape or msg.parts != slot.parts:
            raise GradsyncError(
                f"push to key {key_name(msg.key)}: got {msg.dtype} shape {msg.shape} part {msg.part}/{msg.parts} "
                f"[{msg.offset}+{msg.numel}], but it was initialised as {slot.value.dtype} shape {slot.shape} "
                f"part {msg.part}/{slot.parts} [{slot.offset}+{slot.value.numel()}]; push what you initialised")

    def on_init(self, ident: bytes, msg: Message) -> None:
        if msg.key is None or msg.dtype is None:
            raise GradsyncError("init needs a key and a tensor")
        if msg.count < 1:
            raise GradsyncError(f"init of key {key_name(msg.key)}: pushers={msg.count} must be >= 1")
        existing = self.slots.get((msg.key, msg.part))
        if existing is not None:  # idempotent: a retried init, or rank 0 re-running after a server restart
            self._check_tensor(existing, msg)
            self._reply(ident, Op.ACK, msg, version=existing.version)
            return
        self.slots[(msg.key, msg.part)] = Slot(
            value=msg.tensor().clone(), shape=msg.shape, offset=msg.offset, parts=msg.parts,
            sync=bool(msg.flags & Flag.SYNC), pushers=msg.count)
        self.updates += 1
        self._force_checkpoint()
        self._reply(ident, Op.ACK, msg, version=0)

    def on_push(self, ident: bytes, msg: Message) -> None:
        slot = self._slot(msg)
        self._check_tensor(slot, msg)
        if not 0 <= msg.sender < slot.pushers:
            raise GradsyncError(f"push to key {key_name(msg.key)} from sender {msg.sender}, but the key has "
                                f"{slot.pushers} pushers (0..{slot.pushers - 1})")
        if msg.version < 1:
            raise GradsyncError(f"push to key {key_name(msg.key)} names round {msg.version}; rounds start at 1")
        if slot.sync:
            self._push_sync(slot, msg)
        else:
            self._push_async(slot, msg)
        self._reply(ident, Op.ACK, msg, version=slot.version)
        self._release((msg.key, msg.part), slot)  # type: ignore[arg-type]

    def _rule(self, slot: Slot) -> Updater:
        return self.updater or default_updater(slot.sync)

    def _push_async(self, slot: Slot, msg: Message) -> None:
        if msg.version <= slot.last_seq.get(msg.sender, 0):
            return  # a retry of a push already applied
        self._rule(slot).apply(slot.value, msg.tensor(), 1, slot.state)
        slot.last_seq[msg.sender] = msg.version
        slot.version += 1
        self.updates += 1

    def _push_sync(self, slot: Slot, msg: Message) -> None:
        r = msg.version
        if r <= slot.version or (r == slot.version + 1 and msg.sender in slot.pending_from):
            return  # a retry of a push this server already holds
        if r > slot.version + 1:
            slot.future.setdefault(r, {}).setdefault(msg.sender, msg.tensor().clone())
            return
        self._add_to_round(slot, msg.sender, msg.tensor())
        while len(slot.pending_from) == slot.pushers:
            assert slot.pending is not None
            self._rule(slot).apply(slot.value, slot.pending, slot.pushers, slot.state)
            slot.version += 1
            self.updates += 1
            slot.pending, slot.pending_from = None, set()
            for sender, t in slot.future.pop(slot.version + 1, {}).items():
                self._add_to_round(slot, sender, t)

    @staticmethod
    def _add_to_round(slot: Slot, sender: int, t: torch.Tensor) -> None:
        if slot.pending is None:
            slot.pending = t.clone()
        else:
            slot.pending.add_(t)
        slot.pending_from.add(sender)

    def on_pull(self, ident: bytes, msg: Message) -> None:
        slot = self._slot(msg)
        if msg.flags & Flag.ORDERED:
            if msg.count < 1 or not 0 <= msg.priority < msg.count:
                raise GradsyncError(f"ordered pull of key {key_name(msg.key)}: priority {msg.priority} must be in "
                                    f"0..{msg.count - 1} (count={msg.count} ordered pulls per iteration)")
        if slot.version >= msg.version:
            self._send_value(ident, msg, slot)
        else:
            self.deferred.setdefault((msg.key, msg.part), {}).setdefault((ident, msg.req_id), msg)  # type: ignore[arg-type]

    def _release(self, where: tuple[Key, int], slot: Slot) -> None:
        waiting = self.deferred.get(where)
        if not waiting:
            return
        for (ident, req), msg in list(waiting.items()):
            if slot.version >= msg.version:
                del waiting[(ident, req)]
                self._send_value(ident, msg, slot)

    def _send_value(self, ident: bytes, msg: Message, slot: Slot) -> None:
        if not msg.flags & Flag.ORDERED:
            self._reply(ident, Op.VALUE, msg, tensor=slot.value, shape=slot.shape, offset=slot.offset,
                        version=slot.version)
            return
        state = self.ordered.get(ident)
        if state is None or state.n != msg.count or (msg.priority == 0 and state.next != 0):
            # a new batch; priority 0 while the counter is elsewhere means the sender abandoned its last
            # batch (an error or timeout on its side): start over rather than wait for replies never asked
            state = self.ordered[ident] = _Ordered(n=msg.count)
        frames = encode(Op.VALUE, key=msg.key, tensor=slot.value.clone(), shape=slot.shape, offset=slot.offset,
                        part=msg.part, parts=msg.parts, req_id=msg.req_id, version=slot.version,
                        priority=msg.priority, sender=self.config.server_id, count=self.incarnation,
                        secret=self.config.secret)
        state.ready[msg.priority] = frames
        while state.next in state.ready:
            self.outbox.append([ident, *state.ready.pop(state.next)])
            state.next = (state.next + 1) % state.n

    def on_set_optimizer(self, ident: bytes, msg: Message) -> None:
        spec = msg.json()
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                or not isinstance(spec.get("hyperparameters", {}), dict):
            raise GradsyncError('set_optimizer payload must be {"name": str, "hyperparameters": {...}}')
        self.updater = create_updater(spec["name"], **spec.get("hyperparameters", {}))
        self._force_checkpoint()
        self._reply(ident, Op.ACK, msg)

    def on_barrier(self, ident: bytes, msg: Message) -> None:
        if msg.count < 1 or not 0 <= msg.sender < msg.count:
            raise GradsyncError(f"barrier: sender {msg.sender} of {msg.count} workers is out of range")
        waiting = self.barriers.setdefault(msg.version, {})
        waiting[msg.sender] = (ident, msg.req_id)
        if len(waiting) == msg.count:
            for who, req_id in self.barriers.pop(msg.version).values():
                self._reply(who, Op.ACK, version=msg.version, req_id=req_id)

    def on_status(self, ident: bytes, msg: Message) -> None:
        if msg.key is not None:
            info = [{"part": p, "version": s.version, "sync": s.sync, "pushers": s.pushers,
                     "pushed": sorted(s.pending_from), "missing": s.missing() if s.sync else []}
                    for (k, p), s in self.slots.items() if k == msg.key]
        else:
            info = {"server": self.config.server_id, "keys": len({k for k, _ in self.slots}), "slots": len(self.slots),
                    "updates": self.updates, "updater": describe(self.updater) if self.updater else None, **self.stats}
        self._reply(ident, Op.INFO, msg, json_payload=info)

    def on_ping(self, ident: bytes, msg: Message) -> None:
        self._reply(ident, Op.ACK, msg)

    def on_checkpoint(self, ident: bytes, msg: Message) -> None:
        if self.config.checkpoint_path is None:
            raise GradsyncError("this server has no checkpoint directory (start it with --checkpoint-dir)")
        self.checkpoint()
        self._reply(ident, Op.ACK, msg)

    def on_shutdown(self, ident: bytes, msg: Message) -> None:
        self.stopping = True
        self._reply(ident, Op.ACK, msg)

    # ---- checkpoints ----------------------------------------------------------------------------
    def _checkpoint_due(self) -> bool:
        cfg = self.config
        if cfg.checkpoint_path is None or self.updates == self.updates_at_checkpoint:
            return False
        if cfg.checkpoint_every and self.updates - self.updates_at_checkpoint >= cfg.checkpoint_every:
            return True
        return bool(cfg.checkpoint_interval_s) and time.monotonic() - self.checkpointed_at >= cfg.checkpoint_interval_s

    def _force_checkpoint(self) -> None:
        if self.config.checkpoint_path is not None:
            self.updates_at_checkpoint = -1  # due now, whatever the interval

    def checkpoint(self) -> None:
        """Write every slot (value, version, optimizer state) atomically: tmp file, fsync, rename."""
        path = self.config.checkpoint_path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, np.ndarray] = {}
        index = []
        for i, ((key, part), s) in enumerate(self.slots.items()):
            arrays[f"v{i}"] = _raw(s.value)
            for name, t in s.state.items():
                arrays[f"s{i}_{name}"] = _raw(t)
            index.append({"key": key, "int_key": isinstance(key, int), "part": part, "parts": s.parts,
                          "offset": s.offset, "shape": list(s.shape), "dtype": _CODES[s.value.dtype],
                          "numel": s.value.numel(), "sync": s.sync, "pushers": s.pushers, "version": s.version,
                          "last_seq": {str(k): v for k, v in s.last_seq.items()},
                          "state": {n: [_CODES[t.dtype], list(t.shape)] for n, t in s.state.items()}})
        meta = {"format": "gradsync-ps-checkpoint", "version": 1, "server": self.config.server_id,
                "updater": describe(self.updater) if self.updater else None, "slots": index}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.updates_at_checkpoint = self.updates
        self.checkpointed_at = time.monotonic()
        self.stats["checkpoints"] += 1

    def _restore(self) -> None:
        path = self.config.checkpoint_path
        if path is None or not path.exists():
            return
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if meta.get("format") != "gradsync-ps-checkpoint":
                    raise GradsyncError(f"{path} is not a gradsync PS checkpoint")
                up = meta.get("updater")
                self.updater = create_updater(up.pop("name"), **up) if up else None
                for i, e in enumerate(meta["slots"]):
                    key: Key = int(e["key"]) if e["int_key"] else str(e["key"])
                    value = _unraw(z[f"v{i}"], e["dtype"], [e["numel"]])
                    state = {n: _unraw(z[f"s{i}_{n}"], code, shape) for n, (code, shape) in e["state"].items()}
                    self.slots[(key, int(e["part"]))] = Slot(
                        value=value, shape=tuple(e["shape"]), offset=int(e["offset"]), parts=int(e["parts"]),
                        sync=bool(e["sync"]), pushers=int(e["pushers"]), version=int(e["version"]),
                        last_seq={int(k): int(v) for k, v in e["last_seq"].items()}, state=state)
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise GradsyncError(f"cannot restore server {self.config.server_id} from {path}: {e}; move the file "
                                f"away to start empty") from e
        self.updates = self.updates_at_checkpoint = 0
        log.info("server %d: restored %d slots from %s", self.config.server_id, len(self.slots), path)


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def _unraw(a: np.ndarray, code: int, shape: list[int]) -> torch.Tensor:
    dtype = DTYPES[int(code)]
    flat = torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint8).copy())
    if flat.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return flat.view(dtype).reshape(shape).clone()


_HANDLERS = {
    Op.INIT: Server.on_init, Op.PUSH: Server.on_push, Op.PULL: Server.on_pull, Op.SET_OPTIMIZER: Server.on_set_optimizer,
    Op.BARRIER: Server.on_barrier, Op.STATUS: Server.on_status, Op.PING: Server.on_ping,
    Op.CHECKPOINT: Server.on_checkpoint, Op.SHUTDOWN: Server.on_shutdown,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradsync.ps.server", description=__doc__.splitlines()[0])
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ endpoint (default: loopback, any port)")
    p.add_argument("--id", type=int, default=0, help="this server's index (names its checkpoint file)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint after this many updates (0: off)")
    p.add_argument("--checkpoint-interval", type=float, default=0.0, help="checkpoint every S seconds (0: off)")
    p.add_argument("--max-payload", type=int, default=MAX_PAYLOAD, help="largest payload accepted, bytes")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    secret = os.environ.get(SECRET_ENV)
    try:
        server = Server(ServerConfig(bind=a.bind, server_id=a.id, checkpoint_dir=a.checkpoint_dir,
                                     checkpoint_every=a.checkpoint_every, checkpoint_interval_s=a.checkpoint_interval,
                                     secret=secret.encode() if secret else None, max_payload=a.max_payload))
    except GradsyncError as e:
        print(f"gradsync-ps: {e}", file=sys.stderr)
        return 2

    def stop(signum: int, frame: Any) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"gradsync-ps server {a.id} listening on {server.endpoint}", flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
