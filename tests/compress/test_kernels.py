"""The fused GPU codec kernels (gradsync.compress.kernels), run on CPU tensors through Triton's interpreter.

Against independent expectations: numpy's packbits for the sign bits; the codecs' torch forms (the same bits for
every deterministic pass); for the kernels that draw their own random numbers, the quantizers' defining
properties (levels in range, the two neighbouring levels only, unbiased on average, the same draws per seed).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from gradsync.compress import create, kernels
from gradsync.compress.base import TensorInfo

pytest.importorskip("triton")

SIZES = [1, 7, 8, 9, 1000, 4097]


def _interpreter_or_skip() -> None:
    """Where a CUDA GPU is, conftest leaves Triton compiling for it, and the interpreter these tests run on CPU
    tensors cannot be had in the same process: say so instead of failing (the compiled kernels are checked against
    the torch forms on the GPU by ``gradsync bench gpu``)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a CUDA GPU is here, so Triton compiles for it: these run the kernels' source on CPU tensors "
                    "through Triton's interpreter; `gradsync bench gpu` checks the compiled kernels on the GPU")


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Kernels on for CPU tensors (the interpreter), with a count of launches per kernel."""
    _interpreter_or_skip()
    monkeypatch.setenv(kernels.ENV, "interpret")
    real = kernels._kernels(True)
    assert real is not None
    launches: dict[str, int] = {}

    class Counted:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: object) -> object:
            launches[self.name] = launches.get(self.name, 0) + 1
            return real[self.name][grid]

    monkeypatch.setattr(kernels, "_kernels", lambda interpret: {name: Counted(name) for name in real})
    return launches


def _values(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[::7] = 0.0
    x[3::11] = -0.0
    return x


def _torch_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_sign_bits_are_numpys_packbits_of_x_at_least_zero(fused, n, dtype):
    x = _values(n, n, dtype)
    if n > 4:
        x[2], x[4] = float("nan"), float("-inf")
    packed = kernels.pack_nonnegative(x)
    expected = np.packbits(np.greater_equal(x.float().numpy(), 0), bitorder="little")
    assert packed.dtype == torch.uint8 and packed.numpy().tolist() == expected.tolist()
    assert fused == {"pack_nonnegative": 1}


@pytest.mark.parametrize("n", SIZES)
def test_select_by_bits_is_torch_where_in_each_mode(fused, n):
    x = _values(n, 100 + n)
    bits = x >= 0
    packed = torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
    v = torch.tensor([0.3, -1.7])
    assert torch.equal(kernels.select_by_bits(packed, n, torch.float32), torch.where(bits, 1.0, -1.0))
    half = kernels.select_by_bits(packed, n, torch.float16, values=v, negate=True)
    assert half.dtype == torch.float16 and torch.equal(half, torch.where(bits, v[0].half(), -v[0].half()))
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    got = kernels.select_by_bits(packed, n, torch.float64, out=out, values=v)
    assert got is out and torch.equal(out, torch.where(bits, v[0].double(), v[1].double()))


@pytest.mark.parametrize("name", ["signsgd", "signum", "efsignsgd", "onebit"])
@pytest.mark.parametrize("n", [9, 1000, 4097])
def test_sign_codecs_give_the_torch_forms_bits(fused, monkeypatch, name, n):
    """The bits are the torch form's; a scale (EF-signSGD, 1-bit SGD) is its sum in another order (within
    rounding); decoding a payload gives the torch form's bits."""
    x = _values(n, 7 * n) * 3
    info = TensorInfo("w", (n,), torch.float32)
    c = create(name)
    payload, ctx = c.compress(x, info)
    decoded = c.decompress(payload, ctx)
    combined = c.combine([payload, payload, payload], ctx)
    packs = sum(fused.get(k, 0) for k in ("pack_nonnegative", "sign_stats", "signum_pack"))
    assert packs == 1 and fused["select_by_bits"] >= 1
    _torch_form(monkeypatch)
    ref = create(name)
    ref_payload, _ = ref.compress(x, info)
    assert payload[-1].tolist() == ref_payload[-1].tolist()
    for got, want in zip(payload[:-1], ref_payload[:-1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(decoded, ref.decompress(payload, ctx))
    assert torch.equal(combined, ref.combine([payload] * 3, ctx))


@pytest.mark.parametrize("n", [1, 4096, 2 * 4096 + 5, 20000])
def test_sign_stats_fold_to_the_float64_statistics(fused, n):
    x = _values(n, 11 * n) * 2 + 0.25
    x64 = x.double()
    bits, (mean_abs,), _ = kernels.sign_stats(x, "mean_abs")
    assert bits.tolist() == np.packbits(np.greater_equal(x.numpy(), 0), bitorder="little").tolist()
    assert math.isclose(mean_abs.item(), x64.abs().mean().item(), rel_tol=1e-6)
    _, means, _ = kernels.sign_stats(x, "side_means")
    pos, neg = x64[x64 >= 0], x64[x64 < 0]
    expected = [pos.mean().item() if pos.numel() else 0.0, neg.mean().item() if neg.numel() else 0.0]
    assert means.tolist() == pytest.approx(expected, rel=1e-6)
    for clip in (None, 1.5):
        none, scale, bound = kernels.sign_stats(x, "ternary", pack=False, clip=clip)
        sd = x64.std(correction=0).item()
        want = x64.abs().max().item() if clip is None else min(x64.abs().max().item(), clip * sd)
        assert none is None and math.isclose(scale.item(), want, rel_tol=1e-6)
        if clip is not None:
            assert math.isclose(bound.item(), clip * sd, rel_tol=1e-6, abs_tol=1e-12)
    assert fused["sign_stats"] == fused["finish_stats"] == 4


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter: inf - inf
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_sign_stats_never_turn_a_non_finite_input_into_a_finite_scale(fused, bad):
    x = _values(5000, 1)
    x[4321] = bad
    assert math.isnan(kernels.sign_stats(x, "ternary", pack=False)[1].item())  # max|x| alone would skip a NaN
    assert not math.isfinite(kernels.sign_stats(x, "mean_abs")[1].item())
    assert not all(math.isfinite(v) for v in kernels.sign_stats(x, "side_means")[1].tolist())


def test_one_sided_inputs_give_zero_for_the_empty_side(fused):
    _, means, _ = kernels.sign_stats(torch.full((10,), 2.0), "side_means")
    assert means.tolist() == [2.0, 0.0]


@pytest.mark.parametrize("n", [5, 1000, 4097])
def test_qsgd_decode_gives_the_torch_forms_bits(fused, monkeypatch, n):
    g = torch.Generator().manual_seed(n)
    levels, bucket = 127, 128
    count = math.ceil(n / bucket)
    codes = (torch.randint(0, levels + 1, (n,), generator=g) << 1 | torch.randint(0, 2, (n,), generator=g)).to(torch.uint8)
    norms = torch.rand(count, generator=g) * 10
    norms[0] = 0.0
    out = torch.full((n,), float("nan"))
    got = kernels.qsgd_decode(norms, codes, n, levels, bucket, out)
    c = create("qsgd")
    _torch_form(monkeypatch)
    ctx = c.compress(torch.zeros(n), TensorInfo("w", (n,), torch.float32))[1]
    assert got is out and torch.equal(out, c.decompress([norms, codes], ctx))
    assert fused == {"qsgd_decode": 1}


def test_qsgd_encode_is_unbiased_rounding_to_a_neighbouring_level(fused):
    n, levels, bucket = 300, 7, 64
    x = _values(n, 3)
    x[:bucket] = 0.0  # an all-zero bucket: norm 0, every code 0
    buckets = torch.cat([x, x.new_zeros(-n % bucket)]).view(-1, bucket)
    norms_ref = torch.linalg.vector_norm(buckets, dim=1)
    per_element = norms_ref.repeat_interleave(bucket)[:n]
    total = torch.zeros(n, dtype=torch.float64)
    trials = 300
    for seed in range(trials):
        norms, codes = kernels.qsgd_encode(x, levels, bucket, seed)
        torch.testing.assert_close(norms, norms_ref, rtol=1e-6, atol=0)
        level = (codes >> 1).to(torch.float64)
        exact = x.abs().double() / per_element.double().clamp(min=1e-30) * levels
        assert (level <= levels).all() and (level >= exact.floor()).all() and (level <= exact.floor() + 1).all()
        assert torch.equal((codes & 1).bool() & (level > 0), (x < 0) & (level > 0))
        total += torch.where((codes & 1).bool(), -level, level) * per_element.double() / levels
    assert (codes[:bucket] == 0).all()
    # the mean of `trials` draws, each within one level step of x: within 5 standard errors of x
    step = per_element.double() / levels
    assert ((total / trials - x.double()).abs() <= 5 * step / 2 / math.sqrt(trials) + 1e-12).all()
    a, b = kernels.qsgd_encode(x, levels, bucket, 11), kernels.qsgd_encode(x, levels, bucket, 11)
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], kernels.qsgd_encode(x, levels, bucket, 12)[1])


@pytest.mark.parametrize("n", [1, 9, 1000])
def test_terngrad_decode_gives_the_torch_forms_bits(fused, monkeypatch, n):
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 3, (n,), generator=g)
    padded = torch.cat([codes, codes.new_zeros(-n % 4)]).view(-1, 4)
    packed = (padded[:, 0] | padded[:, 1] << 2 | padded[:, 2] << 4 | padded[:, 3] << 6).to(torch.uint8)
    scale = torch.tensor([0.625])
    got = kernels.terngrad_decode(packed, scale, n, torch.float32)
    c = create("terngrad")
    _torch_form(monkeypatch)
    ctx = c.compress(torch.zeros(n), TensorInfo("w", (n,), torch.float32))[1]
    assert torch.equal(got, c.decompress([scale, packed], ctx))
    assert torch.equal(got, torch.tensor([0.0, 0.625, -0.625])[codes])


@pytest.mark.parametrize("clip", [None, 1.0])
def test_terngrad_fused_is_an_unbiased_ternary_of_the_clipped_tensor(fused, monkeypatch, clip):
    n = 257
    x = _values(n, 5)
    x[10] = 9.0  # an outlier the clip cuts
    info = TensorInfo("w", (n,), torch.float32)
    c = create("terngrad", clip=clip, seed=1)
    total = torch.zeros(n, dtype=torch.float64)
    trials = 100  # each trial is three interpreted kernel launches; the summed statistic below is the sharp one
    for _ in range(trials):
        payload, ctx = c.compress(x, info)
        decoded = c.decompress(payload, ctx)
        scale = payload[0]
        assert set(decoded.unique().tolist()) <= {0.0, scale.item(), -scale.item()}
        assert ((decoded == 0) | (torch.sign(decoded) == torch.sign(x))).all()
        total += decoded.double()
    assert fused["terngrad_encode"] == fused["terngrad_decode"] == fused["sign_stats"] == trials
    target = x if clip is None else x.clamp(-clip * x.std(correction=0), clip * x.std(correction=0))
    # the scale is the torch form's (a deterministic reduction, summed in another order): max|clip(x)|
    _torch_form(monkeypatch)
    torch.testing.assert_close(scale, create("terngrad", clip=clip, seed=1).compress(x, info)[0][0], rtol=1e-6,
                               atol=0)
    torch.testing.assert_close(scale.reshape(()), target.abs().max(), rtol=1e-6, atol=0)
    sd = scale.double().item() / 2 / math.sqrt(trials)  # a Bernoulli of range `scale`: variance <= scale^2 / 4
    error = total / trials - target.double()
    assert (error.abs() <= 5 * sd).all()
    # Unbiased as a whole: a rounding biased toward 0 by 0.1 |x| (keeping 0.9 |x| / scale of the mass) moves the
    # signed sum to 2.75x this 5-sigma bound with clip=1.0 (simulated, 100 trials); per element, even 300 trials
    # never see it (0.1 scale at most, against 5 sigma = 0.14 scale). With clip=None the outlier makes scale 9 and
    # that bias 0.3x the bound: caught by neither.
    assert abs(float((torch.sign(target.double()) * error).sum())) <= 5 * sd * math.sqrt(n)


def test_the_switch(monkeypatch):
    x = torch.randn(10)
    monkeypatch.setenv(kernels.ENV, "0")
    assert kernels.pack_nonnegative(x) is None and not kernels.enabled_for(x)
    monkeypatch.setenv(kernels.ENV, "1")  # the default: CUDA tensors only
    assert kernels.pack_nonnegative(x) is None
    _interpreter_or_skip()
    monkeypatch.setenv(kernels.ENV, "interpret")
    assert kernels.enabled_for(x)
    assert kernels.pack_nonnegative(x.double()) is None  # a dtype the kernel does not take: the torch form runs
    assert kernels.qsgd_encode(x, 127, 100, 0) is None  # a bucket that is not a power of two
    monkeypatch.setenv(kernels.ENV, "yes")
    with pytest.raises(ValueError, match="GRADSYNC_FUSED='yes'.*use 1"):
        kernels.enabled_for(x)


def test_two_threads_compressing_at_once_get_what_each_gets_alone(fused):
    """Ranks on threads and the communication thread launch kernels at the same time; under the interpreter
    (which patches Triton's language module per launch) only the lock keeps them apart."""
    import threading

    xs = [_values(3000, seed) for seed in (1, 2)]
    info = TensorInfo("w", (3000,), torch.float32)
    alone = [create("efsignsgd").decompress(*create("efsignsgd").compress(x, info)) for x in xs]
    got: list[list[torch.Tensor]] = [[], []]

    def work(i: int) -> None:
        c = create("efsignsgd")
        for _ in range(5):
            got[i].append(c.decompress(*c.compress(xs[i], info)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(len(g) == 5 and all(torch.equal(d, alone[i]) for d in g) for i, g in enumerate(got))


def test_signum_carries_its_momentum_through_steps_as_the_torch_form(fused, monkeypatch):
    """Three steps of one tensor: the same momentum state and bits as the torch form (the interpreter does not fuse
    the multiply-add; a GPU may, which moves the state by an ulp), and a tensor of another shape starts afresh."""
    info = TensorInfo("w", (300,), torch.float32)
    xs = [_values(300, 40 + s) for s in range(3)]
    c = create("signum", momentum=0.8)
    got = [c.compress(x, info)[0][0] for x in xs]
    state = c._state["w"].clone()
    assert fused["signum_pack"] == 3
    _torch_form(monkeypatch)
    ref = create("signum", momentum=0.8)
    want = [ref.compress(x, info)[0][0] for x in xs]
    assert [g.tolist() for g in got] == [w.tolist() for w in want] and torch.equal(state, ref._state["w"])


def test_the_torch_form_draws_only_its_own_random_numbers():
    """Where the kernels do not run (here: the CPU), QSGD and TernGrad draw no kernel seed: a seeded compressor's
    generator, and torch's global one for an unseeded compressor, advance by the torch form's own draw alone."""
    x = _values(1000, 9)
    info = TensorInfo("w", (1000,), torch.float32)
    c = create("qsgd", seed=3)
    c.compress(x, info)
    ref = torch.Generator().manual_seed(3)
    torch.rand((8, 128), generator=ref)  # 1000 elements in buckets of 128
    assert torch.equal(c._generators[torch.device("cpu")].get_state(), ref.get_state())
    torch.manual_seed(5)
    create("terngrad").compress(x, info)
    after = torch.get_rng_state()
    torch.manual_seed(5)
    torch.rand(1000)
    assert torch.equal(after, torch.get_rng_state())


# ---- the launch path on a GPU (kernels._Launch), with a fake Triton kernel ----------------------------------------
class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, runs: list) -> None:
        self._runs = runs

    def run(self, *args: object) -> None:
        self._runs.append(args)


class _FakeJit:
    """Triton's JITFunction as _Launch sees it: ``kernel[grid](*args, **constexprs)`` launches and returns the
    compiled kernel."""

    def __init__(self) -> None:
        self.slow: list = []
        self.runs: list = []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.slow.append((grid, args, constexprs))
            return _FakeCompiled(self.runs)

        return launch


def _launcher(all_args: bool = True, hooked: bool = False):
    jit = _FakeJit()
    launch = kernels._Launch(jit, ["x_ptr", "out_ptr", "n", "nbytes", "BYTES"], all_args, lambda: 0,
                             lambda device: 1234 + device, lambda: hooked)
    return jit, launch


def test_launch_goes_through_triton_once_per_specialization_then_calls_the_compiled_launcher():
    jit, launch = _launcher()
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.uint8)
    launch[(3,)](x, out, 64, 8, BYTES=512)
    assert len(jit.slow) == 1 and not jit.runs
    launch[(5,)](x, out, 64, 8, BYTES=512)
    assert len(jit.slow) == 1
    assert jit.runs == [(5, 1, 1, 1234, "fn", "meta", None, None, None, x, out, 64, 8, 512)]


@pytest.mark.parametrize("change", ["dtype", "alignment", "one", "divisibility", "width", "constexpr"])
def test_launch_compiles_anew_where_triton_would_specialize_differently(change):
    jit, launch = _launcher()
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.uint8)
    args = [x, out, 64, 8]
    launch[(1,)](*args, BYTES=512)
    constexpr = 512
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "alignment":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "one":
        args[2] = 1
    elif change == "divisibility":
        args[2] = 65
    elif change == "width":
        args[2] = 2**31 + 16
    else:
        constexpr = 256
    launch[(1,)](*args, BYTES=constexpr)
    assert len(jit.slow) == 2 and not jit.runs


def test_launch_passes_only_the_non_constexpr_arguments_to_an_older_triton():
    jit, launch = _launcher(all_args=False)
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.uint8)
    launch[(1,)](x, out, 64, 8, BYTES=512)
    launch[(1,)](x, out, 64, 8, BYTES=512)
    assert jit.runs[0][9:] == (x, out, 64, 8)


def test_launch_leaves_every_call_to_triton_while_a_launch_hook_is_set_or_constexprs_come_out_of_order():
    jit, launch = _launcher(hooked=True)
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.uint8)
    for _ in range(3):
        launch[(1,)](x, out, 64, 8, BYTES=512)
    assert len(jit.slow) == 3 and not jit.runs
    jit2 = _FakeJit()
    launch2 = kernels._Launch(jit2, ["x_ptr", "n", "A", "B"], True, lambda: 0, lambda d: 0, lambda: False)
    for _ in range(2):
        launch2[(1,)](x, 64, B=1, A=2)
    assert len(jit2.slow) == 2 and not jit2.runs


def test_the_installed_triton_launches_as_launch_expects():
    """A Triton upgrade that changes how ``JITFunction.run`` launches turns the direct path off (Triton then
    launches every call); this says so here rather than on a GPU."""
    import inspect

    from triton.runtime.jit import JITFunction

    assert kernels._launch_convention(inspect.getsource(JITFunction.run)) is not None
    assert kernels._launch_convention("kernel.run(grid_0, grid_1, grid_2, stream, other)") is None


def test_an_empty_chain_of_launch_hooks_is_no_hook():
    """Triton 3.4 on keeps its launch hooks in a chain that is never None: only a chain with calls is a hook."""
    from triton.knobs import HookChain

    chain = HookChain()
    assert not kernels._hook_set(None) and not kernels._hook_set(chain)
    chain.add(print)
    assert kernels._hook_set(chain) and kernels._hook_set(print)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 3), (100, 1), (1000, 10), (4097, 40), (600, 600), (10007, 123)])
@pytest.mark.parametrize("seed", [0, 1, 2**31, (1 << 63) - 1])
def test_randk_gather_draws_the_strata_reference_and_place_is_the_scatter(fused, n, k, seed):
    """The fused draw is the hash in plain Python integers (``strata_reference``), whatever width Triton gives the
    seed (0 and 1 are specialized, 2**31 is 64-bit); the fused place is a zero fill and a scatter."""
    from gradsync.compress.sparsify import _MIX, _WEYL, _signed64, strata_reference

    x = _values(n, seed % 1000 + n, torch.float16 if k == 3 else torch.float32)
    values, indices = kernels.randk_gather(x, k, _signed64(seed), _WEYL, _MIX)
    expected = torch.tensor(strata_reference(n, k, seed), dtype=torch.int64)
    assert torch.equal(indices, expected) and torch.equal(values, x[expected])
    assert torch.equal(kernels.randk_place(values, indices, n), torch.zeros(n, dtype=x.dtype).scatter_(0, indices, values))
    assert fused == {"randk_gather": 1, "randk_place": 1}


def test_randk_codec_fused_is_the_torch_form_in_two_launches(fused, monkeypatch):
    """Compress (draw and gather) and decompress (place) are one launch each, with the torch form's payload,
    indices and decoded tensor, step after step."""
    x = _values(5003, 3)
    info = TensorInfo("w", (5003,), torch.float32)
    c = create("randk", ratio=0.01)
    got = []
    for _ in range(3):
        payload, ctx = c.compress(x, info)
        got.append((payload[0], ctx.extra[0], c.decompress(payload, ctx)))
    assert fused == {"randk_gather": 3, "randk_place": 3}
    _torch_form(monkeypatch)
    ref = create("randk", ratio=0.01)
    for values, indices, dense in got:
        payload, ctx = ref.compress(x, info)
        assert torch.equal(values, payload[0]) and torch.equal(indices, ctx.extra[0])
        assert torch.equal(dense, ref.decompress(payload, ctx))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_narrow_and_scatter_values_are_index_select_cast_and_scatter(fused, index_dtype):
    x = _values(5000, 11)
    indices = torch.randperm(5000, generator=torch.Generator().manual_seed(2))[:777]
    values, narrow = kernels.gather_narrow(x, indices)
    assert torch.equal(values, x.index_select(0, indices)) and narrow.dtype == torch.int32
    assert torch.equal(narrow, indices.to(torch.int32))
    dense = kernels.scatter_values(values, indices.to(index_dtype), 5000)
    assert torch.equal(dense, torch.zeros(5000).scatter_(0, indices, values))
    assert kernels.gather_narrow(x, indices.to(torch.int32)) is None  # int64 in, as topk gives
    assert fused == {"gather_narrow": 1, "scatter_values": 1}


@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_sparsifiers_fused_give_the_torch_forms_payload_and_decode(fused, monkeypatch, name):
    """Top-k's and DGC's payload (values, int32 indices) and decode with the gather-and-cast and the scatter fused:
    one launch each, the torch form's bits."""
    x = _values(20000, 5)
    info = TensorInfo("w", (20000,), torch.float32)
    params = {"ratio": 0.01, **({"seed": 1} if name == "dgc" else {})}  # DGC's threshold sample: the same draws
    payload, ctx = create(name, **params).compress(x, info)
    decoded = create(name, **params).decompress(payload, ctx)
    assert fused == {"gather_narrow": 1, "scatter_values": 1}
    _torch_form(monkeypatch)
    ref = create(name, **params)
    want, _ = ref.compress(x, info)
    assert [t.dtype for t in payload] == [torch.float32, torch.int32]
    assert torch.equal(payload[0], want[0]) and torch.equal(payload[1], want[1])
    assert torch.equal(decoded, ref.decompress(want, ctx))
