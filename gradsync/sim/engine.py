"""A flow-level, event-driven network simulator for any :class:`~gradsync.plan.schedule.Schedule`.

Model (fluid, α–β):

* Every transfer is a flow of ``chunk.size * bytes`` along its route. A link direction ``e`` moves
  ``C_e = bandwidth_e * 1e9`` bytes/s, shared by its flows **max-min fairly** by progressive filling
  (water-filling): all unfrozen flows rise with one level λ, flow f at rate ``λ w_f``; when a link direction
  saturates (``used_e + λ W_e = C_e``, ``W_e`` its unfrozen weight) its unfrozen flows freeze; repeat until
  every flow is frozen. ``fairness="size"`` (default) weights flows by their bytes, so flows that share a
  bottleneck finish together: the planner's proportional model, under which every schedule streams in
  exactly its planned cost ``max_e load_e c_e`` (a multi-tree ``lp`` mix gives each tree its weight's share).
  ``fairness="flow"`` (``w_f = 1``) is plain per-flow max-min, TCP-like; trees of unequal weight then lose.
* Latency: a route's latency ``α_f`` is the **sum of its hops' latencies** (per hop, like the planner's
  ``latency_term``: a 2-hop route through a switch pays 2α). It is a delay added at the end of the flow:
  the last byte leaves at ``sent_f`` and arrives at ``finish_f = max(sent_f, max_{d in deps} finish_d) + α_f``
  (the last byte can leave only after the last byte of every dependency has arrived).
* Store-and-forward (``streaming=False``): a flow starts when all its dependencies have *finished*,
  ``start_t = max_d finish_d``; that is the per-step α–β model, so ring allreduce on N ranks takes
  ``2(N-1) (bytes/N / β + α_route)``.
* Streaming (default; OMS's aggregation streams through trees): a flow may start once every
  dependency has *started*, ``start_t = max_d (start_d + α_d)`` (its first byte arrives α_d after it
  left), and it can never have sent more bytes than any unfinished dependency: ``x_t <= min_d x_d``
  (same chunk, so the same size). In progressive filling a flow that is *caught up* with a dependency
  (``x_t == x_d``, d unfinished) freezes when that dependency freezes, at its rate. The lag between a
  dependency's bytes leaving and arriving is applied exactly at both ends of a flow (start and finish,
  above) but not to the cap in between (we use ``x_t <= x_d(τ)`` rather than ``x_d(τ - α_d)``): a
  simple, documented approximation that keeps the cap a pure rate constraint. With α = 0 it is exact.
  Consequence: store-and-forward ring pays exactly ``2(N-1)`` route latencies (the planner's α term),
  while streaming hides most of them behind bandwidth (between one and ``2(N-1)``); a chain of h hops
  streams in ``M/β + h α`` (cut-through) against ``h (M/β + α)`` store-and-forward.

Token buckets (``burst_s``): a shaped link (Linux ``tc tbf``, a cloud NIC's burst credits) passes a burst
faster than its rate. Every link direction holds ``B_e = burst_s C_e`` bytes of tokens, full at the start
(a collective begins after the wire was idle); while it has tokens it moves :data:`BURST_PEAK` ``C_e`` (as
good as instantly at the sizes a burst covers, finite so the fluid model stays one), and a load above
``C_e`` drains them at ``used_e - C_e``. An empty bucket is a link of rate ``C_e`` again. So a message of
``m <= B_e`` bytes crosses at once and a stream pays its rate on all but ``B_e`` of its bytes. The bucket
is not refilled within a collective: refilled in the gaps between one connection's messages, it priced deep
pipelines as if those gaps cost nothing, which the testbed did not bear out (docs/simulator.md), while the
first burst is what short collectives gain. One event more per bucket that empties.

Late ranks (``start_delay_s``): a rank that reaches the collective ``Δ_r`` seconds after the others (a
straggler, StragglAR's persistent one) sends nothing before then: every flow it sends starts at
``max(ready_t, Δ_r)``, which delays everything that depends on it. Flows *into* it are not held back (the
transport buffers what arrives early, as a TCP socket and the executor's posted receives do). ``time_s`` is
measured from the on-time ranks' start, so a ring with one rank late by Δ takes at least ``Δ`` plus that
rank's share of the ring (its link carries ``2 (N - 1) / N`` of the buffer after it arrives).

Events: a flow drains (its bytes are all sent), a flow catches up with its dependencies' envelope
``min_d x_d`` (or the envelope's slowest member changes), a flow becomes startable. Rates are recomputed at
every event; all flows that drain or start at the same instant (to 1e-9 relative) are one batch, which is
what makes step-synchronous schedules (ring, ps, BML) cheap: one event per step, not per transfer.
Everything is vectorised with numpy over the active flows (a scipy sparse flows x link-directions
incidence) and over dependency groups (:mod:`gradsync.sim.flows`), never byte by byte.
"""

from __future__ import annotations

import heapq
import math
import numbers
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
import scipy.sparse as sp

try:  # the kernels behind ``csr_matrix @ v`` and ``csr_matrix.T @ v`` (see _Engine._rebuild)
    from scipy.sparse._sparsetools import csc_matvec as _csc_matvec
    from scipy.sparse._sparsetools import csr_matvec as _csr_matvec
except ImportError:  # pragma: no cover - a SciPy without them: the public operators below
    _csr_matvec = _csc_matvec = None

from gradsync.plan.schedule import Schedule
from gradsync.sim.flows import FlowSet, SimulationError, _ranges, build_flows, by_step, tensor_sizes
from gradsync.topology.model import Topology

__all__ = ["BURST_PEAK", "FAIRNESS", "SimResult", "simulate", "start_delays"]

#: How flows share a link direction: max-min fair in bytes/s per byte of flow, or per flow.
FAIRNESS = ("size", "flow")

#: A link direction with tokens moves this many times its rate (``simulate(burst_s=...)``).
BURST_PEAK = 100.0

#: Up to this many active flows without caps, the rates are filled in plain Python (:meth:`_Engine._few_rates`):
#: numpy's cost per call is most of a fill round over a handful of flows. Above it, vectorised. Both run the same
#: floating-point operations in the same order, so the choice changes no bit of a result.
FEW_ACTIVE = 48
#: ...over every link direction up to this many, beyond it over those the active flows' routes touch.
FEW_DIRECTIONS = 256

#: Tests set this to assert the model's invariants after every event (link capacity, x_t <= min_d x_d).
_DEBUG = False
_PROGRESS_EVERY_S = 2.0  # seconds between progress lines
_REL = 1e-9  # relative tolerance on bytes and times: what counts as "the same instant" / "caught up"


@dataclass(frozen=True, eq=False)
class SimResult:
    """The simulated time of one schedule, per-link busy time, and every flow's timeline.

    ``gst_over_tf`` is the synchronisation time in units of ``T_F = bytes / (unit_bandwidth * 1e9)``, the
    planner's cost units, so it is directly comparable with ``evaluate(...).cost``. Link arrays are
    ``(links, 2)``: column 0 is ``a -> b``. Flow arrays have one entry per flow: per transfer when the
    tensors were merged (``flow_tensor == -1``), else per (tensor, transfer).
    """

    topology: str
    algorithm: str
    tensor_sizes: tuple[float, ...]
    streaming: bool
    merged: bool
    fairness: str
    #: One message at a time per connection and per receiver (``simulate(fifo=True)``).
    fifo: bool
    #: Per-hop latency override (``None``: the links' own; ``0.0`` also when latency was turned off).
    latency_s: float | None
    time_s: float
    t_f_s: float
    gst_over_tf: float
    unit_bandwidth_GBps: float
    events: int
    fill_rounds: int
    max_active_flows: int
    wall_s: float
    links: tuple[tuple[str, str, str], ...] = field(repr=False)
    link_bandwidth_GBps: np.ndarray = field(repr=False)
    link_busy_s: np.ndarray = field(repr=False)
    link_utilisation: np.ndarray = field(repr=False)
    start_s: np.ndarray = field(repr=False)
    sent_s: np.ndarray = field(repr=False)
    finish_s: np.ndarray = field(repr=False)
    flow_transfer: np.ndarray = field(repr=False)
    flow_tensor: np.ndarray = field(repr=False)
    flow_chunk: np.ndarray = field(repr=False)
    flow_step: np.ndarray = field(repr=False)
    flow_src: np.ndarray = field(repr=False)
    flow_dst: np.ndarray = field(repr=False)
    flow_link_ptr: np.ndarray = field(repr=False)
    flow_link_idx: np.ndarray = field(repr=False)
    #: κ of :func:`simulate`: the share of a flow's rate taken on the opposite link directions.
    reverse_share: float = 0.0
    #: Per rank, when it reached the collective (``simulate(start_delay_s=...)``); empty: all at 0.
    start_delay_s: tuple[float, ...] = ()
    #: Seconds of tokens per link direction at its rate (``simulate(burst_s=...)``); 0: no buckets.
    burst_s: float = 0.0

    @property
    def size_bytes(self) -> float:
        return float(sum(self.tensor_sizes))

    @property
    def num_flows(self) -> int:
        return int(self.start_s.shape[0])

    @property
    def link_bytes(self) -> np.ndarray:
        """Bytes that crossed every link direction, ``(links, 2)`` (busy time times bandwidth)."""
        bw = self.link_bandwidth_GBps
        return self.link_busy_s * (bw if bw.ndim == 2 else bw[:, None]) * 1e9

    def transfer_times(self) -> tuple[np.ndarray, np.ndarray]:
        """Per transfer of the schedule: (first start, last finish) over its tensors' flows."""
        n = int(self.flow_transfer.max()) + 1 if self.flow_transfer.size else 0
        start = np.full(n, np.inf)
        finish = np.full(n, -np.inf)
        np.minimum.at(start, self.flow_transfer, self.start_s)
        np.maximum.at(finish, self.flow_transfer, self.finish_s)
        return start, finish

    def link_classes(self) -> dict[str, dict[str, float]]:
        """Per link kind: link count, max and mean utilisation over link directions."""
        out: dict[str, dict[str, float]] = {}
        for i, (_, _, kind) in enumerate(self.links):
            u = float(self.link_utilisation[i].max())
            cls = out.setdefault(kind, {"links": 0, "max_utilisation": 0.0, "mean_utilisation": 0.0})
            cls["links"] += 1
            cls["max_utilisation"] = max(cls["max_utilisation"], u)
            cls["mean_utilisation"] += u
        for cls in out.values():
            cls["mean_utilisation"] /= cls["links"]
        return out

    def to_dict(self, *, links: bool = True) -> dict[str, Any]:
        """Tagged JSON form (``type: gradsync.simulation``); flow timelines are left out (use the arrays)."""
        out: dict[str, Any] = {
            "type": "gradsync.simulation",
            "topology": self.topology,
            "algorithm": self.algorithm,
            "size_bytes": self.size_bytes,
            "tensor_sizes": list(self.tensor_sizes),
            "mode": "streaming" if self.streaming else "store-and-forward",
            "merged_tensors": self.merged,
            "fairness": self.fairness,
            "fifo": self.fifo,
            "reverse_share": self.reverse_share,
            **({"burst_s": self.burst_s} if self.burst_s else {}),
            **({"start_delay_s": list(self.start_delay_s)} if self.start_delay_s else {}),
            "latency_s_per_hop": self.latency_s,
            "time_s": self.time_s,
            "t_f_s": self.t_f_s,
            "gst_over_tf": self.gst_over_tf,
            "unit_bandwidth_GBps": self.unit_bandwidth_GBps,
            "algbw_GBps": self.size_bytes / self.time_s / 1e9 if self.time_s > 0 else None,
            "flows": self.num_flows,
            "events": self.events,
            "fill_rounds": self.fill_rounds,
            "max_active_flows": self.max_active_flows,
            "wall_s": self.wall_s,
            "link_classes": self.link_classes(),
        }
        if links:
            out["links"] = [
                {
                    "a": a, "b": b, "kind": kind, "bandwidth_GBps": float(self.link_bandwidth_GBps[i, 0]),
                    "bandwidth_down_GBps": float(self.link_bandwidth_GBps[i, 1]),
                    "busy_ab_s": float(self.link_busy_s[i, 0]), "busy_ba_s": float(self.link_busy_s[i, 1]),
                    "utilisation_ab": float(self.link_utilisation[i, 0]),
                    "utilisation_ba": float(self.link_utilisation[i, 1]),
                }
                for i, (a, b, kind) in enumerate(self.links)
            ]
        return out


def with_reverse_share(incidence: sp.csr_matrix, share: float) -> sp.csr_matrix:
    """``incidence`` plus ``share`` on the opposite direction of every link direction a flow crosses.

    Direction ``2 l + d`` has opposite ``2 l + (1 - d)`` = ``e ^ 1``. A TCP stream's acknowledgements run
    against it and, on a link loaded both ways, queue behind the other direction's data: measured on the
    testbed, an exchange of equal streams over one link moves each ``1 + κ`` times slower than a lone
    stream (κ: :func:`gradsync.testbed.probe.probe_duplex` measures it) while one-way fan-in and fan-out
    lose nothing. Charging κ of a flow's rate to the opposite direction reproduces both: alone, the
    opposite direction has room; loaded both ways, ``x + κ x = C`` gives each ``C / (1 + κ)``.
    """
    if share == 0.0 or incidence.nnz == 0:
        return incidence
    rev = sp.csr_matrix((incidence.data * share, incidence.indices ^ 1, incidence.indptr), shape=incidence.shape)
    out = (incidence + rev).tocsr()
    out.sort_indices()
    return out


#: Rows of the flows x link-directions incidence as CSR arrays (indptr, indices, data).
Rows = tuple[np.ndarray, np.ndarray, np.ndarray]


def _flows_to_dirs(rows: Rows, n_dirs: int, v: np.ndarray) -> np.ndarray:
    """Per link direction, the sum over ``rows``' flows on it of incidence x ``v`` (``R.T @ v``), by SciPy's own
    kernel: what ``csr_matrix(...).T @ v`` runs, bit for bit, without building and checking a matrix per call."""
    ptr, idx, val = rows
    if _csc_matvec is None:  # pragma: no cover
        return sp.csr_matrix((val, idx, ptr), shape=(ptr.shape[0] - 1, n_dirs)).T @ v
    out = np.zeros(n_dirs)
    _csc_matvec(n_dirs, ptr.shape[0] - 1, ptr, idx, val, v, out)
    return out


def _dirs_to_flows(rows: Rows, n_dirs: int, v: np.ndarray) -> np.ndarray:
    """Per flow of ``rows``, the sum over the link directions it uses of incidence x ``v`` (``R @ v``)."""
    ptr, idx, val = rows
    if _csr_matvec is None:  # pragma: no cover
        return sp.csr_matrix((val, idx, ptr), shape=(ptr.shape[0] - 1, n_dirs)) @ v
    out = np.zeros(ptr.shape[0] - 1)
    _csr_matvec(out.shape[0], n_dirs, ptr, idx, val, v, out)
    return out


class _Engine:
    """The event loop over one :class:`FlowSet` in step order (:func:`by_step`); see the module docstring.

    Flow state: 0 waiting, 1 active (started, bytes left), 2 drained (all bytes sent). A dependency
    group ``g`` (the flows that share one list of dependencies) becomes ready when all its dependencies
    have started (streaming) or finished (store-and-forward); its members then start at ``ready_g``.
    Flows are numbered by step, so the flows that have started and not drained lie in a window
    ``[lo, hi)``; per-event work is on views of that window, with the waiting and drained flows inside
    it masked out.
    """

    def __init__(self, fs: FlowSet, streaming: bool, weight: np.ndarray, progress: TextIO | None, label: str,
                 fifo: bool = False, message_s: float = 0.0, reverse_share: float = 0.0,
                 release_s: np.ndarray | None = None, burst_s: float = 0.0, overlap: bool = False) -> None:
        n, ng = fs.num_flows, fs.num_groups
        self.fs = fs
        # What the rates see: a flow uses every link direction on its route fully and, with
        # ``reverse_share`` κ, κ of its rate on the opposite direction (direction ``e ^ 1``).
        self.inc = with_reverse_share(fs.incidence, reverse_share)
        self.streaming = streaming
        # Per-connection FIFO: one flow per ordered (src, dst) pair moves at a time, the others queue in
        # the order they became ready (then step order), as messages on one TCP connection do.
        self.fifo = fifo
        self.message_s = float(message_s)
        self.overlap = overlap
        if fifo:
            width = int(max(fs.src.max(), fs.dst.max())) + 1 if n else 1
            self.pair = fs.src * width + fs.dst
            self.pair_busy = np.zeros(width * width, bool)
            self.cpu_free = np.zeros(width)  # when each rank's thread is done with the messages it received
            self.granted = np.zeros(n, bool)  # popped from its connection's queue: the connection is held for it
            self.queued: dict[int, list[tuple[float, int]]] = {}
        self.weight = weight
        self.progress = progress
        self.label = label
        self.state = np.zeros(n, np.int8)
        self.x = np.zeros(n)
        self.start = np.full(n, np.nan)
        self.sent = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        # The earliest a flow may start whatever its dependencies: its sender's arrival (late ranks).
        self.release = np.zeros(n) if release_s is None else release_s
        self.ready_at = self.release.copy()
        self.tol_all = fs.size * _REL + 1e-12
        self.gneed = np.diff(fs.gdep_ptr)  # dependencies not yet started (streaming) / finished (s&f)
        self.gready = np.zeros(ng)  # max over dependencies of start + α (streaming) / finish (s&f)
        self.gfinish = np.zeros(ng)  # max finish over the dependencies drained so far
        self.gown = np.repeat(np.arange(ng, dtype=np.int64), self.gneed)
        self.dgrp_cnt = np.diff(fs.dgrp_ptr)
        self.gmem_cnt = np.diff(fs.gmem_ptr)
        self.inc_ptr = self.inc.indptr.astype(np.int64)
        self.inc_idx = self.inc.indices.astype(np.int64)
        self.inc_val = self.inc.data.astype(np.float64)
        self.n_dirs = int(self.inc.shape[1])
        self.pending = np.flatnonzero(fs.group < 0)
        self.busy = np.zeros(fs.capacity.shape[0])
        # Token buckets (module docstring): ``bucket`` bytes each, ``tokens`` left; ``link_cap`` what a direction
        # moves now (its rate, or BURST_PEAK times it while it has tokens).
        self.bucket = fs.capacity * burst_s if burst_s > 0 else None
        self.tokens = self.bucket.copy() if self.bucket is not None else None
        self.link_cap = fs.capacity * BURST_PEAK if self.bucket is not None else fs.capacity
        self.scratch = np.zeros(max(n, ng), np.int64)
        self.lo = self.hi = 0
        self.nact = 0
        self.now = 0.0
        self.events = 0
        self.fill_rounds = 0
        self.drained = 0
        self.max_active = 0
        self.changed = True
        self.any_latency = bool(np.any(fs.latency_s > 0))
        self._rows: dict[int, tuple[tuple[int, float], ...]] = {}  # a flow's incidence row, for _few_rates
        # the active flows' rows, made once per window for the vectorised filling and for the plain-Python one
        self._compact: tuple[np.ndarray, ...] | None = None
        self._few: tuple[np.ndarray, list[Any], list[float], list[int] | None] | None = None

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _dedupe(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` without repeats (one occurrence of each kept), in O(len) with a scratch array, no sort."""
        if ids.size < 2:
            return ids
        k = np.arange(ids.size, dtype=np.int64)
        self.scratch[ids] = k  # of repeated ids one write wins; keep exactly that occurrence
        return ids[self.scratch[ids] == k]

    def _release(self, ids: np.ndarray, at: np.ndarray) -> None:
        """``ids`` started (streaming) or finished (store-and-forward): their groups may go at ``at``."""
        fs = self.fs
        cnt = self.dgrp_cnt[ids]
        if not cnt.any():
            return
        gs = fs.dgrp_idx[_ranges(fs.dgrp_ptr[ids], cnt)]
        np.maximum.at(self.gready, gs, np.repeat(at, cnt))
        np.add.at(self.gneed, gs, -1)
        ready = self._dedupe(gs[self.gneed[gs] == 0])
        if ready.size:
            mcnt = self.gmem_cnt[ready]
            members = fs.gmem_idx[_ranges(fs.gmem_ptr[ready], mcnt)]
            self.ready_at[members] = np.maximum(np.repeat(self.gready[ready], mcnt), self.release[members])
            self.pending = np.concatenate([self.pending, members])

    def _start_ready(self) -> None:
        """Start every pending flow whose time has come, cascading through zero-delay dependents."""
        fs = self.fs
        while self.pending.size:
            go = self.ready_at[self.pending] <= self.now * (1 + _REL) + 1e-300
            if not go.any():
                return
            ids = self.pending[go]
            self.pending = self.pending[~go]
            if self.fifo:
                ids = self._admit(ids)
                if not ids.size:
                    continue
            self.start[ids] = np.minimum(self.ready_at[ids], self.now)
            self.state[ids] = 1
            self.hi = max(self.hi, int(ids.max()) + 1)
            self.changed = True
            if self.streaming:
                self._release(ids, self.start[ids] + fs.latency_s[ids])
            empty = ids[fs.size[ids] <= 0]
            if empty.size:
                self._drain(empty)

    def _admit(self, ids: np.ndarray) -> np.ndarray:
        """Of the flows ready now, those that may start: the first of each idle connection; queue the rest."""
        ids = np.sort(ids)
        granted = self.granted[ids]
        rest = ids[~granted]
        pairs = self.pair[rest]
        _, first = np.unique(pairs, return_index=True)
        go = np.zeros(rest.shape[0], bool)
        go[first] = True
        go &= ~self.pair_busy[pairs]
        for f in rest[~go].tolist():
            heapq.heappush(self.queued.setdefault(int(self.pair[f]), []), (float(self.ready_at[f]), f))
        self.pair_busy[self.pair[rest[go]]] = True
        return np.concatenate([ids[granted], rest[go]])

    def _next_on_connections(self, ids: np.ndarray) -> None:
        """``ids`` drained: each connection takes its next queued message once the last one has finished
        (arrived and been handled, its α), so a connection serves one message per ``bytes/β + α``."""
        nxt, at = [], []
        for f in ids.tolist():
            p = int(self.pair[f])
            q = self.queued.get(p)
            if q:
                nxt.append(heapq.heappop(q)[1])
                at.append(max(float(self.finish[f]), self.now))
            else:
                self.pair_busy[p] = False
        if nxt:
            got = np.array(nxt, np.int64)
            self.granted[got] = True
            self.ready_at[got] = np.array(at)
            self.pending = np.concatenate([self.pending, got])

    def _deps_of(self, ids: np.ndarray) -> np.ndarray:
        fs = self.fs
        g = fs.group[ids]
        # Many flows share a dependency group (PS: ~1M broadcasts over N groups); expand each group once,
        # or the index array grows to flows x fan-in (18 GB on PS over BCube(32,2)).
        g = np.unique(g[g >= 0])
        return fs.gdep_idx[_ranges(fs.gdep_ptr[g], fs.gdep_ptr[g + 1] - fs.gdep_ptr[g])]

    def _drain(self, ids: np.ndarray) -> None:
        """``ids`` have sent their last byte now; set sent/finish times and release dependents."""
        fs = self.fs
        self.state[ids] = 2
        if self.streaming:
            # x_t <= x_d: an active dependency of a drained flow has drained too (to rounding).
            new = ids
            while True:
                deps = self._deps_of(new)
                new = self._dedupe(deps[self.state[deps] == 1])
                if not new.size:
                    break
                self.state[new] = 2
                ids = np.concatenate([ids, new])
        self.x[ids] = fs.size[ids]
        self.sent[ids] = self.now
        self.drained += ids.size
        self.changed = True
        if self.fifo and self.message_s > 0:
            # The receiver handles one message at a time (one thread waits, adds, posts the next): each
            # arrival takes α of its receiver's time, in arrival order.
            self.finish[ids] = self.now + fs.latency_s[ids] - self.message_s
            for f in ids[np.argsort(self.finish[ids], kind="stable")].tolist():
                d = int(fs.dst[f])
                if self.overlap:  # α runs while the bytes arrive: done at the later of the two
                    done = max(float(self.finish[f]), max(float(self.start[f]), float(self.cpu_free[d])) + self.message_s)
                else:
                    done = max(float(self.finish[f]), float(self.cpu_free[d])) + self.message_s
                self.finish[f] = self.cpu_free[d] = done
        elif not self.streaming or not self.any_latency:
            # Store-and-forward: dependencies finished before the flow started. Streaming without latency:
            # dependencies drained no later than the flow (x_t <= x_d), so the max below is now.
            self.finish[ids] = self.now + fs.latency_s[ids]
        else:
            steps = fs.step[ids]
            for s in np.unique(steps):  # dependencies first: they have lower steps
                g_ids = ids[steps == s] if steps.size > 1 else ids
                grp = fs.group[g_ids]
                last = np.where(grp >= 0, np.maximum(self.gfinish[np.maximum(grp, 0)], self.now), self.now)
                self.finish[g_ids] = last + fs.latency_s[g_ids]
                cnt = self.dgrp_cnt[g_ids]
                if cnt.any():
                    gs = fs.dgrp_idx[_ranges(fs.dgrp_ptr[g_ids], cnt)]
                    np.maximum.at(self.gfinish, gs, np.repeat(self.finish[g_ids], cnt))
        if not self.streaming:
            self._release(ids, self.finish[ids])
        if self.fifo:
            self._next_on_connections(ids)

    # ---- rates -----------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Window views: active mask, incidence rows, and the window groups' live dependencies."""
        fs = self.fs
        if self.lo < self.hi:
            open_ = np.flatnonzero(self.state[self.lo:self.hi] != 2)
            self.lo = self.lo + int(open_[0]) if open_.size else self.hi
        lo, hi = self.lo, self.hi
        w = hi - lo
        self.act = self.state[lo:hi] == 1
        self.nact = int(np.count_nonzero(self.act))
        self.max_active = max(self.max_active, self.nact)
        p0, p1 = self.inc_ptr[lo], self.inc_ptr[hi]
        # The window's rows of the incidence (flows x link directions) as CSR arrays, multiplied by SciPy's own
        # kernels (_flows_to_dirs, _dirs_to_flows): what ``csr_matrix(...) @ v`` and ``.T @ v`` run, bit for
        # bit, without building and checking two matrix objects per event (that was most of an event's time).
        self.R_ptr = self.inc_ptr[lo:hi + 1] - p0
        self.R_idx = self.inc_idx[p0:p1]
        self.R_val = self.inc_val[p0:p1]
        self._compact = self._few = None  # the active flows' rows alone, made when rates without caps need them
        self.w: np.ndarray | None = None  # made when the window's filling needs it (:meth:`_rates`)
        self.tol = self.tol_all[lo:hi]
        self.size_w = fs.size[lo:hi]
        self.has_caps = False
        self.changed = False
        if not (self.streaming and self.nact):
            return
        gw = fs.group[lo:hi]
        cap = self.act & (gw >= 0)
        if not cap.any():
            return
        gsel = gw[cap]
        glo, ghi = int(gsel.min()), int(gsel.max()) + 1
        e0, e1 = int(fs.gdep_ptr[glo]), int(fs.gdep_ptr[ghi])
        e_d = fs.gdep_idx[e0:e1] - lo
        inside = (e_d >= 0) & (e_d < w)
        self.e_d = np.where(inside, e_d, 0)
        self.live = inside & self.act[self.e_d]  # dependencies that are active (started, not drained)
        if not self.live.any():
            return
        self.e_g = self.gown[e0:e1] - glo
        self.seg = fs.gdep_ptr[glo:ghi] - e0  # every group has a dependency: no empty segment
        seg_len = np.diff(fs.gdep_ptr[glo:ghi + 1])
        self.seg_max = int(seg_len.max())
        self.seg_more: list[tuple[np.ndarray, np.ndarray]] = []
        if self.seg_max <= 8:
            for k in range(1, self.seg_max):
                more = np.flatnonzero(seg_len > k)
                self.seg_more.append((more, self.seg[more] + k))
        self.t_g = np.where(cap, gw - glo, 0)
        self.cap = cap
        self.gact = np.zeros(ghi - glo, bool)
        self.gact[self.t_g[cap]] = True
        self.has_caps = True

    def _seg_min(self, values: np.ndarray) -> np.ndarray:
        """Min of ``values`` (one per dependency of the window's groups) per group.

        ``np.minimum.reduceat`` pays per segment; groups usually have a handful of dependencies, so for
        short segments a few vectorised passes over the k-th member of every group are faster.
        """
        if self.seg_max > 8:
            return np.minimum.reduceat(values, self.seg)
        out = values[self.seg]
        for more, kth in self.seg_more:
            out[more] = np.minimum(out[more], values[kth])
        return out

    def _active_rows(self) -> tuple[np.ndarray, ...]:
        """The active flows' window positions, their rows of the incidence (CSR) and their weights: a window spans
        every flow from the oldest undrained one to the newest started one, most of them waiting or drained (with
        FIFO connections, a thousand flows around a handful active), and the rates need the active ones only."""
        if self._compact is None:
            at = np.flatnonzero(self.act)
            first = self.R_ptr[at]
            count = self.R_ptr[at + 1] - first
            ptr = np.zeros(at.size + 1, np.int64)
            np.cumsum(count, out=ptr[1:])
            rows = _ranges(first, count)
            self._compact = (at, ptr, self.R_idx[rows], self.R_val[rows], self.weight[self.lo + at])
        return self._compact

    def _rates(self, xw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Weighted max-min fair rates with the streaming caps (progressive filling), and link usage.

        Every unfrozen flow has rate ``λ w_f``; link direction e saturates at ``λ_e = (C_e - used_e) / W_e``
        with ``W_e`` the unfrozen weight on it. A flow caught up with its group's slowest dependencies
        (``x_t == X_g = min_d x_d``) freezes when one of those *tight* dependencies freezes, at its rate
        (same size and weight): so ``r_t <= min`` over tight dependencies and ``x_t <= X_g`` holds.
        """
        caught_any = False
        if self.has_caps:
            xd = xw[self.e_d]
            self.X = self._seg_min(np.where(self.live, xd, np.inf))
            self.Xt = self.X[self.t_g]
            self.capped = self.cap & np.isfinite(self.Xt)
            self.caught = self.capped & (xw >= self.Xt - self.tol)
            self.tight = self.live & (xd <= self.X[self.e_g] + self.tol[self.e_d])
            caught_any = bool(self.caught.any())
        if self.w is None:  # the window's weights, zero where a flow is not active: once per window
            self.w = np.where(self.act, self.weight[self.lo:self.hi], 0.0)
        return self._fill((self.R_ptr, self.R_idx, self.R_val), self.w, self.act.copy(), caught_any)

    def _fill(self, rows: Rows, w: np.ndarray, free: np.ndarray, caught_any: bool) -> tuple[np.ndarray, np.ndarray]:
        """Progressive filling of the flows of ``rows`` (weights ``w``) that are ``free``: their rates, and link
        usage. ``caught_any``: some flow is caught up with its dependencies (:meth:`_rates`; on the window's rows)."""
        cap_e = self.link_cap
        rate = np.zeros(w.shape[0])
        used = np.zeros(cap_e.shape[0])
        level = 0.0
        left = int(np.count_nonzero(free))
        while left:
            self.fill_rounds += 1
            weight_e = _flows_to_dirs(rows, self.n_dirs, np.where(free, w, 0.0))
            on = weight_e > 0
            lam_e = np.full(cap_e.shape[0], np.inf)
            lam_e[on] = (cap_e[on] - used[on]) / weight_e[on]
            level = max(level, float(lam_e.min()))
            sat = on & (lam_e <= level * (1 + 1e-12))
            newly = free & (_dirs_to_flows(rows, self.n_dirs, sat.astype(float)) > 0)
            if caught_any:
                frontier = newly
                while True:
                    hit_g = np.zeros(self.gact.shape[0], bool)
                    hit_g[self.e_g[self.tight & frontier[self.e_d]]] = True
                    hit = free & ~newly & self.caught & hit_g[self.t_g]
                    if not hit.any():
                        break
                    newly |= hit
                    frontier = hit
            k = int(np.count_nonzero(newly))
            if k == 0:  # pragma: no cover - a saturated link always has an unfrozen flow
                raise SimulationError(f"simulation of {self.label}: progressive filling made no progress")
            rate[newly] = level * w[newly]
            used += _flows_to_dirs(rows, self.n_dirs, np.where(newly, rate, 0.0))
            free &= ~newly
            left -= k
        return rate, used

    def _uncapped_rates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_rates` where no flow is capped by a dependency, on the active flows' rows alone: their window
        positions, their rates and the link usage. The same operations in the same order as on the whole window
        (its other rows only add zeros), so the same bits."""
        if self.nact <= FEW_ACTIVE:
            return self._few_rates()
        at, ptr, idx, val, w = self._active_rows()
        rate, used = self._fill((ptr, idx, val), w, np.ones(at.size, bool), False)
        return at, rate, used

    def _row(self, flow: int) -> tuple[tuple[int, float], ...]:
        """Flow ``flow``'s row of the incidence as (link direction, share) pairs, in the row's order (made once)."""
        got = self._rows.get(flow)
        if got is None:
            a, b = int(self.inc_ptr[flow]), int(self.inc_ptr[flow + 1])
            got = self._rows[flow] = tuple(zip(self.inc_idx[a:b].tolist(), self.inc_val[a:b].tolist()))
        return got

    def _few_rates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_uncapped_rates` for a few active flows, in plain Python floats (IEEE doubles, as numpy's): each sum
        over a link direction adds the same products in the same order as SciPy's kernels do over the rows (a row
        that is not summed would add 0.0, which changes no sum), so the results are the same bits. On a fabric of more
        than :data:`FEW_DIRECTIONS` link directions, over those the active routes touch alone (numbered in the order
        first met; the others carry no weight and stay unused): a pass over every direction would cost more than
        the flows."""
        if self._few is None:
            at = np.flatnonzero(self.act)
            rows = [self._row(f) for f in (self.lo + at).tolist()]
            touched = None
            if self.n_dirs > FEW_DIRECTIONS:
                local: dict[int, int] = {}
                for row in rows:
                    for d, _ in row:
                        local.setdefault(d, len(local))
                rows = [tuple((local[d], v) for d, v in row) for row in rows]
                touched = list(local)
            self._few = (at, rows, self.weight[self.lo + at].tolist(), touched)
        at, rows, w, touched = self._few
        cap = (self.link_cap if touched is None else self.link_cap[touched]).tolist()
        m = len(cap)
        n = len(rows)
        rate = [0.0] * n
        free = [True] * n
        used = [0.0] * m
        level = 0.0
        left = n
        inf = math.inf
        while left:
            self.fill_rounds += 1
            weight_e = [0.0] * m
            for i in range(n):
                if free[i]:
                    wi = w[i]
                    for d, v in rows[i]:
                        weight_e[d] += v * wi
            lam = [(cap[d] - used[d]) / weight_e[d] if weight_e[d] > 0 else inf for d in range(m)]
            level = max(level, min(lam))
            bar = level * (1 + 1e-12)
            sat = [weight_e[d] > 0 and lam[d] <= bar for d in range(m)]
            newly = []
            for i in range(n):
                if free[i]:
                    hit = 0.0
                    for d, v in rows[i]:
                        if sat[d]:
                            hit += v
                    if hit > 0:
                        newly.append(i)
            if not newly:  # pragma: no cover - a saturated link always has an unfrozen flow
                raise SimulationError(f"simulation of {self.label}: progressive filling made no progress")
            add = [0.0] * m
            for i in newly:
                r = rate[i] = level * w[i]
                free[i] = False
                for d, v in rows[i]:
                    add[d] += v * r
            for d in range(m):
                used[d] += add[d]
            left -= len(newly)
        if touched is None:
            return at, np.array(rate), np.array(used)
        out = np.zeros(self.n_dirs)
        out[touched] = used
        return at, np.array(rate), out

    def _catch_up_dt(self, xw: np.ndarray, rate: np.ndarray) -> float:
        """Time until a capped flow reaches its group's envelope ``min_d x_d(τ)``, or the envelope bends."""
        if not self.has_caps:
            return np.inf
        rd = rate[self.e_d]
        slope = self._seg_min(np.where(self.tight, rd, np.inf))  # the envelope's slope now
        dt = np.inf
        # A live, non-tight dependency slower than the envelope will become the minimum.
        s = slope[self.e_g]
        bend = self.live & ~self.tight & self.gact[self.e_g] & (rd < s * (1 - 1e-12))
        if bend.any():
            gap = xw[self.e_d[bend]] - self.X[self.e_g[bend]]
            dt = min(dt, float((gap / (s[bend] - rd[bend])).min()))
        # A flow that is behind and faster than the envelope catches up.
        st = slope[self.t_g]
        closing = self.capped & ~self.caught & (rate > st * (1 + 1e-12))
        if closing.any():
            gap = self.Xt[closing] - xw[closing]
            dt = min(dt, float((gap / (rate[closing] - st[closing])).min()))
        return dt

    def _empty_dt(self, used: np.ndarray) -> float:
        """Time until a bucket that drains (its load above its rate) runs empty; inf without buckets."""
        if self.tokens is None:
            return np.inf
        draining = (self.tokens > 0) & (used > self.fs.capacity)
        if not draining.any():
            return np.inf
        return float((self.tokens[draining] / (used[draining] - self.fs.capacity[draining])).min())

    def _spend(self, used: np.ndarray, dt: float) -> None:
        """Drain the buckets for ``dt`` at load ``used`` (never refilled within a collective: module docstring);
        a bucket within rounding of empty is empty, its direction back to its rate."""
        if self.tokens is None or dt <= 0:
            return
        cap = self.fs.capacity
        t = self.tokens - np.maximum(used - cap, 0.0) * dt
        t[t <= self.bucket * _REL] = 0.0
        self.tokens = t
        self.link_cap = np.where(t > 0, cap * BURST_PEAK, cap)

    def _check(self, xw: np.ndarray, used: np.ndarray) -> None:
        """Invariants of the model (only under ``_DEBUG``): capacities hold and no flow overtakes a dependency."""
        assert np.all(used <= self.link_cap * (1 + 1e-9)), "a link direction carries more than its bandwidth"
        if self.has_caps:
            x_min = self._seg_min(np.where(self.live, xw[self.e_d], np.inf))[self.t_g]
            over = np.where(self.cap & np.isfinite(x_min), xw - x_min, 0.0)
            assert np.all(over <= 1e-6 * self.size_w), f"a flow overtook its dependency by {over.max()} B"

    # ---- the loop --------------------------------------------------------------------------------------
    def run(self, max_events: int | None) -> None:
        fs = self.fs
        last_report = time.monotonic()
        while True:
            self._start_ready()
            if self.changed:
                self._rebuild()
            if self.nact == 0:
                if not self.pending.size:
                    break
                self.now = max(self.now, float(self.ready_at[self.pending].min()))
                continue
            self.events += 1
            if max_events is not None and self.events > max_events:
                raise SimulationError(f"simulation of {self.label} passed max_events={max_events} at t={self.now:.6g} s")
            xw = self.x[self.lo:self.hi]  # a view: advancing it advances the flows
            if self.has_caps:
                at = None
                rate, used = self._rates(xw)
                with np.errstate(divide="ignore", invalid="ignore"):
                    t_drain = np.where(rate > 0, (self.size_w - xw) / rate, np.inf)
                dt = min(float(t_drain.min()), self._catch_up_dt(xw, rate), self._empty_dt(used))
            else:  # the active flows alone (the window's others have no rate: they neither move nor drain)
                at, rate, used = self._uncapped_rates()
                xa, size_a = xw[at], self.size_w[at]
                with np.errstate(divide="ignore", invalid="ignore"):
                    t_drain = np.where(rate > 0, (size_a - xa) / rate, np.inf)
                dt = min(float(t_drain.min()), self._empty_dt(used))
            if self.pending.size:
                dt = min(dt, float(self.ready_at[self.pending].min()) - self.now)
            if not math.isfinite(dt):
                raise SimulationError(
                    f"simulation of {self.label} is stuck at t={self.now:.6g} s: {self.nact} active flows have no rate"
                )
            dt = max(dt, 0.0)
            if at is None:
                xw += rate * dt
            else:
                xa += rate * dt
                xw[at] = xa
            self.busy += used * dt
            self.now += dt
            if _DEBUG:
                self._check(xw, used)
            self._spend(used, dt)
            if at is None:
                done = self.lo + np.flatnonzero(self.act & ((t_drain <= dt * (1 + _REL)) | (self.size_w - xw <= self.tol)))
            else:
                done = self.lo + at[(t_drain <= dt * (1 + _REL)) | (size_a - xa <= self.tol[at])]
            if done.size:
                self._drain(done)
            if self.progress is not None and time.monotonic() - last_report >= _PROGRESS_EVERY_S:
                last_report = time.monotonic()
                print(
                    f"gradsync simulate: {self.label}: t={self.now:.6g} s, {self.drained}/{fs.num_flows} flows done, "
                    f"{self.nact} active, {self.events} events",
                    file=self.progress, flush=True,
                )
        if self.drained != fs.num_flows:  # pragma: no cover - steps are acyclic, so every flow starts
            raise SimulationError(f"simulation of {self.label}: {fs.num_flows - self.drained} flows never started")


def simulate(
    schedule: Schedule,
    topology: Topology,
    size_bytes: float | Sequence[float] | np.ndarray,
    *,
    streaming: bool = True,
    latency: bool = True,
    latency_s: float | None = None,
    message_s: float = 0.0,
    merge_tensors: bool = True,
    fairness: str = "size",
    fifo: bool = False,
    reverse_share: float = 0.0,
    burst_s: float = 0.0,
    start_delay_s: Sequence[float] | Mapping[int, float] | None = None,
    message_overlap: bool = False,
    progress: bool | TextIO | None = None,
    max_events: int | None = None,
) -> SimResult:
    """Simulate ``schedule`` on ``topology`` for ``size_bytes`` (one buffer, or a list of tensor sizes).

    * ``streaming``: inputs stream through a transfer (default) or it waits for them (store-and-forward).
    * ``latency``: honour the links' ``latency_s``; ``latency_s`` overrides every hop's (seconds per hop).
    * ``message_s``: a per-message cost added once to every flow's latency (the runtime's α, see
      :mod:`gradsync.sim.cost`), on top of the hops' latencies.
    * ``merge_tensors``: a tensor list moves as one flow per transfer (default) or one per (tensor, transfer).
    * ``fairness``: ``"size"`` shares links max-min fairly per byte of flow (default), ``"flow"`` per flow.
    * ``fifo``: messages between one (src, dst) pair go one after another, in the order they became ready
      (one TCP connection per peer, as gloo and the executor use), and a receiver handles its arrivals one
      at a time, ``message_s`` each (one thread waits, adds, posts): sub-chunks then pipeline through
      relays, and a rank that receives many messages (a parameter server's owner) pays for each.
    * ``reverse_share``: κ in [0, 1): every flow also takes κ of its rate from the opposite direction of
      each link on its route (TCP acknowledgements on a link loaded both ways, :func:`with_reverse_share`);
      the runtime's cost model sets it from a probe, 0 is the pure fluid model.
    * ``burst_s``: seconds of tokens per link direction at its own rate (a shaper's token bucket, module
      docstring); 0 (default): links move their rate and no faster.
    * ``start_delay_s``: when each rank reaches the collective, in seconds after the on-time ranks (one value
      per rank, or ``{rank: delay}`` for the late ones): a late rank sends nothing before then (module
      docstring). ``None`` (default): every rank at 0.
    * ``message_overlap`` (with ``fifo``): a message's ``message_s`` runs while its bytes move, not after them:
      it is done at the later of its arrival and its start (or its receiver's previous message) plus
      ``message_s``. The backend's own ring (gloo's C++) works so: a receiver that wakes late for a step finds
      the step's bytes waiting, so a step costs the longer of α and the wire, not their sum. The executor's α is
      CPU on a shared host's cores and stays in series (False).
    * ``progress``: a line on stderr every 2 s; ``None``: only when stderr is a terminal; or a stream.
    * ``max_events``: stop with :class:`SimulationError` after this many events (default: no limit).

    Returns a :class:`SimResult`; the model is in this module's docstring.
    """
    sizes = tensor_sizes(size_bytes)
    if isinstance(reverse_share, bool) or not isinstance(reverse_share, (int, float)) or not 0 <= reverse_share < 1:
        raise SimulationError(f"reverse_share={reverse_share!r} must lie in [0, 1): the share of a flow's rate "
                              f"its acknowledgements take on the opposite link direction")
    if isinstance(burst_s, bool) or not isinstance(burst_s, (int, float)) or not (math.isfinite(burst_s) and burst_s >= 0):
        raise SimulationError(f"burst_s={burst_s!r} must be a finite number of seconds >= 0: how long a link's "
                              f"token bucket lasts at its own rate (0: no bucket)")
    if fairness not in FAIRNESS:
        raise SimulationError(f"fairness={fairness!r}; use one of {list(FAIRNESS)}")
    delays = start_delays(start_delay_s, topology.world_size)
    wall = time.perf_counter()
    fs = build_flows(schedule, topology, sizes, merge=merge_tensors, latency=latency, latency_s=latency_s, message_s=message_s)
    stream: TextIO | None
    if progress is None:
        stream = sys.stderr if sys.stderr.isatty() else None
    elif progress is True:
        stream = sys.stderr
    elif progress is False:
        stream = None
    else:
        stream = progress
    label = f"{schedule.algorithm} on {topology.name}"
    weight = fs.size / max(float(fs.size.max()), 1e-300) if fairness == "size" and fs.num_flows else np.ones(fs.num_flows)
    ordered, perm = by_step(fs)
    release = np.asarray(delays)[ordered.src] if delays and ordered.num_flows else None
    eng = _Engine(ordered, streaming, weight[perm], stream, label, fifo, message_s, float(reverse_share), release,
                  float(burst_s), bool(message_overlap))
    eng.run(max_events)
    back = np.empty_like(perm)  # flow in schedule order -> its index in step order
    back[perm] = np.arange(perm.shape[0], dtype=np.int64)
    time_s = float(eng.finish.max()) if fs.num_flows else 0.0
    unit = float(topology.unit_bandwidth_GBps or 1.0)
    t_f = sum(sizes) / (unit * 1e9)
    busy_s = (eng.busy / fs.capacity).reshape(-1, 2)
    inc = fs.incidence
    return SimResult(
        topology=topology.name,
        algorithm=schedule.algorithm,
        tensor_sizes=sizes,
        streaming=streaming,
        merged=merge_tensors,
        fairness=fairness,
        fifo=fifo,
        latency_s=(latency_s if latency else 0.0),
        time_s=time_s,
        t_f_s=t_f,
        gst_over_tf=time_s / t_f,
        unit_bandwidth_GBps=unit,
        events=eng.events,
        fill_rounds=eng.fill_rounds,
        max_active_flows=eng.max_active,
        wall_s=time.perf_counter() - wall,
        links=tuple((lk.a, lk.b, lk.kind) for lk in topology.links),
        link_bandwidth_GBps=np.array([lk.directed_GBps for lk in topology.links], float).reshape(-1, 2),
        link_busy_s=busy_s,
        link_utilisation=busy_s / time_s if time_s > 0 else np.zeros_like(busy_s),
        start_s=eng.start[back],
        sent_s=eng.sent[back],
        finish_s=eng.finish[back],
        flow_transfer=fs.transfer,
        flow_tensor=fs.tensor,
        flow_chunk=fs.chunk,
        flow_step=fs.step,
        flow_src=fs.src,
        flow_dst=fs.dst,
        flow_link_ptr=inc.indptr.astype(np.int64),
        flow_link_idx=inc.indices.astype(np.int64),
        reverse_share=float(reverse_share),
        start_delay_s=delays,
        burst_s=float(burst_s),
    )


def start_delays(delays: Sequence[float] | Mapping[int, float] | None, world_size: int) -> tuple[float, ...]:
    """Per-rank arrival times from :func:`simulate`'s ``start_delay_s``; ``()`` when nobody is late.

    Raises :class:`SimulationError` naming the value: a delay is a finite number of seconds >= 0, given
    for ranks ``0 .. world_size - 1``."""
    if delays is None:
        return ()
    if isinstance(delays, Mapping):
        out = [0.0] * world_size
        for rank, d in delays.items():
            if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
                raise SimulationError(f"start_delay_s names rank {rank!r}; the topology has ranks 0..{world_size - 1}")
            out[rank] = d
    else:
        out = list(delays)
        if len(out) != world_size:
            raise SimulationError(f"start_delay_s has {len(out)} values for {world_size} ranks; give one per rank "
                                  f"or a {{rank: delay}} mapping")
    for rank, d in enumerate(out):
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not (math.isfinite(d) and d >= 0):
            raise SimulationError(f"start_delay_s[{rank}]={d!r} must be a finite number of seconds >= 0")
    vals = tuple(float(d) for d in out)
    return vals if any(vals) else ()
