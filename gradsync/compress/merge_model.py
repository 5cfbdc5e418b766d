"""MergeComp's cost model: what a partition of the gradients into merged groups costs.

:class:`Partition` (cut points over ``n`` tensors in backward order), the per-group costs ``h`` and ``g``
(:class:`LinearCost`, or any vectorised :class:`Cost`), and :class:`MergeCostModel`, which replays the
two-stream pipeline exactly (:meth:`MergeCostModel.simulate`); :func:`fit_group_overhead` fits the model to
one observed step. The searches over partitions are :mod:`gradsync.compress.merge_search`; the names a user
gives a partition, and the overview, are :mod:`gradsync.compress.merge`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gradsync.compress.base import CompressionError

__all__ = ["WIRE_SCALE_BOUNDS", "Cost", "LinearCost", "MergeCostModel", "MergeError", "Partition", "PipelineTrace",
           "ScaledCost", "ShiftedCost", "ZERO_COST", "fit_group_overhead", "fit_wire_scale", "is_int"]


class MergeError(CompressionError):
    """Bad input to MergeComp's planner: a partition, a cost model or a search parameter out of range."""


def is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _nonneg_float(what: str, value: object, meaning: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise MergeError(f"{what}={value!r} must be a finite number >= 0 ({meaning})")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise MergeError(f"{what}={value!r} must be a finite number >= 0 ({meaning})")
    return out


# -- partitions ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    """``n`` tensors in backward order cut into contiguous groups: group ``j`` is ``[cuts[j-1], cuts[j])``.

    With ``cuts = (c_1, ..., c_{y-1})``, ``0 < c_1 < ... < c_{y-1} < n`` and ``c_0 = 0``, ``c_y = n``, group
    ``j`` holds tensors ``c_{j-1} .. c_j - 1`` (0 = the first gradient backward produces). Contiguity is
    MergeComp's: a group can only be compressed once its last tensor is ready, so only runs of neighbours in
    backward order are worth merging. ``Partition(n)`` is one group; :meth:`layerwise` is ``n`` groups.
    """

    n: int
    cuts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise MergeError(f"n={self.n!r} must be an integer >= 1 (the number of tensors to partition)")
        object.__setattr__(self, "n", int(self.n))
        try:
            cuts = tuple(self.cuts)
        except TypeError:
            raise MergeError(f"cuts={self.cuts!r} must be a sequence of integers in 1..{self.n - 1}") from None
        for i, c in enumerate(cuts):
            if not is_int(c):
                raise MergeError(f"cuts[{i}]={c!r} must be an integer (a tensor index in backward order)")
            if not 1 <= c <= self.n - 1:
                raise MergeError(
                    f"cuts[{i}]={c!r} must be in 1..n-1={self.n - 1}: a cut separates tensor c-1 from tensor c"
                )
            if i and c <= cuts[i - 1]:
                raise MergeError(
                    f"cuts must be strictly increasing: cuts[{i}]={c!r} follows cuts[{i - 1}]={cuts[i - 1]!r}"
                )
        object.__setattr__(self, "cuts", tuple(int(c) for c in cuts))

    @classmethod
    def unchecked(cls, n: int, cuts: tuple[int, ...]) -> Partition:
        """A partition the planner built itself (valid by construction): skips the per-cut checks."""
        part = object.__new__(cls)
        object.__setattr__(part, "n", n)
        object.__setattr__(part, "cuts", cuts)
        return part

    @classmethod
    def single(cls, n: int) -> Partition:
        """One group (``y = 1``): the whole model merged, nothing overlaps backward."""
        return cls(n)

    @classmethod
    def layerwise(cls, n: int) -> Partition:
        """``n`` groups (``y = n``): every tensor compressed and sent alone (the no-merge baseline)."""
        return cls(n, tuple(range(1, n)))

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> Partition:
        """The partition whose group ``j`` holds ``counts[j]`` tensors."""
        counts = tuple(counts)
        if not counts:
            raise MergeError("counts=() must name at least one group")
        for i, c in enumerate(counts):
            if not is_int(c) or c < 1:
                raise MergeError(f"counts[{i}]={c!r} must be an integer >= 1 (tensors in group {i})")
        bounds = list(itertools.accumulate(int(c) for c in counts))
        return cls(bounds[-1], tuple(bounds[:-1]))

    @property
    def num_groups(self) -> int:
        """``y``, the number of groups."""
        return len(self.cuts) + 1

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` tensor indices of each group (``stop`` exclusive)."""
        edges = (0, *self.cuts, self.n)
        return tuple(zip(edges[:-1], edges[1:]))

    @property
    def counts(self) -> tuple[int, ...]:
        """Tensors per group."""
        return tuple(b - a for a, b in self.bounds)

    def groups(self, items: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
        """``items`` (one per tensor, backward order: names, sizes, gradients) split into the groups."""
        items = self._check_len("items", items)
        return tuple(tuple(items[a:b]) for a, b in self.bounds)

    def group_sizes(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """MergeComp's ``x_j``: elements per group, from per-tensor element counts."""
        return tuple(int(sum(g)) for g in self.groups(sizes))

    def _check_len(self, what: str, items: Sequence[Any]) -> Sequence[Any]:
        if len(items) != self.n:
            raise MergeError(f"len({what})={len(items)} != n={self.n}: give one entry per tensor of the partition")
        return items


# -- costs -----------------------------------------------------------------------------------------------------


@runtime_checkable
class Cost(Protocol):
    """Seconds as a function of elements; must accept a float **and** a NumPy array (the DP prices all pairs at once)."""

    def __call__(self, numel: Any) -> Any: ...


@dataclass(frozen=True)
class LinearCost:
    """Assumption 5's ``B + γ x``: ``base_s`` is the start-up time, ``per_element_s`` the time per element."""

    base_s: float
    per_element_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_s", _nonneg_float("base_s", self.base_s, "start-up seconds per operation"))
        object.__setattr__(
            self, "per_element_s", _nonneg_float("per_element_s", self.per_element_s, "seconds per element")
        )

    def __call__(self, numel: Any) -> Any:
        return self.base_s + self.per_element_s * numel


ZERO_COST = LinearCost(0.0, 0.0)


def _as_cost(what: str, value: object) -> Cost:
    """A :class:`LinearCost` from a ``(base_s, per_element_s)`` pair, or a vectorised callable checked on a probe."""
    if isinstance(value, LinearCost):
        return value
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise MergeError(f"{what}={value!r} must be a (base_s, per_element_s) pair or a Cost callable")
        try:
            return LinearCost(*value)
        except MergeError as err:
            raise MergeError(f"{what}: {err}") from None
    if not callable(value):
        raise MergeError(f"{what}={value!r} must be a (base_s, per_element_s) pair or a Cost callable")
    probe = np.array([[0.0, 1.0], [1024.0, 1e6]])
    try:
        out = np.asarray(value(probe), dtype=np.float64)
    except Exception as err:  # noqa: BLE001 - any failure means the callable cannot price an array
        raise MergeError(f"{what}={value!r} must accept a NumPy array of element counts: {err}") from None
    if out.shape != probe.shape or not np.all(np.isfinite(out)) or np.any(out < 0):
        raise MergeError(
            f"{what}={value!r} must map an array of element counts to finite seconds >= 0 of the same shape; "
            f"got {out!r} for {probe.tolist()}"
        )
    return value  # type: ignore[return-value]


# -- the pipeline ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineTrace:
    """One simulated iteration: per-group stream times (seconds from backward start) and the result."""

    partition: Partition
    #: ``C_j``: when group j's compression ends.
    compress_end_s: tuple[float, ...]
    #: ``E_j``: when group j's communication (and decode, if modelled) ends.
    comm_end_s: tuple[float, ...]
    #: When backward ends, including compressions run inline on the compute stream.
    compute_end_s: float
    #: Communication not hidden behind computation: ``max(0, E_y - compute_end)`` (MergeComp's Σg - Σp).
    exposed_comm_s: float
    #: ``forward_s + max(compute_end, E_y)``.
    iteration_s: float


@dataclass(frozen=True)
class MergeCostModel:
    """What a partition costs: per-group compression ``h`` and communication ``g``, and when gradients are ready.
    (Not :class:`gradsync.sim.cost.CostModel`, the runtime's model of the wire.)

    Fields (tensors indexed in backward order, ``i = 0`` is the first gradient produced):

    * ``sizes[i]`` -- elements of tensor ``i``; a group's size is ``x_j = Σ sizes`` over its tensors;
    * ``ready_s[i]`` -- when gradient ``i`` is ready, seconds from backward start, without any compression
      (non-decreasing: backward produces them in this order);
    * ``backward_end_s`` -- when backward computation ends (``>= ready_s[-1]``);
    * ``h`` -- compression time of a group: encode **and** decode, as MergeComp's ``h`` and Figure 3 count it;
      a ``(base_s, per_element_s)`` pair or any vectorised :class:`Cost` (e.g. ``profile.MeasuredCost``).
      All of ``h`` is charged before the group's transfer, which is conservative about overlap; to charge
      the decode after it instead, profile it apart and pass it as ``d``;
    * ``g`` -- communication time of a group, same forms;
    * ``d`` -- optional extra per-group time on the communication side after the transfer (a decode profiled
      apart from ``h``, or the aggregation of an allgather); default zero;
    * ``forward_s`` -- computation that overlaps nothing (forward pass, optimizer step): MergeComp's ``A`` is
      ``forward_s + backward_end_s``;
    * ``overlap_compression`` -- where compression runs (below).

    The pipeline, for groups ``j = 1..y`` with last tensor ``b_j`` and size ``x_j`` (``C_0 = E_0 = H_0 = 0``):

    ``overlap_compression=False`` (default, MergeComp's objective (7)): the compressor runs on the compute
    stream right after the group's last gradient, so each compression delays the rest of backward::

        H_j = H_{j-1} + h(x_j)                       compression time spent so far
        C_j = ready_s[b_j] + H_j                     (gradient b_j is itself late by H_{j-1})
        E_j = max(C_j, E_{j-1}) + g(x_j) + d(x_j)    one communication stream, FIFO
        T   = forward_s + max(backward_end_s + H_y, E_y)

    so ``T = A + Σh + Σg - Σp`` with ``Σp`` the communication hidden behind computation, exactly (7).

    ``overlap_compression=True``: compression has its own stream (a second CUDA stream, a CPU thread)::

        C_j = max(ready_s[b_j], C_{j-1}) + h(x_j)    one compression stream, FIFO
        E_j = max(C_j, E_{j-1}) + g(x_j) + d(x_j)
        T   = forward_s + max(backward_end_s, E_y)
    """

    sizes: tuple[int, ...]
    ready_s: tuple[float, ...]
    backward_end_s: float
    h: Cost
    g: Cost
    d: Cost = ZERO_COST
    forward_s: float = 0.0
    overlap_compression: bool = False
    _prefix: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            sizes = tuple(self.sizes)
            ready = tuple(self.ready_s)
        except TypeError:
            raise MergeError("sizes and ready_s must be sequences with one entry per tensor") from None
        if not sizes:
            raise MergeError("sizes=() must list at least one tensor")
        if len(ready) != len(sizes):
            raise MergeError(f"len(ready_s)={len(ready)} != len(sizes)={len(sizes)}: one ready time per tensor")
        for i, s in enumerate(sizes):
            if not is_int(s) or s < 0:
                raise MergeError(f"sizes[{i}]={s!r} must be an integer >= 0 (elements of tensor {i})")
        ready = tuple(_nonneg_float(f"ready_s[{i}]", r, "seconds from backward start") for i, r in enumerate(ready))
        for i in range(1, len(ready)):
            if ready[i] < ready[i - 1]:
                raise MergeError(
                    f"ready_s[{i}]={ready[i]!r} < ready_s[{i - 1}]={ready[i - 1]!r}: gradients must be listed in "
                    "backward order (the order they become ready)"
                )
        end = _nonneg_float("backward_end_s", self.backward_end_s, "seconds from backward start")
        if end < ready[-1]:
            raise MergeError(
                f"backward_end_s={end!r} < ready_s[-1]={ready[-1]!r}: backward cannot end before its last gradient"
            )
        object.__setattr__(self, "sizes", tuple(int(s) for s in sizes))
        object.__setattr__(self, "ready_s", ready)
        object.__setattr__(self, "backward_end_s", end)
        object.__setattr__(self, "forward_s", _nonneg_float("forward_s", self.forward_s, "non-overlapped compute"))
        for name in ("h", "g", "d"):
            object.__setattr__(self, name, _as_cost(name, getattr(self, name)))
        if not isinstance(self.overlap_compression, (bool, np.bool_)):
            raise MergeError(f"overlap_compression={self.overlap_compression!r} must be True or False")
        object.__setattr__(self, "overlap_compression", bool(self.overlap_compression))
        prefix = np.zeros(len(sizes) + 1, dtype=np.float64)
        np.cumsum(self.sizes, out=prefix[1:])
        prefix.flags.writeable = False
        object.__setattr__(self, "_prefix", prefix)

    @classmethod
    def from_backward_times(
        cls,
        sizes: Sequence[int],
        backward_s: Sequence[float],
        h: Cost | tuple[float, float],
        g: Cost | tuple[float, float],
        **kw: Any,
    ) -> MergeCostModel:
        """A model whose gradient ``i`` takes ``backward_s[i]`` seconds of backward compute (ready times are the prefix sums)."""
        times = [_nonneg_float(f"backward_s[{i}]", t, "seconds of backward compute") for i, t in enumerate(backward_s)]
        ready = tuple(itertools.accumulate(times))
        return cls(sizes=tuple(sizes), ready_s=ready, backward_end_s=ready[-1] if ready else 0.0, h=h, g=g, **kw)

    @property
    def n(self) -> int:
        """Number of tensors."""
        return len(self.sizes)

    @property
    def total_elements(self) -> int:
        """``D``, the model size in elements."""
        return int(self._prefix[-1])

    def simulate(self, partition: Partition) -> PipelineTrace:
        """Replay the pipeline of the class docstring for ``partition`` (``O(y)``)."""
        if not isinstance(partition, Partition):
            raise MergeError(f"partition={partition!r} must be a Partition")
        if partition.n != self.n:
            raise MergeError(f"partition.n={partition.n} != model.n={self.n}: the partition is for another model")
        prefix, ready = self._prefix, self.ready_s
        h, g, d = self.h, self.g, self.d
        inline = not self.overlap_compression
        s = e = 0.0  # s: H_j (inline) or C_j (stream); e: E_j
        comp: list[float] = []
        comm: list[float] = []
        for a, b in partition.bounds:
            x = float(prefix[b] - prefix[a])
            r = ready[b - 1]
            if inline:
                s = s + float(h(x))
                c = r + s
            else:
                c = max(r, s) + float(h(x))
                s = c
            e = max(c, e) + (float(g(x)) + float(d(x)))
            comp.append(c)
            comm.append(e)
        compute_end = self.backward_end_s + (s if inline else 0.0)
        return PipelineTrace(
            partition=partition,
            compress_end_s=tuple(comp),
            comm_end_s=tuple(comm),
            compute_end_s=compute_end,
            exposed_comm_s=max(0.0, e - compute_end),
            iteration_s=self.forward_s + max(compute_end, e),
        )

    def iteration_time(self, partition: Partition) -> float:
        """Seconds per iteration with ``partition`` (forward + the pipeline's end)."""
        return self.simulate(partition).iteration_s

    def no_merge_time(self) -> float:
        """Layer-wise compression (``y = n``): every tensor its own group."""
        return self.iteration_time(Partition.layerwise(self.n))

    def single_group_time(self) -> float:
        """The whole model merged (``y = 1``)."""
        return self.iteration_time(Partition.single(self.n))

    def pair_costs(self) -> tuple[np.ndarray, np.ndarray]:
        """``h(x)`` and ``g(x) + d(x)`` for every group ``[k, k')`` as ``(n+1) x (n+1)`` matrices (inf where ``k' <= k``)."""
        p = self._prefix
        x = p[None, :] - p[:, None]
        valid = np.triu(np.ones(x.shape, dtype=bool), k=1)
        x = np.where(valid, x, 0.0)
        hx = np.broadcast_to(np.asarray(self.h(x), dtype=np.float64), x.shape)
        gx = np.broadcast_to(np.asarray(self.g(x), dtype=np.float64), x.shape) + np.broadcast_to(
            np.asarray(self.d(x), dtype=np.float64), x.shape
        )
        return np.where(valid, hx, np.inf), np.where(valid, gx, np.inf)


# -- fitting the model to one observed step -------------------------------------------------------------------


@dataclass(frozen=True)
class ShiftedCost:
    """``cost(x) + base_s``: a cost with a per-operation overhead added (vectorised like ``cost``)."""

    cost: Cost
    base_s: float

    def __call__(self, numel: Any) -> Any:
        return self.cost(numel) + self.base_s


def fit_group_overhead(model: MergeCostModel, partition: Partition, observed_s: float, *, tol_s: float = 1e-7) -> tuple[MergeCostModel, float]:
    """The model with a per-group overhead ``δ >= 0`` added to compression ``h`` that makes it predict
    ``observed_s`` for ``partition``, and ``δ``.

    Why. ``h``, ``g`` and ``d`` are measured one operation at a time, on an otherwise idle process; a real
    step also pays, per group, what those measurements leave out, on the thread that runs backward: the
    hook's bookkeeping, handing the group to the communication thread, and -- where the CPU does both --
    the communication thread's copies competing with the compute thread (on loopback it is enough to turn
    a predicted gain from more groups into a loss). It is the same for every group, so it moves the optimum
    toward fewer groups, and no profile taken outside a step sees it. One step run with many groups (the
    layer-wise calibration step, ``y = n``) measures it. With ``h_δ(x) = h(x) + δ`` the replayed time ``T(δ)`` is continuous and
    non-decreasing in ``δ`` (every ``C_j`` and ``E_j`` is a max of sums that grow with ``δ``) and
    ``T(δ) >= y δ`` (the compression stream, inline or not, runs the ``y`` groups one after another), so
    ``T(δ) = observed_s`` has a least root in ``[0, observed_s / y]``, found by bisection. When the model
    already predicts at least ``observed_s``, ``δ = 0`` and the model is returned as it is (an
    over-prediction is not evidence of a negative overhead).
    """
    if not isinstance(model, MergeCostModel):
        raise MergeError(f"model={model!r} must be a MergeCostModel")
    observed = _nonneg_float("observed_s", observed_s, "seconds the step took")
    if model.iteration_time(partition) >= observed:
        return model, 0.0

    def shifted(delta: float) -> MergeCostModel:
        return replace(model, h=ShiftedCost(model.h, delta))

    lo, hi = 0.0, observed / partition.num_groups
    while hi - lo > tol_s:
        mid = 0.5 * (lo + hi)
        if shifted(mid).iteration_time(partition) < observed:
            lo = mid
        else:
            hi = mid
    return shifted(hi), hi


@dataclass(frozen=True)
class ScaledCost:
    """``cost(x) * factor``: a cost corrected by a measured-to-modelled ratio (vectorised like ``cost``)."""

    cost: Cost
    factor: float

    def __call__(self, numel: Any) -> Any:
        return self.cost(numel) * self.factor


#: The range :func:`fit_wire_scale` keeps a step's measured-to-modelled communication ratio in: a ratio beyond it says
#: the measurement is not of the wire (a rank that joined late, a stall), and is not trusted further.
WIRE_SCALE_BOUNDS = (0.25, 4.0)


def fit_wire_scale(model: MergeCostModel, partition: Partition, busy_s: float,
                   bounds: tuple[float, float] = WIRE_SCALE_BOUNDS) -> tuple[MergeCostModel, float]:
    """The model with its communication ``g`` times ``s``, the seconds ``partition``'s collectives kept the wire busy
    in a timed step (``busy_s``: the union of each group's launch-to-done interval) over what the model puts on it
    (``Σ g(x_j)``), kept within ``bounds``; and ``s``.

    Why. :func:`fit_group_overhead` reads a step's whole miss against the model as a cost per group. Where the miss
    is the wire's (a backend's ring slower than the wire model, a fabric's congestion), that charges every extra group
    a share of the wire's error, and the search merges groups that the wire would overlap with backward. The step's
    own collectives say how much of the miss is theirs: a miss in proportion to bytes, fitted here first, so that
    only what remains (launch, bookkeeping, the host) is fitted per group after it."""
    if not isinstance(model, MergeCostModel):
        raise MergeError(f"model={model!r} must be a MergeCostModel")
    busy = _nonneg_float("busy_s", busy_s, "seconds the step's collectives were in flight")
    low, high = bounds
    if not (0 < low <= 1 <= high):
        raise MergeError(f"bounds={bounds!r} must be (low, high) with 0 < low <= 1 <= high")
    if not isinstance(partition, Partition) or partition.n != model.n:
        raise MergeError(f"partition={partition!r} must be a Partition of the model's {model.n} tensors")
    modelled = sum(float(model.g(float(x))) for x in partition.group_sizes(model.sizes))
    if modelled <= 0.0 or busy <= 0.0:  # a free wire, or no measurement: nothing to scale
        return model, 1.0
    scale = min(max(busy / modelled, low), high)
    return replace(model, g=ScaledCost(model.g, scale)), scale
