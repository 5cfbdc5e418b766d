"""MergeComp's partition search and cost profiling (issue 8, seed 004 §4.3, Algorithms 1-2)."""

from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np
import pytest

from gradsync.compress import CompressionError, create
from gradsync.compress.merge import (
    LinearCost,
    MergeCostModel,
    MergeError,
    Partition,
    fit_group_overhead,
    optimal_per_y,
    search_mergecomp,
    search_mergecomp_trace,
    search_optimal,
)
from gradsync.compress.profile import (
    DEFAULT_SIZES,
    MeasuredCost,
    Samples,
    fit_linear,
    measure_codec,
    measure_comm,
    prediction_error,
    refit_if_drifted,
)
from gradsync.compress.sparsify import TopK
from gradsync.errors import GradsyncError

pytestmark = pytest.mark.usefixtures("single_intraop_thread")


def _three(**kw: object) -> MergeCostModel:
    """The worked example: h(x) = 0.5 + 0.01 x, g(x) = 1 + 0.02 x, gradients ready at 1, 2, 4 s."""
    args: dict[str, object] = {"h": (0.5, 0.01), "g": (1.0, 0.02), **kw}
    return MergeCostModel(sizes=(100, 200, 300), ready_s=(1.0, 2.0, 4.0), backward_end_s=4.0, **args)  # type: ignore[arg-type]


def _random_model(n: int, seed: int, overlap: bool, *, measured: bool = False) -> MergeCostModel:
    """Costs on the scale of backward so that merging, overlapping and not merging all win sometimes."""
    rng = random.Random(seed)
    sizes = [int(10 ** rng.uniform(0, 5)) for _ in range(n)]
    # Bursts of gradients ready at the same instant (as bucketed hooks report them) as well as spread ones.
    backward = [0.0 if rng.random() < 0.2 else rng.uniform(0.0, 2.0) for _ in range(n)]
    if measured:
        knots = sorted(rng.sample(range(1, 200_000), 4))
        h = MeasuredCost.from_samples(Samples(tuple(knots), tuple(rng.uniform(0.1, 3.0) for _ in knots)))
        g = MeasuredCost.from_samples(Samples(tuple(knots), tuple(rng.uniform(0.1, 5.0) for _ in knots)))
    else:
        h = (rng.uniform(0, 1), rng.choice([0.0, rng.uniform(0, 1e-4), rng.uniform(0, 1e-3)]))
        g = (rng.uniform(0, 2), rng.choice([0.0, rng.uniform(0, 2e-4), rng.uniform(0, 2e-3)]))
    d = (rng.uniform(0, 0.3), rng.uniform(0, 1e-5)) if rng.random() < 0.3 else (0.0, 0.0)
    return MergeCostModel.from_backward_times(
        sizes, backward, h, g, d=d, forward_s=rng.uniform(0, 1), overlap_compression=overlap
    )


def _brute_force(model: MergeCostModel) -> dict[int, float]:
    """F_min(y) over all 2^(n-1) partitions."""
    best: dict[int, float] = {}
    n = model.n
    for r in range(n):
        for cuts in itertools.combinations(range(1, n), r):
            t = model.iteration_time(Partition(n, cuts))
            best[r + 1] = min(best.get(r + 1, math.inf), t)
    return best


# -- Partition -------------------------------------------------------------------------------------------------


def test_partition_groups_contiguous_tensors() -> None:
    p = Partition(6, (2, 5))
    assert p.num_groups == 3
    assert p.bounds == ((0, 2), (2, 5), (5, 6))
    assert p.counts == (2, 3, 1)
    assert p.groups("abcdef") == (("a", "b"), ("c", "d", "e"), ("f",))
    assert p.group_sizes([1, 2, 3, 4, 5, 6]) == (3, 12, 6)
    assert Partition.from_counts([2, 3, 1]) == p
    assert Partition.single(4) == Partition(4) and Partition.single(4).counts == (4,)
    assert Partition.layerwise(4).cuts == (1, 2, 3)
    assert Partition(1).bounds == ((0, 1),)
    assert Partition(5, [np.int64(3)]).cuts == (3,)


@pytest.mark.parametrize(
    ("n", "cuts", "match"),
    [
        (0, (), r"n=0 must be an integer >= 1"),
        (3.0, (), r"n=3\.0 must be an integer"),
        (True, (), r"n=True must be an integer"),
        (5, (0,), r"cuts\[0\]=0 must be in 1\.\.n-1=4"),
        (5, (2, 5), r"cuts\[1\]=5 must be in 1\.\.n-1=4"),
        (5, (3, 3), r"strictly increasing: cuts\[1\]=3 follows cuts\[0\]=3"),
        (5, (3, 2), r"cuts\[1\]=2 follows cuts\[0\]=3"),
        (5, (1.5,), r"cuts\[0\]=1\.5 must be an integer"),
        (1, (1,), r"cuts\[0\]=1 must be in 1\.\.n-1=0"),
        (5, 3, r"cuts=3 must be a sequence"),
    ],
)
def test_partition_rejects_bad_cuts(n: object, cuts: object, match: str) -> None:
    with pytest.raises(MergeError, match=match):
        Partition(n, cuts)  # type: ignore[arg-type]


def test_partition_errors_are_gradsync_errors() -> None:
    assert issubclass(MergeError, CompressionError) and issubclass(MergeError, GradsyncError)
    with pytest.raises(MergeError, match=r"len\(items\)=2 != n=3"):
        Partition(3, (1,)).groups([1, 2])
    with pytest.raises(MergeError, match=r"counts\[1\]=0 must be an integer >= 1"):
        Partition.from_counts([2, 0])


# -- the pipeline ----------------------------------------------------------------------------------------------


def test_iteration_time_by_hand_inline() -> None:
    # Compression on the compute stream (the seed's objective (7)).  Layer-wise, y = 3:
    #   H = 1.5, 4.0, 7.5;  C = r + H = 2.5, 6.0, 11.5
    #   E1 = 2.5 + g(100) = 5.5;  E2 = max(6, 5.5) + 5 = 11;  E3 = max(11.5, 11) + 7 = 18.5
    #   T = max(backward_end + H3 = 11.5, 18.5) = 18.5
    m = _three()
    trace = m.simulate(Partition(3, (1, 2)))
    assert trace.compress_end_s == pytest.approx((2.5, 6.0, 11.5))
    assert trace.comm_end_s == pytest.approx((5.5, 11.0, 18.5))
    assert trace.compute_end_s == pytest.approx(11.5)
    assert trace.exposed_comm_s == pytest.approx(7.0)
    assert trace.iteration_s == pytest.approx(18.5) == m.no_merge_time()
    # y = 1: C = 4 + h(600) = 10.5, E = 10.5 + g(600) = 23.5.
    assert m.single_group_time() == pytest.approx(23.5)
    # {0, 1} {2}: H = 3.5, 7.0; C = 5.5, 11; E = 12.5, max(11, 12.5) + 7 = 19.5.
    assert m.iteration_time(Partition(3, (2,))) == pytest.approx(19.5)
    # {0} {1, 2}: C = 2.5, 4 + 7 = 11; E = 5.5, 11 + g(500) = 22.
    assert m.iteration_time(Partition(3, (1,))) == pytest.approx(22.0)
    # Seed (7): T = A + Σh + Σg - Σp, with Σp the hidden communication.
    sum_h, sum_g = 1.5 + 2.5 + 3.5, 3.0 + 5.0 + 7.0
    assert trace.iteration_s == pytest.approx(4.0 + sum_h + sum_g - (sum_g - trace.exposed_comm_s))


def test_iteration_time_by_hand_compression_stream() -> None:
    # Own compression stream: C_j = max(r_j, C_{j-1}) + h(x_j).  Layer-wise:
    #   C = 2.5, max(2, 2.5) + 2.5 = 5, max(4, 5) + 3.5 = 8.5;  E = 5.5, 10.5, 17.5;  T = 17.5
    m = _three(overlap_compression=True)
    trace = m.simulate(Partition.layerwise(3))
    assert trace.compress_end_s == pytest.approx((2.5, 5.0, 8.5))
    assert trace.comm_end_s == pytest.approx((5.5, 10.5, 17.5))
    assert trace.compute_end_s == pytest.approx(4.0)
    assert trace.iteration_s == pytest.approx(17.5)
    assert m.single_group_time() == pytest.approx(23.5)
    assert m.iteration_time(Partition(3, (2,))) == pytest.approx(19.5)
    assert m.iteration_time(Partition(3, (1,))) == pytest.approx(20.5)


def test_forward_and_decode_terms() -> None:
    # d = 0.5 s per group after each transfer; forward 0.25 s overlaps nothing.
    #   E1 = 2.5 + 3 + 0.5 = 6;  E2 = max(6, 6) + 5.5 = 11.5;  E3 = max(11.5, 11.5) + 7.5 = 19;  T = 0.25 + 19
    m = _three(d=(0.5, 0.0), forward_s=0.25)
    assert m.no_merge_time() == pytest.approx(19.25)
    assert m.total_elements == 600 and m.n == 3


def test_costs_are_linear_or_vectorised_callables() -> None:
    m = _three(h=LinearCost(0.5, 0.01), g=lambda x: 1.0 + 0.02 * np.asarray(x))
    assert m.no_merge_time() == pytest.approx(18.5)
    assert LinearCost(1.0, 2.0)(np.array([0.0, 1.0])).tolist() == [1.0, 3.0]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"sizes": ()}, r"sizes=\(\) must list at least one tensor"),
        ({"ready_s": (1.0, 2.0)}, r"len\(ready_s\)=2 != len\(sizes\)=3"),
        ({"ready_s": (1.0, 0.5, 4.0)}, r"ready_s\[1\]=0\.5 < ready_s\[0\]=1\.0"),
        ({"ready_s": (-1.0, 2.0, 4.0)}, r"ready_s\[0\]=-1\.0 must be a finite number >= 0"),
        ({"backward_end_s": 3.0}, r"backward_end_s=3\.0 < ready_s\[-1\]=4\.0"),
        ({"sizes": (100, -1, 3)}, r"sizes\[1\]=-1 must be an integer >= 0"),
        ({"sizes": (100, 2.5, 3)}, r"sizes\[1\]=2\.5 must be an integer"),
        ({"h": (-0.5, 0.01)}, r"h: base_s=-0\.5 must be a finite number >= 0"),
        ({"g": (1.0, float("nan"))}, r"g: per_element_s=nan must be a finite number >= 0"),
        ({"g": (1.0,)}, r"g=\(1\.0,\) must be a \(base_s, per_element_s\) pair"),
        ({"h": "fast"}, r"h='fast' must be a \(base_s, per_element_s\) pair"),
        ({"h": lambda x: -1.0 * np.asarray(x)}, r"must map an array of element counts to finite seconds >= 0"),
        ({"h": lambda x: float(x)}, r"must accept a NumPy array"),
        ({"forward_s": -1}, r"forward_s=-1 must be a finite number >= 0"),
        ({"overlap_compression": "yes"}, r"overlap_compression='yes' must be True or False"),
    ],
)
def test_cost_model_rejects_bad_input(kw: dict[str, object], match: str) -> None:
    base: dict[str, object] = {
        "sizes": (100, 200, 300),
        "ready_s": (1.0, 2.0, 4.0),
        "backward_end_s": 4.0,
        "h": (0.5, 0.01),
        "g": (1.0, 0.02),
    }
    with pytest.raises(MergeError, match=match):
        MergeCostModel(**{**base, **kw})  # type: ignore[arg-type]


def test_iteration_time_rejects_a_partition_for_another_model() -> None:
    with pytest.raises(MergeError, match=r"partition\.n=4 != model\.n=3"):
        _three().iteration_time(Partition(4))
    with pytest.raises(MergeError, match=r"partition=\(1, 2\) must be a Partition"):
        _three().iteration_time((1, 2))  # type: ignore[arg-type]


def test_from_backward_times_accumulates_ready_times() -> None:
    m = MergeCostModel.from_backward_times([1, 2, 3], [0.5, 0.0, 1.5], (0, 0), (0, 0))
    assert m.ready_s == (0.5, 0.5, 2.0) and m.backward_end_s == 2.0
    with pytest.raises(MergeError, match=r"backward_s\[1\]=-0\.1"):
        MergeCostModel.from_backward_times([1, 2], [0.5, -0.1], (0, 0), (0, 0))


# -- exact search ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "stream"])
@pytest.mark.parametrize("measured", [False, True], ids=["linear", "measured"])
def test_dp_matches_brute_force_for_every_y(overlap: bool, measured: bool) -> None:
    for seed in range(20 if measured else 40):  # MeasuredCost prices scalars slowly
        n = 1 + seed % 10
        model = _random_model(n, seed, overlap, measured=measured)
        brute = _brute_force(model)
        per_y = optimal_per_y(model)
        assert sorted(per_y) == list(range(1, n + 1))
        for y, (t, part) in per_y.items():
            assert part.num_groups == y and part.n == n
            assert t == pytest.approx(brute[y], rel=1e-9, abs=1e-12), (seed, y)
            assert model.iteration_time(part) == pytest.approx(t, rel=1e-9, abs=1e-12)
        best = search_optimal(model)
        assert model.iteration_time(best) == pytest.approx(min(brute.values()), rel=1e-9, abs=1e-12)


def test_search_optimal_for_a_fixed_y() -> None:
    for seed in range(12):
        model = _random_model(8, 100 + seed, overlap=seed % 2 == 1)
        per_y = optimal_per_y(model)
        for y in (1, 2, 3, 5, 8):
            part = search_optimal(model, y)
            assert part.num_groups == y
            assert model.iteration_time(part) == pytest.approx(per_y[y][0], rel=1e-9)
        assert optimal_per_y(model, max_groups=3).keys() == {1, 2, 3}


def test_single_group_and_layerwise_are_the_ends() -> None:
    model = _random_model(7, 3, overlap=False)
    assert search_optimal(model, 1) == Partition.single(7)
    assert search_optimal(model, 7) == Partition.layerwise(7)
    per_y = optimal_per_y(model)
    assert per_y[1][0] == pytest.approx(model.single_group_time())
    assert per_y[7][0] == pytest.approx(model.no_merge_time())
    one = MergeCostModel(sizes=(5,), ready_s=(1.0,), backward_end_s=1.0, h=(1, 0), g=(1, 0))
    assert search_optimal(one) == Partition(1) and optimal_per_y(one)[1][0] == pytest.approx(3.0)


def test_startup_costs_decide_between_merging_and_not() -> None:
    sizes, backward = [1000] * 12, [1.0] * 12
    # Free start-up: sending each gradient as it is ready hides everything but the last transfer, so
    # layer-wise is optimal (merging the early ones costs nothing either; ties go to fewer groups).
    cheap = MergeCostModel.from_backward_times(sizes, backward, h=(0.0, 1e-5), g=(0.0, 5e-4))
    assert cheap.iteration_time(search_optimal(cheap)) == pytest.approx(cheap.no_merge_time())
    assert cheap.iteration_time(search_optimal(cheap, 2)) > cheap.no_merge_time()
    # Start-up far above the whole backward pass: one group.
    costly = MergeCostModel.from_backward_times(sizes, backward, h=(50.0, 1e-5), g=(50.0, 5e-4))
    assert search_optimal(costly) == Partition(12)
    # In between the optimum merges, and beats both ends.
    mid = MergeCostModel.from_backward_times(sizes, backward, h=(0.1, 1e-4), g=(1.5, 1e-3))
    best = search_optimal(mid)
    assert 1 < best.num_groups < 12
    assert mid.iteration_time(best) < min(mid.no_merge_time(), mid.single_group_time())


@pytest.mark.parametrize("y", [0, 9, 2.0, None])
def test_search_optimal_rejects_bad_y(y: object) -> None:
    model = _random_model(8, 0, overlap=False)
    if y is None:
        with pytest.raises(MergeError, match=r"max_groups=0 must be an integer in 1\.\.n=8"):
            optimal_per_y(model, max_groups=0)
        with pytest.raises(MergeError, match=r"model=3 must be a MergeCostModel"):
            search_optimal(3)  # type: ignore[arg-type]
        return
    with pytest.raises(MergeError, match=rf"y={y!r} must be an integer in 1\.\.n=8"):
        search_optimal(model, y)  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "stream"])
def test_dp_scales_to_resnet152_sized_models(overlap: bool) -> None:
    # 465 tensors (ResNet-152 has 467), every y: about a second of CPU on one core.
    rng = np.random.default_rng(7)
    sizes = rng.choice([64, 256, 2048, 16384, 147456, 589824, 2359296], size=465).tolist()
    backward = (np.asarray(sizes) / sum(sizes) * 0.08 + 0.02 / 465).tolist()
    model = MergeCostModel.from_backward_times(
        sizes, backward, h=(50e-6, 2e-10), g=(100e-6, 1.6e-9), forward_s=0.05, overlap_compression=overlap
    )
    start = time.process_time()
    per_y = optimal_per_y(model)
    elapsed = time.process_time() - start
    assert len(per_y) == 465
    assert elapsed < 20, f"optimal_per_y over n=465 took {elapsed:.1f} s of CPU"
    times = [t for t, _ in per_y.values()]
    best = min(times)
    assert best < min(model.no_merge_time(), model.single_group_time())
    for y in (1, 2, 50, 465):
        assert model.iteration_time(per_y[y][1]) == pytest.approx(per_y[y][0], rel=1e-9)


# -- Algorithm 2 -----------------------------------------------------------------------------------------------


def _algorithm2_by_hand(f: dict[int, float], Y: int, alpha: float) -> int:
    """The y Algorithm 2 returns, given F_min(y) for every y (lines 3-12)."""
    for y in range(2, Y + 1):
        if f[y - 1] < f[y]:
            return y - 1
        if f[y - 1] - f[y] < alpha * f[y - 1]:
            return y
    return Y


def test_algorithm2_follows_its_lines_and_never_beats_the_optimum() -> None:
    for seed in range(30):
        n = 2 + seed % 9
        model = _random_model(n, 200 + seed, overlap=seed % 3 == 0)
        per_y = optimal_per_y(model)
        f = {y: t for y, (t, _) in per_y.items()}
        optimum = min(f.values())
        for Y, alpha in ((2, 0.01), (n, 0.001), (min(n, 4), 0.2), (n, 0.9)):
            trace = search_mergecomp_trace(model, Y, alpha)
            y = _algorithm2_by_hand(f, Y, alpha)
            assert trace.partition.num_groups == y, (seed, Y, alpha, f)
            assert trace.time_s == pytest.approx(f[y], rel=1e-9)
            assert trace.time_s >= optimum * (1 - 1e-12)
            assert search_mergecomp(model, Y, alpha) == trace.partition
            assert set(trace.f_min) == set(range(1, max(trace.f_min) + 1))
            assert trace.reason in ("worse", "marginal", "reached Y")


def test_algorithm2_finds_the_optimum_when_f_min_is_unimodal() -> None:
    # Uniform layers: F_min(y) falls, then rises. With α -> 0 and Y = N the search stops right after the
    # minimum (lines 6-7), so it returns the global optimum.
    model = MergeCostModel.from_backward_times([4096] * 16, [1.0] * 16, h=(0.05, 1e-5), g=(0.3, 4e-4))
    f = [t for _, (t, _) in sorted(optimal_per_y(model).items())]
    k = int(np.argmin(f))
    assert 0 < k < len(f) - 1
    assert all(a > b for a, b in zip(f[:k], f[1 : k + 1])) and all(a < b for a, b in zip(f[k:], f[k + 1 :]))
    trace = search_mergecomp_trace(model, 16, 1e-9)
    assert trace.reason == "worse"
    assert trace.time_s == pytest.approx(min(f))
    # With a large α it settles for the first y whose gain is marginal.
    assert search_mergecomp_trace(model, 16, 0.5).partition.num_groups == 2


def test_algorithm2_returns_one_group_when_startup_dominates() -> None:
    model = MergeCostModel.from_backward_times([1000] * 6, [0.1] * 6, h=(5.0, 0.0), g=(5.0, 0.0))
    trace = search_mergecomp_trace(model, 2, 0.01)
    assert trace.partition == Partition(6) and trace.reason == "worse"
    assert trace.partition == search_optimal(model)


def test_algorithm2_bisect_inner_search() -> None:
    # The seed's Theorem 3 proof: F(X_2) falls then rises in x_1 (inline, uniform layers: max of a falling
    # and a rising sequence), so binary search finds the exact X_2*.
    model = MergeCostModel.from_backward_times([4096] * 40, [1.0] * 40, h=(0.05, 1e-5), g=(0.6, 2e-4))
    exact = optimal_per_y(model, max_groups=3)
    trace = search_mergecomp_trace(model, 2, 1e-9, inner="bisect")
    assert trace.f_min[2] == pytest.approx(exact[2][0])
    # On irregular models it is a heuristic: never better than the exact argmin for the same y.
    for seed in range(15):
        m = _random_model(9, 300 + seed, overlap=seed % 2 == 0)
        per_y = optimal_per_y(m)
        t = search_mergecomp_trace(m, 4, 1e-9, inner="bisect")
        for y, f in t.f_min.items():
            assert f >= per_y[y][0] * (1 - 1e-12)
            assert m.iteration_time(t.candidates[y]) == pytest.approx(f)
    with pytest.raises(MergeError, match=r"needs about \d+ evaluations .* max_evaluations=10"):
        search_mergecomp(model, 3, 0.01, inner="bisect", max_evaluations=10)


@pytest.mark.parametrize(
    ("Y", "alpha", "kw", "match"),
    [
        (1, 0.1, {}, r"Y=1 must be an integer in \[2, N=5\]"),
        (6, 0.1, {}, r"Y=6 must be an integer in \[2, N=5\]"),
        (2.0, 0.1, {}, r"Y=2\.0 must be an integer"),
        (2, 0.0, {}, r"alpha=0\.0 must be in \(0, 1\)"),
        (2, 1, {}, r"alpha=1 must be in \(0, 1\)"),
        (2, "0.1", {}, r"alpha='0\.1' must be in \(0, 1\)"),
        (2, 0.1, {"inner": "greedy"}, r"inner='greedy' must be 'exact'"),
        (2, 0.1, {"max_evaluations": 0}, r"max_evaluations=0 must be an integer >= 1"),
    ],
)
def test_algorithm2_rejects_bad_parameters(Y: object, alpha: object, kw: dict[str, object], match: str) -> None:
    model = _random_model(5, 1, overlap=False)
    with pytest.raises(MergeError, match=match):
        search_mergecomp(model, Y, alpha, **kw)  # type: ignore[arg-type]


def test_algorithm2_needs_two_tensors() -> None:
    one = MergeCostModel(sizes=(5,), ready_s=(1.0,), backward_end_s=1.0, h=(1, 0), g=(1, 0))
    with pytest.raises(MergeError, match=r"Y=2 must be an integer in \[2, N=1\].*only the single-group"):
        search_mergecomp(one, 2, 0.1)


# -- profiling -------------------------------------------------------------------------------------------------


def test_measure_codec_samples_every_size_and_fits() -> None:
    sizes = (2**10, 2**12, 2**14)
    samples = measure_codec(create("topk", ratio=0.01), sizes, repeats=3)
    encode = measure_codec(create("qsgd"), sizes, repeats=2, part="encode")
    decode = measure_codec(create("qsgd"), sizes, repeats=2, part="decode")
    for s in (samples, encode, decode):
        assert s.sizes == sizes and all(t > 0 for t in s.seconds)
    fit = fit_linear(samples)
    assert fit.r2 <= 1.0 and len(fit.pattern) == 3 and "R^2" in fit.report()
    assert DEFAULT_SIZES[0] == 2**10 and DEFAULT_SIZES[-1] == 2**22


class _LoggedTopK(TopK):
    """Top-k that logs its codec calls, so a fake timer can say what :func:`measure_codec` timed."""

    log: list[str] = []

    def compress(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.log.append("compress")
        return super().compress(*a, **kw)

    def decompress(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.log.append("decompress")
        return super().decompress(*a, **kw)

    def subtract_decoded(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.log.append("subtract_decoded")
        return super().subtract_decoded(*a, **kw)

    def combine(self, payloads, *a, **kw):  # type: ignore[no-untyped-def]
        self.log.append(f"combine x{len(payloads)}")
        return super().combine(payloads, *a, **kw)


@pytest.mark.parametrize(
    ("part", "timed"),
    [
        ("feedback", ["subtract_decoded"]),
        ("combine", ["combine x4"]),
        ("decode", ["decompress"]),
        ("encode", ["compress"]),
        ("both", ["compress", "decompress"]),
    ],
)
def test_measure_codec_times_what_the_step_runs_feedback_and_combine(part: str, timed: list[str]) -> None:
    """Error feedback of a sparse payload is its O(k) ``subtract_decoded`` and a top-k receiver sums W payloads
    with one ``combine``: neither decodes a dense tensor, and nothing else falls between the timer's readings
    (a fake clock that marks the log; real timings belong in benchmarks)."""
    log = _LoggedTopK.log
    log.clear()

    def timer() -> float:
        log.append("t")
        return float(len(log))

    samples = measure_codec(_LoggedTopK(ratio=0.01), (4096,), repeats=2, part=part, world=4, timer=timer)  # type: ignore[arg-type]
    marks = [i for i, e in enumerate(log) if e == "t"]
    assert len(marks) == 2 * 3  # a warm-up and two timed runs, each between two readings
    for start, stop in zip(marks[::2], marks[1::2]):
        assert log[start + 1 : stop] == timed
    assert samples.seconds == (len(timed) + 1.0,)
    c = create("topk", ratio=0.01)
    with pytest.raises(MergeError, match="world=0 must be an integer >= 1"):
        measure_codec(c, (4096,), part="combine", world=0)
    with pytest.raises(MergeError, match="'feedback' or 'combine'"):
        measure_codec(c, (4096,), part="both-ways")  # type: ignore[arg-type]


def test_measure_codec_leaves_the_callers_state_alone() -> None:
    c = create("signum", momentum=0.9)
    measure_codec(c, (256,), repeats=1)
    assert c._state == {}
    with pytest.raises(MergeError, match=r"repeats=0 must be an integer >= 1"):
        measure_codec(c, (256,), repeats=0)
    with pytest.raises(MergeError, match=r"part='all' must be"):
        measure_codec(c, (256,), part="all")  # type: ignore[arg-type]
    with pytest.raises(MergeError, match=r"sizes\[1\]=0 must be an integer >= 1"):
        measure_codec(c, (256, 0))
    with pytest.raises(MergeError, match=r"compressor='topk' must be a Compressor"):
        measure_codec("topk")  # type: ignore[arg-type]


def test_measure_comm_with_a_synthetic_link() -> None:
    def send(nbytes: int) -> float:  # 10 us latency, 1 GB/s
        return 1e-5 + nbytes * 1e-9

    raw = fit_linear(measure_comm(send, (1024, 65536, 2**20)))
    assert raw.cost.base_s == pytest.approx(1e-5, rel=1e-6)
    assert raw.cost.per_element_s == pytest.approx(4e-9, rel=1e-6)  # float32: 4 bytes an element
    assert raw.r2 == pytest.approx(1.0)
    topk = create("topk", ratio=0.01)
    fit = fit_linear(measure_comm(send, (10_000, 100_000, 1_000_000), compressor=topk))
    # 1% of the elements travel, each as a float32 value and an int32 index: 0.08 bytes an element.
    assert fit.cost.per_element_s == pytest.approx(0.01 * 8 * 1e-9, rel=1e-6)
    with pytest.raises(MergeError, match=r"send\(4096\) returned -1\.0"):
        measure_comm(lambda nbytes: -1.0, (1024,))
    with pytest.raises(MergeError, match=r"send=3 must be a callable"):
        measure_comm(3, (1024,))  # type: ignore[arg-type]


def test_fit_linear_recovers_lines_and_clamps() -> None:
    sizes = (10, 100, 1000, 10_000)
    line = Samples(sizes, tuple(2e-6 + 3e-9 * s for s in sizes))
    for relative in (True, False):
        fit = fit_linear(line, relative=relative)
        assert fit.cost.base_s == pytest.approx(2e-6) and fit.cost.per_element_s == pytest.approx(3e-9)
        assert fit.r2 == pytest.approx(1.0) and fit.max_rel_error < 1e-9
    # Convex data (cache misses at the large end): plain least squares would give a negative start-up.
    convex = Samples(sizes, (1e-6, 1e-6, 2e-6, 1e-4))
    assert fit_linear(convex, relative=False).cost.base_s == 0.0
    fit = fit_linear(convex)
    assert fit.cost.base_s > 0 and fit.pattern[-1] == "+"
    with pytest.raises(MergeError, match=r"needs samples at >= 2 sizes, got 1"):
        fit_linear(Samples((10,), (1.0,)))


def test_samples_validate_and_merge() -> None:
    s = Samples((100, 10), (2.0, 1.0))
    assert s.sizes == (10, 100) and s.seconds == (1.0, 2.0)
    assert s.merged(Samples((100, 1000), (3.0, 4.0))) == Samples((10, 100, 1000), (1.0, 3.0, 4.0))
    with pytest.raises(MergeError, match=r"size 10 appears twice"):
        Samples((10, 10), (1.0, 2.0))
    with pytest.raises(MergeError, match=r"seconds\[0\]=-1\.0 must be a finite number >= 0"):
        Samples((10,), (-1.0,))
    with pytest.raises(MergeError, match=r"len\(seconds\)=1 != len\(sizes\)=2"):
        Samples((10, 20), (1.0,))


def test_measured_cost_interpolates_piecewise() -> None:
    cost = MeasuredCost.from_samples(Samples((100, 200, 400), (1.0, 3.0, 4.0)))
    assert cost(100) == 1.0 and cost(200) == 3.0 and cost(300) == pytest.approx(3.5)
    assert cost(500) == pytest.approx(4.5)  # last segment extended
    assert cost(50) == pytest.approx(0.0)  # first segment extended, never below 0
    assert cost(np.array([[150.0, 400.0]])).tolist() == [[2.0, 4.0]]
    bumpy = MeasuredCost.from_samples(Samples((1, 2, 3), (2.0, 1.0, 3.0)))
    assert bumpy.seconds == (2.0, 2.0, 3.0)
    assert MeasuredCost.from_samples(Samples((1, 2, 3), (2.0, 1.0, 3.0)), monotone=False).seconds[1] == 1.0
    with pytest.raises(MergeError, match=r"strictly increasing"):
        MeasuredCost((2.0, 1.0), (1.0, 1.0))


def test_refit_if_drifted() -> None:
    sizes = (1000, 10_000, 100_000)
    line = LinearCost(1e-5, 1e-9)
    same = Samples(sizes, tuple(float(line(s)) * 1.02 for s in sizes))
    kept = refit_if_drifted(line, same, tolerance=0.05)
    assert not kept.refitted and kept.cost is line and kept.error == pytest.approx(0.02 / 1.02)
    slow = Samples(sizes, tuple(float(line(s)) * 2 for s in sizes))
    check = refit_if_drifted(line, slow, tolerance=0.05)
    assert check.refitted and check.error == pytest.approx(0.5)
    assert prediction_error(check.cost, slow) < 1e-9
    one = refit_if_drifted(line, Samples((1000,), (float(line(1000)) * 3,)), tolerance=0.05)
    assert isinstance(one.cost, LinearCost)
    assert (one.cost.base_s, one.cost.per_element_s) == pytest.approx((3e-5, 3e-9))
    # A measured cost takes the new knot and carries the slowdown over to the knots not re-measured.
    measured = MeasuredCost.from_samples(Samples(sizes, (1.0, 2.0, 4.0)))
    moved = refit_if_drifted(measured, Samples((10_000,), (6.0,)), tolerance=0.1)
    assert moved.refitted and moved.cost.seconds == pytest.approx((3.0, 6.0, 12.0))
    with pytest.raises(MergeError, match=r"tolerance=0 must be a finite number > 0"):
        refit_if_drifted(line, slow, tolerance=0)
    with pytest.raises(MergeError, match=r"cost=\(1, 2\) must be a LinearCost or a MeasuredCost"):
        refit_if_drifted((1, 2), slow, tolerance=0.1)  # type: ignore[arg-type]


def test_measured_costs_plan_like_linear_ones() -> None:
    # A MeasuredCost through points of a line is that line, so the plans agree.
    sizes = tuple(2**k for k in range(0, 22, 3))
    h_line, g_line = LinearCost(0.05, 1e-5), LinearCost(0.6, 2e-4)
    h = MeasuredCost.from_samples(Samples(sizes, tuple(float(h_line(s)) for s in sizes)))
    g = MeasuredCost.from_samples(Samples(sizes, tuple(float(g_line(s)) for s in sizes)))
    a = MergeCostModel.from_backward_times([4096] * 16, [1.0] * 16, h=h_line, g=g_line)
    b = MergeCostModel.from_backward_times([4096] * 16, [1.0] * 16, h=h, g=g)
    assert b.iteration_time(search_optimal(b)) == pytest.approx(a.iteration_time(search_optimal(a)))


# -- fitting the per-group overhead to one observed step ---------------------------------------------------------


def test_fit_group_overhead_by_hand() -> None:
    """Layer-wise on the worked example with h + δ: H = 7.5 + 3δ, E_3 = 18.5 + 3δ (δ >= 0.5), so an observed
    25 s means δ = 13/6; with it the search merges the first two tensors (the overhead now outweighs overlap)."""
    m = _three()
    lw = Partition.layerwise(3)
    fitted, delta = fit_group_overhead(m, lw, 25.0)
    assert delta == pytest.approx(13 / 6, abs=1e-6)
    assert fitted.iteration_time(lw) == pytest.approx(25.0, abs=1e-5)
    assert search_optimal(m) == Partition(3, (1, 2))
    assert search_optimal(fitted) == Partition(3, (2,))
    # every other partition pays δ once per group on the compute stream: brute force on the shifted costs
    shifted = MergeCostModel(
        sizes=m.sizes, ready_s=m.ready_s, backward_end_s=m.backward_end_s, h=(0.5 + delta, 0.01), g=(1.0, 0.02)
    )
    for cuts in [(), (1,), (2,), (1, 2)]:
        p = Partition(3, cuts)
        assert fitted.iteration_time(p) == pytest.approx(shifted.iteration_time(p), abs=1e-9)


def test_fit_group_overhead_leaves_an_over_prediction_alone() -> None:
    m = _three()
    lw = Partition.layerwise(3)
    fitted, delta = fit_group_overhead(m, lw, m.iteration_time(lw) - 1.0)
    assert delta == 0.0 and fitted is m


@pytest.mark.parametrize("seed", range(6))
def test_fit_group_overhead_hits_the_observation_on_random_models(seed: int) -> None:
    """The least root: T(δ) = observed, and any smaller overhead predicts less (non-decreasing T)."""
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    sizes = [rng.randint(1, 1000) for _ in range(n)]
    m = MergeCostModel.from_backward_times(
        sizes,
        [rng.uniform(0, 2) for _ in range(n)],
        h=(rng.uniform(0, 1), rng.uniform(0, 0.01)),
        g=(rng.uniform(0, 1), rng.uniform(0, 0.02)),
        overlap_compression=bool(seed % 2),
    )
    part = Partition(n, tuple(sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))))
    observed = m.iteration_time(part) + rng.uniform(0.1, 20.0)
    fitted, delta = fit_group_overhead(m, part, observed)
    assert fitted.iteration_time(part) == pytest.approx(observed, abs=1e-5)
    lower = MergeCostModel(
        sizes=m.sizes,
        ready_s=m.ready_s,
        backward_end_s=m.backward_end_s,
        h=(m.h.base_s + delta * 0.99, m.h.per_element_s),
        g=m.g,
        overlap_compression=m.overlap_compression,
    )
    assert lower.iteration_time(part) < observed


def test_fit_group_overhead_rejects_bad_input() -> None:
    with pytest.raises(MergeError, match="observed_s"):
        fit_group_overhead(_three(), Partition.layerwise(3), -1.0)
    with pytest.raises(MergeError, match="model"):
        fit_group_overhead("model", Partition.layerwise(3), 1.0)  # type: ignore[arg-type]
