"""A parameter server: one process, one ZeroMQ ROUTER socket, the slices of the keys placed on it.

Each stored slice (a key, or one part of a large key sliced over servers) keeps its value, a version and,
in synchronous mode, the round being summed. The loop is single-threaded, so updates are atomic with
respect to requests: a pull sees a value before or after an update, never half of one.

* **Sync** (``dist_sync``/``hybrid_sync``): a round completes when each of the key's ``pushers`` has
  pushed once; the rule then runs on the round's sum and the version goes up by one. A pull asks for a
  version (its sender's push count) and is answered once the store has it. Pushes name their round, so a
  retried push is recognised and a push for a later round waits for it.
* **Elastic** (opt-in per key, ``Flag.ELASTIC`` at INIT; Horovod elastic and torchft are the anchors): a
  server notes when it last heard from each client (any frame, heartbeats included). A client missing
  from a round that has waited ``elastic_timeout_s`` for it, and silent that long, is dropped from the
  key's members: the round completes with the pushes it has (the rule sees how many), and later rounds
  wait for the members left. Pushes already received stay in their round (nothing acknowledged is lost),
  and completed rounds are never changed. A dropped client's later pushes are refused with an error
  saying so; a restarted one rejoins with an INIT (``Flag.JOIN``), which makes it a member again from
  the key's next round and tells it the current version, so its first pull returns the current value.
* **Async**: every push is applied at once (a delta without an optimizer); pulls are answered at once.
* **Push-and-pull** (``PUSHPULL``): the push, then the pull of the round it belongs to (sync) or of the
  value it produced (async), in one request with one ``VALUE`` reply.
* **Replies without a copy**: a ``VALUE`` is sent from the stored tensor's memory (ZeroMQ ``copy=False``,
  tracked). A stored value that a reply still sends from is copied before it is changed (copy on write,
  :meth:`Slot.writable`), so a reply never carries half of a later update and the common case, a value
  sent before the next push arrives, copies nothing.
* **Ordered pulls** (TicTac §5): a sender that marks its pulls ``ORDERED`` with priorities
  0..n−1 gets the replies in exactly that order; a per-sender counter releases reply ``p`` only after
  ``p − 1`` has gone out, whatever order the values became ready in.
* **Bounds**: a sync push is buffered at most ``max_ahead`` rounds ahead of its key's round, and a pull
  parked at most that far ahead; at most ``max_parked_per_key`` pulls wait per key and
  ``max_parked_per_client`` per client connection. Beyond them the request gets an ``ERROR`` reply: a
  flood of future rounds cannot grow the server's memory. INIT shapes must describe exactly the elements
  sent (whole keys) and fit ``parts`` frames of ``max_payload`` bytes (sliced keys).
* **Trust**: with a shared secret every frame is authenticated, and a frame whose (session, seq) is not
  newer than the last one seen from that session is a replay: refused and logged. A frame must also name
  this server (``dest``, its index) and its incarnation (a random nonce drawn at each start, which every
  reply carries: clients learn it from the first one, a PING's ACK or a ``STALE`` refusal), so a frame
  captured on its way to another server, or to this server before a restart (which forgot its replay
  window unless it had a checkpoint), is refused too. Only a PING may carry no incarnation. SHUTDOWN is refused
  unless the frame was authenticated. Without a secret the server binds only to loopback (or ipc), unless
  told ``insecure``. A server serves one job: the first job id it sees (or ``job``), and requests of any
  other job are refused at their first frame (the worker's connect), not mixed into its rounds.
* **Failures**: a bad request gets an ``ERROR`` reply naming what was wrong, and the server keeps serving.
  State is checkpointed atomically (write, fsync, rename) every ``checkpoint_every`` updates and/or
  ``checkpoint_interval_s`` seconds, before the replies those updates release go out; a restarted server
  loads it, and workers re-send what it lost (see :mod:`gradsync.ps.client`). Checkpoints are ``.npz``
  files of raw bytes plus a JSON index, read with ``allow_pickle=False``.
* **A failing disk** (full, read-only, gone) does not stop the server: a failed checkpoint write is logged,
  retried with a doubling backoff (``checkpoint_retry_s`` up to a minute), and the server keeps serving from
  memory, where everything it acknowledged still is. Every reply carries ``Flag.DISK_FAILING`` while the
  last write failed, every ERROR says why, and STATUS gives the path and the OS error (clients fetch it and
  warn). ``checkpoint_dir`` is checked at start (a writable directory), and a checkpoint that cannot be read
  is an error naming the file.
* **Capacity**: at most ``max_keys`` stored slices and ``max_bytes`` bytes of stored values; an INIT past
  either gets an ERROR naming the limit (``--max-keys``/``--max-bytes``, their environment variables).

Run one with ``python -m gradsync.ps.server --bind tcp://127.0.0.1:5555``; the shared secret, if any, comes
from the environment variable ``GRADSYNC_PS_SECRET`` (never the command line, which other users can read).

This module is the loop and its request handlers, in one file on purpose: every handler reads and changes
the same loop state (slots, parked requests, ordered-pull counters, sessions, the outbox), so a split would
have one module reach into another's. What is not that state lives apart: the configuration and command
line (:mod:`gradsync.ps.server_config`), the stored slice (:mod:`gradsync.ps.slot`) and the checkpoint file
(:mod:`gradsync.ps.checkpoint`).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import zmq

from gradsync.errors import GradsyncError
from gradsync.ps.checkpoint import read_checkpoint, write_checkpoint
from gradsync.ps.env import (
    JOB_ENV,
    MAX_AHEAD_ENV,
    MAX_BYTES_ENV,
    MAX_KEYS_ENV,
    MAX_PARKED_ENV,
    MAX_PARKED_PER_CLIENT_ENV,
    SECRET_ENV,
    SERVERS_ENV,
)
from gradsync.ps.server_config import ELASTIC_TIMEOUT as ELASTIC_TIMEOUT
from gradsync.ps.server_config import (
    MAX_AHEAD,
    MAX_PARKED,
    MAX_PARKED_PER_CLIENT,
    ServerConfig,
    argument_parser,
    config_from_args,
    is_loopback,
)
from gradsync.ps.slot import Slot
from gradsync.ps.updaters import Updater, create_updater, default_updater, describe
from gradsync.ps.wire import (
    MAX_ELEMENTS,
    ORDERED_BIT,
    Flag,
    Key,
    Message,
    Op,
    TagJoiner,
    WireError,
    decode,
    encode,
    is_detached,
    key_name,
    tag_frame,
)

__all__ = ["ServerConfig", "Server", "Slot", "main", "SECRET_ENV", "MAX_AHEAD", "MAX_PARKED", "MAX_PARKED_PER_CLIENT",
           "is_loopback"]

log = logging.getLogger("gradsync.ps")

#: the most workers an elastic barrier may count (each may then keep a last-heard time here)
MAX_ELASTIC_WORKERS = 1 << 16
#: the longest wait between two tries of a failing checkpoint write (seconds)
MAX_CHECKPOINT_BACKOFF_S = 60.0


@dataclass
class _ElasticBarrier:
    """The open barrier of an elastic store: who waits (sender -> (ident, req_id, session)), for how many workers."""

    count: int
    started: float
    number: int
    waiting: dict[int, tuple[bytes, int, int]] = field(default_factory=dict)


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
        _check_checkpoint_dir(config)  # before the bind: a bad directory leaves nothing open
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
        #: a random nonce per start: tells workers a restarted server from the old one, and (bound under the
        #: tag of every request) makes frames sent to the old one worthless to this one
        self.incarnation = secrets.randbits(63) | 1
        self.slots: dict[tuple[Key, int], Slot] = {}
        self.updater: Updater | None = None
        self.deferred: dict[tuple[Key, int], dict[tuple[bytes, int], Message]] = {}
        self.ordered: dict[bytes, _Ordered] = {}
        self.barriers: dict[int, dict[int, tuple[bytes, int, int]]] = {}
        #: elastic stores' barrier (one open at a time) and how many were released
        self.elastic_barrier: _ElasticBarrier | None = None
        self.elastic_barriers = 0
        #: requests held per client connection (parked pulls, barrier waits, ordered replies held back)
        self.parked: dict[bytes, int] = {}
        #: authenticated sessions: session -> last seq accepted (a frame not newer is a replay)
        self.sessions: dict[int, int] = {}
        self.job = config.job
        #: replies released by the request being handled: (frames, the slot a VALUE is sent from, if any)
        self.outbox: list[tuple[list[Any], Slot | None]] = []
        self.updates = 0
        self.updates_at_checkpoint = 0
        self.checkpointed_at = time.monotonic()
        self.stopping = False
        self.stats = {"requests": 0, "errors": 0, "rejected": 0, "replayed": 0, "stale": 0, "misrouted": 0,
                      "checkpoints": 0, "checkpoint_failures": 0}
        #: why the last checkpoint write failed (None: it did not), when to try again and the next backoff
        self.disk_error: str | None = None
        self._retry_at = 0.0
        self._backoff = config.checkpoint_retry_s
        #: bytes of stored values (the ``max_bytes`` cap)
        self.stored_bytes = 0
        #: requests handled per op name (STATUS reports them: which exchange the workers use)
        self.ops: dict[str, int] = {}
        #: when each client (sender id) was last heard from; elastic keys drop the silent ones
        self.seen: dict[int, float] = {}
        #: INIT requests with Flag.JOIN waiting for their key to be created: slot -> (ident, req) -> INIT
        self.joining: dict[tuple[Key, int], dict[tuple[bytes, int], Message]] = {}
        self._expired_at = 0.0
        #: requests whose tag follows on its own, per client connection (:class:`gradsync.ps.wire.TagJoiner`)
        self.joiner = TagJoiner(config.secret)
        try:
            self._restore()
        except BaseException:
            self.sock.close(linger=0)
            raise
        self.stored_bytes = sum(_nbytes(s.value) for s in self.slots.values())
        self._max_pushers = max((s.pushers for s in self.slots.values()), default=0)

    # ---- loop -----------------------------------------------------------------------------------
    def serve(self) -> None:
        # a blocking receive that gives up after 100 ms: one call per request (a poll, then receives until
        # zmq.Again, cost two more calls and an exception each), and the idle wake-ups check stopping and
        # the checkpoint interval
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        recv = self.sock.recv_multipart
        while not self.stopping:
            try:
                frames = recv(copy=False)
            except zmq.Again:
                self._expire()
                self._finish()
                continue
            self.handle(frames)
            self._expire()
            self._finish()
        if self.config.checkpoint_path is not None:
            self.checkpoint()  # a failure is logged and left in disk_error (main exits 1)
        self.sock.close(linger=1000)

    def _finish(self) -> None:
        """After each request: checkpoint if due, then send what it released (never the reverse)."""
        if self._checkpoint_due():
            self.checkpoint()
        for frames, source in self.outbox:
            self._send(frames, source)
        self.outbox.clear()

    def _send(self, frames: list[Any], source: Slot | None) -> None:
        """Send one reply without copying its payload; a payload that is ``source``'s stored value is
        tracked until ZeroMQ has sent it (see :meth:`Slot.writable`). Below pyzmq's ``copy_threshold`` it
        copies anyway (cheaper than tracking), and nothing needs to be tracked."""
        sock, body = self.sock, frames[2]
        if source is None or memoryview(body).nbytes < sock.copy_threshold:
            sock.send_multipart(frames, copy=False)
        else:
            last = len(frames) - 1
            if len(source.sending) >= 16:  # a value pulled often and pushed rarely: forget the replies gone
                source.sending = [t for t in source.sending if not t.done]
            for i, f in enumerate(frames):
                if i == 2:
                    source.sending.append(sock.send(f, zmq.SNDMORE if i < last else 0, copy=False, track=True))
                else:
                    sock.send(f, zmq.SNDMORE if i < last else 0, copy=False)
        if is_detached(frames[1:]):
            # the tag, hashed while the payload is on its way (the payload is not written until sent: above)
            sock.send_multipart([frames[0], tag_frame(frames[1:], self.config.secret)])

    def handle(self, frames: Sequence[Any]) -> None:
        """Process one request (``frames[0]`` is the ROUTER identity). Never raises for bad input."""
        if len(frames) < 2:
            self.stats["rejected"] += 1
            return
        ident = bytes(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
        for message, expected in self.joiner.feed(ident, [f.buffer if hasattr(f, "buffer") else f
                                                            for f in frames[1:]]):
            self._handle(ident, message, expected)

    def _handle(self, ident: bytes, frames: list[Any], expected: bytes | None) -> None:
        """One request, its tag joined (``frames`` without the identity; ``expected``: its MAC, if known)."""
        self.stats["requests"] += 1
        try:
            msg = decode(frames, secret=self.config.secret, max_payload=self.config.max_payload, expected=expected)
        except WireError as e:
            self._reject(ident, str(e))
            return
        if self.config.secret and not (self._addressed(ident, msg) and self._fresh(ident, msg)):
            return
        self.ops[msg.op.name] = self.ops.get(msg.op.name, 0) + 1
        # bounded: clients that some key counts, not any number sent; and with a secret only a frame bound
        # to this incarnation (a PING replayed from before a restart does not keep a dead client a member)
        if msg.sender < self._max_pushers and (not self.config.secret or msg.incarnation == self.incarnation):
            self.seen[msg.sender] = time.monotonic()
        try:
            self._check_job(msg)
            handler = _HANDLERS.get(msg.op)
            if handler is None:
                raise GradsyncError(f"op {msg.op.name} is a reply, not a request")
            handler(self, ident, msg)
        except GradsyncError as e:
            self.stats["errors"] += 1
            self._reply(ident, Op.ERROR, msg, payload=self._error_text(str(e)).encode())
        except Exception as e:  # noqa: BLE001 - a bug must not take the server (and every key) down
            self.stats["errors"] += 1
            log.exception("server %d: internal error on %s", self.config.server_id, msg.op.name)
            self._reply(ident, Op.ERROR, msg,
                        payload=self._error_text(f"internal server error: {type(e).__name__}: {e}").encode())

    def _error_text(self, why: str) -> str:
        """An ERROR reply's text: ``why``, and that the disk fails when it does (the worker may be about to
        decide whether to restart this server, and should know its checkpoint is stale)."""
        return why if self.disk_error is None else f"{why} (note: {self.disk_error}; it serves on from memory)"

    def _reject(self, ident: bytes, why: str, stat: str = "rejected") -> None:
        self.stats[stat] += 1
        log.warning("server %d: rejected a frame from %r: %s", self.config.server_id, ident, why)
        # unsigned: the sender may not hold the secret, and the reply carries no data, only why
        self.outbox.append(([ident, *encode(Op.ERROR, payload=f"rejected: {why}".encode(), flags=self._flags(),
                                            sender=self.config.server_id, incarnation=self.incarnation)], None))

    def _flags(self, flags: int = 0) -> Flag:
        """A reply's flags: ``flags``, plus ``DISK_FAILING`` while the checkpoint cannot be written."""
        return Flag(int(flags) | (int(Flag.DISK_FAILING) if self.disk_error is not None else 0))

    def _addressed(self, ident: bytes, msg: Message) -> bool:
        """Whether an authenticated frame is for this server and this run of it (``dest``, ``incarnation``):
        a copy of a frame sent to another server of the job, or to this one before it restarted, is not.
        A stale one gets a signed ``STALE`` ERROR carrying the current incarnation, so its client (if it is
        one, not a replayer) learns it and sends the request again."""
        if msg.dest != self.config.server_id:
            self._reject(ident, f"{msg.op.name} frame is addressed to server {msg.dest}, but this is server "
                                f"{self.config.server_id}: a copy of a frame sent to another server of the job, or "
                                f"a client whose server list ({SERVERS_ENV}) is not in --id order", "misrouted")
            return False
        if msg.incarnation == self.incarnation or (msg.incarnation == 0 and msg.op == Op.PING):
            return True
        self.stats["stale"] += 1
        log.warning("server %d: refused a %s frame of session %016x bound to incarnation %016x, not this run's "
                    "%016x (sent before a restart, or replayed)", self.config.server_id, msg.op.name, msg.session,
                    msg.incarnation, self.incarnation)
        self._reply(ident, Op.ERROR, msg, flags=Flag.STALE,
                    payload=f"{msg.op.name} frame is bound to incarnation {msg.incarnation:016x} of server "
                            f"{self.config.server_id}, which now runs as {self.incarnation:016x} (it restarted): "
                            f"sent before the restart, or replayed; send it again".encode())
        return False
    def _fresh(self, ident: bytes, msg: Message) -> bool:
        """Whether an authenticated frame is new: its session's seq must grow (a replayed copy does not)."""
        last = self.sessions.get(msg.session)
        if msg.session == 0:
            self._reject(ident, f"{msg.op.name} frame carries no session: this server needs each client's "
                                f"frames numbered (session, seq) under the tag")
            return False
        if last is not None and msg.seq <= last:
            self._reject(ident, f"replayed frame: {msg.op.name} with seq {msg.seq} of session {msg.session:016x}, "
                                f"which already reached seq {last} (a copy of an earlier frame)", "replayed")
            return False
        self.sessions[msg.session] = msg.seq
        return True

    def _check_job(self, msg: Message) -> None:
        """One server, one job: the first job id seen claims it; requests of another job are refused."""
        if msg.job == self.job:
            return
        if self.job == 0 and msg.job != 0:
            self.job = msg.job
            log.info("server %d: serving job %016x", self.config.server_id, self.job)
            return
        theirs = f"job {msg.job:016x}" if msg.job else "a process with no job id"
        raise GradsyncError(
            f"server {self.config.server_id} serves job {self.job:016x}, but this request is from {theirs}: two "
            f"jobs are pointed at one server and would share its keys and rounds. Give each job its own servers "
            f"(`gradsync launch` starts them), or set the same {JOB_ENV} in every process of one job")

    def _hold(self, ident: bytes, what: str) -> None:
        """Count one more request held for ``ident``, or refuse it past ``max_parked_per_client``."""
        n = self.parked.get(ident, 0)
        if n >= self.config.max_parked_per_client:
            raise GradsyncError(f"{what}: this client connection already has {n} requests waiting on server "
                                f"{self.config.server_id}, its limit (--max-parked-per-client, "
                                f"{MAX_PARKED_PER_CLIENT_ENV}); wait for replies before sending more")
        self.parked[ident] = n + 1

    def _unhold(self, ident: bytes, n: int = 1) -> None:
        left = self.parked.get(ident, 0) - n
        if left > 0:
            self.parked[ident] = left
        else:
            self.parked.pop(ident, None)

    def _ahead(self, slot: Slot, msg: Message, what: str) -> None:
        """Refuse a round more than ``max_ahead`` past the one the key is summing (``version + 1``)."""
        limit = slot.version + 1 + self.config.max_ahead
        if msg.version > limit:
            raise GradsyncError(
                f"{what} of key {key_name(msg.key)} names round {msg.version}, but the key is at round "
                f"{slot.version + 1}; server {self.config.server_id} holds at most {self.config.max_ahead} rounds "
                f"ahead (--max-ahead, {MAX_AHEAD_ENV}): a worker far ahead of the others, or a bad round number")

    def _reply(self, ident: bytes, op: Op, msg: Message | None = None, *, source: Slot | None = None,
               **kw: Any) -> None:
        """Queue a reply; ``source``: the slot whose stored value is its payload (sent without a copy)."""
        if msg is not None:
            kw.setdefault("key", msg.key)
            kw.setdefault("part", msg.part)
            kw.setdefault("parts", msg.parts)
            kw.setdefault("req_id", msg.req_id)
            kw.setdefault("session", msg.session)  # under the tag: the reply is bound to its asker's session
        kw.setdefault("sender", self.config.server_id)
        kw.setdefault("incarnation", self.incarnation)
        kw["flags"] = self._flags(kw.get("flags", 0))
        kw.setdefault("job", self.job)
        self.outbox.append(([ident, *encode(op, secret=self.config.secret, detach=True, **kw)], source))

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
        self._check_init_shape(msg)
        where = (msg.key, msg.part)
        existing = self.slots.get(where)  # type: ignore[arg-type]
        if existing is not None:  # idempotent: a retried init, or rank 0 re-running after a server restart
            self._check_tensor(existing, msg)
            self._join(ident, msg, existing)
            return
        if msg.flags & Flag.JOIN:  # wait for the key's creator (rank 0), as a parked pull waits for its round
            waiting = self.joining.setdefault(where, {})  # type: ignore[arg-type]
            if (ident, msg.req_id) in waiting:
                return
            if len(waiting) >= self.config.max_parked_per_key:
                raise GradsyncError(f"join of key {key_name(msg.key)}: {len(waiting)} joins already wait for it on "
                                    f"server {self.config.server_id}, the limit (--max-parked-per-key)")
            self._hold(ident, f"join of key {key_name(msg.key)}")
            waiting[(ident, msg.req_id)] = replace(msg, payload=b"")
            return
        self._check_capacity(msg)
        self._max_pushers = max(self._max_pushers, msg.count)
        slot = self.slots[where] = Slot(  # type: ignore[index]
            value=msg.tensor().clone(), shape=msg.shape, offset=msg.offset, parts=msg.parts,
            sync=bool(msg.flags & Flag.SYNC), pushers=msg.count, elastic=bool(msg.flags & Flag.ELASTIC))
        self.stored_bytes += _nbytes(slot.value)
        self.updates += 1
        self._force_checkpoint()
        self._reply(ident, Op.ACK, msg, version=0)
        for (who, _), joined in self.joining.pop(where, {}).items():  # type: ignore[arg-type]
            self._unhold(who)
            try:
                self._check_tensor(slot, joined)
                self._join(who, joined, slot)
            except GradsyncError as e:
                self._reply(who, Op.ERROR, joined, payload=str(e).encode())

    def _check_capacity(self, msg: Message) -> None:
        """Refuse a new slice past ``max_keys`` slices or ``max_bytes`` bytes of stored values."""
        cfg = self.config
        if len(self.slots) >= cfg.max_keys:
            raise GradsyncError(f"init of key {key_name(msg.key)}: server {cfg.server_id} already stores {len(self.slots)} "
                                f"key slices, its limit (--max-keys, {MAX_KEYS_ENV}); raise it, use more servers, or "
                                f"use fewer keys")
        size = msg.numel * msg.tensor().element_size()
        if self.stored_bytes + size > cfg.max_bytes:
            raise GradsyncError(f"init of key {key_name(msg.key)} ({size} bytes): server {cfg.server_id} stores "
                                f"{self.stored_bytes} bytes, and {self.stored_bytes + size} would pass its limit of "
                                f"{cfg.max_bytes} (--max-bytes, {MAX_BYTES_ENV}); raise it or use more servers")

    def _join(self, ident: bytes, msg: Message, slot: Slot) -> None:
        """Answer an INIT of an existing key with its version; an elastic key takes the sender back as a
        member (a restarted worker rejoining). Its first push names the round after that version, which
        is the round being summed, so that round now waits for it too."""
        if slot.elastic and 0 <= msg.sender < slot.pushers and msg.sender not in slot.members:
            slot.members.add(msg.sender)
            log.warning("server %d: client %d rejoined key %s at version %d", self.config.server_id, msg.sender,
                        key_name(msg.key), slot.version)
        self._reply(ident, Op.ACK, msg, version=slot.version)

    def _check_init_shape(self, msg: Message) -> None:
        """A whole key holds exactly its shape's elements; a sliced one fits ``parts`` frames of the limit."""
        total = 1
        for d in msg.shape:
            total *= d
        itemsize = msg.tensor().element_size()
        where = f"init of key {key_name(msg.key)}: shape {msg.shape}"
        if total > MAX_ELEMENTS:
            raise GradsyncError(f"{where} describes {total} elements, more than 2^63 - 1")
        if msg.parts == 1 and (msg.offset != 0 or msg.numel != total):
            raise GradsyncError(f"{where} holds {total} elements, but the frame carries {msg.numel} at offset "
                                f"{msg.offset}: send the whole tensor (or its parts with parts > 1)")
        if total * itemsize > msg.parts * self.config.max_payload:
            raise GradsyncError(f"{where} is {total * itemsize} bytes of {msg.dtype}; in {msg.parts} part(s) of at "
                                f"most {self.config.max_payload} bytes (this server's payload limit) it cannot be "
                                f"sent: use more servers or raise --max-payload")

    def on_push(self, ident: bytes, msg: Message) -> None:
        slot = self._slot(msg)
        self._apply_push(slot, msg)
        self._reply(ident, Op.ACK, msg, version=slot.version)
        self._release((msg.key, msg.part), slot)  # type: ignore[arg-type]

    def on_pushpull(self, ident: bytes, msg: Message) -> None:
        """The push, then the pull of its round (sync: answered when the round completes; async: at once,
        with the value this push produced). Everything that can refuse the pull is checked before the
        push is applied, except the parking caps, which only matter once the push is in: then the error
        says that the push was kept (a retry of the request is recognised as a repeat and not re-applied)."""
        slot = self._slot(msg)
        self._check_ordered(ident, msg)
        self._apply_push(slot, msg)
        try:
            if not slot.sync or slot.version >= msg.version:
                self._send_value(ident, msg, slot)
            else:  # parked as a plain pull: the push's payload is not kept while it waits
                self._answer_pull(ident, replace(msg, op=Op.PULL, dtype=None, numel=0, payload=b""), slot)
        except GradsyncError as e:
            raise GradsyncError(f"{e} (its push was applied: round {msg.version} of sender {msg.sender} is kept; "
                                f"pull the key to get its value)") from None
        finally:
            self._release((msg.key, msg.part), slot)  # type: ignore[arg-type]

    def _apply_push(self, slot: Slot, msg: Message) -> None:
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

    def _rule(self, slot: Slot) -> Updater:
        return self.updater or default_updater(slot.sync)

    def _push_async(self, slot: Slot, msg: Message) -> None:
        if msg.version <= slot.last_seq.get(msg.sender, 0):
            return  # a retry of a push already applied
        self._rule(slot).apply(slot.writable(), msg.tensor(), 1, slot.state)
        slot.last_seq[msg.sender] = msg.version
        slot.version += 1
        self.updates += 1

    def _push_sync(self, slot: Slot, msg: Message) -> None:
        r = msg.version
        if msg.sender not in slot.members:  # before the repeat test: its round may have completed without it
            raise GradsyncError(
                f"push to key {key_name(msg.key)} from client {msg.sender}, which server {self.config.server_id} "
                f"dropped from the key's rounds after {self.config.elastic_timeout_s:g} s without a frame from it "
                f"(elastic); the others went on without it. Rejoin: create the kvstore again and init the key")
        if r <= slot.version or (r == slot.version + 1 and msg.sender in slot.pending_from):
            return  # a retry of a push this server already holds
        if r > slot.version + 1:
            self._ahead(slot, msg, "push")
            slot.future.setdefault(r, {}).setdefault(msg.sender, msg.tensor().clone())
            return
        self._add_to_round(slot, msg.sender, msg.tensor())
        self._complete_rounds(slot)

    def _complete_rounds(self, slot: Slot) -> None:
        """Apply every round that has a push from each member (count: how many pushed it)."""
        while slot.pending is not None and slot.pending_from >= slot.members:
            slot.last_pushed = len(slot.pending_from)
            self._rule(slot).apply(slot.writable(), slot.pending, slot.last_pushed, slot.state)
            slot.version += 1
            self.updates += 1
            slot.pending, slot.pending_from = None, set()
            for sender, t in slot.future.pop(slot.version + 1, {}).items():
                if sender in slot.members:
                    self._add_to_round(slot, sender, t)

    @staticmethod
    def _add_to_round(slot: Slot, sender: int, t: torch.Tensor) -> None:
        if slot.pending is None:
            slot.pending = t.clone()
            slot.round_started = time.monotonic()
        else:
            slot.pending.add_(t)
        slot.pending_from.add(sender)

    def _expire(self) -> None:
        """Drop from elastic rounds the members that a started round has waited for, and that have been
        silent, for ``elastic_timeout_s``; complete the rounds that then have every member's push.
        Looks at most ten times a second."""
        now = time.monotonic()
        if now - self._expired_at < 0.1:
            return
        self._expired_at = now
        limit = self.config.elastic_timeout_s
        self._release_elastic_barrier(now)
        for where, slot in self.slots.items():
            if not slot.elastic or slot.pending is None or now - slot.round_started < limit:
                continue
            gone = [m for m in slot.missing() if now - self.seen.get(m, slot.round_started) >= limit]
            if not gone:
                continue
            slot.members.difference_update(gone)
            log.warning("server %d: dropped client(s) %s from key %s at round %d: nothing heard from them for "
                        "%.1f s; the round completes with the %d push(es) it has", self.config.server_id, gone,
                        key_name(where[0]), slot.version + 1, limit, len(slot.pending_from))
            self._complete_rounds(slot)
            self._release(where, slot)

    def on_pull(self, ident: bytes, msg: Message) -> None:
        slot = self._slot(msg)
        self._check_ordered(ident, msg)
        self._answer_pull(ident, msg, slot)

    def _check_ordered(self, ident: bytes, msg: Message) -> None:
        if int(msg.flags) & ORDERED_BIT:
            if msg.count < 1 or not 0 <= msg.priority < msg.count:
                raise GradsyncError(f"ordered pull of key {key_name(msg.key)}: priority {msg.priority} must be in "
                                    f"0..{msg.count - 1} (count={msg.count} ordered pulls per iteration)")
            if msg.count > self.config.max_parked_per_client:
                raise GradsyncError(f"ordered pull of key {key_name(msg.key)}: count={msg.count} ordered pulls per "
                                    f"iteration exceeds this server's limit of {self.config.max_parked_per_client} "
                                    f"held replies per client (--max-parked-per-client)")
            if self.parked.get(ident, 0) >= self.config.max_parked_per_client:
                self._hold(ident, f"ordered pull of key {key_name(msg.key)}")  # raises: its reply may be held

    def _answer_pull(self, ident: bytes, msg: Message, slot: Slot) -> None:
        """Send the value if the store has ``msg.version``, else park the pull until it has."""
        if slot.version >= msg.version:
            self._send_value(ident, msg, slot)
            return
        self._ahead(slot, msg, "pull")
        waiting = self.deferred.setdefault((msg.key, msg.part), {})  # type: ignore[arg-type]
        if (ident, msg.req_id) in waiting:
            return  # the same request again
        if len(waiting) >= self.config.max_parked_per_key:
            raise GradsyncError(f"pull of key {key_name(msg.key)}: {len(waiting)} pulls already wait for its next "
                                f"rounds on server {self.config.server_id}, the limit (--max-parked-per-key, "
                                f"{MAX_PARKED_ENV})")
        self._hold(ident, f"pull of key {key_name(msg.key)}")
        waiting[(ident, msg.req_id)] = msg

    def _release(self, where: tuple[Key, int], slot: Slot) -> None:
        waiting = self.deferred.get(where)
        if not waiting:
            return
        for (ident, req), msg in list(waiting.items()):
            if slot.version >= msg.version:
                del waiting[(ident, req)]
                self._unhold(ident)
                self._send_value(ident, msg, slot)

    def _send_value(self, ident: bytes, msg: Message, slot: Slot) -> None:
        if not int(msg.flags) & ORDERED_BIT:
            self._reply(ident, Op.VALUE, msg, source=slot, tensor=slot.value, shape=slot.shape, offset=slot.offset,
                        version=slot.version, pushed=slot.last_pushed)
            return
        state = self.ordered.get(ident)
        if state is None or state.n != msg.count or (msg.priority == 0 and state.next != 0):
            # a new batch; priority 0 while the counter is elsewhere means the sender abandoned its last
            # batch (an error or timeout on its side): start over rather than wait for replies never asked
            if state is not None:
                self._unhold(ident, len(state.ready))
            state = self.ordered[ident] = _Ordered(n=msg.count)
        frames = encode(Op.VALUE, key=msg.key, tensor=slot.value.clone(), shape=slot.shape, offset=slot.offset,
                        part=msg.part, parts=msg.parts, req_id=msg.req_id, session=msg.session, version=slot.version,
                        priority=msg.priority, pushed=slot.last_pushed, sender=self.config.server_id,
                        count=msg.count, incarnation=self.incarnation, flags=self._flags(),
                        secret=self.config.secret, detach=True)
        if msg.priority not in state.ready:
            self.parked[ident] = self.parked.get(ident, 0) + 1  # bounded: on_pull refused it past the cap
        state.ready[msg.priority] = frames
        while state.next in state.ready:
            self.outbox.append(([ident, *state.ready.pop(state.next)], None))
            self._unhold(ident)
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
        if msg.flags & Flag.ELASTIC:
            self._elastic_barrier(ident, msg)
            return
        if msg.version not in self.barriers and len(self.barriers) >= self.config.max_parked_per_key:
            raise GradsyncError(f"barrier {msg.version}: {len(self.barriers)} barriers are already open on server "
                                f"{self.config.server_id}, the limit (--max-parked-per-key, {MAX_PARKED_ENV})")
        waiting = self.barriers.setdefault(msg.version, {})
        if msg.sender in waiting:
            self._unhold(waiting[msg.sender][0])  # the same worker again (a retry, or a new connection)
        try:
            self._hold(ident, f"barrier {msg.version}")
        except GradsyncError:
            waiting.pop(msg.sender, None)
            if not waiting:
                del self.barriers[msg.version]
            raise
        waiting[msg.sender] = (ident, msg.req_id, msg.session)
        if len(waiting) == msg.count:
            for who, req_id, session in self.barriers.pop(msg.version).values():
                self._unhold(who)
                self._reply(who, Op.ACK, version=msg.version, req_id=req_id, session=session)

    def _elastic_barrier(self, ident: bytes, msg: Message) -> None:
        """An elastic store's barrier: released once every worker has arrived that has not been silent for
        ``elastic_timeout_s`` (the rule that drops it from sync rounds), so survivors go on without a dead
        worker and a restarted one, whose own barrier count starts again, meets the others at their next
        barrier. The server numbers the barriers; one is open at a time."""
        if msg.count > MAX_ELASTIC_WORKERS:
            raise GradsyncError(f"elastic barrier of {msg.count} workers: at most {MAX_ELASTIC_WORKERS}")
        now = time.monotonic()
        open_ = self.elastic_barrier
        if open_ is None:
            open_ = self.elastic_barrier = _ElasticBarrier(msg.count, now, self.elastic_barriers + 1)
        elif open_.count != msg.count:
            raise GradsyncError(f"elastic barrier: worker {msg.sender} counts {msg.count} workers, the open barrier "
                                f"{open_.count} (every worker of a job gives the same num_workers)")
        if msg.sender in open_.waiting:
            self._unhold(open_.waiting.pop(msg.sender)[0])  # the same worker again (a retry, a new connection)
        try:
            self._hold(ident, f"barrier {open_.number}")
        except GradsyncError:
            if not open_.waiting:
                self.elastic_barrier = None
            raise
        open_.waiting[msg.sender] = (ident, msg.req_id, msg.session)
        self._max_pushers = max(self._max_pushers, msg.count)  # its workers' heartbeats now count as signs of life
        self.seen[msg.sender] = now
        self._release_elastic_barrier(now)

    def _release_elastic_barrier(self, now: float) -> None:
        open_ = self.elastic_barrier
        if open_ is None:
            return
        limit = self.config.elastic_timeout_s
        absent = [s for s in range(open_.count) if s not in open_.waiting]
        if any(now - self.seen.get(s, open_.started) < limit for s in absent):
            return
        if absent:
            log.warning("server %d: barrier %d released without worker(s) %s: nothing heard from them for %.1f s",
                        self.config.server_id, open_.number, absent, limit)
        self.elastic_barrier, self.elastic_barriers = None, open_.number
        for who, req_id, session in open_.waiting.values():
            self._unhold(who)
            self._reply(who, Op.ACK, version=open_.number, req_id=req_id, session=session)

    def on_status(self, ident: bytes, msg: Message) -> None:
        if msg.key is not None:
            info = [{"part": p, "version": s.version, "sync": s.sync, "pushers": s.pushers, "elastic": s.elastic,
                     "members": sorted(s.members), "pushed": sorted(s.pending_from),
                     "missing": s.missing() if s.sync else []}
                    for (k, p), s in self.slots.items() if k == msg.key]
        else:
            info = {"server": self.config.server_id, "keys": len({k for k, _ in self.slots}), "slots": len(self.slots),
                    "bytes": self.stored_bytes, "updates": self.updates,
                    "updater": describe(self.updater) if self.updater else None, "ops": dict(self.ops),
                    "disk": self.disk_error, **self.stats}
        self._reply(ident, Op.INFO, msg, json_payload=info)

    def on_ping(self, ident: bytes, msg: Message) -> None:
        self._reply(ident, Op.ACK, msg)

    def on_checkpoint(self, ident: bytes, msg: Message) -> None:
        if self.config.checkpoint_path is None:
            raise GradsyncError("this server has no checkpoint directory (start it with --checkpoint-dir)")
        if not self.checkpoint():
            raise GradsyncError(f"checkpoint not written: {self.disk_error}")
        self._reply(ident, Op.ACK, msg)

    def on_shutdown(self, ident: bytes, msg: Message) -> None:
        if not self.config.secret:
            log.warning("server %d: refused SHUTDOWN from %r: no shared secret, so the peer is not authenticated",
                        self.config.server_id, ident)
            raise GradsyncError(f"SHUTDOWN refused: server {self.config.server_id} has no shared secret, so it cannot "
                                f"tell who asks; stop it with SIGTERM, or start it with {SECRET_ENV} set")
        log.warning("server %d: SHUTDOWN by an authenticated peer %r (session %016x)", self.config.server_id, ident,
                    msg.session)
        self.stopping = True
        self._reply(ident, Op.ACK, msg)

    # ---- checkpoints ----------------------------------------------------------------------------
    def _checkpoint_due(self) -> bool:
        cfg = self.config
        if cfg.checkpoint_path is None or self.updates == self.updates_at_checkpoint:
            return False
        if self.disk_error is not None and time.monotonic() < self._retry_at:
            return False  # backing off: the disk failed the last try
        if cfg.checkpoint_every and self.updates - self.updates_at_checkpoint >= cfg.checkpoint_every:
            return True
        return bool(cfg.checkpoint_interval_s) and time.monotonic() - self.checkpointed_at >= cfg.checkpoint_interval_s

    def _force_checkpoint(self) -> None:
        if self.config.checkpoint_path is not None:
            self.updates_at_checkpoint = -1  # due now, whatever the interval

    def checkpoint(self) -> bool:
        """Write every slot (value, version, optimizer state) atomically: tmp file, fsync, rename. Whether it
        was written: a disk that fails it (full, read-only) is logged, remembered in ``disk_error`` (which
        replies then report) and tried again after a backoff; the server serves on from memory."""
        path = self.config.checkpoint_path
        if path is None:
            return True
        try:
            write_checkpoint(path, self.slots, server_id=self.config.server_id, updater=self.updater, job=self.job,
                             sessions=self.sessions)
        except OSError as e:
            self._disk_failed(path, e)
            return False
        if self.disk_error is not None:
            log.warning("server %d: checkpoint %s written again; the disk works", self.config.server_id, path)
            self.disk_error, self._backoff = None, self.config.checkpoint_retry_s
        self.updates_at_checkpoint = self.updates
        self.checkpointed_at = time.monotonic()
        self.stats["checkpoints"] += 1
        return True

    def _disk_failed(self, path: os.PathLike[str], e: OSError) -> None:
        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        self.stats["checkpoint_failures"] += 1
        self.disk_error = f"server {self.config.server_id} cannot write its checkpoint {path}: {e.strerror or e} ({code})"
        self._retry_at = time.monotonic() + self._backoff
        log.error("%s; serving on from memory (what it acknowledged since its last checkpoint is only there), "
                  "next try in %.3g s", self.disk_error, self._backoff)
        self._backoff = min(self._backoff * 2, MAX_CHECKPOINT_BACKOFF_S)

    def _restore(self) -> None:
        path = self.config.checkpoint_path
        if path is None:
            return
        restored = read_checkpoint(path, self.config.server_id, self.job)
        if restored is None:
            return
        self.job, self.sessions, self.updater = restored.job, restored.sessions, restored.updater
        self.slots.update(restored.slots)
        self.updates = self.updates_at_checkpoint = 0
        log.info("server %d: restored %d slots from %s", self.config.server_id, len(self.slots), path)


_HANDLERS = {
    Op.INIT: Server.on_init, Op.PUSH: Server.on_push, Op.PULL: Server.on_pull, Op.PUSHPULL: Server.on_pushpull,
    Op.SET_OPTIMIZER: Server.on_set_optimizer,
    Op.BARRIER: Server.on_barrier, Op.STATUS: Server.on_status, Op.PING: Server.on_ping,
    Op.CHECKPOINT: Server.on_checkpoint, Op.SHUTDOWN: Server.on_shutdown,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_checkpoint_dir(config: ServerConfig) -> None:
    """Refuse a ``checkpoint_dir`` that is not a directory this process can write to (at start, not at
    the first checkpoint, by which time the job has run for a while)."""
    if config.checkpoint_dir is None:
        return
    where = config.checkpoint_dir
    try:
        os.makedirs(where, exist_ok=True)
    except FileExistsError:
        raise GradsyncError(f"--checkpoint-dir {where!r} is a file, not a directory; give a directory "
                            f"(it is created if missing)") from None
    except OSError as e:
        raise GradsyncError(f"--checkpoint-dir {where!r} cannot be created: {e.strerror}; give a writable "
                            f"directory") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".gradsync-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise GradsyncError(f"--checkpoint-dir {where!r} is not writable: {e.strerror}; give a directory this "
                            f"server can write its checkpoint to") from None


def main(argv: Sequence[str] | None = None) -> int:
    a = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.threads < 1:
        print(f"gradsync-ps: --threads {a.threads} must be >= 1", file=sys.stderr)
        return 2
    # The loop is one thread, and an update is a memory-bound add or copy. With torch's default pool, every
    # update of more than ~32k elements wakes one thread per core, which then spin-wait after it: CPU time
    # (many times one thread's) taken from the workers beside the server.
    torch.set_num_threads(a.threads)
    try:
        config = config_from_args(a)
        server = Server(config)
    except GradsyncError as e:
        print(f"gradsync-ps: {e}", file=sys.stderr)
        return 2
    if not config.secret:
        log.warning("server %d: no shared secret (%s): any local process can use this server", a.id, SECRET_ENV)

    def stop(signum: int, frame: Any) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"gradsync-ps server {a.id} listening on {server.endpoint}", flush=True)
    server.serve()
    if server.disk_error is not None:
        print(f"gradsync-ps: stopped without a final checkpoint: {server.disk_error}; what it held since its "
              f"last checkpoint is lost", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
