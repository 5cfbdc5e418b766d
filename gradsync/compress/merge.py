"""MergeComp's partition search: which contiguous runs of gradients to merge before compressing (MergeComp §4.3).

Compressing every tensor on its own pays a compressor's start-up cost ``B_h`` and a message's latency ``B_g``
once per tensor (hundreds per model); compressing the whole model at once pays them once but cannot start
before backward ends, so nothing overlaps. MergeComp merges the tensors, in backward order, into ``y``
contiguous groups and picks the partition with the shortest iteration. This module holds the pieces as pure
functions over frozen records (hivemind ``load_balancing`` style):

* :class:`Partition` -- cut points over ``n`` tensors in backward order;
* :class:`MergeCostModel` -- MergeComp's Assumption 5, ``h(x) = B_h + γ_h x`` (compression, encode and decode, per
  group of ``x`` elements) and ``g(x) = B_g + γ_g x`` (communication), plus the backward timeline;
  :meth:`MergeCostModel.iteration_time` replays the two-stream pipeline exactly;
* :func:`search_mergecomp` -- MergeComp's Algorithm 2 (grow ``y`` while the best ``y``-partition keeps
  improving by at least ``α``);
* :func:`search_optimal` / :func:`optimal_per_y` -- the exact optimum for every ``y`` by dynamic programming
  over cut points (a Pareto-front DP; see :func:`optimal_per_y` for why it is exact).

Units: sizes ``x`` are **elements** for both ``h`` and ``g``, as in Assumption 5. A compressor's payload is
affine in the element count (``payload_bytes``), so a bytes-based link model becomes an element-based ``g``
by composition; :func:`gradsync.compress.profile.measure_comm` measures ``g`` that way.

Modules: the partition and the cost model are :mod:`gradsync.compress.merge_model`, the searches
:mod:`gradsync.compress.merge_search`; this module re-exports them and turns a user's ``merge=`` (a mode, a
number of groups or a partition) into a partition.

    >>> m = MergeCostModel(sizes=(100, 200, 300), ready_s=(1.0, 2.0, 4.0), backward_end_s=4.0,
    ...               h=(0.5, 0.01), g=(1.0, 0.02))
    >>> m.iteration_time(Partition(3, (1, 2))), m.single_group_time()
    (18.5, 23.5)
    >>> search_optimal(m)
    Partition(n=3, cuts=(1, 2))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradsync.compress.merge_model import (
    ZERO_COST as ZERO_COST,
)
from gradsync.compress.merge_model import (
    Cost,
    LinearCost,
    MergeCostModel,
    MergeError,
    Partition,
    PipelineTrace,
    ScaledCost,
    ShiftedCost,
    fit_group_overhead,
    fit_wire_scale,
)
from gradsync.compress.merge_search import (
    MergeCompSearch,
    optimal_per_y,
    search_mergecomp,
    search_mergecomp_trace,
    search_optimal,
)

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
    "ScaledCost",
    "ShiftedCost",
    "equal_partition",
    "fit_group_overhead",
    "fit_wire_scale",
    "optimal_per_y",
    "probe_sizes",
    "resolve_merge",
    "search_mergecomp",
    "search_mergecomp_trace",
    "search_optimal",
]


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
