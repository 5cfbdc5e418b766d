"""Export an allreduce, reduce-scatter or allgather :class:`~gradsync.plan.schedule.Schedule` as an MSCCL algorithm file.

**Collectives.** ``coll`` is ``allreduce``, ``reducescatter`` or ``allgather`` (the executor's parser,
``src/misc/msccl/msccl_parser.cc``, multiplies the buffer by ``ngpus`` for the last two). Every algorithm is
in-place. A reduce-scatter's steps address its input ``i`` (``nchunksperloop`` chunks, rank ``r``'s result at
``r * K/N``: its ``o`` of ``K/N`` chunks); an allgather's address its output ``o`` (``K`` chunks, its ``i`` of
``K/N`` chunks sits at ``r * K/N``), msccl-tools' ``ReduceScatter``/``AllGather`` layouts. Shards are
quantized separately, ``K/N`` chunks each, so a shard is whole MSCCL chunks.

**Quantization** (:mod:`gradsync.plan.msccl.quantize`). MSCCL cuts the buffer into ``K = nchunksperloop``
equal chunks; each schedule chunk gets a whole number of them, as close to the plan's weights as the loads
allow (:func:`quantize`, re-exported here).

**Steps.** Per GPU and chunk, writes (receives) are chained in schedule-step order and a send reads the value
after every receive of an earlier step, as :class:`Schedule` defines; dependencies order every read after
the write it needs and every write after the reads of the value it replaces. A receive is *fused* with the
first send of its result (``rrcs`` / ``rcs``, or ``rrs`` when the result is only forwarded and later
overwritten), so relays stream: a tree reduces up with ``rrc``/``rrcs`` and broadcasts down with
``rcs``/``s``/``r``. Fused steps form chains that run together; chains are ordered by a topological order
of the dependencies between them, and every thread block runs its steps in that order, which makes the
program deadlock-free even with unbuffered connections. A fusion that would put a dependency inside a
chain (which can deadlock once buffers fill) or two steps of one chain in one thread block is undone.

**Thread blocks and channels.** Chunks that use the same set of GPU pairs (one tree, one ring direction)
share a channel, so different trees run on different thread blocks in parallel; per channel a GPU has one
thread block per (send peer, receive peer) pair that a fused step needs, and plain sends and receives
join the block of their peer.

**Routes.** MSCCL addresses GPU ranks only: a transfer is a send from its source rank to its destination
rank whatever its route. Switches are transparent. A route through another GPU is *not* turned into a
relay on that GPU (it would take a thread block and memory bandwidth there, and NCCL picks the physical
path itself); such transfers are counted in ``relayed_transfers`` because the achieved bandwidth then
depends on NCCL's routing, not on the planned one.

Every program is replayed by :func:`~gradsync.plan.msccl.replay.check_msccl_xml` (its XML text) before it
is returned.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradsync.errors import MscclError
from gradsync.plan.msccl.program import (
    DEFAULT_LIMITS,
    STEP_KINDS,
    MscclGpu,
    MscclLimits,
    MscclProgram,
    MscclStep,
    MscclThreadBlock,
)
from gradsync.plan.msccl.quantize import MAX_AUTO_CHUNKS, Quantization, quantize
from gradsync.plan.msccl.replay import check_msccl_xml
from gradsync.plan.schedule import Schedule
from gradsync.plan.unionfind import DisjointSets
from gradsync.topology.model import Topology

__all__ = ["MAX_AUTO_CHUNKS", "MSCCL_COLL", "MscclExport", "Quantization", "export_msccl", "quantize", "to_msccl_xml"]

_PROTOCOLS = ("Simple", "LL", "LL128")


# ---- the exported program ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MscclExport:
    """An exported algorithm: its XML text, the program, and what quantization cost."""

    xml: str
    program: MscclProgram
    quantization: Quantization
    #: GB/s of one cost unit (the topology's unit link); ``None`` without a topology.
    unit_bandwidth_GBps: float | None
    fused_steps: int
    relayed_transfers: int
    thread_blocks: int
    max_steps_per_tb: int
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def algbw_GBps(self) -> float | None:
        """Algorithmic bandwidth of the quantized schedule (bytes of buffer / time, bandwidth term)."""
        q = self.quantization.quantized_cost
        return None if self.unit_bandwidth_GBps is None or q <= 0 else self.unit_bandwidth_GBps / q

    @property
    def optimal_algbw_GBps(self) -> float | None:
        c = self.quantization.cost
        return None if self.unit_bandwidth_GBps is None or c <= 0 else self.unit_bandwidth_GBps / c

    def to_dict(self) -> dict[str, Any]:
        q = self.quantization
        return {
            "type": "gradsync.msccl_export", "name": self.program.name, "nchunksperloop": q.nchunksperloop,
            "chunk_counts": list(q.counts), "cost": q.cost, "quantized_cost": q.quantized_cost, "loss": q.loss,
            "algbw_GBps": self.algbw_GBps, "optimal_algbw_GBps": self.optimal_algbw_GBps,
            "channels": self.program.nchannels, "thread_blocks_max": self.thread_blocks,
            "steps_per_tb_max": self.max_steps_per_tb, "fused_steps": self.fused_steps,
            "relayed_transfers": self.relayed_transfers, "proto": self.program.proto,
        }


@dataclass(frozen=True)
class _Xfer:
    piece: int
    src: int
    dst: int
    reduce: bool
    step: int


@dataclass(eq=False)
class _Op:
    gpu: int
    piece: int
    chan: int
    type: str
    recv: int | None = None  # index of the transfer it receives
    send: int | None = None  # index of the transfer it sends
    deps: list[_Op] = field(default_factory=list)
    tb: _Tb | None = None
    group: int = -1


@dataclass(eq=False)
class _Tb:
    send: int
    recv: int
    chan: int
    ops: list[_Op] = field(default_factory=list)


class _Builder:
    """Turns pieces and transfers into thread blocks of ordered steps (module docstring, **Steps**)."""

    def __init__(self, n: int, pieces: Sequence[tuple[int, int, int]], xfers: Sequence[_Xfer], chan_of_piece: Sequence[int],
                 fuse: bool) -> None:
        self.n, self.pieces, self.x, self.chan = n, pieces, xfers, chan_of_piece
        self.fuse = fuse
        self.incoming: dict[tuple[int, int], list[int]] = {}
        self.outgoing: dict[tuple[int, int], list[int]] = {}
        for i, t in enumerate(xfers):
            self.incoming.setdefault((t.dst, t.piece), []).append(i)
            self.outgoing.setdefault((t.src, t.piece), []).append(i)
        for lst in self.incoming.values():
            lst.sort(key=lambda i: (xfers[i].step, xfers[i].src))
        for lst in self.outgoing.values():
            lst.sort(key=lambda i: (xfers[i].step, xfers[i].dst))
        self.keys = sorted(set(self.incoming) | set(self.outgoing))
        #: Per (GPU, piece): the sends that read the value each receive writes (key None: the GPU's own value).
        self.readers: dict[tuple[int, int], dict[int | None, list[int]]] = {}
        for key in self.keys:
            ins, readers = self.incoming.get(key, []), self.readers.setdefault(key, {})
            for o in self.outgoing.get(key, []):
                prev = None
                for i in ins:
                    if xfers[i].step < xfers[o].step:
                        prev = i
                readers.setdefault(prev, []).append(o)

    def build(self) -> tuple[list[list[_Tb]], int]:
        nofuse: set[int] = set()
        while True:
            # Undo the fusions no thread block can take before any step is built (each undo frees others).
            while True:
                fusions = self._fusions(nofuse)
                blocks, _, _ = self._fit([(self.x[i].dst, self.chan[self.x[i].piece], self.x[o].dst, self.x[i].src)
                                          for i, o in fusions.items()])
                unfit = {i for i, tb in zip(fusions, blocks) if tb is None}
                if not unfit:
                    break
                nofuse |= unfit
            ops, by_recv, by_send = self._ops(fusions)
            bad = self._assign_tbs(ops, by_recv)
            if not bad:
                bad = self._order(ops, by_recv, by_send)
            if not bad:
                break
            nofuse |= bad
        tbs: list[list[_Tb]] = [[] for _ in range(self.n)]
        seen: set[int] = set()
        for op in ops:
            assert op.tb is not None
            if id(op.tb) not in seen:
                seen.add(id(op.tb))
                tbs[op.gpu].append(op.tb)
        return tbs, sum(1 for op in ops if op.recv is not None and op.send is not None)

    def _fusions(self, nofuse: set[int]) -> dict[int, int]:
        """Receive -> the send fused with it, in the order :meth:`_ops` creates them (module docstring, **Steps**)."""
        x = self.x
        out: dict[int, int] = {}
        if not self.fuse:
            return out
        for key in self.keys:
            readers = self.readers[key]
            for i in self.incoming.get(key, []):
                mine = readers.get(i)
                if mine and i not in nofuse:
                    out[i] = min(mine, key=lambda o: (x[o].dst == x[i].src, x[o].step, x[o].dst))
        return out

    def _ops(self, fusions: dict[int, int]) -> tuple[list[_Op], dict[int, _Op], dict[int, _Op]]:
        x = self.x
        ops: list[_Op] = []
        by_recv: dict[int, _Op] = {}
        by_send: dict[int, _Op] = {}
        for g, p in self.keys:
            ins = self.incoming.get((g, p), [])
            outs = self.outgoing.get((g, p), [])
            readers = self.readers[(g, p)]
            fused_out: set[int] = set()
            local: list[tuple[tuple[int, int, int], _Op]] = []
            for pos, i in enumerate(ins):
                mine = readers.get(i, [])
                typ = "rrc" if x[i].reduce else "r"
                o = fusions.get(i)
                if o is not None:
                    fused_out.add(o)
                    nxt = ins[pos + 1] if pos + 1 < len(ins) else None
                    if not x[i].reduce:
                        typ = "rcs"
                    elif len(mine) == 1 and nxt is not None and not x[nxt].reduce:
                        typ = "rrs"  # forwarded only, and overwritten later: no local write needed
                    else:
                        typ = "rrcs"
                op = _Op(g, p, self.chan[p], typ, recv=i, send=o)
                by_recv[i] = op
                if o is not None:
                    by_send[o] = op
                ops.append(op)
                local.append(((x[i].step, 1, x[i].src), op))
            for o in outs:
                if o in fused_out:
                    continue
                op = _Op(g, p, self.chan[p], "s", send=o)
                by_send[o] = op
                ops.append(op)
                local.append(((x[o].step, 0, x[o].dst), op))
            local.sort(key=lambda kv: kv[0])
            writer: _Op | None = None
            readers_since: list[_Op] = []
            for _, op in local:
                kind = STEP_KINDS[op.type]
                if kind.reads_src and writer is not None:
                    op.deps.append(writer)
                if kind.writes_dst:
                    op.deps += ([writer] if writer is not None else []) + [r for r in readers_since if r is not op]
                    writer, readers_since = op, []
                if kind.reads_src:
                    readers_since.append(op)
        return ops, by_recv, by_send

    def _assign_tbs(self, ops: list[_Op], by_recv: dict[int, _Op]) -> set[int]:
        """Thread blocks per (GPU, channel); returns fused receives that do not fit (to undo)."""
        x = self.x
        fused = [op for op in ops if op.recv is not None and op.send is not None]
        blocks, send_tb, recv_tb = self._fit([(op.gpu, op.chan, x[op.send].dst, x[op.recv].src)  # type: ignore[index]
                                              for op in fused])
        bad = {op.recv for op, tb in zip(fused, blocks) if tb is None and op.recv is not None}
        if bad:
            return bad
        for op, tb in zip(fused, blocks):
            op.tb = tb
        plain = [op for op in ops if op.tb is None]
        plain.sort(key=lambda op: (op.gpu, op.chan, self._peer(op)))
        for op in plain:
            if op.send is not None:
                q = x[op.send].dst
                tb = send_tb.get((op.gpu, op.chan, q))
                if tb is None:
                    tb = recv_tb.get((op.gpu, op.chan, q))
                    if tb is None or tb.send != -1:
                        tb = _Tb(q, -1, op.chan)
                    tb.send = q
                    send_tb[(op.gpu, op.chan, q)] = tb
            else:
                assert op.recv is not None
                p = x[op.recv].src
                tb = recv_tb.get((op.gpu, op.chan, p))
                if tb is None:
                    tb = send_tb.get((op.gpu, op.chan, p))
                    if tb is None or tb.recv != -1:
                        tb = _Tb(-1, p, op.chan)
                    tb.recv = p
                    recv_tb[(op.gpu, op.chan, p)] = tb
            op.tb = tb
        return bad

    @staticmethod
    def _fit(fused: Sequence[tuple[int, int, int, int]]) -> tuple[list[_Tb | None], dict[tuple[int, int, int], _Tb],
                                                                   dict[tuple[int, int, int], _Tb]]:
        """A thread block for each fused step ``(gpu, channel, send peer, receive peer)`` in order, or ``None``
        where the blocks of those peers already pair them otherwise; the blocks by send and by receive peer."""
        send_tb: dict[tuple[int, int, int], _Tb] = {}
        recv_tb: dict[tuple[int, int, int], _Tb] = {}
        out: list[_Tb | None] = []
        for gpu, chan, q, p in fused:
            ts, tr = send_tb.get((gpu, chan, q)), recv_tb.get((gpu, chan, p))
            if ts is None and tr is None:
                tb = _Tb(q, p, chan)
            elif ts is not None and (ts is tr or (tr is None and ts.recv == -1)):
                tb = ts
            elif tr is not None and ts is None and tr.send == -1:
                tb = tr
            else:
                out.append(None)
                continue
            tb.send, tb.recv = q, p
            send_tb[(gpu, chan, q)] = recv_tb[(gpu, chan, p)] = tb
            out.append(tb)
        return out, send_tb, recv_tb

    def _peer(self, op: _Op) -> int:
        return self.x[op.send].dst if op.send is not None else self.x[op.recv].src  # type: ignore[index]

    def _order(self, ops: list[_Op], by_recv: dict[int, _Op], by_send: dict[int, _Op]) -> set[int]:
        """Chains (groups), a topological order of them, and each thread block's steps in that order."""
        chains = DisjointSets(range(len(ops)))
        idx = {id(op): k for k, op in enumerate(ops)}
        for t in range(len(self.x)):
            chains.union(idx[id(by_send[t])], idx[id(by_recv[t])])
        roots = sorted({chains.find(k) for k in range(len(ops))})
        gid = {r: g for g, r in enumerate(roots)}
        for k, op in enumerate(ops):
            op.group = gid[chains.find(k)]
        ngroups = len(roots)
        x = self.x
        gkey: list[tuple[int, int, int, int]] = [(1 << 60, 0, 0, 0)] * ngroups
        for t, tr in enumerate(x):
            g = by_send[t].group
            gkey[g] = min(gkey[g], (tr.step, tr.piece, tr.src, tr.dst))
        conflict: set[int] = set()
        cut: set[int] = set()
        succ: list[set[int]] = [set() for _ in range(ngroups)]
        for op in ops:
            for d in op.deps:
                if d.group != op.group:
                    succ[d.group].add(op.group)
                    continue
                # a dependency inside a chain: cut the chain just above the later of the two steps
                for end in (op, d):
                    up = by_send[end.recv] if end.recv is not None else None
                    if up is not None and up.recv is not None and up.send is not None:
                        cut.add(up.recv)
                        break
                else:
                    conflict.add(op.group)
        if cut:
            return cut
        seen_tb: dict[tuple[int, int], _Op] = {}
        for op in ops:
            key = (id(op.tb), op.group)
            if key in seen_tb:
                conflict.add(op.group)
            seen_tb[key] = op
        if not conflict:
            indeg = [0] * ngroups
            for s in succ:
                for g in s:
                    indeg[g] += 1
            heap = [(gkey[g], g) for g in range(ngroups) if indeg[g] == 0]
            heapq.heapify(heap)
            rank = [-1] * ngroups
            r = 0
            while heap:
                _, g = heapq.heappop(heap)
                rank[g] = r
                r += 1
                for h in succ[g]:
                    indeg[h] -= 1
                    if indeg[h] == 0:
                        heapq.heappush(heap, (gkey[h], h))
            conflict = {g for g in range(ngroups) if rank[g] < 0}
        if conflict:
            return {op.recv for op in ops if op.group in conflict and op.recv is not None and op.send is not None}
        members: dict[int, tuple[_Tb, list[_Op]]] = {}
        for op in ops:
            op.group = rank[op.group]
            assert op.tb is not None
            members.setdefault(id(op.tb), (op.tb, []))[1].append(op)
        for tb, mine in members.values():  # one pass over the ops: a scan per thread block was quadratic
            tb.ops = sorted(mine, key=lambda op: op.group)
        return set()


#: MSCCL's name (``coll``) of each collective, and the buffer its steps address with whole-buffer offsets: an
#: in-place reduce-scatter's output is its input at ``rank * K/N``, an in-place allgather's input its output
#: there (msccl-tools ``msccl/language/collectives.py``; the executor's parser takes ``reducescatter``).
MSCCL_COLL = {"allreduce": ("allreduce", "i"), "reduce_scatter": ("reducescatter", "i"), "allgather": ("allgather", "o")}


def _emit(tbs_per_gpu: list[list[_Tb]], pieces: Sequence[tuple[int, int, int]], k: int, nchannels: int, name: str,
          proto: str, min_bytes: int, max_bytes: int, collective: str = "allreduce") -> MscclProgram:
    coll, buf = MSCCL_COLL[collective]
    n = len(tbs_per_gpu)
    i_chunks, o_chunks = {"allreduce": (k, k), "reduce_scatter": (k, k // n), "allgather": (k // n, k)}[collective]
    gpus = []
    for g, tbs in enumerate(tbs_per_gpu):
        # blocks others wait for get the low ids: a dependency names its block in an int8 (dependentBid)
        waited = {id(d.tb) for tb in tbs for op in tb.ops for d in op.deps if d.tb is not tb}
        tbs.sort(key=lambda tb: (id(tb) not in waited, tb.send, tb.recv, tb.chan))
        tb_id = {id(tb): i for i, tb in enumerate(tbs)}
        pos: dict[int, int] = {}
        for tb in tbs:
            for p, op in enumerate(tb.ops):
                pos[id(op)] = p
        # per op: its dependencies as (thread block, position), the latest per block, minus implied ones
        reduced: dict[int, list[tuple[int, _Op]]] = {}
        for tb in tbs:
            running: dict[int, int] = {}
            for op in tb.ops:
                latest: dict[int, _Op] = {}
                for d in op.deps:
                    assert d.tb is not None
                    if d.tb is tb:
                        continue
                    t = tb_id[id(d.tb)]
                    if t not in latest or pos[id(d)] > pos[id(latest[t])]:
                        latest[t] = d
                keep = [(t, d) for t, d in sorted(latest.items()) if running.get(t, -1) < pos[id(d)]]
                for t, d in keep:
                    running[t] = pos[id(d)]
                reduced[id(op)] = keep
        step_of: dict[int, int] = {}
        for tb in tbs:
            s = 0
            for op in tb.ops:
                s += max(0, len(reduced[id(op)]) - 1)
                step_of[id(op)] = s
                s += 1
        hasdep = {id(d) for deps in reduced.values() for _, d in deps}
        out_tbs = []
        for tb in tbs:
            steps: list[MscclStep] = []
            for op in tb.ops:
                deps = reduced[id(op)]
                for t, d in deps[:-1]:
                    steps.append(MscclStep(len(steps), "nop", "i", -1, "o", -1, 0, t, step_of[id(d)], 0))
                _, off, cnt = pieces[op.piece]
                depid, depstep = (deps[-1][0], step_of[id(deps[-1][1])]) if deps else (-1, -1)
                steps.append(MscclStep(len(steps), op.type, buf, off, buf, off, cnt, depid, depstep,
                                       int(id(op) in hasdep)))
            out_tbs.append(MscclThreadBlock(tb_id[id(tb)], tb.send, tb.recv, tb.chan, tuple(steps)))
        gpus.append(MscclGpu(g, i_chunks, o_chunks, 0, tuple(out_tbs)))
    return MscclProgram(name, proto, k, nchannels, len(tbs_per_gpu), coll, True, False, tuple(gpus),
                        min_bytes, max_bytes)


def _channels(schedule: Schedule, kept: Sequence[int], max_channels: int, split: int) -> tuple[dict[int, int], int]:
    """Channel per kept chunk: one per set of GPU pairs the chunk uses (a tree, a ring direction).

    ``split > 1`` cuts each such set's chunks into ``split`` contiguous runs on channels of their own
    (multiring's rings share GPU pairs; split, each ring gets its thread blocks), for programs whose
    thread blocks would otherwise exceed ``MSCCL_MAX_NUM_STEPS``.
    """
    pairs: dict[int, set[tuple[int, int]]] = {c: set() for c in kept}
    for t in schedule.transfers:
        if t.chunk in pairs:
            pairs[t.chunk].add((t.src, t.dst))
    members: dict[frozenset[tuple[int, int]], list[int]] = {}
    for c in kept:
        members.setdefault(frozenset(pairs[c]), []).append(c)
    label: dict[int, int] = {}
    for g, chunks in enumerate(members.values()):
        parts = min(split, len(chunks))
        for i, c in enumerate(chunks):
            label[c] = g * split + i * parts // len(chunks)
    used = sorted(set(label.values()))
    nchan = max(1, min(len(used), max_channels))
    dense = {v: i % nchan for i, v in enumerate(used)}
    return {c: dense[label[c]] for c in kept}, nchan


def _thread_block_floor(n: int, xfers: Sequence[_Xfer], chan_of_piece: Sequence[int]) -> np.ndarray:
    """A lower bound on each GPU's thread blocks, from the transfers alone (before any step is built).

    A thread block has one send peer and one receive peer on one channel, and a connection (peer, channel)
    one block per side, so a GPU needs at least ``max(send peers, receive peers)`` blocks on each channel.
    """
    if not xfers:
        return np.zeros(n, dtype=np.int64)
    src = np.fromiter((t.src for t in xfers), dtype=np.int64, count=len(xfers))
    dst = np.fromiter((t.dst for t in xfers), dtype=np.int64, count=len(xfers))
    chan = np.asarray(chan_of_piece, dtype=np.int64)[np.fromiter((t.piece for t in xfers), dtype=np.int64,
                                                                  count=len(xfers))]
    nchan = int(chan.max()) + 1
    floor = np.zeros(n * nchan, dtype=np.int64)
    for me, peer in ((src, dst), (dst, src)):  # distinct peers per (GPU, channel), sending then receiving
        conns = np.unique((me * nchan + chan) * n + peer)
        floor = np.maximum(floor, np.bincount(conns // n, minlength=n * nchan))
    return floor.reshape(n, nchan).sum(axis=1)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored afterwards, if it ran) while a program is built and replayed.

    A 128-GPU program allocates some 10^5 small objects that all live until the export returns; every
    collection triggered meanwhile walks them again and frees nothing (35 % of fattree:8's export, more in a
    process that already holds large plans). Their cycles (steps and thread blocks) go at the next collection.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def export_msccl(
    schedule: Schedule,
    topology: Topology | None = None,
    *,
    name: str | None = None,
    proto: str = "Simple",
    nchunksperloop: int | None = None,
    max_loss: float = 0.01,
    channels: int | None = None,
    fuse: bool = True,
    min_bytes: int = 0,
    max_bytes: int = 0,
    limits: MscclLimits = DEFAULT_LIMITS,
) -> MscclExport:
    """Write ``schedule`` (an allreduce) as an MSCCL algorithm and replay it; see the module docstring.

    ``channels`` caps the channels used (default: one per chunk pattern, at most ``MAXCHANNELS``).
    Raises :class:`MscclError` naming the executor limit a schedule cannot fit, or the bad argument.
    """
    if schedule.collective not in MSCCL_COLL:
        raise MscclError(f"the MSCCL export writes {', '.join(MSCCL_COLL)} schedules; this one is a "
                         f"{schedule.collective!r}; plan one of those")
    n = schedule.world_size
    if n < 2:
        raise MscclError(f"schedule {schedule.algorithm!r} has {n} rank; an MSCCL algorithm needs at least 2 GPUs")
    if topology is not None:
        schedule.require_topology(topology)
    if proto not in _PROTOCOLS:
        raise MscclError(f"proto={proto!r}; MSCCL knows {', '.join(_PROTOCOLS)}")
    if nchunksperloop is not None and (not isinstance(nchunksperloop, int) or not 1 <= nchunksperloop <= limits.max_chunks):
        raise MscclError(f"nchunksperloop={nchunksperloop!r} must be an integer in 1..{limits.max_chunks} (MSCCL offsets "
                         f"are int16); leave it out to choose one within {max_loss:.0%} of the plan")
    if channels is not None and (not isinstance(channels, int) or not 1 <= channels <= limits.max_channels):
        raise MscclError(f"channels={channels!r} must be an integer in 1..{limits.max_channels} (MAXCHANNELS)")
    if not (min_bytes >= 0 and max_bytes >= 0):
        raise MscclError(f"min_bytes={min_bytes}, max_bytes={max_bytes} must be >= 0 (max_bytes=0: no limit)")
    with _gc_paused():
        return _export(schedule, topology, name=name, proto=proto, nchunksperloop=nchunksperloop, max_loss=max_loss,
                       channels=channels, fuse=fuse, min_bytes=min_bytes, max_bytes=max_bytes, limits=limits)


def _export(schedule: Schedule, topology: Topology | None, *, name: str | None, proto: str, nchunksperloop: int | None,
            max_loss: float, channels: int | None, fuse: bool, min_bytes: int, max_bytes: int,
            limits: MscclLimits) -> MscclExport:
    n = schedule.world_size
    q = quantize(schedule, topology, nchunksperloop, max_loss=max_loss)
    kept = [c for c, k in enumerate(q.counts) if k > 0]
    # pieces: (chunk, offset, cnt), a chunk split where its count exceeds MSCCL_MAX_COUNT
    pieces: list[tuple[int, int, int]] = []
    piece_ids: dict[int, list[int]] = {}
    off = 0
    for c in kept:
        left = q.counts[c]
        while left > 0:
            cnt = min(left, limits.max_count)
            piece_ids.setdefault(c, []).append(len(pieces))
            pieces.append((c, off, cnt))
            off += cnt
            left -= cnt
    xfers = [_Xfer(p, t.src, t.dst, t.reduce, t.step) for t in schedule.transfers for p in piece_ids.get(t.chunk, ())]
    ranks = set(schedule.ranks)
    relayed = sum(1 for t in schedule.transfers if t.chunk in piece_ids and any(d in ranks for d in t.route[1:-1]))
    label = name or f"gradsync-{schedule.algorithm}-{schedule.topology}"
    cap = channels or limits.max_channels
    split = 1
    current = _channels(schedule, kept, cap, split)
    while True:
        chan_of_chunk, nchan = current
        chan_of_piece = [chan_of_chunk[c] for c, _, _ in pieces]
        more = _channels(schedule, kept, cap, split + 1)  # the next split's channels (the next round's, if any)
        last = len(set(more[0].values())) <= len(set(chan_of_chunk.values()))
        floor = _thread_block_floor(n, xfers, chan_of_piece)
        if last and floor.max() > limits.max_thread_blocks:  # this program is the one returned: it cannot fit
            g = int(np.argmax(floor))
            raise MscclError(f"schedule {schedule.algorithm!r} on {schedule.topology!r} with nchunksperloop="
                             f"{q.nchunksperloop} does not fit the MSCCL executor: GPU {g} needs at least {floor[g]} "
                             f"thread blocks (one per peer it sends to or receives from on each channel), over "
                             f"MSCCL_MAX_NUM_THREAD_BLOCKS={limits.max_thread_blocks}; use fewer channels or fewer "
                             f"peers per GPU", g)
        tbs, fused = _Builder(n, pieces, xfers, chan_of_piece, fuse).build()
        program = _emit(tbs, pieces, q.nchunksperloop, nchan, label, proto, min_bytes, max_bytes, schedule.collective)
        longest = max(len(tb.steps) for g in program.gpus for tb in g.tbs)
        if longest <= limits.max_steps or last:
            break
        split += 1  # spread the longest thread blocks over more channels
        current = more
    xml = program.to_xml()
    try:
        stats = check_msccl_xml(xml, limits=limits)
    except MscclError as exc:
        if "MSCCL_MAX" in str(exc) or "MAX_SUBS" in str(exc) or "int8" in str(exc):
            raise MscclError(f"schedule {schedule.algorithm!r} on {schedule.topology!r} with nchunksperloop="
                             f"{q.nchunksperloop} does not fit the MSCCL executor: {exc}", exc.gpu, exc.tb, exc.step) from None
        raise
    unit = float(topology.unit_bandwidth_GBps) if topology is not None and topology.unit_bandwidth_GBps else None
    return MscclExport(xml, program, q, unit, fused, relayed, stats.thread_blocks, stats.max_steps_per_tb,
                       {"replayed_steps": stats.steps, "replayed_chunk_moves": stats.chunk_moves})


def to_msccl_xml(schedule: Schedule, topology: Topology | None = None, **kwargs: Any) -> str:
    """The MSCCL XML text of ``schedule`` (replayed before it is returned); options as :func:`export_msccl`."""
    return export_msccl(schedule, topology, **kwargs).xml
