"""One compressed payload (tensors of any wire dtype and shape) as one self-describing uint8 buffer, and back.

Communicators that gather payloads of uneven sizes (``allgather``) send each worker's payload as one buffer
with an explicit header instead of pickling it; the receiver checks the header instead of trusting that
every rank packed the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradsync.compress.base import CompressionError

__all__ = ["PAYLOAD_MAGIC", "PAYLOAD_VERSION", "pack_payload", "unpack_payload"]

#: ``b"GSPAYLD1"`` read as a little-endian int64: marks a packed payload.
PAYLOAD_MAGIC = int.from_bytes(b"GSPAYLD1", "little")
PAYLOAD_VERSION = 1
#: Dtype codes on the wire; append only, so old buffers keep decoding.
_WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
_CODE = {d: i for i, d in enumerate(_WIRE_DTYPES)}
_ALIGN = 8  # every field starts on an 8-byte boundary, so it can be viewed in place as its dtype


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack_payload(tensors: Sequence[Tensor]) -> Tensor:
    """Serialise tensors of any wire dtype and shape into one uint8 buffer (native byte order).

    Layout, all int64 words: ``[magic, version, header_words, count, (dtype code, ndim, *shape) per
    tensor]``, then each tensor's bytes, each padded to 8 bytes. The header makes the buffer
    self-describing, so a receiver checks it instead of trusting that every rank packed the same thing.
    """
    words = [PAYLOAD_MAGIC, PAYLOAD_VERSION, 0, len(tensors)]
    flats = []
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise CompressionError(f"payload[{i}] is a {type(t).__name__}, not a tensor")
        code = _CODE.get(t.dtype)
        if code is None:
            raise CompressionError(f"payload[{i}] has dtype {t.dtype}, which has no wire code; use one of {list(_CODE)}")
        words += [code, t.dim(), *t.shape]
        flats.append(t.detach().reshape(-1).contiguous().view(torch.uint8))
    words[2] = len(words)
    header = torch.tensor(words, dtype=torch.int64).view(torch.uint8)  # host: a few words, copied in below
    total = header.numel() + sum(_aligned(f.numel()) for f in flats)
    # on the tensors' device: a payload of GPU tensors is sent from the GPU, with one small header copy
    out = torch.zeros(total, dtype=torch.uint8, device=flats[0].device if flats else None)
    out[: header.numel()] = header
    at = header.numel()
    for f in flats:
        out[at : at + f.numel()] = f
        at += _aligned(f.numel())
    return out


def unpack_payload(buffer: Tensor) -> list[Tensor]:
    """Inverse of :func:`pack_payload`; raises :class:`CompressionError` naming what does not add up."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise CompressionError(f"a packed payload is a 1-D uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
    buf = buffer.contiguous() if buffer.storage_offset() % _ALIGN == 0 else buffer.clone()
    if buf.numel() < 32:
        raise CompressionError(f"a packed payload has at least 32 header bytes, got {buf.numel()}")
    head = buf[:32].view(torch.int64).tolist()
    if head[0] != PAYLOAD_MAGIC or head[1] != PAYLOAD_VERSION:
        raise CompressionError(
            f"buffer is not a version-{PAYLOAD_VERSION} gradsync payload (magic {head[0]:#x}, version {head[1]}); "
            "every rank must run the same gradsync"
        )
    n_words, count = head[2], head[3]
    if n_words < 4 or n_words * 8 > buf.numel():
        raise CompressionError(f"payload header claims {n_words} words but the buffer has {buf.numel()} bytes")
    words = buf[: n_words * 8].view(torch.int64).tolist()
    out, w, at = [], 4, n_words * 8
    for i in range(count):
        code, ndim = words[w], words[w + 1]
        shape = tuple(words[w + 2 : w + 2 + ndim])
        w += 2 + ndim
        if not 0 <= code < len(_WIRE_DTYPES):
            raise CompressionError(f"payload tensor {i} has dtype code {code}, not one of 0..{len(_WIRE_DTYPES) - 1}")
        dtype = _WIRE_DTYPES[code]
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if at + nbytes > buf.numel():
            raise CompressionError(
                f"payload tensor {i} ({dtype} {shape}) needs bytes {at}..{at + nbytes} but the buffer has {buf.numel()}"
            )
        out.append(buf[at : at + nbytes].view(dtype).reshape(shape))
        at += _aligned(nbytes)
    if w != n_words:
        raise CompressionError(f"payload header has {n_words} words but its {count} tensors describe {w}")
    return out
