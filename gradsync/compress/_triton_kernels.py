"""The Triton kernels behind :mod:`gradsync.compress.fused` (imported only where Triton is installed).

Each kernel is one pass over the tensor where the torch form of the same codec takes 3 to 8 kernels, and
each writes exactly what the torch form writes (see :mod:`~gradsync.compress.fused` for which are
bit-identical and which draw their own random numbers). Bit order is :mod:`~gradsync.compress.packing`'s:
element ``i`` is bit ``i % 8`` (or field ``i % (8 / bits)``) of byte ``i // (8 / bits)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The functions stay plain (undecorated) here: :mod:`fused` wraps each once for the GPU (``triton.jit``) and
# once for Triton's interpreter, which runs the same source on CPU tensors in the tests.


def pack_nonnegative(x_ptr, out_ptr, n, nbytes, BYTES: tl.constexpr):  # noqa: N803 - Triton's constexpr style
    """Bit ``i`` = ``x[i] >= 0`` (NaN: 0, as torch's ``ge``); padding bits past ``n`` are 0."""
    pid = tl.program_id(0)
    offs = pid * (BYTES * 8) + tl.arange(0, BYTES * 8)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # exact for fp16/bf16
    bits = tl.reshape(((x >= 0) & mask).to(tl.int32), (BYTES, 8))
    byte = tl.sum(bits << tl.arange(0, 8)[None, :], axis=1)
    b = pid * BYTES + tl.arange(0, BYTES)
    tl.store(out_ptr + b, byte.to(tl.uint8), mask=b < nbytes)


def select_by_bits(packed_ptr, out_ptr, n, v_ptr, hi, lo, MODE: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    """``out[i] = hi if bit i else lo``. ``MODE`` 0: ``hi``/``lo`` are the numbers given; 1: ``hi = v[0]``,
    ``lo = -v[0]``; 2: ``hi = v[0]``, ``lo = v[1]`` (device values, read in the kernel: no host round trip)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = tl.load(packed_ptr + (offs >> 3), mask=mask, other=0).to(tl.int32)
    bit = (byte >> (offs & 7)) & 1
    if MODE == 0:
        value = tl.where(bit != 0, hi, lo)
    elif MODE == 1:
        s = tl.load(v_ptr).to(out_ptr.dtype.element_ty)
        value = tl.where(bit != 0, s, -s)
    else:
        a = tl.load(v_ptr).to(out_ptr.dtype.element_ty)
        b = tl.load(v_ptr + 1).to(out_ptr.dtype.element_ty)
        value = tl.where(bit != 0, a, b)
    tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=mask)


def qsgd_encode(x_ptr, norms_ptr, codes_ptr, n, count, seed, levels,
                BUCKET: tl.constexpr, ROWS: tl.constexpr):  # noqa: N803
    """QSGD with 8-bit codes: per bucket of ``BUCKET`` elements its norm, then ``code = level << 1 | (x < 0)``
    with ``level = min(floor(u + |x| * s / norm), s)``, ``u`` uniform in [0, 1) from Philox(``seed``, index)."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    tl.store(norms_ptr + rows, norm, mask=rows < count)
    safe = tl.where(norm > 0, norm, 1.0)
    u = tl.rand(seed, offs)
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
    from Philox(``seed``, index)); code 1 is ``+``, 2 is ``-``, 0 is dropped."""
    pid = tl.program_id(0)
    offs = pid * (BYTES * 4) + tl.arange(0, BYTES * 4)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CLIP:
        bound = tl.load(bound_ptr)
        x = tl.minimum(tl.maximum(x, -bound), bound)
    scale = tl.load(scale_ptr)
    prob = tl.math.div_rn(tl.abs(x), tl.where(scale > 0, scale, 1.0))
    u = tl.rand(seed, offs)
    keep = (u < prob).to(tl.int32)
    code = keep << (x < 0).to(tl.int32)
    code = tl.where(mask, code, 0)
    fields = tl.reshape(code, (BYTES, 4))
    byte = tl.sum(fields << (tl.arange(0, 4) * 2)[None, :], axis=1)
    b = pid * BYTES + tl.arange(0, BYTES)
    tl.store(out_ptr + b, byte.to(tl.uint8), mask=b < nbytes)


def terngrad_decode(packed_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
    """Code ``c`` to ``((c & 1) - (c >> 1)) * scale``: the torch decode's one conversion and one product."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = tl.load(packed_ptr + (offs >> 2), mask=mask, other=0).to(tl.int32)
    code = (byte >> ((offs & 3) * 2)) & 3
    ternary = ((code & 1) - (code >> 1)).to(out_ptr.dtype.element_ty)
    scale = tl.load(scale_ptr).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, ternary * scale, mask=mask)


def sign_stats(x_ptr, bits_ptr, part_ptr, n, nbytes, PACK: tl.constexpr, BYTES: tl.constexpr):  # noqa: N803
    """One pass per block of ``8 * BYTES`` elements: the sign bits (when ``PACK``) and the block's partial
    statistics at ``part_ptr + 8 * block``: count, sum of ``x >= 0`` (NaN counts here), sum of ``x < 0``, count
    of ``x >= 0``, block mean, sum of squared deviations from it, min, max."""
    pid = tl.program_id(0)
    offs = pid * (BYTES * 8) + tl.arange(0, BYTES * 8)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    nonneg = (x >= 0) & mask
    if PACK:
        bits = tl.reshape(nonneg.to(tl.int32), (BYTES, 8))
        byte = tl.sum(bits << tl.arange(0, 8)[None, :], axis=1)
        b = pid * BYTES + tl.arange(0, BYTES)
        tl.store(bits_ptr + b, byte.to(tl.uint8), mask=b < nbytes)
    count = tl.sum(mask.to(tl.float32))
    sum_pos = tl.sum(tl.where(x < 0, 0.0, x))  # masked elements are 0
    sum_neg = tl.sum(tl.where(x < 0, x, 0.0))
    mean = (sum_pos + sum_neg) / count
    dev = tl.where(mask, x - mean, 0.0)
    base = part_ptr + pid * 8
    tl.store(base, count)
    tl.store(base + 1, sum_pos)
    tl.store(base + 2, sum_neg)
    tl.store(base + 3, tl.sum(nonneg.to(tl.float32)))
    tl.store(base + 4, mean)
    tl.store(base + 5, tl.sum(dev * dev))
    tl.store(base + 6, tl.min(tl.where(mask, x, float("inf"))))
    tl.store(base + 7, tl.max(tl.where(mask, x, float("-inf"))))


def finish_stats(part_ptr, out_ptr, bound_ptr, blocks, n, clip, KIND: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    """One program folds the blocks' partials (in float64, in block order: the same result every run) into
    the codec's scalars. ``KIND`` 0 (EF-signSGD): ``mean|x|``; 1 (1-bit SGD): the means of each side; 2
    (TernGrad): ``scale`` and, at ``bound_ptr``, ``bound``, with ``bound = clip * std`` (Chan et al.'s pairwise variance) and
    ``scale = max|clip(x)|``, NaN when any element is NaN or infinite (min and max skip NaN; a sum does not)."""
    rows = tl.arange(0, BLOCK)
    sum_pos = tl.zeros((BLOCK,), dtype=tl.float64)
    sum_neg = tl.zeros((BLOCK,), dtype=tl.float64)
    count_pos = tl.zeros((BLOCK,), dtype=tl.float64)
    low = tl.full((BLOCK,), float("inf"), dtype=tl.float32)
    high = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, blocks, BLOCK):
        r = start + rows
        m = r < blocks
        sum_pos += tl.load(part_ptr + r * 8 + 1, mask=m, other=0.0).to(tl.float64)
        sum_neg += tl.load(part_ptr + r * 8 + 2, mask=m, other=0.0).to(tl.float64)
        count_pos += tl.load(part_ptr + r * 8 + 3, mask=m, other=0.0).to(tl.float64)
        low = tl.minimum(low, tl.load(part_ptr + r * 8 + 6, mask=m, other=float("inf")))
        high = tl.maximum(high, tl.load(part_ptr + r * 8 + 7, mask=m, other=float("-inf")))
    sp = tl.sum(sum_pos)
    sn = tl.sum(sum_neg)
    if KIND == 0:
        tl.store(out_ptr, ((sp - sn) / n).to(tl.float32))
    elif KIND == 1:
        cp = tl.sum(count_pos)
        tl.store(out_ptr, (sp / tl.maximum(cp, 1.0)).to(tl.float32))
        tl.store(out_ptr + 1, (sn / tl.maximum(n - cp, 1.0)).to(tl.float32))
    else:
        total = sp + sn
        mean = total / n
        m2 = tl.zeros((BLOCK,), dtype=tl.float64)
        for start in range(0, blocks, BLOCK):
            r = start + rows
            m = r < blocks
            cnt = tl.load(part_ptr + r * 8, mask=m, other=0.0).to(tl.float64)
            bm = tl.load(part_ptr + r * 8 + 4, mask=m, other=0.0).to(tl.float64)
            bm2 = tl.load(part_ptr + r * 8 + 5, mask=m, other=0.0).to(tl.float64)
            m2 += bm2 + cnt * (bm - mean) * (bm - mean)
        scale = tl.maximum(-tl.min(low), tl.max(high)).to(tl.float64)
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
    pid = tl.program_id(0)
    offs = pid * (BYTES * 8) + tl.arange(0, BYTES * 8)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_PREV:
        prev = tl.load(prev_ptr + offs, mask=mask, other=0.0)
    else:
        prev = tl.zeros((BYTES * 8,), dtype=tl.float32)
    m = prev * beta + x * rest
    tl.store(m_ptr + offs, m, mask=mask)
    bits = tl.reshape(((m >= 0) & mask).to(tl.int32), (BYTES, 8))
    byte = tl.sum(bits << tl.arange(0, 8)[None, :], axis=1)
    b = pid * BYTES + tl.arange(0, BYTES)
    tl.store(bits_ptr + b, byte.to(tl.uint8), mask=b < nbytes)


KERNELS = {f.__name__: f for f in (pack_nonnegative, select_by_bits, qsgd_encode, qsgd_decode, terngrad_encode,
                                     terngrad_decode, sign_stats, finish_stats, signum_pack)}
__all__ = ["KERNELS", "triton"]
