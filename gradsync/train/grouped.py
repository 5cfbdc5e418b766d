"""MergeComp's Algorithm 1 on a live backward pass: gradients merged into y groups, each sent when complete.

Gradients are indexed in backward order (0 = first ready) and cut into contiguous groups by a
:class:`~gradsync.compress.merge.Partition`. :class:`MergedGroups` collects gradients as backward produces
them; the moment a group's last gradient arrives it is flattened into one buffer, compressed once (on the
caller's thread, as MergeComp compresses on the compute stream) and queued for exchange on the runtime's
communication thread, so it travels while backward goes on. :meth:`MergedGroups.wait` then writes each
group's aggregate back into every parameter's ``.grad``.

Choosing the partition (:func:`~gradsync.compress.merge.resolve_merge`): ``"layerwise"`` (``y = N``, every tensor alone, with its
own shape -- PowerSGD needs the matrix), an int ``y`` (:func:`~gradsync.compress.merge.equal_partition`: ``y`` contiguous groups of
about equal element counts), a :class:`Partition`, or ``"auto"``: :func:`profile_cost_model` measures the
codec (``h``, ``d``) and the exchange (``g``) on this machine for the model's actual sizes, averages the
measurements over ranks (so every rank plans the same partition) and :func:`search_optimal` picks the
exact optimum of MergeComp's objective (7). Naming and searching a partition is pure and lives in
:mod:`gradsync.compress.merge`; this module runs it on a live backward pass and a runtime.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gradsync.comm.runtime import Runtime, Work
from gradsync.compress.base import TensorInfo
from gradsync.compress.memory import NoMemory
from gradsync.compress.merge import MergeCostModel, MergeError, Partition, fit_group_overhead, probe_sizes
from gradsync.compress.profile import MeasuredCost, Samples, measure_codec, measure_comm
from gradsync.train.communicator import CompressionStep

__all__ = [
    "DDP_BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "MergedGroups",
    "busy_seconds",
    "ddp_bucket_bytes",
    "ddp_partition",
    "ends_on_host",
    "profile_cost_model",
]


def _average_over_ranks(runtime: Runtime, values: Sequence[float]) -> list[float]:
    buf = torch.tensor(list(values), dtype=torch.float64)  # host: timings; the collective stages them
    runtime.allreduce(buf, "avg")
    return buf.tolist()


def profile_cost_model(
    step: CompressionStep,
    sizes: Sequence[int],
    ready_s: Sequence[float],
    backward_end_s: float,
    *,
    forward_s: float = 0.0,
    repeats: int = 3,
    points: int = 8,
    dtype: torch.dtype = torch.float32,
    observed: tuple[Partition, float] | None = None,
    device: torch.device | str = "cpu",
) -> MergeCostModel:
    """A :class:`MergeCostModel` for ``step`` measured on this machine, identical on every rank.

    What is timed matches what :class:`MergedGroups` does: ``h`` = encode, plus error feedback's in-place
    subtraction of the local payload when there is a memory, inline on the compute thread; ``g`` = the
    exchange of a group's payload bytes (allreduce of the payload, or the allgather of the packed buffer);
    ``d`` = the decode after it (every worker's payload combined into one buffer for allgather, the summed
    payload's decode for allreduce). Each is measured at
    :func:`probe_sizes` and interpolated (:class:`~gradsync.compress.profile.MeasuredCost`: caches make
    ``h`` non-linear). This is a collective: every rank must call it with the same sizes. The timeline
    (``ready_s``, ``backward_end_s``) and all measurements are averaged over ranks before planning.

    ``device``: where the gradients live; the codecs and the exchanges are timed with tensors there.

    ``observed``: a partition and the seconds one real step with it took on this rank (same origin as
    ``ready_s``), e.g. the layer-wise calibration step. The per-group overhead that the operation-by-operation
    measurements miss is then fitted to it (:func:`~gradsync.compress.merge.fit_group_overhead`, on the
    rank-averaged time): without it the model prices groups too cheaply, so its exact search picks too many
    groups, slower than the best measured partition (measured: docs/benchmarks.md, ``gradsync bench
    mergecomp``).
    """
    rt = step.communicator.runtime
    world = rt.world_size
    probes = probe_sizes(sizes, points)
    enc = measure_codec(step.compressor, probes, repeats=repeats, dtype=dtype, part="encode", device=device)
    if isinstance(step.memory, NoMemory):
        feedback = Samples(probes, tuple(0.0 for _ in probes))
    else:
        feedback = measure_codec(step.compressor, probes, repeats=repeats, dtype=dtype, part="feedback", device=device)
    gathers = step.communicator.name == "allgather"
    dec = measure_codec(step.compressor, probes, repeats=repeats, dtype=dtype, device=device,
                        part="combine" if gathers else "decode",
                        world=world)

    def send(nbytes: int) -> float:
        def job() -> float:
            t0 = time.perf_counter()
            if step.communicator.sums:
                rt.run_allreduce(torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device), "sum")
            else:
                rt.run_allgather(torch.zeros(nbytes + 64, dtype=torch.uint8, device=device),  # + the payload header
                                 equal_sizes=step.compressor.payload_shapes_fixed)
            return time.perf_counter() - t0

        return float(rt.submit(job, "profile").wait())

    comm = measure_comm(send, probes, compressor=step.compressor, dtype=dtype, repeats=repeats)
    k = len(probes)
    seen = float(observed[1]) if observed is not None else 0.0
    local = [*enc.seconds, *feedback.seconds, *dec.seconds, *comm.seconds, *ready_s, backward_end_s, forward_s, seen]
    avg = _average_over_ranks(rt, local)
    e, f, d, g = avg[:k], avg[k : 2 * k], avg[2 * k : 3 * k], avg[3 * k : 4 * k]
    ready = avg[4 * k : 4 * k + len(ready_s)]
    end, fwd, seen = avg[-3], avg[-2], avg[-1]
    ready = list(np.maximum.accumulate(np.maximum(ready, 0.0)))
    h = MeasuredCost.from_samples(Samples(probes, tuple(a + b for a, b in zip(e, f))))
    after = MeasuredCost.from_samples(Samples(probes, tuple(d)))
    send_cost = MeasuredCost.from_samples(Samples(probes, tuple(g)))
    model = MergeCostModel(
        sizes=tuple(int(s) for s in sizes),
        ready_s=tuple(ready),
        backward_end_s=max(end, ready[-1]),
        h=h,
        g=send_cost,
        d=after,
        forward_s=max(fwd, 0.0),
    )
    if observed is not None:
        model, _ = fit_group_overhead(model, observed[0], max(seen, 0.0))
    return model


#: The first group's default size limit (``torch.distributed``'s ``_DEFAULT_FIRST_BUCKET_BYTES``, DDP's).
FIRST_BUCKET_BYTES = 1 << 20
#: DDP's default bucket size limit (``bucket_cap_mb=25``): ``compression="auto"``'s calibration steps bucket so.
DDP_BUCKET_BYTES = 25 << 20


def ddp_partition(nbytes: Sequence[int]) -> Partition:
    """DDP's default buckets over tensors of ``nbytes`` (backward order): the first closes at ``FIRST_BUCKET_BYTES``,
    the others at ``DDP_BUCKET_BYTES``, as ``_on_grad`` groups.

    ``compression="auto"``'s calibration steps send them: those steps time backward's ready times and fit each
    group's own cost, and sent as DDP's buckets they cost about what DDP's steps do. Layer-wise, LeNet-5's ten
    tensors made them several times a settled step (docs/mergecomp.md). Its DDP hook has their payloads priced ahead
    first: they are the buckets of DDP's first backward."""
    counts, count, size = [], 0, 0
    for b in nbytes:
        count, size = count + 1, size + b
        if size >= (DDP_BUCKET_BYTES if counts else FIRST_BUCKET_BYTES):
            counts.append(count)
            count, size = 0, 0
    if count:
        counts.append(count)
    return Partition.from_counts(counts)


def ends_on_host(buf: Tensor) -> bool:
    """Whether the future of ``buf``'s collective ends when the collective does, so that its host time is the
    collective's: on host tensors (gloo) yes; on a GPU an NCCL future completes once the work is queued on its
    stream, and its span would read as almost no time (the wire model then scaled to its lower bound)."""
    return buf.device.type == "cpu"


def _close_span(span: list[float | None]) -> None:
    """End a timeline entry (:attr:`MergedGroups.timeline`) now, unless it has ended."""
    if span[1] is None:
        span[1] = time.perf_counter()


def busy_seconds(spans: Sequence[Sequence[float | None]]) -> float | None:
    """How long at least one of ``spans`` (``[start, end]`` seconds, :attr:`MergedGroups.timeline`) was in flight:
    their union's length, so that collectives a backend runs side by side count once. None where a span has no end
    (a collective not done: a step that waited for its groups leaves none)."""
    if any(start is None or end is None for start, end in spans):
        return None
    total, reach = 0.0, -math.inf
    for start, end in sorted((float(start), float(end)) for start, end in spans):  # type: ignore[arg-type]
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def ddp_bucket_bytes(params: Sequence[Tensor]) -> list[int]:
    """The bytes of each bucket of DDP's first backward over ``params`` (the trainable ones, in registration order),
    in the order it sends them: :func:`ddp_partition` of their sizes in reverse, DDP's default limits. What a DDP
    hook's runtime prices ahead where it is given the model; a bucket of empty parameters only sends nothing, and is
    left out (a size of 0 is no size to price)."""
    nbytes = [p.numel() * p.element_size() for p in reversed(params)]
    return [int(n) for n in ddp_partition(nbytes).group_sizes(nbytes) if n > 0] if nbytes else []


#: A lean group at least this large is scaled member by member as it is copied into its buffer (one pass); a smaller
#: one is copied whole and then scaled (two passes over a buffer that stays in cache, and one call instead of one a
#: member: for LeNet-5's ten small tensors the calls cost more than the pass).
FUSED_SCALE_BYTES = 1 << 20


@dataclass(frozen=True)
class _Group:
    index: int
    members: tuple[int, ...]  # tensor indices in backward order
    info: TensorInfo
    #: The members' own records when the compressor keeps shapes (``merges_flat`` False, PowerSGD): the group
    #: is a batch, each member compressed alone and the payloads sent together; empty for a flat group.
    parts: tuple[TensorInfo, ...] = ()


class MergedGroups:
    """Algorithm 1 for one model: collect gradients in backward order, compress and send each group when complete.

    ``names``/``shapes``: the tensors in backward order (index 0 is the first gradient backward produces);
    ``partition`` cuts them. A group of one tensor keeps that tensor's shape and name (so layer-wise
    compression is exactly per-tensor compression, and PowerSGD sees matrices); a larger group is one flat
    buffer named after its first and last tensor -- unless the compressor keeps shapes (``merges_flat``
False, PowerSGD), when a group is a batch of its tensors under their own names, compressed one by one and
exchanged together (one collective per round instead of one per tensor). All tensors must share one
floating dtype. ``plain`` (with ``compression="auto"`` and ``reuse_inputs``): every group is averaged uncompressed,
outside auto's choosing (the optimizer's calibration steps).
    """

    def __init__(
        self,
        step: CompressionStep,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        dtype: torch.dtype,
        partition: Partition,
        *,
        reuse_inputs: bool = False,
        plain: bool = False,
    ) -> None:
        if len(names) != len(shapes) or partition.n != len(names):
            raise MergeError(
                f"{len(names)} names, {len(shapes)} shapes and a partition of {partition.n} tensors: give one of each per tensor"
            )
        if plain and not reuse_inputs:
            raise MergeError("plain=True averages each group's gradients in place: pass reuse_inputs=True with it")
        self.step = step
        #: Whether the gradients given to :meth:`add` may be overwritten by their aggregates (the optimizer's
        #: ``.grad``, which step() overwrites anyway): each aggregate is then decoded straight into its gradient.
        self.reuse_inputs = reuse_inputs
        self.names = list(names)
        self.shapes = [tuple(int(s) for s in shape) for shape in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.dtype = dtype
        self.partition = partition
        self.groups: list[_Group] = []
        self.group_of: list[int] = [0] * len(names)
        compressor = getattr(step, "compressor", None)
        #: auto (``averages_flat``) picks a codec per group, PowerSGD among them: its groups keep their shapes too
        self._auto = bool(getattr(step, "averages_flat", False))
        #: auto's groups sent uncompressed, outside its choosing (:meth:`AutoCompression.plain_launch`): the
        #: optimizer's calibration steps, whose partition is not the job's
        self.plain = plain and self._auto
        #: the dtype plain groups are summed in (a cast, :meth:`AutoCompression.calibration_wire
        #: <gradsync.train.auto_compression.AutoCompression.calibration_wire>`); None: as they are
        self.plain_wire: torch.dtype | None = None
        #: where a list, each plain group's collective appends ``[launched, done]`` to it (``time.perf_counter``
        #: seconds, ``done`` None until it is): the optimizer's timed calibration step, whose collectives' time in
        #: flight (:func:`busy_seconds`) scales auto's wire model before its partition search; host buffers only
        #: (:func:`ends_on_host`)
        self.timeline: list[list[float | None]] | None = None
        batched = (compressor is not None and not compressor.merges_flat) or self._auto
        for j, (a, b) in enumerate(partition.bounds):
            members = tuple(range(a, b))
            for i in members:
                self.group_of[i] = j
            parts: tuple[TensorInfo, ...] = ()
            if len(members) == 1:
                info = TensorInfo(self.names[a], self.shapes[a], dtype, j)
            else:
                total = sum(self.numels[a:b])
                info = TensorInfo(f"merged[{a}:{b}]:{self.names[a]}..{self.names[b - 1]}", (total,), dtype, j)
                if batched:
                    parts = tuple(TensorInfo(self.names[i], self.shapes[i], dtype, i) for i in members)
            self.groups.append(_Group(j, members, info, parts))
        self._pending: dict[int, dict[int, Tensor]] = {}
        self._works: list[tuple[_Group, Work]] = []
        self._sent: set[int] = set()
        #: Each merged group's flat buffer, reused every step (a fresh 13 MB tensor per step costs page faults
        #: on top of the copy): the gradients are concatenated into it, and the aggregate may come back in it.
        self._flat: dict[int, Tensor] = {}
        self._flat_views: dict[int, list[Tensor]] = {}  # each buffer's members in their shapes (:meth:`_views`)
        self._spans: dict[int, list[float | None]] = {}  # this step's open timeline entries, by group
        #: where the gradients live (the last one added): missing ones are zeros there, merged buffers too
        self._device = torch.device("cpu")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def exchange_shapes(self) -> list[list[tuple[int, ...]]]:
        """Each group's item shapes as a fixed step exchanges them, in launch order: its members' own (a batch) or
        its flat buffer's (:meth:`CompressionStep.allreduce_bytes
        <gradsync.train.communicator.CompressionStep.allreduce_bytes>` prices them)."""
        return [[p.shape for p in g.parts] if g.parts else [g.info.shape] for g in self.groups]

    @property
    def started(self) -> bool:
        """Whether this step has gradients added or groups sent (:meth:`wait` ends the step)."""
        return bool(self._works or self._pending)

    def add(self, index: int, grad: Tensor) -> None:
        """Gradient of tensor ``index`` (backward order) is final; send its group if this was the last one."""
        if grad.dtype != self.dtype:
            raise MergeError(
                f"gradient {index} ({self.names[index]!r}) is {grad.dtype} but the groups merge {self.dtype}; "
                "keep every compressed parameter in one dtype"
            )
        j = self.group_of[index]
        if j in self._sent:
            raise MergeError(
                f"gradient {index} ({self.names[index]!r}) arrived twice in one step, or after its group was sent; "
                "call wait() (optimizer.step()) once per backward"
            )
        got = self._pending.setdefault(j, {})
        got[index] = grad
        self._device = grad.device
        if len(got) == len(self.groups[j].members):
            self._launch(self.groups[j])

    def flush(self) -> None:
        """Send every group not sent yet, missing gradients as zeros (e.g. parameters unused this step)."""
        for g in self.groups:
            if g.index not in self._sent:
                self._launch(g)

    def _launch(self, g: _Group) -> None:
        got = self._pending.pop(g.index, {})
        parts = [
            got[i] if i in got else torch.zeros(self.shapes[i], dtype=self.dtype, device=self._device) for i in g.members
        ]
        self._sent.add(g.index)
        if g.parts and not self._auto:  # a batch: every member under its own name and shape, one exchange
            work = self.step.step_async([p.detach() for p in parts], list(g.parts), reuse=self.reuse_inputs)
            self._works.append((g, work))
            return
        # a merged group's buf is ours: the aggregate may come back in it
        reuse = len(parts) > 1 or self.reuse_inputs
        if self._auto and self.reuse_inputs and len(parts) > 1 and not self.step.needs_flat(g.info.name):
            # settled on a codec that encodes each member as it is: the gradients themselves go, and their aggregates
            # come back in them (no copy into the group's buffer, none back into .grad)
            self._works.append((g, self.step.step_async([p.detach() for p in parts], list(g.parts), reuse=True,
                                                        key=g.info.name)))
            return
        # a lean "none" group (and a plain one) is averaged as DDP averages its bucket: scaled while copied in, not in
        # a pass after the sum
        scale = None
        if self.plain:
            scale = self.step.plain_scale(self._device)
        elif self._auto and reuse:
            scale = self.step.lean_scale(g.info.name, self._device)
        buf = self._buffer(g, parts, scale)
        if self.plain:
            tensors, infos = self._members(buf, g)
            launched = time.perf_counter()
            work = self.step.plain_launch(buf, g.info, scaled=scale is not None, tensors=tensors, infos=infos,
                                          wire=self.plain_wire)
            if self.timeline is not None and ends_on_host(buf):
                span: list[float | None] = [launched, None]
                self.timeline.append(span)
                self._spans[g.index] = span
                work.future.add_done_callback(lambda _, span=span: _close_span(span))
            self._works.append((g, work))
            return
        if self._auto and reuse:
            # a settled stateless choice: a plain allreduce
            settled = self.step.settled_work(buf, g.info.name, scaled=scale is not None)
            if settled is not None:
                self._works.append((g, settled))
                return
            # auto: its "none" is the backend's allreduce of buf, any codec sees the members' shapes (views of buf)
            tensors, infos = self._members(buf, g)
            work = self.step.step_async(tensors, infos, reuse=True, flat=buf, key=g.info.name)
        else:
            work = self.step.step_async([buf], [g.info], reuse=reuse)
        self._works.append((g, work))

    def _buffer(self, g: _Group, parts: list[Tensor], scale: float | None) -> Tensor:
        """The group's gradients as one flat tensor: a lone gradient itself, else the group's reused buffer they are
        copied into; times ``scale`` where given (in the same pass where the group is large: :data:`FUSED_SCALE_BYTES`)."""
        if len(parts) == 1:
            buf = parts[0].detach()
            return buf if scale is None else buf.mul_(scale)
        buf = self._flat.get(g.index)
        if buf is None or buf.dtype != self.dtype or buf.device != self._device:
            buf = self._flat[g.index] = torch.empty(g.info.numel, dtype=self.dtype, device=self._device)
            self._flat_views.pop(g.index, None)
        if scale is None or buf.numel() * buf.element_size() < FUSED_SCALE_BYTES:
            torch.cat([p.detach().reshape(-1) for p in parts], out=buf)
            return buf if scale is None else buf.mul_(scale)
        at = 0
        for p in parts:
            n = p.numel()
            torch.mul(p.detach().reshape(-1), scale, out=buf[at : at + n])
            at += n
        return buf

    def _members(self, buf: Tensor, g: _Group) -> tuple[list[Tensor], list[TensorInfo]]:
        """``g``'s tensors in ``buf`` and their records: its members as views of it, or ``buf`` itself where the group
        is one flat tensor."""
        return (self._views(buf, g), list(g.parts)) if g.parts else ([buf], [g.info])

    def _views(self, buf: Tensor, g: _Group) -> list[Tensor]:
        """The members of ``g`` as views of ``buf`` in their own shapes; made once for the group's own reused buffer."""
        if buf is self._flat.get(g.index):
            views = self._flat_views.get(g.index)
            if views is None:
                views = self._flat_views[g.index] = self._cut(buf, g)
            return views
        return self._cut(buf, g)

    def _cut(self, buf: Tensor, g: _Group) -> list[Tensor]:
        out, at = [], 0
        for i in g.members:
            out.append(buf[at : at + self.numels[i]].view(self.shapes[i]))
            at += self.numels[i]
        return out

    def wait(self) -> list[Tensor]:
        """Every tensor's aggregate in backward order (after :meth:`flush`); ends the training step (a NaN or inf in
        any group rolls back every group's error feedback, :meth:`CompressionStep.close_step`) and resets for the next.

        A merged group's aggregates may be views of the group's reused buffer: they hold until the next step
        adds that group's first gradient (copy them to keep them longer; the optimizer copies them into ``.grad``).
        """
        self.flush()
        out: list[Tensor | None] = [None] * len(self.names)
        works, self._works = self._works, []
        self._sent.clear()
        self.step.close_step()  # every group of the step is queued: no exchange joins it any more
        for g, work in works:
            results = work.wait()
            span = self._spans.pop(g.index, None)
            if span is not None:  # a future's callbacks may run after its waiter wakes: done by now at the latest
                _close_span(span)
            if g.parts and len(results) == len(g.members):  # a batch's aggregates (auto's "none" is the flat buffer)
                for i, r in zip(g.members, results):
                    out[i] = r
            elif len(g.members) == 1:
                out[g.members[0]] = results[0]
            else:
                for i, view in zip(g.members, self._views(results[0], g)):
                    out[i] = view
        return out  # type: ignore[return-value]
