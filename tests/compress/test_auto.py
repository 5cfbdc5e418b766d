"""compression="auto"'s chooser (issue 40) on fake wires and fake codec costs: no device timing anywhere."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradsync.compress.auto import (
    CAST_MARGIN,
    CODECS,
    MARGIN,
    POLICIES,
    STEP_CHECK_ROUNDS,
    STEP_TOLERANCE,
    TRY_GAIN,
    AlphaBeta,
    AutoChoice,
    CodecProfile,
    GroupSpec,
    JointChoice,
    allowed,
    choose,
    dense_payloads,
    ladder_covers,
    margin_for,
    profile_ladder,
    review,
    rival,
    run_classes,
    steps_apart,
    trust_margin,
    turns_over,
    whole_steps_lose,
    wide_margin,
)
from gradsync.compress.base import CompressionError
from gradsync.compress.merge_model import WIRE_SCALE_BOUNDS, LinearCost

FAST = AlphaBeta(0.0, math.inf)
SLOW = AlphaBeta(1e-3, 1e3)  # 1 KB/s: every byte counts


def _free_codecs(codec: str, numel: int) -> float:
    return 0.0


def _cheap_codecs(codec: str, numel: int) -> float:
    return 0.0 if codec == "none" else 1e-6 + 1e-9 * numel


GROUPS = [
    GroupSpec("fc.weight", ((512, 256),), torch.float32),
    GroupSpec("fc.bias", ((512,),), torch.float32),
    GroupSpec("merged[0:3]", ((70000,),), torch.float32),
    GroupSpec("bucket0", ((64, 3, 3, 3), (64,), (128, 64)), torch.float32),
]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_infinitely_fast_wire_picks_none_everywhere(policy: str) -> None:
    for cost in (_cheap_codecs, _free_codecs):  # even codecs that cost nothing tie with none, and none wins ties
        picks = choose(GROUPS, policy=policy, wire=FAST, codec_cost=cost, world=4)
        assert [c.codec for c in picks] == ["none"] * len(GROUPS)
        assert all(c.payload_bytes == c.nbytes == g.nbytes for c, g in zip(picks, GROUPS))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_very_slow_wire_picks_the_smallest_payload_the_policy_allows(policy: str) -> None:
    picks = choose(GROUPS, policy=policy, wire=SLOW, codec_cost=_cheap_codecs, world=2)
    for spec, pick in zip(GROUPS, picks):
        # independent expectation: every allowed codec's payload, from the compressors themselves
        payloads = {o.name: sum(o.create().payload_bytes(s, spec.dtype) for s in spec.shapes)
                    for o in allowed(policy, spec.dtype)}
        assert pick.payload_bytes == min(payloads.values()), (spec.name, pick, payloads)
        assert pick.codec in payloads
    if policy == "cast":
        assert {p.codec for p in picks} == {"fp16"}
    if policy == "lossless":
        assert {p.codec for p in picks} == {"none"}


def test_allow_is_never_violated() -> None:
    wires = [FAST, SLOW, AlphaBeta(1e-4, 1e9), AlphaBeta(0.0, 1e6)]
    classes = {"lossless": {"none"}, "cast": {"none", "fp16"}, "any": set(CODECS.names())}
    for policy, permitted in classes.items():
        for wire in wires:
            for world in (2, 4, 16):
                for cost in (_free_codecs, _cheap_codecs):
                    for pick in choose(GROUPS, policy=policy, wire=wire, codec_cost=cost, world=world):
                        assert pick.codec in permitted, (policy, wire, world, pick)
    # an fp16 model: the cast rounds nothing, so "lossless" may use it
    assert [o.name for o in allowed("lossless", torch.float16)] == ["none", "fp16"]
    half = [GroupSpec("h", ((4096,),), torch.float16)]  # same payload as none, and it costs a pass: none
    assert [c.codec for c in choose(half, policy="lossless", wire=SLOW, codec_cost=_cheap_codecs, world=2)] == ["none"]
    assert [o.name for o in allowed("lossless", torch.float32)] == ["none"]
    with pytest.raises(CompressionError, match="allow='lossy'"):
        choose(GROUPS, policy="lossy", wire=SLOW, codec_cost=_cheap_codecs, world=2)


def test_overlap_hides_a_group_behind_backward() -> None:
    wire = AlphaBeta(0.0, 1e8)  # 100 MB/s
    spec = GroupSpec("g", ((1_000_000,),), torch.float32)  # 4 MB: 2 * 1 * 4e6 / (2 * 1e8) = 40 ms by allreduce
    exposed = choose([spec], policy="cast", wire=wire, codec_cost=_cheap_codecs, world=2)[0]
    assert exposed.codec == "fp16" and exposed.none_s == pytest.approx(0.04)
    hidden = GroupSpec("g", spec.shapes, spec.dtype, slack_s=0.05)  # backward runs 50 ms more: none is free
    assert choose([hidden], policy="cast", wire=wire, codec_cost=_cheap_codecs, world=2)[0].codec == "none"


def test_codec_cost_decides_when_the_wire_is_cheap() -> None:
    wire = AlphaBeta(0.0, 1e9)
    spec = GroupSpec("g", ((1_000_000,),), torch.float32)  # none: 4 ms on 2 ranks; fp16 saves 2 ms
    slow_codec = CodecProfile({"fp16": LinearCost(0.0, 3e-9), "bf16": LinearCost(0.0, 3e-9)})  # 3 ms: > it saves
    fast_codec = CodecProfile({"fp16": LinearCost(0.0, 1e-9), "bf16": LinearCost(0.0, 1e-9)})  # 1 ms: less
    assert choose([spec], policy="cast", wire=wire, codec_cost=slow_codec, world=2)[0].codec == "none"
    pick = choose([spec], policy="cast", wire=wire, codec_cost=fast_codec, world=2)[0]
    assert pick.codec == "fp16" and pick.predicted_s == pytest.approx(1e-3 + 2e-3)


@pytest.mark.parametrize("alpha_s, picked", [(0.0, "fp16"), (2.9e-3, "fp16"), (3.1e-3, "none"), (10e-3, "none")])
def test_a_codec_is_chosen_only_where_it_is_priced_try_gain_times_quicker(alpha_s: float, picked: str) -> None:
    """Closed form on 2 ranks (allreduce 2 (α + M/(2β))) with a free codec: none 2α + 4 ms, fp16 2α + 2 ms; fp16 is
    picked iff (2α + 4 ms) >= TRY_GAIN (2α + 2 ms), i.e. α <= 3 ms at TRY_GAIN = 1.25. gain=1 keeps any win."""
    assert TRY_GAIN == 1.25
    spec = GroupSpec("g", ((1_000_000,),), torch.float32)
    wire = AlphaBeta(alpha_s, 1e9)
    (pick,) = choose([spec], policy="cast", wire=wire, codec_cost=_free_codecs, world=2)
    assert pick.codec == picked and pick.none_s == pytest.approx(2 * alpha_s + 4e-3), pick
    (eager,) = choose([spec], policy="cast", wire=wire, codec_cost=_free_codecs, world=2, gain=1.0)
    assert eager.codec == "fp16"
    with pytest.raises(CompressionError, match="gain=0.5"):
        choose([spec], policy="cast", wire=wire, codec_cost=_free_codecs, world=2, gain=0.5)


def test_whole_steps_lose_only_beyond_the_tolerance() -> None:
    """Medians 1.0 s (baseline) against 1.03 s (settled): inside STEP_TOLERANCE = 5 %, kept; 1.06 s: lost. The
    median, not the mean: one slow step (3 s) on the settled side does not decide."""
    assert STEP_TOLERANCE == 0.05
    assert not whole_steps_lose([1.03, 1.03], [1.0, 1.0])
    assert whole_steps_lose([1.06, 1.06], [1.0, 1.0])
    assert not whole_steps_lose([1.0, 1.02, 3.0], [0.99, 1.0, 1.01])
    assert whole_steps_lose([1.03, 1.03], [1.0, 1.0], tolerance=0.0)
    with pytest.raises(CompressionError, match="both sides"):
        whole_steps_lose([], [1.0])


def test_steps_apart_needs_every_quick_step_try_gain_under_every_slow_one() -> None:
    """TRY_GAIN = 1.25: 0.8 s against 1.0 s is apart (1.25x), 0.81 s is not; one slow step on the quick side, or one
    quick step on the slow side (a probe that happened to run fast), breaks the gap; fewer than ``least`` steps on
    either side never makes one."""
    assert TRY_GAIN == 1.25
    assert steps_apart([0.8], [1.0], least=1)
    assert not steps_apart([0.81], [1.0], least=1)
    assert steps_apart([0.5, 0.8], [1.0, 3.0], least=2)
    assert not steps_apart([0.5, 0.9], [1.0, 3.0], least=2)
    assert not steps_apart([0.5, 0.5], [1.0, 0.6], least=2)
    assert not steps_apart([0.5], [1.0, 1.0], least=2)
    assert not steps_apart([], [1.0], least=1)
    assert steps_apart([0.9], [1.0], least=1, gain=1.1)
    with pytest.raises(CompressionError, match="least=0"):
        steps_apart([0.5], [1.0], least=0)


def test_a_whole_step_comparison_goes_on_while_its_sides_overlap() -> None:
    """Two steps a side (``least``) that overlap say nothing: the comparison goes on, one step a side at a time,
    until every step of one side is quicker than every step of the other (either side), or ``rounds * least`` a side
    (STEP_CHECK_ROUNDS = 3); sides apart end it at ``least``; fewer than ``least`` a side never does."""
    assert STEP_CHECK_ROUNDS == 3
    assert turns_over([1.0, 1.1], [1.2, 1.3], least=2) and turns_over([1.2, 1.3], [1.0, 1.1], least=2)
    assert not turns_over([1.0, 1.3], [1.1, 1.2], least=2)  # overlapping: the medians would tie
    assert not turns_over([1.0, 1.3, 1.3, 1.3, 1.3], [1.1, 1.2, 1.0, 1.0, 1.0], least=2)
    assert turns_over([1.0, 1.3, 1.3, 1.3, 1.3, 1.3], [1.1, 1.2, 1.0, 1.0, 1.0, 1.0], least=2)  # 3 * 2 a side
    assert not turns_over([1.0], [2.0], least=2)
    assert turns_over([1.0], [2.0], least=1) and turns_over([1.0, 2.0, 1.5], [1.5, 1.0, 2.0], least=1)
    with pytest.raises(CompressionError, match="rounds=0"):
        turns_over([1.0], [2.0], least=1, rounds=0)


def test_a_choice_measured_slower_than_none_is_dropped() -> None:
    pick = AutoChoice("g", 4000, "topk-1%", 80, 1e-3, 4e-3)
    dropped = review(pick, measured_s=5e-3, measured_none_s=4e-3)
    assert (dropped.codec, dropped.payload_bytes, dropped.reason) == ("none", 4000, "dropped")
    kept = review(pick, measured_s=2e-3, measured_none_s=4e-3)
    assert (kept.codec, kept.payload_bytes, kept.reason) == ("topk-1%", 80, "measured")
    # with a bar: 3.6 ms against 4 ms is quicker, but not 1.25x quicker; 3.2 ms is exactly that
    assert review(pick, measured_s=3.6e-3, measured_none_s=4e-3).reason == "measured"
    assert review(pick, measured_s=3.6e-3, measured_none_s=4e-3, gain=1.25).reason == "dropped"
    assert review(pick, measured_s=3.2e-3, measured_none_s=4e-3, gain=1.25).reason == "measured"
    for bad in (0.9, True, "1.25"):
        with pytest.raises(CompressionError, match="gain="):
            review(pick, measured_s=1e-3, measured_none_s=4e-3, gain=bad)


def test_a_wide_margin_is_trusted_only_while_the_measurement_keeps_it() -> None:
    """A choice more than 2x ahead of "none" on the model skips timing "none"; it is kept if it measured at most half
    of "none"'s predicted time, else None ("none" is timed and reviewed). A cast on a free codec is exactly 2x: never
    wide, whatever the wire."""
    assert wide_margin(AutoChoice("g", 4000, "topk-1%", 80, 0.4, 1.0))
    assert not wide_margin(AutoChoice("g", 4000, "topk-1%", 80, 0.5, 1.0))  # exactly 2x: not more than
    assert not wide_margin(AutoChoice("g", 4000, "none", 4000, 0.1, 1.0))
    for wire in (SLOW, AlphaBeta(0.0, 1e3), AlphaBeta(1.0, 1e9)):
        (cast,) = choose([GroupSpec("w", ((1000,),), torch.float32)], policy="cast", wire=wire, codec_cost=_free_codecs,
                         world=4)
        # (where latency is the wire's whole cost, halving the bytes gains under TRY_GAIN: "none")
        assert cast.codec == ("none" if wire.alpha_s == 1.0 else "fp16") and not wide_margin(cast), cast
        # on its own margin it clears where the bytes are the cost (2x ahead: free codecs)
        assert wide_margin(cast, margin_for(cast.codec)) == (cast.codec == "fp16"), cast
    pick = AutoChoice("g", 4000, "topk-1%", 80, 0.1, 1.0)
    kept = trust_margin(pick, 0.5)
    assert kept is not None and (kept.codec, kept.reason, kept.none_s) == ("topk-1%", "measured", 1.0)
    assert trust_margin(pick, 0.51) is None and trust_margin(pick, math.inf) is None


def test_a_cast_is_trusted_on_its_own_margin_and_never_on_a_wider_one_than_asked() -> None:
    """margin_for: a cast's margin is CAST_MARGIN (under 2x, which half the bytes can reach), unless the margin asked
    for is lower still (TRY_GAIN, where a check follows); any other codec keeps the margin asked for; and a cast
    margin of MARGIN (the optimizer's, where its search found no gain) is never cleared by a cast."""
    assert 1.0 < CAST_MARGIN < 2.0 and margin_for("fp16") == margin_for("bf16") == CAST_MARGIN
    assert margin_for("fp16", TRY_GAIN) == TRY_GAIN and margin_for("fp16", MARGIN, MARGIN) == MARGIN
    assert margin_for("topk-1%") == MARGIN and margin_for("topk-1%", TRY_GAIN) == TRY_GAIN
    cast = AutoChoice("g", 4000, "fp16", 2000, 0.55, 1.0)  # 1.8x ahead
    assert wide_margin(cast, margin_for("fp16")) and not wide_margin(cast, margin_for("fp16", MARGIN, MARGIN))
    assert trust_margin(cast, 0.6, margin_for("fp16")) is not None  # 1/0.6 = 1.67x measured
    assert trust_margin(cast, 0.65, margin_for("fp16")) is None  # 1.54x: "none" is timed after all
    with pytest.raises(CompressionError, match="zstd"):
        margin_for("zstd")


def test_wire_model_closed_forms_and_json() -> None:
    w = AlphaBeta(1e-4, 1e9)
    assert w("allreduce", 4e6, 4) == pytest.approx(2 * 3 * (1e-4 + 4e6 / 4e9))
    assert w("allgather", 4e6, 4) == pytest.approx(3 * (1e-4 + 4e6 / 1e9))
    assert w("allreduce", 4e6, 1) == 0.0
    assert FAST.to_dict()["bytes_per_s"] == "inf"
    with pytest.raises(CompressionError, match="collective='broadcast'"):
        w("broadcast", 1, 2)
    with pytest.raises(CompressionError, match="bytes_per_s=0"):
        AlphaBeta(0.0, 0)
    assert AutoChoice.from_dict("g", pick_dict := AutoChoice("g", 8, "fp16", 4, 1.0, 2.0).to_dict()).codec == "fp16"
    with pytest.raises(CompressionError, match="auto codec"):
        AutoChoice.from_dict("g", {**pick_dict, "codec": "zip"})


def test_casts_are_lossless_on_their_own_dtype_and_cast_class_otherwise() -> None:
    names = lambda policy, dtype: [o.name for o in allowed(policy, dtype)]  # noqa: E731
    assert names("lossless", torch.float32) == ["none"]
    assert names("lossless", torch.bfloat16) == ["none", "bf16"]
    assert names("lossless", torch.float16) == ["none", "fp16"]
    assert names("cast", torch.float32) == ["none", "fp16"]  # bf16: fp16's bytes, coarser
    assert names("cast", torch.bfloat16) == ["none", "bf16", "fp16"]  # a tie goes to bf16, lossless there


# -- the partition and the codec together ------------------------------------------------------------------------
def _brute_force_joint(sizes, ready, end, policy, wire, cost, world, overhead=0.0, wire_scale=1.0):
    """Every codec x every contiguous partition, priced by MergeCostModel.iteration_time with closed-form h and g
    (``overhead`` seconds added to every group's h, every collective ``wire_scale`` times the wire's)."""
    import itertools

    from gradsync.compress.merge_model import MergeCostModel, Partition

    best = None
    n = len(sizes)
    for option in allowed(policy, torch.float32):
        comp = option.create()
        h = lambda x, name=option.name: np.vectorize(lambda v: cost(name, int(v)) + overhead)(x)  # noqa: E731
        g = lambda x, comp=comp: np.vectorize(  # noqa: E731
            lambda v: wire_scale * wire(comp.communicator, comp.payload_bytes((int(v),), torch.float32), world))(x)
        model = MergeCostModel(tuple(sizes), tuple(ready), end, h=h, g=g)
        for k in range(n):
            for cuts in itertools.combinations(range(1, n), k):
                t = model.iteration_time(Partition(n, cuts))
                if best is None or t < best[0] - 1e-15:
                    best = (t, option.name, cuts)
    return best


def test_the_joint_search_is_brute_forces_optimum_over_codecs_and_partitions() -> None:
    import random

    from gradsync.compress.auto import choose_joint

    per_element = {"fp16": 2e-10, "bf16": 2e-10, "powersgd-r4": 3e-9, "powersgd-r1": 3e-9, "topk-1%": 4e-9,
                   "dgc-0.1%": 2e-9, "qsgd": 1e-9, "efsignsgd": 8e-10}

    def cost(codec: str, numel: int) -> float:
        return 0.0 if codec == "none" else 2e-5 + per_element[codec] * numel

    picked = set()
    for seed in range(6):
        rng = random.Random(seed)
        n = 5
        sizes = [rng.choice([1000, 20_000, 300_000, 2_000_000]) for _ in range(n)]
        ready = list(np.cumsum([rng.uniform(0.0, 4e-3) for _ in range(n)]))
        end = ready[-1] + rng.uniform(0.0, 2e-3)
        wire = AlphaBeta(rng.choice([1e-5, 1e-4]), rng.choice([1e8, 1e9, 1e10]))
        for policy in ("cast", "any"):
            joint = choose_joint(sizes, ready, end, policy=policy, dtype=torch.float32, wire=wire, codec_cost=cost,
                                 world=4)
            t, codec, cuts = _brute_force_joint(sizes, ready, end, policy, wire, cost, 4)
            assert joint.predicted_s == pytest.approx(t, rel=1e-9, abs=1e-12), (seed, policy, joint, t, codec, cuts)
            assert joint.per_codec_s[joint.codec] == joint.predicted_s == min(joint.per_codec_s.values())
            assert set(joint.per_codec_s) == {o.name for o in allowed(policy, torch.float32)}
            picked.add((joint.codec, joint.partition.num_groups))
    # the cases differ: compressing and not, one group and several (a search that ignored either would fail some)
    assert len({c for c, _ in picked}) >= 3 and len({y for _, y in picked}) >= 2, picked


def test_the_joint_search_prices_each_groups_own_cost_from_a_timed_layerwise_step() -> None:
    """A step's per-group cost that no profile sees (launch, bookkeeping): fitted to the timed layer-wise step, it
    turns a split that is free in the model into one group, and the result is brute force's with that cost."""
    from gradsync.compress.auto import choose_joint
    from gradsync.compress.merge_model import MergeCostModel, Partition

    sizes, ready, end = [156, 2_400, 30_000, 48_000, 150], [1e-4, 4e-4, 1.2e-3, 2.4e-3, 2.5e-3], 2.6e-3
    wire = AlphaBeta(5e-5, 1e9)
    cost = lambda codec, numel: 0.0 if codec == "none" else 3e-5 + 1e-9 * numel  # noqa: E731
    plain = choose_joint(sizes, ready, end, policy="cast", dtype=torch.float32, wire=wire, codec_cost=cost, world=2)
    assert plain.group_overhead_s == 0.0 and plain.partition.num_groups > 1, plain  # free groups: it splits
    true_overhead = 4e-4
    g = lambda x: np.vectorize(lambda v: wire("allreduce", 4 * int(v), 2))(x)  # noqa: E731
    h = lambda x: np.zeros_like(np.asarray(x, dtype=float)) + true_overhead  # noqa: E731
    layerwise = Partition(5, tuple(range(1, 5)))
    seen = MergeCostModel(tuple(sizes), tuple(ready), end, h=h, g=g).iteration_time(layerwise)
    joint = choose_joint(sizes, ready, end, policy="cast", dtype=torch.float32, wire=wire, codec_cost=cost, world=2,
                         observed=(layerwise, seen))
    assert joint.group_overhead_s == pytest.approx(true_overhead, rel=1e-3)
    t, codec, cuts = _brute_force_joint(sizes, ready, end, "cast", wire, cost, 2, overhead=true_overhead)
    assert joint.predicted_s == pytest.approx(t, rel=1e-3) and joint.codec == codec, (joint, t, codec, cuts)
    assert joint.partition.num_groups == len(cuts) + 1 < plain.partition.num_groups
    # a step no slower than the model: no overhead, the same choice as without it
    quick = choose_joint(sizes, ready, end, policy="cast", dtype=torch.float32, wire=wire, codec_cost=cost, world=2,
                         observed=(layerwise, 0.0))
    assert quick == plain
    with pytest.raises(CompressionError, match="Partition of the 5 tensors"):
        choose_joint(sizes, ready, end, policy="cast", dtype=torch.float32, wire=wire, codec_cost=cost, world=2,
                     observed=(Partition(4, ()), 1.0))


def test_the_joint_search_reads_a_slow_wire_from_the_steps_collectives_not_as_a_cost_per_group() -> None:
    """A timed step on DDP's buckets whose backend ran 1.4x the wire model: with the time its collectives were in
    flight, the miss is fitted as the wire's (scale 1.4, the true per-group cost left), and the search finds brute
    force's optimum of the true model, with more groups than the fit that charges the wire's miss to each group."""
    from gradsync.compress.auto import choose_joint
    from gradsync.compress.merge_model import MergeCostModel, Partition

    sizes = [5_000, 1_000_000, 1_000, 1_000_000, 1_000, 1_000_000]
    ready = list(np.cumsum([1e-3, 30e-3, 1e-3, 30e-3, 1e-3, 30e-3]))
    end, wire, world = ready[-1] + 2e-3, AlphaBeta(1e-4, 1e8), 4
    cost = lambda codec, numel: 0.0 if codec == "none" else 1e-4 + 2e-10 * numel  # noqa: E731
    true_scale, true_overhead = 1.4, 2e-4
    g = lambda x: np.vectorize(lambda v: true_scale * wire("allreduce", 4 * int(v), world))(x)  # noqa: E731
    h = lambda x: np.zeros_like(np.asarray(x, dtype=float)) + true_overhead  # noqa: E731
    buckets = Partition.from_counts([2, 4])
    seen = MergeCostModel(tuple(sizes), tuple(ready), end, h=h, g=g).iteration_time(buckets)
    busy = sum(true_scale * wire("allreduce", 4 * sum(sizes[a:b]), world) for a, b in buckets.bounds)
    kw = dict(policy="cast", dtype=torch.float32, wire=wire, codec_cost=cost, world=world, observed=(buckets, seen))
    joint = choose_joint(sizes, ready, end, observed_busy_s=busy, **kw)
    assert joint.wire_scale == pytest.approx(true_scale, rel=1e-9)
    assert joint.group_overhead_s == pytest.approx(true_overhead, rel=1e-3)
    t, codec, cuts = _brute_force_joint(sizes, ready, end, "cast", wire, cost, world, overhead=true_overhead,
                                        wire_scale=true_scale)
    assert joint.codec == codec and joint.partition == Partition(len(sizes), cuts), (joint, t, codec, cuts)
    assert joint.predicted_s == pytest.approx(t, rel=1e-3)
    charged = choose_joint(sizes, ready, end, **kw)  # the whole miss per group: 180x the true cost, fewer groups
    assert charged.wire_scale == 1.0 and charged.group_overhead_s > 100 * true_overhead
    assert charged.partition.num_groups < joint.partition.num_groups, (charged, joint)
    assert JointChoice.from_dict(joint.to_dict()) == joint
    old = joint.to_dict()
    del old["wire_scale"]  # a cache written before the scale: read as unscaled
    assert JointChoice.from_dict(old).wire_scale == 1.0
    # a wire model far off is not the wire's measure (a late rank, a stall): the scale stops at its bound
    far = choose_joint(sizes, ready, end, observed_busy_s=busy * 100, **kw)
    assert far.wire_scale == WIRE_SCALE_BOUNDS[1]
    with pytest.raises(CompressionError, match="observed_busy_s=.* needs observed="):
        choose_joint(sizes, ready, end, policy="cast", dtype=torch.float32, wire=wire, codec_cost=cost, world=world,
                     observed_busy_s=busy)


def test_the_joint_search_keeps_none_on_a_free_wire_and_compresses_on_a_slow_one() -> None:
    from gradsync.compress.auto import choose_joint

    sizes, ready = [10_000] * 4, [1e-3, 2e-3, 3e-3, 4e-3]
    cost = lambda codec, numel: 0.0 if codec == "none" else 1e-4 + 1e-9 * numel  # noqa: E731
    free = choose_joint(sizes, ready, 4e-3, policy="any", dtype=torch.float32, wire=FAST, codec_cost=cost, world=4)
    assert free.codec == "none" and free.predicted_s == pytest.approx(4e-3)
    slow = choose_joint(sizes, ready, 4e-3, policy="any", dtype=torch.float32, wire=AlphaBeta(1e-4, 1e6),
                        codec_cost=cost, world=4)
    assert slow.codec not in ("none", "fp16") and slow.predicted_s < slow.per_codec_s["none"] / 3


def test_the_profile_ladder_is_powers_of_8_capped_and_covers_what_it_extends_to() -> None:
    assert profile_ladder(100, 5000) == (64, 512, 4096, 32768)
    assert profile_ladder(1, 1) == (1, 8)
    assert profile_ladder(100, 5_000_000) == (64, 512, 4096, 32768, 262144, 2097152, 16777216)
    assert profile_ladder(100, 5_000_000, cap=8**7) == (64, 512, 4096, 32768, 262144, 2097152)
    assert profile_ladder(5_000_000, 9_000_000, cap=8**7) == (262144, 2097152)  # two points below the cap
    capped = profile_ladder(64, 300_000, cap=8**7)
    assert ladder_covers(capped, 64, 10**9, cap=8**7) and not ladder_covers(capped, 64, 10**9)
    assert not ladder_covers(capped, 8, 1000, cap=8**7)  # below the first point


def test_a_rival_is_timed_only_when_the_pick_measured_far_above_its_prediction() -> None:
    """Closed forms on a slow wire with free codecs: the model's pick is the smallest payload; measured within 2x of
    its prediction there is no rival; far above, the rival is the best codec not tried yet (exposed time), and
    none once it is predicted no quicker than the pick measured."""
    spec = GroupSpec("w", ((256, 256),), torch.float32)
    kw = dict(policy="any", wire=SLOW, codec_cost=_free_codecs, world=4)
    (pick,) = choose([spec], **kw)
    assert rival(spec, pick, 2 * pick.predicted_s, tried=[pick.codec], **kw) is None
    second = rival(spec, pick, 100 * pick.predicted_s, tried=[pick.codec], **kw)
    priced = sorted((p.predicted_s, i, p.codec) for i, p in enumerate(
        choose([spec], policy="any", wire=SLOW, codec_cost=lambda c, n, o=o: 0.0 if c == o else 1e9, world=4)[0]
        for o in [o.name for o in allowed("any", torch.float32)] if o not in ("none", pick.codec)))
    assert second is not None and second.codec == priced[0][2] and second.none_s == pick.none_s, (second, priced)
    assert rival(spec, pick, 100 * pick.predicted_s, tried=[o.name for o in allowed("any", torch.float32)], **kw) is None
    assert rival(spec, pick, second.predicted_s, tried=[pick.codec], **kw) is None  # no quicker than measured
    # a later rival must beat the quickest measured so far, not only the last
    third = rival(spec, second, 100 * second.predicted_s, tried=[pick.codec, second.codec], **kw)
    assert third is not None and third.codec not in (pick.codec, second.codec)
    assert rival(spec, second, 100 * second.predicted_s, tried=[pick.codec, second.codec], beat_s=third.predicted_s,
                 **kw) is None


def test_a_trial_ends_before_its_exchange_settled_only_where_even_its_quickest_launch_is_far_behind_none():
    from gradsync.compress.auto import TRY_GAIN, clearly_slower

    # fp16 on the MLP's 25 MB group (two-tier file, 10 Gbit/s): its 12.6 MB payload explored, "none" at 64 ms
    assert clearly_slower([0.29, 0.15, 0.11, 0.17, 0.12, 0.14], 0.064, least=6)
    assert not clearly_slower([0.29, 0.15, 0.11, 0.17, 0.12], 0.064, least=6)  # too few launches read
    assert not clearly_slower([0.29, 0.15, 0.07, 0.17, 0.12, 0.14], 0.064, least=6)  # one within TRY_GAIN: wait
    assert not clearly_slower([1.0] * 6, math.inf, least=6)  # "none" not timed
    edge = 0.064 * TRY_GAIN
    assert clearly_slower([edge] * 6, 0.064, least=6) and not clearly_slower([edge * 0.99] * 6, 0.064, least=6)
    # a wire-bound group: fp16's explored launches, warm-ups among them, still well under "none"'s
    assert not clearly_slower([0.52, 0.41, 0.39, 0.45, 0.6, 0.38], 0.7, least=6)


def test_a_quick_or_codec_trial_whose_two_launches_disagree_takes_a_third():
    from gradsync.compress.auto import LAUNCH_SPREAD, QUICK_LAUNCH_S, wants_another

    assert wants_another([0.0165, 0.0057], 2)  # LeNet-5's bucket, planned, on the two-tier file at 300 Mbit/s
    assert not wants_another([0.0067, 0.0076], 2)  # they agree
    assert not wants_another([0.14, 0.09], 2) and not wants_another([0.9, 0.3], 2)  # one launch costs too much
    # ... unless it is a codec's: fp16 on the MLP's 16.9 MB bucket (two-tier file, 1 Gbit/s), its first launch off
    assert wants_another([0.2895, 0.1807], 2, codec=True) and wants_another([0.9, 0.3], 2, codec=True)
    assert not wants_another([0.125, 0.110], 2, codec=True)  # they agree
    assert not wants_another([0.0165, 0.0057, 0.006], 2)  # the third came: read them
    assert not wants_another([0.01], 2) and not wants_another([], 0)
    edge = QUICK_LAUNCH_S * 0.99
    assert wants_another([edge, edge / LAUNCH_SPREAD * 0.99], 2) and not wants_another([edge, edge / LAUNCH_SPREAD], 2)


def test_dense_payloads_are_each_cast_then_none() -> None:
    """What a group's one-allreduce codecs send (what the runtime prices ahead): a float32 group of 1,000 bytes sends
    500 as fp16 and 1,000 as it is; a cast to the model's own dtype sends what "none" does and is not listed twice;
    codecs with other exchanges (PowerSGD's two rounds, top-k's allgather) are not listed."""
    assert dense_payloads([1000, 64], torch.float32, allowed("cast", torch.float32)) == [500, 32, 1000, 64]
    assert dense_payloads([1000], torch.float32, allowed("any", torch.float32)) == [500, 1000]
    assert dense_payloads([1000], torch.float32, allowed("lossless", torch.float32)) == [1000]
    assert dense_payloads([1000, 64], torch.float32, allowed("cast", torch.float32), none=False) == [500, 32]
    assert dense_payloads([1000], torch.float32, allowed("lossless", torch.float32), none=False) == []
    assert dense_payloads([1000], torch.float16, allowed("cast", torch.float16)) == [1000, 1000]  # bf16: 2 bytes too
    assert dense_payloads([1000], torch.float16, allowed("lossless", torch.float16)) == [1000]


def test_run_classes_hold_every_class_a_run_of_consecutive_tensors_falls_in() -> None:
    """Brute force over every run of consecutive tensors: its size class is listed wherever it is at least the floor,
    and the list is the powers of two between, largest first."""
    mib = 1 << 20
    assert run_classes([3 * mib, 1024, 5 * mib], mib) == [16 * mib, 8 * mib, 4 * mib, 2 * mib, mib]
    assert run_classes([], mib) == [] and run_classes([100], mib) == []
    rng = np.random.default_rng(0)
    for _ in range(50):
        nbytes = [int(x) for x in rng.integers(1, 4 * mib, size=int(rng.integers(1, 12)))]
        floor = int(2 ** rng.integers(10, 22))
        got = run_classes(nbytes, floor)
        assert got == sorted(set(got), reverse=True) and all(c >= floor for c in got)
        for i in range(len(nbytes)):
            for j in range(i + 1, len(nbytes) + 1):
                cls = 1 << math.ceil(math.log2(sum(nbytes[i:j])))
                if cls >= floor:
                    assert cls in got, (nbytes, i, j, cls)


def test_calibration_cast_is_the_first_allowed_cast_the_wire_puts_the_margin_ahead_closed_form():
    """The α-β ring over k buckets of S bytes in all: uncompressed kα + S/(Wβ) per step pair, the cast kα + S/(2Wβ);
    the cast is taken where that ratio reaches the margin, exactly at α = (1 - m/2) / (m - 1) * S/(Wβ) / k. None where
    no cast is allowed, the wire is infinitely fast, or the cast sends as many bytes (fp16 on a bf16 model)."""
    from gradsync.compress.auto import CAST_MARGIN, allowed, calibration_cast

    world, rate, buckets = 4, 1e6, [4_000_000, 2_000_000]
    f32 = torch.float32
    edge = (1 - CAST_MARGIN / 2) / (CAST_MARGIN - 1) * sum(buckets) / (world * rate) / len(buckets)
    got = calibration_cast(buckets, f32, allowed("cast", f32), AlphaBeta(edge * 0.99, rate), world)
    assert got is not None and got.name == "fp16"
    assert calibration_cast(buckets, f32, allowed("cast", f32), AlphaBeta(edge * 1.01, rate), world) is None
    assert calibration_cast(buckets, f32, allowed("any", f32), SLOW, world).name == "fp16"
    assert calibration_cast(buckets, f32, allowed("lossless", f32), SLOW, world) is None
    assert calibration_cast(buckets, f32, allowed("cast", f32), FAST, world) is None
    assert calibration_cast(buckets, torch.bfloat16, allowed("any", torch.bfloat16), SLOW, world) is None
    assert calibration_cast(buckets, f32, allowed("cast", f32), SLOW, 1) is None  # one rank: no wire
    assert calibration_cast(buckets, f32, allowed("cast", f32), SLOW, world, margin=2.01) is None  # at most 2x
