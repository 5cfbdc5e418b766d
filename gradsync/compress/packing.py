"""Bit packing: the byte strings that 1-bit, ternary and QSGD payloads really are on the wire.

A compressor that claims "1 bit per element" must send ``ceil(d / 8)`` bytes, not a ``bool`` tensor (one
byte per element): MergeComp prices a merge by payload bytes (§4.3), so the bytes must be real.
Everything here is vectorised (Python loops run over the fields of a group or the bytes of one field,
never over elements) and works on any device. Fields narrower than a byte are packed in groups that fill
whole bytes (8/bits fields, or 8 fields = ``bits`` bytes), one whole-column operation per field of a
group; 1-bit fields on CPU go through numpy's packbits. Bits are little-endian: element ``i``'s bit ``j`` lands at stream bit
``i * bits + j``, and stream bit ``b`` is bit ``b % 8`` of byte ``b // 8`` (``numpy.packbits(...,
bitorder="little")`` for ``bits == 1``).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import Tensor

from gradsync.compress import kernels

__all__ = ["MAX_BITS", "less", "pack_bits", "pack_nonnegative", "unpack_bits", "pack_uint", "unpack_uint",
           "unpack_fields", "packed_nbytes"]

#: The widest field ``pack_uint`` takes: a 32-bit field shifted by up to 7 bits still fits in int64.
MAX_BITS = 32

#: Fields of 1, 2 or 4 bits, one per byte, seen as words of ``8 // bits`` bytes (little-endian machines only):
#: one byte of packed stream per word.
_WORD_OF = {1: torch.int64, 2: torch.int32, 4: torch.int16}
_WORDS = sys.byteorder == "little"
#: dtypes numpy compares natively (bfloat16 is not one).
_NUMPY_FLOATS = (torch.float32, torch.float64)


def _numpy_ok(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype in _NUMPY_FLOATS and not t.requires_grad for t in tensors)


def less(a: Tensor, b: Tensor | float) -> Tensor:
    """``a < b`` (broadcast) as uint8 0/1: the one-byte flags that codes and packed bits are built from.

    On CPU numpy's comparison writes the flags several times faster than torch's bool-producing kernel, and a
    bool array is viewed as bytes without a copy.
    """
    if _numpy_ok(a, *([b] if isinstance(b, Tensor) else [])):
        other = b.numpy() if isinstance(b, Tensor) else b
        return torch.from_numpy(np.less(a.numpy(), other)).view(torch.uint8)
    return torch.lt(a, b).view(torch.uint8)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` fields of ``bits`` bits occupy: ``ceil(n * bits / 8)``."""
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0 (number of packed fields)")
    return (n * bits + 7) // 8


def pack_bits(bits: Tensor) -> Tensor:
    """Pack a boolean tensor (any shape, read flat) into ``ceil(n / 8)`` uint8 bytes."""
    flat = bits.reshape(-1)
    if flat.dtype == torch.bool and flat.device.type == "cpu":  # no conversion: numpy packs bools
        return torch.from_numpy(np.packbits(flat.numpy(), bitorder="little"))
    if flat.device.type != "cpu" and _WORDS:  # a bool is one 0/1 byte: pack it as is, no conversion pass
        n = flat.numel()
        return _pack_words(flat.view(torch.uint8) if flat.dtype == torch.bool else flat & 1, 1, n, packed_nbytes(n, 1))
    return pack_uint(flat.to(torch.uint8), 1)


def pack_nonnegative(x: Tensor) -> Tensor:
    """``pack_bits(x >= 0)``: the sign family's payload, with numpy's comparison on CPU (see :func:`less`)."""
    flat = x.reshape(-1)
    fused = kernels.pack_nonnegative(flat)
    if fused is not None:
        return fused
    if _numpy_ok(flat):
        return torch.from_numpy(np.packbits(np.greater_equal(flat.numpy(), 0), bitorder="little"))
    if flat.device.type != "cpu" and _WORDS:
        return _pack_nonnegative_words(flat)
    return pack_bits(flat >= 0)


def _pack_nonnegative_words(flat: Tensor) -> Tensor:
    """:func:`pack_nonnegative` off the CPU: compare straight into zero-padded words, then :func:`_multiply_pack`."""
    n = flat.numel()
    nbytes = packed_nbytes(n, 1)
    flags = torch.empty(nbytes * 8, dtype=torch.bool, device=flat.device)
    torch.ge(flat, 0, out=flags[:n])
    flags[n:] = False
    return _multiply_pack(flags.view(torch.uint8), 1)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits of ``packed`` as a 1-D bool tensor."""
    if packed.dtype == torch.uint8 and packed.device.type == "cpu" and packed.numel() * 8 >= n >= 0:
        return torch.from_numpy(np.unpackbits(packed.reshape(-1).numpy(), count=n, bitorder="little")).view(torch.bool)
    if packed.dtype == torch.uint8 and packed.device.type != "cpu":
        return unpack_fields(packed, 1, n).view(torch.bool)  # fields are 0/1 bytes: a bool view, no conversion
    return unpack_uint(packed, 1, n).to(torch.bool)


def pack_uint(values: Tensor, bits: int) -> Tensor:
    """Pack non-negative integers below ``2**bits`` into a uint8 stream of ``ceil(n * bits / 8)`` bytes.

    Values are read flat and masked to ``bits`` bits, so a stray large value cannot corrupt its neighbours.
    """
    _check_bits(bits)
    flat = values.reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        raise TypeError(f"pack_uint needs an integer or bool tensor, got {flat.dtype}")
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    n = flat.numel()
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        return (flat.to(torch.int64) & 0xFF).to(torch.uint8)
    if bits < 8:
        return _pack_small(flat, bits, n, nbytes)
    # Wider than a byte: a field starting at bit offset ``o`` of byte ``b`` touches bytes b .. b+span-1; add
    # each of those byte slices into the stream (disjoint bits, so adding is OR).
    v = flat.to(torch.int64) & ((1 << bits) - 1)
    pos = torch.arange(n, dtype=torch.int64, device=flat.device) * bits
    first = pos >> 3
    shifted = v << (pos & 7)
    span = (7 + bits + 7) // 8
    out = torch.zeros(nbytes + span, dtype=torch.int64, device=flat.device)
    for j in range(span):
        out.index_add_(0, first + j, (shifted >> (8 * j)) & 0xFF)
    return out[:nbytes].to(torch.uint8)


def unpack_uint(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_uint`: the first ``n`` fields as a 1-D int64 tensor."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_uint needs a uint8 tensor, got {packed.dtype}")
    flat = packed.reshape(-1)
    need = packed_nbytes(n, bits)
    if flat.numel() < need:
        raise ValueError(f"{flat.numel()} bytes hold fewer than n={n} fields of {bits} bits (need {need} bytes)")
    if bits == 8:
        return flat[:n].to(torch.int64)
    if bits < 8:
        return unpack_fields(flat, bits, n).to(torch.int64)
    pos = torch.arange(n, dtype=torch.int64, device=flat.device) * bits
    first = pos >> 3
    span = (7 + bits + 7) // 8
    padded = torch.cat([flat.to(torch.int64), torch.zeros(span, dtype=torch.int64, device=flat.device)])
    word = torch.zeros(n, dtype=torch.int64, device=flat.device)
    for j in range(span):
        word |= padded[first + j] << (8 * j)
    return (word >> (pos & 7)) & ((1 << bits) - 1)


def unpack_fields(packed: Tensor, bits: int, n: int) -> Tensor:
    """:func:`unpack_uint` for ``bits < 8`` as uint8 fields, one per byte (no widening to int64)."""
    _check_bits(bits)
    if bits >= 8:
        raise ValueError(f"bits={bits} must be below 8 for one field per byte (use unpack_uint)")
    flat = packed.reshape(-1)
    need = packed_nbytes(n, bits)
    if packed.dtype != torch.uint8 or flat.numel() < need:
        raise ValueError(f"unpack_fields needs at least {need} uint8 bytes for n={n} fields of {bits} bits, got "
                         f"{flat.numel()} {packed.dtype}")
    return _unpack_small(flat, bits, n, need)


def _pack_small(flat: Tensor, bits: int, n: int, nbytes: int) -> Tensor:
    """``pack_uint`` for fields narrower than a byte."""
    mask = (1 << bits) - 1
    if bits == 1 and flat.device.type == "cpu":  # numpy's C loop: far faster than the torch expression below
        return torch.from_numpy(np.packbits((flat & 1).to(torch.uint8).numpy(), bitorder="little"))
    if bits in _WORD_OF and _WORDS:
        return _pack_words(flat, bits, n, nbytes)
    # Groups of ``g`` fields fill whole bytes (g = 8 / bits for 1, 2, 4 bits; 8 fields = ``bits`` bytes
    # otherwise): OR each group's fields into one word at their offsets, then cut the word into bytes.
    # Whole-column operations, ``g`` of them: no per-element index arithmetic.
    group = 8 // bits if 8 % bits == 0 else 8
    group_bytes = group * bits // 8
    rows = -(-n // group)
    wide = torch.uint8 if group_bytes == 1 else torch.int64
    fields = torch.zeros(rows * group, dtype=wide, device=flat.device)
    fields[:n] = flat & mask
    cols = fields.view(rows, group)
    word = cols[:, 0].clone()
    for i in range(1, group):
        word |= cols[:, i] << (i * bits)
    if group_bytes == 1:
        return word[:nbytes]
    out = torch.empty(rows, group_bytes, dtype=torch.uint8, device=flat.device)
    for j in range(group_bytes):
        out[:, j] = (word >> (8 * j)) & 0xFF
    return out.reshape(-1)[:nbytes]


def _unpack_small(flat: Tensor, bits: int, n: int, need: int) -> Tensor:
    """``unpack_uint`` for fields narrower than a byte."""
    mask = (1 << bits) - 1
    if bits == 1 and flat.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(flat[:need].numpy(), count=n, bitorder="little"))
    if bits in _WORD_OF and _WORDS:
        return _unpack_words(flat, bits, n, need)
    group = 8 // bits if 8 % bits == 0 else 8
    group_bytes = group * bits // 8
    rows = -(-n // group)
    if rows * group_bytes == need:  # whole groups (always so for 1, 2, 4 bits): no padded copy
        by = flat[:need].view(rows, group_bytes)
    else:
        padded = torch.zeros(rows * group_bytes, dtype=torch.uint8, device=flat.device)
        padded[:need] = flat[:need]
        by = padded.view(rows, group_bytes)
    word = by[:, 0] if group_bytes == 1 else by[:, 0].to(torch.int64)
    for j in range(1, group_bytes):
        word |= by[:, j].to(torch.int64) << (8 * j)
    shifts = torch.arange(0, group * bits, bits, dtype=word.dtype, device=flat.device)
    return ((word.unsqueeze(1) >> shifts) & mask).reshape(-1)[:n].to(torch.uint8)


def _pack_words(flat: Tensor, bits: int, n: int, nbytes: int) -> Tensor:
    """Fields of 1, 2 or 4 bits, one per byte, packed ``g = 8 // bits`` at a time: seen as a little-endian word of
    ``g`` bytes, field ``i`` sits at bit ``8 i``; one multiplication per word moves them (:func:`_multiply_pack`),
    or on the CPU whole-word shifts (:func:`_pack_rounds`)."""
    group = 8 // bits
    if flat.device.type == "cpu":
        return _pack_rounds(flat, bits, n, nbytes)
    if n == nbytes * group and flat.dtype == torch.uint8 and flat.is_contiguous() and _aligned(flat, group):
        return _multiply_pack(flat, bits)  # whole words already: no padded copy
    fields = torch.empty(nbytes * group, dtype=torch.uint8, device=flat.device)
    torch.bitwise_and(flat, (1 << bits) - 1, out=fields[:n])
    fields[n:] = 0
    return _multiply_pack(fields, bits)


def _pack_rounds(flat: Tensor, bits: int, n: int, nbytes: int) -> Tensor:
    """:func:`_pack_words` on the CPU, by whole-word shifts (measured faster there than the multiplication).

    Round ``r`` (``r = 0 .. log2 g - 1``) ORs the word with itself shifted right by ``2**r * (8 - bits)``: runs
    of ``2**r`` packed fields, ``8 * 2**r`` bits apart, merge pairwise into runs of ``2**(r + 1)``. After the
    last round the low byte holds all ``g`` fields (junk lands only above it).
    """
    group = 8 // bits
    fields = torch.zeros(nbytes * group, dtype=torch.uint8, device=flat.device)
    torch.bitwise_and(flat, (1 << bits) - 1, out=fields[:n])
    word = fields.view(_WORD_OF[bits])
    for r in range(group.bit_length() - 1):
        word = word | (word >> ((8 - bits) << r))
    return word.to(torch.uint8)  # the low byte (conversion to uint8 is modulo 256)


def _multiply_pack(fields: Tensor, bits: int) -> Tensor:
    """Whole words of ``g = 8 // bits`` one-field bytes (each field below ``2**bits``) to one packed byte each.

    Multiplying the word by ``M = sum_m 2**(bits (g - 1) + (8 - bits) m)`` puts the partial product of field ``i``
    and term ``m = g - 1 - i`` at bit ``8 (g - 1) + bits i``: the top byte of the product holds every field at its
    packed place. The other partial products land on their own bits (for ``bits * g = 8`` no two overlap, so
    nothing carries into the top byte) or beyond the word (dropped modulo ``2**(8 g)``). Two device passes
    (the product, then the top bytes), where shifting in rounds takes seven.
    """
    group = 8 // bits
    magic = sum(1 << (bits * (group - 1) + (8 - bits) * m) for m in range(group))
    product = fields.view(_WORD_OF[bits]) * magic  # wraps modulo 2**(8 g) in two's complement
    return product.view(torch.uint8).view(-1, group)[:, group - 1].contiguous()


def _aligned(t: Tensor, group: int) -> bool:
    return t.storage_offset() % group == 0


def _unpack_words(flat: Tensor, bits: int, n: int, need: int) -> Tensor:
    """Inverse of :func:`_pack_words` as one uint8 field per byte.

    On CPU the word-shift rounds in reverse (fewest temporaries); on a device one broadcast shift and one mask,
    two passes over the output bytes.
    """
    group = 8 // bits
    if flat.device.type != "cpu":
        return _unpack_shift(flat, bits, n, need)
    wide = _WORD_OF[bits]
    word = flat[:need].to(wide)
    for r in reversed(range(group.bit_length() - 1)):
        word = word | (word << ((8 - bits) << r))
    mask = int.from_bytes(bytes([(1 << bits) - 1]) * group, "little")
    return word.bitwise_and_(mask).view(torch.uint8)[:n]


#: Each field's bit offset within its byte, per (bits, device): made once, not a launch per call.
_SHIFTS: dict[tuple[int, torch.device], Tensor] = {}


def _unpack_shift(flat: Tensor, bits: int, n: int, need: int) -> Tensor:
    """:func:`_unpack_words` off the CPU: one broadcast shift and one mask, two passes over the output bytes."""
    shifts = _SHIFTS.get((bits, flat.device))
    if shifts is None:
        shifts = _SHIFTS[(bits, flat.device)] = torch.arange(0, 8, bits, dtype=torch.uint8, device=flat.device)
    fields = torch.bitwise_right_shift(flat[:need].unsqueeze(1), shifts).bitwise_and_((1 << bits) - 1)
    return fields.view(-1)[:n]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits={bits!r} must be an integer in [1, {MAX_BITS}]")
