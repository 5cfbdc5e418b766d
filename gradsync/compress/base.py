"""The compression contract: Compressor, Memory and the one fixed step that joins them.

GRACE's split (STYLE.md): a :class:`Compressor` turns a tensor into a payload and back, a :class:`Memory`
does error feedback around it, and a communicator moves payloads. MergeComp's Algorithm 1 (§4.1)
is exactly that loop: compress, communicate (allreduce or allgather, Table 1), decompress, aggregate.
Communicators need the runtime and live elsewhere; :func:`simulate_step` is the pure-function reference of
the step they must reproduce, run for W simulated workers in one process.

Two rules keep a compressor honest:

* everything a receiver needs that depends on the sender's tensor travels in the **payload** (norms,
  scales, indices); the **ctx** holds only what every worker already knows (the :class:`TensorInfo`,
  indices drawn from a shared seed, PowerSGD's allreduced basis). So ``payload_bytes`` is the whole cost,
  and a receiver can decompress anyone's payload with its own ctx;
* ``decompress`` is pure, so a memory can call it again on the same payload; state that persists across
  steps (SigNUM's momentum, PowerSGD's Q, Rand-k's step) changes only in ``compress`` (or
  :meth:`TwoRoundCompressor.finish`), keyed by ``info.name``.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import threading
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from gradsync.errors import GradsyncError
from gradsync.registry import Registry

__all__ = [
    "COMMUNICATORS",
    "COMPRESSORS",
    "MEMORIES",
    "CompressionError",
    "Compressor",
    "Context",
    "Memory",
    "TensorInfo",
    "TwoRoundBatch",
    "TwoRoundCompressor",
    "StepBoundary",
    "StepVerdict",
    "Verdict",
    "Verdicts",
    "as_buffer",
    "create",
    "create_memory",
    "nonfinite_marks",
    "all_finite",
    "payload_nbytes",
    "register_compressor",
    "register_memory",
    "shares_memory",
    "simulate_step",
    "stable_seed",
]

#: How a compressor's payloads travel (MergeComp Table 1): summed in place, or gathered then aggregated.
COMMUNICATORS = ("allreduce", "allgather")


class CompressionError(GradsyncError):
    """Bad input to a compressor or memory: an unknown name, a parameter out of range, a mismatched tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """What a compressor knows about a tensor besides its values (hivemind's frozen ``CompressionInfo``).

    ``position`` is the index in backward order (0 = first gradient ready), so a scheduler that merges
    tensors (MergeComp) sees sizes and order without touching the values.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    position: int = 0

    def __post_init__(self) -> None:
        # Built per tensor per step by the hooks: the common case (a tuple of ints) skips the rebuild.
        shape = self.shape
        if type(shape) is not tuple or not all(type(s) is int for s in shape):
            shape = tuple(int(s) for s in shape)
            object.__setattr__(self, "shape", shape)
        if not isinstance(self.name, str) or not self.name:
            raise CompressionError(f"name={self.name!r} must be a non-empty string (keys per-tensor state)")
        if shape and min(shape) < 0:
            raise CompressionError(f"shape={self.shape} of {self.name!r} has a negative size")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise CompressionError(f"dtype={self.dtype!r} of {self.name!r} must be a floating torch.dtype")
        if isinstance(self.position, bool) or not isinstance(self.position, int) or self.position < 0:
            raise CompressionError(f"position={self.position!r} of {self.name!r} must be an integer >= 0")

    @classmethod
    def of(cls, name: str, tensor: Tensor, position: int = 0) -> TensorInfo:
        """The record for ``tensor``."""
        return cls(name, tuple(tensor.shape), tensor.dtype, position)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Uncompressed size: what ``none`` sends."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class Context:
    """What a receiver needs besides the payload; only data every worker already has (see module doc)."""

    info: TensorInfo
    extra: tuple[Tensor, ...] = field(default=())


def payload_nbytes(payload: Sequence[Tensor]) -> int:
    """Bytes a payload occupies on the wire: the sum of ``element_size * numel``."""
    return sum(t.element_size() * t.numel() for t in payload)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` that is the same in every process (``hash(str)`` is salted per process)."""
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Compressor(ABC):
    """Turns a tensor into a payload (``compress``) and a payload back into a tensor (``decompress``).

    Subclasses implement ``_compress`` on the flat tensor, ``_decompress`` returning any tensor with
    ``info.numel`` elements, and ``payload_bytes``; the public methods check shapes and restore the
    input's shape and dtype. Constructor parameters are stored under their own names (``__repr__`` and
    :func:`create` rely on it).

    Per-tensor state changes by *replacing* ``_state[name]`` (never by writing into the old value): a step with a
    tensor that was non-finite on some worker puts back the value :meth:`checkpoint` saw for every tensor of the
    step, and the seeded generators' positions from before the step's first tensor (see :meth:`commit`).
    """

    #: Registry name, set by :func:`register_compressor`.
    name: ClassVar[str] = ""
    #: ``"allreduce"`` when payloads are dense and summable, else ``"allgather"``.
    communicator: ClassVar[str] = "allgather"
    #: Whether the aggregate is divided by the number of workers (False for majority vote).
    average: ClassVar[bool] = True
    #: Set by compressors that are a plain elementwise cast (``compress`` = ``x.to(cast_dtype)``,
    #: ``decompress`` = cast back, no state): a hook may then cast a whole bucket at once and sum it natively.
    cast_dtype: ClassVar[torch.dtype | None] = None
    #: Whether every payload tensor's shape and dtype follow from the :class:`TensorInfo` alone, never from the
    #: values: every rank's payload for the same tensors then has the same size, and an allgather can skip the
    #: round that exchanges sizes. Leave False for data-dependent sizes (e.g. a threshold sparsifier).
    payload_shapes_fixed: ClassVar[bool] = False
    #: Whether a MergeComp group is compressed as one flat buffer (its tensors concatenated). False for
    #: compressors that need each tensor's own shape (PowerSGD's matrices): a merged group is then a batch --
    #: every tensor compressed alone, under its own name, and the group's payloads sent in one collective
    #: per round.
    merges_flat: ClassVar[bool] = True

    def __init__(self) -> None:
        #: Per-tensor state that persists across steps, keyed by ``info.name``.
        self._state: dict[str, Any] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        #: Scratch buffers (:meth:`_workspace`), never part of a payload or of the state.
        self._workspaces: dict[tuple[str, torch.dtype, torch.device, int], Tensor] = {}
        #: Per tensor name: the checkpoint of a committed step and its verdict, decided at the name's next use.
        self._pending: dict[str, tuple[Checkpoint, AnyVerdict]] = {}
        #: The generators' positions before the last committed step's first tensor, and that step's verdict:
        #: shared by every tensor of the step, so rewound once, before the next step draws anything.
        self._rewind: tuple[tuple[tuple[torch.device, Tensor], ...], AnyVerdict] | None = None

    # -- the contract ---------------------------------------------------------------------------------

    def compress(self, tensor: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]:
        """Payload tensors to send and the receiver-side context."""
        check_matches(tensor, info)
        if self._pending or self._rewind is not None:
            self._settle(info.name)
        if tensor.requires_grad:
            tensor = tensor.detach()
        return self._compress(tensor if len(info.shape) == 1 else tensor.reshape(-1), info)

    def decompress(self, payload: Sequence[Tensor], ctx: Context, out: Tensor | None = None) -> Tensor:
        """The tensor a payload stands for, in the input's shape and dtype. Pure: no state changes.

        ``out``: a contiguous buffer of ``info.numel`` elements of the input's dtype the result may be written into
        (its contents are overwritten; never a payload tensor), the destination the caller copies from anyway.
        Where the decoded tensor is in another dtype (a cast's payload, fp16 summed), the cast back goes into it, not
        into a new d-element tensor, whose page faults cost the first steps of a large group more than the cast
        (docs/mergecomp.md); elsewhere it is not used (a copy into it would be one pass more)."""
        flat = self._decompress(list(payload), ctx)
        info = ctx.info
        if (flat.dtype != info.dtype and (buf := as_buffer(out, info.numel, info.dtype)) is not None
                and buf.device == flat.device):
            buf.copy_(flat.reshape(-1))
            return buf.view(info.shape)
        if flat.shape != info.shape:
            flat = flat.reshape(info.shape)
        return cast(flat, info.dtype)

    def aggregate(self, tensors: Sequence[Tensor]) -> Tensor:
        """Combine decompressed tensors from all workers (allgather); the sum unless a method says otherwise."""
        return torch.stack(list(tensors)).sum(dim=0)

    def sparse(self, payload: Sequence[Tensor], ctx: Context) -> tuple[Tensor, Tensor] | None:
        """``(indices, values)`` when ``decompress(payload, ctx)`` is zero but for ``values`` at the distinct flat
        ``indices``, else None (a dense payload). Lets error feedback and aggregation run in O(k), not O(d)."""
        return None

    def combine(self, payloads: Sequence[Sequence[Tensor]], ctx: Context, out: Tensor | None = None) -> Tensor:
        """``aggregate([decompress(p, ctx) for p in payloads])`` (every worker's payload, as a receiver sees them),
        in a tensor the caller owns: ``out`` where the method can write there, else a new one.

        ``out``: a contiguous buffer of ``info.numel`` elements the result may be written into (its contents are
        overwritten; never a payload tensor) -- the destination the caller copies from anyway, already in
        memory, where a new d-element tensor per step would cost page faults. For the sum, each payload is
        decoded and added into one running buffer as it comes (the additions of ``stack(...).sum(0)`` in the
        same order, so the same bits; fp16/bf16 add in float32 and round once, as that reduction does) instead
        of W dense tensors stacked; a sparse payload is added at its indices into one zeroed buffer without
        being decoded at all. Methods with their own :meth:`aggregate` get it unchanged unless they override
        this too.
        """
        payloads = list(payloads)
        info = ctx.info
        if not payloads:
            raise CompressionError(f"combine of {info.name!r} needs at least one payload")
        if type(self).aggregate is not Compressor.aggregate:
            return self.aggregate([self.decompress(p, ctx) for p in payloads])
        acc = work_dtype(info.dtype)
        pairs = [self.sparse(p, ctx) for p in payloads]
        if all(pair is not None for pair in pairs):
            sums = as_buffer(out, info.numel, acc)
            if sums is None:
                sums = torch.zeros(info.numel, dtype=acc, device=pairs[0][1].device)  # type: ignore[index]
            else:
                sums.zero_()
            for indices, values in pairs:  # type: ignore[misc]
                sums.index_add_(0, indices, cast(cast(values, info.dtype), acc))
            return cast(sums, info.dtype).reshape(info.shape)
        out = self.decompress(payloads[0], ctx)
        if out.dtype != acc:
            out = cast(out, acc)
        elif shares_memory(out, payloads[0]):
            out = out.clone()
        for p in payloads[1:]:
            out.add_(self.decompress(p, ctx))
        return cast(out, info.dtype)

    def subtract_decoded(self, tensor: Tensor, payload: Sequence[Tensor], ctx: Context, *, inplace: bool = False) -> Tensor:
        """``tensor - decompress(payload, ctx)``: what error feedback keeps (the same bits).

        With ``inplace`` (the caller owns ``tensor`` and gives it up) the difference is written into ``tensor``
        -- unless a payload tensor shares its memory (``none`` sends the tensor itself): one pass and no new
        buffer, and O(k) for a sparse payload (only the sent elements change).
        """
        inplace = inplace and tensor.is_contiguous() and not shares_memory(tensor, payload)
        pair = self.sparse(payload, ctx)
        if pair is not None and tensor.is_contiguous():
            indices, values = pair
            out = tensor if inplace else tensor.clone()
            # x - v as x + (-1) v: negation is exact, so the same bits as the dense subtraction
            out.view(-1).index_add_(0, indices, cast(values, out.dtype), alpha=-1)
            return out
        decoded = self.decompress(payload, ctx)
        return tensor.sub_(decoded) if inplace and not shares_memory(tensor, [decoded]) else tensor - decoded

    @abstractmethod
    def payload_bytes(self, shape: int | Sequence[int], dtype: torch.dtype) -> int:
        """Bytes one worker sends for a tensor of this shape, without compressing (MergeComp prices merges)."""

    def sends_exactly(self, info: TensorInfo) -> bool:
        """Whether a two-round compressor sends this tensor as it is (PowerSGD's vectors): its aggregate is the
        plain sum, with no error to feed back, no state to roll back and nothing to decode, so a step sums it
        with the rest and divides it in place (a NaN or inf then reaches the aggregate by the sum itself)."""
        return False

    def estimate_ratio(self, info: TensorInfo) -> float:
        """Payload bytes over uncompressed bytes (1.0 for ``none``)."""
        raw = info.nbytes
        return self.payload_bytes(info.shape, info.dtype) / raw if raw else 1.0

    def reset(self) -> None:
        """Forget all per-tensor state (momentum, warm starts, step counters)."""
        self._state.clear()
        self._generators.clear()
        self._pending.clear()
        self._rewind = None

    # -- non-finite steps ---------------------------------------------------------------------------------

    def checkpoint(self, name: str) -> Checkpoint:
        """What a non-finite step of ``name`` rolls back to: its state (a reference: state is replaced, never
        written into) and the seeded generators' positions. Call before the step's first round."""
        self._settle(name)
        gens = tuple((device, g.get_state()) for device, g in self._generators.items()) if self._generators else ()
        return Checkpoint(self._state.get(name, _ABSENT), gens)

    def commit(self, name: str, verdict: AnyVerdict, checkpoint: Checkpoint) -> None:
        """End ``name``'s step: when ``verdict`` says it was non-finite on some worker, its state (SigNUM's momentum,
        PowerSGD's warm start, Rand-k's step) goes back to ``checkpoint`` -- read on the host at the name's next
        use, not now (no synchronisation with a GPU on the step's path). The generators go back to where they were
        before the step's first tensor (its first commit), once, before the next step's first draw."""
        self._pending[name] = (checkpoint, verdict)
        if self._rewind is None or self._rewind[1] is not verdict:
            if self._rewind is not None:
                self._settle_generators()  # an earlier step not decided yet (never: the next step settles it first)
            self._rewind = (checkpoint.generators, verdict)

    def _settle(self, name: str) -> None:
        if self._rewind is not None:
            self._settle_generators()
        entry = self._pending.pop(name, None)
        if entry is None or entry[1]:
            return
        if entry[0].state is _ABSENT:
            self._state.pop(name, None)
        else:
            self._state[name] = entry[0].state

    def _settle_generators(self) -> None:
        """Rewind the generators if the last committed step was non-finite, once its verdict is final (a step still
        open -- its later tensors not yet compressed -- is left for the next step's first use; one whose exchange
        failed, and raised to its caller, is never final and never rewinds)."""
        positions, verdict = self._rewind  # type: ignore[misc]
        if not verdict.decided:
            return
        self._rewind = None
        if verdict:
            return
        saved = dict(positions)
        for device in list(self._generators):
            if device in saved:
                self._generators[device].set_state(saved[device])
            else:  # made during the bad step: as if never made (it starts again from the seed)
                del self._generators[device]

    @abstractmethod
    def _compress(self, flat: Tensor, info: TensorInfo) -> tuple[list[Tensor], Context]: ...

    @abstractmethod
    def _decompress(self, payload: list[Tensor], ctx: Context) -> Tensor: ...

    # -- helpers for subclasses -----------------------------------------------------------------------

    def _generator(self, device: torch.device, seed: int | None) -> torch.Generator | None:
        """A seeded generator per device, or None (torch's global RNG) when ``seed`` is None."""
        if seed is None:
            return None
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self._generators[device] = gen
        return gen

    def _kernel_seed(self, seed: int | None) -> int:
        """One integer that seeds a fused kernel's own random stream (:mod:`~gradsync.compress.kernels`): drawn on
        the host from this compressor's seeded generator (or torch's global one), so no device round trip."""
        gen = self._generator(torch.device("cpu"), seed)
        return int(torch.randint(0, 2**31 - 1, (), generator=gen))  # host: a scalar argument of the kernel

    def _workspace(self, slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D scratch tensor of ``numel`` elements, reused from call to call (contents undefined).

        One buffer per ``slot`` and thread, grown to the largest size asked for: a fresh d-element temporary per
        call costs page faults on top of its pass. Per thread, because one step compresses the next group on
        the caller's thread while the communication thread decodes the last. Only for values that die inside
        one call (never a payload).
        """
        key = (slot, dtype, device, threading.get_ident())
        buf = self._workspaces.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._workspaces[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def __repr__(self) -> str:
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        args = ", ".join(f"{p}={getattr(self, p)!r}" for p in names if hasattr(self, p))
        return f"{type(self).__name__}({args})"


class TwoRoundCompressor(Compressor):
    """An allreduce compressor whose second round needs the sum of the first (PowerSGD, Vogels et al. 2019).

    A communicator runs, per tensor ``x`` (already compensated by the memory)::

        p = c.first_round(x, info)                  # None: this tensor goes in one round
        if p is not None: p = allreduce_sum(p)
        payload, ctx = c.second_round(x, info, p)   # ctx now holds the shared basis
        memory.update(x, info, c, payload, ctx)     # local error, before the payload is summed
        summed = [allreduce_sum(t) for t in payload]
        out = c.finish(summed, ctx, divide_by=world_size)  # also keeps the next step's warm start

    ``compress``/``decompress`` remain a valid one-round (allgather or single-worker) path.
    """

    communicator: ClassVar[str] = "allreduce"

    @abstractmethod
    def first_round(self, tensor: Tensor, info: TensorInfo) -> Tensor | None:
        """The first-round tensor to sum over workers, or None when the tensor is sent in one round."""

    @abstractmethod
    def second_round(self, tensor: Tensor, info: TensorInfo, first_sum: Tensor | None) -> tuple[list[Tensor], Context]:
        """The summable second-round payload and a ctx built from the first round's sum."""

    @abstractmethod
    def finish(self, payload_sum: Sequence[Tensor], ctx: Context, out: Tensor | None = None, *,
               divide_by: int | Tensor = 1) -> Tensor:
        """Decompress the summed payload divided by ``divide_by`` (the world size, for an average: a
        low-rank result divides its thin factor instead of the full tensor) and keep what the next step
        warm-starts from; ``out`` as in :meth:`Compressor.combine` (a buffer the result may be written
        into, or None). A result that is a payload tensor itself may only come back when ``divide_by == 1``.
        ``divide_by`` may be a 0-d tensor on the payload's device (the world size plus a non-finite mark): it is
        never compared on the host."""

    def batch(self, tensors: Sequence[Tensor], infos: Sequence[TensorInfo]) -> TwoRoundBatch:
        """The two rounds of several tensors that travel together (one exchange): each round's tensors summed in
        one go, the per-tensor launches fused where the compressor can (default: the per-tensor methods)."""
        return TwoRoundBatch(self, tensors, infos)


class TwoRoundBatch:
    """One exchange of a :class:`TwoRoundCompressor`: every tensor's two rounds, driven by a communicator::

        b = c.batch(xs, infos)
        allreduce_sum(b.first_round())             # the tensors to sum (the first-round tensors, or a buffer holding them)
        allreduce_sum(b.second_round())            # after memory.update(x, info, c, *b.rounds[i]) for each tensor
        outs = b.finish(outs, divide_by=world_size, marks=summed_marks)

    This default calls the per-tensor methods. A compressor's own batch may pack a round's tensors into one buffer
    (one collective, no copies in or out) and fuse per-tensor launches; it must give the same results.
    """

    def __init__(self, compressor: TwoRoundCompressor, tensors: Sequence[Tensor], infos: Sequence[TensorInfo]) -> None:
        self.compressor = compressor
        self.tensors = list(tensors)
        self.infos = list(infos)
        #: each tensor's first-round tensor (None: sent in one round), summed in place by the caller
        self.firsts: list[Tensor | None] = []
        #: each tensor's second-round ``(payload, ctx)`` (:meth:`second_round`), what the memory sees
        self.rounds: list[tuple[list[Tensor], Context]] = []

    def first_round(self) -> list[Tensor]:
        """The tensors to sum over workers in place; the sum then reaches :attr:`firsts`."""
        c = self.compressor
        self.firsts = [c.first_round(t, i) for t, i in zip(self.tensors, self.infos)]
        return [p for p in self.firsts if p is not None]

    def second_round(self) -> list[Tensor]:
        """Each tensor's ``(payload, ctx)`` from the summed first round, in :attr:`rounds`; returns the tensors to
        sum over workers in place (each payload, or a buffer holding them)."""
        c = self.compressor
        self.rounds = [c.second_round(t, i, p) for t, i, p in zip(self.tensors, self.infos, self.firsts)]
        return [t for payload, _ in self.rounds for t in payload]

    def finish(self, outs: Sequence[Tensor | None], *, divide_by: int, marks: Tensor | None = None) -> list[Tensor]:
        """Each tensor's summed payload decoded and divided by ``divide_by`` (:meth:`TwoRoundCompressor.finish`), in
        the tensor's shape and dtype: into its ``outs`` entry where it can. ``marks``: per tensor, the summed
        non-finite mark (0 or NaN, float32, on the device), added to its divisor: the same bits, or all NaN."""
        c = self.compressor
        divisors = None if marks is None else marks + divide_by
        results = []
        for j, ((payload, ctx), out) in enumerate(zip(self.rounds, outs)):
            result = c.finish(payload, ctx, None if out is None or shares_memory(out, payload) else out,
                              divide_by=divide_by if divisors is None else divisors[j])
            info = ctx.info
            if result.shape != info.shape or result.dtype != info.dtype:
                result = result.reshape(info.shape).to(info.dtype)
            results.append(result)
        return results


class Memory(ABC):
    """Error feedback around a compressor (GRACE's ``Memory``): add back what earlier steps did not send.

    A step is a transaction per tensor name: :meth:`compensate` reads the committed state and leaves it as it is,
    :meth:`update` proposes the next state, and :meth:`commit` attaches the step's verdict (a :class:`StepVerdict`
    shared by every tensor of a training step, or one tensor's :class:`Verdict`). The proposal replaces the state
    at the name's next use when the step was finite on every worker; otherwise it is dropped, the state stays what
    it was before the step (as if the step never happened, :class:`torch.amp.GradScaler`'s skipped step), and
    :attr:`nonfinite_steps` counts the step once. A proposal never committed (a caller that runs compensate and
    update alone) is kept. Subclasses keep state through :meth:`_committed` and :meth:`_propose`;
    one that writes ``_state`` directly is not rolled back (its non-finite steps are still counted).
    """

    name: ClassVar[str] = ""
    #: Whether the memory keeps nothing of the tensors it is given (no error feedback): a caller's buffer is then free
    #: once its payload is made, and a step may decode the aggregate into it (:class:`CompressionStep
    #: <gradsync.train.communicator.CompressionStep>`, ``reuse=True``).
    stateless: ClassVar[bool] = False

    def __init__(self) -> None:
        self._state: dict[str, Any] = {}
        #: name -> [proposed state, verdict or None until committed]
        self._pending: dict[str, list[Any]] = {}
        #: name -> a dropped state whose buffers the next :meth:`compensate` may write into
        self._spare: dict[str, Any] = {}
        self._nonfinite = 0
        #: the non-finite steps counted (a step's tensors settle one by one; it counts once)
        self._counted: weakref.WeakSet[Any] = weakref.WeakSet()
        self._warned = False

    @abstractmethod
    def compensate(self, tensor: Tensor, info: TensorInfo) -> Tensor:
        """The tensor to compress this step (the gradient plus whatever memory carries)."""

    def compensate_all(self, tensors: Sequence[Tensor], infos: Sequence[TensorInfo]) -> list[Tensor]:
        """:meth:`compensate` of several tensors (one exchange's); a memory may fuse their launches."""
        return [self.compensate(t, info) for t, info in zip(tensors, infos)]

    @abstractmethod
    def update(
        self, tensor: Tensor, info: TensorInfo, compressor: Compressor, payload: Sequence[Tensor], ctx: Context
    ) -> None:
        """Record what ``payload`` failed to carry of ``tensor`` (the compensated tensor)."""

    def owed(self, name: str) -> Tensor | None:
        """What ``name``'s committed state still owes the aggregate: gradient that earlier steps did not send, which
        whoever sends ``name`` another way must carry for none of it to be lost (None: nothing is owed)."""
        return None

    def release(self, name: str) -> None:
        """Propose forgetting ``name``'s state, its :meth:`owed` part sent another way this step. Decided by the
        step's verdict as an update is (:meth:`commit` it): a non-finite step keeps the state."""
        self._committed(name)  # decide the name's last step first: a proposal replaces any pending one
        self._propose(name, None)

    def commit(self, info: TensorInfo, verdict: AnyVerdict) -> None:
        """Attach the step's verdict to ``info.name``'s proposed update (decided at the name's next use)."""
        entry = self._pending.get(info.name)
        if entry is None or entry[1] is not None:
            self._pending[info.name] = [_ABSENT, verdict]
        else:
            entry[1] = verdict

    @property
    def nonfinite_steps(self) -> int:
        """Steps whose updates were dropped because a tensor of the step was non-finite (NaN or inf) on some worker.

        Reading it decides every committed step that is closed (on a GPU: waits for their flags, long computed by
        then); a step still open is counted once it is closed."""
        for name in [n for n, entry in self._pending.items() if entry[1] is not None and entry[1].decided]:
            self._settle(name)
        return self._nonfinite

    def reset(self) -> None:
        self._state.clear()
        self._pending.clear()
        self._spare.clear()
        self._counted = weakref.WeakSet()

    def _propose(self, name: str, value: Any) -> None:
        self._pending[name] = [value, None]

    def _committed(self, name: str) -> Any:
        """``name``'s state after deciding its last step (None before its first update)."""
        if self._pending:
            self._settle(name)
        return self._state.get(name)

    def _settle(self, name: str) -> None:
        entry = self._pending.pop(name, None)
        if entry is None:
            return
        value, verdict = entry
        if verdict is None or verdict:
            if value is not _ABSENT:
                old = self._state.get(name)
                self._state[name] = value
                if old is not None:
                    self._spare[name] = old
            return
        if verdict not in self._counted:
            self._counted.add(verdict)
            self._nonfinite += 1
        if value is not _ABSENT:
            self._spare[name] = value
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"gradsync: a gradient of the step that sent {name!r} was NaN or inf on some worker: its aggregate is "
                f"NaN (GradScaler skips such steps) and {type(self).__name__} kept every tensor's state from before "
                "the step; memory.nonfinite_steps counts these steps (warned once)", RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        args = ", ".join(f"{p}={getattr(self, p)!r}" for p in names if hasattr(self, p))
        return f"{type(self).__name__}({args})"


# -- non-finite gradients: marks that travel with the payload, verdicts read lazily on the host ---------------

#: "No value": a state absent before the step, or a memory commit with nothing proposed.
_ABSENT: Any = type("_Absent", (), {"__repr__": lambda self: "<absent>"})()


@dataclass(frozen=True)
class Checkpoint:
    """A compressor's state for one tensor name before a step, and its seeded generators' positions."""

    state: Any
    generators: tuple[tuple[torch.device, Tensor], ...] = ()


class Verdicts:
    """Whether each tensor of one exchange was finite on every worker.

    Decided on the device (``finite``: a bool per tensor) and read on the host only when the state it guards is
    next used: on a GPU the flags go to pinned memory with a non-blocking copy and an event, so reading them a
    step later waits for nothing (no ``.item()`` per tensor per step); on the CPU they are read at once.
    """

    def __init__(self, finite: Tensor) -> None:
        finite = finite.reshape(-1)
        self._event: Any = None
        self._values: list[bool] | None = None
        if finite.device.type == "cuda":
            self._flags = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)  # host: read a step later
            self._flags.copy_(finite, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        elif finite.device.type == "cpu":
            self._values = finite.tolist()
        else:
            self._flags = finite  # another device: read (one copy) when first needed

    def __len__(self) -> int:
        return len(self._values) if self._values is not None else self._flags.numel()

    def __getitem__(self, index: int) -> Verdict:
        return Verdict(self, index)

    def finite(self, index: int) -> bool:
        return self._read()[index]

    def all_finite(self) -> bool:
        """Whether every tensor of the exchange was finite on every worker."""
        return all(self._read())

    def _read(self) -> list[bool]:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._flags.tolist()
        return self._values


@dataclass(frozen=True)
class Verdict:
    """One tensor's entry of :class:`Verdicts`: true when it was finite on every worker."""

    verdicts: Verdicts
    index: int

    #: a tensor's verdict is final once its exchange ran (a :class:`StepVerdict` only once its step is closed)
    decided: ClassVar[bool] = True

    def __bool__(self) -> bool:
        return self.verdicts.finite(self.index)


class StepVerdict:
    """Whether every tensor of one training step was finite on every worker: the AND of its exchanges' verdicts.

    GradScaler skips a whole step when one gradient overflows, so every tensor of the step (every merged group,
    every DDP bucket) is committed with this one verdict, and one bad tensor rolls back all of them. An exchange
    reserves its slot where it is queued (the caller's thread, in order) and fills it where its marks are summed
    (the communication thread); the owner closes the step when no exchange can join it any more
    (:class:`StepBoundary`). Read at the tensors' next use: by then every exchange of the step has run.
    """

    def __init__(self) -> None:
        self._parts: list[Verdicts | None] = []
        self._closed = False
        self._value: bool | None = None

    def reserve(self) -> int:
        """A slot for one exchange of this step (before it is queued)."""
        if self._closed:
            raise CompressionError("an exchange joined a step that was already closed; open the next step first")
        self._parts.append(None)
        return len(self._parts) - 1

    def fill(self, slot: int, verdicts: Verdicts) -> None:
        """The exchange in ``slot`` ran: its tensors' verdicts."""
        self._parts[slot] = verdicts

    def close(self) -> None:
        self._closed = True

    @property
    def decided(self) -> bool:
        """Whether the verdict is final: no exchange can join the step any more and every one of them has run."""
        return self._closed and all(p is not None for p in self._parts)

    def __bool__(self) -> bool:
        if self._value is not None:
            return self._value
        # a slot never filled: its exchange failed and raised to its caller; it proves nothing either way
        parts = list(self._parts)
        value = all(p.all_finite() for p in parts if p is not None)
        if self._closed and all(p is not None for p in parts):
            self._value = value
        return value


#: A per-tensor verdict (:func:`simulate_step`: one tensor is one step) or a whole step's.
AnyVerdict = Verdict | StepVerdict


class StepBoundary:
    """Where one training step ends and the next begins, for every exchange one owner queues.

    :meth:`verdict_for` gives the open step's :class:`StepVerdict` and opens a new step when a tensor name comes
    again (a name is sent once per step); the owner calls :meth:`close` where it knows the step is over
    (``DistributedOptimizer.step()``, DDP's last bucket). :attr:`nonfinite_steps` counts the closed steps that had a
    non-finite tensor on some worker, each once however many tensors it had.
    """

    def __init__(self) -> None:
        self._open: StepVerdict | None = None
        self._names: set[str] = set()
        #: closed steps not counted yet (their flags may still be on their way from a GPU)
        self._closed: list[StepVerdict] = []
        self._bad = 0

    def verdict_for(self, names: Sequence[str]) -> StepVerdict:
        """The open step's verdict for an exchange of ``names`` (a new step when one of them was sent already)."""
        if self._open is not None and not self._names.isdisjoint(names):
            self.close()
        if self._open is None:
            self._open = StepVerdict()
        self._names.update(names)
        return self._open

    def close(self) -> None:
        """The open step is over: later exchanges belong to the next one."""
        if self._open is None:
            return
        self._open.close()
        # count what is surely decided by now (steps before the one just closed): the list stays short
        self._count(keep=1)
        self._closed.append(self._open)
        self._open, self._names = None, set()

    @property
    def nonfinite_steps(self) -> int:
        """Closed steps with a NaN or inf in some tensor on some worker (waits for their flags)."""
        self._count(keep=0)
        return self._bad

    def _count(self, keep: int) -> None:
        done, self._closed = self._closed[: len(self._closed) - keep], self._closed[len(self._closed) - keep:]
        self._bad += sum(not v for v in done)


def nonfinite_marks(groups: Sequence[Sequence[Tensor]], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Per group, 0 when every floating tensor in it is finite, NaN when one holds a NaN or an inf.

    The mark a step sends with each tensor's payload: summed over workers it stays 0 only where every worker's
    tensor was finite, and the aggregate divided by ``world + mark`` (multiplied by ``1 + mark``) is unchanged
    there and all NaN elsewhere -- whatever the codec does to a NaN (a sign bit or an unsent index would hide
    it). One fused max-norm over the tensors (a max-norm is NaN or inf exactly when an element is), on the device;
    on the CPU each tensor's minimum and maximum instead (one of them is NaN or inf exactly when an element is):
    torch's CPU max-norm is a scalar loop, ten times slower than a vectorised min/max pass.
    """
    tensors: list[Tensor] = []
    owner: list[int] = []
    for i, group in enumerate(groups):
        seen: set[tuple[int, int]] = set()
        for t in group:
            key = (t.data_ptr(), t.numel()) if t.device.type != "meta" else (id(t), 0)
            if t.is_floating_point() and t.numel() and key not in seen:
                seen.add(key)
                tensors.append(t)
                owner.append(i)
    marks = torch.zeros(len(groups), dtype=dtype, device=device)
    if tensors:
        if tensors[0].device.type == "cpu":
            ends = torch.stack([end for t in tensors for end in torch.aminmax(t)])
            index = _owner_index(tuple(o for o in owner for _ in range(2)), marks.device)
        else:
            ends = torch.stack(torch._foreach_norm(tensors, math.inf))
            index = _owner_index(tuple(owner), marks.device)
        # inf * 0 and NaN * 0 are NaN; times 0 before the cast, so a large finite float64 value stays finite
        marks.index_add_(0, index, ends.mul_(0).to(dtype))
    return marks


def all_finite(tensor: Tensor) -> Tensor:
    """Whether every element of ``tensor`` is finite, as a bool tensor of shape ``(1,)`` on its device (no host
    sync off the CPU): a max-norm off the CPU (two launches, not :func:`nonfinite_marks`' seven: on a GPU each is
    host time a bucket pays), :func:`nonfinite_marks`' min/max pass on the CPU.

    On the CPU one sum comes first, and where it is finite that is the answer: a NaN or an inf among its terms
    makes a sum NaN or inf. Only a sum that is not (a non-finite element, or finite ones so large that the sum
    overflows) takes the exact pass. One vectorised op instead of eight: this runs on the backend's thread after
    every native "none" allreduce, on the step's critical path (docs/mergecomp.md, "compression='auto'")."""
    if tensor.device.type == "cpu" and tensor.is_floating_point():
        narrow = tensor.element_size() < 4  # float16/bfloat16 in float32: no finite float16 sum can overflow it
        total = tensor.sum(dtype=torch.float32) if narrow else tensor.sum()
        if bool(total.isfinite()):
            return torch.ones(1, dtype=torch.bool, device=tensor.device)
    elif tensor.is_floating_point() and tensor.numel():  # a max-norm is finite exactly when every element is
        return torch.linalg.vector_norm(tensor, math.inf).isfinite().reshape(1)
    return nonfinite_marks([[tensor]], torch.float32, tensor.device).isfinite()


_OWNERS: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _owner_index(owner: tuple[int, ...], device: torch.device) -> Tensor:
    """``owner`` as an index tensor on ``device``, kept per layout: a host-to-device copy per step would wait."""
    key = (owner, device)
    index = _OWNERS.get(key)
    if index is None:
        if len(_OWNERS) > 256:
            _OWNERS.clear()
        index = _OWNERS[key] = torch.tensor(owner, dtype=torch.int64, device=device)
    return index


COMPRESSORS: Registry[type[Compressor]] = Registry("compressor", CompressionError)
MEMORIES: Registry[type[Memory]] = Registry("memory", CompressionError)
C = TypeVar("C", bound=Compressor)
M = TypeVar("M", bound=Memory)


def register_compressor(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[type[C]], type[C]]:
    """Class decorator: register a compressor under ``name`` and set its ``name`` attribute."""

    def deco(cls: type[C]) -> type[C]:
        if cls.communicator not in COMMUNICATORS:
            raise TypeError(f"{cls.__name__}.communicator={cls.communicator!r} must be one of {COMMUNICATORS}")
        cls.name = name
        COMPRESSORS.add(name, cls, aliases=aliases)
        return cls

    return deco


def register_memory(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[type[M]], type[M]]:
    """Class decorator: register a memory under ``name`` and set its ``name`` attribute."""

    def deco(cls: type[M]) -> type[M]:
        cls.name = name
        MEMORIES.add(name, cls, aliases=aliases)
        return cls

    return deco


def create(name: str, **params: Any) -> Compressor:
    """A compressor by registry name; unknown names and parameters fail with the known ones."""
    return _instantiate(COMPRESSORS, "compressor", name, params)


def create_memory(name: str, **params: Any) -> Memory:
    """A memory (``none``, ``residual``, ``dgc``) by registry name."""
    return _instantiate(MEMORIES, "memory", name, params)


def _instantiate(registry: Registry[Any], what: str, name: str, params: dict[str, Any]) -> Any:
    cls = registry.get(name)
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) if accepted else "no parameters"
        raise CompressionError(
            f"{what} {registry.canonical(name)!r} has no parameter {unknown[0]!r}; it takes: {takes}"
        )
    return cls(**params)


def simulate_step(
    compressors: Sequence[Compressor],
    memories: Sequence[Memory],
    grads_per_worker: Sequence[Tensor],
    info: TensorInfo,
) -> Tensor:
    """One synchronisation step for W simulated workers; returns the tensor every worker applies.

    Worker ``w`` owns ``compressors[w]`` and ``memories[w]`` (as one process would), so per-tensor state
    never leaks between workers. The step is MergeComp's Algorithm 1 with GRACE's error feedback:
    compensate -> compress -> memory update -> communicate -> decompress/aggregate. Allreduce sums the
    payloads and decompresses the sum; allgather decompresses each payload with the receiver's own ctx
    and aggregates; a :class:`TwoRoundCompressor` runs its two allreduce rounds. The result is averaged
    over W unless the compressor says not to (majority vote).

    Non-finite gradients (docs/mergecomp.md): when any worker's compensated tensor or payload holds a NaN or an
    inf, the result is all NaN, and every worker's memory and compressor state for ``info.name`` stays as it was
    before this step (counted in ``memory.nonfinite_steps``).
    """
    world = len(grads_per_worker)
    if world < 1 or len(compressors) != world or len(memories) != world:
        raise CompressionError(
            f"simulate_step needs one compressor and one memory per worker: got {len(compressors)} compressors, "
            f"{len(memories)} memories, {world} gradients"
        )
    kinds = {type(c) for c in compressors}
    if len(kinds) != 1:
        raise CompressionError(f"all workers must run the same compressor, got {sorted(k.__name__ for k in kinds)}")
    compressor = compressors[0]
    compensated = [m.compensate(g, info) for m, g in zip(memories, grads_per_worker)]
    checkpoints = [c.checkpoint(info.name) for c in compressors]

    two_round = [c for c in compressors if isinstance(c, TwoRoundCompressor)]
    if two_round:
        firsts = [c.first_round(x, info) for c, x in zip(two_round, compensated)]
        first_sum = None if firsts[0] is None else _sum([p for p in firsts if p is not None])
        rounds = [c.second_round(x, info, first_sum) for c, x in zip(two_round, compensated)]
    else:
        rounds = [c.compress(x, info) for c, x in zip(compressors, compensated)]
    # GRACE's order: memory sees the local payload before communication, so an in-place collective on
    # the payload cannot corrupt the residual.
    for memory, c, x, (payload, ctx) in zip(memories, compressors, compensated, rounds):
        memory.update(x, info, c, payload, ctx)
    # each worker's non-finite mark travels with its payload; their sum is NaN where any worker's was
    mark = _sum([nonfinite_marks([[x, *payload]], torch.float32, x.device) for x, (payload, _) in zip(compensated, rounds)])

    if two_round:
        summed = [_sum([payload[i] for payload, _ in rounds]) for i in range(len(rounds[0][0]))]
        # Every worker finishes (each keeps its own copy of the shared warm start); the results are identical.
        result = [c.finish(summed, ctx) for c, (_, ctx) in zip(two_round, rounds)][0]
    elif compressor.communicator == "allreduce":
        # Summable payloads and a ctx all workers share: decompress the sum once.
        summed = [_sum([payload[i] for payload, _ in rounds]) for i in range(len(rounds[0][0]))]
        result = compressor.decompress(summed, rounds[0][1])
    else:
        # Each receiver decompresses every gathered payload with its own ctx; worker 0 stands for all.
        result = compressor.combine([payload for payload, _ in rounds], rounds[0][1])
    # the same bits as ``/ world`` (or nothing) where every worker was finite, all NaN where one was not
    result = result / (mark[0] + world) if compressor.average else result * (mark[0] + 1)
    verdict = Verdicts(torch.isfinite(mark))[0]
    for memory, c, checkpoint in zip(memories, compressors, checkpoints):
        memory.commit(info, verdict)
        c.commit(info.name, verdict, checkpoint)
    return result.reshape(info.shape).to(info.dtype)


def _sum(tensors: Sequence[Tensor]) -> Tensor:
    return torch.stack(list(tensors)).sum(dim=0)


def as_buffer(out: Tensor | None, numel: int, dtype: torch.dtype) -> Tensor | None:
    """``out`` as a flat buffer when it can take ``numel`` elements of ``dtype`` in place, else None."""
    if out is None or out.dtype != dtype or out.numel() != numel or not out.is_contiguous():
        return None
    return out.view(-1)


def shares_memory(tensor: Tensor, others: Sequence[Tensor]) -> bool:
    """Whether ``tensor`` and any of ``others`` are views of one storage (writing one would change the other)."""
    ptr = tensor.untyped_storage().data_ptr()
    return any(isinstance(o, Tensor) and o.untyped_storage().data_ptr() == ptr for o in others)


def check_matches(tensor: Tensor, info: TensorInfo) -> None:
    if tensor.shape != info.shape or tensor.dtype != info.dtype:  # torch.Size compares with a tuple
        raise CompressionError(
            f"tensor {info.name!r} is {tuple(tensor.shape)} {tensor.dtype}, but its TensorInfo says "
            f"{info.shape} {info.dtype}"
        )


# -- parameter checks shared by the compressor families (messages name the value and the allowed range) --


def check_ratio(what: str, value: float) -> float:
    """A fraction in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise CompressionError(f"{what}={value!r} must be in (0, 1] (fraction of elements sent)")
    return float(value)


def check_int(what: str, value: int, low: int, meaning: str) -> int:
    """An integer >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CompressionError(f"{what}={value!r} must be an integer >= {low} ({meaning})")
    return value


def check_unit_interval(what: str, value: float, meaning: str) -> float:
    """A float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise CompressionError(f"{what}={value!r} must be in [0, 1) ({meaning})")
    return float(value)


def check_seed(value: int | None, *, optional: bool) -> int | None:
    """A non-negative integer seed (or None where the global RNG is acceptable)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        allowed = "an integer >= 0 or None" if optional else "an integer >= 0 (shared by all workers)"
        raise CompressionError(f"seed={value!r} must be {allowed}")
    return value


#: ``Tensor.half()`` and friends dispatch faster than ``Tensor.to(dtype)`` (a fixed cost paid on every cast).
_CASTS: dict[torch.dtype, Callable[[Tensor], Tensor]] = {
    torch.float32: Tensor.float, torch.float16: Tensor.half, torch.bfloat16: Tensor.bfloat16, torch.float64: Tensor.double,
}


def cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor.to(dtype)``: the tensor itself when it has that dtype, else a converted copy."""
    if tensor.dtype == dtype:
        return tensor
    to = _CASTS.get(dtype)
    return to(tensor) if to is not None else tensor.to(dtype)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in: float64 stays, everything narrower is lifted to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices while they fit (half the bytes of int64), int64 beyond 2**31 - 1 elements."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def numel_of(shape: int | Sequence[int]) -> int:
    """``payload_bytes`` takes a shape or a bare element count (a merged, flat buffer)."""
    if isinstance(shape, int):
        return shape
    return math.prod(int(s) for s in shape)


def k_of(numel: int, ratio: float) -> int:
    """Elements a sparsifier keeps: ``round(ratio * numel)``, at least 1 (round, so 0.07 * 100 is 7)."""
    return min(numel, max(1, round(ratio * numel)))
