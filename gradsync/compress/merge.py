"""MergeComp's partition search: which contiguous runs of gradients to merge before compressing (seed 004 §4.3).

Compressing every tensor on its own pays a compressor's start-up cost ``B_h`` and a message's latency ``B_g``
once per tensor (hundreds per model); compressing the whole model at once pays them once but cannot start
before backward ends, so nothing overlaps. MergeComp merges the tensors, in backward order, into ``y``
contiguous groups and picks the partition with the shortest iteration. This module holds the pieces as pure
functions over frozen records (hivemind ``load_balancing`` style):

* :class:`Partition` -- cut points over ``n`` tensors in backward order;
* :class:`MergeCostModel` -- the seed's Assumption 5, ``h(x) = B_h + γ_h x`` (compression, encode and decode, per
  group of ``x`` elements) and ``g(x) = B_g + γ_g x`` (communication), plus the backward timeline;
  :meth:`MergeCostModel.iteration_time` replays the two-stream pipeline exactly;
* :func:`search_mergecomp` -- the seed's Algorithm 2 (grow ``y`` while the best ``y``-partition keeps
  improving by at least ``α``);
* :func:`search_optimal` / :func:`optimal_per_y` -- the exact optimum for every ``y`` by dynamic programming
  over cut points (a Pareto-front DP; see :func:`optimal_per_y` for why it is exact).

Units: sizes ``x`` are **elements** for both ``h`` and ``g``, as in Assumption 5. A compressor's payload is
affine in the element count (``payload_bytes``), so a bytes-based link model becomes an element-based ``g``
by composition; :func:`gradsync.compress.profile.measure_comm` measures ``g`` that way.

    >>> m = MergeCostModel(sizes=(100, 200, 300), ready_s=(1.0, 2.0, 4.0), backward_end_s=4.0,
    ...               h=(0.5, 0.01), g=(1.0, 0.02))
    >>> m.iteration_time(Partition(3, (1, 2))), m.single_group_time()
    (18.5, 23.5)
    >>> search_optimal(m)
    Partition(n=3, cuts=(1, 2))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from gradsync.compress.base import CompressionError

__all__ = [
    "MERGE_MODES",
    "Cost",
    "LinearCost",
    "MergeCompSearch",
    "MergeCostModel",
    "MergeError",
    "MergeSpec",
    "Partition",
    "PipelineTrace",
    "ShiftedCost",
    "equal_partition",
    "fit_group_overhead",
    "optimal_per_y",
    "probe_sizes",
    "resolve_merge",
    "search_mergecomp",
    "search_mergecomp_trace",
    "search_optimal",
]


class MergeError(CompressionError):
    """Bad input to MergeComp's planner: a partition, a cost model or a search parameter out of range."""


def _is_int(value: object) -> bool:
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
        if not _is_int(self.n) or self.n < 1:
            raise MergeError(f"n={self.n!r} must be an integer >= 1 (the number of tensors to partition)")
        object.__setattr__(self, "n", int(self.n))
        try:
            cuts = tuple(self.cuts)
        except TypeError:
            raise MergeError(f"cuts={self.cuts!r} must be a sequence of integers in 1..{self.n - 1}") from None
        for i, c in enumerate(cuts):
            if not _is_int(c):
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
    def _unchecked(cls, n: int, cuts: tuple[int, ...]) -> Partition:
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
            if not _is_int(c) or c < 1:
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
        """The seed's ``x_j``: elements per group, from per-tensor element counts."""
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
    #: Communication not hidden behind computation: ``max(0, E_y - compute_end)`` (the seed's Σg - Σp).
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
    * ``h`` -- compression time of a group: encode **and** decode, as the seed's ``h`` and Figure 3 count it;
      a ``(base_s, per_element_s)`` pair or any vectorised :class:`Cost` (e.g. ``profile.MeasuredCost``).
      All of ``h`` is charged before the group's transfer, which is conservative about overlap; to charge
      the decode after it instead, profile it apart and pass it as ``d``;
    * ``g`` -- communication time of a group, same forms;
    * ``d`` -- optional extra per-group time on the communication side after the transfer (a decode profiled
      apart from ``h``, or the aggregation of an allgather); default zero;
    * ``forward_s`` -- computation that overlaps nothing (forward pass, optimizer step): the seed's ``A`` is
      ``forward_s + backward_end_s``;
    * ``overlap_compression`` -- where compression runs (below).

    The pipeline, for groups ``j = 1..y`` with last tensor ``b_j`` and size ``x_j`` (``C_0 = E_0 = H_0 = 0``):

    ``overlap_compression=False`` (default, the seed's objective (7)): the compressor runs on the compute
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
            if not _is_int(s) or s < 0:
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

    def _pair_costs(self) -> tuple[np.ndarray, np.ndarray]:
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


# -- exact search: dynamic programming over cut points ---------------------------------------------------------


def _check_y(what: str, y: object, n: int) -> int:
    if not _is_int(y) or not 1 <= y <= n:
        raise MergeError(f"{what}={y!r} must be an integer in 1..n={n} (groups of at least one tensor)")
    return int(y)


def _pareto_columns(s2: np.ndarray, e2: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows and columns of the (eps-)non-dominated ``(s, e)`` candidates of each column (smaller is better in both)."""
    m = s2.shape[1]
    ar = np.arange(m)
    ie = np.argmin(e2, axis=0)
    e_best = e2[ie, ar]
    live = np.isfinite(e_best)
    # Fast path: the candidate with the smallest e also has (within eps) the smallest s -- it dominates its
    # column, a front of one. Always the case when s depends only on the state (inline compression, linear h).
    simple = live & (s2[ie, ar] <= s2.min(axis=0) + eps)
    rows, cols = [ie[simple]], [ar[simple]]
    hard = np.flatnonzero(live & ~simple)
    if hard.size:
        sh, eh = s2[:, hard], e2[:, hard]
        order = np.lexsort((eh, sh), axis=0)
        es = np.take_along_axis(eh, order, axis=0)
        best_before = np.vstack([np.full((1, hard.size), np.inf), np.minimum.accumulate(es, axis=0)[:-1]])
        keep = np.isfinite(es) & (es < best_before - eps)
        r, c = np.nonzero(keep)
        rows.append(order[r, c])
        cols.append(hard[c])
    return np.concatenate(rows), np.concatenate(cols)


#: Target columns priced per matrix in the DP (trades NumPy call overhead against wasted k' <= k cells).
_BLOCK = 64


def _lead_bounds(hx: np.ndarray, gx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on ``β``, how far the compression stream can lead the communication stream after boundary ``k``.

    For the groups after ``k`` (``h_l``, ``g_l`` with ``d`` folded in), the state ``(C, E)`` enters the final
    ``E`` only as ``max(E + a, C + a + β)`` with ``a = Σ g_l`` and ``β = max_m (Σ_{l<=m} h_l - Σ_{l<m} g_l)``.
    Returns ``lo[k] = min_{k'} h(k, k') <= β`` and ``hi[k] >= β`` over every continuation, by the recursion
    ``hi[k] = max_{k'} h(k, k') + max(0, hi[k'] - g(k, k'))``; at ``k = n`` (nothing follows) ``lo = 0`` and
    ``hi = inf`` so the normalisations in :func:`_dp` leave finished states alone.
    """
    n = hx.shape[0] - 1
    lo = np.zeros(n + 1)
    hi = np.full(n + 1, -np.inf)
    for k in range(n - 1, -1, -1):
        hs, gs = hx[k, k + 1 :], gx[k, k + 1 :]
        hi[k] = float(np.max(hs + np.maximum(0.0, hi[k + 1 :] - gs)))
        lo[k] = float(np.min(hs))
    hi[n] = np.inf
    return lo, hi


def _dp(model: MergeCostModel, max_groups: int, exact_groups: int | None = None) -> dict[int, tuple[float, Partition]]:
    """The best partition for every ``y <= max_groups`` (or only ``y = exact_groups``); see :func:`optimal_per_y`."""
    n = model.n
    inline = not model.overlap_compression
    hx, gx = model._pair_costs()
    ready = np.asarray(model.ready_s)
    ready_at = np.concatenate(([0.0], ready))  # ready_at[k']: when the last tensor of a group ending at k' is ready
    # next_ready[k']: the earliest the group after boundary k' can have its last tensor ready (-inf: none follows).
    next_ready = np.concatenate((ready, [-np.inf]))
    lead_lo, lead_hi = _lead_bounds(hx, gx)
    # Dominance tolerance: far below any timing resolution, but it merges states that differ only by rounding
    # (the same H reached along different paths), which would otherwise grow the fronts for nothing.
    step = np.arange(n)
    scale = (
        model.forward_s
        + model.backward_end_s
        + float(np.sum(hx[step, step + 1] + gx[step, step + 1]))
        + float(hx[0, n] + gx[0, n])
    )
    eps = 1e-12 * scale
    k_lab = np.zeros(1, dtype=np.int64)  # boundary after the label's last group (0 = nothing merged yet)
    s_lab = np.zeros(1)  # H_j (inline) or C_j (own stream)
    e_lab = np.zeros(1)  # E_j
    layers: list[tuple[np.ndarray, np.ndarray]] = []
    best: dict[int, tuple[float, int]] = {}
    for j in range(1, max_groups + 1):
        hi = n if exact_groups is None else n - (exact_groups - j)
        alive = np.flatnonzero(k_lab < n)
        if alive.size == 0 or hi < j:
            break
        cols = np.arange(j, hi + 1) if (exact_groups is None or j < exact_groups) else np.array([n])
        alive = alive[np.argsort(k_lab[alive], kind="stable")]
        ka = k_lab[alive]
        parts: list[tuple[np.ndarray, ...]] = []
        # Column blocks: a label at boundary k extends only to k' > k, so each block of target columns
        # prices just the labels left of it (about half the full label x column matrix).
        for c0 in range(0, cols.size, _BLOCK):
            cb = cols[c0 : c0 + _BLOCK]
            m = int(np.searchsorted(ka, cb[-1], side="left"))
            if m == 0:
                continue
            sub, kb = alive[:m], ka[:m]
            hmat = hx[np.ix_(kb, cb)]
            r = ready_at[cb][None, :]
            if inline:
                s2 = s_lab[sub, None] + hmat
                c2 = r + s2
            else:
                c2 = np.maximum(r, s_lab[sub, None]) + hmat
                s2 = c2
            e2 = np.maximum(c2, e_lab[sub, None]) + gx[np.ix_(kb, cb)]
            # Normalise states before comparing them (lossless, see optimal_per_y): e.g. a stream that will
            # idle until the next group's last gradient is ready is as good as one that is free only then.
            nr, lo, up = next_ready[cb][None, :], lead_lo[cb][None, :], lead_hi[cb][None, :]
            if inline:
                e2 = np.maximum(e2, nr + lo + s2)
            else:
                s2 = np.maximum(np.maximum(s2, nr), e2 - up)
                e2 = np.maximum(e2, s2 + lo)
            rows, cc = _pareto_columns(s2, e2, eps)
            parts.append((cb[cc], s2[rows, cc], e2[rows, cc], sub[rows]))
        k_lab, s_lab, e_lab, parent = (np.concatenate(a) for a in zip(*parts))
        layers.append((k_lab, parent))
        done = np.flatnonzero(k_lab == n)
        if done.size:
            end = model.backward_end_s + (s_lab[done] if inline else 0.0)
            t = model.forward_s + np.maximum(end, e_lab[done])
            i = int(np.argmin(t))
            best[j] = (float(t[i]), int(done[i]))
    out: dict[int, tuple[float, Partition]] = {}
    for y, (t_best, idx) in best.items():
        edges = []
        for k_arr, parent in reversed(layers[:y]):
            edges.append(int(k_arr[idx]))
            idx = int(parent[idx])
        # The normalisations never change a finished state's T, so t_best is this partition's simulate() time
        # (up to rounding in the order of additions).
        out[y] = (t_best, Partition._unchecked(n, tuple(reversed(edges[1:]))))
    return out


def optimal_per_y(model: MergeCostModel, max_groups: int | None = None) -> dict[int, tuple[float, Partition]]:
    """``{y: (F_min(y), X_y*)}``: the fastest partition into exactly ``y`` groups, for ``y = 1 .. max_groups`` (default n).

    **The DP.** Process groups left to right. After ``j`` groups ending at boundary ``k`` (tensors ``0..k-1``
    merged), the future of the pipeline depends on the past only through the pair ``(s, E_j)``, where ``s``
    is ``H_j`` (inline compression) or ``C_j`` (own compression stream) -- every later ``C``, ``E`` and ``T`` in
    :class:`MergeCostModel`'s recurrences is built from ``(s, E_j)`` and the future groups by ``+`` and ``max``
    only. Both are non-decreasing in each argument, so a state ``(s, E)`` with ``s <= s'`` and ``E <= E'``
    leads, for every completion, to an iteration no slower than ``(s', E')``: a dominated state can be
    dropped without losing any optimum (the principle of optimality for a partial order). So each DP cell
    ``(j, k)`` keeps the **Pareto front** of its ``(s, E)`` pairs; a transition appends the group
    ``[k, k')`` to every front point, and ``F_min(y)`` is the best terminal value in cell ``(y, n)``.

    **Why not one scalar.** With compression on its own stream, two histories can reach ``(j, k)`` as
    ``(C, E) = (3, 9)`` and ``(5, 7)``: a cheap next group favours the second, an expensive one (``h = 10``,
    ``g = 1``: ``E = 14`` against ``16``) the first. Inline with a linear ``h``, ``H_j = j B_h + γ_h P_k`` depends
    only on the cell, every front has one point, and the DP is the textbook min-plus recursion; with a
    non-linear ``h`` (``profile.MeasuredCost``) ``H_j`` depends on the history again and fronts reappear.

    **Normalised states.** Raw fronts get large (up to ~200 points per cell on ResNet-152 with a compression
    stream), so before comparing, each state moves to an equivalent one -- same iteration time for *every*
    completion, hence still exact:

    * the next group's last gradient is ready no earlier than ``ready[k]``, so (own stream) ``C <- max(C,
      ready[k])``, and inline ``E <- max(E, ready[k] + H + β_lo[k])``;
    * unrolling the recurrences, the final ``E`` depends on ``(C, E)`` only through ``max(E, C + β) + Σ g``
      over the later groups, where ``β_lo[k] <= β <= β_hi[k]`` (:func:`_lead_bounds`); so ``C <- max(C,
      E - β_hi[k])`` and ``E <- max(E, C + β_lo[k])`` change nothing downstream, and they line states up so
      that dominance sees them. On ResNet-152 the fronts then average 1.0-1.5 points per cell.

    **Exactness.** Exact up to floating-point rounding: points within ``eps = 1e-12 x`` the time scale of one
    another count as equal, and since the pipeline map is 1-Lipschitz in the max-norm the returned time is
    within ``y * eps`` of the true optimum. Brute force over all ``2^(n-1)`` partitions agrees (tests).

    **Cost.** ``h`` and ``g`` of every candidate group ``[k, k')`` are priced once as ``(n+1)^2`` matrices;
    each layer ``j`` extends all its front points by every ``k' > k`` in NumPy blocks, ``O(Σ_j |front_j| (n - j))``
    = ``O(n^3)`` for all ``y`` with fronts of one point (about a second for ``n = 467`` on one core), and
    ``O(y n^2)`` for :func:`search_optimal` with a fixed ``y``.
    """
    if not isinstance(model, MergeCostModel):
        raise MergeError(f"model={model!r} must be a MergeCostModel")
    y_max = model.n if max_groups is None else _check_y("max_groups", max_groups, model.n)
    return _dp(model, y_max)


def search_optimal(model: MergeCostModel, y: int | None = None) -> Partition:
    """The fastest partition into exactly ``y`` groups, or over all ``y`` when ``y`` is None (ties: fewest groups)."""
    if not isinstance(model, MergeCostModel):
        raise MergeError(f"model={model!r} must be a MergeCostModel")
    if y is not None:
        y = _check_y("y", y, model.n)
        return _dp(model, y, exact_groups=y)[y][1]
    per_y = _dp(model, model.n)
    best = min(t for t, _ in per_y.values())
    tol = 1e-12 * max(best, 1e-300)
    return per_y[min(k for k, (t, _) in per_y.items() if t <= best + tol)][1]


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
    the communication thread's copies competing with the compute thread (loopback, 2 processes on 2
    cores: 1.2-1.9 ms per group, so 8 groups measured 5-10 ms slower than 1 where the profile predicted
    them from 4 ms faster to 1 ms slower). It is the same for every group, so it moves the optimum toward fewer groups, and
    no profile taken outside a step sees it. One step run with many groups (the layer-wise calibration
    step, ``y = n``) measures it. With ``h_δ(x) = h(x) + δ`` the replayed time ``T(δ)`` is continuous and
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


# -- the seed's Algorithm 2 ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeCompSearch:
    """What Algorithm 2 did: the partition it returned, its time, and the ``F_min(y)`` it evaluated."""

    partition: Partition
    time_s: float
    #: ``F_min(y)`` for every ``y`` the search evaluated (1 .. the ``y`` where it stopped).
    f_min: dict[int, float]
    #: ``X_y*`` for the same ``y``.
    candidates: dict[int, Partition]
    #: ``"worse"`` (lines 6-7), ``"marginal"`` (lines 8-9) or ``"reached Y"`` (line 12).
    reason: str


def _bisect_inner(model: MergeCostModel, y: int, budget: int) -> tuple[float, Partition]:
    """``argmin F(X_y)`` as the seed's proof of Theorem 3 computes it: fix ``x_1..x_{y-2}``, binary-search ``x_{y-1}``.

    The proof argues ``F`` is decreasing then increasing in the last free cut (fully hidden communication
    first, then exposed), so a binary search for the turning point finds its minimum. That holds for smooth
    backward timelines; on real ones ``F`` can have plateaus and local minima, which is why this is a heuristic.
    """
    n = model.n
    if y == 1:
        return model.single_group_time(), Partition(n)
    steps = 2 * max(1, math.ceil(math.log2(n)))
    needed = math.comb(n - 2, y - 2) * steps
    if needed > budget:
        raise MergeError(
            f"inner='bisect' with y={y} over n={n} tensors needs about {needed} evaluations (C(n-2, y-2) prefixes "
            f"x {steps}), more than max_evaluations={budget}; use inner='exact' or a smaller Y"
        )
    best: tuple[float, Partition] | None = None
    for prefix in itertools.combinations(range(1, n - 1), y - 2):
        lo = (prefix[-1] + 1) if prefix else 1
        hi = n - 1

        def f(cut: int, prefix: tuple[int, ...] = prefix) -> float:
            return model.iteration_time(Partition(n, (*prefix, cut)))

        while lo < hi:
            mid = (lo + hi) // 2
            if f(mid) <= f(mid + 1):
                hi = mid
            else:
                lo = mid + 1
        cand = (f(lo), Partition(n, (*prefix, lo)))
        if best is None or cand[0] < best[0]:
            best = cand
    assert best is not None
    return best


def search_mergecomp_trace(
    model: MergeCostModel,
    Y: int,
    alpha: float,
    *,
    inner: Literal["exact", "bisect"] = "exact",
    max_evaluations: int = 1_000_000,
) -> MergeCompSearch:
    """Algorithm 2 of the seed (§4.3), line by line, with what it evaluated.

    ::

        1  Input: Y in [2, N], α in (0, 1)
        2  F_min(1) = F(X_1)
        3  for y = 2 to Y do
        4      X_y* = argmin_{X_y} F(X_y)
        5      F_min(y) = F(X_y*)
        6      if F_min(y-1) < F_min(y) then                       more groups made it slower
        7          return X_{y-1}*
        8      else if F_min(y-1) - F_min(y) < α F_min(y-1) then   the gain is marginal
        9          return X_y*
        10     end if
        11 end for
        12 return X_y*                                             (y = Y)

    Line 4's ``argmin`` is ``inner="exact"`` (the DP of :func:`optimal_per_y`, one pass for all ``y <= Y``) or
    ``inner="bisect"`` (the search in the seed's proof of Theorem 3, ``O(N^{y-2} log N)`` evaluations, capped
    by ``max_evaluations``). The heuristic part is the stopping rule: the result is ``X_{y'}*`` for the ``y'``
    where it stopped, never faster than the optimum over all ``y``, and equal to it whenever ``F_min`` is
    unimodal in ``y`` with no step smaller than ``α F_min`` before its minimum and that minimum at ``y <= Y``.
    """
    if not isinstance(model, MergeCostModel):
        raise MergeError(f"model={model!r} must be a MergeCostModel")
    n = model.n
    if not _is_int(Y) or not 2 <= Y <= n:
        raise MergeError(
            f"Y={Y!r} must be an integer in [2, N={n}] (Algorithm 2's largest number of groups)"
            + ("; a 1-tensor model has only the single-group partition" if n == 1 else "")
        )
    if (
        isinstance(alpha, (bool, np.bool_))
        or not isinstance(alpha, (int, float, np.integer, np.floating))
        or not (0 < float(alpha) < 1)
    ):
        raise MergeError(f"alpha={alpha!r} must be in (0, 1) (the smallest relative gain worth another group)")
    if inner not in ("exact", "bisect"):
        raise MergeError(f"inner={inner!r} must be 'exact' (the DP) or 'bisect' (the seed's Theorem 3 search)")
    if not _is_int(max_evaluations) or max_evaluations < 1:
        raise MergeError(f"max_evaluations={max_evaluations!r} must be an integer >= 1")
    alpha = float(alpha)
    exact = _dp(model, int(Y)) if inner == "exact" else None

    def argmin(y: int) -> tuple[float, Partition]:
        return exact[y] if exact is not None else _bisect_inner(model, y, max_evaluations)

    x1 = Partition(n)
    f_min, cand = {1: model.iteration_time(x1)}, {1: x1}  # line 2
    for y in range(2, int(Y) + 1):  # line 3
        f_min[y], cand[y] = argmin(y)  # lines 4-5
        if f_min[y - 1] < f_min[y]:  # lines 6-7
            return MergeCompSearch(cand[y - 1], f_min[y - 1], f_min, cand, "worse")
        if f_min[y - 1] - f_min[y] < alpha * f_min[y - 1]:  # lines 8-9
            return MergeCompSearch(cand[y], f_min[y], f_min, cand, "marginal")
    return MergeCompSearch(cand[int(Y)], f_min[int(Y)], f_min, cand, "reached Y")  # line 12


def search_mergecomp(
    model: MergeCostModel,
    Y: int,
    alpha: float,
    *,
    inner: Literal["exact", "bisect"] = "exact",
    max_evaluations: int = 1_000_000,
) -> Partition:
    """The partition the seed's Algorithm 2 picks (see :func:`search_mergecomp_trace`); the seed recommends ``Y = 2``."""
    return search_mergecomp_trace(model, Y, alpha, inner=inner, max_evaluations=max_evaluations).partition


# -- naming a partition ------------------------------------------------------------------------------------

MergeSpec = str | int | Partition
#: The named merge modes; an int y or a Partition is also accepted.
MERGE_MODES = ("layerwise", "auto")


def equal_partition(sizes: Sequence[int], y: int) -> Partition:
    """``y`` contiguous groups in backward order with about ``sum(sizes) / y`` elements each.

    Group ``j`` ends at the first tensor where the running total reaches ``j * total / y``; every group keeps
    at least one tensor, so a huge tensor cannot leave later groups empty.
    """
    n = len(sizes)
    if isinstance(y, bool) or not isinstance(y, int) or not 1 <= y <= n:
        raise MergeError(f"merge={y!r} groups must be an integer in 1..{n} (the model has {n} gradient tensors)")
    prefix = np.cumsum(np.asarray(sizes, dtype=np.float64))
    total = prefix[-1] if n else 0.0
    cuts: list[int] = []
    for j in range(1, y):
        want = int(np.searchsorted(prefix, j * total / y, side="left")) + 1  # tensors in groups 1..j
        low = (cuts[-1] + 1) if cuts else 1
        high = n - (y - j)  # leave one tensor for each later group
        cuts.append(min(max(want, low), high))
    return Partition(n, tuple(cuts))


def resolve_merge(merge: MergeSpec, sizes: Sequence[int]) -> Partition | None:
    """The partition ``merge`` names for tensors of ``sizes`` (backward order); None for ``"auto"`` (profiled later)."""
    n = len(sizes)
    if n < 1:
        raise MergeError("there are no gradients to merge (no parameter requires grad)")
    if isinstance(merge, Partition):
        if merge.n != n:
            raise MergeError(f"merge={merge!r} partitions {merge.n} tensors but the model has {n}")
        return merge
    if merge == "layerwise":
        return Partition.layerwise(n)
    if merge == "auto":
        return None
    if isinstance(merge, int) and not isinstance(merge, bool):
        return equal_partition(sizes, merge)
    raise MergeError(f"merge={merge!r} must be one of {MERGE_MODES}, a number of groups 1..{n}, or a Partition")


def probe_sizes(sizes: Sequence[int], points: int = 8) -> tuple[int, ...]:
    """Sizes to profile at: geometric from the smallest tensor to the whole model (the sizes groups can take)."""
    lo, hi = max(1, min(sizes)), max(1, int(sum(sizes)))
    if hi <= lo:
        return (lo,)
    return tuple(sorted({int(round(v)) for v in np.geomspace(lo, hi, points)}))
