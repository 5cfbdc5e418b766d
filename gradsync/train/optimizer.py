"""Horovod-style ``DistributedOptimizer``: gradients start travelling the moment backward produces them.

Each parameter gets a post-accumulate-grad hook. When its gradient is final, the hook adds it to the open
group of its dtype; once the group holds ``bucket_bytes`` (0: every gradient alone) the group is queued
as one tensor collective on the runtime's communication thread, and backward goes on (wait-free
backprop, BML §4.1). The first group of an iteration closes at ``first_bucket_bytes`` instead (1 MiB
by default, DDP's first bucket), so the last layers' gradients travel while backward computes the rest
rather than waiting for a group that backward's remaining gradients will never fill. ``step()`` flushes
the open groups, waits for all of them, then runs the wrapped optimizer. Ranks produce gradients in the
same order, so their groups match.

With ``compression=...`` the gradients go through :mod:`gradsync.compress` instead (issue 8, MergeComp's
Algorithm 1): they are cut in backward order into the groups ``merge`` names, each group is compressed
once when its last gradient is ready and exchanged by its communicator while backward goes on, and
``step()`` writes the aggregates back into ``.grad``. ``compression=None`` (the default) is the plain path
above, unchanged. ``step()`` is also where a compressed training step ends: when any group's gradient held a NaN or
an inf on any rank, that group's aggregate is NaN (GradScaler skips the step) and no group's error feedback or
compressor state changes (:mod:`gradsync.train.communicator`), and the wrapped optimizer's step is skipped on every
rank; :attr:`DistributedOptimizer.nonfinite_steps` counts such steps.

Gradient accumulation (``backward_passes_per_step=N``, Horovod's name): each parameter's hook counts the backward
passes of the step and sends the gradient only on the N-th, once the N micro-batches have summed into ``.grad``
(autograd's accumulation); ``op`` then averages (or sums) that accumulated gradient over ranks, as DDP does after
``no_sync()``. Scale each micro-batch's loss by ``1/N`` to get the mean over every rank's micro-batches (single-process
training on them all). A pass beyond N before ``step()`` raises instead of being lost. :meth:`no_sync` is DDP's
form: passes inside it accumulate locally and are sent with the next pass outside it (or at ``step()``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from gradsync.comm.executor import OPS
from gradsync.comm.runtime import Runtime, Work, get_runtime
from gradsync.errors import GradsyncError
from gradsync.sim.choose import AUTO
from gradsync.train.grouped import DDP_BUCKET_BYTES, FIRST_BUCKET_BYTES, busy_seconds, ddp_partition

if TYPE_CHECKING:
    from gradsync.compress import Compressor, Memory, Partition
    from gradsync.compress.merge import MergeCostModel
    from gradsync.train.grouped import MergedGroups

__all__ = ["BUCKET_CHECK_STEPS", "DDP_BUCKET_BYTES", "DistributedOptimizer", "FIRST_BUCKET_BYTES"]

#: Whole steps timed on each side of ``compression="auto"``'s last check, its choices against DDP's buckets sent
#: uncompressed (:meth:`AutoCompression.check_buckets <gradsync.train.AutoCompression.check_buckets>`).
BUCKET_CHECK_STEPS = 3
#: Steps a side after which that check ends early on a clear gap (every step of one side TRY_GAIN times quicker
#: than every step of the other: :func:`~gradsync.compress.auto.steps_apart`).
BUCKET_APART_STEPS = 2
#: Steps of that check not counted because the runtime settled something in them (a size priced, pipeline depths
#: explored: slower than the side will run), each run again; past this many, every step counts (a runtime that keeps
#: settling is what the job runs).
BUCKET_SETTLING_STEPS = 50


class DistributedOptimizer:
    """Wraps ``optimizer`` so gradients are allreduced (averaged by default) before every ``step()``.

    ``named_parameters``: the model's ``named_parameters()`` (default: every parameter of the optimizer).
    ``bucket_bytes``: fuse consecutive gradients of one dtype until a group holds this many bytes.
    ``first_bucket_bytes``: the limit of an iteration's first group (default ``min(bucket_bytes,
    FIRST_BUCKET_BYTES)``, as DDP; ``bucket_bytes`` keeps every group alike).
    ``compression``: a compressor name (``gradsync compress list``) or a :class:`~gradsync.compress.Compressor`;
    ``memory`` (default: the compressor's usual error feedback) and ``communicator`` (default: the
    compressor's own) complete the step. ``merge``: ``"layerwise"`` (each tensor alone; the default with a fixed
    compressor), an int
    ``y`` (y groups of about equal size, backward order), a :class:`~gradsync.compress.Partition`, or
    ``"auto"``: the first step runs layer-wise while recording when each gradient is ready, then h and g
    are profiled on this machine and the exact search picks the partition (compressor and memory state are
    reset then). Backward order is assumed to be the reverse of ``named_parameters`` (``"auto"`` observes it).
    ``compression="auto"`` (issue 40): each group runs the codec :mod:`gradsync.compress.auto` picks from those
    ``allow`` permits (``"lossless"``, ``"cast"`` -- the default --, ``"any"``), measured against ``"none"`` on its
    first steps and dropped where slower (:class:`~gradsync.train.AutoCompression`; pass one to set its wire,
    codec costs or clock); ``optimizer.compression.report()`` prints the choices. With ``merge="auto"`` the
    partition and the codec are chosen together after the second step, timed (the first warms up; both send
    DDP's buckets uncompressed),
    on auto's wire model and codec costs, with each group's own cost fitted to that step's time
    (:func:`~gradsync.compress.auto.choose_joint`, ``optimizer.compression.joint``); it is the default with
    ``compression="auto"``, since a group that settles on ``"none"`` is one native allreduce, and layer-wise
    that is one collective per tensor where DDP sends a few buckets. Once the choices settle, unless they are DDP's
    buckets uncompressed, they are timed against those (:data:`BUCKET_CHECK_STEPS` whole steps each, by turns; from
    :data:`BUCKET_APART_STEPS` on, a clear gap ends it), and DDP's buckets run from then on unless the choices were
    quicker (``optimizer.compression.buckets``).
    ``backward_passes_per_step``: backward passes (micro-batches) summed into ``.grad`` before each ``step()``; the
    gradients travel on the last one (gradient accumulation; scale each micro-batch's loss by 1/N for a mean). A
    parameter's gradient arriving more often raises; :meth:`no_sync` marks extra passes as local instead.
    Other attributes (``param_groups``, ``state``, ``zero_grad`` ...) are the wrapped optimizer's.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        *,
        runtime: Runtime | None = None,
        op: str = "avg",
        algorithm: str | None = None,
        bucket_bytes: int | float = 0,
        first_bucket_bytes: int | float | None = None,
        compression: Compressor | str | None = None,
        merge: Partition | int | str | None = None,
        memory: Memory | str | None = None,
        communicator: str | None = None,
        backward_passes_per_step: int = 1,
        allow: str | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if op not in OPS:
            raise GradsyncError(f"op={op!r} is not one of {OPS}")
        bucket_bytes = _byte_count("bucket_bytes", bucket_bytes, "(0 sends every gradient alone)")
        if first_bucket_bytes is not None:
            first_bucket_bytes = _byte_count("first_bucket_bytes", first_bucket_bytes,
                                             f"or None (None: min(bucket_bytes, {FIRST_BUCKET_BYTES}), DDP's first bucket)")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise GradsyncError(f"backward_passes_per_step={backward_passes_per_step!r} must be an integer >= 1 "
                                "(the backward passes summed into .grad before each step(); 1: no accumulation)")
        self.backward_passes_per_step = backward_passes_per_step
        #: this step's backward passes per parameter (id) that count toward backward_passes_per_step (outside no_sync)
        self._passes: dict[int, int] = {}
        #: parameters (id) whose .grad holds passes not sent yet (fewer than N so far, or inside no_sync)
        self._unsent: set[int] = set()
        self._sync = True  # False inside no_sync()
        self.optimizer = optimizer
        self.runtime = runtime or get_runtime()
        self.op = op
        self.algorithm = algorithm
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = min(self.bucket_bytes, FIRST_BUCKET_BYTES) if first_bucket_bytes is None else first_bucket_bytes
        in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param{i}", p) for i, p in enumerate(in_optimizer)]
        else:
            named = list(named_parameters)
            known = {id(p) for p in in_optimizer}
            stray = [n for n, p in named if id(p) not in known]
            if stray:
                raise GradsyncError(f"named_parameters {stray[:5]} are not in the optimizer; pass model.named_parameters() of the optimized model")
        self.names = {id(p): n for n, p in named}
        self._open: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
        self._works: list[tuple[Work, int]] = []  # this iteration's queued groups and their bytes, in order
        #: bytes of each group the last synchronized iteration sent, in the order they were queued (DDP's
        #: bucket sizes, for this optimizer): what ``auto`` planned for (``runtime.choice(n)`` per size).
        #: Without compression only: compressed groups are ``merge``'s partition.
        self.group_bytes: list[int] = []
        self.wait_seconds = 0.0  # time step() spent waiting on communication (exposed comm time)
        self.compression = None
        if allow is not None and not _is_auto(compression):
            raise GradsyncError(f"allow={allow!r} only applies with compression='auto'; pass compression='auto' or leave allow out")
        if compression is not None:
            self._init_compression(named, compression, merge, memory, communicator, allow)
        elif merge not in (None, "layerwise") or memory is not None or communicator is not None:
            raise GradsyncError(
                f"merge={merge!r}, memory={memory!r}, communicator={communicator!r} only apply with compression=...; "
                "pass a compressor (e.g. compression='fp16') or leave them out"
            )
        self._trainable = [(n, p) for n, p in named if p.requires_grad]
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for _, p in self._trainable]
        self.runtime.prepare(algorithm)  # a bad algorithm fails here, not in the first backward
        if self.compression is None and algorithm in (None, AUTO):  # the groups' sizes priced before they are sent
            sizes = self._plain_group_bytes()
            if sizes:
                self.runtime.anticipate(sizes)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on self: delegate to the wrapped optimizer. (LR schedulers
        # check isinstance(opt, Optimizer): give them ``dist_opt.optimizer``.)
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _hook(self, param: torch.Tensor) -> None:
        """A backward pass finished ``param``'s gradient: count it, and send it on the step's last pass."""
        key = id(param)
        n = self.backward_passes_per_step
        done = self._passes.get(key, 0)
        if done >= n:  # already sent this step: this pass would be summed into a gradient in flight, then lost
            name = self.names.get(key, "?")
            raise GradsyncError(
                f"the gradient of {name!r} arrived from backward pass {done + 1} since the last step(), but "
                f"backward_passes_per_step={n} sent it after pass {n}; pass backward_passes_per_step={done + 1} "
                f"(the micro-batches per step) to DistributedOptimizer, or run the extra passes inside "
                f"`with optimizer.no_sync():`, or call step() (or zero_grad() to drop them) after every {n} pass(es)"
            )
        if not self._sync:
            self._unsent.add(key)
            return
        done += 1
        self._passes[key] = done
        if done < n:
            self._unsent.add(key)
            return
        self._unsent.discard(key)
        self._send(param)

    def _send(self, param: torch.Tensor) -> None:
        if self.compression is None:
            self._on_grad(param)
        else:
            self._on_grad_compressed(param)

    def _send_unsent(self) -> None:
        """At step(): send the gradients that still hold unsent passes (fewer than N, or only inside no_sync), in
        backward order (the same on every rank that ran the same passes)."""
        unsent, self._unsent = self._unsent, set()
        for _, p in reversed(self._trainable):  # backward order, as the hooks would have sent them
            if id(p) in unsent and p.grad is not None:
                self._passes[id(p)] = self.backward_passes_per_step
                self._send(p)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()``: backward passes inside accumulate into ``.grad`` without communicating; the next
        pass outside (or ``step()``) sends the sum. They do not count toward ``backward_passes_per_step``."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:  # pragma: no cover - the hook fires after accumulation
            return
        if grad.is_sparse or not grad.is_contiguous():
            raise GradsyncError(f"gradient of {self.names.get(id(param), '?')} is sparse or not contiguous; gradsync allreduces dense gradients")
        group, size = self._open.get(grad.dtype, ([], 0))
        group.append(grad)
        size += grad.numel() * grad.element_size()
        if self._closes(size, bool(self._works)):
            self._queue(group, size)
            self._open.pop(grad.dtype, None)
        else:
            self._open[grad.dtype] = (group, size)

    # ---- compressed path (gradsync.compress) -----------------------------------------------------------
    def _init_compression(self, named: list[tuple[str, torch.nn.Parameter]], compression: Any, merge: Any,
                          memory: Any, communicator: str | None, allow: str | None = None) -> None:
        from gradsync.compress.merge import resolve_merge
        from gradsync.train.auto_compression import AutoCompression, param_signature
        from gradsync.train.communicator import CompressionStep

        if self.op != "avg":
            raise GradsyncError(f"op={self.op!r} with compression: compressed gradients are averaged (op='avg') or voted")
        for what, value in (("bucket_bytes", self.bucket_bytes), ("first_bucket_bytes", self.first_bucket_bytes)):
            if value:
                raise GradsyncError(f"{what}={value} with compression: merge=... decides the groups (e.g. merge=4 or 'auto')")
        trainable = [(n, p) for n, p in named if p.requires_grad]
        dtypes = sorted({str(p.dtype) for _, p in trainable})
        if len(dtypes) > 1:
            raise GradsyncError(f"compression merges one dtype, but the parameters are {dtypes}; cast the model first")
        if _is_auto(compression):
            if memory is not None or communicator is not None:
                raise GradsyncError(f"compression='auto' picks each group's codec, memory and communicator itself; "
                                    f"memory={memory!r}, communicator={communicator!r} cannot be combined with it "
                                    "(pass no memory/communicator)")
            self.compression = compression if isinstance(compression, AutoCompression) else AutoCompression(
                allow or "cast", runtime=self.runtime, signature=param_signature(trainable))
            self.compression.bind("optimizer", self)
            # the groups' sizes are known after the calibration steps: their classes are priced meanwhile
            self.compression.anticipate_model([p for _, p in trainable])
        else:
            self.compression = CompressionStep(compression, memory, communicator, runtime=self.runtime)
        self._params = list(reversed(trainable))  # backward order: the reverse of registration (forward) order
        self._dtype = self._params[0][1].dtype if self._params else torch.float32
        if merge is None:
            merge = "auto" if _is_auto(compression) else "layerwise"
        self.partition = resolve_merge(merge, [p.numel() for _, p in self._params])
        self.cost_model: MergeCostModel | None = None
        self._calibrating = self.partition is None  # "auto": the first step(s) calibrate, one of them timed
        # compression="auto" fits each group's own cost to that step's time (choose_joint's observed): it times the
        # second step, as the job's first also pays its first collectives and allocations
        self._untimed_steps = 1 if self._calibrating and _is_auto(compression) else 0
        self._arrivals: list[tuple[int, float]] = []
        self._inside = 0.0  # seconds the calibration step spent inside the groups' add()
        #: the calibration steps' groups: layer-wise (the compressor's per-tensor cost is measured there), or, with
        #: compression="auto", DDP's buckets (:func:`~gradsync.train.grouped.ddp_partition`), sent uncompressed (the
        #: untimed first step in a cast where :meth:`AutoCompression.calibration_wire` gives one)
        nbytes = [p.numel() * p.element_size() for _, p in self._params]
        self._calibration = ddp_partition(nbytes) if _is_auto(compression) else _layerwise(len(self._params))
        #: compression="auto" with merge="auto": DDP's buckets sent uncompressed, timed against the choices once they
        #: settle (BUCKET_CHECK_STEPS whole steps each, alternating), and run instead where they are quicker; None
        #: when there is nothing (more) to check
        self._buckets: MergedGroups | None = None
        self._bucket_s: tuple[list[float], list[float]] = ([], [])  # whole steps: the choices', the buckets'
        self._bucket_turn: bool | None = None  # this step runs DDP's buckets (None: no check this step)
        self._step_t0 = 0.0
        self._turns_dropped = 0  # the bucket check's steps not counted (the runtime settled something in them)
        #: compression="auto": the timed calibration step's whole time on auto's clock (DDP's buckets uncompressed, the
        #: bucket check's other side), which may spare that check timing the buckets (:meth:`_next_bucket_turn`); None
        #: where the runtime settled something in it (:meth:`AutoCompression.calibration_stands`)
        self._calibration_s: float | None = None
        self._settling_t0 = 0  # the runtime's settling count when the calibration step or a check's step began
        self._build_groups(self.partition if self.partition is not None else self._calibration)
        if not _is_auto(compression):  # a fixed codec's first groups are known: their sizes priced meanwhile
            sizes = self.compression.allreduce_bytes(self._groups.exchange_shapes(), self._dtype)
            if sizes:
                self.runtime.anticipate(sizes)
        if self._calibrating and self._untimed_steps:
            # the untimed first step sends DDP's buckets in a cast where the policy allows one and the wire puts it
            # well ahead: its partition is thrown away and its time not read, so only its pace matters
            self._groups.plain_wire = self.compression.calibration_wire(
                list(self._calibration.group_sizes(nbytes)), self._dtype)

    def _build_groups(self, partition: Partition) -> None:
        self._index = {id(p): i for i, (_, p) in enumerate(self._params)}
        # compression="auto"'s calibration steps send DDP's buckets outside auto's choosing (uncompressed, or the
        # untimed first in a cast): they are thrown away after them
        self._groups = self._merged(partition, plain=self._calibrating and _is_auto(self.compression))

    def _merged(self, partition: Partition, *, plain: bool) -> MergedGroups:
        from gradsync.train.grouped import MergedGroups

        return MergedGroups(
            self.compression, [n for n, _ in self._params], [tuple(p.shape) for _, p in self._params], self._dtype, partition,
            reuse_inputs=True,  # .grad gets the aggregate anyway: decode it straight there
            plain=plain,
        )

    def _on_grad_compressed(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:  # pragma: no cover - the hook fires after accumulation
            return
        if grad.is_sparse:
            raise GradsyncError(f"gradient of {self.names.get(id(param), '?')} is sparse; gradsync compresses dense gradients")
        index = self._index[id(param)]
        if not self._calibrating:
            if self._bucket_turn is None and self._buckets is not None and not self._running_started():
                self._bucket_turn = self._next_bucket_turn()  # the step's first gradient: which side runs it
            self._running.add(index, grad)
            return
        # Backward's own progress: the time this hook spent compressing earlier gradients taken out (the
        # model adds compression to the ready times itself, so counting it here would count it twice).
        if not self._arrivals and _is_auto(self.compression):  # the step's first gradient: its whole time from here
            self._step_t0 = self.compression.clock()
            self._settling_t0 = self.runtime.settling
        t = time.perf_counter()
        self._arrivals.append((index, t - self._inside))
        self._groups.add(index, grad)
        self._inside += time.perf_counter() - t

    @property
    def _running(self) -> MergedGroups:
        """The groups this step runs: DDP's buckets on a turn of the bucket check, else the job's."""
        return self._buckets if self._bucket_turn and self._buckets is not None else self._groups

    def _running_started(self) -> bool:
        return self._groups.started or (self._buckets is not None and self._buckets.started)

    def _next_bucket_turn(self) -> bool | None:
        """Whether this step runs DDP's buckets (True), the choices (False), or no check (None): once auto's choices
        have settled and passed its own checks, DDP's buckets first, then by turns, BUCKET_CHECK_STEPS each. Where
        the calibration step was timed (it ran those buckets), the choices' BUCKET_APART_STEPS come first: each at
        least CALIBRATION_GAIN times quicker than it, they stay without a step of the buckets (on a slow wire, the
        check's cost)."""
        auto = self.compression
        if not (auto.settled and auto.verified):
            return None
        if self._buckets is not None and self._buckets.partition == self.partition and auto.runs_backend_none:
            self._buckets = None  # the choices are DDP's buckets uncompressed: nothing to time them against
            return None
        self._step_t0 = auto.clock()
        self._settling_t0 = self.runtime.settling
        chosen, buckets = self._bucket_s
        if self._against_calibration and len(chosen) < BUCKET_APART_STEPS:
            return False
        return len(buckets) <= len(chosen)

    @property
    def _against_calibration(self) -> bool:
        """Whether the bucket check still holds the choices' steps against the timed calibration step: it stood for
        DDP's buckets, and no step of the buckets has run yet."""
        return self._calibration_s is not None and not self._bucket_s[1]

    def _end_bucket_turn(self) -> None:
        """After a step of the bucket check: its time goes to its side; after each pair from BUCKET_APART_STEPS on,
        the job decides (rank 0's times) whether the choices stay or DDP's buckets run from now on -- on a clear gap
        only, until BUCKET_CHECK_STEPS pairs."""
        turn, self._bucket_turn = self._bucket_turn, None
        if turn is None or self._buckets is None:
            return
        chosen, buckets = self._bucket_s
        took = self.compression.clock() - self._step_t0
        turn_index = len(chosen) + len(buckets) + self._turns_dropped + 1  # each step ended is counted or dropped
        if self._turns_dropped < BUCKET_SETTLING_STEPS and not self.compression.turn_stands(
                self.runtime.settling - self._settling_t0, turn_index):
            self._turns_dropped += 1  # the same side runs again
            return
        (buckets if turn else chosen).append(took)
        sizes = [g.info.numel * self._dtype.itemsize for g in self._buckets.groups]
        if self._against_calibration and len(chosen) == BUCKET_APART_STEPS:
            if self.compression.check_buckets(chosen, [], sizes, calibration_s=self._calibration_s):
                self._buckets = None  # far quicker than the calibration step: the choices stay
            return
        pairs = len(chosen)
        if pairs != len(buckets) or pairs < BUCKET_APART_STEPS:
            return
        keep = self.compression.check_buckets(chosen, buckets, sizes, final=pairs >= BUCKET_CHECK_STEPS,
                                              calibration_s=self._calibration_s)
        if keep is None:  # no clear gap yet: another pair
            return
        if not keep:
            self.partition, self._groups = self._buckets.partition, self._buckets
        self._buckets = None

    def _synchronize_compressed(self) -> None:
        end = t0 = time.perf_counter()
        results = self._running.wait()
        synced = time.perf_counter()
        self.wait_seconds += synced - t0
        end_step = getattr(self.compression, "end_step", None)
        if end_step is not None:  # compression="auto": backward is over, its groups' slack is known
            end_step()
        _write_back([p for _, p in self._params], results)
        if self._calibrating and self._untimed_steps:
            self._untimed_steps -= 1
            self._arrivals, self._inside = [], 0.0
            self._groups.plain_wire = None  # the timed step sends DDP's buckets as DDP does: the buckets' anchor
            self._groups.timeline = []  # and its collectives' time in flight scales the wire model (_calibrate)
        elif self._calibrating:
            if _is_auto(self.compression):
                took = self.compression.clock() - self._step_t0
                settled = self.runtime.settling - self._settling_t0
                self._calibration_s = took if self.compression.calibration_stands(settled) else None
            self._calibrate(end, synced)
        else:
            self._end_bucket_turn()

    def _calibrate(self, end: float, synced: float) -> None:
        """After the timed calibration step: backward order and ready times -> profiled model -> partition."""
        from gradsync.compress.auto import MARGIN, TRY_GAIN, quicker_by
        from gradsync.compress.merge import search_optimal
        from gradsync.train.grouped import profile_cost_model

        self._calibrating = False
        arrivals, self._arrivals = self._arrivals, []
        start = arrivals[0][1] if arrivals else end
        seen = [i for i, _ in arrivals]
        seen_set = set(seen)
        order = seen + [i for i in range(len(self._params)) if i not in seen_set]
        # Every rank must plan the same groups: keep the observed order only if all ranks observed it. Summed on the
        # backend's own allreduce where there is one (exact: small integers in float64); a planned allreduce of a
        # size seen once would be planned, and decided job-wide, for it alone.
        check = torch.tensor([float(i) for i in order], dtype=torch.float64)  # host: the collective stages it
        fut = self.runtime.native_allreduce_async(check, always=True)
        if fut is None:
            self.runtime.allreduce(check, "sum")
        else:
            fut.wait()
        expect = self.runtime.world_size * torch.tensor([float(i) for i in order], dtype=torch.float64)  # host
        if not torch.equal(check, expect):
            order = list(range(len(self._params)))
        when = dict((i, t - start) for i, t in arrivals)
        ready, last = [], 0.0
        for i in order:
            last = max(last, when.get(i, last))
            ready.append(last)
        self._params = [self._params[i] for i in order]
        sizes = [p.numel() for _, p in self._params]
        n = len(self._params)
        # the timed step's end-to-end time, with its groups, calibrates the per-group overhead
        inside, self._inside = self._inside, 0.0
        if _is_auto(self.compression):  # the partition and the codec chosen together, on auto's own wire model
            # the groups that ran; where backward's order was another, DDP's buckets in that order (near enough)
            ran = self._calibration if order == list(range(n)) else ddp_partition(
                [p.numel() * p.element_size() for _, p in self._params])
            timeline, self._groups.timeline = self._groups.timeline, None
            joint = self.compression.plan_partition(sizes, ready, max(end - start - inside, last), self._dtype,
                                                    observed=(ran, synced - start),
                                                    observed_busy_s=busy_seconds(timeline) if timeline else None)
            self.partition = joint.partition
            if self.compression.runs_ddp_buckets:  # an earlier job's check on this partition: DDP's buckets won
                self.partition, self._groups = ran, self._merged(ran, plain=True)
                return
            self._build_groups(self.partition)
            # timed against DDP's buckets once the choices settle (unless they are those, uncompressed); an earlier
            # job's verdict that kept the choices needs no check
            if self.compression.buckets is None:
                self._buckets = self._merged(ran, plain=True)
                # whole steps against DDP's own way follow: a way on gradsync's thread (the planned exchange, a
                # threaded codec) is kept on any lead of its own and left to them, not refused short of TRY_GAIN
                self.compression.threaded_gain = 1.0
                if quicker_by(joint.per_codec_s[joint.codec], joint.per_codec_s.get("none", 0.0), TRY_GAIN):
                    # the partition's search, which prices overlap with backward from the timed step, put a codec
                    # TRY_GAIN ahead of "none" for the whole step, and whole steps against DDP's uncompressed buckets
                    # follow: a codec the model puts TRY_GAIN ahead of "none" on a group is kept on its own
                    # measurement, without timing "none" (the costly side on a slow wire).
                    self.compression.margin = TRY_GAIN
                else:  # a group's first price (no slack measured yet) is not trusted on a cast's narrow margin
                    self.compression.cast_margin = MARGIN  # the search priced the overlap and found less
            return
        device = self._params[0][1].device if self._params else torch.device("cpu")
        self.cost_model = profile_cost_model(self.compression, sizes, ready, max(end - start - inside, last),
                                             observed=(_layerwise(n), synced - start), device=device)
        self.partition = search_optimal(self.cost_model)
        self.compression.compressor.reset()
        self.compression.memory.reset()
        self._build_groups(self.partition)

    @property
    def choosing(self) -> bool:
        """Whether ``compression="auto"`` is still choosing: calibrating the partition, timing codecs, or checking the
        choices (against ``"none"``, then against DDP's buckets); False once every step runs what was chosen, and
        always False otherwise."""
        auto = self.compression
        if auto is None or not _is_auto(auto):
            return False
        if self._calibrating or self._buckets is not None:
            return True
        if auto.runs_ddp_buckets:
            return False  # DDP's buckets run, outside every choice
        return not (auto.settled and auto.verified)

    @property
    def nonfinite_steps(self) -> int:
        """Compressed steps with a NaN or inf in some gradient on some rank: every group's error feedback and
        compressor state were left as before the step (0 without compression, which keeps no such state)."""
        return 0 if self.compression is None else self.compression.nonfinite_steps

    def synchronize(self) -> None:
        """Send any open groups and wait until every gradient of this iteration is reduced."""
        self._send_unsent()
        self._passes.clear()
        if self.compression is not None:
            self._synchronize_compressed()
            return
        for group, size in self._open.values():
            self._queue(group, size)
        self._open.clear()
        t0 = time.perf_counter()
        works, self._works = self._works, []
        self.group_bytes = [size for _, size in works]
        for w, _ in works:
            w.wait()
        self.wait_seconds += time.perf_counter() - t0

    def _closes(self, size: int, sent: bool) -> bool:
        """Whether an open group of ``size`` bytes is queued: at ``bucket_bytes`` once the iteration ``sent`` a group,
        at ``first_bucket_bytes`` before (the first group)."""
        return size >= (self.bucket_bytes if sent else self.first_bucket_bytes)

    def _plain_group_bytes(self) -> list[int]:
        """The bytes of the groups an iteration sends without compression, in the order :meth:`_on_grad` queues them
        where backward produces the gradients in reverse registration order (DDP's assumption for its buckets); the
        groups still open at the end follow, as :meth:`synchronize` sends them."""
        out: list[int] = []
        open_: dict[torch.dtype, int] = {}
        for _, p in reversed(self._trainable):
            size = open_.get(p.dtype, 0) + p.numel() * p.element_size()
            if self._closes(size, bool(out)):
                out.append(size)
                open_.pop(p.dtype, None)
            else:
                open_[p.dtype] = size
        return [n for n in [*out, *open_.values()] if n > 0]  # an empty parameter's group sends nothing to price

    def _queue(self, group: list[torch.Tensor], size: int) -> None:
        """One fused allreduce of ``group`` (``size`` bytes) on the communication thread."""
        self._works.append((self.runtime.allreduce_async(group, self.op, self.algorithm), size))

    def step(self, closure: Any = None) -> Any:
        """Synchronize, then the wrapped optimizer's step -- skipped (``None``) when the compressed step held a NaN or
        an inf on some rank: GradScaler's contract, kept without a GradScaler too, and on every rank at once (the
        verdict travels with the payloads). :attr:`nonfinite_steps` counts it. With ``compression="auto"``, a group
        sent uncompressed (its timed calibration step and DDP's buckets on the backend's allreduce, a settled "none" on
        either exchange) is not checked, as without compression (the untimed first calibration step sent in a cast is): nothing of compression's to roll back, and the
        check would cost a pass over the group."""
        before = self.nonfinite_steps
        self.synchronize()
        if self.nonfinite_steps > before:
            return None
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's; in the middle of a step (passes since the last ``step()``) the step's passes are
        dropped: what is in flight is waited for first (every rank ran it), then the count starts again."""
        if self._passes or self._unsent:
            self._unsent.clear()
            self._drain()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _drain(self) -> None:
        """Wait for this step's communication and forget it (zero_grad() before step() drops the step)."""
        self._passes.clear()
        if self.compression is None:
            self.synchronize()
            return
        if self._running.started:
            self._running.wait()
        self._bucket_turn = None  # a dropped step times nothing
        self._arrivals, self._inside = [], 0.0

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _write_back(params: list[torch.nn.Parameter], results: list[torch.Tensor]) -> None:
    """Each aggregate into its parameter's ``.grad`` (a copy of it where there is none): one multi-tensor copy for
    those not decoded straight into their ``.grad`` already (one call, not one per tensor: LeNet-5's ten)."""
    from gradsync.train.communicator import write_aggregates

    dests, srcs = [], []
    for p, r in zip(params, results):
        if p.grad is None:
            p.grad = r.detach().clone()
        else:
            dests.append(p.grad)
            srcs.append(r)
    write_aggregates(dests, srcs)


def _is_auto(compression: object) -> bool:
    """Whether ``compression`` asks for per-group choice ("auto" or an AutoCompression)."""
    if isinstance(compression, str):
        return compression == "auto"
    from gradsync.train.auto_compression import AutoCompression

    return isinstance(compression, AutoCompression)


def _layerwise(n: int) -> Partition:
    from gradsync.compress.merge import Partition

    return Partition.layerwise(n)


def _byte_count(name: str, value: object, hint: str) -> int:
    """``value`` as a whole number of bytes >= 0: an int, or a float with an integral value (``25e6``, as a size is
    often written); anything else (a bool, 1.5, "1MB", a negative) is refused with ``name`` and ``hint``."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GradsyncError(f"{name}={value!r} must be an integer >= 0 {hint}")
    return value
