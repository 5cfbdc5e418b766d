"""Communicators and the one fixed step that joins Compressor, Memory and Communicator (GRACE, MergeComp §4.1).

A :class:`Communicator` moves payloads between workers and returns the aggregate every worker applies
(GRACE's ``send_receive``). Three kinds, in the :data:`COMMUNICATOR_TYPES` registry:

* ``allreduce`` -- payloads that sum (FP32, FP16, Rand-k's values, PowerSGD's P and Q) go through the
  gradsync :class:`~gradsync.comm.runtime.Runtime`'s planned schedule, one tensor collective per dtype;
* ``allgather`` -- everything else (indices, packed bits, per-worker scales). Each worker's payload (a list
  of tensors of various dtypes and shapes) is serialised into **one** uint8 buffer with an explicit header
  (:func:`~gradsync.compress.payload.pack_payload`; no pickle), the buffers are gathered with uneven sizes
  (:meth:`~gradsync.comm.runtime.Runtime.run_allgather`: sizes first, then padded; one round when the
  compressor's payload size follows from the shapes alone), and each receiver decodes every worker's payload
  with its own ctx into one running aggregate (:meth:`~gradsync.compress.base.Compressor.combine`);
* ``ps`` -- through the parameter server (``gradsync/ps``, :class:`PSCommunicator`): summable payloads are
  pushed, a synchronous server round adds them, and the sum is pulled back.

All collectives of a step run inside one job on the runtime's communication thread
(:meth:`Runtime.submit`), so PowerSGD's two rounds and a group's exchange-and-decode can never interleave
with another caller's collective: ranks that submit in the same order stay matched. This is why our
PowerSGD runs on gloo with several DDP buckets (PyTorch's ``powerSGD_hook`` chains its second allreduce
from a future callback, and the buckets' rounds can then interleave differently on different ranks).

:class:`CompressionStep` is the step: compensate -> compress -> memory update -> exchange -> decompress and
aggregate -> average; it reproduces :func:`gradsync.compress.base.simulate_step` on real processes.

Non-finite gradients (``GradScaler``'s overflow steps, a diverging run): each tensor's payload travels with a mark
(:func:`~gradsync.compress.base.nonfinite_marks`: 0, or NaN when its compensated values or payload hold a NaN or
an inf), summed with the payload (allreduce) or packed into the same buffer (allgather). Where the sum is NaN the
aggregate comes back all NaN on every rank -- whatever the codec would have made of it (GradScaler then skips the
whole step). The marks ride in collectives the step runs anyway and are read on the host only at the next step.

The contract is per **training step**, as GradScaler's is: when any tensor of the step (any merged group, any DDP
bucket, on any rank -- every rank sums the same marks, so every rank reaches the same verdict) was non-finite,
*no* tensor's memory or compressor state (residuals, PowerSGD's Q, SigNUM's momentum, Rand-k's step, the seeded
generators) changes in that step: the later steps are bit for bit those of a run that never saw it. Every exchange
of a step is committed with one :class:`~gradsync.compress.base.StepVerdict` that a
:class:`~gradsync.compress.base.StepBoundary` keeps: a step begins at the first exchange after the last one ended
and ends where the owner says so (:meth:`CompressionStep.close_step`: ``DistributedOptimizer.step()`` through
:meth:`~gradsync.train.grouped.MergedGroups.wait`, the DDP hook after the bucket that ``GradBucket.is_last()``
names), or at the latest when a tensor name is sent a second time (a name travels once per step). The verdict is
read at the tensors' next use, when every exchange of the step has run; :attr:`CompressionStep.nonfinite_steps`
counts such steps, once each (each memory's ``nonfinite_steps`` counts the steps it dropped, also once each).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from gradsync.comm.collectives import dtype_groups
from gradsync.comm.runtime import Runtime, Work, get_runtime
from gradsync.compress.base import (
    Checkpoint,
    CompressionError,
    Compressor,
    Context,
    Memory,
    StepBoundary,
    StepVerdict,
    TensorInfo,
    TwoRoundCompressor,
    Verdicts,
    cast,
    create,
    create_memory,
    nonfinite_marks,
    shares_memory,
)
from gradsync.compress.memory import NoMemory, default_memory
from gradsync.compress.payload import pack_payload, unpack_payload
from gradsync.registry import Registry

__all__ = [
    "COMMUNICATOR_TYPES",
    "AllgatherCommunicator",
    "AllreduceCommunicator",
    "CompressionStep",
    "Communicator",
    "PSCommunicator",
    "create_communicator",
    "register_communicator",
    "write_aggregate",
    "write_aggregates",
]

# -- communicators ----------------------------------------------------------------------------------------

Item = tuple[list[Tensor], Context]


class Communicator(ABC):
    """Exchanges one step's payloads and returns what every worker applies (GRACE's ``send_receive``).

    :meth:`exchange` runs on the runtime's communication thread (inside :meth:`submit`), so it may run
    several collectives back to back. Results are averaged over workers unless ``compressor.average`` is
    False (majority vote), divided exactly as :func:`~gradsync.compress.base.simulate_step` divides.
    """

    name: ClassVar[str] = ""
    #: Whether :meth:`reduce_sum` works, so two-round compressors (PowerSGD) can run both rounds.
    sums: ClassVar[bool] = False

    def __init__(self, runtime: Runtime | None = None) -> None:
        if runtime is not None and not isinstance(runtime, Runtime):
            raise CompressionError(f"runtime must be a gradsync Runtime (gradsync.init()), got {type(runtime).__name__}")
        self._runtime = runtime

    @property
    def runtime(self) -> Runtime:
        """The runtime given, else ``gradsync.get_runtime()`` at first use: a trainer may build the communicator
        (in a hook state) before it makes the process group."""
        if self._runtime is None:
            self._runtime = get_runtime()
        return self._runtime

    @runtime.setter
    def runtime(self, value: Runtime) -> None:
        self._runtime = value

    @property
    def resolved(self) -> bool:
        """Whether :attr:`runtime` has been found (given, or looked up at first use)."""
        return self._runtime is not None

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    def check(self, compressor: Compressor) -> None:
        """Raise if this communicator cannot carry ``compressor``'s payloads (default: it can)."""
        return None

    def submit(self, fn: Callable[[], Any]) -> Work:
        """Run ``fn`` on the communication thread, in order with every other queued collective."""
        return self.runtime.submit(fn, self.name)

    @abstractmethod
    def exchange(self, compressor: Compressor, items: Sequence[Item], outs: Sequence[Tensor | None] | None = None,
                 marks: Tensor | None = None) -> list[Tensor]:
        """Every worker's payload for each item -> the aggregated tensor per item (comm thread only).

        ``outs``: per item, a buffer the aggregate may be written into (or None); a communicator may ignore it.
        ``marks``: per item, this rank's non-finite mark (0 or NaN, :func:`nonfinite_marks`); it travels with the
        payloads and is summed over ranks in place, and an item whose sum is NaN comes back all NaN.
        """

    def reduce_sum(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Sum ``tensors`` over workers in place (comm thread only); communicators with ``sums`` override."""
        raise CompressionError(f"communicator {self.name!r} cannot sum tensors; two-round compressors need 'allreduce'")

    def _finish(self, compressor: Compressor, result: Tensor, info: TensorInfo, *, owned: bool = False,
                averaged: bool = False, mark: Tensor | None = None) -> Tensor:
        """The average over workers (``owned``: divided in ``result``'s own buffer; ``averaged``: it already
        is), in ``info``'s shape and dtype. ``mark``: the item's summed non-finite mark (0 or NaN, float32): the
        division is by ``world + mark`` -- the same bits where it is 0, all NaN where not, in the same pass."""
        if compressor.average and not averaged:
            divisor: Any = self.world_size if mark is None else mark + self.world_size
            result = result.div_(divisor) if owned and result.dtype.is_floating_point else result / divisor
        elif mark is not None:  # x * 1 is x exactly
            result = result.mul_(mark + 1) if owned else result * (mark + 1)
        return result.reshape(info.shape).to(info.dtype)


def _summed_marks(marks: Tensor | None) -> Tensor | None:
    """Per-item float32 marks for :meth:`Communicator._finish`, or None where nothing needs marking: no marks, or
    on the CPU all finite (read at once there; a GPU never reads them on the host and always applies them)."""
    if marks is None:
        return None
    if marks.device.type == "cpu" and not bool(torch.isnan(marks).any()):
        return None
    return marks.to(torch.float32)


COMMUNICATOR_TYPES: Registry[type[Communicator]] = Registry("communicator", CompressionError)
K = TypeVar("K", bound=type[Communicator])


def register_communicator(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[K], K]:
    """Class decorator: register a communicator (``gradsync/ps`` registers ``ps`` this way)."""

    def deco(cls: K) -> K:
        cls.name = name
        COMMUNICATOR_TYPES.add(name, cls, aliases=aliases)
        return cls

    return deco


def create_communicator(name: str, runtime: Runtime | None = None, **params: Any) -> Communicator:
    """A communicator by registry name, on ``runtime`` (default: ``gradsync.init``'s, looked up at first use)."""
    return COMMUNICATOR_TYPES.get(name)(runtime=runtime, **params)


@register_communicator("allreduce")
class AllreduceCommunicator(Communicator):
    """Sum payloads with the runtime's planned allreduce, then decompress the sum once (payloads must sum)."""

    sums = True

    def check(self, compressor: Compressor) -> None:
        if compressor.communicator != "allreduce":
            raise CompressionError(
                f"compressor {compressor.name!r} sends payloads that do not sum (indices, packed bits or per-worker "
                f"scales); use communicator='allgather' (its default) instead of 'allreduce'"
            )

    def reduce_sum(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """One tensor collective per dtype (a collective moves one dtype), in order of first appearance."""
        tensors = list(tensors)
        for group in dtype_groups(tensors):
            self.runtime.run_allreduce(group, "sum")
        return tensors

    def exchange(self, compressor: Compressor, items: Sequence[Item], outs: Sequence[Tensor | None] | None = None,
                 marks: Tensor | None = None) -> list[Tensor]:
        flat = [t for payload, _ in items for t in payload]
        self.reduce_sum(flat if marks is None else [*flat, marks])  # the marks join a payload dtype's collective
        summed = _summed_marks(marks)
        return [self._decoded(compressor, compressor.decompress(payload, ctx, outs[i] if outs else None), payload, ctx,
                              None if summed is None else summed[i]) for i, (payload, ctx) in enumerate(items)]

    def _decoded(self, compressor: Compressor, result: Tensor, payload: Sequence[Tensor], ctx: Context,
                 mark: Tensor | None = None) -> Tensor:
        """:meth:`_finish` of a decoded sum: averaged in place unless it is a payload tensor (``none`` sends x)."""
        return self._finish(compressor, result, ctx.info, owned=not shares_memory(result, payload), mark=mark)


@register_communicator("allgather")
class AllgatherCommunicator(Communicator):
    """Gather every worker's packed payloads (uneven sizes), decompress each with the local ctx, aggregate.

    All items of one call travel in one buffer, so a DDP bucket or a merged group costs one allgather.
    """

    def exchange(self, compressor: Compressor, items: Sequence[Item], outs: Sequence[Tensor | None] | None = None,
                 marks: Tensor | None = None) -> list[Tensor]:
        counts = [len(payload) for payload, _ in items]
        mine = [t for payload, _ in items for t in payload]
        sent = len(mine) + (marks is not None)
        packed = pack_payload(mine if marks is None else [*mine, marks])  # the marks: the buffer's last tensor
        gathered = [unpack_payload(b) for b in self.runtime.run_allgather(packed, equal_sizes=compressor.payload_shapes_fixed)]
        for rank, tensors in enumerate(gathered):
            if len(tensors) != sent:
                raise CompressionError(
                    f"rank {rank} sent {len(tensors)} payload tensors where this rank sent {sent}: the ranks "
                    "ran different compressors or partitions"
                )
        if marks is not None:
            marks.copy_(torch.stack([tensors[-1] for tensors in gathered]).sum(dim=0))
        summed = _summed_marks(marks)
        out, at = [], 0
        for i, ((_, ctx), n) in enumerate(zip(items, counts)):
            # decoded and summed into the destination where given; either way the caller's: averaged in place
            combined = compressor.combine([tensors[at : at + n] for tensors in gathered], ctx, outs[i] if outs else None)
            out.append(self._finish(compressor, combined, ctx.info, owned=True,
                                    mark=None if summed is None else summed[i]))
            at += n
        return out


@register_communicator("ps")
class PSCommunicator(AllreduceCommunicator):
    """Through the parameter server (MXNET-MPI): push each payload tensor, the servers sum a synchronous round,
    pull the sum, decompress it once. Payloads must sum (the server adds raw tensors, it never decompresses).

    ``kv``: a ``dist_sync`` KVStore (default: created from the environment ``gradsync launch`` sets, on the
    communication thread, which then owns its sockets). Keys are ``"compress/<dtype>/<shape>/<k>"``, the k-th
    payload of that dtype and shape in one exchange: ranks exchange in the same order, so keys and rounds
    match without names, and a key is initialised (collectively) the first time it appears.
    """

    def __init__(self, runtime: Runtime | None = None, kv: Any = None) -> None:
        super().__init__(runtime)
        self.kv = kv
        self._keys: set[str] = set()

    def check(self, compressor: Compressor) -> None:
        if compressor.communicator != "allreduce":
            raise CompressionError(
                f"compressor {compressor.name!r} sends payloads the server cannot add (indices, packed bits or "
                f"per-worker scales); the ps communicator carries summable ones (none, fp16, randk, powersgd)"
            )

    def reduce_sum(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        if self.kv is None:
            from gradsync.ps.kvstore import create

            self.kv = create("dist_sync")
        tensors = list(tensors)
        seen: dict[str, int] = {}
        keys = []
        for t in tensors:
            base = f"compress/{str(t.dtype).removeprefix('torch.')}/{'x'.join(map(str, t.shape))}"
            seen[base] = seen.get(base, -1) + 1
            keys.append(f"{base}/{seen[base]}")
        new = [i for i, k in enumerate(keys) if k not in self._keys]
        if new:
            self.kv.init([keys[i] for i in new], [torch.zeros_like(tensors[i]) for i in new])
            self._keys.update(keys[i] for i in new)
        if tensors:
            self.kv.pushpull(keys, [t.contiguous() for t in tensors], tensors)
        return tensors


# -- the step -----------------------------------------------------------------------------------------------

class CompressionStep:
    """Compressor + Memory + Communicator, joined by one fixed step (GRACE's ``step``, MergeComp Algorithm 1).

    ``compressor``: a :class:`Compressor` or a registry name; ``memory``: a :class:`Memory`, a name, or None
    for :func:`default_memory`; ``communicator``: a :class:`Communicator`, a name, or None for the
    compressor's own (``compressor.communicator``). Per-tensor state is keyed by ``TensorInfo.name``, so one
    step object serves every tensor (or merged group) of a model.
    """

    def __init__(
        self,
        compressor: Compressor | str,
        memory: Memory | str | None = None,
        communicator: Communicator | str | None = None,
        *,
        runtime: Runtime | None = None,
    ) -> None:
        self.compressor = create(compressor) if isinstance(compressor, str) else compressor
        if not isinstance(self.compressor, Compressor):
            raise CompressionError(f"compressor={compressor!r} must be a Compressor or a name from gradsync compress list")
        if memory is None:
            memory = default_memory(self.compressor)
        self.memory = create_memory(memory) if isinstance(memory, str) else memory
        if not isinstance(self.memory, Memory):
            raise CompressionError(f"memory={memory!r} must be a Memory or one of none, residual, dgc")
        if communicator is None:
            communicator = self.compressor.communicator
        self.communicator = (
            create_communicator(communicator, runtime) if isinstance(communicator, str) else communicator
        )
        if not isinstance(self.communicator, Communicator):
            raise CompressionError(f"communicator={communicator!r} must be a Communicator or one of {COMMUNICATOR_TYPES.names()}")
        self.communicator.check(self.compressor)
        self.two_rounds = isinstance(self.compressor, TwoRoundCompressor) and self.communicator.sums
        #: the open training step's verdict and the count of non-finite steps (see the module doc)
        self.boundary = StepBoundary()

    def close_step(self) -> None:
        """The training step is over: the next exchange begins the next one (its tensors' states are then rolled
        back together if one of them was non-finite anywhere)."""
        self.boundary.close()

    @property
    def nonfinite_steps(self) -> int:
        """Closed training steps that had a NaN or inf in some tensor on some worker (their updates were dropped)."""
        return self.boundary.nonfinite_steps

    @property
    def cast_dtype(self) -> torch.dtype | None:
        """The wire dtype when this step is a plain elementwise cast (fp16, bf16) with no memory, summed by
        allreduce: a bucket may then be cast whole and summed by the backend's own allreduce, which gives the same
        bits as :meth:`step_async` at a fraction of its host time. None otherwise."""
        if type(self.memory) is NoMemory and type(self.communicator) is AllreduceCommunicator:
            return self.compressor.cast_dtype
        return None

    def __repr__(self) -> str:
        return f"CompressionStep({self.compressor!r}, {self.memory!r}, {self.communicator.name!r})"

    def allreduce_bytes(self, exchanges: Sequence[Sequence[Sequence[int]]], dtype: torch.dtype) -> list[int]:
        """Bytes per rank of the one allreduce each exchange of :meth:`step_async` sends, given each exchange's item
        shapes (of ``dtype``): the items' payloads and their non-finite marks, which join the payload's collective.
        A runtime prices these ahead (:meth:`Runtime.anticipate <gradsync.comm.runtime.Runtime.anticipate>`), so that a
        fixed codec's first step need not wait for the plans of its sizes. Empty where the step sends no single
        allreduce (an allgather, two rounds)."""
        if self.two_rounds or not isinstance(self.communicator, AllreduceCommunicator):
            return []
        mark = (self.compressor.cast_dtype or dtype).itemsize  # one mark per item, in the payload's dtype
        out = [sum(self.compressor.payload_bytes(tuple(shape), dtype) for shape in shapes) + mark * len(shapes)
               for shapes in exchanges]
        return [n for n in out if n > 0]

    def step(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        """The aggregate of ``tensor`` over workers (blocks until it has travelled)."""
        return self.step_async([tensor], [info]).wait()[0]

    def step_async(self, tensors: Sequence[Tensor], infos: Sequence[TensorInfo], *, reuse: bool = False,
                   verdict: StepVerdict | None = None) -> Work:
        """Start the step for several tensors at once; the work's result is the list of aggregates.

        The local half (compensate, compress, memory update) runs here, on the caller's thread, as
        MergeComp compresses on the compute stream; the exchange and the decode run on the communication
        thread. Two-round compressors do all of it there, since their memory update needs round one's sum.

        ``reuse``: the caller gives ``tensors`` up (a merged group's own flat buffer, gradients about to be
        overwritten by their aggregates): an aggregate may be written into its input's buffer once nothing
        needs that any more -- the memory copied it into its own state and no payload tensor is it -- instead
        of into a new tensor.

        ``verdict``: the training step this exchange belongs to, when its owner keeps the step boundary itself
        (``compression="auto"``: several steps, one per codec, make one training step); default: this step's
        :attr:`boundary`.
        """
        if len(tensors) != len(infos):
            raise CompressionError(f"{len(tensors)} tensors but {len(infos)} TensorInfos: give one info per tensor")
        # first: a name sent again closes the last step before anything of this one settles or draws
        step = verdict if verdict is not None else self.boundary.verdict_for([i.name for i in infos])
        slot = step.reserve()
        if self.two_rounds:  # tensors sent as they are skip the memory (nothing to feed back)
            as_is = [self.compressor.sends_exactly(i) for i in infos]
            lossy = [j for j, e in enumerate(as_is) if not e]
            compensated = list(tensors)
            for j, x in zip(lossy, self.memory.compensate_all([tensors[j] for j in lossy], [infos[j] for j in lossy])):
                compensated[j] = x
        else:
            compensated = self.memory.compensate_all(tensors, infos)
        # an input is free once compressed where the memory copied it (it holds x, not t), or keeps nothing and the
        # payload is made here (two rounds make theirs from x on the communication thread)
        kept = not self.memory.stateless or self.two_rounds
        free = [t if reuse and (not kept or (x is not t and not shares_memory(t, [x]))) else None
                for t, x in zip(tensors, compensated)]
        if self.two_rounds:
            return self.communicator.submit(lambda: self._two_rounds(compensated, list(infos), as_is, free, step, slot))
        items: list[Item] = []
        outs: list[Tensor | None] = []
        checkpoints = [self.compressor.checkpoint(info.name) for info in infos]
        for t, x, info in zip(free, compensated, infos):
            payload, ctx = self.compressor.compress(x, info)
            self.memory.update(x, info, self.compressor, payload, ctx)
            items.append((payload, ctx))
            outs.append(None if t is None or shares_memory(t, [*payload, *ctx.extra]) else t)
        marks = self._marks([[*payload, x] for x, (payload, _) in zip(compensated, items)])

        def job() -> list[Tensor]:
            results = self.communicator.exchange(self.compressor, items, outs, marks)
            self._commit(infos, marks, checkpoints, step, slot)
            return results

        return self.communicator.submit(job)

    @staticmethod
    def _marks(groups: Sequence[Sequence[Tensor]]) -> Tensor | None:
        """This rank's non-finite mark per group of tensors, in the dtype of the group's first floating tensor (so
        that an allreduce sums it in a payload's own collective: groups list the payload first) on the tensors' device."""
        if not groups:
            return None
        first = next((t for t in groups[0] if t.is_floating_point()), groups[0][0])
        dtype = first.dtype if first.is_floating_point() else torch.float32
        return nonfinite_marks(groups, dtype, groups[0][0].device)

    def _commit(self, infos: Sequence[TensorInfo], marks: Tensor | None, checkpoints: Sequence[Checkpoint],
                step: StepVerdict, slot: int) -> None:
        """Give the exchange's verdicts to the training step, and every tensor's memory update and compressor state
        the step's verdict (decided at the tensor's next use, when every exchange of the step has run)."""
        if marks is None:
            return
        step.fill(slot, Verdicts(torch.isfinite(marks)))
        for info, checkpoint in zip(infos, checkpoints):
            self.memory.commit(info, step)
            self.compressor.commit(info.name, step, checkpoint)

    def _two_rounds(self, xs: list[Tensor], infos: list[TensorInfo], as_is: list[bool], outs: list[Tensor | None],
                    step: StepVerdict, slot: int) -> list[Tensor]:
        c = self.compressor
        assert isinstance(c, TwoRoundCompressor)  # guarded by self.two_rounds
        # Tensors sent as they are (PowerSGD's vectors; ``as_is``) join the second round's sum and are divided in
        # place, all at once: no memory, marks, state or decode per tensor, whose launches would dominate a GPU step.
        exact = [i for i, e in enumerate(as_is) if e]
        lossy = [i for i, e in enumerate(as_is) if not e]
        lx, linfos = [xs[i] for i in lossy], [infos[i] for i in lossy]
        dense = [_summable(xs[i]) for i in exact]
        checkpoints = [c.checkpoint(info.name) for info in linfos]
        batch = c.batch(lx, linfos)  # each round summed in one go (PowerSGD: one buffer, no copies in or out)
        self.communicator.reduce_sum(batch.first_round())
        second = batch.second_round()
        rounds = batch.rounds
        for x, info, (payload, ctx) in zip(lx, linfos, rounds):
            self.memory.update(x, info, c, payload, ctx)
        # one mark per lossy tensor, and one for all the tensors sent as they are: a NaN there has no state to
        # roll back of its own, but it is a tensor of the step, so the other tensors' updates are dropped too
        marks = self._marks([[*payload, x] for x, (payload, _) in zip(lx, rounds)] + ([dense] if dense else []))
        flat = second + dense
        self.communicator.reduce_sum(flat if marks is None else [*flat, marks])
        summed = _summed_marks(marks)
        results: list[Tensor] = list(xs)
        divide_by = self.communicator.world_size if c.average else 1
        if dense and divide_by != 1:
            torch._foreach_div_(dense, divide_by)  # one fused launch on a GPU
        for i, d in zip(exact, dense):
            results[i] = d if d.shape == infos[i].shape else d.view(infos[i].shape)
        # the average, in a new tensor or ``out`` (the compressor divides where it is cheapest); a non-finite mark
        # joins the divisor (world + mark: the same bits, or all NaN) in the pass finish makes anyway
        finished = batch.finish([outs[i] for i in lossy], divide_by=divide_by,
                                marks=None if summed is None else summed[: len(lossy)])
        for i, result in zip(lossy, finished):
            results[i] = result
        self._commit(linfos, marks, checkpoints, step, slot)
        return results


def _summable(x: Tensor) -> Tensor:
    """``x`` as a collective sums it in place: itself where contiguous (a view of it, no launch), else a copy."""
    if x.requires_grad:
        x = x.detach()
    return x if x.is_contiguous() else x.reshape(-1)


def write_aggregate(dest: Tensor, result: Tensor) -> None:
    """``dest.copy_(result)``, skipped where ``result`` already is ``dest`` (an aggregate the step decoded in
    place into the buffer it was given, ``step_async(..., reuse=True)``: the same elements, nothing to copy)."""
    if not _in_place(dest, result):
        dest.copy_(result)


def write_aggregates(dests: Sequence[Tensor], results: Sequence[Tensor]) -> None:
    """:func:`write_aggregate` of each pair, the copies in one multi-tensor call (one launch, not one per tensor)."""
    pairs = [(d, r) for d, r in zip(dests, results) if not _in_place(d, r)]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [r for _, r in pairs])


def _in_place(dest: Tensor, result: Tensor) -> bool:
    return result.data_ptr() == dest.data_ptr() and result.shape == dest.shape and result.stride() == dest.stride()


def native_cast_sum_async(runtime: Runtime, flat: Tensor, wire: torch.dtype, *, always: bool = False,
                          finish: Callable[[Tensor], Tensor] | None = None) -> torch.futures.Future | None:
    """``flat`` summed over ranks in ``wire`` (a cast codec's dtype: fp16, bf16) by the process group's own async
    allreduce and cast back into ``flat`` -- the fixed fp16 hook's path, and auto's for a cast -- where the runtime
    runs that size natively (``always``: whatever it plans for the size, for a caller that measured the ways to send
    the buffer); None where it plans it. The future's value is ``flat``, summed, not yet averaged; with ``finish``,
    ``finish(flat)`` (the average), run in the same callback as the cast back: a second chained callback costs a
    hook a future of its own (on CUDA, with its stream events). The runtime is asked before casting: a planned size
    costs no copy."""
    if not always and not runtime.runs_natively(flat.numel() * wire.itemsize):
        return None
    sent = cast(flat, wire)
    fut = runtime.native_allreduce_async(sent, always=always)
    if fut is None:
        return None

    def back(f: torch.futures.Future) -> Tensor:
        f.value()
        if sent is not flat:
            flat.copy_(sent)
        return flat if finish is None else finish(flat)

    return fut.then(back)


def average_in_place(tensor: Tensor, world: int) -> Tensor:
    """``tensor / world`` in place: a multiply by ``2**-k`` where ``world`` is ``2**k`` (the same correctly rounded
    number at about half a divide's cost), a divide otherwise."""
    if world & (world - 1) == 0:
        return tensor.mul_(1.0 / world)
    return tensor.div_(world)
