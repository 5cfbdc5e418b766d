"""MergeComp's searches over partitions: the exact optimum for every number of groups (a Pareto-front dynamic
program, :func:`optimal_per_y`, :func:`search_optimal`) and MergeComp's Algorithm 2 (:func:`search_mergecomp`),
all over a :class:`gradsync.compress.merge_model.MergeCostModel`."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gradsync.compress.merge_model import MergeCostModel, MergeError, Partition, is_int

__all__ = ["MergeCompSearch", "optimal_per_y", "search_mergecomp", "search_mergecomp_trace", "search_optimal"]


# -- exact search: dynamic programming over cut points ---------------------------------------------------------


def _check_y(what: str, y: object, n: int) -> int:
    if not is_int(y) or not 1 <= y <= n:
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
    hx, gx = model.pair_costs()
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
        out[y] = (t_best, Partition.unchecked(n, tuple(reversed(edges[1:]))))
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

    **Normalised states.** Raw fronts get large (hundreds of points per cell on a deep model with a
    compression stream), so before comparing, each state moves to an equivalent one -- same iteration time for *every*
    completion, hence still exact:

    * the next group's last gradient is ready no earlier than ``ready[k]``, so (own stream) ``C <- max(C,
      ready[k])``, and inline ``E <- max(E, ready[k] + H + β_lo[k])``;
    * unrolling the recurrences, the final ``E`` depends on ``(C, E)`` only through ``max(E, C + β) + Σ g``
      over the later groups, where ``β_lo[k] <= β <= β_hi[k]`` (:func:`_lead_bounds`); so ``C <- max(C,
      E - β_hi[k])`` and ``E <- max(E, C + β_lo[k])`` change nothing downstream, and they line states up so
      that dominance sees them. The fronts then stay small.

    **Exactness.** Exact up to floating-point rounding: points within ``eps = 1e-12 x`` the time scale of one
    another count as equal, and since the pipeline map is 1-Lipschitz in the max-norm the returned time is
    within ``y * eps`` of the true optimum. Brute force over all ``2^(n-1)`` partitions agrees (tests).

    **Cost.** ``h`` and ``g`` of every candidate group ``[k, k')`` are priced once as ``(n+1)^2`` matrices;
    each layer ``j`` extends all its front points by every ``k' > k`` in NumPy blocks, ``O(Σ_j |front_j| (n - j))``
    = ``O(n^3)`` for all ``y`` with fronts of one point, and
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


# -- MergeComp's Algorithm 2 ------------------------------------------------------------------------------------


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
    """``argmin F(X_y)`` as MergeComp's proof of Theorem 3 computes it: fix ``x_1..x_{y-2}``, binary-search ``x_{y-1}``.

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
    """Algorithm 2 of MergeComp (§4.3), line by line, with what it evaluated.

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
    ``inner="bisect"`` (the search in MergeComp's proof of Theorem 3, ``O(N^{y-2} log N)`` evaluations, capped
    by ``max_evaluations``). The heuristic part is the stopping rule: the result is ``X_{y'}*`` for the ``y'``
    where it stopped, never faster than the optimum over all ``y``, and equal to it whenever ``F_min`` is
    unimodal in ``y`` with no step smaller than ``α F_min`` before its minimum and that minimum at ``y <= Y``.
    """
    if not isinstance(model, MergeCostModel):
        raise MergeError(f"model={model!r} must be a MergeCostModel")
    n = model.n
    if not is_int(Y) or not 2 <= Y <= n:
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
        raise MergeError(f"inner={inner!r} must be 'exact' (the DP) or 'bisect' (MergeComp's Theorem 3 search)")
    if not is_int(max_evaluations) or max_evaluations < 1:
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
    """The partition MergeComp's Algorithm 2 picks (see :func:`search_mergecomp_trace`); the paper recommends ``Y = 2``."""
    return search_mergecomp_trace(model, Y, alpha, inner=inner, max_evaluations=max_evaluations).partition
