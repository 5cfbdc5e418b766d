"""The Triton kernels behind :mod:`gradsync.compress.kernels` (imported only where Triton is installed).

Each kernel is one pass over the tensor where the torch form of the same codec takes 3 to 8 kernels, and
each writes exactly what the torch form writes (see :mod:`~gradsync.compress.kernels` for which are
bit-identical and which draw their own random numbers). Bit order is :mod:`~gradsync.compress.packing`'s:
element ``i`` is bit ``i % 8`` (or field ``i % (8 / bits)``) of byte ``i // (8 / bits)``.

Every packing kernel works on a ``(BYTES, FIELDS)`` block: row ``r`` holds the ``FIELDS`` elements of byte ``r``
(8 one-bit or 4 two-bit fields), so the loads and stores stay contiguous and a byte is one row's sum. The
helpers below (``_rows``, ``_pack``, ``_unpack``, ``_uniform``) are that layout, shared by every kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The kernels stay plain (undecorated) here: :mod:`kernels` wraps each once (``triton.jit``), for the GPU or, in
# the tests, for Triton's interpreter, which runs the same source on CPU tensors. The helpers they call are
# jitted here, in whichever mode Triton was imported.


@triton.jit
def _rows(pid, BYTES: tl.constexpr, FIELDS: tl.constexpr):  # noqa: N803 - Triton's constexpr style
    """Program ``pid``'s byte indices ``(BYTES,)`` and its elements' offsets ``(BYTES, FIELDS)``."""
    b = pid * BYTES + tl.arange(0, BYTES)
    return b, b[:, None] * FIELDS + tl.arange(0, FIELDS)[None, :]


@triton.jit
def _pack(fields, FIELDS: tl.constexpr):  # noqa: N803
    """Each row's ``FIELDS`` small integers (each below ``2 ** (8 // FIELDS)``) as one byte, field ``j`` at bit
    ``j * 8 // FIELDS``."""
    return tl.sum(fields.to(tl.int32) << (tl.arange(0, FIELDS) * (8 // FIELDS))[None, :], axis=1).to(tl.uint8)


@triton.jit
def _unpack(byte, FIELDS: tl.constexpr):  # noqa: N803
    """The inverse of ``_pack``: ``(BYTES,)`` bytes to ``(BYTES, FIELDS)`` fields (int32)."""
    width: tl.constexpr = 8 // FIELDS
    return (byte.to(tl.int32)[:, None] >> (tl.arange(0, FIELDS) * width)[None, :]) & ((1 << width) - 1)


@triton.jit
def _uniform(seed, group):
    """Uniforms in [0, 1), shaped ``group.shape + (2, 2)``: the 4 numbers of Philox(``seed``, counter ``g``) in
    row-major order, for elements ``4 g`` to ``4 g + 3`` (a quarter of the work of one draw per element)."""
    a, b, c, d = tl.rand4x(seed, group)
    return tl.join(tl.join(a, b), tl.join(c, d))


def pack_nonnegative(x_ptr, out_ptr, n, nbytes, BYTES: tl.constexpr):  # noqa: N803
    """Bit ``i`` = ``x[i] >= 0`` (NaN: 0, as torch's ``ge``); padding bits past ``n`` are 0."""
    b, offs = _rows(tl.program_id(0), BYTES, 8)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # exact for fp16/bf16
    tl.store(out_ptr + b, _pack((x >= 0) & mask, 8), mask=b < nbytes)


def select_by_bits(packed_ptr, out_ptr, n, v_ptr, hi, lo, MODE: tl.constexpr, BYTES: tl.constexpr):  # noqa: N803
    """``out[i] = hi if bit i else lo``. ``MODE`` 0: ``hi``/``lo`` are the numbers given; 1: ``hi = v[0]``,
    ``lo = -v[0]``; 2: ``hi = v[0]``, ``lo = v[1]`` (device values, read in the kernel: no host round trip)."""
    b, offs = _rows(tl.program_id(0), BYTES, 8)
    mask = offs < n
    bit = _unpack(tl.load(packed_ptr + b, mask=b * 8 < n, other=0), 8)
    if MODE == 0:
        value = tl.where(bit != 0, hi, lo)
    elif MODE == 1:
        s = tl.load(v_ptr).to(out_ptr.dtype.element_ty)
        value = tl.where(bit != 0, s, -s)
    else:
        a = tl.load(v_ptr).to(out_ptr.dtype.element_ty)
        c = tl.load(v_ptr + 1).to(out_ptr.dtype.element_ty)
        value = tl.where(bit != 0, a, c)
    tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)


def qsgd_encode(x_ptr, norms_ptr, codes_ptr, n, count, seed, levels,
                BUCKET: tl.constexpr, ROWS: tl.constexpr):  # noqa: N803
    """QSGD with 8-bit codes: per bucket of ``BUCKET`` elements its norm, then ``code = level << 1 | (x < 0)``
    with ``level = min(floor(u + |x| * s / norm), s)``, ``u`` uniform in [0, 1) from Philox(``seed``), number
    ``i % 4`` of counter ``i // 4``."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    tl.store(norms_ptr + rows, norm, mask=rows < count)
    safe = tl.where(norm > 0, norm, 1.0)
    groups = rows[:, None] * (BUCKET // 4) + tl.arange(0, BUCKET // 4)[None, :]
    u = tl.reshape(_uniform(seed, groups), (ROWS, BUCKET))
    level = u + tl.math.div_rn(tl.abs(x) * levels, safe[:, None])
    level = tl.minimum(level, levels * 1.0)
    code = (level.to(tl.int32) << 1) | (x < 0).to(tl.int32)
    tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)


def qsgd_decode(codes_ptr, norms_ptr, out_ptr, n, levels, BUCKET: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    """``value = level * (norm / s)``, negated where the sign bit is set: the torch decode's operations in its
    order (one rounding each), so the same bits."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    code = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    norm = tl.load(norms_ptr + offs // BUCKET, mask=mask, other=0.0)
    scale = tl.math.div_rn(norm, levels * 1.0)
    value = (code >> 1).to(tl.float32) * scale
    value = tl.where((code & 1) != 0, -value, value)
    tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)


def terngrad_encode(x_ptr, bound_ptr, scale_ptr, out_ptr, n, nbytes, seed, CLIP: tl.constexpr,
                    BYTES: tl.constexpr):  # noqa: N803
    """TernGrad's 2-bit codes, four per byte: clip to ``±bound``, keep with probability ``|x| / scale`` (``u``
    from Philox(``seed``): the four numbers of counter ``b`` for the four elements of byte ``b``); code 1 is
    ``+``, 2 is ``-``, 0 is dropped."""
    b, offs = _rows(tl.program_id(0), BYTES, 4)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CLIP:
        bound = tl.load(bound_ptr)
        x = tl.minimum(tl.maximum(x, -bound), bound)
    scale = tl.load(scale_ptr)
    prob = tl.math.div_rn(tl.abs(x), tl.where(scale > 0, scale, 1.0))
    keep = (tl.reshape(_uniform(seed, b), (BYTES, 4)) < prob).to(tl.int32)
    code = tl.where(mask, keep << (x < 0).to(tl.int32), 0)
    tl.store(out_ptr + b, _pack(code, 4), mask=b < nbytes)


def terngrad_decode(packed_ptr, scale_ptr, out_ptr, n, BYTES: tl.constexpr):  # noqa: N803
    """Code ``c`` to ``((c & 1) - (c >> 1)) * scale``: the torch decode's one conversion and one product."""
    b, offs = _rows(tl.program_id(0), BYTES, 4)
    code = _unpack(tl.load(packed_ptr + b, mask=b * 4 < n, other=0), 4)
    ternary = ((code & 1) - (code >> 1)).to(out_ptr.dtype.element_ty)
    scale = tl.load(scale_ptr).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, ternary * scale, mask=offs < n)


def sign_stats(x_ptr, bits_ptr, part_ptr, n, nbytes, PACK: tl.constexpr, KIND: tl.constexpr,
               BYTES: tl.constexpr):  # noqa: N803
    """One pass per block of ``8 * BYTES`` elements: the sign bits (when ``PACK``) and only the partial
    statistics ``KIND`` needs, at ``part_ptr + 4 * block``. ``KIND`` 0: ``sum |x|``; 1: the sum of ``x >= 0``
    (NaN counts here), the sum of ``x < 0``, the count of ``x >= 0``; 2: the sum, the sum of squared deviations
    from the block's mean, ``max |x|`` (skipping NaN; the sum carries it)."""
    pid = tl.program_id(0)
    b, offs = _rows(pid, BYTES, 8)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PACK:
        tl.store(bits_ptr + b, _pack((x >= 0) & mask, 8), mask=b < nbytes)
    base = part_ptr + pid * 4
    if KIND == 0:
        tl.store(base, tl.sum(tl.abs(x)))  # masked elements are 0
    elif KIND == 1:
        tl.store(base, tl.sum(tl.where(x < 0, 0.0, x)))
        tl.store(base + 1, tl.sum(tl.where(x < 0, x, 0.0)))
        tl.store(base + 2, tl.sum(((x >= 0) & mask).to(tl.float32)))
    else:
        total = tl.sum(x)
        mean = total / tl.minimum(n - pid * (BYTES * 8), BYTES * 8).to(tl.float32)
        dev = tl.where(mask, x - mean, 0.0)
        tl.store(base, total)
        tl.store(base + 1, tl.sum(dev * dev))
        tl.store(base + 2, tl.max(tl.abs(x)))


def finish_stats(part_ptr, out_ptr, bound_ptr, blocks, n, clip, KIND: tl.constexpr, SPAN: tl.constexpr,
                 BLOCK: tl.constexpr):  # noqa: N803
    """One program folds the blocks' partials (in float64, in block order: the same result every run) into
    the codec's scalars. ``KIND`` 0 (EF-signSGD): ``mean|x|``; 1 (1-bit SGD): the means of each side; 2
    (TernGrad): ``scale`` and, at ``bound_ptr``, ``bound``, with ``bound = clip * std`` (Chan et al.'s pairwise
    variance of blocks of ``SPAN`` elements) and ``scale = max|clip(x)|``, NaN when any element is NaN or infinite
    (max skips NaN; a sum does not)."""
    rows = tl.arange(0, BLOCK)
    first = tl.zeros((BLOCK,), dtype=tl.float64)
    second = tl.zeros((BLOCK,), dtype=tl.float64)
    third = tl.zeros((BLOCK,), dtype=tl.float64)
    high = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, blocks, BLOCK):
        r = start + rows
        m = r < blocks
        first += tl.load(part_ptr + r * 4, mask=m, other=0.0).to(tl.float64)
        if KIND == 1:
            second += tl.load(part_ptr + r * 4 + 1, mask=m, other=0.0).to(tl.float64)
            third += tl.load(part_ptr + r * 4 + 2, mask=m, other=0.0).to(tl.float64)
        if KIND == 2:
            high = tl.maximum(high, tl.load(part_ptr + r * 4 + 2, mask=m, other=0.0))
    if KIND == 0:
        tl.store(out_ptr, (tl.sum(first) / n).to(tl.float32))
    elif KIND == 1:
        cp = tl.sum(third)
        tl.store(out_ptr, (tl.sum(first) / tl.maximum(cp, 1.0)).to(tl.float32))
        tl.store(out_ptr + 1, (tl.sum(second) / tl.maximum(n - cp, 1.0)).to(tl.float32))
    else:
        total = tl.sum(first)
        mean = total / n
        m2 = tl.zeros((BLOCK,), dtype=tl.float64)
        for start in range(0, blocks, BLOCK):
            r = start + rows
            m = r < blocks
            cnt = tl.minimum(n - r * SPAN, SPAN).to(tl.float64)
            s = tl.load(part_ptr + r * 4, mask=m, other=0.0).to(tl.float64)
            bm2 = tl.load(part_ptr + r * 4 + 1, mask=m, other=0.0).to(tl.float64)
            bm = (s.to(tl.float32) / tl.where(m, cnt, 1.0).to(tl.float32)).to(tl.float64)  # sign_stats' mean
            m2 += tl.where(m, bm2 + cnt * (bm - mean) * (bm - mean), 0.0)
        scale = tl.max(high).to(tl.float64)
        bound = clip * tl.sqrt(tl.sum(m2) / n)
        if clip > 0:
            scale = tl.minimum(scale, bound)
        scale = scale + total * 0.0
        tl.store(out_ptr, scale.to(tl.float32))
        tl.store(bound_ptr, bound.to(tl.float32))


def signum_pack(x_ptr, prev_ptr, m_ptr, bits_ptr, n, nbytes, beta, rest, HAS_PREV: tl.constexpr,
                BYTES: tl.constexpr):  # noqa: N803
    """SIGNUM's step in one pass: ``m = prev * beta + x * rest`` (``prev`` 0 when absent) into ``m_ptr``, and the
    bits of ``m >= 0``."""
    b, offs = _rows(tl.program_id(0), BYTES, 8)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_PREV:
        prev = tl.load(prev_ptr + offs, mask=mask, other=0.0)
    else:
        prev = tl.zeros((BYTES, 8), dtype=tl.float32)
    m = prev * beta + x * rest
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(bits_ptr + b, _pack((m >= 0) & mask, 8), mask=b < nbytes)


def randk_gather(x_ptr, values_ptr, indices_ptr, k, q, r, seed, weyl, mix, BLOCK: tl.constexpr):  # noqa: N803
    """Rand-k's draw and gather in one pass over ``k``: block ``j`` (``q + 1`` elements for ``j < r``, else ``q``)
    sends the element at offset ``splitmix64_high32(j * weyl + seed) mod its length`` (``sparsify.Strata``'s
    hash, in wrapping uint64 arithmetic); its index (int64) and value are written."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = j < k
    jj = j.to(tl.int64)
    zero = jj * 0  # the integer arguments as int64 whatever width (or constant) Triton specialized them to
    h = jj.to(tl.uint64, bitcast=True) * (zero + weyl).to(tl.uint64, bitcast=True) + (zero + seed).to(
        tl.uint64, bitcast=True)
    h = h ^ (h >> 32)
    h = h * (zero + mix).to(tl.uint64, bitcast=True)
    high = (h >> 32).to(tl.uint32).to(tl.int32, bitcast=True)  # the signed high half
    size = tl.where(j < r, q + 1, q)  # int32 from here (indices < n < 2**31): no 64-bit division
    offset = high % size
    offset = tl.where(offset < 0, offset + size, offset)  # floor modulo (torch.remainder), whatever % rounds to
    index = j * q + tl.minimum(j, r) + offset
    tl.store(indices_ptr + j, index.to(tl.int64), mask=mask)
    tl.store(values_ptr + j, tl.load(x_ptr + index, mask=mask), mask=mask)


def randk_place(values_ptr, indices_ptr, out_ptr, n, q, r, BLOCK: tl.constexpr):  # noqa: N803
    """The dense tensor of rand-k's payload in one pass over ``n``: element ``i`` is its block's value where
    ``i`` is the block's index, else 0 (the zero fill and the scatter in one write)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32 throughout (n < 2**31): a GPU divides 64-bit
    mask = i < n                                        # integers in software, one per element here
    long_part = r * (q + 1)
    block = tl.where(i < long_part, i // (q + 1), r + (i - long_part) // q)
    chosen = tl.load(indices_ptr + block, mask=mask, other=-1).to(tl.int32)
    value = tl.load(values_ptr + block, mask=mask, other=0.0)
    tl.store(out_ptr + i, tl.where(chosen == i, value, tl.zeros_like(value)), mask=mask)


def gather_narrow(x_ptr, indices_ptr, values_ptr, narrow_ptr, k, BLOCK: tl.constexpr):  # noqa: N803
    """A sparsifier's payload in one pass over ``k``: ``x[indices]`` and the int64 ``indices`` as int32 (the wire's)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = j < k
    index = tl.load(indices_ptr + j, mask=mask, other=0)
    tl.store(values_ptr + j, tl.load(x_ptr + index, mask=mask), mask=mask)
    tl.store(narrow_ptr + j, index.to(tl.int32), mask=mask)


def scatter_values(values_ptr, indices_ptr, out_ptr, k, BLOCK: tl.constexpr):  # noqa: N803
    """``out[indices[j]] = values[j]`` for distinct indices of any integer width (no widening pass first)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = j < k
    index = tl.load(indices_ptr + j, mask=mask, other=0)
    tl.store(out_ptr + index, tl.load(values_ptr + j, mask=mask), mask=mask)


KERNELS = {f.__name__: f for f in (pack_nonnegative, select_by_bits, qsgd_encode, qsgd_decode, terngrad_encode,
                                     terngrad_decode, sign_stats, finish_stats, signum_pack,
                                     randk_gather, randk_place, gather_narrow, scatter_values)}
__all__ = ["KERNELS", "triton"]
