"""The worker side of the parameter server: key placement, requests, replies, retries and failures.

:func:`place` decides where a key lives: a small key goes whole to one server (by a stable hash of its
name); a key of ``slice_bytes`` or more is cut into contiguous parts, as many on every server, so a large
tensor loads every server equally (BML §4.2: whole-tensor placement leaves servers unbalanced); and
no message carries more than ``part_bytes`` of it (:data:`PART_BYTES`).

:class:`PSClient` holds one DEALER socket per server and sends a batch of requests before waiting for
any reply, so the parts of a key (and the keys of a batch) travel to all servers at once. A request with
no reply after ``retry_s`` makes the client PING that server; every reply carries the server's
incarnation, and when it changes (the server restarted from its checkpoint) the requests in flight and
the synchronous pushes that server may have lost are sent again (ordered pulls renumbered 0..m-1 over
what is still outstanding, since the new process's per-sender counter starts from zero). Servers recognise repeats (pushes name their round, pulls their request id), so
retrying is safe. After ``timeout_s`` the client probes the server once (at most ``min(2, retry_s)`` more
seconds): if a round still waits for pushes it raises :class:`~gradsync.errors.PeerError` naming the first
missing client; if the server does not answer, :class:`~gradsync.errors.CommError` naming its endpoint.

Frames are built untagged and sealed when sent (:func:`gradsync.ps.wire.seal`): each send gets the next
number of this client's random session, the index of the server it goes to and that server's incarnation
as last heard (0 before the first reply: only a PING is accepted so), under the tag when there is a
secret, so a retry is a new frame and a captured copy replayed later, to the same server after a restart or
to another server, is refused. A server with a secret refuses a request bound to an incarnation it is not
with a ``STALE`` ERROR carrying its own, and the client sends the request again. Every frame carries the
job id.

A server whose checkpoint writes fail says so in every reply (``Flag.DISK_FAILING``): the client then asks
its STATUS once, keeps the reason in :attr:`PSClient.notices` and warns (``RuntimeWarning``) naming the
server, the file and the OS error; a later timeout's error repeats it.

Requests travel in batches: :meth:`PSClient.start` sends one and returns a :class:`Batch`, and
:meth:`PSClient.wait` pumps the sockets until a predicate holds (by default: the batch is complete). Every
reply is handled when it arrives, whichever batch is being waited for, so a worker can start a multi-key
pull, wait for the first keys only and compute while ZeroMQ's I/O thread receives the rest
(:meth:`gradsync.ps.kvstore.PSKVStore.pull_async`). Single-threaded on purpose: no lock, no reply thread,
and ``call`` (start + wait for all) behaves as it always did.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from gradsync.errors import CommError, GradsyncError, PeerError
from gradsync.ps.wire import Flag, Key, Message, Op, TagJoiner, WireError, decode, encode, is_detached, seal, tag_frame

__all__ = ["Batch", "Heartbeat", "Part", "place", "PSClient", "Request", "SLICE_BYTES", "PART_BYTES", "flat_view"]

#: Keys of at least this many bytes are sliced over all servers (MXNet's bigarray bound is 1M elements).
SLICE_BYTES = 1 << 20
#: Largest part (bytes) of a key in one message. ZeroMQ receives a message into a fresh allocation, and
#: above glibc's largest mmap threshold (32 MiB) every one is fresh memory: a 64 MiB round trip on loopback
#: spent much of its CPU in page faults (perf), far less with 4 MiB parts, whose buffers are reused.
#: Parts also pipeline: a server works on one while the next travels.
PART_BYTES = 4 << 20


@dataclass(frozen=True)
class Part:
    """Elements ``[offset, offset + numel)`` of a key's flattened tensor, stored on ``server``."""

    server: int
    part: int
    parts: int
    offset: int
    numel: int


def place(key: Key, numel: int, itemsize: int, num_servers: int, slice_bytes: int = SLICE_BYTES,
          part_bytes: int = PART_BYTES) -> list[Part]:
    """Where each part of ``key`` lives: whole on one server; or, from ``slice_bytes``, cut into equal
    contiguous parts, the same number on every server; and never a part of more than ``part_bytes``
    (then several per server, dealt round robin from the key's first server)."""
    if num_servers < 1:
        raise GradsyncError(f"num_servers={num_servers}: a PS key store needs at least one server")
    if part_bytes < 1:
        raise GradsyncError(f"part_bytes={part_bytes} must be >= 1")
    first = zlib.crc32(f"{type(key).__name__}:{key}".encode()) % num_servers
    nbytes = numel * itemsize
    chunks = -(-nbytes // part_bytes)  # parts needed to stay within part_bytes
    sliced = num_servers > 1 and nbytes >= slice_bytes and numel >= num_servers
    if sliced:
        n = num_servers * -(-chunks // num_servers)
    else:
        n = chunks
    n = max(1, min(n, numel))
    if n == 1:
        return [Part(first, 0, 1, 0, numel)]
    base, extra = divmod(numel, n)
    parts, offset = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        parts.append(Part((first + i) % num_servers, i, n, offset, size))
        offset += size
    return parts


@dataclass
class Request:
    """One request in flight: where it went, its frames (unsealed, to re-send), and what to do with the reply.

    ``op`` and ``fields`` are kept so the request can be encoded again with changed fields (an ordered
    pull renumbered for a restarted server)."""

    server: int
    frames: list[Any]
    req_id: int
    what: str
    on_reply: Callable[[Message], None] | None = None
    sent_at: float = 0.0
    key: Key | None = None
    part: int = 0
    op: Op | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    batch: Batch | None = None
    #: the server incarnation its last send was bound to (0: none known then)
    sent_incarnation: int = 0

    @property
    def ordered(self) -> bool:
        return self.op in (Op.PULL, Op.PUSHPULL) and bool(Flag(self.fields.get("flags", Flag.NONE)) & Flag.ORDERED)


@dataclass
class Batch:
    """Requests started together: which are still outstanding, their deadline, and the first failure.

    A failure is kept here (not raised into whoever happens to be pumping the sockets) and raised by the
    next :meth:`PSClient.wait` on this batch, so an asynchronous pull's error reaches its own waiter."""

    ids: set[int]
    requests: dict[int, Request]
    started: float
    timeout_s: float
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Every reply is in (or the batch failed)."""
        return not self.ids or self.error is not None

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    def outstanding(self) -> list[Request]:
        return [self.requests[i] for i in sorted(self.ids)]


class PSClient:
    """Talks to the servers at ``endpoints`` as PS sender ``sender``. Not thread-safe: one per thread."""

    def __init__(self, endpoints: Sequence[str], sender: int, *, secret: bytes | None = None, timeout_s: float = 60.0,
                 retry_s: float = 2.0, context: zmq.Context | None = None, job: int = 0) -> None:
        if not endpoints:
            raise GradsyncError("no PS server endpoints: set GRADSYNC_PS_SERVERS or start with `gradsync launch`")
        if timeout_s <= 0 or retry_s <= 0:
            raise GradsyncError(f"timeout_s={timeout_s} and retry_s={retry_s} must be > 0")
        self.endpoints = list(endpoints)
        self.sender = sender
        self.secret = secret
        self.job = job
        #: this client's random session and the number of its next frame (the server's replay check)
        self.session = secrets.randbits(64) | 1
        self._seq = itertools.count(1)
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.ctx = context or zmq.Context.instance()
        self.socks: list[zmq.Socket] = []
        self.poller = zmq.Poller()
        for ep in self.endpoints:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            self.socks.append(s)
            try:
                s.connect(ep)
            except zmq.ZMQError as e:
                for opened in self.socks:
                    opened.close(linger=0)
                raise GradsyncError(f"PS server endpoint {ep!r} cannot be connected to: {e}; write e.g. "
                                    f"tcp://127.0.0.1:5555 (check GRADSYNC_PS_SERVERS)") from None
            self.poller.register(s, zmq.POLLIN)
        self._ids = itertools.count(1)
        #: every request sent and not yet answered, over all batches: req_id -> request
        self.inflight: dict[int, Request] = {}
        #: signed replies bound to another client's session, ignored (a replay; logged once)
        self.foreign_replies = 0
        self.incarnation: list[int | None] = [None] * len(self.endpoints)
        #: sync pushes a restarted server may have lost: (server, key, part) -> (round, frames)
        self.retained: dict[tuple[int, Key, int], tuple[int, list[Any]]] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        #: replies whose tag follows on its own, per server (:class:`gradsync.ps.wire.TagJoiner`)
        self.joiner = TagJoiner(secret)
        #: what servers reported about themselves (a failing checkpoint disk), by server
        self.notices: dict[int, str] = {}
        #: servers whose STATUS was asked for because a reply flagged a failing disk
        self._asked: set[int] = set()

    def connect(self) -> None:
        """Wait until every server answers a PING (learning its incarnation); a clear error if one is down."""
        self.call([self.request(i, Op.PING, what=f"connecting to server {i} at {ep}")
                   for i, ep in enumerate(self.endpoints)])

    @property
    def num_servers(self) -> int:
        return len(self.socks)

    def request(self, server: int, op: Op, *, what: str, on_reply: Callable[[Message], None] | None = None,
                **fields: Any) -> Request:
        """Build (not send) one request to ``server``."""
        req_id = next(self._ids)
        fields.setdefault("sender", self.sender)
        frames = encode(op, req_id=req_id, job=self.job, session=self.session, **fields)
        return Request(server, frames, req_id, what, on_reply, key=fields.get("key"), part=fields.get("part", 0),
                       op=op, fields=fields)

    def retain(self, req: Request, round_: int) -> None:
        """Keep a sync push (a private copy of its frames) until the round's value has been pulled."""
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in req.frames]
        self.retained[(req.server, req.key, req.part)] = (round_, frames)  # type: ignore[index]

    def release(self, server: int, key: Key, part: int, version: int) -> None:
        held = self.retained.get((server, key, part))
        if held is not None and held[0] <= version:
            del self.retained[(server, key, part)]

    def _send(self, server: int, frames: list[Any]) -> int:
        """Seal and send one request, bound to ``server`` and its incarnation as known now (returned); a large
        one's tag goes after it (hashed while the payload travels)."""
        incarnation = self.incarnation[server] or 0
        frames = seal(frames, seq=next(self._seq), secret=self.secret, detach=True, dest=server,
                      incarnation=incarnation)
        sock = self.socks[server]
        sock.send_multipart(frames, copy=False)
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        if is_detached(frames):
            mac = tag_frame(frames, self.secret)
            sock.send(mac, copy=True)
            self.bytes_sent += len(mac)
        return incarnation

    def call(self, requests: Sequence[Request], timeout_s: float | None = None) -> None:
        """Send every request, then wait for all replies (running each ``on_reply``). Raises on errors."""
        self.wait(self.start(requests, timeout_s))

    def start(self, requests: Sequence[Request], timeout_s: float | None = None) -> Batch:
        """Send every request now and return their :class:`Batch`; replies are handled by later waits."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise GradsyncError(f"timeout_s={timeout} must be > 0")
        now = time.monotonic()
        batch = Batch(ids={r.req_id for r in requests}, requests={r.req_id: r for r in requests}, started=now,
                      timeout_s=timeout)
        for r in requests:
            r.sent_at = now
            r.batch = batch
            self.inflight[r.req_id] = r
            r.sent_incarnation = self._send(r.server, r.frames)
        return batch

    def wait(self, batch: Batch, until: Callable[[], bool] | None = None) -> None:
        """Pump the sockets until ``until()`` holds (default: ``batch`` is complete); raise the batch's error.

        Replies of other batches are handled on the way. Past the batch's deadline the outstanding requests
        are abandoned and :class:`CommError` (or :class:`PeerError`, naming a missing client) is raised."""
        done = until or (lambda: not batch.ids)
        while True:
            if batch.error is not None:
                self._abandon(batch)
                raise batch.error
            if done():
                return
            if not batch.ids:
                raise GradsyncError("wait: the batch is complete but the condition waited for never held "
                                    "(a key that is not part of this batch?)")
            now = time.monotonic()
            if now >= batch.deadline:
                left = batch.outstanding()
                self._abandon(batch)
                self._timed_out(left, batch.timeout_s)
            self.progress(min(batch.deadline - now, self.retry_s))

    def progress(self, wait_s: float = 0.0) -> None:
        """Handle every reply that arrives within ``wait_s`` seconds (0: only what is already here), then
        PING the servers that have been quiet for ``retry_s`` while holding our requests."""
        for sock, _ in self.poller.poll(max(1, int(wait_s * 1000)) if wait_s > 0 else 0):
            server = self.socks.index(sock)
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # not recv until zmq.Again: an exception each time
                self._on_frames(server, sock.recv_multipart(zmq.NOBLOCK, copy=False))
        now = time.monotonic()
        quiet = {r.server for r in self.inflight.values() if now - r.sent_at >= self.retry_s}
        for server in quiet:  # is it still the same server process? its ACK says (see _on_frames)
            self._send(server, self.request(server, Op.PING, what="ping").frames)
            for r in self.inflight.values():
                if r.server == server:
                    r.sent_at = now

    def _abandon(self, batch: Batch) -> None:
        """Forget a failed batch's outstanding requests: their late replies are then ignored."""
        for i in batch.ids:
            self.inflight.pop(i, None)
        batch.ids.clear()

    def _on_frames(self, server: int, frames: list[Any]) -> None:
        self.bytes_received += sum(f.buffer.nbytes for f in frames)
        for message, expected in self.joiner.feed(server, [f.buffer for f in frames]):
            self._on_message(server, message, expected)

    def _on_message(self, server: int, frames: list[Any], expected: bytes | None) -> None:
        try:
            msg = decode(frames, secret=self.secret, expected=expected)
        except WireError as e:
            try:  # the server's own rejection of our frame is unsigned: report why it refused
                plain = decode(frames[:2])
            except WireError:
                plain = None
            if plain is not None and plain.op == Op.ERROR and plain.req_id == 0:
                raise CommError(f"server {server} rejected a request: {plain.text()}") from None
            raise CommError(f"server {server} ({self.endpoints[server]}) sent an invalid reply: {e}") from None
        if self.secret and msg.req_id and msg.session != self.session:
            # signed, but answering another client's request (a captured reply sent here): not ours
            self.foreign_replies += 1
            if self.foreign_replies == 1:
                warnings.warn(f"gradsync: ignored a signed reply from server {server} bound to session "
                              f"{msg.session:016x}, not this client's {self.session:016x} (a reply to another "
                              f"client, sent here again)", RuntimeWarning, stacklevel=2)
            return
        if msg.incarnation and self.incarnation[server] != msg.incarnation:
            restarted = self.incarnation[server] is not None
            self.incarnation[server] = msg.incarnation
            self._asked.discard(server)
            if restarted:  # it lost what it had not checkpointed, and every request we had in flight
                self._resend_retained(server)
                self._resend_inflight(server)
        if msg.flags & Flag.DISK_FAILING:
            self._ask_why(server)
        elif server in self.notices and msg.incarnation:
            del self.notices[server]  # it wrote a checkpoint again
            self._asked.discard(server)
        req = self.inflight.get(msg.req_id)
        if msg.op == Op.ERROR and msg.flags & Flag.STALE:
            # our request named an incarnation the server no longer runs as (it restarted before we heard):
            # not a failure; send it again bound to the one this reply carries, unless that was done
            if req is not None and req.sent_incarnation != self.incarnation[server]:
                req.sent_incarnation = self._send(server, req.frames)
            return
        if msg.op == Op.ERROR:
            if req is None and msg.req_id == 0:
                raise CommError(f"server {server} rejected a request: {msg.text()}")
            if req is None:
                return
            del self.inflight[msg.req_id]
            self._fail(req, GradsyncError(f"server {server}: {req.what} failed: {msg.text()}"))
            return
        if req is None:
            return  # a duplicate reply to a retried request, or a PING's ACK
        del self.inflight[msg.req_id]
        if req.batch is not None:
            req.batch.ids.discard(req.req_id)
        if req.on_reply is not None:
            try:
                req.on_reply(msg)
            except Exception as e:  # noqa: BLE001 - raised by the waiter of this request's batch
                self._fail(req, e)

    def _ask_why(self, server: int) -> None:
        """Ask ``server`` once (per incarnation) for its STATUS, whose ``disk`` says why its checkpoint writes
        fail; the answer is kept in :attr:`notices` and warned about. Nobody waits for it."""
        if server in self._asked:
            return
        self._asked.add(server)

        def noted(m: Message) -> None:
            info = m.json()
            disk = info.get("disk") if isinstance(info, dict) else None
            if disk and self.notices.get(server) != disk:
                self.notices[server] = disk
                warnings.warn(f"PS server {server} ({self.endpoints[server]}) reports: {disk}. It serves on from "
                              f"memory, but what it acknowledged since its last checkpoint would be lost if it "
                              f"stopped now: free or fix that disk", RuntimeWarning, stacklevel=2)

        probe = self.request(server, Op.STATUS, what=f"status of server {server}", on_reply=noted)
        probe.batch = Batch(ids={probe.req_id}, requests={probe.req_id: probe}, started=time.monotonic(),
                            timeout_s=self.timeout_s)  # its own: an error in it is nobody's failure
        self.inflight[probe.req_id] = probe
        probe.sent_incarnation = self._send(server, probe.frames)

    @staticmethod
    def _fail(req: Request, error: BaseException) -> None:
        if req.batch is None:
            raise error
        req.batch.ids.discard(req.req_id)
        if req.batch.error is None:
            req.batch.error = error

    def _resend_inflight(self, server: int) -> None:
        """Send again what a restarted ``server`` lost. Ordered pulls are renumbered 0..m-1 (in their old
        order) over the m still outstanding per batch: the new process's counter starts at 0 and would
        otherwise wait forever for priorities it already answered before the crash."""
        mine = [r for _, r in sorted(self.inflight.items()) if r.server == server]
        by_batch: dict[int, list[Request]] = {}
        for r in mine:
            if r.ordered:
                by_batch.setdefault(id(r.batch), []).append(r)
        for group in by_batch.values():
            group.sort(key=lambda q: q.fields.get("priority", 0))
            for rank, r in enumerate(group):
                r.fields.update(priority=rank, count=len(group))
                r.frames = encode(r.op, req_id=r.req_id, job=self.job, session=self.session, **r.fields)
        for r in mine:
            r.sent_incarnation = self._send(server, r.frames)

    def _resend_retained(self, server: int) -> None:
        for (srv, _key, _part), (_round, frames) in self.retained.items():
            if srv == server:
                self._send(server, frames)

    def _probe(self, server: int, key: Key | None, wait_s: float) -> tuple[bool, Any]:
        """Ask ``server`` once, within ``wait_s``, whether it is alive: (answered, STATUS payload or None).

        A STATUS about ``key`` when there is one (it says which pushes a round still waits for), else a PING.
        It pumps the sockets itself and never goes through :meth:`wait`: a probe that times out must not
        start another probe (it once recursed until Python's recursion limit)."""
        info: list[Any] = []
        if key is None:
            probe = self.request(server, Op.PING, what="ping", on_reply=lambda m: info.append(None))
        else:
            probe = self.request(server, Op.STATUS, what="status", key=key, on_reply=lambda m: info.append(m.json()))
        self.inflight[probe.req_id] = probe
        deadline = time.monotonic() + wait_s
        try:
            self._send(server, probe.frames)
            while not info and probe.req_id in self.inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.progress(left)
        except GradsyncError:  # the server's ERROR reply: it is alive, but says nothing about the round
            return True, None
        except CommError:  # an invalid reply: treat as no answer
            return False, None
        finally:
            self.inflight.pop(probe.req_id, None)
        return bool(info), (info[0] if info else None)

    def _timed_out(self, pending: Sequence[Request], timeout: float) -> None:
        """Raise the error for requests unanswered after ``timeout``: a missing client (PeerError) if the
        server says a round waits for one, else CommError naming the server, its endpoint and what to check.
        Takes at most ``min(2, retry_s, timeout)`` more seconds (one probe), so a failure is reported within
        twice the request timeout."""
        r = min(pending, key=lambda q: q.req_id)
        where = f"server {r.server} at {self.endpoints[r.server]}"
        probe_s = min(2.0, self.retry_s, timeout)
        answered, info = self._probe(r.server, r.key, probe_s)
        detail, missing = "", []
        if not answered:
            detail = (f"; {where} did not answer a probe within {probe_s:.1f} s either: is it still running? "
                      f"(check its process and log; a crashed server must be restarted, from its checkpoint if it "
                      f"wrote one, or the job started again)")
        else:
            slots = [s for s in info if s.get("part") == r.part] if isinstance(info, list) else []
            if slots and slots[0].get("missing"):
                missing = slots[0]["missing"]
                detail = (f"; the server's round {slots[0]['version'] + 1} still waits for pushes from "
                          f"client(s) {missing} (crashed or stalled?)")
            else:
                detail = f"; {where} is alive but did not answer in time (overloaded? raise the timeout)"
        if r.server in self.notices:
            detail += f"; it reported earlier: {self.notices[r.server]}"
        message = (f"{r.what}: no reply from {where} within {timeout:.1f} s "
                   f"({len(pending)} request(s) outstanding){detail}")
        if missing:
            raise PeerError(message, peer=int(missing[0]))
        raise CommError(message)

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.socks.clear()
        self.inflight.clear()


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of a contiguous tensor (the layout parts are cut from)."""
    if not t.is_contiguous():
        raise GradsyncError(f"PS tensors must be contiguous (got a tensor with strides {t.stride()}); "
                            f"pass t.contiguous()")
    return t.reshape(-1)


class Heartbeat:
    """PINGs every server each ``interval_s`` from a thread of its own (own sockets and session), so that
    servers keep an elastic client as a member while its main thread computes for longer than their
    timeout; a killed or hung process stops beating and is dropped. Replies are read only for the
    server's incarnation, which a beat must carry to count (a beat replayed after a restart does not)."""

    def __init__(self, endpoints: Sequence[str], sender: int, *, interval_s: float, secret: bytes | None = None,
                 job: int = 0, context: zmq.Context | None = None) -> None:
        if not interval_s > 0:
            raise GradsyncError(f"heartbeat interval_s={interval_s} must be > 0")
        self.endpoints, self.sender, self.interval_s = list(endpoints), sender, interval_s
        self.secret, self.job = secret, job
        self.ctx = context or zmq.Context.instance()
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gradsync-ps-heartbeat-{sender}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socks = []
        try:
            for ep in self.endpoints:
                s = self.ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 4)  # a server that is down: a few beats queue, the rest are dropped
                s.connect(ep)
                socks.append(s)
            session, seq = secrets.randbits(64) | 1, itertools.count(1)
            incarnations = [0] * len(socks)  # learned from the ACKs: a beat counts only bound to one
            while True:
                for i, s in enumerate(socks):
                    while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        incarnations[i] = _incarnation(s.recv_multipart(zmq.NOBLOCK), self.secret) or incarnations[i]
                    frames = seal(encode(Op.PING, sender=self.sender, job=self.job, session=session),
                                  seq=next(seq), secret=self.secret, dest=i, incarnation=incarnations[i])
                    try:
                        s.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                self.beats += 1
                if self._stop.wait(self.interval_s):
                    return
        finally:
            for s in socks:
                s.close(linger=0)

    def close(self) -> None:
        """Stop beating (the thread ends within one interval)."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5.0)


def _incarnation(frames: list[bytes], secret: bytes | None) -> int:
    """The incarnation a server's reply carries (0 for anything that is not an authentic reply)."""
    try:
        return decode(frames, secret=secret).incarnation
    except WireError:
        return 0
