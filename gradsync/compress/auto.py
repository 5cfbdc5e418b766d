"""``compression="auto"``: pick a codec per merged group (or DDP bucket) that never loses to not compressing.

Pure algorithm layer (issue 40): given what a group is (bytes, dtype, shapes), a wire model (seconds to move
``n`` bytes by allreduce or allgather over ``W`` ranks), the codec costs measured on this device and the
time backward still runs after the group is ready, :func:`choose` prices every codec the policy allows and
keeps the cheapest; :func:`review` drops a choice that measured slower than ``"none"``. The runtime half
(measuring, agreeing across ranks, caching) is :class:`gradsync.train.AutoCompression`.

Per group and codec ``c`` (``h``: encode + decode here, ``g``: the wire, ``slack``: backward left)::

    predicted(c) = h_c(x) + rounds_c * wire(collective_c, payload_c / rounds_c, W)
    exposed(c)   = max(0, predicted(c) - slack)        # hidden behind backward: free

The smallest ``exposed`` wins; ties go to the earlier codec of the policy (``"none"`` first, then casts,
then error-feedback codecs), so a group that any codec would hide is not compressed. A codec must also be
priced :data:`TRY_GAIN` times quicker than ``"none"`` (exposed) to be chosen at all: a smaller predicted gain
is inside what the model misses on a loaded host, and trying it costs timed steps that measure noise. Groups
are priced one by one: that they share one communication stream is left to the measurement (:func:`review`).

Policies (``allow=``) say what accuracy a user gives up, as data (:data:`POLICIES`):

* ``"lossless"`` -- ``"none"``, and casts to the gradient's own dtype (fp16 on an fp16 model);
* ``"cast"`` -- plus fp16 and bf16 (round each gradient once, no error feedback needed);
* ``"any"`` -- plus the error-feedback codecs: PowerSGD at ranks 1 and 4, top-k and DGC at 1% / 0.1%,
  EF-signSGD and QSGD.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from gradsync.compress.base import COMMUNICATORS, CompressionError, Compressor, TwoRoundCompressor, create
from gradsync.compress.merge import MergeError
from gradsync.compress.merge_model import (
    Cost,
    MergeCostModel,
    Partition,
    ScaledCost,
    ShiftedCost,
    fit_group_overhead,
    fit_wire_scale,
)
from gradsync.compress.merge_search import optimal_per_y
from gradsync.compress.profile import MeasuredCost, measure_codec
from gradsync.registry import Registry

__all__ = [
    "ACCURACY",
    "CALIBRATION_GAIN",
    "CAST_MARGIN",
    "calibration_cast",
    "PROFILE_TYPE",
    "profile_ladder",
    "ladder_covers",
    "dense_payloads",
    "run_classes",
    "CPU_PROFILE_CAP",
    "CODECS",
    "POLICIES",
    "AlphaBeta",
    "AutoChoice",
    "CodecOption",
    "CodecProfile",
    "GroupSpec",
    "JointChoice",
    "WireModel",
    "allowed",
    "choose",
    "choose_joint",
    "profile_codecs",
    "quicker_by",
    "review",
    "MARGIN",
    "TRY_GAIN",
    "LAUNCH_SPREAD",
    "QUICK_LAUNCH_S",
    "wants_another",
    "clearly_slower",
    "STEP_CHECK_ROUNDS",
    "STEP_TOLERANCE",
    "turns_over",
    "whole_steps_lose",
    "steps_apart",
    "margin_for",
    "trust_margin",
    "wide_margin",
    "rival",
]

#: Accuracy classes from none lost to most: a policy allows every class up to its own.
ACCURACY = ("lossless", "cast", "any")
#: A choice predicted more than this many times quicker than ``"none"`` is trusted without timing ``"none"``, as
#: long as it measures at most ``1/MARGIN`` of ``"none"``'s predicted time (:func:`wide_margin`, :func:`trust_margin`).
MARGIN = 2.0
#: The same trust for a cast (:func:`margin_for`): it sends half the bytes, so it is never more than 2x ahead and
#: never clears :data:`MARGIN`; on a wire-bound group it is priced near 2x, and timing ``"none"`` there costs a step
#: of the slow wire per probe. Kept on its own measurement, it is at most ``1/CAST_MARGIN`` of ``"none"``'s predicted
#: time: ``"none"`` would have to beat its model by that much, where the model (the probed wire) is at its surest.
CAST_MARGIN = 1.6
#: A codec is chosen over ``"none"`` only where it is priced this many times quicker (exposed seconds): below it the
#: model's error on a loaded host (codec costs profiled alone, a wire shared with backward) is as large as the gain,
#: and a trial would cost timed steps to measure noise (docs/mergecomp.md: a cast priced a little ahead on LeNet-5's
#: one bucket cost more in its trial and whole-step check than it could win).
TRY_GAIN = 1.25
#: The optimizer's bucket check keeps the choices without timing DDP's buckets where each of its first steps took at
#: most ``1/CALIBRATION_GAIN`` of the timed calibration step, which ran those buckets uncompressed (on its own clock,
#: the partition search after it left out); the whole-step check skips its "none" steps where the first settled step
#: took at most that share of every "none" step the groups' probes ran. Above ``TRY_GAIN``, the checks' own early
#: end, by what a step before the codecs (still warming) may read apart from the same way's steps in the check; under
#: 2x, which fp16 at best reaches.
CALIBRATION_GAIN = 1.5
#: The whole-step check sends settled choices back to ``"none"`` only where their steps' median is this much slower
#: than the steps that ran ``"none"`` (:func:`whole_steps_lose`): it has a few noisy steps a side against the groups'
#: own timings, which already put the choices ahead (docs/mergecomp.md: without it a cast went back to ``"none"`` on
#: a difference of a percent between two noisy steps a side).
STEP_TOLERANCE = 0.05
#: The whole-step comparisons (the check against "none" everywhere, and the close calls' part before it) time
#: ``probe_steps`` steps a side, and go on while their sides overlap, up to this many times that
#: (:func:`turns_over`): two noisy steps a side that overlap say nothing either way.
STEP_CHECK_ROUNDS = 3
#: A trial's launches quicker than this (seconds), or a codec's at any speed, get a third where their two disagree
#: (:func:`wants_another`)...
QUICK_LAUNCH_S = 0.05
#: ...by more than this factor.
LAUNCH_SPREAD = 1.5
#: The ``type`` of a cached :class:`CodecProfile`.
PROFILE_TYPE = "gradsync.codec_profile"


@dataclass(frozen=True)
class CodecOption:
    """One codec ``auto`` may pick: a registry compressor with fixed parameters and its accuracy class.

    ``accuracy``: ``"lossless"`` (the exact sum), ``"cast"`` (rounds to ``cast_to``; lossless on a model of that
    dtype) or ``"any"`` (needs error feedback to converge).
    """

    name: str
    compressor: str
    params: tuple[tuple[str, Any], ...] = ()
    accuracy: str = "any"
    cast_to: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.accuracy not in ACCURACY:
            raise CompressionError(f"accuracy={self.accuracy!r} of codec {self.name!r} must be one of {ACCURACY}")

    def create(self) -> Compressor:
        """A fresh compressor (its own per-tensor state)."""
        return create(self.compressor, **dict(self.params))

    def accuracy_for(self, dtype: torch.dtype) -> str:
        """The class on a model of ``dtype``: a cast to the model's own dtype rounds nothing."""
        return "lossless" if self.cast_to is not None and self.cast_to == dtype else self.accuracy


#: The codecs ``auto`` considers, in preference order (ties go to the earlier one).
CODECS: Registry[CodecOption] = Registry("auto codec", CompressionError)
for _option in (
    CodecOption("none", "none", accuracy="lossless"),
    CodecOption("fp16", "fp16", accuracy="cast", cast_to=torch.float16),
    CodecOption("bf16", "bf16", accuracy="cast", cast_to=torch.bfloat16),
    CodecOption("powersgd-r4", "powersgd", (("rank", 4),)),
    CodecOption("powersgd-r1", "powersgd", (("rank", 1),)),
    CodecOption("topk-1%", "topk", (("ratio", 0.01),)),
    CodecOption("dgc-0.1%", "dgc", (("ratio", 0.001), ("seed", 0))),
    CodecOption("qsgd", "qsgd", (("levels", 127), ("seed", 0))),
    CodecOption("efsignsgd", "efsignsgd"),
):
    CODECS.add(_option.name, _option)

#: ``allow=`` names -> the accuracy class they allow up to.
POLICIES: Mapping[str, str] = {"lossless": "lossless", "cast": "cast", "any": "any"}


def allowed(policy: str, dtype: torch.dtype) -> tuple[CodecOption, ...]:
    """The codecs ``policy`` allows on gradients of ``dtype``: the more accurate first, then in preference order
    (``"none"`` always first)."""
    if policy not in POLICIES:
        raise CompressionError(f"allow={policy!r} must be one of {sorted(POLICIES)} (what accuracy auto may give up)")
    limit = ACCURACY.index(POLICIES[policy])
    options = [o for o in (CODECS.get(n) for n in CODECS.names()) if ACCURACY.index(o.accuracy_for(dtype)) <= limit]
    # The more accurate first, so a tie goes to it (bf16 before fp16 on a bf16 model, where bf16 rounds nothing);
    # a cast as wide as an earlier one of its class never sends less and rounds no better (bf16 after fp16).
    options.sort(key=lambda o: ACCURACY.index(o.accuracy_for(dtype)))
    kept: list[CodecOption] = []
    for o in options:
        if o.cast_to is not None and any(k.cast_to is not None and k.cast_to.itemsize == o.cast_to.itemsize
                                         and k.accuracy_for(dtype) == o.accuracy_for(dtype) for k in kept):
            continue
        kept.append(o)
    return tuple(kept)


# -- inputs ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSpec:
    """One merged group or DDP bucket as the codec sees it.

    ``shapes``: the tensors it compresses, each alone (one flat ``(numel,)`` for a merged flat group, each
    parameter's shape for a layer-wise bucket), so PowerSGD's payload is that of its matrices. ``slack_s``:
    seconds of backward still to run once the group is ready (0: nothing to hide behind).
    """

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    slack_s: float = 0.0

    def __post_init__(self) -> None:
        shapes = tuple(tuple(int(s) for s in shape) for shape in self.shapes)
        if not shapes:
            raise CompressionError(f"group {self.name!r} has no tensors; give at least one shape")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise CompressionError(f"dtype={self.dtype!r} of group {self.name!r} must be a floating torch.dtype")
        if not (isinstance(self.slack_s, (int, float)) and math.isfinite(self.slack_s) and self.slack_s >= 0):
            raise CompressionError(f"slack_s={self.slack_s!r} of group {self.name!r} must be seconds >= 0")
        object.__setattr__(self, "shapes", shapes)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def payload_bytes(self, compressor: Compressor) -> int:
        """What one rank sends with ``compressor``: each tensor's payload, summed."""
        return sum(compressor.payload_bytes(s, self.dtype) for s in self.shapes)


class WireModel(Protocol):
    """Seconds one collective of ``nbytes`` per rank takes over ``world`` ranks (``collective``: allreduce/allgather)."""

    def __call__(self, collective: str, nbytes: float, world: int) -> float: ...


@dataclass(frozen=True)
class AlphaBeta:
    """The α–β wire: ring allreduce ``2 (W-1) (α + M / (W β))``, allgather ``(W-1) (α + M / β)``.

    ``alpha_s``: seconds per message step; ``bytes_per_s``: the slowest link's rate (``inf``: a wire that is
    infinitely fast). The runtime builds one from its calibrated :class:`~gradsync.sim.cost.CostModel`.
    """

    alpha_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise CompressionError(f"alpha_s={self.alpha_s!r} must be finite seconds >= 0")
        if not self.bytes_per_s > 0:
            raise CompressionError(f"bytes_per_s={self.bytes_per_s!r} must be > 0 (inf: an infinitely fast wire)")

    def __call__(self, collective: str, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        if collective == "allreduce":
            return 2 * (world - 1) * (self.alpha_s + nbytes / (world * self.bytes_per_s))
        if collective == "allgather":
            return (world - 1) * (self.alpha_s + nbytes / self.bytes_per_s)
        raise CompressionError(f"collective={collective!r} must be one of {COMMUNICATORS}")

    def to_dict(self) -> dict[str, Any]:
        """JSON (``inf`` as the string ``"inf"``): part of the cache key."""
        rate = "inf" if math.isinf(self.bytes_per_s) else self.bytes_per_s
        return {"type": "gradsync.alpha_beta", "alpha_s": self.alpha_s, "bytes_per_s": rate}


@dataclass(frozen=True)
class CodecProfile:
    """Measured codec seconds per element count, one :class:`Cost` per codec name (``"none"`` costs 0)."""

    costs: Mapping[str, Cost] = field(default_factory=dict)

    def __call__(self, codec: str, numel: int) -> float:
        if codec == "none":
            return 0.0
        cost = self.costs.get(codec)
        if cost is None:
            raise CompressionError(f"codec {codec!r} was not profiled (have {sorted(self.costs)}); profile it first")
        return float(cost(numel))

    def to_dict(self) -> dict[str, Any]:
        """Tagged JSON: per codec, the measured points its interpolation runs through."""
        return {"type": PROFILE_TYPE, "costs": {name: {"sizes": list(c.sizes), "seconds": list(c.seconds)}
                                                for name, c in self.costs.items() if isinstance(c, MeasuredCost)}}

    @classmethod
    def from_dict(cls, doc: Any) -> CodecProfile:
        """The inverse of :meth:`to_dict`; a malformed document raises :class:`CompressionError` naming it."""
        if not isinstance(doc, dict) or doc.get("type") != PROFILE_TYPE or not isinstance(doc.get("costs"), dict):
            raise CompressionError(f"a codec profile must be a JSON object with \"type\": \"{PROFILE_TYPE}\" and "
                                   f"\"costs\"; got {str(doc)[:200]}")
        costs: dict[str, Cost] = {}
        for name, c in doc["costs"].items():
            try:
                costs[str(name)] = MeasuredCost(tuple(c["sizes"]), tuple(c["seconds"]))
            except (KeyError, TypeError, MergeError) as exc:
                raise CompressionError(f"codec profile entry {name!r} is malformed ({exc}): {c!r}") from None
        return cls(costs)


#: The largest point a profile measures on a CPU (8 MB of float32): beyond it a codec streams, and its time
#: extends along the last measured segment (:class:`~gradsync.compress.profile.MeasuredCost`). Measuring an MLP's
#: 16.8 MB group at the next power of 8 (1.7e7 elements) took most of a 5 s first step on 2 cores.
CPU_PROFILE_CAP = 8**7


def profile_ladder(low: int, high: int, cap: int | None = None) -> tuple[int, ...]:
    """The element counts a profile measures for groups of ``low`` .. ``high`` elements: the powers of 8 from the
    one at or below ``low`` to the one at or above ``high`` (at least two; a codec's time is close to linear
    between them, and the largest point bounds the profile's own time), stopping at ``cap`` (a power of 8; None:
    no cap) -- larger groups are priced along the last segment. Fixed points, not the range's own,
    so a profile measured for one job (or one caller: the partition search and the per-group choice) serves
    another whose groups fall inside it, and it can be cached."""
    lo = 8 ** max(0, math.floor(math.log(max(1, low), 8) + 1e-12))
    if cap is not None:
        lo = min(lo, cap // 8)
    out = [lo, lo * 8]
    while out[-1] < high and (cap is None or out[-1] < cap):
        out.append(out[-1] * 8)
    return tuple(out)


def dense_payloads(nbytes: Sequence[int], dtype: torch.dtype, options: Sequence[CodecOption], *,
                   none: bool = True) -> list[int]:
    """The one-allreduce payloads groups of ``nbytes`` send under ``options``: each cast's for every group, then
    ``"none"``'s (a cast is usually tried first where the wire is slow, where its first call's pricing costs most;
    ``none=False``: the casts' alone). Codecs with other exchanges (two rounds, an allgather) are left out."""
    casts = [o.cast_to for o in options if o.cast_to is not None and o.cast_to != dtype]
    out = [n * wire.itemsize // dtype.itemsize for wire in casts for n in nbytes]
    if none and any(o.name == "none" for o in options):
        out += list(nbytes)
    return [n for n in out if n > 0]


def calibration_cast(nbytes: Sequence[int], dtype: torch.dtype, options: Sequence[CodecOption], wire: WireModel,
                     world: int, margin: float = CAST_MARGIN) -> CodecOption | None:
    """The cast the optimizer's first calibration step may send DDP's buckets (``nbytes``) in: the first of
    ``options`` that casts (to another dtype than ``dtype``) whose exchange of them ``wire`` prices ``margin`` times
    quicker than the uncompressed one; None where none does (no cast allowed, or a wire on which halving the bytes
    saves little: a fast one, or buckets small enough that each message's fixed cost decides). That step is not
    timed and its partition is thrown away, so the one thing it decides is how long the job waits for it."""
    cast = next((o for o in options if o.cast_to is not None and o.cast_to != dtype), None)
    if cast is None or cast.cast_to is None:
        return None
    plain, comp = CODECS.get("none").create(), cast.create()
    none_s = sum(_wire_seconds(plain, n, wire, world) for n in nbytes)
    cast_s = sum(_wire_seconds(comp, n * cast.cast_to.itemsize // dtype.itemsize, wire, world) for n in nbytes)
    return cast if none_s > 0 and quicker_by(cast_s, none_s, margin) else None  # a free wire saves nothing


def run_classes(nbytes: Sequence[int], floor: int) -> list[int]:
    """The powers of two, largest first, from the one at or above the sum of ``nbytes`` down to the larger of ``floor``
    and the one at or above the smallest entry: the size classes a group of consecutive tensors of ``nbytes`` can fall
    in (every one between, where sums step by less than their size), before a partition is chosen."""
    if not nbytes:
        return []
    top = 1 << max(0, math.ceil(math.log2(max(1, sum(nbytes)))))
    low = max(floor, 1 << max(0, math.ceil(math.log2(max(1, min(nbytes))))))
    out = []
    while top >= low:
        out.append(top)
        top //= 2
    return out


def ladder_covers(ladder: Sequence[int], low: int, high: int, cap: int | None = None) -> bool:
    """Whether a profile measured at ``ladder`` prices groups of ``low`` .. ``high`` elements as one measured now
    would (beyond ``cap`` every profile extends its last segment)."""
    top = high if cap is None else min(high, cap)
    return low >= ladder[0] and top <= ladder[-1]


def profile_codecs(
    options: Sequence[CodecOption], sizes: Sequence[int], dtype: torch.dtype, *, device: torch.device | str = "cpu",
    repeats: int = 2,
) -> CodecProfile:
    """``measure_codec`` (encode + decode, min of ``repeats``) of each option at ``sizes``, interpolated."""
    costs: dict[str, Cost] = {}
    for option in options:
        if option.name != "none":
            samples = measure_codec(option.create(), sizes, repeats=repeats, dtype=dtype, device=device)
            costs[option.name] = MeasuredCost.from_samples(samples)
    return CodecProfile(costs)


# -- choosing ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AutoChoice:
    """The codec picked for one group, what it sends, and its predicted seconds (and ``"none"``'s)."""

    group: str
    nbytes: int
    codec: str
    payload_bytes: int
    predicted_s: float
    none_s: float
    #: why it is this codec: ``"model"`` (priced), ``"measured"`` (kept after measuring), ``"dropped"``
    #: (measured slower than none), ``"step"`` (whole steps decided it: back to none where they measured slower
    #: than those running none everywhere, or a way lost on a close call put back where steps without it measured
    #: slower), ``"cached"`` (an earlier job's)
    reason: str = "model"

    def to_dict(self) -> dict[str, Any]:
        return {"codec": self.codec, "nbytes": self.nbytes, "payload_bytes": self.payload_bytes,
                "predicted_s": self.predicted_s, "none_s": self.none_s, "reason": self.reason}

    @classmethod
    def from_dict(cls, group: str, doc: Any) -> AutoChoice:
        try:
            choice = cls(group, int(doc["nbytes"]), str(doc["codec"]), int(doc["payload_bytes"]),
                         float(doc["predicted_s"]), float(doc["none_s"]), str(doc.get("reason", "cached")))
        except (KeyError, TypeError, ValueError) as exc:
            raise CompressionError(f"cached choice for {group!r} is malformed ({exc}): {doc!r}") from None
        CODECS.get(choice.codec)  # an unknown codec raises, naming the known ones
        return choice


def _price(option: CodecOption, spec: GroupSpec, wire: WireModel, codec_cost: Callable[[str, int], float],
           world: int) -> tuple[int, float]:
    comp = option.create()
    payload = spec.payload_bytes(comp)
    return payload, float(codec_cost(option.name, spec.numel) + _wire_seconds(comp, payload, wire, world))


def _wire_seconds(comp: Compressor, payload: float, wire: WireModel, world: int) -> float:
    """Seconds on ``wire`` for ``payload`` bytes per rank sent by ``comp`` (two rounds for a two-round method)."""
    rounds = 2 if isinstance(comp, TwoRoundCompressor) else 1
    return rounds * wire(comp.communicator, payload / rounds, world)


def choose(groups: Sequence[GroupSpec], *, policy: str, wire: WireModel, codec_cost: Callable[[str, int], float],
           world: int, gain: float = TRY_GAIN) -> tuple[AutoChoice, ...]:
    """Per group, the allowed codec with the least exposed time (module docstring), ties to the earlier codec; a
    codec not ``gain`` times quicker than ``"none"`` (exposed) leaves the group on ``"none"``."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CompressionError(f"world={world!r} must be an integer >= 1 (ranks the gradients are averaged over)")
    if not (isinstance(gain, (int, float)) and math.isfinite(gain) and gain >= 1):
        raise CompressionError(f"gain={gain!r} must be a number >= 1 (how much quicker than none a codec must be)")
    out = []
    for spec in groups:
        options = allowed(policy, spec.dtype)
        priced = [(o, *_price(o, spec, wire, codec_cost, world)) for o in options]
        none_s = priced[0][2]
        exposed = [max(0.0, seconds - spec.slack_s) for _, _, seconds in priced]
        best = min(range(len(priced)), key=lambda i: (exposed[i], i))
        if not quicker_by(exposed[best], exposed[0], gain):
            best = 0
        option, payload, seconds = priced[best]
        out.append(AutoChoice(spec.name, spec.nbytes, option.name, payload, seconds, none_s))
    return tuple(out)


@dataclass(frozen=True)
class JointChoice:
    """The partition and the codec chosen together (:func:`choose_joint`), with every codec's best time."""

    codec: str
    partition: Partition
    predicted_s: float
    #: each allowed codec's best iteration time over all partitions (``"none"`` included)
    per_codec_s: Mapping[str, float]
    #: seconds each group costs beyond its codec and its collective, fitted to a timed step (``observed``)
    group_overhead_s: float = 0.0
    #: the timed step's collectives' measured time over the wire model's (``observed_busy_s``), by which every
    #: codec's collective was priced; 1.0 where none was measured
    wire_scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"codec": self.codec, "counts": list(self.partition.counts), "predicted_s": self.predicted_s,
                "per_codec_s": dict(self.per_codec_s), "group_overhead_s": self.group_overhead_s,
                "wire_scale": self.wire_scale}

    @classmethod
    def from_dict(cls, doc: Any) -> JointChoice:
        """:meth:`to_dict` read back (rank 0's decision, or a cache file; one written before ``wire_scale`` reads 1)."""
        try:
            return cls(str(doc["codec"]), Partition.from_counts([int(c) for c in doc["counts"]]),
                       float(doc["predicted_s"]), {str(k): float(v) for k, v in dict(doc["per_codec_s"]).items()},
                       float(doc["group_overhead_s"]), float(doc.get("wire_scale", 1.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CompressionError(f"the joint choice is malformed ({exc}): {doc!r}") from None


class _GroupCost:
    """A group's seconds as a function of its element count, vectorised as the merge search needs (elements are
    whole numbers, so each distinct count is priced once)."""

    def __init__(self, seconds: Callable[[int], float]) -> None:
        self._seconds = seconds
        self._memo: dict[int, float] = {}

    def __call__(self, numel: Any) -> Any:
        x = np.asarray(numel, dtype=np.float64)
        out = np.empty(x.shape, dtype=np.float64)
        for index, v in np.ndenumerate(x):
            key = int(round(v))
            if key not in self._memo:
                self._memo[key] = float(self._seconds(key))
            out[index] = self._memo[key]
        return out if out.shape else float(out)


def choose_joint(sizes: Sequence[int], ready_s: Sequence[float], backward_end_s: float, *, policy: str,
                 dtype: torch.dtype, wire: WireModel, codec_cost: Callable[[str, int], float], world: int,
                 forward_s: float = 0.0, observed: tuple[Partition, float] | None = None,
                 observed_busy_s: float | None = None) -> JointChoice:
    """The merged partition and the codec together, as MergeComp searches them: for each allowed codec, its
    pipeline (:class:`~gradsync.compress.merge_model.MergeCostModel`: ``h`` the codec's encode + decode, ``g`` its
    collective of each group's payload on ``wire``) and the partition its exact search finds (every group count);
    the codec whose best partition is quickest wins, ties to the earlier (more accurate) one. Tensors are in
    backward order, each group a flat buffer (so PowerSGD sees vectors, which it sends as they are).

    ``observed``: a partition and the seconds one step took running it with ``"none"`` (the optimizer's timed
    layer-wise step). What each group costs beyond its collective -- launching it, the bookkeeping, averaging its
    result -- is in no profile, and priced at zero it makes extra groups look free (a small model's last tensor
    split off into a group of its own, slower than one group). It is fitted to that step
    (:func:`~gradsync.compress.merge_model.fit_group_overhead` on ``"none"``'s model) and added to every codec's
    ``h``: the same per group whatever the codec.

    ``observed_busy_s``: how long that step's collectives were in flight (the union of each group's launch-to-done
    interval). Where given, the step's miss in proportion to its bytes is fitted first, as a scale on the wire
    (:func:`~gradsync.compress.merge_model.fit_wire_scale`, every codec's collective priced with it), and only the
    rest per group: a backend slower than the wire model is not read as a cost of every group (docs/mergecomp.md)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CompressionError(f"world={world!r} must be an integer >= 1 (ranks the gradients are averaged over)")

    def model_for(option: CodecOption, overhead_s: float, scale: float = 1.0) -> MergeCostModel:
        comp = option.create()

        def comm(x: int) -> float:
            return _wire_seconds(comp, comp.payload_bytes((x,), dtype), wire, world)

        h: Cost = _GroupCost(lambda x: codec_cost(option.name, x))
        g: Cost = _GroupCost(comm)
        return MergeCostModel(tuple(sizes), tuple(ready_s), backward_end_s, h=ShiftedCost(h, overhead_s)
                              if overhead_s > 0 else h, g=g if scale == 1.0 else ScaledCost(g, scale),
                              forward_s=forward_s)

    options = allowed(policy, dtype)
    overhead, scale = 0.0, 1.0
    if observed is not None:
        partition, seconds = observed
        if not isinstance(partition, Partition) or partition.n != len(sizes):
            raise CompressionError(f"observed={observed!r} must be (a Partition of the {len(sizes)} tensors, the "
                                   f"seconds a step with it took)")
        base = model_for(options[0], 0.0)
        if observed_busy_s is not None:
            base, scale = fit_wire_scale(base, partition, observed_busy_s)
        _, overhead = fit_group_overhead(base, partition, seconds)
    elif observed_busy_s is not None:
        raise CompressionError(f"observed_busy_s={observed_busy_s!r} needs observed= (the step and its partition)")
    best: tuple[float, str, Partition] | None = None
    per_codec: dict[str, float] = {}
    for option in options:
        model = model_for(option, overhead, scale)
        seconds, partition = min(optimal_per_y(model).values(), key=lambda tp: (tp[0], tp[1].num_groups))
        per_codec[option.name] = float(seconds)
        if best is None or seconds < best[0]:  # strictly quicker: a tie stays with the earlier codec
            best = (float(seconds), option.name, partition)
    if best is None:  # pragma: no cover - "none" is always allowed
        raise CompressionError(f"policy {policy!r} allows no codec")
    return JointChoice(best[1], best[2], best[0], per_codec, overhead, scale)


def quicker_by(seconds: float, than_s: float, factor: float) -> bool:
    """Whether ``seconds`` is at least ``factor`` times quicker than ``than_s``: the one bar every keep-or-drop here
    is (a codec's price against "none"'s, a measurement against "none"'s, against a margin)."""
    return seconds * factor <= than_s


def review(choice: AutoChoice, measured_s: float, measured_none_s: float, gain: float = 1.0) -> AutoChoice:
    """After measuring: a choice that did not measure ``gain`` times quicker than ``"none"`` on this group (by default:
    slower) is dropped for ``"none"``; else kept. A gain above 1 is the bar where the group's own time understates
    what the codec costs the step (its exchange on gradsync's communication thread against "none" on the backend's)."""
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not gain >= 1.0:
        raise CompressionError(f"gain={gain!r} must be a number >= 1 (how many times quicker than 'none' to keep it)")
    if choice.codec == "none":
        return AutoChoice(choice.group, choice.nbytes, "none", choice.nbytes, choice.none_s, choice.none_s, "measured")
    if not quicker_by(measured_s, measured_none_s, gain):
        return AutoChoice(choice.group, choice.nbytes, "none", choice.nbytes, choice.none_s, choice.none_s, "dropped")
    return AutoChoice(choice.group, choice.nbytes, choice.codec, choice.payload_bytes, choice.predicted_s,
                      choice.none_s, "measured")


def wants_another(times_s: Sequence[float], probe_steps: int, *, codec: bool = False) -> bool:
    """Whether a trial's ``probe_steps`` timed launches should get one more before they are read: where they disagree
    by more than :data:`LAUNCH_SPREAD` times and each is quick (under :data:`QUICK_LAUNCH_S`, so the launch costs the
    job little), or whatever their speed on a codec's trial (``codec``: not ``"none"``). Two samples that far apart
    leave their mean to whichever is off, and the off one can be slow (another process on the cores, a launch paying
    the codec's first use on the group) or quick (a shaper's token bucket sending a burst at line rate): the median of
    three is off only where two are. A codec's third launch costs the job at most what the codec loses to
    ``"none"``, and a codec read by the mean of an off launch and a good one is dropped for the off one alone;
    ``"none"`` on a wire-bound group is the slowest launch a trial has, so only its quick trials take a third."""
    if len(times_s) != probe_steps or not times_s:
        return False
    low, high = min(times_s), max(times_s)
    return (codec or high < QUICK_LAUNCH_S) and high > LAUNCH_SPREAD * low


def clearly_slower(readings_s: Sequence[float], none_s: float, *, least: int, gain: float = TRY_GAIN) -> bool:
    """Whether a way's trial may end before the runtime settled the exchange it runs: ``least`` launches read (settled
    or not) and even the quickest of them ``gain`` times slower than the group's ``"none"`` (``none_s``; inf, not
    timed: never). While the runtime explores a size, the launches run its candidates in turn, the one it will settle
    on among them, so the quickest reading past the explorer's warm-up round is about what the way costs settled; a
    way that far behind "none" would be dropped on it, and each launch it waits costs the job that much more."""
    return len(readings_s) >= least and math.isfinite(none_s) and quicker_by(none_s, min(readings_s), gain)


def whole_steps_lose(settled_s: Sequence[float], baseline_s: Sequence[float],
                     tolerance: float = STEP_TOLERANCE) -> bool:
    """Whether whole steps with the settled choices (``settled_s``) ran slower than those with ``"none"`` everywhere
    (``baseline_s``): their median beyond ``1 + tolerance`` times the baseline's. Each side needs a step."""
    if not settled_s or not baseline_s:
        raise CompressionError(f"the whole-step check needs steps on both sides, got {list(settled_s)} and "
                               f"{list(baseline_s)}")
    return float(np.median(settled_s)) > (1.0 + tolerance) * float(np.median(baseline_s))


def steps_apart(quick_s: Sequence[float], slow_s: Sequence[float], *, least: int,
                gain: float = TRY_GAIN) -> bool:
    """Whether whole steps ``quick_s`` were each at least ``gain`` times quicker than every step of ``slow_s``, with
    ``least`` steps a side: a gap no step's noise or a warming step explains, so a whole-step comparison can stop
    before its full count (its slow side, "none" on a slow wire, is the costly one to time)."""
    if isinstance(least, bool) or not isinstance(least, int) or least < 1:
        raise CompressionError(f"least={least!r} must be an integer >= 1 (steps a side before a gap counts)")
    if min(len(quick_s), len(slow_s)) < least:
        return False
    return quicker_by(max(quick_s), min(slow_s), gain)


def turns_over(settled_s: Sequence[float], other_s: Sequence[float], *, least: int,
               rounds: int = STEP_CHECK_ROUNDS) -> bool:
    """Whether a whole-step comparison has its steps: ``least`` a side, and then either its sides apart (every step of
    one side no slower than every step of the other, :func:`steps_apart` at a gain of 1) or ``rounds * least`` a side.
    Sides that overlap are noise as likely as a difference, and a median of two noisy steps picks the slower way
    often enough to matter (docs/mergecomp.md, "The whole-step check goes on while its sides overlap")."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise CompressionError(f"rounds={rounds!r} must be an integer >= 1 (times least, the most steps a side)")
    n = min(len(settled_s), len(other_s))
    if n < least:
        return False
    if n >= rounds * least:
        return True
    return steps_apart(settled_s, other_s, least=least, gain=1.0) or steps_apart(other_s, settled_s, least=least,
                                                                                 gain=1.0)


def margin_for(codec: str, margin: float = MARGIN, cast_margin: float = CAST_MARGIN) -> float:
    """The margin ``codec`` is trusted on (:func:`wide_margin`, :func:`trust_margin`): ``margin``, or ``cast_margin``
    for a cast where that is lower (a cast never clears 2x: half the bytes at best)."""
    option = CODECS.get(codec)
    return min(margin, cast_margin) if option.cast_to is not None else margin


def wide_margin(choice: AutoChoice, margin: float = MARGIN) -> bool:
    """Whether ``choice`` is predicted more than ``margin`` times quicker than ``"none"``: then the model alone
    decides the trial, and ``"none"`` is timed only if the codec's measurement breaks the margin
    (:func:`trust_margin`). On a slow wire timing ``"none"`` is the most expensive part of choosing (an MLP at
    300 Mbit/s: 1.1 s a step against 0.15 s compressed). A cast never clears :data:`MARGIN` (at best half the
    bytes): :func:`margin_for` gives it a margin of its own."""
    return choice.codec != "none" and choice.none_s > margin * choice.predicted_s


def trust_margin(choice: AutoChoice, measured_s: float, margin: float = MARGIN) -> AutoChoice | None:
    """After timing a :func:`wide_margin` choice alone: kept (``"measured"``) if it took at most ``1/margin`` of
    ``"none"``'s predicted time -- then ``"none"`` would have to be ``margin`` times quicker than its model for the
    codec to lose -- else None: time ``"none"`` and :func:`review` as usual."""
    if not quicker_by(measured_s, choice.none_s, margin):
        return None
    return AutoChoice(choice.group, choice.nbytes, choice.codec, choice.payload_bytes, choice.predicted_s,
                      choice.none_s, "measured")


def rival(spec: GroupSpec, choice: AutoChoice, measured_s: float, *, tried: Sequence[str], policy: str,
          wire: WireModel, codec_cost: Callable[[str, int], float], world: int,
          margin: float = MARGIN, beat_s: float | None = None) -> AutoChoice | None:
    """Another codec to time when ``choice`` measured more than ``margin`` times its prediction: the codec profile
    missed what it costs in this job (processes sharing the cores while the profile ran alone, shapes it did not
    see), so the model's ranking of the others is in doubt too. The allowed codec not in ``tried`` with the least
    exposed time, if it is predicted quicker than ``beat_s`` (default ``measured_s``: the quickest measured so
    far); else None. The caller keeps whichever measures quickest."""
    if choice.codec == "none" or not measured_s > margin * choice.predicted_s:
        return None
    best: tuple[float, int, CodecOption, int, float] | None = None
    for i, option in enumerate(allowed(policy, spec.dtype)):
        if option.name == "none" or option.name in tried:
            continue
        payload, seconds = _price(option, spec, wire, codec_cost, world)
        key = (max(0.0, seconds - spec.slack_s), i)
        if best is None or key < best[:2]:
            best = (*key, option, payload, seconds)
    if best is None or not best[4] < (measured_s if beat_s is None else beat_s):
        return None
    return AutoChoice(spec.name, spec.nbytes, best[2].name, best[3], best[4], choice.none_s)
