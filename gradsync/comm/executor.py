"""Execute any planned :class:`~gradsync.plan.schedule.Schedule` on a point-to-point transport.

The schedule is the program. For its own rank the executor compiles, per chunk, a list of *phases* (the
steps at which this rank sends or receives that chunk) and then runs them as a dataflow:

* a phase starts as soon as the previous phase of the same chunk has finished, so chunks never wait for
  each other and a tree or ring streams (OMS §2, MXNET-MPI Fig. 9): while one chunk's reduction is
  being added, other chunks' messages are on the wire;
* sends go straight from the caller's tensor (no copy) when the chunk is one contiguous piece; a chunk that
  spans several tensors (a "tensor collective", MXNET-MPI §6; per-layer pieces, BML §4.1) is packed
  into one message of the chunk's size;
* a reducing receive lands in a chunk-sized scratch buffer and is added in place; a copying receive lands
  directly in the caller's tensor. No full-size copy of the buffer is ever made.

Waiting: gloo's p2p work objects cannot be polled, and a timed-out wait closes the connection, so the
executor blocks on one message at a time: the in-flight message with the smallest key
``(order, step, priority, chunk, transfer index)``, where ``order`` is the cost model's predicted
finish time (:meth:`~gradsync.sim.cost.CostModel.wait_order`; 0 without one, i.e. step order), so a relay
handles sub-chunks in the order they arrive. Every dependency of a transfer, and every earlier phase of
its chunk at either end, has a smaller key, so the globally smallest unfinished transfer always has both
ends posted and waited on; by induction the run cannot deadlock, whatever the schedule. Each wait has a timeout, and a
failed or silent peer surfaces as :class:`~gradsync.errors.PeerError` naming that rank.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradsync.comm.transport import Handle, Transport
from gradsync.errors import GradsyncError, PeerError
from gradsync.plan.schedule import Schedule

__all__ = ["Action", "Phase", "RankProgram", "ExecStats", "Executor", "compile_program", "process_mapping", "OPS",
           "PROGRESS", "SMALL_RUN_BYTES"]

#: How the executor learns that messages finished: per-(peer, direction) waiting threads, or one in key order;
#: ``auto``: lanes unless the run is small (:data:`SMALL_RUN_BYTES`).
PROGRESS = ("auto", "lanes", "ordered")
#: Runs of at most this many bytes (the whole buffer) wait in key order even with ``progress="auto"``: a
#: small run has no large message for another to wait behind, and each lane's hand-off costs a thread
#: wake-up (on the racks testbed, up to this size, key order took less time and less CPU per call). Lanes
#: win where large messages from several peers overlap (BML at MiB sizes on bcube:3,2).
SMALL_RUN_BYTES = 256 << 10
#: Reduction ops the executor applies after the sum: ``avg`` divides by the world size in place.
OPS = ("sum", "avg")


@dataclass(frozen=True)
class Action:
    """One side of one transfer, seen from this rank."""

    index: int  # transfer index in the schedule
    order: float  # when this transfer is expected to finish (Executor's ``order``; 0 when not given)
    chunk: int
    step: int
    priority: int
    peer: int  # process rank of the other side
    tag: int  # sequence number of this transfer among the transfers of its ordered (src, dst) pair
    send: bool
    reduce: bool

    @property
    def key(self) -> tuple[float, int, int, int, int]:
        """The wait order: global (both ends agree), after the transfer's dependencies and after the
        earlier phases of its chunk at both ends (see :meth:`gradsync.sim.cost.CostModel.wait_order`)."""
        return (self.order, self.step, self.priority, self.chunk, self.index)


@dataclass(frozen=True)
class Phase:
    """Everything this rank does to one chunk at one step: all sends read the pre-step value."""

    step: int
    sends: tuple[Action, ...]
    recvs: tuple[Action, ...]


@dataclass(frozen=True)
class RankProgram:
    """One rank's part of a schedule: per chunk, its phases in step order."""

    rank: int  # schedule rank
    process: int  # process rank
    phases: tuple[tuple[Phase, ...], ...]

    @property
    def num_messages(self) -> int:
        return sum(len(p.sends) + len(p.recvs) for ps in self.phases for p in ps)


@dataclass
class ExecStats:
    """What the last run moved and how long it took (for demos and benchmarks)."""

    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    runs: int = 0


def process_mapping(schedule: Schedule, mapping: Sequence[int] | Mapping[str, int] | None, world_size: int) -> list[int]:
    """Process rank of every schedule rank.

    ``mapping`` is ``None`` (schedule rank i runs on process i), a list ``proc_of[schedule_rank]``, or a dict
    from device name (as in the topology) to process rank.
    """
    n = schedule.world_size
    if n != world_size:
        raise GradsyncError(
            f"the schedule has {n} ranks ({schedule.topology!r}) but the process group has world_size={world_size}; "
            f"plan for a topology with {world_size} ranks, e.g. 'switch:{world_size}'"
        )
    if mapping is None:
        proc = list(range(n))
    elif isinstance(mapping, Mapping):
        unknown = sorted(set(mapping) - set(schedule.ranks))
        if unknown:
            raise GradsyncError(f"mapping names devices {unknown} that are not ranks of {schedule.topology!r}: {list(schedule.ranks)}")
        missing = [d for d in schedule.ranks if d not in mapping]
        if missing:
            raise GradsyncError(f"mapping gives no process for devices {missing}; map every rank device to a process rank")
        proc = [int(mapping[d]) for d in schedule.ranks]
    else:
        proc = [int(p) for p in mapping]
    if sorted(proc) != list(range(n)):
        raise GradsyncError(f"mapping {proc} must assign each of the process ranks 0..{n - 1} exactly once")
    return proc


def _pair_tags(schedule: Schedule) -> np.ndarray:
    """Per transfer: its position among the transfers of the same ordered (src, dst) pair, in key order."""
    a = schedule.arrays
    m = len(schedule.transfers)
    if m == 0:
        return np.zeros(0, np.int64)
    prio = np.fromiter((t.priority for t in schedule.transfers), np.int64, m)
    idx = np.arange(m)
    order = np.lexsort((idx, a["chunk"], prio, a["step"], a["dst"], a["src"]))
    pair = a["src"][order] * schedule.world_size + a["dst"][order]
    starts = np.r_[0, np.flatnonzero(np.diff(pair)) + 1]
    group_start = np.repeat(starts, np.diff(np.r_[starts, m]))
    tags = np.empty(m, np.int64)
    tags[order] = np.arange(m) - group_start
    return tags


def compile_program(schedule: Schedule, rank: int, proc_of: Sequence[int] | None = None,
                    order: Sequence[float] | np.ndarray | None = None) -> RankProgram:
    """Compile schedule rank ``rank``'s phases; ``proc_of`` maps schedule ranks to process ranks; ``order``
    (per transfer) sets the wait order, see :class:`Executor`."""
    n = schedule.world_size
    if not 0 <= rank < n:
        raise GradsyncError(f"rank {rank} is outside the schedule's ranks 0..{n - 1}")
    proc = list(range(n)) if proc_of is None else list(proc_of)
    tags = _pair_tags(schedule)
    a = schedule.arrays
    mine = np.flatnonzero((a["src"] == rank) | (a["dst"] == rank))
    per_chunk: list[dict[int, tuple[list[Action], list[Action]]]] = [{} for _ in schedule.chunks]
    for i in mine.tolist():
        t = schedule.transfers[i]
        send = t.src == rank
        at = 0.0 if order is None else float(order[i])
        act = Action(i, at, t.chunk, t.step, t.priority, proc[t.dst if send else t.src], int(tags[i]), send, t.reduce)
        sends, recvs = per_chunk[t.chunk].setdefault(t.step, ([], []))
        (sends if send else recvs).append(act)
    phases = tuple(
        tuple(
            Phase(step, tuple(sorted(s, key=lambda x: x.key)), tuple(sorted(r, key=lambda x: x.key)))
            for step, (s, r) in sorted(steps.items())
        )
        for steps in per_chunk
    )
    return RankProgram(rank, proc[rank], phases)


class _Ordered:
    """Posts each (peer, direction)'s messages in tag order, for backends that match by posting order."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, bool], int] = {}
        self._held: dict[tuple[int, bool], dict[int, Callable[[], None]]] = {}

    def post(self, action: Action, thunk: Callable[[], None]) -> None:
        lane = (action.peer, action.send)
        held = self._held.setdefault(lane, {})
        held[action.tag] = thunk
        nxt = self._next.get(lane, 0)
        while nxt in held:
            held.pop(nxt)()
            nxt += 1
        self._next[lane] = nxt


class Executor:
    """Runs one schedule, again and again, on one transport. Not thread-safe: one run at a time.

    ``mapping`` places schedule ranks (topology devices) on process ranks; see :func:`process_mapping`.
    ``timeout_s`` bounds every wait: a peer that crashed or stalls raises :class:`PeerError` instead of a hang.
    ``recv_window_bytes``: receives are posted ahead of their phase, in key order, into scratch buffers, up to
    this many bytes in flight (scratch is kept for the next run: the memory is up to this much). gloo (and
    MPI's rendezvous protocol) send a large message only after the receiver posted it, and that "ready"
    notice queues behind data on the same connection; posting early removes the round trip from every step.
    0 disables it.
    ``order``: per transfer, when it is expected to finish (:meth:`gradsync.sim.cost.CostModel.wait_order`;
    every rank must pass the same); messages are waited for in that order instead of step order, so a
    relay handles each sub-chunk as it arrives. It must not decrease along a chunk's phases at either end.
    ``progress``: ``"lanes"`` learns of finished messages from one waiting thread per (peer, direction), in
    arrival order, when every receive of a run fits the window and the transport matches by tag; otherwise
    (or with ``"ordered"``) one thread waits in key order. ``"auto"`` (default) is ``"lanes"`` except for runs
    that are small (:data:`SMALL_RUN_BYTES`). See :meth:`_execute_lanes`.
    """

    def __init__(
        self,
        schedule: Schedule,
        transport: Transport,
        *,
        mapping: Sequence[int] | Mapping[str, int] | None = None,
        timeout_s: float = 60.0,
        recv_window_bytes: int = 256 << 20,
        order: Sequence[float] | np.ndarray | None = None,
        progress: str = "auto",
    ) -> None:
        if not timeout_s > 0:
            raise GradsyncError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        if recv_window_bytes < 0:
            raise GradsyncError(f"recv_window_bytes={recv_window_bytes!r} must be >= 0 (0 posts receives only when due)")
        self.recv_window_bytes = int(recv_window_bytes)
        self.schedule = schedule
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.proc_of = process_mapping(schedule, mapping, transport.world_size)
        self.rank = self.proc_of.index(transport.rank)  # this process's schedule rank
        if progress not in PROGRESS:
            raise GradsyncError(f"progress={progress!r} is not one of {PROGRESS}")
        self.progress = progress
        self._lanes: dict[tuple[int, bool], _Lane] = {}
        # lane threads end with the executor (close(), or when it is garbage-collected)
        self._finalizer = weakref.finalize(self, _stop_lanes, self._lanes)
        if order is not None and len(order) != len(schedule.transfers):
            raise GradsyncError(f"order has {len(order)} entries but the schedule has {len(schedule.transfers)} transfers")
        self.program = compile_program(schedule, self.rank, self.proc_of, order)
        self._recv_order = sorted((a for ps in self.program.phases for p in ps for a in p.recvs), key=lambda a: a.key)
        self._device_of_proc = {p: schedule.ranks[r] for r, p in enumerate(self.proc_of)}
        self.stats = ExecStats()
        #: Set to a list to record, per message of the next runs, ``(transfer index, send?, peer process,
        #: seconds from the run's start until this rank learned it finished)``: compare with the cost
        #: model's per-transfer times (``SimResult.transfer_times``) to see where a run departs from its
        #: prediction (``perf_counter`` is one clock for every process of a host, testbed included).
        self.trace: list[tuple[int, bool, int, float]] | None = None
        #: Set to a list to record, per message this rank sends in the next runs, ``(peer process, bytes, posted,
        #: done)`` on :attr:`clock`: what the runtime's watch (:mod:`gradsync.comm.adapt`) turns into pair rates.
        self.sent: list[tuple[int, int, float, float]] | None = None
        #: The clock of :attr:`sent` (a test gives a fake one).
        self.clock: Callable[[], float] = time.perf_counter
        self._pieces: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}
        # Reused receive buffers: a fresh large torch.empty page-faults on every run.
        self._scratch: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    # ---- public -------------------------------------------------------------------------------------
    def run(self, tensors: torch.Tensor | Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor | list[torch.Tensor]:
        """Run the schedule's collective on ``tensors`` (one tensor or a list: one tensor collective) in place.

        Allreduce: every element ends summed. Reduce-scatter: this rank's shard of each tensor
        (:meth:`Schedule.shard` of its schedule rank) ends summed, the rest holds partial sums. Allgather: each
        rank's shard is copied to every rank. Every rank must call ``run`` with tensors of the same numels
        and dtype, in the same order.
        """
        single = isinstance(tensors, torch.Tensor)
        tlist = [tensors] if single else list(tensors)
        flats = _flat_views(tlist)
        if op not in OPS:
            raise GradsyncError(f"op={op!r} is not one of {OPS}")
        if op == "avg" and flats and not (flats[0].is_floating_point() or flats[0].is_complex()):
            raise TypeError(f"op='avg' needs a floating-point tensor, got {flats[0].dtype}; use op='sum' or convert first")
        t0 = time.perf_counter()
        self._execute(flats)
        if op == "avg" and self.schedule.collective == "allreduce":
            for f in flats:
                f.div_(self.schedule.world_size)
        elif op == "avg" and self.schedule.collective == "reduce_scatter":  # only this rank's shard is a sum
            for f in flats:
                lo, hi = self.schedule.shard(self.rank, f.numel())
                f[lo:hi].div_(self.schedule.world_size)
        dt = time.perf_counter() - t0
        self.stats.seconds += dt
        self.stats.runs += 1
        return tensors if single else tlist

    # ---- the dataflow ---------------------------------------------------------------------------------
    def _execute(self, flats: list[torch.Tensor]) -> None:
        schedule, transport, program = self.schedule, self.transport, self.program
        numels = tuple(int(f.numel()) for f in flats)
        pieces = self._pieces.get(numels)
        if pieces is None:
            if len(self._pieces) > 256:  # DDP buckets and layer lists repeat; bound the cache anyway
                self._pieces.clear()
            pieces = self._pieces[numels] = schedule.pieces(numels)
        views = [[flats[i][s:e] for i, s, e in pieces[c]] for c in range(len(schedule.chunks))]
        sizes = [sum(e - s for _, s, e in pieces[c]) for c in range(len(schedule.chunks))]
        like = flats[0] if flats else None
        lanes = self.progress == "lanes" or (
            self.progress == "auto" and like is not None and sum(sizes) * like.element_size() > SMALL_RUN_BYTES)
        if (lanes and not transport.ordered and like is not None
                and sum(sizes[a.chunk] for a in self._recv_order) * like.element_size() <= self.recv_window_bytes):
            self._execute_lanes(views, sizes, like)
            return
        ordered = _Ordered() if transport.ordered else None
        heap: list[tuple[tuple[int, int, int, int], bool, Action, Handle, torch.Tensor | None]] = []
        position = [0] * len(program.phases)
        pending = [0] * len(program.phases)
        stats = self.stats
        early: dict[int, tuple[Handle, torch.Tensor]] = {}  # transfer index -> receive posted ahead of its phase
        windowed: set[int] = set()  # receives in the heap whose bytes count against the window
        due: set[int] = set()  # receives already posted by their phase: never post them ahead (a second
        # receive with the same tag would steal the next collective's message)
        window = [self.recv_window_bytes if ordered is None and like is not None else 0, 0]  # [bytes left, next]
        recv_order = self._recv_order
        trace, t_start = self.trace, time.perf_counter()
        sent, clock = self.sent, self.clock
        posted: dict[int, float] = {}  # send transfer index -> when it was posted (only while watched)

        def post_ahead() -> None:
            """Post the next receives (key order) into scratch while the window has room."""
            assert like is not None
            while window[1] < len(recv_order):
                act = recv_order[window[1]]
                nbytes = sizes[act.chunk] * like.element_size()
                if nbytes > window[0]:
                    return
                window[1] += 1
                if nbytes == 0 or act.index in due:
                    continue
                buf = self._take_scratch(sizes[act.chunk], like)
                early[act.index] = (self._start(act, buf), buf)
                window[0] -= nbytes

        def post(act: Action, chunk_views: list[torch.Tensor], size: int) -> None:
            assert like is not None
            if act.send:
                buf = chunk_views[0] if len(chunk_views) == 1 else torch.cat(chunk_views)
                if sent is not None:
                    posted[act.index] = clock()
                handle = self._start(act, buf)
                stats.bytes_sent += size * like.element_size()
            elif act.index in early:
                handle, buf = early.pop(act.index)
                windowed.add(act.index)
                stats.bytes_received += size * like.element_size()
            else:
                due.add(act.index)
                direct = not act.reduce and len(chunk_views) == 1
                buf = chunk_views[0] if direct else self._take_scratch(size, like)
                handle = self._start(act, buf)
                stats.bytes_received += size * like.element_size()
                if direct:
                    buf = None  # landed in place: nothing to apply
            stats.messages += 1
            heapq.heappush(heap, (act.key, act.send, act, handle, buf))

        def start(chunk: int) -> None:
            """Start phases of ``chunk`` until one has messages in flight."""
            phases = program.phases[chunk]
            size = sizes[chunk]
            while position[chunk] < len(phases):
                phase = phases[position[chunk]]
                acts = phase.sends + phase.recvs
                if size == 0:  # nothing to move; keep ordered lanes' tag sequence intact
                    if ordered is not None:
                        for act in acts:
                            ordered.post(act, lambda: None)
                    position[chunk] += 1
                    continue
                pending[chunk] = len(acts)
                for act in acts:
                    if ordered is None:
                        post(act, views[chunk], size)
                    else:
                        ordered.post(act, lambda act=act: post(act, views[chunk], size))
                return

        if window[0] > 0:
            post_ahead()
        for c in range(len(program.phases)):
            start(c)
        while heap:
            _, _, act, handle, buf = heapq.heappop(heap)
            try:
                handle.wait(self.timeout_s)
            except PeerError as exc:
                raise self._context(act, exc) from exc
            if trace is not None:
                trace.append((act.index, act.send, act.peer, time.perf_counter() - t_start))
            if sent is not None and act.send:
                sent.append((act.peer, sizes[act.chunk] * like.element_size(), posted.pop(act.index), clock()))
            if not act.send and buf is not None:
                # Phases apply in key order: every earlier phase of this chunk (smaller keys) is done.
                _apply(views[act.chunk], buf, act.reduce)
                self._scratch.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)
                if act.index in windowed:  # posted ahead: give its bytes back to the window
                    windowed.discard(act.index)
                    window[0] += buf.numel() * buf.element_size()
                    post_ahead()
            pending[act.chunk] -= 1
            if pending[act.chunk] == 0:
                position[act.chunk] += 1
                start(act.chunk)

    def _execute_lanes(self, views: list[list[torch.Tensor]], sizes: list[int], like: torch.Tensor) -> None:
        """The dataflow, learning of finished messages in the order they finish.

        gloo's waits block and cannot be polled, so one waiting thread per (peer, direction) -- a *lane* --
        blocks on that lane's messages and reports each to this thread, which applies arrivals and starts
        phases in whatever order messages really finish: no message waits behind a slower one from another
        peer (the key-order discipline of :meth:`_execute` makes a tree's relay sit on an uplink's message
        while its rack's inputs have long arrived). Every receive of the run is posted first, in key order,
        so a receive lane waits in key order and a sender's message never needs the receiver's main thread.
        Cannot deadlock: by induction on the global key, the smallest unfinished transfer has had its
        phase started at both ends (all smaller keys are finished), its receive lane is at it, and its
        send lane is at most behind sends that were posted earlier on the same connection, which the
        receiver's pre-posted receives drain. A phase's receives are applied in key order, as in
        :meth:`_execute`, so results do not depend on arrival order. Every wait is bounded by ``timeout_s``.
        """
        program, stats = self.program, self.stats
        esize = like.element_size()
        trace, t_start = self.trace, time.perf_counter()
        sent, clock = self.sent, self.clock
        posted: dict[int, float] = {}  # send transfer index -> when it was posted (only while watched)
        done: queue.SimpleQueue = queue.SimpleQueue()
        landed: dict[int, torch.Tensor] = {}  # transfer index -> scratch holding its arrived message
        due: dict[int, Action] = {}  # receives whose phase has started, by transfer index
        position = [0] * len(program.phases)
        pending = [0] * len(program.phases)
        applied = [0] * len(program.phases)  # receives of the current phase applied, in key order
        outstanding = 0

        def lane(peer: int, send: bool) -> _Lane:
            got = self._lanes.get((peer, send))
            if got is None or not got.is_alive():
                got = self._lanes[(peer, send)] = _Lane(f"gradsync-lane-{'to' if send else 'from'}-{peer}")
            return got

        def apply_ready(chunk: int) -> None:
            """Apply the phase's arrived receives in key order; finish the phase when all is done."""
            phase = program.phases[chunk][position[chunk]]
            while applied[chunk] < len(phase.recvs) and phase.recvs[applied[chunk]].index in landed:
                act = phase.recvs[applied[chunk]]
                buf = landed.pop(act.index)
                due.pop(act.index, None)
                _apply(views[chunk], buf, act.reduce)
                self._scratch.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)
                applied[chunk] += 1
                pending[chunk] -= 1
            if pending[chunk] == 0:
                position[chunk] += 1
                start(chunk)

        def start(chunk: int) -> None:
            nonlocal outstanding
            phases = program.phases[chunk]
            size = sizes[chunk]
            if size == 0:
                position[chunk] = len(phases)
                return
            if position[chunk] >= len(phases):
                return
            phase = phases[position[chunk]]
            pending[chunk] = len(phase.sends) + len(phase.recvs)
            applied[chunk] = 0
            for act in phase.sends:
                buf = views[chunk][0] if len(views[chunk]) == 1 else torch.cat(views[chunk])
                if sent is not None:
                    posted[act.index] = clock()
                # the lane keeps ``buf`` (a packed copy for multi-piece chunks) alive until the send is done
                lane(act.peer, True).put(self._start(act, buf), act, done, self.timeout_s, buf,
                                         clock)
                stats.bytes_sent += size * esize
                stats.messages += 1
                outstanding += 1
            for act in phase.recvs:
                due[act.index] = act
            apply_ready(chunk)

        for act in self._recv_order:  # every receive first, in key order
            size = sizes[act.chunk]
            if size == 0:
                continue
            buf = self._take_scratch(size, like)
            lane(act.peer, False).put(self._start(act, buf), act, done, self.timeout_s, buf)
            stats.bytes_received += size * esize
            stats.messages += 1
            outstanding += 1
        for c in range(len(program.phases)):
            start(c)
        while outstanding:
            try:
                act, buf, err, finished = done.get(timeout=self.timeout_s + 30.0)
            except queue.Empty:  # a lane's own wait is bounded; this is the backstop
                raise PeerError(f"rank {self.transport.rank}: no message finished within {self.timeout_s + 30:g} s", -1) from None
            outstanding -= 1
            if trace is not None:
                trace.append((act.index, act.send, act.peer, finished - t_start))
            if err is not None:
                if isinstance(err, PeerError):
                    raise self._context(act, err) from err
                raise err
            if act.send:
                if sent is not None:
                    sent.append((act.peer, sizes[act.chunk] * esize, posted.pop(act.index), finished))
                pending[act.chunk] -= 1
                if pending[act.chunk] == 0:  # every receive of the phase was applied before
                    apply_ready(act.chunk)
            else:
                assert buf is not None  # receives always travel with their scratch buffer
                landed[act.index] = buf
                if act.index in due:
                    apply_ready(act.chunk)
        if any(position[c] < len(program.phases[c]) for c in range(len(program.phases))):  # pragma: no cover
            raise GradsyncError(f"{self.schedule.algorithm}: the run ended with phases left; this is a bug")

    def close(self) -> None:
        """Stop this executor's lane threads (also done when it is garbage-collected; they are daemons)."""
        self._finalizer()

    def _take_scratch(self, size: int, like: torch.Tensor) -> torch.Tensor:
        pool = self._scratch.get((size, like.dtype, like.device))
        if pool:
            return pool.pop()
        if len(self._scratch) > 16:  # tensor sizes keep changing: do not hoard buffers of old sizes
            self._scratch.clear()
        return torch.empty(size, dtype=like.dtype, device=like.device)

    def _start(self, act: Action, buf: torch.Tensor) -> Handle:
        """``act``'s send or receive of ``buf``, posted: a peer found gone at once (gloo raises there, not at the wait,
        where the peer's connection closed before the call) fails as a wait on it does, named in context."""
        try:
            return (self.transport.isend if act.send else self.transport.irecv)(buf, act.peer, act.tag)
        except PeerError as exc:
            raise self._context(act, exc) from exc

    def _context(self, act: Action, exc: PeerError) -> PeerError:
        """Name this rank, the transfer, and the rank that failed first according to the failure board."""
        me = self.transport.rank
        verb, prep = ("sending", "to") if act.send else ("receiving", "from")
        board = self.transport.capabilities.failures
        reports = board.read()
        # A rank that already lost a peer is itself not the culprit; blame the first peer no survivor reported.
        culprits = sorted({peer for reporter, (peer, _) in reports.items() if peer not in reports and peer != me})
        failed = culprits[0] if culprits else exc.peer
        board.post(me, failed, str(exc))
        blame = "" if failed == exc.peer else f"; rank {failed} ({self._device_of_proc[failed]}) failed first, as other ranks reported"
        return PeerError(
            f"rank {me} ({self._device_of_proc[me]}), {self.schedule.algorithm} {self.schedule.collective}: {verb} chunk {act.chunk} "
            f"(step {act.step}) {prep} rank {act.peer} ({self._device_of_proc[act.peer]}) failed: {exc}{blame}",
            failed,
        )


class _Lane:
    """A daemon thread that waits on one (peer, direction)'s messages in the order they are given and
    reports each ``(action, buffer, error)`` to the queue that came with it."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, handle: Handle, act: Action, out: queue.SimpleQueue, timeout_s: float,
            buf: torch.Tensor | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._q.put((handle, act, out, timeout_s, buf, clock))

    def stop(self) -> None:
        self._q.put(None)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            handle, act, out, timeout_s, buf, clock = item
            item = None
            try:
                handle.wait(timeout_s)
            except BaseException as exc:  # noqa: BLE001 - delivered to the executor's thread
                out.put((act, buf, exc, clock()))
            else:
                out.put((act, buf, None, clock()))
            # hold no backend work object while idle: the user may destroy its process group next
            handle = buf = out = None


def _stop_lanes(lanes: dict[tuple[int, bool], _Lane]) -> None:
    for ln in lanes.values():
        ln.stop()
    lanes.clear()


def _apply(chunk_views: list[torch.Tensor], buf: torch.Tensor, reduce: bool) -> None:
    """Add (reduce) or copy an arrived message into the chunk's pieces."""
    offset = 0
    for v in chunk_views:
        n = v.numel()
        part = buf[offset : offset + n]
        if reduce:
            v.add_(part)
        else:
            v.copy_(part)
        offset += n


def _flat_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """1-D views of the caller's tensors, validated: same dtype and device, contiguous."""
    flats = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {i} is a {type(t).__name__}; pass torch.Tensor objects")
        if not t.is_contiguous():
            raise TypeError(f"tensor {i} (shape {tuple(t.shape)}) is not contiguous; pass t.contiguous() and copy back")
        if t.dtype != tensors[0].dtype or t.device != tensors[0].device:
            raise TypeError(
                f"tensor {i} is {t.dtype} on {t.device} but tensor 0 is {tensors[0].dtype} on {tensors[0].device}; "
                f"a tensor collective moves one dtype on one device: group tensors by dtype first"
            )
        flats.append(t.view(-1))
    return flats


