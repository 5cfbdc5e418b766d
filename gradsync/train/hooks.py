"""A DDP communication hook that allreduces each gradient bucket with a planned schedule.

Usage::

    rt = gradsync.init(topology="p3.8xlarge", algorithm="lp")
    model = DistributedDataParallel(net)
    model.register_comm_hook(GradsyncHookState(rt), allreduce_hook)

DDP hands the hook one flat bucket at a time, in the order buckets become ready; the hook queues the
bucket on the runtime's communication thread and returns a future DDP waits on before the optimizer
step, so buckets travel while backward continues.
"""

# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations and wants the real
# ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from gradsync.comm.executor import OPS
from gradsync.comm.runtime import Runtime, get_runtime, is_initialized
from gradsync.errors import GradsyncError
from gradsync.sim.choose import AUTO
from gradsync.train.grouped import ddp_bucket_bytes

__all__ = ["GradsyncHookState", "allreduce_hook"]


@dataclass
class GradsyncHookState:
    """State for :func:`allreduce_hook`.

    * ``runtime``: the :class:`Runtime` whose transport and schedules to use (default: ``gradsync.init``'s, or, when
      neither gradsync nor torch.distributed has started yet, the one started at the first bucket: a trainer
      such as Lightning builds the state before it makes the process group).
    * ``op``: ``"avg"`` (DDP's semantics: the mean gradient) or ``"sum"``.
    * ``algorithm``: a synthesizer name to use instead of the runtime's default.
    * ``buckets``: counts buckets reduced (statistics).
    * ``model``: the model DDP wraps (optional): where the state has a runtime as it is made, the sizes of DDP's first
      buckets are priced ahead on ``auto`` (:meth:`anticipate_model`), instead of at the first bucket while every
      rank waits.
    """

    runtime: Optional[Runtime] = None  # noqa: UP045 - evaluated at runtime on Python 3.10 too
    op: str = "avg"
    algorithm: Optional[str] = None  # noqa: UP045
    buckets: int = 0
    model: Optional[torch.nn.Module] = field(default=None, repr=False, compare=False)  # noqa: UP045

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise GradsyncError(f"op={self.op!r} is not one of {OPS}; DDP expects 'avg' for averaged gradients")
        if self.model is not None and not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"model must be the torch.nn.Module DDP wraps (or None), got {type(self.model).__name__}")
        self._anticipated = False
        if self.runtime is None and not (is_initialized() or (dist.is_available() and dist.is_initialized())):
            return  # nothing to run on yet: resolve() at the first bucket
        self.resolve()
        if self.model is not None:
            self.anticipate_model(self.model.parameters())

    @property
    def resolved(self) -> bool:
        """Whether the runtime has been found (:meth:`resolve`)."""
        return self.runtime is not None

    def anticipate_model(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Have the runtime price ahead the buckets of DDP's first backward over ``params`` (a model's, in
        registration order; DDP's default limits), once, where the runtime chooses (``auto``) and this state names no
        algorithm of its own. Called as the state is made with ``model``, and by
        :func:`gradsync.integrations.register_comm_hook` with the DDP model's module once a runtime is found."""
        trainable = [p for p in params if p.requires_grad]
        if self._anticipated or not trainable or self.algorithm not in (None, AUTO):
            return
        self._anticipated = True
        self.resolve().anticipate(ddp_bucket_bytes(trainable))

    def resolve(self) -> Runtime:
        """The runtime, started (``gradsync.get_runtime()``) if none was given, with the algorithm planned: a bad
        algorithm fails here, not mid-backward."""
        if self.runtime is None:
            self.runtime = get_runtime()
        if not isinstance(self.runtime, Runtime):
            raise TypeError(f"runtime must be a gradsync Runtime (from gradsync.init()), got {type(self.runtime).__name__}")
        self.runtime.prepare(self.algorithm)
        return self.runtime


def allreduce_hook(state: GradsyncHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``hook(state, bucket) -> Future[Tensor]``: allreduce ``bucket.buffer()`` in place with the schedule.

    Where the runtime runs the bucket's size natively (``auto`` on a flat switch, small buckets), the process
    group's async allreduce is issued here, as DDP itself does, with no hand-off to the communication thread
    and back (:meth:`~gradsync.comm.runtime.Runtime.native_allreduce_async`); ``avg`` divides after the sum,
    as the queued path does, so both give the same bits.
    """
    state.buckets += 1
    runtime = state.runtime or state.resolve()
    buffer = bucket.buffer()
    fut = runtime.native_allreduce_async(buffer, state.algorithm)
    if fut is None:
        return runtime.allreduce_async(buffer, state.op, state.algorithm).future
    if state.op == "sum":
        return fut.then(lambda f: f.value()[0])
    world = runtime.world_size
    return fut.then(lambda f: f.value()[0].div_(world))
