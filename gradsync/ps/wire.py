"""The parameter server's wire format: one fixed header, one raw payload, an optional authentication tag.

A message is a ZeroMQ multipart message ``[header, payload]`` or ``[header, payload, tag]``; a ROUTER socket
adds the peer identity in front. Nothing is pickled: the header is a fixed little-endian struct followed by
the shape and the UTF-8 key, and the payload is the tensor's raw bytes (sent zero-copy from tensor memory),
a UTF-8 error message, or a JSON object (optimizer settings, status). ``decode`` checks every field before
anything is allocated, so garbage, truncated or oversize frames raise :class:`WireError` and never crash.

Header (``HEADER``, 112 bytes, then ``ndim`` × u64 shape, then ``key_len`` bytes of key)::

    magic "GSPS" | proto u8 | op u8 | dtype u8 | flags u8 | part u16 | parts u16 | ndim u8 | pad u8 |
    key_len u16 | sender u32 | count u32 | req_id u64 | version u64 | offset u64 | numel u64 |
    nbytes u64 | priority i32 | pushed u32 | job u64 | session u64 | dest u32 | pad u32 |
    incarnation u64 | seq u64

``pushed`` (once padding, 0 in requests): in a ``VALUE`` of a sync key, how many pushes the round that
produced it summed; fewer than the key's pushers after an elastic server dropped a silent client, so a
worker can average over the pushes there were.

``offset``/``numel``: where this part sits in the flattened tensor (large tensors are sliced over servers)
and how many elements it holds; ``shape`` is the whole tensor's. With a shared secret the third frame is a
tag over header ‖ payload; its first byte names the algorithm (:func:`mac_algorithm`):

- ``2`` AES-256-GMAC (NIST SP 800-38D, through ``cryptography``/OpenSSL; the default when it is installed):
  ``nonce (12) ‖ tag (16)``, the tag of AES-GCM with the payload as associated data and the header as the
  plaintext (whose ciphertext is dropped: GCM's tag covers both lengths, so the split cannot move). The key is
  HMAC-SHA256(secret, "gradsync-ps-gmac-v1"). Nonces are a random 64-bit prefix per process (drawn again in a
  forked child and when its counter wraps) and a 32-bit counter, so no two messages of a job share one.
  GHASH runs several times faster than SHA-256 on CPUs with carry-less multiply, and a round trip hashes its
  payload four times (sender and receiver, both ways): this is what brings an authenticated round trip near
  an unauthenticated one (measured: docs/benchmarks.md, ``gradsync bench ps-loopback``).
- ``1`` HMAC-SHA256(secret, header ‖ payload) (32 bytes), sent where ``cryptography`` is missing.

A receiver accepts either (both are secure; the sender's library decides). A large payload's MAC may
travel as a message of its own right after it (``Flag.DETACHED``, :data:`DETACH_BYTES`, :class:`TagJoiner`).

``job`` names the job a request belongs to (0: none), so a server shared by two jobs by mistake refuses
the second one instead of mixing their rounds. ``session`` (random per client) and ``seq`` (increasing per
session, set when the frame is sent: :func:`seal`) lie under the tag, so a server with a secret rejects a
captured frame sent again (a replay): each session's ``seq`` must grow. ``dest`` (the server's index) and
``incarnation`` (the random nonce a server draws at each start; requests carry the one of the server they
are for, replies their sender's) are under the tag too, so a server with a secret refuses a frame captured
on its way to another server of the job, or to an earlier run of itself (whose replay window died with it).
Like ``seq`` they are written when the frame is sent (:func:`seal`), so a retry to a restarted server is
a new frame. A reply carries its request's ``req_id`` and ``session`` under the server's tag, so a client with a
secret takes only replies to its own requests: a reply captured on its way to another client of the job, whose
request numbers run the same way, is not taken for one of its own. Protocol 2 added job, session and seq, protocol 3
the tag's algorithm byte, protocol 4 dest and incarnation, and protocol 5 the session in replies; older peers are
refused with a message saying so.

``PUSHPULL`` is a PUSH and the PULL that follows it in one request (MXNet's ``kv.pushpull``): its fields
are the push's (``version`` names the round), and its only reply is the ``VALUE`` of that round (of the
value after the push, asynchronously), so a round costs one request and one reply instead of two each.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import itertools
import json
import math
import os
import secrets
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync.errors import GradsyncError

try:  # AES-GMAC through OpenSSL; HMAC-SHA256 (hashlib) where the wheel is missing
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
except ImportError:  # pragma: no cover - cryptography is a declared dependency
    AESGCM = None

__all__ = [
    "MAGIC", "PROTO", "HEADER", "MAX_PAYLOAD", "MAX_ELEMENTS", "Op", "Flag", "DTYPES", "WireError", "Message",
    "encode", "decode", "seal", "job_id", "tensor_from", "key_name", "SYNC_BIT", "ORDERED_BIT", "MAC_HMAC",
    "MAC_GMAC", "MAC_NAMES", "mac_algorithm", "DETACH_BYTES", "is_detached", "tag_frame", "TagJoiner",
]

MAGIC = b"GSPS"
PROTO = 5
HEADER = struct.Struct("<4sBBBBHHBBHIIQQQQQiIQQIIQQ")
#: where ``dest``, ``incarnation`` and ``seq`` (the header's last fields) sit: :func:`seal` rewrites them on every send
_SEQ_AT = HEADER.size - 8
_INCARNATION_AT = HEADER.size - 16
_DEST_AT = HEADER.size - 24
#: Largest element count a shape may describe (torch indexes with int64).
MAX_ELEMENTS = (1 << 63) - 1
#: Default cap on one payload (bytes). Servers take it as an option; a larger frame is refused, not read.
MAX_PAYLOAD = 1 << 31
MAX_NDIM = 16
MAX_KEY = 1024


class WireError(GradsyncError):
    """A frame that is not a valid gradsync PS message (bad magic, size, field, or authentication tag)."""


class Op(enum.IntEnum):
    INIT = 1
    PUSH = 2
    PULL = 3
    SET_OPTIMIZER = 4
    BARRIER = 5
    STATUS = 6
    PING = 7
    SHUTDOWN = 8
    CHECKPOINT = 9
    PUSHPULL = 10  # a PUSH whose reply is the PULL of the round it completes (one exchange per round)
    ACK = 16
    VALUE = 17
    ERROR = 18
    INFO = 19


class Flag(enum.IntFlag):
    NONE = 0
    INT_KEY = 1  # the key is an int (stored as its decimal text)
    SYNC = 2  # INIT: the key's rounds are synchronous
    ORDERED = 4  # PULL, PUSHPULL: reply in this sender's priority order (TicTac enforcement)
    ELASTIC = 8  # INIT: a sync key whose rounds go on without a client that stopped answering
    JOIN = 16  # INIT: join the key as it is (wait for it to exist; never create it)
    DETACHED = 32  # the tag follows as a message of its own (:data:`DETACH_BYTES`; :class:`TagJoiner`)
    STALE = 64  # ERROR: the request named an earlier incarnation of this server (send it again with this one)
    DISK_FAILING = 128  # any reply: the server's last checkpoint write failed (its STATUS says why)


_ALL_FLAGS = int(Flag.INT_KEY | Flag.SYNC | Flag.ORDERED | Flag.ELASTIC | Flag.JOIN | Flag.DETACHED | Flag.STALE
                 | Flag.DISK_FAILING)
_DETACHED = int(Flag.DETACHED)
#: the header byte holding ``flags`` (after magic, proto, op, dtype)
_FLAGS_AT = 7
#: With ``detach=True`` (the client and server), a tagged payload of at least this many bytes is sent as two
#: ZeroMQ messages, ``[header, payload, prefix]`` with ``Flag.DETACHED`` (the prefix: the tag's algorithm
#: byte and nonce) and then ``[MAC]``: ZeroMQ delivers a
#: multipart message only once its last frame is queued, so an inline tag makes the receiver wait for the
#: sender's hash before its copy of the payload even starts, and the two hashes of one hop run one after the
#: other. Detached, the sender hashes while the payload travels and the receiver hashes as it arrives. Below
#: this size the extra message costs more than the overlap saves.
DETACH_BYTES = 256 << 10
#: plain ints for the hot paths (``IntFlag & IntFlag`` runs enum code in Python; ``int(flags) & _BIT`` does not)
_INT_KEY, SYNC_BIT, ORDERED_BIT = int(Flag.INT_KEY), int(Flag.SYNC), int(Flag.ORDERED)

#: dtype code <-> torch dtype. Code 0 means "no tensor" (a text or JSON payload).
DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16, 5: torch.int32, 6: torch.int64,
    7: torch.uint8, 8: torch.int8, 9: torch.int16, 10: torch.bool,
}
_CODES = {dt: code for code, dt in DTYPES.items()}
_ITEMSIZE = {code: torch.empty(0, dtype=dt).element_size() for code, dt in DTYPES.items()}
#: per-request lookups done once: op and flag members by value, the shape struct by ndim
_OPS = {int(o): o for o in Op}
_FLAGS = {v: Flag(v) for v in range(_ALL_FLAGS + 1)}
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]

Key = int | str


def key_name(key: Key) -> str:
    """How a key is written in messages and errors."""
    return repr(key)


@dataclass(frozen=True)
class Message:
    """One decoded message. ``payload`` is a buffer (bytes/memoryview/zmq frame) of ``nbytes`` bytes."""

    op: Op
    key: Key | None = None
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    part: int = 0
    parts: int = 1
    offset: int = 0
    numel: int = 0
    sender: int = 0
    count: int = 0
    req_id: int = 0
    version: int = 0
    priority: int = 0
    flags: Flag = Flag.NONE
    pushed: int = 0
    job: int = 0
    session: int = 0
    dest: int = 0
    incarnation: int = 0
    seq: int = 0
    payload: Any = field(default=b"", repr=False)

    def tensor(self) -> torch.Tensor:
        """The payload as a flat tensor (a read-only view of the frame: copy before keeping it)."""
        if self.dtype is None:
            raise WireError(f"{self.op.name} message for key {key_name(self.key)} carries no tensor")
        return tensor_from(self.payload, self.dtype, self.numel)

    def text(self) -> str:
        return bytes(self.payload).decode("utf-8", errors="replace")

    def json(self) -> Any:
        try:
            return json.loads(bytes(self.payload).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WireError(f"{self.op.name} payload is not JSON: {e}") from None


def tensor_from(buf: Any, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A flat tensor viewing ``buf`` without copying (frames are read-only: torch warns once per process
    that such a tensor must not be written, and that one warning is taken at import, below)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel)


with warnings.catch_warnings():  # torch's warn-once about read-only buffers, spent here and not in a user's log
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0\0\0\0", dtype=torch.uint8, count=4)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor, without a copy when it is a contiguous CPU tensor (the usual case, taken in
    in microseconds: this runs for every push and every reply)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype is torch.bfloat16:  # numpy has no bfloat16: view its bytes
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return memoryview(t.numpy()).cast("B")


def encode(op: Op, *, key: Key | None = None, tensor: torch.Tensor | None = None, shape: tuple[int, ...] | None = None,
           payload: bytes | None = None, json_payload: Any = None, part: int = 0, parts: int = 1, offset: int = 0,
           sender: int = 0, count: int = 0, req_id: int = 0, version: int = 0, priority: int = 0,
           flags: Flag = Flag.NONE, pushed: int = 0, job: int = 0, session: int = 0, seq: int = 0,
           dest: int = 0, incarnation: int = 0, secret: bytes | None = None, detach: bool = False) -> list[Any]:
    """The frames of one message. ``tensor`` is sent as raw bytes (its memory, not a copy).

    Without ``secret`` the frames are ``[header, payload]``; :func:`seal` sets ``seq`` and adds the tag.
    With ``detach`` a payload of :data:`DETACH_BYTES` or more gets ``Flag.DETACHED`` and only the tag's prefix
    as its third frame: the sender sends :func:`tag_frame` (the MAC) as a message of its own after it."""
    if key is None:
        key_bytes = b""
    elif isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"PS keys are int or str, got {type(key).__name__} {key!r}")
    else:
        if isinstance(key, int):
            flags = int(flags) | _INT_KEY
        key_bytes = str(key).encode("utf-8")
    if len(key_bytes) > MAX_KEY:
        raise WireError(f"key {key_name(key)} is {len(key_bytes)} bytes long; the limit is {MAX_KEY}")
    dtype_code = 0
    numel = 0
    if tensor is not None:
        if tensor.dtype not in _CODES:
            raise TypeError(f"dtype {tensor.dtype} cannot travel to the PS; use one of {sorted(map(str, _CODES))}")
        dtype_code = _CODES[tensor.dtype]
        numel = tensor.numel()
        body: Any = _tensor_bytes(tensor)
        shape = tuple(tensor.shape) if shape is None else shape
    elif json_payload is not None:
        body = json.dumps(json_payload, sort_keys=True).encode("utf-8")
    else:
        body = payload or b""
    shape = tuple(shape or ())
    if len(shape) > MAX_NDIM:
        raise WireError(f"shape {shape} has {len(shape)} dimensions; the limit is {MAX_NDIM}")
    nbytes = body.nbytes if isinstance(body, memoryview) else len(body)
    detached = _detaches(secret, detach, nbytes)
    flags = (int(flags) & ~_DETACHED) | (_DETACHED if detached else 0)  # a request's flags echoed: not ours
    try:
        head = HEADER.pack(MAGIC, PROTO, op, dtype_code, flags, part, parts, len(shape), 0, len(key_bytes),
                           sender, count, req_id, version, offset, numel, nbytes, priority, pushed, job, session, dest,
                           0, incarnation, seq)
        head += _SHAPES[len(shape)].pack(*shape) + key_bytes
    except struct.error as e:
        raise WireError(f"{op.name} message field out of range ({e}): shape {shape}, part {part}/{parts}, "
                        f"sender {sender}, count {count}, version {version}, job {job}, dest {dest}, "
                        f"incarnation {incarnation}") from None
    frames: list[Any] = [head, body]
    if secret:
        frames.append(_prefix() if detached else _tag(secret, head, body))
    return frames


def _detaches(secret: bytes | None, detach: bool, nbytes: int) -> bool:
    """Whether :func:`encode` and :func:`seal` send a payload of ``nbytes`` with its MAC detached."""
    return bool(secret) and detach and nbytes >= DETACH_BYTES


def is_detached(frames: Sequence[Any]) -> bool:
    """Whether ``frames`` are the first message of a detached pair (``[header, payload, tag prefix]``)."""
    head = frames[0]
    return len(frames) == 3 and len(head) > _FLAGS_AT and bool(head[_FLAGS_AT] & _DETACHED)


def tag_frame(frames: Sequence[Any], secret: bytes) -> bytes:
    """The message that follows detached ``frames`` (from :func:`encode` or :func:`seal`): their MAC."""
    return _mac(secret, bytes(frames[2]), bytes(frames[0]), frames[1])


#: tag algorithms (the tag frame's first byte)
MAC_HMAC = 1
MAC_GMAC = 2
_GMAC_INFO = b"gradsync-ps-gmac-v1"
_NONCE = 12
#: (prefix length, MAC length) per algorithm: the tag frame is prefix ‖ MAC, the prefix its algorithm byte
#: and, for GMAC, the nonce
_LAYOUT = {MAC_GMAC: (1 + _NONCE, 16), MAC_HMAC: (1, 32)}
MAC_NAMES = {MAC_GMAC: "AES-256-GMAC", MAC_HMAC: "HMAC-SHA256"}


def mac_algorithm() -> int:
    """The tag algorithm this process sends: :data:`MAC_GMAC` when ``cryptography`` is importable."""
    return MAC_GMAC if AESGCM is not None else MAC_HMAC


@functools.lru_cache(maxsize=8)
def _gmac_key(secret: bytes) -> Any:
    return AESGCM(hmac.digest(secret, _GMAC_INFO, "sha256"))


class _Nonces:
    """Unique 96-bit GCM nonces: a random 64-bit prefix and a 32-bit counter (a fresh prefix when it wraps
    and in a forked child, which would otherwise repeat its parent's)."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix, self.count = secrets.token_bytes(8), itertools.count()

    def next(self) -> bytes:
        n = next(self.count)
        if n >= 1 << 32:
            self.reset()
            n = next(self.count)
        return self.prefix + n.to_bytes(4, "little")


_nonces = _Nonces()


def _prefix() -> bytes:
    """A fresh tag prefix: the algorithm this process sends and, for GMAC, a new nonce."""
    if AESGCM is not None:
        return bytes((MAC_GMAC,)) + _nonces.next()
    return bytes((MAC_HMAC,))


def _split(tag: bytes) -> tuple[bytes, bytes]:
    """``tag`` as (prefix, MAC), checked against its algorithm's layout."""
    layout = _LAYOUT.get(tag[0]) if tag else None
    if layout is None or len(tag) != sum(layout):
        raise WireError(f"authentication tag of {len(tag)} bytes with algorithm byte {tag[:1].hex() or 'none'}: "
                        f"expected {MAC_GMAC} (AES-GMAC, 29 bytes) or {MAC_HMAC} (HMAC-SHA256, 33 bytes)")
    return tag[:layout[0]], tag[layout[0]:]


def _mac(secret: bytes, prefix: bytes, head: bytes, body: Any) -> bytes:
    """The MAC of ``head ‖ body`` under the algorithm (and nonce) ``prefix`` names."""
    if prefix[0] == MAC_GMAC:
        if AESGCM is None:
            raise WireError("the peer authenticates with AES-GMAC but this process cannot check it: "
                            "pip install cryptography")
        return _gmac_key(secret).encrypt(prefix[1:], head, body)[-16:]
    mac = hmac.new(secret, head, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def _tag(secret: bytes, head: bytes, body: Any) -> bytes:
    """A fresh tag frame for ``head ‖ body`` (see the module docstring for the format)."""
    prefix = _prefix()
    return prefix + _mac(secret, prefix, head, body)


def _verify(secret: bytes, head: bytes, body: Any, tag: Any, expected: bytes | None = None) -> bool:
    """Whether ``tag`` (a tag frame) authenticates ``head ‖ body``, in constant time. ``expected``: the MAC
    already computed for this prefix (:class:`TagJoiner` hashes a detached payload as it arrives)."""
    prefix, mac = _split(bytes(tag))
    if expected is None:
        expected = _mac(secret, prefix, head, body)
    return hmac.compare_digest(expected, mac)


def seal(frames: Sequence[Any], *, seq: int, secret: bytes | None = None, detach: bool = False,
         dest: int | None = None, incarnation: int | None = None) -> list[Any]:
    """``frames`` (from :func:`encode`, tagged or not) with ``seq`` (and ``dest``, ``incarnation`` when given)
    written into the header and, with a ``secret``, a fresh tag. A client seals each frame when it sends it,
    so a retry is a new frame the server accepts while a copy of an old one is refused; the payload is
    neither copied nor changed. ``detach``: as in :func:`encode` (the MAC then comes from :func:`tag_frame`,
    sent after the frames)."""
    head = bytearray(bytes(frames[0]))
    struct.pack_into("<Q", head, _SEQ_AT, seq)
    if dest is not None:
        struct.pack_into("<I", head, _DEST_AT, dest)
    if incarnation is not None:
        struct.pack_into("<Q", head, _INCARNATION_AT, incarnation)
    body = frames[1]
    detached = _detaches(secret, detach, memoryview(body).nbytes)
    if detached:
        head[_FLAGS_AT] |= _DETACHED
    else:
        head[_FLAGS_AT] &= ~_DETACHED & 0xFF
    sealed: list[Any] = [bytes(head), body]
    if secret:
        sealed.append(_prefix() if detached else _tag(secret, sealed[0], body))
    return sealed


class TagJoiner:
    """Puts detached MACs back on their messages, per peer, so :func:`decode` sees ``[header, payload, tag]``.

    A detached pair is ``[header, payload, prefix]`` (``Flag.DETACHED``; the prefix names the algorithm and
    nonce) and then ``[MAC]``. With a ``secret`` the joiner hashes the payload when it arrives, while the
    sender is still computing the same MAC, and hands the result to :func:`decode` (``expected``). ZeroMQ
    keeps one connection's messages in order, so a peer's MAC is the next message after its detached
    frames. :meth:`feed` returns ``(frames, expected)`` for each message ready to decode: none while a MAC is
    awaited, and a detached message whose MAC never came (the peer sent something else next) untagged, so
    that :func:`decode` refuses it with the reason. At most ``max_peers`` peers wait at once (the oldest is
    given up on): a peer that never sends its MAC holds one message, not memory without bound."""

    def __init__(self, secret: bytes | None = None, max_peers: int = 1024) -> None:
        self.secret = secret
        self.pending: dict[Any, tuple[list[Any], bytes | None]] = {}
        self.max_peers = max_peers
        #: detached pairs put back together so far
        self.joined = 0

    def feed(self, peer: Any, frames: list[Any]) -> list[tuple[list[Any], bytes | None]]:
        held = self.pending.pop(peer, None)
        if held is not None and len(frames) == 1:
            (head, body, prefix), expected = held
            self.joined += 1
            return [([head, body, bytes(prefix) + bytes(frames[0])], expected)]
        ready = [] if held is None else [(held[0][:2], None)]
        if is_detached(frames):
            if len(self.pending) >= self.max_peers:
                ready.append((self.pending.pop(next(iter(self.pending)))[0][:2], None))
            self.pending[peer] = (frames, self._expect(frames))
        else:
            ready.append((frames, None))
        return ready

    def _expect(self, frames: list[Any]) -> bytes | None:
        """The MAC ``frames`` should get, computed now; None where :func:`decode` will say why it cannot."""
        prefix = bytes(frames[2])
        layout = _LAYOUT.get(prefix[0]) if prefix else None
        if (not self.secret or layout is None or len(prefix) != layout[0]
                or (prefix[0] == MAC_GMAC and AESGCM is None)):
            return None
        return _mac(self.secret, prefix, _head_bytes(frames[0]), frames[1])


def _head_bytes(frame: Any) -> bytes:
    """A header frame (bytes, or a received buffer) as bytes: parsed and hashed as such."""
    return frame if isinstance(frame, bytes) else bytes(memoryview(frame).cast("B"))


def job_id(text: str) -> int:
    """The u64 job id for ``GRADSYNC_PS_JOB``'s text: up to 16 hex digits as a number, else a hash of it."""
    text = text.strip()
    if not text:
        return 0
    if len(text) <= 16:
        try:
            return int(text, 16)
        except ValueError:
            pass
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") or 1


def decode(frames: list[Any], *, secret: bytes | None = None, max_payload: int = MAX_PAYLOAD,
           expected: bytes | None = None) -> Message:
    """Parse and check one message (without a ROUTER identity frame). Raises :class:`WireError`.
    ``expected``: its MAC when already computed (by :class:`TagJoiner`, from the same frames)."""
    if len(frames) not in (2, 3):
        raise WireError(f"a message has 2 or 3 frames (header, payload[, tag]); got {len(frames)}")
    head = _head_bytes(frames[0])
    body = frames[1]
    body_len = body.nbytes if isinstance(body, memoryview) else memoryview(body).nbytes
    if len(head) >= 5 and head[:4] != MAGIC:
        raise WireError(f"bad magic {head[:4]!r}: not a gradsync PS message")
    if len(head) >= 5 and head[4] != PROTO:  # before the size check: an older peer's header is shorter
        raise WireError(f"protocol version {head[4]}; this build speaks {PROTO} (upgrade both sides together)")
    if len(head) < HEADER.size:
        raise WireError(f"header is {len(head)} bytes; at least {HEADER.size} expected (truncated frame?)")
    (_magic, _proto, op, dtype_code, flags, part, parts, ndim, _pad, key_len, sender, count, req_id, version, offset,
     numel, nbytes, priority, pushed, job, session, dest, _pad2, incarnation, seq) = HEADER.unpack_from(head)
    if secret:
        if len(frames) != 3:
            raise WireError("message has no authentication tag; this server requires one (set the shared secret)")
        if not _verify(secret, head, body, frames[2], expected):
            raise WireError("authentication tag does not match: wrong shared secret or a tampered frame")
    op_v = _OPS.get(op)
    if op_v is None:
        raise WireError(f"unknown op code {op}")
    if ndim > MAX_NDIM:
        raise WireError(f"ndim {ndim} exceeds {MAX_NDIM}")
    if len(head) != HEADER.size + 8 * ndim + key_len:
        raise WireError(f"header is {len(head)} bytes but its fields describe {HEADER.size + 8 * ndim + key_len}")
    if nbytes != body_len:
        raise WireError(f"header announces {nbytes} payload bytes but the frame holds {body_len} (truncated frame?)")
    if nbytes > max_payload:
        raise WireError(f"payload of {nbytes} bytes exceeds this server's limit of {max_payload}")
    if parts < 1 or part >= parts:
        raise WireError(f"part {part} of {parts} is out of range")
    shape = _SHAPES[ndim].unpack_from(head, HEADER.size)
    key: Key | None = None
    if key_len:
        try:
            text = head[HEADER.size + 8 * ndim:].decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("key is not UTF-8") from None
        if flags & _INT_KEY:
            try:
                key = int(text)
            except ValueError:
                raise WireError(f"int key {text!r} is not a number") from None
        else:
            key = text
    dtype = None
    if dtype_code:
        if dtype_code not in DTYPES:
            raise WireError(f"unknown dtype code {dtype_code}")
        dtype = DTYPES[dtype_code]
        itemsize = _ITEMSIZE[dtype_code]
        if numel * itemsize != nbytes:
            raise WireError(f"{numel} elements of {dtype} need {numel * itemsize} bytes; the payload has {nbytes}")
        total = math.prod(shape)
        if total > MAX_ELEMENTS:
            raise WireError(f"shape {tuple(shape)} describes {total} elements; at most 2^63 - 1 can be indexed")
        if offset + numel > total:
            raise WireError(f"part [{offset}, {offset + numel}) lies outside a tensor of shape {tuple(shape)}")
    flag_v = _FLAGS.get(flags)
    if flag_v is None:
        raise WireError(f"unknown flags {flags:#x}")
    return Message(op=op_v, key=key, dtype=dtype, shape=shape, part=part, parts=parts, offset=offset, numel=numel,
                   sender=sender, count=count, req_id=req_id, version=version, priority=priority, flags=flag_v,
                   pushed=pushed, job=job, session=session, dest=dest, incarnation=incarnation, seq=seq, payload=body)
