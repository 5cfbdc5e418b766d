"""Turn a schedule on a topology into flows: sizes, link-direction incidence, route latency, dependencies.

A *flow* is what the simulator moves: one transfer of the schedule, carrying ``chunk.size * bytes`` along
its route. Link directions are numbered ``2 * link + direction`` (direction 0 is ``a -> b``), so the
flows x link-directions incidence is one sparse 0/1 matrix and every per-link quantity is a matvec.

Tensor lists (BML §4.1 per-layer pieces): the schedule's chunk fractions apply to every tensor, so
transfer ``t`` moves ``chunk.size * S_k`` bytes of tensor ``k``. With ``merge=True`` (the default) the
pieces of one transfer are sent back to back as one message: one flow of ``chunk.size * sum_k S_k`` bytes,
which is exactly the concatenated buffer and makes ``[a, b]`` simulate like ``a + b``. With
``merge=False`` every (tensor, transfer) is its own flow and depends only on flows of the same tensor, so
store-and-forward pipelines across tensors (tensor ``k + 1`` of a hop can go while tensor ``k`` is
forwarded); the cost is ``K`` times more flows.

Dependencies are the schedule's (see :mod:`gradsync.plan.schedule`): ``deps(t) = {u : u.chunk ==
t.chunk, u.dst == t.src, u.step < t.step}``. They depend on ``(t.src, t.chunk, t.step)`` only, so
transfers that share it form a *dependency group* with one list of dependencies. Storing groups instead
of transfer-to-transfer edges keeps fan-in schedules linear: a parameter server's broadcast of a chunk to
N-1 ranks after N-1 reduces is 2(N-1) memberships, not (N-1)^2 edges. Everything is derived with sorts
and searches, so a schedule of 4 million transfers builds in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import scipy.sparse as sp

from gradsync.errors import GradsyncError, ScheduleError, SimulationError
from gradsync.plan.schedule import Schedule
from gradsync.topology.model import Topology

__all__ = ["SimulationError", "FlowSet", "build_flows", "by_step", "tensor_sizes", "schedule_dependencies"]




def tensor_sizes(size: float | Sequence[float]) -> tuple[float, ...]:
    """``size`` as a tuple of tensor sizes in bytes (one number is one tensor); their sum must be > 0."""

    def num(v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise SimulationError(f"tensor size {v!r} must be a number of bytes")
        return float(v)

    if isinstance(size, np.ndarray) and size.ndim == 1:
        sizes = tuple(num(s) for s in size.tolist())
    elif isinstance(size, Sequence) and not isinstance(size, (str, bytes)):
        sizes = tuple(num(s) for s in size)
    else:
        sizes = (num(size),)
    if not sizes:
        raise SimulationError("the tensor list is empty; give at least one tensor size in bytes")
    for s in sizes:
        if not (math.isfinite(s) and s >= 0):
            raise SimulationError(f"tensor size {s!r} must be a finite number of bytes >= 0")
    if sum(sizes) <= 0:
        raise SimulationError(f"sizes {list(sizes)} add up to 0 bytes; simulate a positive size")
    return sizes


def _ranges(lo: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(lo[i], lo[i] + counts[i])`` for all i, without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    return np.repeat(lo - (ends - counts), counts) + np.arange(total, dtype=np.int64)


def _csr_of(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Group positions ``0..len(keys)-1`` by ``keys`` in ``[0, n)``: CSR ``(indptr, positions)``, stable."""
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(keys, minlength=n), out=ptr[1:])
    return ptr, np.argsort(keys, kind="stable").astype(np.int64)


@dataclass(frozen=True)
class _Columns:
    chunk: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    step: np.ndarray
    route_id: np.ndarray
    routes: list[tuple[str, ...]]


def _columns(schedule: Schedule) -> _Columns:
    """Transfer columns and route ids in C-level passes (``map`` + ``attrgetter``), no per-item Python."""
    ts = schedule.transfers
    n = len(ts)
    cached = schedule.__dict__.get("arrays")  # Schedule.arrays is a cached_property: reuse it when built
    cols = {}
    for name in ("chunk", "src", "dst", "step"):
        cols[name] = cached[name] if cached is not None else np.fromiter(map(attrgetter(name), ts), np.int64, n)
    routes = list(map(attrgetter("route"), ts))
    index = dict.fromkeys(routes)
    for i, r in enumerate(index):
        index[r] = i
    route_id = np.fromiter(map(index.__getitem__, routes), np.int64, n)
    return _Columns(cols["chunk"], cols["src"], cols["dst"], cols["step"], route_id, list(index))


def _groups(c: _Columns, ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dependency groups of the transfers: ``group[t]`` (-1: no dependency) and each group's deps (CSR).

    Transfers into (rank, chunk) are sorted by step; a group ``(src, chunk, step)`` depends on the prefix
    of the run of ``(src, chunk)`` with smaller steps, found by two binary searches per distinct group.
    """
    n = c.chunk.shape[0]
    if n == 0:
        return np.full(0, -1, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64)
    steps = int(c.step.max()) + 2
    key_in = c.chunk * ranks + c.dst
    order = np.lexsort((c.step, key_in))
    ks = key_in[order]
    keys, inv = np.unique((c.chunk * ranks + c.src) * steps + c.step, return_inverse=True)
    lo = np.searchsorted(ks, keys // steps, side="left")
    hi = np.searchsorted(ks * steps + c.step[order], keys, side="left")
    has = hi > lo
    gid = np.where(has, np.cumsum(has) - 1, -1)
    cnt = (hi - lo)[has]
    ptr = np.zeros(cnt.shape[0] + 1, np.int64)
    np.cumsum(cnt, out=ptr[1:])
    return gid[inv.ravel()], ptr, order[_ranges(lo[has], cnt)].astype(np.int64)


def schedule_dependencies(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(indptr, indices)`` of every transfer's dependencies; equals :meth:`Schedule.dependencies`."""
    c = _columns(schedule)
    group, gptr, gidx = _groups(c, len(schedule.ranks))
    g = np.maximum(group, 0)
    counts = np.where(group >= 0, gptr[g + 1] - gptr[g], 0)
    indptr = np.zeros(group.shape[0] + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr, gidx[_ranges(gptr[g], counts)]


@dataclass(frozen=True, eq=False)
class FlowSet:
    """Everything the event loop needs, as arrays over flows ``f``, groups ``g`` and link directions ``e``.

    ``incidence[f, e] = 1`` when flow f crosses link direction e. ``group[f]`` is f's dependency group
    (-1: none); ``gdep_*`` list a group's dependencies, ``gmem_*`` its member flows and ``dgrp_*`` the
    groups a flow feeds (all CSR). ``latency_s[f]`` is the route latency α_f = sum of its hops' latencies.
    """

    size: np.ndarray
    transfer: np.ndarray
    tensor: np.ndarray
    chunk: np.ndarray
    step: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    latency_s: np.ndarray
    incidence: sp.csr_matrix
    capacity: np.ndarray
    group: np.ndarray
    gdep_ptr: np.ndarray
    gdep_idx: np.ndarray
    gmem_ptr: np.ndarray
    gmem_idx: np.ndarray
    dgrp_ptr: np.ndarray
    dgrp_idx: np.ndarray

    @property
    def num_flows(self) -> int:
        return int(self.size.shape[0])

    @property
    def num_groups(self) -> int:
        return int(self.gdep_ptr.shape[0] - 1)

    def dependencies(self, f: int) -> np.ndarray:
        """The flows that flow ``f`` depends on."""
        g = int(self.group[f])
        return self.gdep_idx[self.gdep_ptr[g]:self.gdep_ptr[g + 1]] if g >= 0 else np.zeros(0, np.int64)


def build_flows(
    schedule: Schedule,
    topology: Topology,
    sizes: Sequence[float],
    *,
    merge: bool = True,
    latency: bool = True,
    latency_s: float | None = None,
    message_s: float = 0.0,
) -> FlowSet:
    """Flows of ``schedule`` on ``topology`` for tensors of ``sizes`` bytes (see the module docstring).

    ``latency_s`` (per hop) overrides every link's own latency; ``latency=False`` zeroes them.
    ``message_s`` is added once per flow (a message's software cost at its ends, whatever its route).
    """
    schedule.require_topology(topology)
    if latency_s is not None and not (isinstance(latency_s, (int, float)) and math.isfinite(latency_s) and latency_s >= 0):
        raise SimulationError(f"latency_s={latency_s!r} must be a number of seconds >= 0 (per hop)")
    if not (isinstance(message_s, (int, float)) and math.isfinite(message_s) and message_s >= 0):
        raise SimulationError(f"message_s={message_s!r} must be a number of seconds >= 0 (per message)")
    c = _columns(schedule)
    n_t = c.chunk.shape[0]
    n_c = len(schedule.chunks)
    n_r = len(schedule.ranks)
    if n_t and (c.chunk.min() < 0 or c.chunk.max() >= n_c):
        raise ScheduleError(f"a transfer names a chunk outside 0..{n_c - 1}; run schedule.check(topology)")
    if n_t and (min(c.src.min(), c.dst.min()) < 0 or max(c.src.max(), c.dst.max()) >= n_r or c.step.min() < 0):
        raise ScheduleError(f"a transfer names a rank outside 0..{n_r - 1} or a negative step; run schedule.check(topology)")
    # Routes -> link directions, once per distinct route.
    route_lds: list[list[int]] = []
    for r in c.routes:
        try:
            hops = topology.route_links(r)
        except GradsyncError as exc:
            raise ScheduleError(f"route {list(r)} does not follow {topology.name!r}: {exc}") from None
        if not hops:
            raise ScheduleError(f"route {list(r)} has one device; a transfer's route needs two ends")
        route_lds.append([2 * e + d for e, d in hops])
    lens = np.array([len(r) for r in route_lds], np.int64)
    flat = np.array([e for r in route_lds for e in r], np.int64)
    rptr = np.zeros(len(route_lds) + 1, np.int64)
    np.cumsum(lens, out=rptr[1:])
    hop_lat = np.repeat(np.array([lk.latency_s for lk in topology.links], float), 2)
    if not latency:
        hop_lat[:] = 0.0
    elif latency_s is not None:
        hop_lat[:] = float(latency_s)
    route_lat = np.add.reduceat(hop_lat[flat], rptr[:-1]) if flat.size else np.zeros(len(route_lds))
    t_lens = lens[c.route_id]
    cols = flat[_ranges(rptr[c.route_id], t_lens)]
    group, gdp, gdi = _groups(c, len(schedule.ranks))
    n_g = gdp.shape[0] - 1
    base_size = np.array([ch.size for ch in schedule.chunks], float)[c.chunk] if n_t else np.zeros(0)

    # K copies (one per tensor) unless merged; copy j owns flows j*n_t.. and groups j*n_g..
    k = 1 if merge else len(sizes)
    scale = np.array([float(sum(sizes))] if merge else [float(s) for s in sizes])
    f = n_t * k
    copy = np.arange(k, dtype=np.int64)
    indptr = np.zeros(f + 1, np.int64)
    np.cumsum(np.tile(t_lens, k), out=indptr[1:])
    incidence = sp.csr_matrix((np.ones(f and indptr[-1]), np.tile(cols, k), indptr), shape=(f, 2 * len(topology.links)))
    grp = np.where(np.tile(group, k) >= 0, np.tile(group, k) + np.repeat(copy * n_g, n_t), -1)
    gdep_ptr = np.zeros(n_g * k + 1, np.int64)
    np.cumsum(np.tile(np.diff(gdp), k), out=gdep_ptr[1:])
    gdep_idx = np.tile(gdi, k) + np.repeat(copy * n_t, gdi.shape[0])
    has = np.flatnonzero(grp >= 0)
    gmem_ptr, pos = _csr_of(grp[has], n_g * k)
    gmem_idx = has[pos]
    feeder = np.repeat(np.arange(n_g * k, dtype=np.int64), np.diff(gdep_ptr))
    dgrp_ptr, pos = _csr_of(gdep_idx, f)
    dgrp_idx = feeder[pos]
    capacity = np.array([lk.directed_GBps for lk in topology.links], float).reshape(-1) * 1e9  # a->b, b->a
    return FlowSet(
        size=(scale[:, None] * base_size[None, :]).ravel(),
        transfer=np.tile(np.arange(n_t, dtype=np.int64), k),
        tensor=np.repeat(copy, n_t) if not merge else np.full(n_t, -1, np.int64),
        chunk=np.tile(c.chunk, k),
        step=np.tile(c.step, k),
        src=np.tile(c.src, k),
        dst=np.tile(c.dst, k),
        latency_s=np.tile(route_lat[c.route_id] + float(message_s), k) if n_t else np.zeros(0),
        incidence=incidence,
        capacity=capacity,
        group=grp,
        gdep_ptr=gdep_ptr,
        gdep_idx=gdep_idx,
        gmem_ptr=gmem_ptr,
        gmem_idx=gmem_idx,
        dgrp_ptr=dgrp_ptr,
        dgrp_idx=dgrp_idx,
    )


def by_step(fs: FlowSet) -> tuple[FlowSet, np.ndarray]:
    """The same flows and groups renumbered in step order, and ``perm`` (new flow -> old flow).

    The simulator works in this order: flows start and drain roughly step by step, so the active flows
    are (nearly) a contiguous window ``[lo, hi)`` and every per-event array is a view, not a gather.
    """
    f, g = fs.num_flows, fs.num_groups
    perm = np.argsort(fs.step, kind="stable").astype(np.int64)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(f, dtype=np.int64)
    gstep = fs.step[fs.gmem_idx[fs.gmem_ptr[:-1]]] if g else np.zeros(0, np.int64)  # a group has >= 1 member
    gperm = np.argsort(gstep, kind="stable").astype(np.int64)
    ginv = np.empty_like(gperm)
    ginv[gperm] = np.arange(g, dtype=np.int64)
    old = fs.group[perm]
    group = np.where(old >= 0, ginv[np.maximum(old, 0)] if g else -1, -1)
    dcnt = np.diff(fs.gdep_ptr)[gperm]
    gdep_ptr = np.zeros(g + 1, np.int64)
    np.cumsum(dcnt, out=gdep_ptr[1:])
    gdep_idx = inv[fs.gdep_idx[_ranges(fs.gdep_ptr[:-1][gperm], dcnt)]]
    has = np.flatnonzero(group >= 0)
    gmem_ptr, pos = _csr_of(group[has], g)
    feeder = np.repeat(np.arange(g, dtype=np.int64), dcnt)
    dgrp_ptr, dpos = _csr_of(gdep_idx, f)
    return FlowSet(
        size=fs.size[perm], transfer=fs.transfer[perm], tensor=fs.tensor[perm], chunk=fs.chunk[perm],
        step=fs.step[perm], src=fs.src[perm], dst=fs.dst[perm], latency_s=fs.latency_s[perm],
        incidence=fs.incidence[perm], capacity=fs.capacity, group=group,
        gdep_ptr=gdep_ptr, gdep_idx=gdep_idx, gmem_ptr=gmem_ptr, gmem_idx=has[pos],
        dgrp_ptr=dgrp_ptr, dgrp_idx=feeder[dpos],
    ), perm
