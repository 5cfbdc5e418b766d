"""Iteration simulator: one training or inference iteration of W workers, compute DAG plus transfers.

Each worker runs the same :class:`~gradsync.order.Dag` (TicTac's Model Replica) on one compute resource,
one op at a time, an op starting once its inputs are done and the parameters it reads have arrived. The
network, in ``mode``:

* ``ps`` (default): a channel per worker and direction (downlink for pulls, uplink for pushes) of
  ``bandwidth_GBps``; all workers' channels share the server's NIC of ``server_bandwidth_GBps`` per
  direction (``None``: the server is never the bottleneck). Sharing is max-min fair (fluid): with ``k``
  workers sending, each gets ``min(B, S/k)``, split equally among its in-flight chunks. Every pull is
  activated when the iteration starts (the PS activates all sends, TicTac §2.2); a training DAG's send ops
  push a gradient once its backward ops are done, first-come first-served on the uplink.
* ``allreduce``: one collective channel for all workers (ring cost: a chunk of ``n`` bytes takes
  ``2(W-1)/W · n/B + 2(W-1)α``). The parameter transfers are the allreduces of the previous iteration's
  gradients, issued in priority order when the iteration starts, and an op reading a parameter waits for
  its allreduce (ByteScheduler's cross-iteration view); this iteration's sends are free (they are the next
  iteration's allreduces). All workers agree on one order, so worker 0's priorities are used.

Order: each channel picks its next chunk by (priority, random tie-break): priorities from an ordering name
(``random``, ``fifo``, ``tic``, ``tac``: :data:`gradsync.order.ORDERINGS`; ``random`` draws a different order
per worker), an explicit ``{param: priority}``, or one mapping per worker. ``partition_bytes`` splits
transfers into chunks; ``credit_bytes`` lets a channel keep that many bytes in flight (ByteScheduler's
credit; ``None``: one chunk at a time, gRPC's one active transfer per channel). A chunk's latency ``α`` is
paid after its last byte leaves and does not hold the channel.

The result has the makespan, each worker's finish time (and the straggler percentage), the order in which
each worker received its parameters, and a per-event timeline for :func:`plot_iteration`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradsync.errors import SimulationError
from gradsync.order.dag import KIND_SEND, Dag
from gradsync.order.oracle import LinkModel, TimeOracle, time_oracle
from gradsync.order.priorities import ORDERINGS, check_priorities, ordering
from gradsync.order.tictac import straggler_percent
from gradsync.registry import Registry

__all__ = ["ITERATION_MODES", "IterationConfig", "IterationEvent", "IterationResult", "plot_iteration",
           "resolve_priorities", "simulate_iteration"]

#: Network models of :func:`simulate_iteration` (summaries; the code branches on the two channel kinds).
ITERATION_MODES: Registry[str] = Registry("iteration mode", SimulationError)
ITERATION_MODES.add("ps", "parameter server: per-worker downlink/uplink channels sharing the server NIC")
ITERATION_MODES.add("allreduce", "one ring-allreduce channel; transfers are last iteration's gradient allreduces")

Order = str | Mapping[str, int] | Sequence[Mapping[str, int]]


@dataclass(frozen=True)
class IterationConfig:
    """Workers and network of one simulated iteration (bandwidths in GB/s per direction, sizes in bytes)."""

    workers: int = 1
    mode: str = "ps"
    bandwidth_GBps: float = 1.0
    server_bandwidth_GBps: float | None = None
    alpha_s: float = 0.0
    partition_bytes: int | None = None
    credit_bytes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise SimulationError(f"workers={self.workers!r} must be a positive integer")
        object.__setattr__(self, "mode", ITERATION_MODES.canonical(self.mode))
        for label, v, allow_none in (("bandwidth_GBps", self.bandwidth_GBps, False),
                                     ("server_bandwidth_GBps", self.server_bandwidth_GBps, True)):
            if v is None and allow_none:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise SimulationError(f"{label}={v!r} must be a positive number of GB/s" + (" or None" if allow_none else ""))
        if isinstance(self.alpha_s, bool) or not isinstance(self.alpha_s, (int, float)) or not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise SimulationError(f"alpha_s={self.alpha_s!r} must be a latency in seconds >= 0")
        for label, v in (("partition_bytes", self.partition_bytes), ("credit_bytes", self.credit_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SimulationError(f"{label}={v!r} must be a positive number of bytes or None")

    @property
    def link(self) -> LinkModel:
        """The per-worker link as a time-oracle link model (what TAC is told a transfer costs)."""
        return LinkModel(self.bandwidth_GBps, self.alpha_s)


@dataclass(frozen=True)
class IterationEvent:
    """One bar of the timeline: an op on ``compute``, or a chunk on ``downlink``/``uplink``/``allreduce``."""

    worker: int
    resource: str
    name: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class IterationResult:
    """Makespan (the slowest worker), per-worker finish times and receive orders, and the timeline."""

    dag: str
    config: IterationConfig
    makespan_s: float
    finish_s: tuple[float, ...]
    recv_order: tuple[tuple[str, ...], ...]
    events: tuple[IterationEvent, ...] = field(repr=False)

    @property
    def straggler_percent(self) -> float:
        """TicTac §6.3: the longest wait of a worker for the slowest, in percent of the iteration."""
        return straggler_percent(self.finish_s)

    def to_dict(self, *, events: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "gradsync.sim.iteration", "dag": self.dag, "config": asdict(self.config),
                               "makespan_s": self.makespan_s, "finish_s": list(self.finish_s),
                               "straggler_percent": self.straggler_percent,
                               "recv_order": [list(o) for o in self.recv_order]}
        if events:
            out["events"] = [asdict(e) for e in self.events]
        return out


def resolve_priorities(dag: Dag, order: Order, workers: int, *, oracle: TimeOracle | None = None,
                       seed: int = 0) -> list[dict[str, int]]:
    """One priority list per worker from an ordering name, one mapping, or one mapping per worker."""
    if isinstance(order, str):
        method = ORDERINGS.canonical(order)
        if method == "random":
            return [ordering(dag, method, oracle, seed=seed * 100_003 + w) for w in range(workers)]
        prio = ordering(dag, method, oracle or time_oracle(dag), seed=seed)
        return [prio] * workers
    if isinstance(order, Mapping):
        return [check_priorities(dag, order)] * workers
    lists = list(order)
    if len(lists) != workers or not all(isinstance(x, Mapping) for x in lists):
        raise SimulationError(f"order has {len(lists)} entries for {workers} workers; give an ordering name, one "
                              f"{{param: priority}} mapping, or one mapping per worker")
    return [check_priorities(dag, x) for x in lists]


class _Flow:
    __slots__ = ("worker", "channel", "param", "nbytes", "left", "rate", "start", "chunk")

    def __init__(self, worker: int, channel: int, param: int, nbytes: float, start: float, chunk: int) -> None:
        self.worker, self.channel, self.param, self.nbytes = worker, channel, param, nbytes
        self.left, self.rate, self.start, self.chunk = nbytes, 0.0, start, chunk


_DOWN, _UP = 0, 1
_RESOURCE = {_DOWN: "downlink", _UP: "uplink"}


def simulate_iteration(dag: Dag, order: Order = "random", config: IterationConfig | None = None, *,
                       oracle: TimeOracle | None = None, seed: int = 0, record: bool = True) -> IterationResult:
    """Simulate one iteration of ``dag`` on ``config.workers`` workers with transfers in ``order``.

    Compute times are the DAG's ``time_s`` (profile it first); transfer times follow ``config``. ``oracle``
    is only used to compute a named ordering (default: the DAG's times with ``config.link``); ``seed``
    draws random orders and breaks priority ties. ``record=False`` skips the timeline (faster sweeps).
    """
    cfg = config or IterationConfig()
    W, n = cfg.workers, len(dag.params)
    if isinstance(order, str) and oracle is None:
        oracle = time_oracle(dag, cfg.link)
    prios = resolve_priorities(dag, order, W, oracle=oracle, seed=seed)
    ops = dag.ops
    nops = len(ops)
    pidx = dag.param_index
    nbytes = [float(p.nbytes) for p in dag.params]
    part = cfg.partition_bytes
    chunks_of = [max(1, math.ceil(b / part)) if part and b > 0 else 1 for b in nbytes]
    ring = cfg.mode == "allreduce"
    bw = cfg.bandwidth_GBps * 1e9
    if ring:
        # A ring allreduce moves 2(W-1)/W of the bytes per rank and pays 2(W-1) latencies.
        alpha = 2 * (W - 1) * cfg.alpha_s
        eff_bw = math.inf if W == 1 else bw * W / (2 * (W - 1))
    else:
        alpha, eff_bw = cfg.alpha_s, bw
    server = math.inf if cfg.server_bandwidth_GBps is None or ring else cfg.server_bandwidth_GBps * 1e9
    credit = cfg.credit_bytes

    # Static graph structure (shared by all workers).
    consumers: list[list[int]] = [[] for _ in range(nops)]
    readers: list[list[int]] = [[] for _ in range(n)]
    need0 = [0] * nops
    send_param = [-1] * nops
    send_of: dict[int, int] = {}
    for i, op in enumerate(ops):
        for s in op.inputs:
            consumers[dag.index(s)].append(i)
        for p in op.reads:
            readers[pidx[p]].append(i)
        need0[i] = len(op.inputs) + len(op.reads)
        if op.kind == KIND_SEND:
            send_param[i] = pidx[op.sends or ""]
            if send_param[i] in send_of:
                raise SimulationError(f"DAG {dag.name!r} pushes gradient {op.sends!r} twice; give each parameter one send op")
            send_of[send_param[i]] = i
    op_time = [op.time_s for op in ops]

    rng = random.Random(seed)
    n_channels = 1 if ring else W
    need = [list(need0) for _ in range(W)]
    chunks_left = [[chunks_of[j] for j in range(n)] for _ in range(W)]  # recv chunks still to arrive
    send_left: list[dict[int, int]] = [{} for _ in range(W)]          # send op -> chunks still to deliver
    ready: list[list[tuple[float, int]]] = [[] for _ in range(W)]      # compute ready queue (time, op)
    busy = [False] * W
    done_ops = [0] * W
    finish = [0.0] * W
    recv_order: list[list[str]] = [[] for _ in range(W)]
    # Channel queues: heaps of (priority, tie, param, chunk, size); 2 directions per channel.
    queues: list[list[list[tuple[Any, ...]]]] = [[[], []] for _ in range(n_channels)]
    inflight_bytes = [[0.0, 0.0] for _ in range(n_channels)]
    inflight_count = [[0, 0] for _ in range(n_channels)]
    events: list[IterationEvent] = []
    heap: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, worker, item)
    seq = 0
    OP_DONE, DELIVER_DOWN, DELIVER_UP = 0, 1, 2

    def enqueue(ch: int, direction: int, priority: Any, j: int) -> None:
        tie = rng.random()
        k = chunks_of[j]
        size = nbytes[j] / k
        for c in range(k):
            heapq.heappush(queues[ch][direction], (priority, tie, j, c, size))

    if ring:
        for j in sorted(range(n), key=lambda j: prios[0][dag.params[j].name]):
            enqueue(0, _DOWN, prios[0][dag.params[j].name], j)
    else:
        for w in range(W):
            for j in range(n):
                enqueue(w, _DOWN, prios[w][dag.params[j].name], j)
    for w in range(W):
        for i in range(nops):
            if need0[i] == 0:
                ready[w].append((0.0, i))
        heapq.heapify(ready[w])

    flows: list[_Flow] = []
    t = 0.0
    total_ops = nops

    def op_ready(w: int, i: int, now: float) -> None:
        nonlocal seq
        if send_param[i] >= 0 and not ring:
            j = send_param[i]
            send_left[w][i] = chunks_of[j]
            # FIFO on the uplink: gradients in the order they become ready.
            enqueue(w, _UP, (now, i), j)
        elif send_param[i] >= 0:
            heapq.heappush(heap, (now, seq, OP_DONE, w, i))  # allreduce: this iteration's push is next one's pull
            seq += 1
        else:
            heapq.heappush(ready[w], (now, i))

    def complete_op(w: int, i: int, now: float) -> None:
        done_ops[w] += 1
        finish[w] = max(finish[w], now)
        for c in consumers[i]:
            need[w][c] -= 1
            if need[w][c] == 0:
                op_ready(w, c, now)

    def param_arrived(w: int, j: int, now: float) -> None:
        recv_order[w].append(dag.params[j].name)
        finish[w] = max(finish[w], now)
        for c in readers[j]:
            need[w][c] -= 1
            if need[w][c] == 0:
                op_ready(w, c, now)

    # Ops with no inputs that are sends (an untrained parameter's push) are handled like any ready op.
    for w in range(W):
        initial = [i for _, i in ready[w] if send_param[i] >= 0]
        if initial:
            ready[w] = [(tt, i) for tt, i in ready[w] if send_param[i] < 0]
            heapq.heapify(ready[w])
            for i in initial:
                op_ready(w, i, 0.0)

    rates_dirty = True
    while True:
        # Start compute on idle workers.
        for w in range(W):
            if not busy[w] and ready[w]:
                _, i = heapq.heappop(ready[w])
                busy[w] = True
                end = t + op_time[i]
                heapq.heappush(heap, (end, seq, OP_DONE, w, i))
                seq += 1
                if record:
                    events.append(IterationEvent(w, "compute", ops[i].name, t, end))
        # Start chunks on channels with credit left.
        for ch in range(n_channels):
            for d in (_DOWN, _UP):
                q = queues[ch][d]
                while q and (inflight_count[ch][d] == 0 or
                             (credit is not None and inflight_bytes[ch][d] + q[0][4] <= credit)):
                    _, _, j, c, size = heapq.heappop(q)
                    f = _Flow(ch, d, j, size, t, c)
                    flows.append(f)
                    inflight_count[ch][d] += 1
                    inflight_bytes[ch][d] += size
                    rates_dirty = True
        if rates_dirty:
            _set_rates(flows, eff_bw, server, n_channels)
            rates_dirty = False
        # Next event: a flow drains or a timed event fires.
        t_flow = math.inf
        for f in flows:
            if f.rate == math.inf:
                t_flow = t
                break
            if f.rate > 0:
                t_flow = min(t_flow, t + f.left / f.rate)
        t_heap = heap[0][0] if heap else math.inf
        t_next = min(t_flow, t_heap)
        if t_next == math.inf:
            break
        dt = t_next - t
        if dt > 0:
            for f in flows:
                if f.rate != math.inf:
                    f.left -= f.rate * dt
        t = t_next
        drained = [f for f in flows if f.rate == math.inf or f.left <= 1e-9 * f.nbytes + 1e-12]
        if drained:
            flows = [f for f in flows if not (f.rate == math.inf or f.left <= 1e-9 * f.nbytes + 1e-12)]
            rates_dirty = True
            for f in drained:
                ch, d = f.worker, f.channel
                inflight_count[ch][d] -= 1
                inflight_bytes[ch][d] -= f.nbytes
                heapq.heappush(heap, (t + alpha, seq, DELIVER_DOWN if d == _DOWN else DELIVER_UP, ch, f.param))
                seq += 1
                if record:
                    name = f"{dag.params[f.param].name}" + (f"#{f.chunk}" if chunks_of[f.param] > 1 else "")
                    events.append(IterationEvent(ch if not ring else -1, "allreduce" if ring else _RESOURCE[d],
                                                 name, f.start, t))
        while heap and heap[0][0] <= t:
            when, _, kind, w, item = heapq.heappop(heap)
            if kind == OP_DONE:
                if send_param[item] < 0:
                    busy[w] = False
                complete_op(w, item, when)
            elif kind == DELIVER_DOWN:
                targets = range(W) if ring else (w,)
                for x in targets:
                    chunks_left[x][item] -= 1
                    if chunks_left[x][item] == 0:
                        param_arrived(x, item, when)
            else:  # DELIVER_UP: one chunk of a gradient push reached the server
                i = send_of[item]
                send_left[w][i] -= 1
                if send_left[w][i] == 0:
                    del send_left[w][i]
                    complete_op(w, i, when)
    for w in range(W):
        if done_ops[w] != total_ops or any(chunks_left[w]):
            stuck = [ops[i].name for i in range(nops) if need[w][i] > 0][:5]
            raise SimulationError(f"worker {w} could not finish DAG {dag.name!r}: ops {stuck} still wait "
                                  f"(a dependency on an op that never runs?)")
    return IterationResult(dag.name, cfg, max(finish), tuple(finish), tuple(tuple(o) for o in recv_order),
                           tuple(events))


def _set_rates(flows: list[_Flow], link: float, server: float, n_channels: int) -> None:
    """Max-min fair rates: per direction, ``k`` busy channels get ``min(link, server/k)`` each, split equally
    among their in-flight chunks (all channels have the same capacity, so this is the water-filling result)."""
    per: dict[tuple[int, int], int] = {}
    for f in flows:
        key = (f.worker, f.channel)
        per[key] = per.get(key, 0) + 1
    busy = [0, 0]
    for _, d in per:
        busy[d] += 1
    for f in flows:
        share = min(link, server / busy[f.channel]) if busy[f.channel] else link
        f.rate = share / per[(f.worker, f.channel)]


_COLORS = {"compute": "tab:blue", "downlink": "tab:orange", "uplink": "tab:green", "allreduce": "tab:purple"}


def plot_iteration(result: IterationResult, path: str | Path, *, title: str | None = None, max_workers: int = 8) -> Path:
    """Gantt chart of ``result``: a row per (worker, resource), a bar per op or chunk; ``.png`` or ``.svg``."""
    out = Path(path)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise SimulationError(f"plot file {str(out)!r} must end in .png, .svg or .pdf")
    if not result.events:
        raise SimulationError("the result has no timeline; simulate with record=True to plot it")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in result.events:
        if e.worker < max_workers:
            rows.setdefault((e.worker, e.resource), []).append((e.start_s, max(e.end_s - e.start_s, 0.0)))
    keys = sorted(rows, key=lambda k: (k[0], list(_COLORS).index(k[1])))
    scale, unit = (1e3, "ms") if result.makespan_s < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.35 * len(keys)))
    for y, key in enumerate(keys):
        bars = [(s * scale, d * scale) for s, d in rows[key]]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=_COLORS[key[1]], edgecolors="white", linewidth=0.2)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([("all" if w < 0 else f"w{w}") + f" {r}" for w, r in keys], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(result.makespan_s * scale, color="black", lw=0.8, ls="--")
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"{result.dag}: {result.config.workers} worker(s), {result.config.mode}, "
                          f"makespan {result.makespan_s * scale:.4g} {unit}", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
