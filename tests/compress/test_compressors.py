"""Compressors, error feedback and the reference step (issue 8, seed 004 §2.1 and Table 1)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from gradsync.compress import (
    COMMUNICATORS,
    COMPRESSORS,
    DGC,
    MEMORIES,
    CompressionError,
    Compressor,
    DGCMemory,
    PowerSGD,
    ResidualMemory,
    TensorInfo,
    TopK,
    create,
    create_memory,
    majority_vote,
    pack_bits,
    pack_uint,
    packed_nbytes,
    packing,
    payload_nbytes,
    simulate_step,
    unpack_bits,
    unpack_uint,
)
from gradsync.compress.base import stable_seed
from gradsync.errors import GradsyncError

NAMES = COMPRESSORS.names()
SHAPES = [(1,), (7,), (1000,), (4097,), (40, 25), (17, 241), (8, 4, 3, 3), (64, 3, 7, 7)]
ONE_BIT = ["signsgd", "signum", "efsignsgd", "onebit"]
AVERAGED = [n for n in NAMES if COMPRESSORS.get(n).average]


pytestmark = pytest.mark.usefixtures("single_intraop_thread")


def _seeded(name: str, **params: object) -> Compressor:
    """A compressor with a fixed seed where it takes one, so the tests are deterministic."""
    if "seed" in inspect.signature(COMPRESSORS.get(name)).parameters and "seed" not in params:
        params["seed"] = 0
    return create(name, **params)


def _info(x: torch.Tensor, name: str = "layer.weight") -> TensorInfo:
    return TensorInfo.of(name, x)


# -- packing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 32])
@pytest.mark.parametrize("n", [0, 1, 13, 1000])
def test_pack_uint_round_trips_in_exact_bytes(bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    values = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.int64)
    packed = pack_uint(values, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(unpack_uint(packed, bits, n), values)


@pytest.mark.parametrize("bits", [1, 3, 5])
def test_pack_uint_stream_is_little_endian_like_numpy(bits: int) -> None:
    values = torch.randint(0, 2**bits, (101,), generator=torch.Generator().manual_seed(bits))
    stream = ((values.numpy()[:, None] >> np.arange(bits)) & 1).astype(bool).reshape(-1)
    assert np.array_equal(pack_uint(values, bits).numpy(), np.packbits(stream, bitorder="little"))


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 3, 9, 17, 1001])
def test_whole_word_packing_matches_numpy_bit_by_bit(bits: int, n: int) -> None:
    """The word-shift path (1-bit fields take it off CPU only, so it is called directly) against a stream
    built bit by bit, and its inverse as one uint8 field per byte."""
    values = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(bits * 100 + n), dtype=torch.uint8)
    stream = ((values.numpy()[:, None].astype(np.int64) >> np.arange(bits)) & 1).astype(bool).reshape(-1)
    nbytes = packed_nbytes(n, bits)
    packed = packing._pack_words(values, bits, n, nbytes)
    assert np.array_equal(packed.numpy(), np.packbits(stream, bitorder="little"))
    fields = packing._unpack_words(packed, bits, n, nbytes)
    assert fields.dtype == torch.uint8 and torch.equal(fields, values)
    assert torch.equal(packing._unpack_shift(packed, bits, n, nbytes), values)  # the off-CPU inverse
    fields = torch.zeros(nbytes * (8 // bits), dtype=torch.uint8)
    fields[:n] = values
    assert torch.equal(packing._multiply_pack(fields, bits), packed)  # the off-CPU packing
    if bits > 1:
        assert torch.equal(packing.unpack_fields(pack_uint(values, bits), bits, n), values)


def test_less_and_pack_nonnegative_match_torch() -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(5))
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    for t in (x, x.double(), x.half()):  # numpy path for float32/64, torch's for the rest
        assert torch.equal(packing.less(t, 0), (t < 0).to(torch.uint8))
        assert torch.equal(packing.less(t, t.flip(0)), (t < t.flip(0)).to(torch.uint8))
        assert torch.equal(packing.pack_nonnegative(t), pack_bits(t >= 0))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1001])
def test_off_cpu_sign_packing_matches_numpy(n: int) -> None:
    """The paths a GPU takes (a comparison into padded words, one multiplication per word), run on CPU tensors."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    if n:
        x[0] = -0.0
    expected = np.packbits(x.numpy() >= 0, bitorder="little")
    assert np.array_equal(packing._pack_nonnegative_words(x).numpy(), expected)
    assert np.array_equal(packing._multiply_pack(torch.ones(64, dtype=torch.uint8), 1).numpy(), [255] * 8)


def test_pack_bits_round_trip() -> None:
    bits = torch.rand(4097, generator=torch.Generator().manual_seed(1)) > 0.5
    packed = pack_bits(bits)
    assert packed.numel() == 513
    assert torch.equal(unpack_bits(packed, 4097), bits)


def test_packing_rejects_bad_widths() -> None:
    with pytest.raises(ValueError, match=r"bits=0 must be an integer in \[1, 32\]"):
        pack_uint(torch.zeros(3, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match="integer or bool"):
        pack_uint(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="need 2 bytes"):
        unpack_uint(torch.zeros(1, dtype=torch.uint8), 4, 3)


# -- the contract, for every registered compressor ----------------------------------------------------------


def test_registry_holds_the_issue_methods() -> None:
    expected = {"none", "fp16", "qsgd", "terngrad", "topk", "randk", "dgc", "efsignsgd", "signsgd", "signum"}
    assert expected | {"onebit", "powersgd"} <= set(NAMES)
    assert set(MEMORIES.names()) == {"none", "residual", "dgc"}
    for name in NAMES:
        assert COMPRESSORS.get(name).communicator in COMMUNICATORS
        assert COMPRESSORS.get(name).name == name
    allreduce = {n for n in NAMES if COMPRESSORS.get(n).communicator == "allreduce"}
    assert allreduce == {"none", "fp16", "bf16", "randk", "powersgd"}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_decompress_restores_shape_and_dtype(name: str, shape: tuple[int, ...]) -> None:
    compressor = _seeded(name)
    for dtype in (torch.float32, torch.float16, torch.float64):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        payload, ctx = compressor.compress(x, _info(x))
        out = compressor.decompress(payload, ctx)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_payload_bytes_is_the_actual_payload(name: str, shape: tuple[int, ...]) -> None:
    compressor = _seeded(name)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        payload, _ = compressor.compress(x, _info(x))
        assert payload_nbytes(payload) == compressor.payload_bytes(shape, dtype)
    if len(shape) == 1:  # a bare element count prices a merged flat buffer the same way
        assert compressor.payload_bytes(shape[0], torch.float32) == compressor.payload_bytes(shape, torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_estimate_ratio_prices_compression(name: str) -> None:
    info = TensorInfo("conv", (64, 3, 7, 7), torch.float32, position=3)
    ratio = create(name).estimate_ratio(info)
    assert ratio == 1.0 if name == "none" else ratio <= 0.5


@pytest.mark.parametrize("name", ONE_BIT)
@pytest.mark.parametrize("numel", [1000, 4097, 64 * 3 * 7 * 7])
def test_one_bit_methods_send_d_over_8_bytes(name: str, numel: int) -> None:
    compressor = create(name)
    extra = compressor.payload_bytes(numel, torch.float32) - math.ceil(numel / 8)
    assert 0 <= extra <= 8  # at most two float32 scalars
    x = torch.randn(numel)
    assert payload_nbytes(compressor.compress(x, _info(x))[0]) == math.ceil(numel / 8) + extra


def test_compress_checks_the_tensor_matches_its_info() -> None:
    x = torch.randn(4, 5)
    with pytest.raises(CompressionError, match=r"is \(4, 5\) torch.float32, but its TensorInfo says \(20,\)"):
        create("topk").compress(x, TensorInfo("w", (20,), torch.float32))
    with pytest.raises(CompressionError, match="floating"):
        TensorInfo("w", (3,), torch.int64)
    info = TensorInfo("w", [4, 5], torch.float32, position=2)
    assert info.shape == (4, 5) and info.numel == 20 and info.nbytes == 80
    with pytest.raises(AttributeError):
        info.name = "v"  # type: ignore[misc]


# -- sparsifiers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["topk", "dgc"])
@pytest.mark.parametrize("numel,ratio", [(1000, 0.01), (4097, 0.1), (20000, 0.01), (7, 0.3), (50000, 0.01),
                                         (200000, 0.002)])
def test_sparsifiers_keep_exactly_the_k_largest(name: str, numel: int, ratio: float) -> None:
    x = torch.randperm(numel, generator=torch.Generator().manual_seed(numel)).float() - numel / 2 + 0.5  # distinct
    compressor = _seeded(name, ratio=ratio)
    payload, ctx = compressor.compress(x, _info(x))
    k = round(ratio * numel)
    values, indices = payload
    assert values.numel() == indices.numel() == k and indices.dtype == torch.int32
    assert set(indices.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())
    out = compressor.decompress(payload, ctx)
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[indices.long()] = True
    assert torch.equal(out[mask], x[mask]) and not out[~mask].any()


def test_dgc_falls_back_to_exact_topk_when_the_sampled_threshold_is_too_high(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(20000, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(DGC, "_OVERSAMPLE", 1e-6)  # threshold = the sample's max: too few candidates
    payload, _ = create("dgc", ratio=0.05, seed=0).compress(x, _info(x))
    assert set(payload[1].tolist()) == set(torch.topk(x.abs(), 1000).indices.tolist())


def test_topk_on_large_tensors_is_exact_even_when_its_sampled_threshold_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-k preselects candidates above a sampled threshold from 8 * 4096 elements on; the result is
    torch.topk's set, and a threshold that lets too few through falls back to the full top-k."""
    x = torch.randn(40000, generator=torch.Generator().manual_seed(4))
    expected = set(torch.topk(x.abs(), 400).indices.tolist())
    assert set(create("topk", ratio=0.01).compress(x, _info(x))[0][1].tolist()) == expected
    monkeypatch.setattr(TopK, "_OVERSAMPLE", 1e-6)  # threshold = the sample's max: too few candidates
    assert set(create("topk", ratio=0.01).compress(x, _info(x))[0][1].tolist()) == expected


def test_compressors_leave_their_input_alone() -> None:
    """Codecs overwrite their own temporaries in place; never the caller's tensor."""
    for name in NAMES:
        for n in (1, 128, 300, 40000):
            x = torch.randn(n, generator=torch.Generator().manual_seed(n))
            before = x.clone()
            compressor = _seeded(name)
            payload, ctx = compressor.compress(x, _info(x))
            compressor.decompress(payload, ctx)
            assert torch.equal(x, before) and torch.equal(x.sign(), before.sign()), (name, n)


def test_randk_indices_are_shared_across_workers_and_change_per_step() -> None:
    x = torch.randn(1000)
    info = _info(x)
    a, b = create("randk", ratio=0.05, seed=7), create("randk", ratio=0.05, seed=7)
    (_, ctx_a1), (_, ctx_b1) = a.compress(x, info), b.compress(torch.randn(1000), info)
    (_, ctx_a2), (_, ctx_b2) = a.compress(x, info), b.compress(x, info)
    assert torch.equal(ctx_a1.extra[0], ctx_b1.extra[0])
    assert torch.equal(ctx_a2.extra[0], ctx_b2.extra[0])
    assert not torch.equal(ctx_a1.extra[0], ctx_a2.extra[0])
    assert len(set(ctx_a1.extra[0].tolist())) == 50
    assert torch.equal(a.indices(info, 0), ctx_a1.extra[0])
    assert not torch.equal(a.indices(info, 0), a.indices(TensorInfo("other", (1000,), torch.float32), 0))


def test_randk_allreduce_sums_values_at_the_shared_indices() -> None:
    grads = [torch.randn(500, generator=torch.Generator().manual_seed(w)) for w in range(3)]
    info = _info(grads[0])
    workers = [create("randk", ratio=0.1) for _ in range(3)]
    out = simulate_step(workers, [create_memory("none") for _ in range(3)], grads, info)
    idx = create("randk", ratio=0.1).indices(info, 0)
    expected = torch.zeros(500)
    expected[idx] = torch.stack(grads).mean(0)[idx]
    torch.testing.assert_close(out, expected)


# -- unbiased quantizers ------------------------------------------------------------------------------------


def _mean_of_draws(name: str, x: torch.Tensor, draws: int, **params: object) -> torch.Tensor:
    compressor = create(name, seed=0, **params)
    info = _info(x)
    total = torch.zeros_like(x)
    for _ in range(draws):
        total += compressor.decompress(*compressor.compress(x, info))
    return total / draws


@pytest.mark.parametrize("bucket_size", [None, 8])
def test_qsgd_is_unbiased(bucket_size: int | None) -> None:
    x = torch.randn(32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    levels, draws = 2, 2000
    mean = _mean_of_draws("qsgd", x, draws, levels=levels, bucket_size=bucket_size)
    # Each element is norm/s * (floor(a) + Bernoulli(frac(a))): variance <= (norm/s)^2 / 4. Five standard
    # errors of the mean bound a per-element miss with probability ~6e-7 each.
    norm = x.norm() if bucket_size is None else x.view(-1, bucket_size).norm(dim=1).max()
    tolerance = 5 * (norm / levels) / (2 * math.sqrt(draws))
    assert (mean - x).abs().max() <= tolerance


def test_qsgd_values_are_on_the_grid_and_within_one_level() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    compressor = create("qsgd", levels=4, bucket_size=None, seed=1)  # one norm for the tensor
    out = compressor.decompress(*compressor.compress(x, _info(x)))
    step = x.norm() / 4
    grid = out / step
    torch.testing.assert_close(grid, grid.round(), atol=1e-5, rtol=0)
    assert ((out - x).abs() <= step + 1e-6).all()
    assert compressor.bits == 4  # 3 bits of level (0..4) + 1 of sign


def test_terngrad_is_unbiased_and_ternary() -> None:
    x = torch.randn(32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    draws = 2000
    mean = _mean_of_draws("terngrad", x, draws, clip=None)
    scale = x.abs().max()
    assert (mean - x).abs().max() <= 5 * scale / (2 * math.sqrt(draws))  # Bernoulli variance <= scale^2/4
    compressor = create("terngrad", clip=None, seed=3)
    out = compressor.decompress(*compressor.compress(x, _info(x)))
    assert set((out / scale.float()).round().tolist()) <= {-1.0, 0.0, 1.0}


def test_terngrad_clips_at_two_and_a_half_sigma_by_default() -> None:
    """TernGrad §3.3 / GRACE: clamp to ±2.5σ, then ternarize; unbiased for the clamped tensor, and an outlier
    no longer sets the scale (brute-force reference: the formula on the same tensor)."""
    x = torch.randn(400, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    x[17] = 40.0  # one outlier
    c = 2.5 * torch.sqrt(((x - x.mean()) ** 2).mean())
    clipped = x.clamp(-c, c)
    draws = 2000
    mean = _mean_of_draws("terngrad", x, draws)
    assert (mean - clipped).abs().max() <= 5 * c / (2 * math.sqrt(draws))
    compressor = create("terngrad", seed=4)
    out = compressor.decompress(*compressor.compress(x, _info(x)))
    assert set((out / c).round(decimals=6).tolist()) <= {-1.0, 0.0, 1.0}
    err_clip = (_mean_of_draws("terngrad", x, 1) - x).norm()
    err_plain = (_mean_of_draws("terngrad", x, 1, clip=None) - x).norm()
    assert err_clip < err_plain  # the outlier dominated the unclipped scale


def test_qsgd_default_buckets_of_128_keep_the_error_small_on_large_tensors() -> None:
    """Default ``bucket_size=128``: a norm per 128 elements (bytes: ceil(n/128) float32 + 8 bits per element),
    and the error stays near GRACE's 0.036 where one norm per tensor gives >1 (issue 20's measurement)."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(9))
    info = _info(x)
    bucketed, whole = create("qsgd", seed=0), create("qsgd", bucket_size=None, seed=0)
    assert bucketed.bucket_size == 128
    assert bucketed.payload_bytes(100_000, torch.float32) == math.ceil(100_000 / 128) * 4 + 100_000
    payload, ctx = bucketed.compress(x, info)
    assert sum(p.numel() * p.element_size() for p in payload) == bucketed.payload_bytes(100_000, torch.float32)
    rel = lambda c: ((c.decompress(*c.compress(x, info)) - x).norm() / x.norm()).item()  # noqa: E731
    assert rel(bucketed) < 0.06 < 0.5 < rel(whole)


@pytest.mark.parametrize(("n", "k"), [(1000, 20), (1003, 20), (7, 7), (10, 1), (2**20 + 5, 10_000)])
def test_randk_strata_match_the_pure_python_hash_one_index_per_block(n: int, k: int) -> None:
    """The tensor draw (wrapping int64 ops, the same on every device) against plain Python integers, and its
    shape: k distinct ascending indices, the j-th inside block j."""
    from gradsync.compress.sparsify import Strata, strata_reference

    strata = Strata(n, k, torch.device("cpu"))
    for seed in (0, 1, 2**62 + 12345, (1 << 63) - 1):
        drawn = strata.draw(seed)
        assert drawn.dtype == torch.int64 and drawn.tolist() == strata_reference(n, k, seed)
        ends = torch.cat([strata.start[1:], torch.tensor([n])])
        assert bool(((strata.start <= drawn) & (drawn < ends)).all())


def test_randk_sends_each_element_with_probability_k_over_n() -> None:
    """Over 2000 steps every element of a 1000-element tensor is drawn about 40 times (k = 20): chi-square."""
    from gradsync.compress.sparsify import Strata

    strata = Strata(1000, 20, torch.device("cpu"))
    draws = torch.cat([strata.draw(stable_seed("t", s)) for s in range(2000)])
    counts = torch.bincount(draws, minlength=1000).double()
    chi2 = (((counts - 40) ** 2) / 40).sum().item()
    assert chi2 < 1200  # 999 degrees of freedom (fewer: each block's counts sum to 2000): mean <= 999, sd ~45
    with pytest.raises(ValueError, match="k=0"):
        Strata(10, 0, torch.device("cpu"))


# -- 1-bit methods -----------------------------------------------------------------------------------------


def test_efsignsgd_decompresses_to_mean_abs_times_sign() -> None:
    x = torch.randn(4097, generator=torch.Generator().manual_seed(8))
    compressor = create("efsignsgd")
    out = compressor.decompress(*compressor.compress(x, _info(x)))
    torch.testing.assert_close(out, x.abs().mean() * torch.sign(x))


def test_onebit_decompresses_to_the_two_means() -> None:
    x = torch.tensor([3.0, 1.0, -2.0, -4.0, 0.5])
    compressor = create("onebit")
    out = compressor.decompress(*compressor.compress(x, _info(x)))
    torch.testing.assert_close(out, torch.tensor([1.5, 1.5, -3.0, -3.0, 1.5]))


@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_sign_methods_aggregate_by_majority_vote(name: str) -> None:
    grads = [
        torch.tensor([1.0, -2.0, 3.0, -0.5]),
        torch.tensor([0.2, 1.0, -1.0, -1.0]),
        torch.tensor([-5.0, 4.0, 0.1, -2.0]),
    ]
    info = _info(grads[0])
    workers = [create(name) for _ in grads]
    out = simulate_step(workers, [create_memory("none") for _ in grads], grads, info)
    # votes per element: (+,+,-) (-,+,+) (+,-,+) (-,-,-): majority +, +, +, -; not averaged over workers
    assert torch.equal(out, torch.tensor([1.0, 1.0, 1.0, -1.0]))
    assert torch.equal(majority_vote([torch.ones(2), -torch.ones(2)]), torch.zeros(2))  # a tie abstains


def test_signum_keeps_momentum_per_tensor() -> None:
    compressor = create("signum", momentum=0.5)
    info = TensorInfo("w", (2,), torch.float32)
    compressor.compress(torch.tensor([4.0, -4.0]), info)  # m = [2, -2]
    payload, ctx = compressor.compress(torch.tensor([-1.0, 1.0]), info)  # m = [0.5, -0.5]: signs persist
    assert torch.equal(compressor.decompress(payload, ctx), torch.tensor([1.0, -1.0]))
    other = TensorInfo("v", (2,), torch.float32)
    assert torch.equal(
        compressor.decompress(*compressor.compress(torch.tensor([-1.0, 1.0]), other)), torch.tensor([-1.0, 1.0])
    )


# -- error feedback ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_residual_memory_conserves_the_gradient_sum(name: str) -> None:
    """sum_t sent_t + e_T = sum_t g_t, since e_t = (g_t + e_{t-1}) - sent_t (closed form, exact up to rounding)."""
    gen = torch.Generator().manual_seed(9)
    compressor, memory = _seeded(name, **({"min_compression_rate": 0} if name == "powersgd" else {})), ResidualMemory()
    info = TensorInfo("w", (8, 16), torch.float64)
    sent, grads = torch.zeros(8, 16, dtype=torch.float64), torch.zeros(8, 16, dtype=torch.float64)
    for _ in range(6):
        g = torch.randn(8, 16, generator=gen, dtype=torch.float64)
        grads += g
        sent += simulate_step([compressor], [memory], [g], info)
    residual = memory.residual("w")
    assert residual is not None
    torch.testing.assert_close(sent + residual, grads, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", AVERAGED)
def test_residual_memory_conserves_the_sum_over_workers(name: str) -> None:
    """With W workers and a summing aggregate: W * sum_t out_t + sum_w e_w = sum of every worker's gradients."""
    world, gen = 3, torch.Generator().manual_seed(10)
    params = {"min_compression_rate": 0} if name == "powersgd" else {}
    compressors = [_seeded(name, **params) for _ in range(world)]
    memories = [ResidualMemory() for _ in range(world)]
    info = TensorInfo("w", (6, 10), torch.float64)
    sent, grads = torch.zeros(6, 10, dtype=torch.float64), torch.zeros(6, 10, dtype=torch.float64)
    for _ in range(4):
        g = [torch.randn(6, 10, generator=gen, dtype=torch.float64) for _ in range(world)]
        grads += sum(g)
        sent += world * simulate_step(compressors, memories, g, info)
    residuals = sum(m.residual("w") for m in memories)
    # fp16 and bf16 sum in their own dtype: that rounding happens after the memories saw their payloads.
    atol = 3 * 4 * {"fp16": 2**-10, "bf16": 2**-7}.get(name, 0) * grads.abs().max().item() or 1e-9
    torch.testing.assert_close(sent + residuals, grads, rtol=0, atol=atol)


def test_residual_memory_compensates_several_tensors_in_fused_launches_bit_for_bit(monkeypatch) -> None:
    """compensate_all's two fused launches (the GPU's path, here forced onto the CPU) give compensate's bits, in
    the memory's own buffers, which update then writes in place; a tensor whose residual does not fit goes alone."""
    shapes = [(40, 25), (17, 241), (8, 4, 3, 3)]
    infos = [TensorInfo(f"t{i}", s, torch.float32) for i, s in enumerate(shapes)]
    c = create("topk", ratio=0.1)
    gen = torch.Generator().manual_seed(5)
    fused, plain = ResidualMemory(), ResidualMemory()
    for step in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        if step == 2:  # a changed shape: its residual no longer fits
            grads[1], infos[1] = torch.randn(5, 7, generator=gen), TensorInfo("t1", (5, 7), torch.float32)
        monkeypatch.setattr(ResidualMemory, "fused_devices", frozenset({"cpu"}))
        got = fused.compensate_all(grads, infos)
        monkeypatch.undo()
        want = plain.compensate_all(grads, infos)
        for g, x, y in zip(grads, got, want):
            assert torch.equal(x, y) and (x is g) == (y is g)
        for memory, xs in ((fused, got), (plain, want)):
            for x, info in zip(xs, infos):
                memory.update(x, info, c, *c.compress(x, info))
    for info in infos:
        assert torch.equal(fused.residual(info.name), plain.residual(info.name))


def test_dgc_memory_with_zero_momentum_is_residual_memory() -> None:
    gen = torch.Generator().manual_seed(11)
    info = TensorInfo("w", (200,), torch.float64)
    a, b = create("topk", ratio=0.05), create("topk", ratio=0.05)
    dgc, residual = DGCMemory(momentum=0.0), ResidualMemory()
    for _ in range(4):
        g = torch.randn(200, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(simulate_step([a], [dgc], [g], info), simulate_step([b], [residual], [g], info))
    torch.testing.assert_close(dgc.velocity("w"), residual.residual("w"))


def test_dgc_memory_corrects_momentum_and_masks_it_where_sent() -> None:
    """u_t = m u_{t-1} + g_t; v accumulates u; after sending, sum_t sent_t + v_T = sum_t u_t."""
    gen, m = torch.Generator().manual_seed(12), 0.9
    info = TensorInfo("w", (300,), torch.float64)
    compressor, memory = create("dgc", ratio=0.05, seed=0), DGCMemory(momentum=m)
    sent, momenta = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    for _ in range(5):
        g = torch.randn(300, generator=gen, dtype=torch.float64)
        u_before = memory.momentum_buffer("w")
        u_before = torch.zeros_like(g) if u_before is None else u_before
        momenta += m * u_before + g
        out = simulate_step([compressor], [memory], [g], info)
        sent += out
        u_after, v_after = memory.momentum_buffer("w"), memory.velocity("w")
        assert not u_after[out != 0].any() and not v_after[out != 0].any()  # factor masking
    torch.testing.assert_close(sent + memory.velocity("w"), momenta, rtol=0, atol=1e-9)


# -- PowerSGD ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (4, 2, 3, 3)], ids=str)
def test_powersgd_full_rank_reconstructs_exactly(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    rows, cols = shape[0], x.numel() // shape[0]
    compressor = create("powersgd", rank=min(rows, cols), min_compression_rate=0)
    payload, ctx = compressor.compress(x, _info(x))
    assert len(payload) == 2  # the low-rank path ran, not the dense fallback
    torch.testing.assert_close(compressor.decompress(payload, ctx), x, rtol=0, atol=1e-10)


@pytest.mark.parametrize("r", [1, 3])
def test_orthonormalize_off_cpu_spans_the_same_columns_as_qr(r: int) -> None:
    """Gram-Schmidt (the GPU's path, called directly) and the rank-1 division against Householder QR: the same
    projector ``Q Q^T``, orthonormal columns; a zero column stays zero instead of NaN."""
    from gradsync.compress.lowrank import gram_schmidt, orthonormalize

    p = torch.randn(40, r, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
    qr = torch.linalg.qr(p, mode="reduced").Q
    for q in (gram_schmidt(p), orthonormalize(p)):
        torch.testing.assert_close(q.T @ q, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(q @ q.T, qr @ qr.T, rtol=0, atol=1e-12)
    zero = torch.zeros(40, r)
    assert torch.equal(gram_schmidt(zero), zero) and torch.equal(orthonormalize(zero[:, :1]), zero[:, :1])


def test_powersgd_recovers_a_rank_one_matrix_in_one_step() -> None:
    gen = torch.Generator().manual_seed(14)
    u, v = torch.randn(30, 1, generator=gen), torch.randn(1, 50, generator=gen)
    x = u @ v
    compressor = create("powersgd", rank=1)
    payload, ctx = compressor.compress(x, _info(x))
    assert [t.shape for t in payload] == [(30, 1), (50, 1)]
    torch.testing.assert_close(compressor.decompress(payload, ctx), x, rtol=1e-5, atol=1e-5)


def test_powersgd_two_rounds_sum_rank_one_workers_exactly() -> None:
    """Workers sharing a column space: P = sum_w M_w Q spans it, so P P^T sum_w M_w is exact."""
    gen, world = torch.Generator().manual_seed(15), 3
    u = torch.randn(20, 1, generator=gen)
    grads = [u @ torch.randn(1, 40, generator=gen) for _ in range(world)]
    info = _info(grads[0])
    compressors = [PowerSGD(rank=1) for _ in range(world)]
    out = simulate_step(compressors, [create_memory("none") for _ in range(world)], grads, info)
    torch.testing.assert_close(out, sum(grads) / world, rtol=1e-5, atol=1e-5)
    states = [c.warm_start("layer.weight") for c in compressors]
    assert all(torch.equal(s, states[0]) for s in states)  # the same warm start everywhere


def test_powersgd_warm_start_converges_to_the_best_rank_one() -> None:
    gen = torch.Generator().manual_seed(16)
    left, _ = torch.linalg.qr(torch.randn(40, 3, generator=gen, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(60, 3, generator=gen, dtype=torch.float64))
    x = left @ torch.diag(torch.tensor([5.0, 2.0, 1.0], dtype=torch.float64)) @ right.T
    compressor = create("powersgd", rank=1)
    for _ in range(40):  # one power iteration per step, warm-started from the last Q
        out = compressor.decompress(*compressor.compress(x, _info(x)))
    assert abs((out - x).norm().item() - math.sqrt(2.0**2 + 1.0**2)) < 1e-6


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 8])
def test_powersgd_products_equal_the_plain_matmul(rank: int) -> None:
    """The layouts chosen for speed (``times``, ``transposed_times``) compute ``M Q`` and ``M^T P``."""
    from gradsync.compress.lowrank import times, transposed_times

    gen = torch.Generator().manual_seed(17)
    m = torch.randn(37, 53, generator=gen, dtype=torch.float64)
    q, p = torch.randn(53, rank, generator=gen, dtype=torch.float64), torch.randn(37, rank, generator=gen, dtype=torch.float64)
    for got, want in [(times(m, q), m @ q), (transposed_times(m, p), m.T @ p)]:
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", [3, 4])
def test_powersgd_finish_divides_the_thin_factor(world: int) -> None:
    """``finish(divide_by=W)`` is ``P Q^T / W``, written into ``out`` when given; with W a power of two the
    scaling is exact, so it equals dividing the product bit for bit. Dense tensors come back divided too."""
    gen = torch.Generator().manual_seed(18)
    x = torch.randn(24, 40, generator=gen)
    c = PowerSGD(rank=2)
    info = _info(x)
    p = c.first_round(x, info)
    payload, ctx = c.second_round(x, info, p)
    want = ctx.extra[0] @ payload[0].T / world
    out = torch.empty_like(x)
    got = c.finish(payload, ctx, out, divide_by=world)
    assert got.data_ptr() == out.data_ptr()
    if world & (world - 1) == 0:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c.finish(payload, ctx, None, divide_by=world), want, rtol=1e-6, atol=1e-7)
    v = torch.randn(10, generator=gen)
    dense, dctx = c.second_round(v, _info(v), None)
    assert torch.equal(c.finish(dense, dctx, None, divide_by=world), v / world)
    assert torch.equal(v, dense[0])  # the summed payload itself is left alone


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("shape", [(24, 40), (512, 1024)], ids=str)
def test_outer_into_is_the_product_and_the_subtraction(r: int, shape) -> None:
    """``outer_into`` (broadcast passes at rank 2 on large matrices, the gemm otherwise) writes ``P Q^T`` or
    subtracts it in place, equal to the float64 product to float32's last bits, whichever path it takes."""
    from gradsync.compress.lowrank import BROADCAST_MIN_ELEMENTS, outer_into

    gen = torch.Generator().manual_seed(r)
    rows, cols = shape
    p, q, m = torch.randn(rows, r, generator=gen), torch.randn(cols, r, generator=gen), torch.randn(rows, cols, generator=gen)
    exact = p.double() @ q.double().T
    out = torch.full((rows, cols), float("nan"))
    assert outer_into(p, q.T, out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-6)
    got = outer_into(p, q.T, m.clone(), subtract=True)
    torch.testing.assert_close(got.double(), m.double() - exact, rtol=1e-6, atol=1e-6)
    if r != 2 or rows * cols < BROADCAST_MIN_ELEMENTS:  # the gemm path: mm's bits, and addmm_'s in place
        assert torch.equal(out, p @ q.T) and torch.equal(got, m.addmm(p, q.T, alpha=-1))
    # a PowerSGD step through finish and the in-place residual takes the same path
    c = PowerSGD(rank=r, min_compression_rate=0)
    info = _info(m)
    payload, ctx = c.second_round(m, info, c.first_round(m, info))
    want = ctx.extra[0].double() @ payload[0].double().T
    torch.testing.assert_close(c.finish(payload, ctx, torch.empty_like(m)).double(), want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(c.subtract_decoded(m.clone(), payload, ctx, inplace=True).double(), m.double() - want,
                               rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_batch_is_the_per_tensor_methods_bit_for_bit(rank: int, dtype: torch.dtype) -> None:
    """An exchange's matrices in one buffer (PowerSGD.batch: products written into their places, fused
    normalisation, one division) give the per-tensor methods' bits: every aggregate, the in-place residual and the
    next step's warm start, over three steps, with a divisor, and with a non-finite mark that turns one tensor NaN.
    Shapes whose factors would start at offsets a BLAS rounds differently at (MKL's m^T p on two threads), were
    they not aligned."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_powersgd_batch(rank, dtype)
    finally:
        torch.set_num_threads(before)


def _check_powersgd_batch(rank: int, dtype: torch.dtype) -> None:
    from gradsync.compress.base import TwoRoundBatch

    shapes = [(64, 3, 3, 3), (128, 64, 3, 3), (10, 512), (128, 64, 1, 1), (512, 576), (37, 53)]
    infos = [TensorInfo(f"t{i}", s, dtype) for i, s in enumerate(shapes)]
    gen = torch.Generator().manual_seed(rank)
    for divide_by, marked in ((1, False), (3, False), (2, True)):
        fused, plain = PowerSGD(rank=rank), PowerSGD(rank=rank)
        for step in range(3):
            xs = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
            marks = torch.zeros(len(xs)) if marked else None
            if marked and step == 1:
                marks[2] = math.nan
            seen = []
            for c, batch in ((fused, fused.batch(xs, infos)), (plain, TwoRoundBatch(plain, xs, infos))):
                assert (type(batch) is TwoRoundBatch) == (c is plain)
                batch.first_round()  # one worker: each sum is the tensor itself
                batch.second_round()
                outs = [torch.empty_like(x) if i % 2 else None for i, x in enumerate(xs)]
                results = batch.finish(outs, divide_by=divide_by, marks=marks)
                assert all(r.data_ptr() == o.data_ptr() for r, o in zip(results, outs) if o is not None)
                residuals = [c.subtract_decoded(x.clone(), p, ctx, inplace=True) for x, (p, ctx) in zip(xs, batch.rounds)]
                seen.append(results + residuals + [c.warm_start(i.name) for i in infos])
            for got, want in zip(*seen):
                assert got.shape == want.shape and got.dtype == want.dtype
                assert torch.equal(got, want) or (torch.isnan(got).all() and torch.isnan(want).all()), (divide_by, step)


def test_powersgd_sends_vectors_and_small_matrices_dense() -> None:
    compressor = create("powersgd", rank=4)
    for shape in [(1000,), (3, 3)]:
        x = torch.randn(shape)
        assert compressor.first_round(x, _info(x)) is None
        payload, ctx = compressor.compress(x, _info(x))
        assert len(payload) == 1 and torch.equal(compressor.decompress(payload, ctx), x)


# -- registry and parameters ----------------------------------------------------------------------------------


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(CompressionError, match=r"unknown compressor 'topkk'; known: .*topk.* Did you mean 'topk'"):
        create("topkk")
    with pytest.raises(CompressionError, match=r"unknown memory 'residul'; known: none, residual, dgc"):
        create_memory("residul")
    assert issubclass(CompressionError, GradsyncError) and issubclass(CompressionError, ValueError)
    assert type(create("fp32")).name == "none"  # aliases resolve


def test_unknown_parameters_name_the_accepted_ones() -> None:
    with pytest.raises(CompressionError, match=r"compressor 'topk' has no parameter 'rank'; it takes: ratio"):
        create("topk", rank=2)
    with pytest.raises(CompressionError, match="it takes: no parameters"):
        create("signsgd", ratio=0.5)


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("topk", {"ratio": 0}, r"ratio=0 must be in \(0, 1\]"),
        ("topk", {"ratio": 1.5}, r"ratio=1.5 must be in \(0, 1\]"),
        ("randk", {"ratio": -0.1}, r"ratio=-0.1 must be in \(0, 1\]"),
        ("dgc", {"ratio": 2}, r"ratio=2 must be in \(0, 1\]"),
        ("dgc", {"sample_ratio": 0.0}, r"sample_ratio=0.0 must be in \(0, 1\]"),
        ("qsgd", {"levels": 0}, r"levels=0 must be an integer >= 1"),
        ("qsgd", {"levels": 2.5}, r"levels=2.5 must be an integer >= 1"),
        ("qsgd", {"bucket_size": 0}, r"bucket_size=0 must be an integer >= 1"),
        ("qsgd", {"levels": 2**31}, r"levels=2147483648 needs 33 bits per element .* nothing is saved"),
        ("qsgd", {"levels": 2**30}, r"levels=1073741824 needs 32 bits"),
        ("terngrad", {"clip": 0}, r"clip=0 must be a positive number of standard deviations"),
        ("terngrad", {"clip": float("nan")}, r"clip=nan must be"),
        ("powersgd", {"rank": 0}, r"rank=0 must be an integer >= 1"),
        ("powersgd", {"min_compression_rate": -1}, r"min_compression_rate=-1 must be >= 0"),
        ("signum", {"momentum": 1.0}, r"momentum=1.0 must be in \[0, 1\)"),
        ("randk", {"seed": None}, r"seed=None must be an integer >= 0"),
    ],
)
def test_bad_parameters_name_the_value_and_the_range(name: str, params: dict[str, object], message: str) -> None:
    with pytest.raises(CompressionError, match=message):
        create(name, **params)


def test_bad_memory_parameters() -> None:
    with pytest.raises(CompressionError, match=r"momentum=1.5 must be in \[0, 1\)"):
        create_memory("dgc", momentum=1.5)


def test_simulate_step_needs_one_compressor_and_memory_per_worker() -> None:
    x = torch.randn(4)
    with pytest.raises(CompressionError, match="got 1 compressors, 2 memories, 2 gradients"):
        simulate_step([create("none")], [create_memory("none")] * 2, [x, x], _info(x))
    with pytest.raises(CompressionError, match="same compressor"):
        simulate_step([create("none"), create("fp16")], [create_memory("none")] * 2, [x, x], _info(x))


@pytest.mark.parametrize("name", ["none", "fp16", "topk", "qsgd"])
def test_simulate_step_averages_summable_methods(name: str) -> None:
    grads = [torch.randn(64, generator=torch.Generator().manual_seed(w)) for w in range(4)]
    compressors = [_seeded(name, **({"ratio": 1.0} if name == "topk" else {})) for _ in grads]
    out = simulate_step(compressors, [create_memory("none") for _ in grads], grads, _info(grads[0]))
    tol = 2 * max(g.norm() for g in grads).item() / 127 if name == "qsgd" else 1e-3
    torch.testing.assert_close(out, torch.stack(grads).mean(0), rtol=0, atol=tol)


def test_repr_names_the_parameters() -> None:
    assert repr(create("topk", ratio=0.05)) == "TopK(ratio=0.05)"
    assert repr(create_memory("dgc", momentum=0.5)) == "DGCMemory(momentum=0.5)"


def test_bf16_rounds_to_bfloat16_and_keeps_what_fp16_overflows() -> None:
    x = torch.tensor([1.0, 1 + 2**-9, -3.14159, 1e5, -1e30, 0.0], dtype=torch.float32)
    info = TensorInfo("w", (6,), torch.float32)
    payload, ctx = create("bf16").compress(x, info)
    assert payload[0].dtype == torch.bfloat16 and create("bf16").payload_bytes((6,), torch.float32) == 12
    out = create("bf16").decompress(payload, ctx)
    assert out.dtype == torch.float32
    # round to nearest even with 8 significant bits: 1 + 2**-9 is a tie (to 1.0), 1e5 = 1.5259 * 2**16 -> 1.5234375
    assert out[[0, 1, 2, 3, 5]].tolist() == [1.0, 1.0, -3.140625, 99840.0, 0.0]
    assert abs(out[4].item() / -1e30 - 1) <= 2**-9
    fp16 = create("fp16")
    assert torch.isinf(fp16.decompress(*fp16.compress(x, info))[3:5]).all()
