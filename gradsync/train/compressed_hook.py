"""A compressed DDP communication hook: ``hook(state, bucket) -> Future[Tensor]`` (PyTorch's ddp_comm_hooks shape).

Usage::

    rt = gradsync.init()
    state = CompressionHookState("powersgd", runtime=rt, model=net)
    model = DistributedDataParallel(net, bucket_cap_mb=1)
    model.register_comm_hook(state, compression_hook)

The state may also be built before any process group exists (Lightning's ``DDPStrategy(ddp_comm_state=...)``
does): bad arguments fail at once, and the runtime is found (or started on the process group) at the first
bucket (:meth:`CompressionHookState.resolve`).

Per bucket, the hook compensates and compresses each gradient (``merge="layerwise"``: each parameter's
gradient with its own shape, so PowerSGD sees matrices) or the whole bucket as one merged group
(``merge="bucket"``: DDP's bucket *is* a MergeComp group), then queues one job on the runtime's
communication thread that exchanges every payload of the bucket, decodes, aggregates and writes the
averaged result into the bucket. Per-tensor state (residuals, PowerSGD's warm start) is keyed by parameter
name, not bucket index, so DDP's bucket rebuild after the first iteration does not mix it up.

Non-finite gradients: the step is DDP's iteration. Each bucket's exchange joins the iteration's verdict, and
the bucket ``GradBucket.is_last()`` names (DDP hands buckets over in index order, the last one last) closes it --
or, should it never come, the next iteration's first use of a parameter name. When any bucket held a NaN or inf
on any rank, no bucket's error feedback or compressor state changes in that iteration (its NaN aggregate makes
GradScaler skip the step); ``state.nonfinite_steps`` counts such iterations. A bucket on the native cast path
(``fp16`` without memory) has neither state nor a count: its NaN reaches the aggregate by the sum itself. The same
holds for ``compression="auto"`` once every bucket has settled on a stateless choice ("none" on the backend's
allreduce or the planned exchange, or a cast on the backend's): each bucket is then a plain allreduce hook
(:meth:`AutoCompression.settled_launch`).

Why our PowerSGD runs on gloo with several buckets: both rounds of a bucket run inside that one job, and
jobs run in submission order, so every rank sees the same sequence of collectives. (PyTorch's
``powerSGD_hook`` launches the second allreduce from a future callback; with several buckets in flight
the callbacks can interleave the rounds differently on different ranks.)
"""

# No ``from __future__ import annotations``: DDP inspects the hook's annotations and wants real objects.
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from gradsync.comm.runtime import Runtime, is_initialized
from gradsync.compress.base import CompressionError, Compressor, Memory, TensorInfo
from gradsync.train.auto_compression import AutoCompression, param_signature
from gradsync.train.communicator import CompressionStep, average_in_place, native_cast_sum_async, write_aggregate
from gradsync.train.grouped import ddp_bucket_bytes, ddp_partition

__all__ = ["HOOK_MERGE_MODES", "CompressionHookState", "compression_hook"]

#: ``layerwise``: each gradient compressed alone; ``bucket``: the bucket compressed as one merged group.
HOOK_MERGE_MODES = ("layerwise", "bucket")


class CompressionHookState:
    """State for :func:`compression_hook` (grouped as PyTorch's ``PowerSGDState``).

    Hyper-parameters:

    * ``compression`` -- a compressor name or :class:`Compressor`, or ``"auto"`` (a codec per bucket from those
      ``allow`` permits: ``"lossless"``, ``"cast"`` (default), ``"any"``; measured against ``"none"`` on the first
      steps and dropped where slower; ``state.auto.report()`` prints the choices) or an
      :class:`~gradsync.train.AutoCompression`; ``memory`` (default: the compressor's
      usual error feedback) and ``communicator`` (default: the compressor's own) complete the step;
    * ``merge`` -- ``"layerwise"`` or ``"bucket"`` (see the module doc);
    * ``runtime`` -- the gradsync runtime whose communication thread runs the exchanges (default: ``gradsync.init``'s,
      or, when neither gradsync nor torch.distributed has started yet, the one started at the first bucket);
    * ``model`` / ``named_parameters`` -- where parameter names come from (default ``param<i>`` in the order
      DDP first shows them; pass the model so names match across runs).

    Internal state: ``step`` (the :class:`CompressionStep` with the compressor's and the memory's per-tensor
    state) and ``bucket_members``. Statistics: ``buckets`` (buckets handled; ``native_buckets`` of them cast and summed
    by the process group's own allreduce), ``payload_bytes`` / ``dense_bytes`` (what was sent against the uncompressed size).
    """

    def __init__(
        self,
        compression: Compressor | AutoCompression | str,
        *,
        allow: str | None = None,
        memory: Memory | str | None = None,
        communicator: str | None = None,
        merge: str = "layerwise",
        runtime: Any = None,
        model: torch.nn.Module | None = None,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    ) -> None:
        if merge not in HOOK_MERGE_MODES:
            raise CompressionError(f"merge={merge!r} must be one of {HOOK_MERGE_MODES} for the DDP hook")
        if model is not None and named_parameters is not None:
            raise CompressionError("pass model or named_parameters, not both (they name the same parameters)")
        named = list(model.named_parameters() if model is not None else named_parameters or [])
        auto = compression == "auto" if isinstance(compression, str) else isinstance(compression, AutoCompression)
        if allow is not None and not auto:
            raise CompressionError(f"allow={allow!r} only applies with compression='auto'; pass it or leave allow out")
        #: compression="auto"'s per-bucket choices (None for a fixed compressor)
        self.auto: AutoCompression | None = None
        if auto:
            if memory is not None or communicator is not None:
                raise CompressionError("compression='auto' picks each bucket's memory and communicator itself; "
                                       f"leave out memory={memory!r} and communicator={communicator!r}")
            self.auto = compression if isinstance(compression, AutoCompression) else AutoCompression(
                allow or "cast", runtime=runtime, signature=param_signature(named) if named else None)
            self.auto.bind("hook", self)
            self.step = self.auto.base
        else:
            self.step = CompressionStep(compression, memory, communicator, runtime=runtime)  # type: ignore[arg-type]
        self.merge = merge
        self._names: dict[int, str] = {id(p): n for n, p in named} if named is not None else {}
        #: For ``merge="bucket"``: each merged group's name -> the parameter names in it, as DDP bucketed them.
        self.bucket_members: dict[str, list[str]] = {}
        #: per bucket layout (dtype and parameter ids): its group name, TensorInfos, payload and dense bytes
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        self.buckets = 0
        self.native_buckets = 0
        self.payload_bytes = 0
        self.dense_bytes = 0
        #: The wire dtype when the step is a plain cast (fp16) with no memory, summed by allreduce: the hook
        #: then casts the whole bucket and sums it with the process group's own future where it can.
        self.cast_dtype: torch.dtype | None = self.step.cast_dtype if self.auto is None else None
        self._anticipated = False
        if runtime is not None or is_initialized() or (dist.is_available() and dist.is_initialized()):
            self.resolve()  # something to run on already: look it up now, as GradsyncHookState does
            self.anticipate_model(p for _, p in named)

    def anticipate_model(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Have the runtime price ahead what DDP's first backward over ``params`` (a model's, in registration order;
        DDP's default limits) sends, once. ``"auto"``: every class a bucket may fall in, and first the buckets' own
        payloads (DDP's buckets are runs of the parameters). A fixed codec on gradsync's thread: each bucket's
        exchange (a cast on the process group's own allreduce prices nothing). Called as the state is made with the
        model, and by :func:`gradsync.integrations.register_comm_hook` with the DDP model's module once the runtime is
        found."""
        trainable = [p for p in params if p.requires_grad]
        if self._anticipated or not trainable:
            return
        self._anticipated = True
        if self.auto is not None:
            self.auto.anticipate_model(trainable)
            self.auto.anticipate(ddp_bucket_bytes(trainable), trainable[0].dtype, first=True)
        elif self.cast_dtype is None:
            self._anticipate_buckets(trainable)

    def _anticipate_buckets(self, params: list[torch.nn.Parameter]) -> None:
        """Have the runtime price ahead what a fixed codec sends for the buckets of DDP's first backward (its default
        limits over ``params`` in reverse), each one exchange of its gradients (``merge="layerwise"``) or of its flat
        buffer (``"bucket"``)."""
        shapes = [tuple(p.shape) for p in reversed(params)]
        nbytes = [p.numel() * p.element_size() for p in reversed(params)]
        exchanges = [shapes[a:b] if self.merge == "layerwise" else [(sum(math.prod(s) for s in shapes[a:b]),)]
                     for a, b in ddp_partition(nbytes).bounds]
        sizes = self.step.allreduce_bytes(exchanges, params[0].dtype)
        if sizes:
            self.resolve().anticipate(sizes)

    @property
    def resolved(self) -> bool:
        """Whether the runtime has been found (:meth:`resolve`)."""
        return self.step.communicator.resolved

    def resolve(self) -> Runtime:
        """The runtime the exchanges run on: the one given, else ``gradsync.get_runtime()`` (started on the
        process group the trainer made, if gradsync was not initialised). Called at the first bucket."""
        return self.step.communicator.runtime

    @property
    def choosing(self) -> bool:
        """Whether ``compression="auto"`` is still choosing (timing codecs, or checking the choices against
        ``"none"``); always False for a fixed compressor."""
        return self.auto is not None and not (self.auto.settled and self.auto.verified)

    @property
    def nonfinite_steps(self) -> int:
        """DDP iterations with a NaN or inf in some bucket on some rank, whose updates were all dropped."""
        return (self.auto or self.step).nonfinite_steps

    def close_step(self) -> None:
        """The iteration is over (called after the last bucket): the next bucket begins the next one."""
        (self.auto or self.step).close_step()

    def name_of(self, param: torch.Tensor) -> str:
        key = id(param)
        if key not in self._names:
            self._names[key] = f"param{len(self._names)}"
        return self._names[key]


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress the bucket's gradients, exchange them on the communication thread, return the averaged bucket."""
    if not state.resolved:
        state.resolve()
    buffer = bucket.buffer()
    if state.cast_dtype is not None:
        fut = _native_cast(state, bucket, buffer, state.cast_dtype)
        if fut is not None:
            return fut
    state.buckets += 1
    layout = _layout(state, bucket, buffer)
    state.dense_bytes += layout.dense
    if state.auto is not None:  # the bucket is auto's group, whatever merge says
        scale = state.auto.lean_scale(layout.key, buffer.device)  # scaled before the sum, as DDP without a hook
        if scale is not None:
            buffer.mul_(scale)
        settled = state.auto.settled_launch(buffer, layout.key, verdict=False, scaled=scale is not None)
        if settled is not None:  # a settled, stateless choice on one allreduce of the bucket: a plain hook's cost
            if bucket.is_last():
                state.close_step()
            return settled
    if state.merge == "bucket":
        tensors = [buffer]
        infos = [TensorInfo(layout.key, tuple(buffer.shape), buffer.dtype, bucket.index())]
        state.payload_bytes += state.step.compressor.payload_bytes(infos[0].shape, buffer.dtype) if state.auto is None else 0
    else:
        tensors = list(bucket.gradients())
        infos = layout.infos
        state.payload_bytes += layout.payload
    # The views in ``tensors`` alias ``buffer``; the local half copies what it needs before anything is written,
    # and an aggregate may be decoded straight into its gradient's place in the bucket (reuse).
    if state.auto is not None:
        inner = state.auto.step_async(tensors, infos, reuse=True, key=layout.key, flat=buffer)
    else:
        inner = state.step.step_async(tensors, infos, reuse=True)
    if bucket.is_last():  # every bucket of the iteration is queued: no exchange joins its verdict any more
        state.close_step()
    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def write_back(fut: torch.futures.Future) -> None:
        try:
            results = fut.value()
            if state.merge == "bucket":
                write_aggregate(buffer, results[0])
            else:  # by offset: whether bucket.gradients() are views of the buffer is DDP's business
                at, base, size = 0, buffer.data_ptr(), buffer.element_size()
                for r in results:
                    n = r.numel()
                    if r.data_ptr() != base + at * size or not r.is_contiguous():  # else decoded in its place
                        write_aggregate(buffer[at : at + n], r.reshape(-1))
                    at += n
            out.set_result(buffer)
        except Exception as exc:  # noqa: BLE001 - delivered to DDP's wait
            out.set_exception(exc)

    inner.future.add_done_callback(write_back)
    return out


class _Layout(NamedTuple):
    """One bucket layout's records, made once: its merged group's name, each gradient's TensorInfo, and the
    payload and dense bytes of one pass (auto's payload is counted by its codecs: 0 here)."""

    key: str
    infos: list[TensorInfo]
    payload: int
    dense: int


def _layout(state: CompressionHookState, bucket: dist.GradBucket, buffer: torch.Tensor) -> _Layout:
    """The bucket's :class:`_Layout`, per layout (its dtype and parameters; DDP's rebuilt buckets each their own): a
    record per gradient per step would cost the hook more than its launches. Made from the parameters' shapes (a
    gradient has its parameter's), so a bucket that never needs its gradients' views never makes them."""
    params = bucket.parameters()
    key = (buffer.dtype, *map(id, params))
    layout = state._layouts.get(key)
    if layout is None:
        names = [state.name_of(p) for p in params]
        name = f"bucket:{names[0]}..{names[-1]}" if names else f"bucket{bucket.index()}"
        state.bucket_members[name] = names
        infos = [TensorInfo(n, tuple(p.shape), buffer.dtype, i) for i, (n, p) in enumerate(zip(names, params))]
        comp = state.step.compressor
        payload = sum(comp.payload_bytes(info.shape, info.dtype) for info in infos) if state.auto is None else 0
        if len(state._layouts) > 1024:
            state._layouts.clear()
        layout = state._layouts[key] = _Layout(name, infos, payload, sum(info.nbytes for info in infos))
    return layout


def _native_cast(
    state: CompressionHookState, bucket: dist.GradBucket, buffer: torch.Tensor, wire: torch.dtype
) -> "torch.futures.Future[torch.Tensor] | None":
    """A cast compressor (fp16) where the runtime sums this size natively: ``torch``'s ``fp16_compress_hook``
    path -- cast the bucket, the process group's async allreduce, cast back and average in place.

    The general path below gives the same bits (an elementwise cast sums the same flat buffer, averaged
    after in the gradient's dtype) at several times the overhead: a TensorInfo, a payload and a decode per
    gradient, and two thread hand-offs. None when the runtime plans this size itself (the bucket then takes
    the general path); the same on every rank, as the plan is.
    """
    runtime = state.step.communicator.runtime
    world = runtime.world_size
    fut = native_cast_sum_async(runtime, buffer, wire,
                                finish=None if world == 1 else lambda flat: average_in_place(flat, world))
    if fut is None:
        return None
    state.buckets += 1
    state.native_buckets += 1
    state.payload_bytes += state.step.compressor.payload_bytes(buffer.numel(), buffer.dtype)
    state.dense_bytes += buffer.numel() * buffer.element_size()
    if state.merge == "bucket":
        _layout(state, bucket, buffer)  # records the bucket's members
    return fut
