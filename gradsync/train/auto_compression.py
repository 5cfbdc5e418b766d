"""``compression="auto"`` on a live job: per group, run the codec :func:`gradsync.compress.auto.choose` picks,
measure it against ``"none"``, and drop it where it loses (issue 40).

Each group (a merged group of :class:`DistributedOptimizer`, or a DDP bucket of the compressed hook) goes
through the same few steps, as ``auto`` explores plans:

1. its first ``probe_steps`` launches run ``"none"``, timed: the baseline, and when the group is ready
   against when backward ends (its *slack*, the time a transfer can hide behind);
2. at the next launch the codec is chosen (wire model + codec costs profiled on this device + slack), once
   for the job: rank 0 computes it and every rank gets the same bytes (the runtime's job-wide decide, as
   :meth:`PlanCache.decide <gradsync.comm.plans.PlanCache.decide>`), so replicas stay bit-identical;
3. the chosen codec then runs ``probe_steps`` launches, timed; at the next one rank 0's measurements decide,
   for every rank, whether it stays (:func:`~gradsync.compress.auto.review`: slower than ``"none"`` -> dropped).

A launch across which the runtime settled its exchange (:attr:`Runtime.settling
<gradsync.comm.runtime.Runtime.settling>`: a payload size's first call priced and planned, its pipeline depths
explored) is timed apart, and its trial runs up to :data:`SETTLING_LAUNCHES` more launches for ``probe_steps``
settled ones: a codec's payload is a size the runtime has never sent, and its first calls time that, not the codec.

Where the model puts a codec more than :attr:`AutoCompression.margin` (:data:`~gradsync.compress.auto.MARGIN`, or
``TRY_GAIN`` where the optimizer's bucket check follows a search that put the codec that far ahead; a cast at most
:data:`~gradsync.compress.auto.CAST_MARGIN`) times ahead of ``"none"`` at the group's first launch, step 1
is skipped: the codec is timed first, and kept if it took at most ``1/margin`` of
``"none"``'s predicted time; otherwise ``"none"`` is timed after all and step 3's review decides. On a slow wire
the ``"none"`` launches are most of what choosing costs.

``"none"`` of a group handed over as one buffer (``step_async(flat=...)``) is the backend's own allreduce of it,
what DDP runs. Where the runtime plans that size itself (a tuned or planned schedule on gradsync's communication
thread), that planned exchange is timed right after as a second way to send the group uncompressed
(:data:`PLANNED`), and the group's ``"none"`` from then on is the planned one only where it measured
:attr:`AutoCompression.threaded_gain` times quicker: a plan measured alone may beat the backend's and still lose
inside a training step, where it shares the cores with backward (the bar is 1 where the optimizer's whole steps
against DDP's buckets follow and decide that). A cast codec's payload (fp16, bf16) goes the way the group's ``"none"``
runs: the backend's allreduce, whatever the runtime explores for the smaller size, unless the group kept the planned
way (or, before ``"none"`` was timed, the runtime's pick for the payload's size is a plan).

Once every group has settled and the whole-step check is over, a group whose choice is stateless and sums its flat
buffer as it is ("none", on the backend's allreduce or the planned exchange it measured quicker on; or a cast the
runtime sums natively) launches by :meth:`AutoCompression.settled_launch`: the allreduce and the average, without the
timing callbacks and step bookkeeping the choosing needs, which on a GPU cost more host time than the allreduce's
launch (``gradsync bench gpu``'s hook step times, docs/mergecomp.md), and without the ``"none"`` step's per-tensor
payloads, finite marks and copies back.

A codec with error feedback (top-k, DGC, EF-signSGD, PowerSGD) keeps what it has not sent yet per tensor name. When
the group's next launch runs another way (the next trial, "none" after a dropped codec, a turn of the whole-step
check, the optimizer's DDP buckets), that debt (:meth:`Memory.owed <gradsync.compress.base.Memory.owed>`) is added to
the launch's gradients and the codec forgets it, committed with the step's verdict as any update is: a codec tried and
dropped loses none of the gradient its launches held back, and a codec put back starts from nothing stale.

Settled choices are cached (JSON) per model signature, wire model, device, world size, policy and path (the
optimizer's merged groups or a DDP hook's buckets), so the next
job with the same ones starts decided; another wire or parameter signature misses the cache.
:meth:`AutoCompression.report` prints one table: group, bytes, codec, predicted and measured time.
A measured time is the group's local half (compensate, compress) plus its exchange's service time on the
communication thread (from when it could start -- queued behind the previous job -- to its end).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from gradsync.comm.runtime import Runtime, Work
from gradsync.comm.tuning import EXPLORE_MAX_CALLS, cache_file, write_cache
from gradsync.compress.auto import (
    CALIBRATION_GAIN,
    CAST_MARGIN,
    CODECS,
    CPU_PROFILE_CAP,
    MARGIN,
    POLICIES,
    PROFILE_TYPE,
    TRY_GAIN,
    AlphaBeta,
    AutoChoice,
    CodecProfile,
    GroupSpec,
    JointChoice,
    WireModel,
    allowed,
    calibration_cast,
    choose,
    choose_joint,
    clearly_slower,
    dense_payloads,
    ladder_covers,
    margin_for,
    profile_codecs,
    profile_ladder,
    quicker_by,
    review,
    rival,
    run_classes,
    steps_apart,
    trust_margin,
    turns_over,
    wants_another,
    whole_steps_lose,
    wide_margin,
)
from gradsync.compress.base import (
    CompressionError,
    Memory,
    StepBoundary,
    StepVerdict,
    TensorInfo,
    Verdicts,
    all_finite,
)
from gradsync.compress.merge_model import Partition
from gradsync.train.communicator import CompressionStep, average_in_place, native_cast_sum_async

__all__ = ["AUTO_TYPE", "PLANNED", "PROBE_STEPS", "AutoCompression", "param_signature", "wire_of"]

#: The cache file's ``"type"``.
AUTO_TYPE = "gradsync.compression_auto"
#: Launches per group timed with ``"none"``, then with the choice.
PROBE_STEPS = 2
#: The smallest size class priced ahead before the partition is known (:meth:`AutoCompression.anticipate_model`):
#: smaller classes price in well under a second, and there are many.
AHEAD_FLOOR_BYTES = 1 << 20
#: Launches a trial may add to its ``probe_steps`` while the runtime settles the exchange it runs (a new payload
#: size priced and planned, its pipeline depths explored): a launch across which :attr:`Runtime.settling
#: <gradsync.comm.runtime.Runtime.settling>` grew timed that, not what the codec will cost from then on. Up to an
#: explorer's longest run; then the trial's times are what they were.
SETTLING_LAUNCHES = EXPLORE_MAX_CALLS
#: ...unless, after this many launches, even the quickest is far slower than the group's "none"
#: (:func:`~gradsync.compress.auto.clearly_slower`): an explorer runs one call a launch, and a group launches once a
#: step, so waiting out its run would time a losing way for most of a short job. Past an explorer's first round (up
#: to five candidates, each first call a warm-up), so one reading at least is a timed call.
SETTLING_READINGS = 6
#: How long a review waits for a timing callback of a job already finished (it runs on the comm thread).
RECORD_WAIT_S = 5.0
#: Codecs a group times at most: the model's pick and up to two rivals while each measures beyond its prediction
#: (on the MLP at 1 Gbit/s the first rival, PowerSGD rank 4, was itself 2x off, and rank 1 was quicker still).
MAX_CODECS = 3
#: The trial of a group's ``"none"`` on the runtime's planned exchange instead of the backend's allreduce.
PLANNED = "none/planned"
#: The whole-step check's two comparisons (:meth:`AutoCompression._take_turns`): the ways lost on close calls put
#: back, then "none" everywhere.
RESTORE_PART, NONE_PART = "restore", "none"
_SERIALS = itertools.count()


def wire_of(runtime: Runtime) -> AlphaBeta:
    """The runtime's calibrated wire as α–β: α of one native ring step (or one executor message), β the
    slowest link's rate (measured per link class where calibrated) times the transport's goodput."""
    cm = runtime.cost_model
    rates = list(cm.link_GBps.values()) or [min(link.directed_GBps) for link in runtime.topology.links]
    alpha = cm.native_message_s if getattr(runtime.caps, "native", False) else cm.message_s
    return AlphaBeta(float(alpha), min(rates) * cm.goodput * 1e9)


def param_signature(named: Iterable[tuple[str, Tensor]]) -> list[list[Any]]:
    """``[name, shape, dtype]`` per parameter: what a cached choice is valid for."""
    return [[n, list(p.shape), str(p.dtype)] for n, p in named]


def _buckets_from(doc: Any) -> dict[str, Any]:
    """A cached bucket-check verdict (:meth:`AutoCompression.check_buckets`), checked, marked ``"cached"``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("kept"), bool):
        raise CompressionError(f"'buckets' must be an object with a boolean 'kept', got {doc!r}")
    out = {"kept": doc["kept"], "chosen_s": [float(x) for x in doc.get("chosen_s", [])],
           "buckets_s": [float(x) for x in doc.get("buckets_s", [])], "bytes": [int(b) for b in doc.get("bytes", [])],
           "cached": True}
    if doc.get("calibration_s") is not None:  # the check that stood the calibration step for DDP's buckets
        out["calibration_s"] = float(doc["calibration_s"])
    return out


class _Launch(NamedTuple):
    """One launch of the step in progress: its group, when it started, the codec it ran, whether it had settled, and
    the seconds the step had spent in job-wide decisions when it started."""

    key: str
    t0: float
    codec: str
    final: bool
    decided_s: float = 0.0


@dataclass
class _Group:
    spec: GroupSpec
    #: its tensors' names, what every codec's error feedback is keyed by
    names: tuple[str, ...] = ()
    launches: int = 0
    choice: AutoChoice | None = None
    final: bool = False
    #: the least slack a step measured (None: no step yet)
    slack_s: float | None = None
    times: dict[str, list[float]] = field(default_factory=dict)
    #: launches timed while the runtime settled their exchange (:data:`SETTLING_LAUNCHES`), kept apart
    unsettled: dict[str, list[float]] = field(default_factory=dict)
    #: the codecs timed so far (or being timed), in order, and the launches left in the last one's trial
    trials: list[str] = field(default_factory=list)
    left: int = 0
    #: each codec tried (not "none") as the model priced it
    candidates: dict[str, AutoChoice] = field(default_factory=dict)
    #: whether its last "none" launch ran on the backend's allreduce of one buffer (``step_async(flat=...)``,
    #: a buffer the backend takes), and whether its "none" runs on the runtime's planned exchange instead (it
    #: measured quicker: :data:`PLANNED`)
    native: bool = False
    planned: bool = False
    #: the codecs whose launches ran on gradsync's communication thread (a cast the runtime plans the size of, or
    #: any codec with an exchange of its own), not on the backend's allreduce
    threaded: set[str] = field(default_factory=set)
    #: the way it lost on a close call, where "none" measured less than TRY_GAIN times quicker: a codec its review
    #: dropped, or the planned exchange (:data:`PLANNED`) it did not keep; the whole-step check times steps with it
    #: back where the group settled on "none" (:meth:`AutoCompression._check_restore`)
    close: str | None = None

    def restorable(self) -> str | None:
        """The way the whole-step check puts back (:attr:`close`), where the group settled on the "none" it lost to;
        None otherwise (it settled on a codec; or on the planned way, which lost no close call then)."""
        choice = self.choice
        if self.close is None or choice is None or choice.codec != "none":
            return None
        lost = not self.planned if self.close == PLANNED else choice.reason == "dropped"
        return self.close if lost else None

    def now(self) -> GroupSpec:
        """The group as the model prices it now: with the least slack its steps measured."""
        return GroupSpec(self.spec.name, self.spec.shapes, self.spec.dtype, self.slack_s or 0.0)

    def time_s(self, codec: str) -> float:
        """``codec``'s time on this group: the median of its timed launches; of those timed while the runtime settled
        their exchange only where no other was (inf: none timed)."""
        return float(np.median(self.times.get(codec) or self.unsettled.get(codec) or [math.inf]))

    def trial_over(self, probe_steps: int) -> bool:
        """Whether the trial in progress has ``probe_steps`` settled timings (one more where they disagree and are
        quick or a codec's: :func:`~gradsync.compress.auto.wants_another`), or no launch left to wait for them, or
        (a way other than "none", its exchange still settling) :data:`SETTLING_READINGS` launches clearly slower
        than "none" (:func:`~gradsync.compress.auto.clearly_slower`)."""
        if self.left == 0:
            return True
        trial = self.trials[-1]
        times = self.times.get(trial, [])
        if len(times) >= probe_steps and not wants_another(times, probe_steps, codec=trial not in ("none", PLANNED)):
            return True
        return trial != "none" and clearly_slower(times + self.unsettled.get(trial, []), self.time_s("none"),
                                                  least=max(SETTLING_READINGS, probe_steps))

    def priced(self) -> AutoChoice:
        """The choice a check is about; one before any was made is a bug in the caller."""
        if self.choice is None:
            raise CompressionError(f"group {self.spec.name!r} is checked before it was given a codec")
        return self.choice


def _chained(fut: torch.futures.Future, finish: Callable[[Any], Tensor] | None) -> torch.futures.Future:
    """``fut`` with ``finish`` (:meth:`AutoCompression._finisher`) chained on it, given its value; ``fut`` itself
    without one."""
    return fut if finish is None else fut.then(lambda f: finish(f.value()))


class AutoCompression:
    """Per-group codec choice for ``compression="auto"``; duck-types :class:`CompressionStep`'s ``step_async``.

    ``allow``: the policy (``"lossless"``, ``"cast"``, ``"any"``; :data:`gradsync.compress.auto.POLICIES`).
    ``wire``: seconds per collective (default: :func:`wire_of` the runtime); ``codec_cost``: seconds per
    ``(codec, numel)`` (default: profiled on this device by rank 0 at the first choice). ``clock``: the timer
    (a fake one in tests). ``signature``: the parameters (:func:`param_signature`) the cache is keyed by;
    None keeps nothing on disk (``cache=False`` too). ``current``: the codec of the launch in progress
    (:data:`PLANNED` while "none" is timed on the runtime's planned exchange).
    """

    #: :meth:`step_async` takes ``flat=``: a group handed over as one buffer it may average in place runs its
    #: ``"none"`` as the backend's own allreduce (:class:`~gradsync.train.grouped.MergedGroups` asks for it)
    averages_flat = True

    def __init__(
        self,
        allow: str = "cast",
        *,
        runtime: Runtime | None = None,
        wire: WireModel | None = None,
        codec_cost: Callable[[str, int], float] | None = None,
        probe_steps: int = PROBE_STEPS,
        clock: Callable[[], float] = time.perf_counter,
        signature: list[list[Any]] | None = None,
        cache: bool = True,
    ) -> None:
        if allow not in POLICIES:
            raise CompressionError(f"allow={allow!r} must be one of {sorted(POLICIES)} (what accuracy auto may give up)")
        if isinstance(probe_steps, bool) or not isinstance(probe_steps, int) or probe_steps < 1:
            raise CompressionError(f"probe_steps={probe_steps!r} must be an integer >= 1 (timed launches per codec)")
        if wire is not None and not callable(wire):
            raise CompressionError(f"wire={wire!r} must be a callable (collective, nbytes, world) -> seconds")
        self.allow = allow
        self.probe_steps = probe_steps
        #: how far ahead of ``"none"`` the model must put a group's codec for it to be timed first and kept on its own
        #: measurement against ``"none"``'s predicted time, ``"none"`` never timed (:func:`wide_margin`,
        #: :func:`trust_margin`). :data:`MARGIN` (a cast: :attr:`cast_margin`) where nothing else would time the choices
        #: against ``"none"``; the optimizer lowers it to :data:`TRY_GAIN` where its check against DDP's buckets
        #: sent uncompressed follows (whole steps that catch a trusted codec losing) and its partition search put the
        #: codec that far ahead for the whole step
        self.margin = MARGIN
        #: the margin a cast is trusted on where :attr:`margin` is higher (:func:`~gradsync.compress.auto.margin_for`):
        #: :data:`~gradsync.compress.auto.CAST_MARGIN`; the optimizer raises it to :data:`MARGIN` (never cleared)
        #: where its partition search, which prices the overlap with backward a group's first price leaves out, put
        #: no codec :data:`TRY_GAIN` ahead for the whole step
        self.cast_margin = CAST_MARGIN
        #: how much quicker than the backend's allreduce a way of sending a group on gradsync's communication thread
        #: (the runtime's planned exchange, a codec whose exchange runs there) must measure to be kept:
        #: :data:`TRY_GAIN`, as its own time leaves out what that thread takes from backward; the optimizer lowers it
        #: to 1 where its check against DDP's buckets sent uncompressed follows (whole steps that catch a threaded
        #: way losing), so a lead the bar would refuse is decided on whole steps instead
        self.threaded_gain = TRY_GAIN
        self.clock = clock
        self.signature = signature
        #: what launches its groups (:meth:`bind`): ``"optimizer"`` (merged groups), ``"hook"`` (DDP's buckets), None
        #: (a caller of its own); part of the cache key
        self.path: str | None = None
        #: what launches the groups (:meth:`bind`), held weakly
        self._owner: weakref.ref[Any] | None = None
        self.use_cache = cache and signature is not None
        self._wire = wire
        self._codec_cost = codec_cost
        #: the points the codec profile was measured at (None: given by the caller, or not profiled yet)
        self._ladder: tuple[int, ...] | None = None
        self._steps: dict[str, CompressionStep] = {"none": CompressionStep("none", runtime=runtime)}
        #: tensor name -> the codecs with error feedback that sent it and may still owe it (confirmed lazily:
        #: :meth:`_owed_by`), so a launch looks up its own names, not every codec's state
        self._owing: dict[str, set[str]] = {}
        #: one training step spans every codec's step: its verdict rolls back all of their states together
        self.boundary = StepBoundary()
        self._groups: dict[str, _Group] = {}
        self._this_step: list[_Launch] = []
        #: whether some whole step ran "none" everywhere; the whole-step check's steps (each from its first launch
        #: to the later of its last exchange's end and the step's close) with "none" everywhere and with the
        #: settled choices; whether the settled choices passed the step check
        self._none_ran = False
        #: whole steps that ran "none" everywhere before the choices settled (the groups' probes, the job's first
        #: step left out): a settled step far quicker than all of them ends the check at once (:func:`steps_apart`)
        self._early_none_steps: list[float] = []
        self._baseline_steps: list[float] = []
        self._settled_steps: list[float] = []
        #: the whole-step check's first part, where groups lost a way on a close call (:attr:`_Group.close`): the
        #: ways put back (group -> codec or PLANNED; None until the choices settle), and whole steps with the settled
        #: choices and with those ways put back (the part is under way until :meth:`_take_turns` ends it)
        self._restore: dict[str, str] | None = None
        self._dropped_steps: list[float] = []
        self._restored_steps: list[float] = []
        #: the job's answer, at each count of steps a side, whether a whole-step comparison (RESTORE_PART, NONE_PART)
        #: was over (``"<part>/<count>"``): one that was takes no more steps, so its count stays where it ended
        self._turns_decided: dict[str, bool] = {}
        #: what each group runs on the coming step in place of its choice (a turn of the whole-step check: "none"
        #: everywhere, or the ways lost on close calls put back; empty: the choices)
        self._turn: dict[str, str] = {}
        #: steps ended so far; the clock when this step's last exchange ended, and when the step was closed
        self._ended = 0
        self._done_at = -math.inf
        self._closed_at: float | None = None
        #: seconds spent in job-wide decisions since the last end_step (not the step's own time)
        self._deciding_s = 0.0
        self.verified = False
        #: timing callbacks given up on after RECORD_WAIT_S (a stalled exchange; its time is left out)
        self.record_timeouts = 0
        #: the groups the last complete step launched (DDP rebuilds its buckets after the first iteration: the
        #: first ones are never seen again)
        self._live: list[str] = []
        self._lock = threading.Lock()
        self._last_done = -math.inf
        #: timing callbacks not waited for yet: (group key, set when its time is recorded)
        self._events: list[tuple[str, threading.Event]] = []
        self._loaded = False
        #: the groups that launch lean (:meth:`settled_launch`): every group's choice settled and checked, each one
        #: stateless and summing the flat buffer as it is; None until the step check is over (set at each end_step)
        self._lean: frozenset[str] | None = None
        #: whether the settled choices came from an earlier job's cache
        self.cached = False
        self.current = "none"
        #: launches of a whole group summed by the backend's own allreduce ("none", or a cast the runtime sums natively)
        self.native_launches = 0
        #: launches that took :meth:`settled_launch` (those on the backend's allreduce are among native_launches)
        self.settled_launches = 0
        #: the partition and codec chosen together (:meth:`plan_partition`, ``merge="auto"``); None before
        self.joint: JointChoice | None = None
        #: the optimizer's check of the choices against DDP's buckets (:meth:`check_buckets`, or an earlier job's
        #: verdict on the cached partition: ``"cached": True``); None before
        self.buckets: dict[str, Any] | None = None
        #: an earlier job's partition and its bucket verdict (:meth:`plan_partition` takes both instead of searching:
        #: the cached choices are its groups')
        self._cached_joint: JointChoice | None = None
        self._cached_buckets: dict[str, Any] | None = None
        # Which AutoCompression of this process this is: part of every job-wide decision's key, so a second one
        # with the same group names (a rebuilt model) never reads the first one's decisions. Every rank builds
        # them in the same order (SPMD), so the serials agree.
        self._serial = next(_SERIALS)

    def bind(self, path: str, owner: object | None = None) -> None:
        """Say what launches this instance's groups (``"optimizer"``, ``"hook"``), once, before its first launch.
        The two cache different things for the same parameters (merged groups and their partition, DDP's buckets),
        so the path is part of the cache key: a hook job on a model never overwrites what an optimizer job on it
        cached, nor reads it.

        ``owner``: the object that launches them (a :class:`DistributedOptimizer`, a hook's state). One instance
        serves one: its groups, its step bookkeeping and its whole-step checks are one training loop's, and a
        second owner's launches would be taken for the first's next step. A second owner is refused while the first
        is alive."""
        if self.path != path:
            if self.path is not None:
                raise CompressionError(f"this AutoCompression already chooses for the {self.path!r} path; give the "
                                       f"{path!r} path an AutoCompression of its own (their groups and caches differ)")
            if self._loaded:
                raise CompressionError(f"bind({path!r}) comes after this AutoCompression's first launch read its "
                                       "cache; bind it before training")
        if owner is not None:
            held = self._owner() if self._owner is not None else None
            if held is not None and held is not owner:
                raise CompressionError(
                    f"this AutoCompression already chooses for a {type(held).__name__}; give this "
                    f"{type(owner).__name__} an AutoCompression of its own (compression='auto', or a new "
                    "AutoCompression(...)): one instance's groups, steps and checks are one training loop's")
            self._owner = weakref.ref(owner)
        self.path = path

    # ---- the runtime --------------------------------------------------------------------------------------
    @property
    def base(self) -> CompressionStep:
        """The ``"none"`` step: its communicator finds the runtime (at once or at the first bucket)."""
        return self._steps["none"]

    @property
    def runtime(self) -> Runtime:
        return self.base.communicator.runtime

    @property
    def wire(self) -> WireModel:
        if self._wire is None:
            self._wire = wire_of(self.runtime)
        return self._wire

    def _step(self, codec: str) -> CompressionStep:
        step = self._steps.get(codec)
        if step is None:
            step = self._steps[codec] = CompressionStep(CODECS.get(codec).create(), runtime=self.runtime)
        return step

    def _owed_by(self, name: str, besides: str | None = None) -> list[str]:
        """The codecs other than ``besides`` whose error feedback owes ``name`` a part of its gradient; a codec found
        owing nothing (its debt repaid, the step finite) is forgotten."""
        codecs = self._owing.get(name)
        if not codecs:
            return []
        owing = []
        for codec in sorted(codecs):
            if codec == besides:
                continue
            if self._steps[codec].memory.owed(name) is None:
                codecs.discard(codec)
            else:
                owing.append(codec)
        if not codecs:
            del self._owing[name]
        return owing

    def _owes(self, names: Iterable[str]) -> bool:
        """Whether some codec's error feedback owes one of ``names`` a part of its gradient."""
        return bool(self._owing) and any(self._owed_by(name) for name in names)

    def _repay(self, tensors: Sequence[Tensor], infos: Sequence[TensorInfo], way: str, verdict: StepVerdict, *,
               in_place: bool, scale: float = 1.0) -> list[Tensor]:
        """``tensors`` plus what the error feedback of codecs other than ``way`` (this launch's) still owes them (times
        ``scale``, where the caller scaled them already), each such codec forgetting its debt with ``verdict``: the
        part a codec held back of a group's gradients is sent by whichever way the group's launch runs, none of it lost
        when auto drops the codec, and none of it stale when auto puts the codec back. ``in_place``: the tensors are
        the caller's to overwrite (views of the buffer the group is averaged in)."""
        out = list(tensors)
        own = "none" if way == PLANNED else way
        for j, info in enumerate(infos):
            for codec in self._owed_by(info.name, besides=own):
                memory = self._steps[codec].memory
                debt = memory.owed(info.name)
                if debt is None:
                    continue
                if debt.numel() != out[j].numel():  # another layout under the name: no place to put it, so the
                    self._owing[info.name].discard(codec)  # codec keeps it for its own next launch of the name
                    continue
                debt = debt.reshape(out[j].shape).to(out[j].dtype)
                out[j] = out[j].add_(debt, alpha=scale) if in_place else torch.add(out[j], debt, alpha=scale)
                memory.release(info.name)
                memory.commit(info, verdict)
        return out

    def anticipate(self, nbytes: Sequence[int], dtype: torch.dtype, *, first: bool = False) -> None:
        """Have the runtime price ahead the allreduce payloads groups of ``nbytes`` may send under the policy (each
        allowed cast's, then ``"none"``'s: :func:`~gradsync.compress.auto.dense_payloads`), so that a trial's first
        launch finds its size priced (:meth:`Runtime.anticipate <gradsync.comm.runtime.Runtime.anticipate>`);
        ``first``: before those anticipated earlier (a group about to launch)."""
        sizes = dense_payloads(nbytes, dtype, allowed(self.allow, dtype))
        if sizes:
            self.runtime.anticipate(sizes, first=first)

    def calibration_wire(self, nbytes: Sequence[int], dtype: torch.dtype) -> torch.dtype | None:
        """The dtype the optimizer's first calibration step sends DDP's buckets (of ``nbytes``) in, the same on every
        rank: a cast the policy allows where the wire model puts it :data:`~gradsync.compress.auto.CAST_MARGIN` times
        ahead of sending them uncompressed (:func:`~gradsync.compress.auto.calibration_cast`), else None (as they
        are). That step is not timed; on a slow wire sent uncompressed it took DDP's pace, all of it choosing's cost."""
        def compute() -> bytes:
            got = calibration_cast(nbytes, dtype, allowed(self.allow, dtype), self.wire, self.runtime.world_size)
            return b"" if got is None else got.name.encode()

        name = self._decide(f"calibration-wire/{len(nbytes)}", compute).decode()
        return None if not name else CODECS.get(name).cast_to

    def anticipate_model(self, params: Sequence[Tensor]) -> None:
        """Have the runtime price ahead what the groups a partition of ``params`` (the trainable ones, one dtype) may
        send, before it is chosen: every size class of a run of them down to :data:`AHEAD_FLOOR_BYTES`, largest first
        (:func:`~gradsync.compress.auto.run_classes`), as each allowed cast's payload. The uncompressed classes only
        where no cast is allowed: a cast is what a slow wire tries first, and the speculative classes cost the child's
        core for seconds each (on the two-tier testbed, 32 MiB took 2.5-4 s)."""
        if not params:
            return
        dtype = params[0].dtype
        classes = run_classes([p.numel() * p.element_size() for p in params], AHEAD_FLOOR_BYTES)
        options = allowed(self.allow, dtype)
        sizes = dense_payloads(classes, dtype, options, none=False) or dense_payloads(classes, dtype, options)
        if sizes:
            self.runtime.anticipate(sizes)

    def _current_groups(self) -> list[str]:
        return [k for k in self._live if k in self._groups] or list(self._groups)

    @property
    def choices(self) -> dict[str, AutoChoice]:
        """The choice per group in use (settled or on trial)."""
        return {k: c for k in self._current_groups() if (c := self._groups[k].choice) is not None}

    @property
    def settled(self) -> bool:
        """Whether every group in use (those of the last complete step) has a final choice."""
        keys = self._current_groups()
        return bool(keys) and all(self._groups[k].final for k in keys)

    @property
    def runs_ddp_buckets(self) -> bool:
        """Whether the optimizer's check (this job's, or an earlier one's on the same partition) put DDP's buckets,
        sent uncompressed, in place of the choices."""
        return self.buckets is not None and not self.buckets["kept"]

    @property
    def trials(self) -> dict[str, list[str]]:
        """The codecs each group timed, in order (:data:`PLANNED`: its "none" on the runtime's planned exchange)."""
        return {k: list(g.trials) for k, g in self._groups.items()}

    @property
    def trial_times(self) -> dict[str, dict[str, list[float]]]:
        """Each group's timed launches per codec it tried, in seconds (what its choice was made on)."""
        return {k: {c: list(t) for c, t in g.times.items()} for k, g in self._groups.items()}

    @property
    def runs_backend_none(self) -> bool:
        """Whether every group in use runs ``"none"`` on the backend's allreduce (not the planned exchange): DDP's own
        exchange of those groups."""
        keys = self._current_groups()
        return all((c := self._groups[k].choice) is not None and c.codec == "none" and not self._groups[k].planned
                   for k in keys)

    # ---- one launch ----------------------------------------------------------------------------------------
    def step_async(self, tensors: Sequence[Tensor], infos: Sequence[TensorInfo], *, reuse: bool = False,
                   key: str | None = None, flat: Tensor | None = None) -> Work:
        """Run the group's codec (see the module doc) on ``tensors``; the work's result is their aggregates.

        ``flat``: one contiguous buffer that ``tensors`` are views of, in order (a DDP bucket). A ``"none"``
        launch then averages it in place with the backend's own allreduce, as DDP does without a hook, where
        the runtime runs that size natively (the work's result is ``[flat]``): "none" is DDP itself, not
        gradsync's per-tensor exchange.
        """
        if not infos:
            raise CompressionError("step_async needs at least one tensor and its TensorInfo")
        self._load_once()
        self._lean = None  # a group outside the lean set launched (a new one, a planned size): look again at end_step
        key = key or (infos[0].name if len(infos) == 1 else f"{infos[0].name}..{infos[-1].name}")
        if any(launch.key == key for launch in self._this_step):
            self.end_step()
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(GroupSpec(key, tuple(i.shape for i in infos), infos[0].dtype),
                                               tuple(i.name for i in infos))
            self.anticipate([group.spec.nbytes], group.spec.dtype, first=True)
        codec, sink = self._codec_for(group)  # choosing (rank 0 profiles, every rank waits) is not the codec's time
        # a launch timed while the runtime settles its exchange goes to the trial's rough times instead
        rough = group.unsettled.setdefault(group.trials[-1], []) if sink is not None else None
        settling = self.runtime.settling
        t0 = self.clock()
        self._this_step.append(_Launch(key, t0, codec, sink is None and group.final, self._deciding_s))
        group.launches += 1
        self.current = codec
        verdict = self.boundary.verdict_for([key])
        if self._owing:
            tensors = self._repay(tensors, infos, codec, verdict, in_place=flat is not None or reuse)
        work = None
        if flat is not None and codec == "none":
            # scaled before the sum, as DDP scales its bucket: the same bits as DDP's step on any number of ranks
            scale = self.plain_scale(flat.device)
            if scale is not None:
                flat.mul_(scale)
            work = self._native(flat, key, verdict, scaled=scale is not None)
        elif flat is not None and codec == PLANNED:
            work = self._planned(flat, key, verdict)  # what the group runs lean if it keeps this way
        elif flat is not None and (wire := self._step(codec).cast_dtype) is not None:
            # a fixed fp16 hook's path: the same bits, less host time
            work = self._native(flat, key, verdict, wire, always=self._casts_natively(group, wire))
        native = work is not None and codec != PLANNED
        if codec == "none":
            group.native = native
        elif codec != PLANNED and not native:
            group.threaded.add(codec)
        if work is None:
            step = self._step("none" if codec == PLANNED else codec)
            work = step.step_async(tensors, infos, reuse=reuse, verdict=verdict)
            if type(step.memory).owed is not Memory.owed:
                # error feedback: what it did not send it owes, and the group's next launch of another way repays it
                for info in infos:
                    self._owing.setdefault(info.name, set()).add(codec)
        t1 = self.clock()
        event = threading.Event()

        def record(_: Any) -> None:
            now = self.clock()
            with self._lock:
                self._done_at = max(self._done_at, now)
                if native:
                    # the process group runs buckets side by side (gloo's worker threads): timed from its own
                    # launch, as from the previous bucket's end it would look shorter than it is (docs/mergecomp.md)
                    start = t1
                else:  # gradsync's exchanges queue on one thread: their service time
                    start = max(t1, self._last_done)
                    self._last_done = now
            if sink is not None and rough is not None:
                # the runtime planned or explored meanwhile: a rough time, used only if no other comes
                (sink if self.runtime.settling == settling else rough).append((t1 - t0) + max(0.0, now - start))
            event.set()

        self._events.append((key, event))
        work.future.add_done_callback(record)
        return work

    def needs_flat(self, key: str) -> bool:
        """Whether the group ``key``'s next launch may sum its flat buffer (the optimizer's merged group's): while it
        is chosen or checked, on ``"none"`` (the backend's or the planned exchange), or on a cast the backend sums.
        False once it settled on a codec that encodes each member as it is: the optimizer then hands over the gradients
        themselves (:meth:`step_async` without ``flat``), and their aggregates come back in them, with no copy into the
        group's buffer and none back into ``.grad`` (on the MLP's 25 MB, 16.1 against 7.7 ms a step on one core:
        docs/mergecomp.md). The same on every rank: the choices and the runtime's plans are."""
        group = self._groups.get(key)
        if group is None or not group.final or key in self._turn:
            return True
        codec = group.priced().codec
        return codec == "none" or self._backend_casts(group, codec)

    def _backend_casts(self, group: _Group, codec: str) -> bool:
        """Whether ``codec`` is a cast that ``group`` sends as its whole buffer on the backend's allreduce (where it was
        timed there, or where the runtime runs the cast's payload natively): a launch that needs the group's flat
        buffer, and one that may run lean (:meth:`_lean_groups`)."""
        wire = self._step(codec).cast_dtype
        return wire is not None and (self._casts_natively(group, wire)
                                     or self.runtime.runs_natively(group.spec.numel * wire.itemsize))

    def _native(self, flat: Tensor, key: str, verdict: StepVerdict | None, wire: torch.dtype | None = None,
                scaled: bool = False, deferred: bool = False, always: bool = False) -> Work | None:
        """``flat`` averaged in place by the process group's own async allreduce, whatever the runtime plans for
        its size (None where the backend cannot take it: no process group, another device). The sum is the same
        bits on every rank, so whether it is finite is the job's verdict on this group: with ``verdict``, it joins the
        step's, as every codec's exchange does (:func:`~gradsync.compress.base.all_finite`); None: not checked (a
        plain launch, :meth:`plain_launch`).

        ``wire``: a cast codec's dtype (fp16, bf16): ``flat`` is cast, summed in that dtype and cast back, as a
        fixed fp16 hook does -- where the runtime runs that size natively (None where it plans it: the codec's
        own step then runs on the planned exchange, as the fixed codec would; ``always``: on the backend's whatever the
        runtime plans, :meth:`_casts_natively`). ``scaled``: ``flat`` was scaled by
        1/world already (:meth:`plain_scale`), the sum is the average. ``deferred``: the average and the verdict
        are the work's ``finish``, done by its ``wait()`` on the caller's thread (:meth:`_finisher`), for a caller
        that waits for the work itself; else chained on its future, for one that hands the future on (a DDP hook)."""
        fut = self._backend_sum(flat, wire, always=always)
        if fut is None:
            if scaled:
                raise CompressionError(f"group {key!r} was scaled for the backend's allreduce, which refused it "
                                       "after it said it takes it (a non-contiguous buffer, or the runtime failed "
                                       "meanwhile)")
            return None
        self.native_launches += 1
        return self._work(fut, flat, verdict, f"auto:{key}:native", world=1 if scaled else None, deferred=deferred)

    def _planned(self, flat: Tensor, key: str, verdict: StepVerdict) -> Work:
        """``flat`` averaged in place by the runtime's planned exchange as one job (what :meth:`settled_launch` runs
        for a group kept on it), its finite verdict joining the step's: the ``"none/planned"`` trial times the way the
        group would run, not the ``"none"`` step's per-tensor payloads around it. Queued on the communication thread
        and timed as its other exchanges are. It runs the runtime's pick for the size as it stands (``explore=False``),
        not the explorer of its pipeline depths: exploring takes a few dozen launches, one candidate a launch, and the
        trial would time that, not the plan; a group kept on the planned way lets the runtime explore on its later
        launches, as any job's planned allreduce does."""
        return self._work(self.runtime.allreduce_async(flat, "sum", explore=False).future, flat, verdict,
                          f"auto:{key}:planned", world=None, deferred=False)

    def _work(self, fut: torch.futures.Future, flat: Tensor, verdict: StepVerdict | None, name: str, *,
              world: int | None, deferred: bool) -> Work:
        """The work of the sum of ``flat`` (``fut``: the backend's, or the planned exchange's), its result ``[flat]``
        averaged (:meth:`_finisher`): finished by its ``wait()`` where ``deferred``, else by callbacks chained on
        ``fut``."""
        finish = self._finisher(flat, verdict, world)
        if deferred:
            return Work(fut, name, finish=lambda value: [finish(value)])
        return Work(fut.then(lambda f: [finish(f.value())]), name)

    def _backend_sum(self, flat: Tensor, wire: torch.dtype | None, *, always: bool = False,
                     finish: Callable[[Any], Tensor] | None = None) -> torch.futures.Future | None:
        """``flat`` summed in place by the process group's own allreduce (in ``wire`` and cast back, for a cast
        codec, where the runtime runs that size natively or ``always``); None where the backend cannot take it.
        ``finish``: what follows the sum (:meth:`_finisher`), the future's value then its result: for a cast, in
        the callback that casts back (one future, not two)."""
        if wire is None:
            fut = self.runtime.native_allreduce_async(flat, always=True)
            return None if fut is None else _chained(fut, finish)
        return native_cast_sum_async(self.runtime, flat, wire, always=always, finish=finish)

    def _casts_natively(self, group: _Group, wire: torch.dtype) -> bool:
        """Whether a cast of ``group`` to ``wire`` goes to the backend's allreduce whatever the runtime runs for the
        cast's payload size now: where the group's "none" runs there (it measured no planned exchange quicker, or the
        runtime runs the group's size natively), or, before "none" was timed (a cast far ahead on the model), where
        the runtime's pick for the payload is the backend's (:meth:`Runtime.picks_native
        <gradsync.comm.runtime.Runtime.picks_native>`, while an explorer may still time a plan against it). The
        cast's trial then times the codec, not a payload size the runtime has never sent, whose plans it would
        explore one call a launch for a few dozen launches first; and a plan's edge over the backend's ring is in
        bandwidth, which a cast halves. Where the group's "none" is the planned exchange, the cast goes where the
        runtime plans its size, as a fixed cast would. The same on every rank: the flags and the pick are."""
        if group.planned:
            return False
        return group.native or self.runtime.picks_native(group.spec.numel * wire.itemsize)

    def lean_scale(self, key: str, device: torch.device) -> float | None:
        """The factor a caller may scale ``key``'s gradients (on ``device``) by while it copies them into the group's
        buffer, for :meth:`settled_launch` with ``scaled=True``: ``1 / world`` where the group launches lean on
        ``"none"`` (a float sum, the backend's or the planned exchange's, takes it), so the average costs no pass of
        its own -- DDP's fused copy-and-divide into its bucket; None otherwise (a cast rounds the scaled values, and
        off the lean path the codec averages; and on one rank, where the sum is the average)."""
        lean = self._lean
        if lean is None or key not in lean or self._groups[key].priced().codec != "none":
            return None
        return self.plain_scale(device)

    def settled_launch(self, flat: Tensor, key: str, *, verdict: bool = True,
                       scaled: bool = False) -> torch.futures.Future | None:
        """A settled group's launch at the cost of a plain allreduce hook: ``flat`` averaged in place by the backend's
        own allreduce (cast to and from the wire dtype for a cast codec), or by the runtime's planned exchange where
        the group's "none" measured quicker on it (:class:`~gradsync.train.hooks.GradsyncHookState`'s hook), the
        future's value ``flat``. Only once every group's choice is settled, checked and stateless ("none", or a cast
        the runtime sums natively) and nothing is measured any more; None otherwise (the caller takes
        :meth:`step_async`), the same on every rank.

        ``verdict``: whether a cast's finite verdict joins the step's, as on the slow path (the optimizer skips a
        non-finite step; a group on "none" is not checked: :meth:`_lean_verdict`). A DDP hook passes False: with no
        codec state in the job there is nothing to roll back, and a NaN reaches the aggregate by the sum itself, as
        on the fixed fp16 hook's native path. The timing
        callbacks, the job-wide decisions and the step bookkeeping of :meth:`step_async` are skipped: on a GPU
        their host time is most of a bucket's (``gradsync bench gpu``'s hook step times, docs/mergecomp.md).

        ``scaled``: the caller already scaled ``flat`` by :meth:`lean_scale` (asked of this group, not None): the sum
        is the average, and only its verdict is taken."""
        if not verdict:  # the average follows the sum in one callback (nothing to reserve before the launch)
            return self._settled_sum(flat, key, scaled, finish=self._finisher(flat, None, 1 if scaled else None))
        fut = self._settled_sum(flat, key, scaled)
        if fut is None:
            return None
        return _chained(fut, self._finisher(flat, self._lean_verdict(key), 1 if scaled else None))

    def settled_work(self, flat: Tensor, key: str, *, scaled: bool = False) -> Work | None:
        """:meth:`settled_launch` (a cast's verdict joining the step's) for a caller that waits for the work itself (the
        optimizer's groups): the average and the verdict are done by the work's ``wait()`` on the caller's thread,
        not by callbacks on the backend's thread, each of which first takes the GIL from the caller (two per launch
        cost a small model's step more than its allreduce: docs/mergecomp.md). The result is ``[flat]``."""
        fut = self._settled_sum(flat, key, scaled)
        if fut is None:
            return None
        return self._work(fut, flat, self._lean_verdict(key), f"auto:{key}:settled", world=1 if scaled else None,
                          deferred=True)

    def _lean_verdict(self, key: str) -> StepVerdict | None:
        """The step's verdict for a lean launch of ``key`` where its choice is a cast (fp16's range ends where the
        gradient's does not: an overflow on the wire is compression's to catch); None where it is "none". A group sent
        as it is keeps no state to roll back and can turn nothing finite into a NaN, so its step is not checked, as
        ``compression=None``'s and DDP's are not: the check is a pass over the group's sum on the step's critical
        path, what would keep a settled "none" slower than not compressing (docs/mergecomp.md)."""
        return None if self._groups[key].priced().codec == "none" else self.boundary.verdict_for([key])

    def _settled_sum(self, flat: Tensor, key: str, scaled: bool,
                     finish: Callable[[Any], Tensor] | None = None) -> torch.futures.Future | None:
        """The sum of a lean group's ``flat`` (:meth:`settled_launch`): the backend's, or the runtime's planned
        exchange's where the group's "none" measured quicker on it; None where the group is not lean or the backend
        refused the buffer. ``finish``: what follows the sum, in the same callback (:meth:`_backend_sum`)."""
        lean = self._lean
        if lean is None or key not in lean:
            return None
        group = self._groups[key]
        codec = group.priced().codec
        if scaled and codec != "none":
            raise CompressionError(f"group {key!r} runs {codec!r}: only a lean 'none' group is scaled before its sum "
                                   "(ask lean_scale first)")
        if codec == "none" and group.planned:  # the flat buffer on the planned exchange: one job, no per-tensor step
            self.settled_launches += 1
            return _chained(self.runtime.allreduce_async(flat, "sum").future, finish)
        wire = None if codec == "none" else self._step(codec).cast_dtype
        fut = self._backend_sum(flat, wire, always=wire is not None and self._casts_natively(group, wire),
                                finish=finish)
        if fut is None:  # nothing joined the step: the caller's step_async opens its verdict
            if scaled:  # lean_scale said the backend takes it
                raise CompressionError(f"group {key!r} was scaled for the backend's allreduce, which refused it "
                                       "after it said it takes it (a non-contiguous buffer, or the runtime failed "
                                       "meanwhile)")
            return None
        self.native_launches += 1
        self.settled_launches += 1
        return fut

    def plain_scale(self, device: torch.device) -> float | None:
        """:meth:`lean_scale` for :meth:`plain_launch`: ``1 / world`` where the backend's allreduce takes a buffer on
        ``device``, None where the ``"none"`` step's exchange would run it (and average it itself) and on one rank
        (the sum is the average: nothing to scale)."""
        world = self.runtime.world_size
        return 1.0 / world if world > 1 and self.runtime.takes_native(device) else None

    def plain_launch(self, flat: Tensor, info: TensorInfo, *, scaled: bool = False, tensors: Sequence[Tensor] = (),
                     infos: Sequence[TensorInfo] = (), wire: torch.dtype | None = None) -> Work:
        """``flat`` (one group, named by ``info``) averaged uncompressed, outside every choice: for groups that are
        not the job's, as the optimizer's calibration steps run a partition that is thrown away after them (and
        DDP's buckets, where they measured quicker than the job's: :meth:`check_buckets`). Nothing is recorded,
        timed or decided for it (a group seen there and priced, timed and profiled for like the job's own cost
        each of those steps several times a plain one). The backend's own allreduce where it can take ``flat``, its
        sum not checked for a NaN or inf (uncompressed, as ``compression=None`` and DDP send it: :meth:`_lean_verdict`);
        else the ``"none"`` step's exchange, whose marks join the step's verdict as every codec's do. ``scaled``:
        ``flat`` was scaled by :meth:`plain_scale` (not None) as it was copied in. ``tensors``, ``infos``: the
        tensors ``flat`` holds, as views of it, and their records (none: ``flat`` is ``info``'s tensor itself), which
        codecs' error feedback may still owe (:meth:`_repay`: the job's groups' codecs, where DDP's buckets took their
        place). ``wire``: a cast dtype (:meth:`calibration_wire`): summed in it on the backend's allreduce, its sum
        checked for a NaN or inf as a cast codec's is (a cast may overflow where the float sum would not)."""
        verdict = None
        infos = tuple(infos) or (info,)
        if self._owes(i.name for i in infos):
            verdict = self.boundary.verdict_for([info.name])
            self._repay(list(tensors) or [flat], infos, "none", verdict, in_place=True,
                        scale=1.0 / self.runtime.world_size if scaled else 1.0)
        if wire is not None:
            verdict = verdict or self.boundary.verdict_for([info.name])
            native = self._native(flat, info.name, verdict, wire=wire, scaled=scaled, deferred=True, always=True)
        else:
            native = self._native(flat, info.name, None, scaled=scaled, deferred=True)
        if native is not None:
            return native
        if verdict is None:
            verdict = self.boundary.verdict_for([info.name])
        return self.base.step_async([flat], [info], reuse=True, verdict=verdict)

    def calibration_stands(self, settled: int) -> bool:
        """Whether the optimizer's timed calibration step may stand for DDP's buckets in :meth:`check_buckets`: only
        where the runtime settled nothing during it (``settled``: how much :attr:`Runtime.settling
        <gradsync.comm.runtime.Runtime.settling>` grew; rank 0's count decides for every rank). A step in which the
        buckets' sizes were priced or their pipeline depths explored ran slower than the buckets will, and chosen
        steps held against it would be flattered (docs/mergecomp.md)."""
        return self._decide_flag("calibration-stands", lambda: settled == 0)

    def turn_stands(self, settled: int, turn: int) -> bool:
        """Whether the optimizer's ``turn``-th whole step of :meth:`check_buckets` counts: only where the runtime settled
        nothing during it (``settled``: how much :attr:`Runtime.settling <gradsync.comm.runtime.Runtime.settling>`
        grew; rank 0's count decides for every rank), as for the calibration step (:meth:`calibration_stands`). A
        step in which a size was priced or its depths explored ran slower than its side will, and would be held
        against the other side's settled ones; the optimizer runs the same side again instead."""
        return self._decide_flag(f"bucket-turn/{turn}", lambda: settled == 0)

    def check_buckets(self, chosen_s: Sequence[float], buckets_s: Sequence[float], buckets: Sequence[int], *,
                      final: bool = True, calibration_s: float | None = None) -> bool | None:
        """The optimizer's last check, once the choices are settled (``merge="auto"``): whole steps with the chosen
        partition and codecs (``chosen_s``) against steps with DDP's buckets (of ``buckets`` bytes) sent uncompressed
        on the backend's allreduce (``buckets_s``), what DDP itself runs. Whether the choice stays: on a clear gap
        either way (:func:`~gradsync.compress.auto.steps_apart`, as many steps as there are a side), the quicker
        side; else, at the ``final`` count, its median must be quicker than the buckets' (a tie goes to DDP's
        buckets, which cost no accuracy and no choosing), and before it None: time another pair. Rank 0's samples
        decide for every rank; :attr:`buckets` keeps the verdict for :meth:`table` and :meth:`report`.

        Before any step of DDP's buckets (``buckets_s`` empty), ``calibration_s`` stands for them: the optimizer's
        timed calibration step, which ran those buckets uncompressed. The choices stay without timing the buckets
        where each chosen step took at most ``1 / CALIBRATION_GAIN`` of it
        (:data:`~gradsync.compress.auto.CALIBRATION_GAIN`: a step alone, before the codecs, is held to more than the
        check's own ``TRY_GAIN``); else None: time the buckets (on a slow wire each of their steps costs most of a
        step more). :attr:`buckets` keeps ``calibration_s`` whenever it is given."""
        if not chosen_s or not (buckets_s or calibration_s is not None):
            raise CompressionError(f"the bucket check needs steps on both sides, got {list(chosen_s)} and "
                                   f"{list(buckets_s)} (calibration step: {calibration_s})")
        least = min(len(chosen_s), len(buckets_s))

        def verdict() -> bytes:
            if not buckets_s:
                return b"1" if steps_apart(chosen_s, [calibration_s], least=1, gain=CALIBRATION_GAIN) else b""
            if steps_apart(chosen_s, buckets_s, least=least):
                return b"1"
            if steps_apart(buckets_s, chosen_s, least=least):
                return b"0"
            if not final:
                return b""
            return b"1" if float(np.median(chosen_s)) < float(np.median(buckets_s)) else b"0"

        got = self._decide(f"bucket-check/{len(chosen_s)}/{len(buckets_s)}", verdict)
        if not got:
            return None
        keep = got == b"1"
        self.buckets = {"kept": keep, "chosen_s": list(chosen_s), "buckets_s": list(buckets_s),
                        "bytes": [int(b) for b in buckets]}
        if calibration_s is not None:
            self.buckets["calibration_s"] = float(calibration_s)
        self._write_cache()  # the next job with this partition starts with the verdict
        return keep

    def _finisher(self, flat: Tensor, verdict: StepVerdict | None, world: int | None = None) -> Callable[[Any], Tensor]:
        """What follows the sum of ``flat`` (the backend's or the planned exchange's), given its result: with
        ``verdict`` (its slot reserved now, in launch order), whether the sum is finite joins that step's -- the same
        bits on every rank, so the same verdict --; then ``flat`` is averaged in place and returned. ``world``: what
        to divide by (default the runtime's world size; 1 where the terms were scaled before the sum)."""
        world = self.runtime.world_size if world is None else world
        slot = verdict.reserve() if verdict is not None else -1

        def finish(_: Any) -> Tensor:
            if verdict is not None:
                verdict.fill(slot, Verdicts(all_finite(flat)))
            return average_in_place(flat, world) if world > 1 else flat

        return finish

    def _lean_groups(self) -> frozenset[str] | None:
        """The groups :meth:`settled_launch` may take: all of them once the step check is over and every choice is
        stateless and sums the group's flat buffer as it is ("none", on the backend's allreduce or the runtime's
        planned exchange, or a memoryless cast on the backend's) and no codec's error feedback still owes them (their
        launches through :meth:`step_async` send it); else None."""
        if not self.verified or not self.settled or self._turn:
            return None
        keys = self._current_groups()
        for key in keys:
            group = self._groups[key]
            codec = group.priced().codec
            if codec != "none" and not self._backend_casts(group, codec):  # a cast takes the backend's allreduce
                return None
        if self._owes(n for key in keys for n in self._groups[key].names):
            return None  # a codec's debt goes out with a launch of step_async (a step that repaid it was rolled back)
        return frozenset(keys)

    def close_step(self) -> None:
        """No exchange joins the training step any more (:meth:`CompressionStep.close_step`, for every codec)."""
        if self._closed_at is None and self._this_step:
            self._closed_at = self.clock()
        self.boundary.close()

    @property
    def step_check(self) -> dict[str, Any]:
        """The whole-step check's samples (seconds per step): the uncompressed baseline, the settled steps, the probes'
        "none" steps before the choices settled; the ways put back where groups lost them on a close call, with the
        steps that ran the settled choices and those that ran the ways back; and whether the check is over."""
        return {"baseline_s": list(self._baseline_steps), "settled_s": list(self._settled_steps),
                "early_none_s": list(self._early_none_steps), "restore": dict(self._restore or {}),
                "dropped_s": list(self._dropped_steps), "restored_s": list(self._restored_steps),
                "verified": self.verified}

    @property
    def nonfinite_steps(self) -> int:
        """Closed training steps with a NaN or inf in some group on some worker, whichever codecs they ran."""
        return self.boundary.nonfinite_steps

    def end_step(self) -> None:
        """Backward is over (the optimizer's ``step()``; the hook infers it from a group launching again): each
        group's slack is the time from its launch to the last launch, less the job-wide decisions between them (a
        later group's choosing holds backward's thread, not backward), and a group keeps the least it has seen: an
        exchange on gradsync's thread slows the rest of backward (the GIL, the cores), and a slack that long would
        hide a wire-bound group behind backward, so it would never be compressed. The step's timing callbacks are
        waited for (bounded): one that ran late would otherwise charge the next step's launches to this step's
        times.

        The step's whole time, for the step check, runs from its first launch to the later of its last exchange's
        end and its close (the optimizer's wait, DDP's last bucket): what a codec can change (its encoding slowing
        the rest of backward, its exchange), and nothing of what the job does between steps (a data loader, a
        log line, another model's step) that would only add noise."""
        self.close_step()
        self._wait_records()
        closed, self._closed_at = self._closed_at, None
        with self._lock:
            done, self._done_at = self._done_at, -math.inf
        if not self._this_step:
            return
        launches, self._this_step = self._this_step, []
        self._live = [launch.key for launch in launches]
        last = max(launches, key=lambda launch: launch.t0)
        for launch in launches:
            group = self._groups[launch.key]
            slack = max(0.0, last.t0 - launch.t0 - (last.decided_s - launch.decided_s))
            group.slack_s = slack if group.slack_s is None else min(group.slack_s, slack)
        deciding, self._deciding_s = self._deciding_s, 0.0
        self._ended += 1
        if self._ended > 1 and not self.verified:  # the job's first step warms up
            span = max(done, closed if closed is not None else -math.inf) - min(launch.t0 for launch in launches)
            self._check_step(max(0.0, span - deciding), launches)
            self._deciding_s = 0.0  # what the check decided here, between steps, is in no step's span
        self._lean = self._lean_groups()

    def _check_step(self, seconds: float, launches: list[_Launch]) -> None:
        """The whole step's check, after the per-group ones: a group's own time leaves out what its codec costs the
        rest of the step (encoding on backward's thread, cores shared with it), and a planned exchange's time on
        the communication thread leaves out what that thread takes from backward. Once every group has settled on
        choices other than DDP's own (a codec, or "none" on the planned exchange), the next steps alternate between
        those choices and "none" on the backend's allreduce everywhere, timed whole (``probe_steps`` a side, more while
        the sides overlap: :meth:`_take_turns`); where
        the choices' median is more than :data:`~gradsync.compress.auto.STEP_TOLERANCE` slower
        (:func:`~gradsync.compress.auto.whole_steps_lose`), every group goes back to that "none" (reason ``"step"``). Both kinds
        run warm and side by side: the job's first "none" steps were still warming up (new sizes planned, first
        calls) and would flatter any choice. Choices where no step ran that "none" everywhere (codecs trusted on a
        wide margin, an earlier job's cached choices) are kept without the check. Nor is "none" timed again where
        the first settled step took less than ``1 / CALIBRATION_GAIN`` of every step that ran "none" everywhere while
        the groups probed it, the job's first left out (:func:`~gradsync.compress.auto.steps_apart`): the groups' own
        timings already put the choices ahead, and on a slow wire those "none" steps are what the check costs. Those
        steps ran before the codecs, still warming up, so they are held to the bar the optimizer's calibration step
        is (:data:`~gradsync.compress.auto.CALIBRATION_GAIN`), not to the check's own ``TRY_GAIN``: a warming step
        alone can read that much slower than the same "none" warm.

        Where groups lost a way on a close call (a codec, the planned exchange), the steps first time the settled
        choices against those ways put back (:meth:`_check_restore`), whether or not a step ran "none" everywhere;
        this check then runs on what that part left."""
        if all(launch.codec == "none" for launch in launches):
            self._none_ran = True
            if not self.settled:
                self._early_none_steps.append(seconds)
        if not self.settled:
            return
        whole = all(launch.final for launch in launches)  # every group ran its settled choice or this turn's
        if self._restore is None:
            self._restore = {key: way for key in self._current_groups()
                             if (way := self._groups[key].restorable()) is not None}
        if self._restore and not self._turns_ended(RESTORE_PART, self._dropped_steps, self._restored_steps):
            self._check_restore(seconds if whole else None)  # the first part is under way
            return
        chosen = {k: c for k, c in self.choices.items() if c.codec != "none" or self._groups[k].planned}
        if not chosen or not self._none_ran:
            self.verified, self._turn = True, {}
            return
        if whole:
            baseline = bool(self._turn)
            (self._baseline_steps if baseline else self._settled_steps).append(seconds)
            if not baseline and len(self._settled_steps) == 1 and self._decide_flag(
                    "step-apart", lambda: steps_apart(self._settled_steps, self._early_none_steps, least=1,
                                                       gain=CALIBRATION_GAIN)):
                self.verified, self._turn = True, {}  # no warm-up or noise explains that gap
                return
        if not self._take_turns(NONE_PART, self._settled_steps, self._baseline_steps,
                                dict.fromkeys(self._current_groups(), "none")):
            return
        self.verified = True

        if self._decide_flag("step-check", lambda: whole_steps_lose(self._settled_steps, self._baseline_steps)):
            for key, c in chosen.items():
                self._groups[key].choice = AutoChoice(c.group, c.nbytes, "none", c.nbytes, c.none_s, c.none_s, "step")
                self._groups[key].planned = False
            self._write_cache()

    def _check_restore(self, seconds: float | None) -> None:
        """The whole-step check's first part, where groups lost a way on a close call (:attr:`_Group.close`: a codec
        its review dropped, the planned exchange not kept): steps alternate between the settled choices and the same
        with those ways put back (``probe_steps`` a side, more while the sides overlap: :meth:`_take_turns`), timed
        whole (``seconds``: the step just ended, None where some group did not run a settled choice); where the
        settled steps' median is more than
        :data:`~gradsync.compress.auto.STEP_TOLERANCE` slower (:func:`~gradsync.compress.auto.whole_steps_lose`),
        the ways come back (reason ``"step"``). A group's own
        time reads what shares the cores with its exchange (backward's hold on them, the other groups' exchanges):
        two ways within ``TRY_GAIN`` of each other there may tie while the whole steps are far apart. Then the part
        is over and from the next step the check against "none" everywhere runs on the choices
        it left."""
        restore = self._restore or {}
        if seconds is not None:
            (self._restored_steps if self._turn else self._dropped_steps).append(seconds)
        if not self._take_turns(RESTORE_PART, self._dropped_steps, self._restored_steps, dict(restore)):
            return
        if not self._decide_flag("restore-check", lambda: whole_steps_lose(self._dropped_steps, self._restored_steps)):
            return
        for key, way in restore.items():
            group = self._groups[key]
            c = group.priced() if way == PLANNED else group.candidates[way]
            group.choice = AutoChoice(c.group, c.nbytes, c.codec, c.payload_bytes, c.predicted_s, c.none_s, "step")
            group.planned = way == PLANNED
        self._write_cache()

    def _take_turns(self, part: str, settled_s: list[float], other_s: list[float], other: dict[str, str]) -> bool:
        """One whole-step comparison's next turn (``part``: which), its steps alternating: ``other`` (what groups run in
        place of their choices) where that side has fewer steps than the settled choices' side, else the choices. True
        once the comparison is over (:func:`~gradsync.compress.auto.turns_over` on rank 0's steps, decided for the
        job each time both sides have as many from ``probe_steps`` on): from then on the choices run."""
        key = f"{part}/{min(len(settled_s), len(other_s))}"
        if key not in self._turns_decided and len(settled_s) == len(other_s) >= self.probe_steps:
            # once per count: a step without a sample asks no second time
            self._turns_decided[key] = self._decide_flag(
                f"turns/{key}", lambda: turns_over(settled_s, other_s, least=self.probe_steps))
        if self._turns_ended(part, settled_s, other_s):
            self._turn = {}
            return True
        self._turn = other if len(other_s) < len(settled_s) else {}
        return False

    def _turns_ended(self, part: str, settled_s: list[float], other_s: list[float]) -> bool:
        """Whether the job decided the comparison ``part`` over at the count of steps a side it holds."""
        return self._turns_decided.get(f"{part}/{min(len(settled_s), len(other_s))}", False)

    def _codec_for(self, group: _Group) -> tuple[str, list[float] | None]:
        """The codec of this launch and the list its time goes to (None: not timed)."""
        if not group.final and self._trial_over(group):
            self._next_trial(group)
        if group.final:
            codec = group.priced().codec
            if group.spec.name in self._turn:
                return self._turn[group.spec.name], None
        else:
            group.left -= 1
            codec = group.trials[-1]
        sink = None if group.final else group.times.setdefault(codec, [])
        if codec == "none" and group.planned:
            codec = PLANNED  # this group's "none" is the planned exchange (it measured quicker)
        return codec, sink

    @property
    def _trial_launches(self) -> int:
        """The launches a trial may take: ``probe_steps``, and up to :data:`SETTLING_LAUNCHES` more while the runtime
        settles the exchange it runs."""
        return self.probe_steps + SETTLING_LAUNCHES

    def _trial_over(self, group: _Group) -> bool:
        """:meth:`_Group.trial_over`, the same on every rank. Whether a launch was timed while the runtime settled an
        exchange is each rank's own reading (its communication thread's progress against its record callbacks), so
        one rank may hold ``probe_steps`` settled timings while another waits for more: a rank moving to the next
        trial alone would wait for a decision the others never ask for, and they for its collectives. So once the
        trial has had ``probe_steps`` launches (fewer cannot end it) and has launches left, rank 0's timings decide."""
        if not group.trials or group.left == 0:
            return True
        launched = self._trial_launches - group.left
        if launched < self.probe_steps:
            return False

        def over() -> bool:
            self._wait_records(group.spec.name)
            return group.trial_over(self.probe_steps)

        return self._decide_flag(f"over/{group.spec.name}/{len(group.trials)}/{launched}", over)

    def _next_trial(self, group: _Group) -> None:
        """What the group times next, once the last trial's launches are spent (or settle it). Usually ``"none"``
        first, then the choice it informs, then :func:`review`; a choice the model puts more than ``MARGIN`` times
        ahead of ``"none"`` runs first and alone, and ``"none"`` is timed only if its measurement breaks the
        margin (:func:`~gradsync.compress.auto.wide_margin`, :func:`~gradsync.compress.auto.trust_margin`). A
        codec measuring more than ``MARGIN`` times its prediction gets a :func:`~gradsync.compress.auto.rival`
        (up to :data:`MAX_CODECS` codecs in all), and the quickest goes on."""
        if group.trials[-1:] == ["none"] and PLANNED not in group.trials and self._agree_has_plan(group):
            self._trial(group, PLANNED)
            return
        if group.trials[-1:] == [PLANNED]:
            self._agree_planned(group)
        trials = [t for t in group.trials if t != PLANNED]
        if not trials:
            first = self._agree_choice(group, "first")
            if wide_margin(first, self._margin_for(first.codec)):
                self._trial(group, first.codec, first)
            else:
                self._trial(group, "none")
            return
        if trials == ["none"]:
            choice = self._agree_choice(group, "choose")
            if choice.codec == "none":
                self._settle(group, review(choice, 0.0, 0.0))
            else:
                self._trial(group, choice.codec, choice)
            return
        if trials[-1] != "none":  # a codec's trial ended
            if len(group.candidates) < MAX_CODECS:
                second = self._agree_rival(group)
                if second is not None:
                    self._trial(group, second.codec, second)
                    return
            group.choice = self._agree_quickest(group)
            if "none" not in trials:  # the wide-margin trials alone
                kept = self._agree_margin(group)
                if kept is not None:
                    self._settle(group, kept)
                else:
                    self._trial(group, "none")
                return
        self._settle(group, self._agree_review(group))

    def _trial(self, group: _Group, codec: str, choice: AutoChoice | None = None) -> None:
        """Time ``codec`` (priced as ``choice``) for the next ``probe_steps`` launches."""
        if codec not in ("none", PLANNED):
            if choice is None:
                raise CompressionError(f"group {group.spec.name!r}: codec {codec!r} is tried without its priced choice")
            group.candidates[codec] = group.choice = choice
        group.trials.append(codec)
        group.left = self._trial_launches

    # ---- deciding once for the job -------------------------------------------------------------------------
    def _decide(self, key: str, compute: Callable[[], bytes]) -> bytes:
        """``compute()`` on rank 0, the same bytes everywhere (the runtime's job-wide decide); with one rank, here.
        Its time (profiling, searching, waiting for rank 0) is kept out of the whole-step check's samples."""
        rt = self.runtime
        if rt.world_size > 1 and rt.caps.decide is None:  # each rank would choose from its own timings: drift
            raise CompressionError(
                f"compression='auto' needs a transport that shares one decision across the job (torch.distributed's "
                f"store); this runtime's {type(rt.transport).__name__} cannot: pass a fixed codec instead")
        t0 = self.clock()
        try:
            if rt.world_size == 1:
                return compute()
            return rt.plans.decide(f"compression-auto/{self._serial}/{key}", compute)
        finally:
            self._deciding_s += self.clock() - t0

    def _decide_flag(self, key: str, compute: Callable[[], bool]) -> bool:
        """:meth:`_decide` of a yes or no: rank 0's ``compute()``, the same answer on every rank."""
        return self._decide(key, lambda: b"1" if compute() else b"0") == b"1"

    def _agree(self, group: _Group, stage: str, pick: Callable[[], AutoChoice | None]) -> AutoChoice | None:
        """``pick()`` on rank 0 once the group's own timings are in, the same choice (or None) on every rank.
        ``stage`` names the decision: each is made once per group (a key decided twice would read the first
        answer on the peers)."""
        def compute() -> bytes:
            self._wait_records(group.spec.name)
            got = pick()
            return json.dumps(None if got is None else got.to_dict()).encode()

        doc = json.loads(self._decide(f"{stage}/{group.spec.name}", compute))
        return None if doc is None else AutoChoice.from_dict(group.spec.name, doc)

    def _agree_has_plan(self, group: _Group) -> bool:
        """Whether the group's "none" has a second way to go, the runtime's planned exchange: where the runtime's
        pick for the size is a plan (rank 0 reads it; every rank takes its answer). A pick of the backend's own
        collective that an explorer times a plan against is not: the explorer's calls would time its candidates,
        the backend's among them, for a few dozen launches, and "none" has timed the backend already."""
        if not group.native:
            return False
        nbytes = group.spec.nbytes
        return self._decide_flag(f"has-plan/{group.spec.name}", lambda: not self.runtime.picks_native(nbytes))

    def _agree_planned(self, group: _Group) -> None:
        """After both ways of sending the group uncompressed were timed: the planned exchange is its "none" from now
        on where it measured :attr:`threaded_gain` times quicker than the backend's allreduce (DDP's own way
        otherwise), decided for the job. Later reviews compare against the one kept. Kept on any lead where no
        whole steps against DDP's buckets follow, it lost whole steps on DDP hooks: a bucket that measured a few
        percent quicker on its own ran slower steps than DDP's (docs/mergecomp.md)."""
        def quicker() -> bool:
            self._wait_records(group.spec.name)
            return quicker_by(group.time_s(PLANNED), group.time_s("none"), self.threaded_gain)

        group.planned = self._decide_flag(f"planned/{group.spec.name}", quicker)
        if not group.planned:
            self._agree_close(group, PLANNED)
        if group.planned:
            group.times["none"] = list(group.times.get(PLANNED, []))
            group.unsettled["none"] = list(group.unsettled.get(PLANNED, []))

    def _agree_choice(self, group: _Group, stage: str) -> AutoChoice:
        """The model's choice for ``group`` (``stage``: ``"first"`` before anything was timed, its slack that of an
        earlier step if any; ``"choose"`` after ``"none"``'s launches), decided once for the job."""
        def pick() -> AutoChoice:
            (choice,) = choose([group.now()], policy=self.allow, wire=self.wire, codec_cost=self.codec_cost,
                               world=self.runtime.world_size)
            return choice

        return self._agreed(group, stage, pick)

    def _agree_rival(self, group: _Group) -> AutoChoice | None:
        """The codec timed next after a choice that measured far above its prediction (:func:`rival`), or None."""
        choice = group.priced()
        return self._agree(group, f"rival{len(group.candidates)}", lambda: rival(
            group.now(), choice, group.time_s(choice.codec), tried=list(group.candidates), policy=self.allow,
            wire=self.wire, codec_cost=self.codec_cost, world=self.runtime.world_size,
            beat_s=min(group.time_s(c) for c in group.candidates)))

    def _agree_quickest(self, group: _Group) -> AutoChoice:
        """Of the codecs tried, the one that measured quickest (ties to the earlier), decided for the job."""
        return self._agreed(group, "quickest", lambda: min(
            enumerate(group.candidates.values()), key=lambda ic: (group.time_s(ic[1].codec), ic[0]))[1])

    def _agree_margin(self, group: _Group) -> AutoChoice | None:
        """Whether a wide-margin choice measured inside its margin (:func:`trust_margin`), decided for the job."""
        choice = group.priced()
        return self._agree(group, "margin", lambda: trust_margin(choice, group.time_s(choice.codec),
                                                                 self._margin_for(choice.codec)))

    def _margin_for(self, codec: str) -> float:
        """The margin ``codec`` is trusted on here: :attr:`margin`, or :attr:`cast_margin` for a cast where lower."""
        return margin_for(codec, self.margin, self.cast_margin)

    def _agree_review(self, group: _Group) -> AutoChoice:
        """Keep the choice or drop it for "none", decided for the job. A codec whose exchange ran on gradsync's
        communication thread while "none" ran on the backend's allreduce must measure :attr:`threaded_gain` times
        quicker, the bar the planned way of "none" clears (:meth:`_agree_planned`): its own time leaves out what that
        thread takes from backward (what a codec kept on a smaller lead cost LeNet-5's steps: docs/mergecomp.md).
        A codec dropped though "none" measured less than ``TRY_GAIN`` times quicker is a close call the group's own
        times cannot settle: the whole-step check times it back (:attr:`_Group.close`, :meth:`_check_restore`)."""
        choice = group.priced()
        threaded = choice.codec in group.threaded and group.native and not group.planned
        gain = self.threaded_gain if threaded else 1.0
        kept = self._agreed(group, "review", lambda: review(choice, group.time_s(choice.codec), group.time_s("none"),
                                                            gain))
        if kept.codec == "none" and choice.codec != "none":
            self._agree_close(group, choice.codec)
        return kept

    def _agree_close(self, group: _Group, way: str) -> None:
        """After ``way`` (a codec, or :data:`PLANNED`) lost to the group's "none": it lost on a close call where "none"
        measured less than ``TRY_GAIN`` times quicker (:attr:`_Group.close`), decided for the job."""
        if self._decide_flag(f"close/{group.spec.name}/{way}",
                             lambda: not quicker_by(group.time_s("none"), group.time_s(way), TRY_GAIN)):
            group.close = way

    def _agreed(self, group: _Group, stage: str, pick: Callable[[], AutoChoice]) -> AutoChoice:
        """:meth:`_agree` where ``pick`` always chooses."""
        got = self._agree(group, stage, pick)
        if got is None:
            raise CompressionError(f"group {group.spec.name!r}: rank 0 sent no choice for {stage!r}")
        return got

    def _wait_records(self, key: str | None = None) -> None:
        """Wait (bounded) for the timing callbacks of ``key``'s launches (None: every group's).

        A decision waits for its own group's only. Another group launched earlier in this step may still be on
        the wire, and its exchange may need a job-wide decision of its own (a payload size the runtime has not
        planned yet) from the communication thread: on a peer, that waits behind this decision on the one
        store client, so waiting for it here would stall every rank until the bound."""
        mine = [(k, e) for k, e in self._events if key is None or k == key]
        self._events = [(k, e) for k, e in self._events if key is not None and k != key]
        deadline = time.monotonic() + RECORD_WAIT_S
        for _, e in mine:
            if not e.wait(max(0.0, deadline - time.monotonic())):
                self.record_timeouts += 1

    @property
    def codec_cost(self) -> Callable[[str, int], float]:
        """Codec seconds per ``(codec, numel)``: given, or profiled here at sizes spanning the groups seen."""
        sizes = [g.spec.numel for g in self._groups.values()]
        if self._codec_cost is None or sizes:  # _profile keeps a given cost, or one whose points cover the groups
            self._profile(min(sizes), max(sizes), next(iter(self._groups.values())).spec.dtype)
        return self._codec_cost  # type: ignore[return-value]

    def _profile(self, low: int, high: int, dtype: torch.dtype) -> None:
        """Profile the allowed codecs on :func:`~gradsync.compress.auto.profile_ladder`'s points for ``low`` ..
        ``high`` elements, unless a profile covering them is in hand (a given ``codec_cost`` always is) or in the
        cache (:meth:`profile_key`: device, dtype, torch, codecs, points): the first job on a machine measures
        (seconds for a large model), the next reads it."""
        cap = CPU_PROFILE_CAP if self._device().type == "cpu" else None
        if self._codec_cost is not None and (self._ladder is None or ladder_covers(self._ladder, low, high, cap)):
            return
        ladder = profile_ladder(min(low, *(self._ladder or (low,))), max(high, *(self._ladder or (high,))), cap)
        options = allowed(self.allow, dtype)
        key = self.profile_key(ladder, dtype, options)
        path = cache_file("codec-profile", key)
        profile = None
        if self.use_cache and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
                if not isinstance(doc, dict) or doc.get("key") != key:
                    raise CompressionError("its key is not this profile's")
                profile = CodecProfile.from_dict(doc.get("profile"))
            except (OSError, ValueError, CompressionError) as exc:
                warnings.warn(f"ignoring the cached codec profile {path} ({exc}); profiling again", stacklevel=4)
        if profile is None:
            profile = profile_codecs(options, ladder, dtype, device=self._device())
            if self.use_cache:
                write_cache(path, {"type": PROFILE_TYPE, "key": key, "profile": profile.to_dict()}, "codec profile",
                            stacklevel=4)
        self._codec_cost, self._ladder = profile, ladder

    def profile_key(self, ladder: Sequence[int], dtype: torch.dtype, options: Sequence[Any]) -> dict[str, Any]:
        """What a cached codec profile is valid for: the device (its name on a GPU), the host's CPUs, dtype,
        torch, the codecs (name and settings) and the points measured."""
        device = self._device()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        return {"device": f"{device.type}:{name}", "cpus": os.cpu_count(), "dtype": str(dtype),
                "torch": torch.__version__, "codecs": [repr(o) for o in options], "ladder": list(ladder)}

    def plan_partition(self, sizes: Sequence[int], ready_s: Sequence[float], backward_end_s: float,
                       dtype: torch.dtype, observed: tuple[Partition, float] | None = None,
                       observed_busy_s: float | None = None) -> JointChoice:
        """The merged partition chosen together with the codec (:func:`~gradsync.compress.auto.choose_joint`) from
        one timed step's ready times (tensors in backward order), once for the job: rank 0 computes it and every
        rank gets the same. Each group's codec is then chosen and measured as usual; the partition is priced
        with the best single codec, as MergeComp searches a partition for one compressor. ``observed``: the
        timed step's partition and seconds (same origin as ``ready_s``), which price each group's own cost;
        ``observed_busy_s``: how long that step's collectives were in flight, which scales the wire model first."""
        self._load_once()
        cached = self._cached_joint
        if cached is not None and cached.partition.n == len(sizes):  # an earlier job's: every rank read the same
            self.joint, self.buckets = cached, self._cached_buckets
            return cached

        def compute() -> bytes:
            self._profile(min(sizes), sum(sizes), dtype)
            joint = choose_joint(sizes, ready_s, backward_end_s, policy=self.allow, dtype=dtype, wire=self.wire,
                                 codec_cost=self.codec_cost, world=self.runtime.world_size, observed=observed,
                                 observed_busy_s=observed_busy_s)
            return json.dumps(joint.to_dict()).encode()

        self.joint = JointChoice.from_dict(json.loads(self._decide(f"joint/{len(sizes)}", compute)))
        return self.joint

    def _device(self) -> torch.device:
        try:
            return self.runtime.device
        except AttributeError:
            return torch.device("cpu")

    def _settle(self, group: _Group, choice: AutoChoice) -> None:
        group.choice, group.final = choice, True
        if self.settled:
            self._write_cache()

    # ---- the cache -----------------------------------------------------------------------------------------
    def cache_key(self) -> dict[str, Any]:
        """What cached choices are valid for: parameters, wire, device, world size, policy, codecs and path."""
        wire = self.wire
        wire_doc = wire.to_dict() if hasattr(wire, "to_dict") else repr(wire)
        return {"signature": self.signature, "wire": wire_doc, "device": self._device().type,
                "world": self.runtime.world_size, "allow": self.allow, "codecs": CODECS.names(), "path": self.path}

    def cache_path(self) -> str:
        return cache_file("compression-auto", self.cache_key())

    def _load_once(self) -> None:
        if not self._loaded:
            self._loaded = True
            self._load_cache()

    def _load_cache(self) -> None:
        if not self.use_cache:
            return
        path = self.cache_path()
        raw = self._decide(f"cache/{os.path.basename(path)}",
                           lambda: open(path, "rb").read() if os.path.isfile(path) else b"")
        if not raw:
            return
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("type") != AUTO_TYPE or doc.get("key") != self.cache_key():
                raise CompressionError("written for other parameters, another wire or device")
            choices = [AutoChoice.from_dict(g, entry) for g, entry in dict(doc["groups"]).items()]
            planned = doc.get("planned", [])
            if not isinstance(planned, list) or not all(isinstance(k, str) for k in planned):
                raise CompressionError(f"'planned' must be a list of group names, got {planned!r}")
            joint = None if doc.get("joint") is None else JointChoice.from_dict(doc["joint"])
            buckets = None if joint is None or doc.get("buckets") is None else _buckets_from(doc["buckets"])
        except (ValueError, KeyError, TypeError, CompressionError) as exc:
            warnings.warn(f"ignoring the cached auto compression choices {path} ({exc}); measuring again", stacklevel=4)
            return
        dtype = getattr(torch, str(self.signature[0][2]).rsplit(".", 1)[-1]) if self.signature else torch.float32
        permitted = {o.name for o in allowed(self.allow, dtype)}
        for c in choices:
            if c.codec not in permitted:
                continue  # never run what the policy does not allow, whatever a file says
            cached = AutoChoice(c.group, c.nbytes, c.codec, c.payload_bytes, c.predicted_s, c.none_s, "cached")
            spec = GroupSpec(c.group, ((max(1, c.nbytes),),), torch.float32)  # replaced by the real shapes at launch
            self._groups[c.group] = _Group(spec, choice=cached, final=True, planned=c.group in planned)
        self.cached = bool(choices)
        self._cached_joint, self._cached_buckets = joint, buckets

    def _write_cache(self) -> None:
        if not self.use_cache or self.runtime.rank != 0:
            return
        doc = {"type": AUTO_TYPE, "key": self.cache_key(),
               "groups": {k: c.to_dict() for k, c in self.choices.items()},
               "planned": sorted(k for k in self.choices if self._groups[k].planned),
               "joint": None if self.joint is None else self.joint.to_dict(),
               "buckets": self.buckets}
        write_cache(self.cache_path(), doc, "auto compression choices", stacklevel=4)

    # ---- the table -----------------------------------------------------------------------------------------
    def table(self) -> list[dict[str, Any]]:
        """One row per group: bytes, codec (``planned``: its "none" runs on the runtime's planned exchange, not the
        backend's allreduce), the slack it was priced with (None: no step yet), predicted and measured seconds
        (None: not measured), why, and how many of its trials' launches were timed while the runtime settled their
        exchange (kept apart: :data:`SETTLING_LAUNCHES`). Where DDP's buckets measured quicker than the choices
        (:meth:`check_buckets`), one row per bucket instead: ``"none"``, reason ``"buckets"``."""
        if self.runs_ddp_buckets:
            return [{"group": f"bucket{i}", "bytes": b, "codec": "none", "planned": False, "slack_s": None,
                     "predicted_s": None, "measured_s": None, "reason": "buckets", "settling_launches": 0}
                    for i, b in enumerate(self.buckets["bytes"])]
        rows = []
        for key in self._current_groups():
            g = self._groups[key]
            c = g.choice
            codec = c.codec if c is not None else "none"
            measured = g.time_s(codec)
            rows.append({"group": key, "bytes": g.spec.nbytes if c is None else c.nbytes, "codec": codec,
                         "planned": codec == "none" and g.planned, "slack_s": g.slack_s,
                         "predicted_s": None if c is None else c.predicted_s,
                         "measured_s": measured if math.isfinite(measured) else None,
                         "reason": "probing" if c is None else c.reason,
                         "settling_launches": sum(len(v) for v in g.unsettled.values())})
        return rows

    def report(self) -> str:
        """:meth:`table` as text."""
        def us(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e6:.1f}"

        lines = [f"{'group':<40} {'bytes':>12} {'codec':<12} {'predicted us':>13} {'measured us':>12}  reason"]
        for r in self.table():
            codec = PLANNED if r["planned"] else r["codec"]
            lines.append(f"{r['group'][:40]:<40} {r['bytes']:>12d} {codec:<12} {us(r['predicted_s']):>13} "
                         f"{us(r['measured_s']):>12}  {r['reason']}")
        if self.buckets is not None:
            b = self.buckets

            def ms(xs: Sequence[float]) -> str:
                return f"{np.median(xs) * 1e3:.2f} ms" if len(xs) else "not timed"

            against = (ms(b["buckets_s"]) if b["buckets_s"] or "calibration_s" not in b
                       else f"{b['calibration_s'] * 1e3:.2f} ms (the calibration step)")
            lines.append(f"whole steps (median): chosen {ms(b['chosen_s'])}, DDP's buckets uncompressed {against}: "
                         + ("the choices stay" if b["kept"] else "DDP's buckets run"))
        if self.path == "hook" and self.settled and self.verified and self.runs_backend_none:
            lines.append("every bucket settled on 'none' on the backend's allreduce: DDP without a comm hook runs that "
                         "exchange with one pass less per bucket (a hook averages in a pass of its own; "
                         "docs/mergecomp.md)")
        return "\n".join(lines)
