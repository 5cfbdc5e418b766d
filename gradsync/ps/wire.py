"""The parameter server's wire format: one fixed header, one raw payload, an optional HMAC tag.

A message is a ZeroMQ multipart message ``[header, payload]`` or ``[header, payload, tag]``; a ROUTER socket
adds the peer identity in front. Nothing is pickled: the header is a fixed little-endian struct followed by
the shape and the UTF-8 key, and the payload is the tensor's raw bytes (sent zero-copy from tensor memory),
a UTF-8 error message, or a JSON object (optimizer settings, status). ``decode`` checks every field before
anything is allocated, so garbage, truncated or oversize frames raise :class:`WireError` and never crash.

Header (``HEADER``, 96 bytes, then ``ndim`` × u64 shape, then ``key_len`` bytes of key)::

    magic "GSPS" | proto u8 | op u8 | dtype u8 | flags u8 | part u16 | parts u16 | ndim u8 | pad u8 |
    key_len u16 | sender u32 | count u32 | req_id u64 | version u64 | offset u64 | numel u64 |
    nbytes u64 | priority i32 | pushed u32 | job u64 | session u64 | seq u64

``pushed`` (once padding, 0 in requests): in a ``VALUE`` of a sync key, how many pushes the round that
produced it summed; fewer than the key's pushers after an elastic server dropped a silent client, so a
worker can average over the pushes there were.

``offset``/``numel``: where this part sits in the flattened tensor (large tensors are sliced over servers)
and how many elements it holds; ``shape`` is the whole tensor's. With a shared secret the tag is
HMAC-SHA256(secret, header ‖ payload).

``job`` names the job a request belongs to (0: none), so a server shared by two jobs by mistake refuses
the second one instead of mixing their rounds. ``session`` (random per client) and ``seq`` (increasing per
session, set when the frame is sent: :func:`seal`) lie under the tag, so a server with a secret rejects a
captured frame sent again (a replay): each session's ``seq`` must grow. Protocol 2 added these three
fields; protocol 1 peers are refused with a message saying so.

``PUSHPULL`` is a PUSH and the PULL that follows it in one request (MXNet's ``kv.pushpull``): its fields
are the push's (``version`` names the round), and its only reply is the ``VALUE`` of that round (of the
value after the push, asynchronously), so a round costs one request and one reply instead of two each.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync.errors import GradsyncError

__all__ = [
    "MAGIC", "PROTO", "HEADER", "MAX_PAYLOAD", "MAX_ELEMENTS", "Op", "Flag", "DTYPES", "WireError", "Message",
    "encode", "decode", "seal", "job_id", "tensor_from", "key_name", "SYNC_BIT", "ORDERED_BIT",
]

MAGIC = b"GSPS"
PROTO = 2
HEADER = struct.Struct("<4sBBBBHHBBHIIQQQQQiIQQQ")
#: where ``seq`` (the header's last u64) sits: :func:`seal` rewrites it on every send
_SEQ_AT = HEADER.size - 8
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


_ALL_FLAGS = int(Flag.INT_KEY | Flag.SYNC | Flag.ORDERED | Flag.ELASTIC | Flag.JOIN)
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
    about 2 us: this runs for every push and every reply)."""
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
           secret: bytes | None = None) -> list[Any]:
    """The frames of one message. ``tensor`` is sent as raw bytes (its memory, not a copy).

    Without ``secret`` the frames are ``[header, payload]``; :func:`seal` sets ``seq`` and adds the tag."""
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
    try:
        head = HEADER.pack(MAGIC, PROTO, op, dtype_code, flags, part, parts, len(shape), 0, len(key_bytes),
                           sender, count, req_id, version, offset, numel, nbytes, priority, pushed, job, session, seq)
        head += _SHAPES[len(shape)].pack(*shape) + key_bytes
    except struct.error as e:
        raise WireError(f"{op.name} message field out of range ({e}): shape {shape}, part {part}/{parts}, "
                        f"sender {sender}, count {count}, version {version}, job {job}") from None
    frames: list[Any] = [head, body]
    if secret:
        frames.append(_tag(secret, head, body))
    return frames


def _tag(secret: bytes, head: bytes, body: Any) -> bytes:
    mac = hmac.new(secret, head, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def seal(frames: Sequence[Any], *, seq: int, secret: bytes | None = None) -> list[Any]:
    """``frames`` (from :func:`encode`, tagged or not) with ``seq`` written into the header and, with a
    ``secret``, a fresh tag. A client seals each frame when it sends it, so a retry is a new frame the
    server accepts while a copy of an old one is refused; the payload is neither copied nor changed."""
    head = bytearray(bytes(frames[0]))
    struct.pack_into("<Q", head, _SEQ_AT, seq)
    sealed: list[Any] = [bytes(head), frames[1]]
    if secret:
        sealed.append(_tag(secret, sealed[0], frames[1]))
    return sealed


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


def decode(frames: list[Any], *, secret: bytes | None = None, max_payload: int = MAX_PAYLOAD) -> Message:
    """Parse and check one message (without a ROUTER identity frame). Raises :class:`WireError`."""
    if len(frames) not in (2, 3):
        raise WireError(f"a message has 2 or 3 frames (header, payload[, tag]); got {len(frames)}")
    head = frames[0] if isinstance(frames[0], bytes) else bytes(memoryview(frames[0]).cast("B"))
    body = frames[1]
    body_len = body.nbytes if isinstance(body, memoryview) else memoryview(body).nbytes
    if len(head) >= 5 and head[:4] != MAGIC:
        raise WireError(f"bad magic {head[:4]!r}: not a gradsync PS message")
    if len(head) >= 5 and head[4] != PROTO:  # before the size check: an older peer's header is shorter
        raise WireError(f"protocol version {head[4]}; this build speaks {PROTO} (upgrade both sides together)")
    if len(head) < HEADER.size:
        raise WireError(f"header is {len(head)} bytes; at least {HEADER.size} expected (truncated frame?)")
    (_magic, _proto, op, dtype_code, flags, part, parts, ndim, _pad, key_len, sender, count, req_id, version, offset,
     numel, nbytes, priority, pushed, job, session, seq) = HEADER.unpack_from(head)
    if secret:
        if len(frames) != 3:
            raise WireError("message has no authentication tag; this server requires one (set the shared secret)")
        if not hmac.compare_digest(_tag(secret, head, body), bytes(frames[2])):
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
                   pushed=pushed, job=job, session=session, seq=seq, payload=body)
