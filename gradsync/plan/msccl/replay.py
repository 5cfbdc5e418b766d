"""Replay checker: execute any MSCCL allreduce, reduce-scatter or allgather algorithm symbolically and prove it correct.

Semantics (where they are defined: Azure/msccl-executor-nccl ``src/device/msccl_kernel.cu`` and
``src/misc/msccl/msccl_parser.cc``; see :mod:`gradsync.plan.msccl.program` for the format):

* Every thread block runs its steps in order. A step first waits for its dependency: thread block
  ``depid`` of the same GPU must have completed a step with index ``>= deps`` and ``hasdep=1`` (the
  executor's per-block flag, compared with ``>=``). ``nop`` steps only wait.
* The k-th sending step on connection ``(src GPU, dst GPU, channel)`` meets the k-th receiving step on it;
  both must move the same ``cnt``. A step of ``cnt`` chunks moves them one chunk at a time (the executor's
  loop over ``maxAllowedCount``, which is 1 for large buffers), and a connection buffers at most
  ``fifo_depth`` chunks: 2 for the Simple protocol (``NCCL_STEPS`` / ``MSCCL_CHUNKSTEPS`` = 8 / 4). A
  program that completes with depth ``d`` completes with any deeper FIFO: every thread block is sequential,
  and only its own progress can disable an enabled step, so executions are confluent and monotone in ``d``.
* Values are symbolic: a chunk holds ``(position, set of GPUs whose contribution it sums)``; the input
  buffer of GPU ``g`` starts with ``(j, {g})`` at chunk ``j``, output and scratch start undefined. For an
  in-place algorithm the output buffer *is* the input buffer; an algorithm that declares both modes is
  replayed in both.
* Races: every chunk access is checked against the last write and the reads since it with vector clocks
  (happens-before = thread-block order + dependencies + message delivery). A read not ordered after the
  write it depends on may read the chunk before it arrives; a write not ordered after earlier reads may
  overwrite them; both are rejected even when this replay's interleaving happened to be lucky.

At the end every GPU must hold ``(j, all GPUs)`` at output chunk ``j`` for every ``j < nchunksperloop``.

Reduce-scatter and allgather (``coll="reducescatter"`` / ``"allgather"``, the parser's names) follow
msccl-tools' ``ReduceScatter`` and ``AllGather`` (``msccl/language/collectives.py``), with ``c = nchunksperloop
/ ngpus`` chunks per rank. Reduce-scatter: input chunk ``j`` of GPU ``g`` starts as ``(j, {g})``; in place its
output chunk ``j`` *is* input chunk ``g c + j``; it must end as ``(g c + j, all GPUs)``. Allgather: input chunk
``j`` of GPU ``g`` starts as ``(g c + j, all GPUs)`` (a finished value: adding anything to it is a duplicate
reduction); in place it *is* output chunk ``g c + j``; output chunk ``j`` must end as ``(j, all GPUs)``.

Every failure raises :class:`~gradsync.errors.MscclError` naming the GPU, thread block and step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gradsync.errors import MscclError
from gradsync.plan.msccl.program import (
    DEFAULT_LIMITS,
    MscclGpu,
    MscclLimits,
    MscclProgram,
    MscclStep,
    MscclThreadBlock,
    parse_msccl_xml,
)

__all__ = ["ReplayStats", "check_msccl_program", "check_msccl_xml", "validate_program"]

_PROTOCOLS = ("Simple", "LL", "LL128")
Value = tuple[int, int] | None  # (chunk position, bitmask of contributing GPUs) or undefined


@dataclass(frozen=True)
class ReplayStats:
    """What a successful replay executed."""

    modes: tuple[str, ...]
    steps: int
    chunk_moves: int
    thread_blocks: int
    max_steps_per_tb: int
    channels: int


@dataclass(frozen=True)
class _Coll:
    """Where a collective's values start, how its in-place buffers alias, and where they must end."""

    #: ``(gpu, per, i_chunks) -> [(buffer, index, value)]``
    initial: Callable[[int, int, int, int], list[tuple[str, int, tuple[int, int]]]]
    #: ``(gpu, per, buffer, index) -> (buffer, index)`` in place: the canonical cell a buffer index names
    alias: Callable[[int, int, str, int], tuple[str, int]]
    #: ``(gpu, per, nchunksperloop, full) -> [(buffer, index, value)]``
    final: Callable[[int, int, int, int], list[tuple[str, int, tuple[int, int]]]]
    #: ``(nchunksperloop, per) -> (least i_chunks, least o_chunks)``
    sizes: Callable[[int, int], tuple[int, int]]
    goal: str


def _same(gpu: int, per: int, buf: str, idx: int) -> tuple[str, int]:
    return ("i" if buf == "o" else buf, idx)


COLLS: dict[str, _Coll] = {
    "allreduce": _Coll(
        lambda g, per, ni, full: [("i", j, (j, 1 << g)) for j in range(ni)], _same,
        lambda g, per, k, full: [("o", j, (j, full)) for j in range(k)], lambda k, per: (k, k), "the full reduction"),
    "reducescatter": _Coll(
        lambda g, per, ni, full: [("i", j, (j, 1 << g)) for j in range(ni)],
        lambda g, per, buf, idx: ("i", g * per + idx) if buf == "o" else (buf, idx),
        lambda g, per, k, full: [("o", j, (g * per + j, full)) for j in range(per)], lambda k, per: (k, per),
        "its shard's full reduction"),
    "allgather": _Coll(
        lambda g, per, ni, full: [("i", j, (g * per + j, full)) for j in range(ni)],
        lambda g, per, buf, idx: ("o", g * per + idx) if buf == "i" else (buf, idx),
        lambda g, per, k, full: [("o", j, (j, full)) for j in range(k)], lambda k, per: (per, k),
        "every GPU's shard"),
}


def _at(gpu: int, tb: int, step: int, typ: str) -> str:
    return f"GPU {gpu}, thread block {tb}, step {step} ({typ})"


def _gpus_of(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


# ---- structure ----------------------------------------------------------------------------------------------
def validate_program(program: MscclProgram, limits: MscclLimits = DEFAULT_LIMITS) -> None:
    """Check what the executor's parser checks, and the limits; raise :class:`MscclError` naming the place."""
    if program.coll not in COLLS:
        hint = " (MSCCL spells it 'reducescatter')" if program.coll.replace("_", "") == "reducescatter" else ""
        raise MscclError(f"coll={program.coll!r}: the replay checker proves {', '.join(COLLS)} algorithms{hint}")
    if program.proto not in _PROTOCOLS:
        raise MscclError(f"proto={program.proto!r}; the executor knows {', '.join(_PROTOCOLS)}")
    if not program.inplace and not program.outofplace:
        raise MscclError("inplace=0 and outofplace=0: the executor never selects this algorithm; set inplace=\"1\"")
    n = program.ngpus
    if sorted(g.id for g in program.gpus) != list(range(n)):
        raise MscclError(f"ngpus={n} but the <gpu> ids are {sorted(g.id for g in program.gpus)}; need each of 0..{n - 1} once")
    if not 1 <= program.nchunksperloop <= limits.max_chunks:
        raise MscclError(f"nchunksperloop={program.nchunksperloop}; it must be in 1..{limits.max_chunks} (int16 offsets)")
    if not 1 <= program.nchannels <= limits.max_channels:
        raise MscclError(f"nchannels={program.nchannels}; MAXCHANNELS allows 1..{limits.max_channels}")
    if program.coll != "allreduce" and program.nchunksperloop % n:
        raise MscclError(f"coll={program.coll!r} with nchunksperloop={program.nchunksperloop} on ngpus={n}: every GPU's "
                         f"shard needs nchunksperloop / ngpus chunks; make nchunksperloop a multiple of {n}")
    need_i, need_o = COLLS[program.coll].sizes(program.nchunksperloop, program.nchunksperloop // max(n, 1))
    for g in program.gpus:
        if min(g.i_chunks, g.o_chunks, g.s_chunks) < 0:
            raise MscclError(f"GPU {g.id} declares a negative buffer size", g.id)
        if program.coll != "allreduce" and (g.i_chunks < need_i or g.o_chunks < need_o):
            raise MscclError(f"GPU {g.id} declares i_chunks={g.i_chunks}, o_chunks={g.o_chunks}; a {program.coll} of "
                             f"nchunksperloop={program.nchunksperloop} on {n} GPUs needs at least {need_i} and {need_o}",
                             g.id)
        ids = sorted(tb.id for tb in g.tbs)
        if ids != list(range(len(ids))):
            raise MscclError(f"GPU {g.id} has thread block ids {ids}; the executor needs 0..{len(ids) - 1}, each once", g.id)
        if len(ids) > limits.max_thread_blocks:
            raise MscclError(f"GPU {g.id} has {len(ids)} thread blocks, over MSCCL_MAX_NUM_THREAD_BLOCKS="
                             f"{limits.max_thread_blocks}; use fewer channels or fewer peers per GPU", g.id)
        if len(ids) > limits.max_subs:
            raise MscclError(f"GPU {g.id} has {len(ids)} thread blocks, over the parser's MAX_SUBS={limits.max_subs}", g.id)
        senders: dict[tuple[int, int], int] = {}
        receivers: dict[tuple[int, int], int] = {}
        per_chan: dict[int, int] = {}
        for tb in g.tbs:
            _validate_tb(program, g, tb, len(ids), limits)
            for peer, table, what in ((tb.send, senders, "send to"), (tb.recv, receivers, "receive from")):
                if peer < 0:
                    continue
                other = table.setdefault((peer, tb.chan), tb.id)
                if other != tb.id:
                    raise MscclError(f"GPU {g.id}: thread blocks {other} and {tb.id} both {what} GPU {peer} on channel "
                                     f"{tb.chan}; one connection needs one thread block per side", g.id, tb.id)
            if tb.send >= 0:
                per_chan[tb.chan] = per_chan.get(tb.chan, 0) + 1
                if per_chan[tb.chan] > limits.max_tbs_per_channel:
                    raise MscclError(f"GPU {g.id} has more than MSCCL_MAX_NUM_THREAD_BLOCKS_PER_CHANNEL="
                                     f"{limits.max_tbs_per_channel} sending thread blocks on channel {tb.chan}", g.id, tb.id)


def _validate_tb(program: MscclProgram, g: MscclGpu, tb: MscclThreadBlock, ntbs: int, limits: MscclLimits) -> None:
    n, gid = program.ngpus, g.id
    for peer, what in ((tb.send, "send"), (tb.recv, "recv")):
        if not -1 <= peer < n or peer == gid:
            raise MscclError(f"GPU {gid}, thread block {tb.id} has {what}={peer}; a peer is another GPU in 0..{n - 1} "
                             f"or -1", gid, tb.id)
    if not 0 <= tb.chan < program.nchannels:
        raise MscclError(f"GPU {gid}, thread block {tb.id} uses channel {tb.chan}, outside 0..{program.nchannels - 1} "
                         f"(nchannels={program.nchannels})", gid, tb.id)
    if len(tb.steps) > min(limits.max_steps, limits.max_subs):
        raise MscclError(f"GPU {gid}, thread block {tb.id} has {len(tb.steps)} steps, over MSCCL_MAX_NUM_STEPS="
                         f"{limits.max_steps}; use fewer chunks per loop, pipeline=1, or more channels", gid, tb.id)
    pending_deps = False
    for pos, st in enumerate(tb.steps):
        at = _at(gid, tb.id, st.s, st.type)
        if st.s != pos:
            raise MscclError(f"{at} is the thread block's step number {pos}; steps must be numbered 0, 1, 2, ... in "
                             f"order (dependencies name them)", gid, tb.id, st.s)
        if not 0 <= st.cnt <= limits.max_count:
            raise MscclError(f"{at} has cnt={st.cnt}; MSCCL_MAX_COUNT allows 0..{limits.max_count}", gid, tb.id, st.s)
        if st.hasdep not in (0, 1):
            raise MscclError(f"{at} has hasdep={st.hasdep}; it must be 0 or 1", gid, tb.id, st.s)
        if st.depid >= 0:
            if st.depid >= ntbs or st.deps < 0:
                raise MscclError(f"{at} depends on thread block {st.depid} step {st.deps}, which does not exist",
                                 gid, tb.id, st.s)
            if st.depid > limits.max_dep_tb:
                raise MscclError(f"{at} depends on thread block {st.depid}; dependentBid is an int8, at most "
                                 f"{limits.max_dep_tb}", gid, tb.id, st.s)
        elif st.depid < -1:
            raise MscclError(f"{at} has depid={st.depid}; use -1 for no dependency", gid, tb.id, st.s)
        kind = st.kind
        if st.type == "nop":
            pending_deps = pending_deps or st.depid >= 0
            continue
        if pending_deps and st.depid < 0:
            raise MscclError(f"{at} follows nop dependencies but has none itself; the parser refuses such a chain "
                             f"(the last dependency must be on the step)", gid, tb.id, st.s)
        pending_deps = False
        if kind.send and tb.send < 0:
            raise MscclError(f"{at} sends, but thread block {tb.id} has no send peer (send=-1)", gid, tb.id, st.s)
        if kind.recv and tb.recv < 0:
            raise MscclError(f"{at} receives, but thread block {tb.id} has no receive peer (recv=-1)", gid, tb.id, st.s)
        for used, buf, off in ((kind.reads_src, st.srcbuf, st.srcoff), (kind.writes_dst or kind.reads_dst, st.dstbuf, st.dstoff)):
            if used and not (0 <= off and off + st.cnt <= g.chunks(buf)):
                raise MscclError(f"{at} touches {buf}[{off}:{off + st.cnt}], outside the {g.chunks(buf)} chunks GPU "
                                 f"{gid} declares for buffer {buf!r}", gid, tb.id, st.s)


# ---- replay -------------------------------------------------------------------------------------------------
@dataclass
class _Event:
    tbx: int  # global thread-block index (vector-clock slot)
    clock: int
    gpu: int
    tb: int
    step: int
    typ: str

    def label(self) -> str:
        return f"thread block {self.tb}, step {self.step} ({self.typ})"


@dataclass
class _Cell:
    value: Value
    writer: _Event | None = None
    reads: list[_Event] = field(default_factory=list)


@dataclass
class _Message:
    value: Value
    vc: np.ndarray
    event: _Event
    cnt: int
    unit: int


@dataclass
class _TbState:
    gpu: int
    tb: MscclThreadBlock
    tbx: int
    vc: np.ndarray
    pc: int = 0
    unit: int = 0
    started: bool = False
    clock: int = 0
    flag: int = -1
    #: (step index, vector clock) of every completed step with hasdep=1, in order.
    flags: list[tuple[int, np.ndarray]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.pc >= len(self.tb.steps)

    @property
    def step(self) -> MscclStep:
        return self.tb.steps[self.pc]


class _Replay:
    def __init__(self, program: MscclProgram, aliased: bool, fifo_depth: int) -> None:
        self.p = program
        self.aliased = aliased
        self.depth = fifo_depth
        self.full = (1 << program.ngpus) - 1
        self.gpus = {g.id: g for g in program.gpus}
        self.states: list[_TbState] = []
        self.by_tb: dict[tuple[int, int], _TbState] = {}
        ntb = sum(len(g.tbs) for g in program.gpus)
        clocks = np.zeros((ntb, ntb), np.int32)  # one (lazily zeroed) block, not a vector clock allocation per block
        for g in sorted(program.gpus, key=lambda g: g.id):
            for tb in sorted(g.tbs, key=lambda t: t.id):
                st = _TbState(g.id, tb, len(self.states), clocks[len(self.states)])
                self.states.append(st)
                self.by_tb[(g.id, tb.id)] = st
        self.fifos: dict[tuple[int, int, int], deque[_Message]] = {}
        self.mem: dict[tuple[int, str, int], _Cell] = {}
        self.coll = COLLS[program.coll]
        self.per = program.nchunksperloop // program.ngpus
        for g in program.gpus:
            for buf, j, value in self.coll.initial(g.id, self.per, g.i_chunks, self.full):
                self.mem[self._key(g.id, buf, j)] = _Cell(value)
        self.units = 0
        self.steps = 0

    # -- memory with race checks --
    def _key(self, gpu: int, buf: str, idx: int) -> tuple[int, str, int]:
        if not self.aliased:
            return (gpu, buf, idx)
        b, i = self.coll.alias(gpu, self.per, buf, idx)
        return (gpu, b, i)

    @staticmethod
    def _hb(a: _Event, vc: np.ndarray) -> bool:
        return bool(vc[a.tbx] >= a.clock)

    def _read(self, ev: _Event, vc: np.ndarray, buf: str, idx: int) -> Value:
        cell = self.mem.get(self._key(ev.gpu, buf, idx))
        if cell is None or cell.value is None or (cell.writer is not None and not self._hb(cell.writer, vc)):
            raise self._read_error(ev, vc, buf, idx, cell)
        cell.reads.append(ev)
        return cell.value

    def _read_error(self, ev: _Event, vc: np.ndarray, buf: str, idx: int, cell: _Cell | None) -> MscclError:
        where = _at(ev.gpu, ev.tb, ev.step, ev.typ)
        if cell is None or cell.value is None:
            return MscclError(f"{where} reads {buf}[{idx}] before anything arrives there (it is never written before "
                              f"this step can run)", ev.gpu, ev.tb, ev.step)
        assert cell.writer is not None
        return MscclError(
            f"{where} reads {buf}[{idx}] before it arrives: {cell.writer.label()} writes it and no dependency "
            f"orders the write first (add depid={cell.writer.tb} deps={cell.writer.step})", ev.gpu, ev.tb, ev.step)

    def _write(self, ev: _Event, vc: np.ndarray, buf: str, idx: int, value: Value) -> None:
        key = self._key(ev.gpu, buf, idx)
        cell = self.mem.get(key)
        if cell is None:
            cell = self.mem[key] = _Cell(None)
        for r in cell.reads:
            if r is not ev and not self._hb(r, vc):
                raise MscclError(
                    f"{_at(ev.gpu, r.tb, r.step, r.typ)} reads {buf}[{idx}] unordered with {ev.label()}, which "
                    f"overwrites it: the read may see the chunk before its data arrive or after it is replaced "
                    f"(no dependency chain orders them)", ev.gpu, r.tb, r.step)
        if cell.writer is not None and cell.writer is not ev and not self._hb(cell.writer, vc):
            raise MscclError(f"{_at(ev.gpu, ev.tb, ev.step, ev.typ)} writes {buf}[{idx}] unordered with "
                             f"{cell.writer.label()}, which also writes it; add a dependency", ev.gpu, ev.tb, ev.step)
        cell.value, cell.writer, cell.reads = value, ev, []

    def _reduce(self, ev: _Event, a: Value, b: Value, what: Callable[[], str]) -> Value:
        """``a + b``; ``what()`` describes the addition in an error (built only then: this runs per chunk)."""
        assert a is not None and b is not None  # _read and message values are never undefined
        if a[0] != b[0]:
            raise MscclError(f"{_at(ev.gpu, ev.tb, ev.step, ev.typ)} adds chunk position {a[0]} to chunk position "
                             f"{b[0]} ({what()}); a reduction only adds equal positions", ev.gpu, ev.tb, ev.step)
        twice = a[1] & b[1]
        if twice:
            raise MscclError(f"{_at(ev.gpu, ev.tb, ev.step, ev.typ)} counts the contribution of GPU(s) {_gpus_of(twice)} "
                             f"to chunk {a[0]} twice ({what()}): a duplicate reduction", ev.gpu, ev.tb, ev.step)
        return (a[0], a[1] | b[1])

    # -- execution --
    def _deps_ready(self, s: _TbState) -> bool:
        st = s.step
        if st.depid < 0:
            return True
        other = self.by_tb[(s.gpu, st.depid)]
        if other.flag < st.deps:
            return False
        vc = next(v for idx, v in other.flags if idx >= st.deps)  # the earliest flag write that satisfies it
        np.maximum(s.vc, vc, out=s.vc)
        return True

    def _try(self, s: _TbState) -> bool:
        """Advance ``s`` by one chunk (or one whole nop / empty step); False when it is blocked."""
        st = s.step
        if not s.started:
            if not self._deps_ready(s):
                return False
            s.started = True
        kind = st.kind
        if st.type == "nop" or st.cnt == 0:
            self._complete(s)
            return True
        tb = s.tb
        inq = self.fifos.get((tb.recv, s.gpu, tb.chan)) if kind.recv else None
        if kind.recv and not inq:
            return False
        outkey = (s.gpu, tb.send, tb.chan)
        if kind.send and len(self.fifos.get(outkey, ())) >= self.depth:
            return False
        s.clock += 1
        s.vc[s.tbx] = s.clock
        ev = _Event(s.tbx, s.clock, s.gpu, tb.id, st.s, st.type)
        j = s.unit
        msg_value: Value = None
        if kind.recv:
            assert inq is not None
            msg = inq.popleft()
            if msg.cnt != st.cnt:
                raise MscclError(
                    f"{_at(s.gpu, tb.id, st.s, st.type)} receives cnt={st.cnt} from GPU {tb.recv} on channel {tb.chan}, "
                    f"but the matching send ({msg.event.label()} on GPU {tb.recv}) has cnt={msg.cnt}: a receive is "
                    f"missing or extra on this connection", s.gpu, tb.id, st.s)
            np.maximum(s.vc, msg.vc, out=s.vc)
            msg_value = msg.value
        vc = s.vc
        src = self._read(ev, vc, st.srcbuf, st.srcoff + j) if kind.reads_src else None
        dst = self._read(ev, vc, st.dstbuf, st.dstoff + j) if kind.reads_dst else None
        if st.type == "re":
            result = self._reduce(ev, dst, src, lambda: f"{st.dstbuf}[{st.dstoff + j}] += {st.srcbuf}[{st.srcoff + j}]")
        elif kind.reduce:
            result = self._reduce(ev, msg_value, src,
                                  lambda: f"received from GPU {tb.recv} + {st.srcbuf}[{st.srcoff + j}]")
        elif kind.recv:
            result = msg_value
        else:
            result = src
        if kind.writes_dst:
            self._write(ev, vc, st.dstbuf, st.dstoff + j, result)
        if kind.send:
            self.fifos.setdefault(outkey, deque()).append(_Message(result, vc.copy(), ev, st.cnt, j))
        self.units += 1
        s.unit += 1
        if s.unit >= st.cnt:
            self._complete(s)
        return True

    def _complete(self, s: _TbState) -> None:
        st = s.step
        if st.hasdep and st.type != "nop":  # the parser makes no transmission (and no flag) of a nop
            s.flag = st.s
            s.flags.append((st.s, s.vc.copy()))
        s.pc += 1
        s.unit = 0
        s.started = False
        self.steps += 1

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for s in self.states:
                while not s.done and self._try(s):
                    progress = True
        stuck = [s for s in self.states if not s.done]
        if stuck:
            raise self._deadlock(stuck)
        for (src, dst, chan), q in sorted(self.fifos.items()):
            if q:
                e = q[0].event
                raise MscclError(f"{_at(src, e.tb, e.step, e.typ)} sends to GPU {dst} on channel {chan}, but nothing on "
                                 f"GPU {dst} receives it (a missing receive)", src, e.tb, e.step)
        self._postcondition()

    def _remaining(self, gpu: int, chan: int, side: str, peer: int) -> bool:
        """Whether GPU ``gpu``'s thread block with ``side`` (send/recv) = ``peer`` on ``chan`` still has such a step."""
        s = next((x for x in self.states if x.gpu == gpu and x.tb.chan == chan and getattr(x.tb, side) == peer), None)
        return s is not None and any(getattr(x.kind, side) for x in s.tb.steps[s.pc:])

    def _deadlock(self, stuck: list[_TbState]) -> MscclError:
        waits: list[tuple[int, MscclError]] = []
        for s in stuck:
            st, tb = s.step, s.tb
            at = _at(s.gpu, tb.id, st.s, st.type)
            if not s.started:
                other = self.by_tb[(s.gpu, st.depid)]
                never = other.done or not any(x.hasdep and x.s >= st.deps for x in other.tb.steps[other.pc:])
                why = "which never comes (no later step there has hasdep=1)" if never else "which never completes"
                waits.append((0 if never else 3, MscclError(
                    f"{at} waits for thread block {st.depid} step {st.deps} {why}: deadlock", s.gpu, tb.id, st.s)))
            elif st.kind.recv and not self.fifos.get((tb.recv, s.gpu, tb.chan)):
                sender = self._remaining(tb.recv, tb.chan, "send", s.gpu)
                waits.append((2 if sender else 1, MscclError(
                    f"{at} waits for a chunk from GPU {tb.recv} on channel {tb.chan} that "
                    f"{'is not sent yet: deadlock' if sender else 'is never sent (a missing send, or an extra receive)'}",
                    s.gpu, tb.id, st.s)))
            else:
                receiver = self._remaining(tb.send, tb.chan, "recv", s.gpu)
                why = "does not receive it yet: deadlock" if receiver else "never receives it (a missing receive)"
                waits.append((2 if receiver else 0, MscclError(
                    f"{at} sends to GPU {tb.send} on channel {tb.chan}, but GPU {tb.send} {why}", s.gpu, tb.id, st.s)))
        return min(waits, key=lambda w: w[0])[1]

    def _postcondition(self) -> None:
        for g in sorted(self.p.gpus, key=lambda g: g.id):
            for buf, j, want in self.coll.final(g.id, self.per, self.p.nchunksperloop, self.full):
                cell = self.mem.get(self._key(g.id, buf, j))
                value = cell.value if cell else None
                if value == want:
                    continue
                last = f"; last written by {cell.writer.label()}" if cell and cell.writer else ""
                mode = "in-place" if self.aliased else "out-of-place"
                if value is None:
                    what = "nothing"
                elif value[0] != want[0]:
                    what = f"chunk position {value[0]} (not {want[0]})"
                else:
                    what = f"the sum over GPU(s) {_gpus_of(value[1])}, missing {_gpus_of(self.full & ~value[1])}"
                w = cell.writer if cell else None
                raise MscclError(f"GPU {g.id} ends ({mode}) with {what} in output chunk {j}, not {self.coll.goal}{last}",
                                 g.id, w.tb if w else None, w.step if w else None)


def check_msccl_program(program: MscclProgram, *, fifo_depth: int = 2, limits: MscclLimits = DEFAULT_LIMITS) -> ReplayStats:
    """Validate ``program`` and replay it in every mode it declares; see the module docstring."""
    if not isinstance(fifo_depth, int) or fifo_depth < 1:
        raise ValueError(f"fifo_depth={fifo_depth!r} must be an integer >= 1 (chunks a connection buffers)")
    validate_program(program, limits)
    modes = [m for m, on in (("in-place", program.inplace), ("out-of-place", program.outofplace)) if on]
    steps = units = 0
    for mode in modes:
        replay = _Replay(program, mode == "in-place", fifo_depth)
        replay.run()
        steps, units = replay.steps, replay.units
    tbs = [tb for g in program.gpus for tb in g.tbs]
    return ReplayStats(tuple(modes), steps, units, max((len(g.tbs) for g in program.gpus), default=0),
                       max((len(tb.steps) for tb in tbs), default=0), 1 + max((tb.chan for tb in tbs), default=0))


def check_msccl_xml(xml_text: str, *, fifo_depth: int = 2, limits: MscclLimits = DEFAULT_LIMITS) -> ReplayStats:
    """Parse an MSCCL algorithm file's text and prove it does its ``coll`` (raises :class:`MscclError` if not)."""
    return check_msccl_program(parse_msccl_xml(xml_text), fifo_depth=fifo_depth, limits=limits)
