"""The runtime a training job talks to: ``gradsync.init()``, ``gradsync.allreduce()``, and async work.

A :class:`Runtime` owns a transport, the topology the job runs on and one communication thread. Every
collective, synchronous or not, is queued to that thread in call order: all ranks issue collectives in the
same order, so the queue keeps them matched, and backward can go on while gradients travel (wait-free
backprop, Horovod's design). What it runs comes from two rooms beside it:

* :mod:`gradsync.comm.plans`: the plan cache, ``auto``'s choice per size class and one executor per plan, for
  allreduce, reduce-scatter and allgather alike;
* :mod:`gradsync.comm.tuning`: calibration, tuning and exploring, which check the cost model's choices on the
  job's own wire, and their cache on disk.

The collectives beside the planned executor (the backend's own allreduce, allgather of uneven sizes, the
sharded tensor forms) are in :mod:`gradsync.comm.collectives`. Each rank counts what it asked for
(:mod:`gradsync.comm.ledger`, host counters only), so a failed collective names the rank whose calls differ.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.comm import claims, lifetime
from gradsync.comm.adapt import Adapter, AdaptOptions, adapt_from_env
from gradsync.comm.collectives import (
    NativeAllreduce,
    Tensors,
    check_sharded,
    gather_p2p,
    gather_torch,
    native_failure,
    nbytes_of,
    run_sharded,
)
from gradsync.comm.executor import OPS, Executor
from gradsync.comm.ledger import Ledger, describe_mismatch
from gradsync.comm.plans import PlanCache, Runnable, price_ahead
from gradsync.comm.trace import TraceRecorder, profiled
from gradsync.comm.transport import Transport, create_transport
from gradsync.comm.tuning import EXPLORE_MIN_BYTES, TUNE_MAX_BYTES, Explorer, Tuning, load_cost_model
from gradsync.errors import CommError, GradsyncError, PeerError
from gradsync.plan.schedule import SHARDED, Schedule
from gradsync.plan.synthesizers import PlanOptions
from gradsync.sim.choose import AUTO, Chooser
from gradsync.sim.cost import NATIVE, CostModel, size_class
from gradsync.topology.io import get_topology
from gradsync.topology.model import Topology

__all__ = [
    "COMM_THREAD",
    "Runtime",
    "default_backend",
    "Work",
    "init",
    "allreduce",
    "allreduce_async",
    "allgather",
    "allgather_async",
    "all_gather_into_tensor",
    "all_gather_into_tensor_async",
    "get_runtime",
    "is_initialized",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_async",
    "shutdown",
]

@dataclass
class Work:
    """A queued collective. ``wait()`` returns its tensors or raises the error the collective hit.

    ``finish``: applied to the collective's result by the first ``wait()``, on the waiting thread (later waits return
    what it returned), for a caller that waits itself: a callback chained on ``future`` instead runs on the backend's
    thread, which must take the GIL from the caller first. ``future`` is the collective's own (without ``finish``).
    """

    future: torch.futures.Future
    name: str = ""
    finish: Callable[[Any], Any] | None = None
    _finished: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)  # finish's result, once run

    def wait(self) -> Any:
        value = self.future.wait()
        if self.finish is None:
            return value
        if not self._finished:
            self._finished.append(self.finish(value))
        return self._finished[0]

    def done(self) -> bool:
        return self.future.done()


#: The name of each live runtime's communication thread (what a debugger's or a test's thread list shows).
COMM_THREAD = "gradsync-comm"
#: :meth:`Runtime._native_issue`'s executor for ``native_allreduce_async(always=True)``: whatever the size's plan.
NATIVE_ANY = object()
#: The watch's agreement round on gloo (:meth:`Runtime._share_sum`): a tree reduces and broadcasts in two latency
#: steps per level where gloo's ring takes ``2 (n - 1)``.
AGREE_ALGORITHM = "tree"


def _label(ex: Any) -> str:
    """The profiler range of an allreduce on ``ex``: ``gradsync::allreduce::<algorithm>``."""
    return f"gradsync::allreduce::{ex.schedule.algorithm}"


_STOP = object()
_CALL = object()  # marks a queued callable (``Runtime.submit``) among queued allreduces
#: How long a failed rank waits for its peers' ledgers: they fail within about the same timeout, or posted at shutdown.
LEDGER_WAIT_S = 5.0


class Runtime:
    """Transport + topology + planned schedules + one communication thread. Build with :func:`init`."""

    def __init__(
        self,
        transport: Transport,
        topology: Topology | str | None = None,
        algorithm: str = "auto",
        *,
        options: PlanOptions | None = None,
        mapping: Sequence[int] | Mapping[str, int] | None = None,
        timeout_s: float = 60.0,
        cost_model: CostModel | None = None,
        trace: str | os.PathLike[str] | None = None,
        adapt: bool | AdaptOptions | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.transport = transport
        if topology is None:
            topology = os.environ.get("GRADSYNC_TOPOLOGY") or f"switch:{transport.world_size}"
        #: the watch that replans when the wire leaves the model (:mod:`gradsync.comm.adapt`); None: off
        #: (``adapt=False`` or ``GRADSYNC_ADAPT=0``)
        self.adapt: Adapter | None = None
        self._topology = topology if isinstance(topology, Topology) else get_topology(str(topology))
        if self._topology.world_size != transport.world_size:
            raise GradsyncError(
                f"topology {self._topology.name!r} has {self._topology.world_size} ranks but the job has "
                f"world_size={transport.world_size}; pass a topology with {transport.world_size} ranks "
                f"(e.g. 'switch:{transport.world_size}') or select ranks like 'p3.16xlarge[0,1,2,3]'"
            )
        self.algorithm = algorithm
        self.options = options or PlanOptions()
        self.mapping = mapping
        self.timeout_s = timeout_s
        #: what the transport offers beyond point to point (read once: the runtime never probes it)
        self.caps = transport.capabilities
        #: choices and executors for every collective (:mod:`gradsync.comm.plans`)
        self.plans = PlanCache(transport, self._topology, options=self.options, mapping=mapping, timeout_s=timeout_s,
                               cost_model=cost_model or CostModel())
        #: calibration, tuning and exploring for ``auto`` (:mod:`gradsync.comm.tuning`)
        self.tuning = Tuning(self.plans, self.submit)
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # collectives queued or running; 0 lets a blocking call run on the caller's thread
        self._mutex = threading.Lock()  # guards _pending
        self._running = threading.Lock()  # held while a collective runs: one at a time, in call order
        self._failed: BaseException | None = None
        self.comm_seconds = 0.0  # time the communication thread spent running collectives
        trace = trace if trace is not None else os.environ.get("GRADSYNC_TRACE") or None
        #: the Chrome trace of this rank's collectives (``trace=`` or ``$GRADSYNC_TRACE``), written at shutdown
        self.trace: TraceRecorder | None = (
            TraceRecorder(trace, transport.rank, transport.world_size) if trace is not None else None
        )
        #: what this rank asked for, compared with the other ranks' only when a collective fails
        self.ledger = Ledger()
        adapt_options = adapt_from_env(adapt)
        if adapt_options is not None and transport.world_size > 1:
            self.adapt = Adapter(self.plans, self.tuning, adapt_options, share=self._share_sum,
                                 build=lambda nbytes: self.executor(None, nbytes), label=self._plan_label, clock=clock,
                                 auto=algorithm == AUTO)
        # one live runtime a transport; the ones after the first decide under keys of their own (gradsync.comm.claims)
        served = claims.claim(transport, self)
        self.plans.namespace = f"r{served}/" if served else ""
        self._thread = threading.Thread(target=self._loop, name=COMM_THREAD, daemon=True)
        self._thread.start()
        try:
            self.prepare(algorithm)
        except BaseException:
            self._queue.put(_STOP)  # a runtime that failed to start leaves no thread behind, and frees its transport
            self._thread.join(self.timeout_s)
            claims.release(transport, self)
            raise

    @property
    def topology(self) -> Topology:
        """The job's topology as it is now: the one it started on, less the links the watch dropped (by
        :meth:`drop_link`, or for a NIC without carrier)."""
        return self.adapt.base_topology if self.adapt is not None else self._topology

    # ---- planning (the plan cache and tuning do the work) ----------------------------------------------------
    @functools.cached_property
    def device(self) -> torch.device:
        """Where the backend's collectives take their tensors (others are staged there); read once."""
        return self.caps.collective_device()

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def cost_model(self) -> CostModel:
        return self.plans.cost_model

    @property
    def chooser(self) -> Chooser:
        """``auto``'s chooser for allreduce (:meth:`PlanCache.chooser <gradsync.comm.plans.PlanCache.chooser>`)."""
        return self.plans.chooser()

    @property
    def tuned(self) -> dict[int, dict[str, Any]]:
        """Measurements per size class (:attr:`Tuning.tuned <gradsync.comm.tuning.Tuning.tuned>`)."""
        return self.tuning.tuned

    @property
    def explore(self) -> bool:
        """Whether ``auto`` times pipeline depths on each large class's first calls (``init(calibrate=True)``
        turns it on, as does ``init(explore=True)``; :class:`~gradsync.comm.tuning.Explorer`)."""
        return self.tuning.explore

    @explore.setter
    def explore(self, value: bool) -> None:
        self.tuning.explore = bool(value)

    @property
    def tuned_cache(self) -> tuple[str, int] | None:
        """Where rank 0 keeps :attr:`tuned`, with the cost-model generation it is keyed by."""
        return self.tuning.tuned_cache

    @tuned_cache.setter
    def tuned_cache(self, value: tuple[str, int] | None) -> None:
        self.tuning.tuned_cache = value

    def executor(self, algorithm: str | None = None, nbytes: float | None = None, *,
                 explore: bool = True) -> Runnable | Explorer:
        """The executor for ``algorithm`` (default: the runtime's), planned once and cached.

        ``auto`` chooses per size class of ``nbytes`` (default ``options.size_bytes``) with :attr:`chooser`
        (while :attr:`explore` times a large class's depths, the class's :class:`~gradsync.comm.tuning.Explorer`,
        which runs like an executor); a named algorithm runs at ``options.pipeline``. Every schedule comes from
        the plan cache (one planning path, self-checked before it runs) and waits for its messages in the cost
        model's predicted arrival order (:meth:`~gradsync.sim.cost.CostModel.wait_order`). ``explore=False``: the
        size's pick as it stands, not an explorer timing its neighbours.
        """
        name = algorithm or self.algorithm
        size = size_class(self.options.size_bytes if nbytes is None else nbytes)
        if name == AUTO:
            pick = self.plans.choice(size)
            explorer = self.tuning.explorer(size, pick) if explore else None
            if explorer is not None:
                return explorer
            name, pipeline = pick
        else:
            pipeline = self.options.pipeline
        return self.plans.executor(name, pipeline, size)

    def prepare(self, algorithm: str | None = None) -> None:
        """Plan ``algorithm`` (default: the runtime's) now, so that a bad one fails here and not in the first backward:
        a named algorithm's schedule and executor; ``auto``'s candidates, each size class priced only at its first
        call. Pricing the default class (``options.size_bytes``) here cost rank 0 every candidate's simulation of a
        size the job may never send, while every rank waited (docs/runtime.md)."""
        if (algorithm or self.algorithm) == AUTO:
            self.plans.chooser()  # a topology nothing plans fails here
        else:
            self.executor(algorithm)

    def runs_natively(self, nbytes: float, algorithm: str | None = None) -> bool:
        """Whether an allreduce of ``nbytes`` runs on the backend's own collective now (no planned schedule)."""
        return isinstance(self.executor(algorithm, nbytes), NativeAllreduce)

    def picks_native(self, nbytes: float) -> bool:
        """Whether the size's pick is the backend's own collective (the runtime's named algorithm, or ``auto``'s
        choice by the model or a measurement), even while an explorer times a plan against it (:meth:`runs_natively`
        is False then): a caller that times another way against the backend's in a few launches (``compression="auto"``'s
        trials) reads it to skip the near-tie a class's exploration settles over a few dozen."""
        if self.algorithm != AUTO:
            return self.algorithm == NATIVE
        return self.plans.choice(size_class(nbytes))[0] == NATIVE

    def anticipate(self, sizes: Sequence[float], *, first: bool = False) -> None:
        """Allreduce sizes (bytes) this job will send later, soonest first (``first``: before sizes anticipated earlier,
        about to be sent): ``auto`` prices their classes ahead in a child process, so that their first calls need not
        wait for rank 0's simulations (:meth:`PlanCache.anticipate <gradsync.comm.plans.PlanCache.anticipate>`).
        Nothing for a named algorithm, or with ``GRADSYNC_PRICE_AHEAD=0``; a rank that does not price for the job
        returns at once."""
        todo = [float(n) for n in sizes]
        if any(not (n > 0) for n in todo):
            raise GradsyncError(f"sizes={list(sizes)!r} must be positive byte counts")
        if price_ahead() and self.algorithm == AUTO:
            self.plans.anticipate(todo, first=first, orders_from=self._orders_from)

    def start_pricing(self) -> bool:
        """Start ``auto``'s child pricing ahead now (:meth:`PlanCache.start_ahead
        <gradsync.comm.plans.PlanCache.start_ahead>`), before any size is anticipated: :func:`init` does, once the
        cost model is calibrated and exploring is set, so that the child has started by the time a model's optimizer
        or hook asks for its sizes. Whether a child runs: not for a named algorithm, with ``GRADSYNC_PRICE_AHEAD=0``,
        or on a rank or fabric where pricing ahead does not pay."""
        return price_ahead() and self.algorithm == AUTO and self.plans.start_ahead(orders_from=self._orders_from)

    @property
    def _orders_from(self) -> int | None:
        """Where this runtime explores, the child pricing ahead also orders the neighbours its explorers will time,
        from the smallest class explored."""
        return EXPLORE_MIN_BYTES if self.tuning.explore else None

    def choice(self, nbytes: float) -> tuple[str, int]:
        """The (algorithm, pipeline) ``auto`` runs for ``nbytes`` now: the model's, or what :meth:`tune` or
        the first calls' measurements (:attr:`explore`) replaced it with."""
        return self.plans.choice(size_class(nbytes))

    @property
    def settling(self) -> int:
        """A count that grows whenever a collective settles something before or while it runs (a size class's
        choice priced, a plan built, an exploring call): a timing across which it grew measured more than the
        exchange the job runs from then on (:attr:`PlanCache.settling <gradsync.comm.plans.PlanCache.settling>`)."""
        return self.plans.settling

    def exploring(self) -> bool:
        """Whether some size class's first calls are timing pipeline depths (:meth:`Tuning.exploring
        <gradsync.comm.tuning.Tuning.exploring>`): a benchmark warms up until this is False."""
        return self.tuning.exploring()

    def drop_link(self, u: str | int, v: str | int) -> None:
        """Stop using the link between devices ``u`` and ``v`` (names, or rank indices): the job replans on the
        surviving graph, in order with the queued collectives. Every rank calls it at the same point (a
        collective boundary), like :meth:`set_cost_model`. Where no path joins every rank without the link,
        :class:`~gradsync.errors.PeerError` names it (and the runtime fails, as on a lost peer)."""
        if self.adapt is None:
            raise GradsyncError("drop_link replans through the runtime's watch, which is off (adapt=False or "
                                "GRADSYNC_ADAPT=0); start the runtime with adapt=True")
        adapt = self.adapt
        size = self.options.size_bytes

        def drop() -> None:
            try:
                adapt.drop_link(u, v, size)
            except PeerError as exc:
                self._failed = exc
                raise

        self.submit(drop, "drop_link").wait()

    def _plan_label(self, nbytes: float) -> str:
        """``algorithm/pipeline`` of what an allreduce of ``nbytes`` runs now (the log line of a replan)."""
        if self.algorithm == AUTO:
            name, pipeline = self.choice(nbytes)
        else:
            name, pipeline = self.algorithm, self.options.pipeline
        return f"{name}/{pipeline}"

    def _share_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks now (the watch's agreement round: a few hundred float64s, each entry with one
        writer, so the sum is exact in any order). On gloo, on a :data:`AGREE_ALGORITHM` plan: gloo's allreduce is a
        ring, ``2 (n - 1)`` latency steps, and its wait after the slowest rank was most of what watching an
        allreduce cost (docs/runtime.md); a planned ring's tiny messages cost more still. Elsewhere on the backend's
        own allreduce where the transport has one, else on the plan for its size."""
        caps = self.plans.caps
        ex: Any = None
        if caps.backend == "gloo":
            try:
                ex = self.executor(AGREE_ALGORITHM, tensor.numel() * tensor.element_size())
            except GradsyncError:  # no tree on this topology: the backend's own
                ex = None
        if ex is None:
            ex = self._executor_for(tensor, "sum", NATIVE if caps.native else None)
        ex.run(tensor, "sum")

    def set_cost_model(self, model: CostModel) -> None:
        """Price with ``model`` from now on: plans and choices made with the old one are dropped."""
        self.tuning.set_cost_model(model)

    def calibrate(self, reps: int = 5, size_bytes: int = 4096) -> CostModel:
        """Measure the per-message costs on this job's wire and price with them (returns the new model;
        :meth:`Tuning.calibrate <gradsync.comm.tuning.Tuning.calibrate>`)."""
        return self.tuning.calibrate(reps, size_bytes)

    def tune(self, max_bytes: int = TUNE_MAX_BYTES, reps: int = 3) -> dict[int, dict[str, Any]]:
        """Choose ``auto``'s plan for every size class up to ``max_bytes`` by measuring, not only pricing
        (:meth:`Tuning.tune <gradsync.comm.tuning.Tuning.tune>`); a runtime that is not ``auto`` has nothing
        to tune."""
        return self.tuning.tune(max_bytes, reps, auto=self.algorithm == AUTO)

    def use_tuned(self, doc: Any) -> None:
        """Adopt :meth:`tune`'s cached choices (:meth:`Tuning.use_tuned <gradsync.comm.tuning.Tuning.use_tuned>`)."""
        self.tuning.use_tuned(doc)

    def schedule(self, algorithm: str | None = None, nbytes: float | None = None) -> Schedule:
        return self.executor(algorithm, nbytes).schedule

    def sharded_executor(self, collective: str, algorithm: str | None = None, nbytes: float | None = None) -> Executor:
        """The executor of a ``reduce_scatter`` or ``allgather`` schedule, planned once per (algorithm, depth).

        ``auto`` picks per size class of ``nbytes`` (the full buffer) among the algorithms that plan the
        collective, priced with the runtime's cost model; the backend's native collective is not a candidate.
        """
        if collective not in SHARDED:
            raise GradsyncError(f"collective {collective!r} is not one of {SHARDED}; allreduce runs on Runtime.executor")
        name = algorithm or self.algorithm
        size = size_class(self.options.size_bytes if nbytes is None else nbytes)
        if name == AUTO:
            name, pipeline = self.plans.choice(size, collective)
        else:
            self.plans.chooser(collective)  # refuses a collective no algorithm plans here
            pipeline = self.options.pipeline
        return self.plans.executor(name, pipeline, size, collective)  # type: ignore[return-value]

    # ---- collectives ---------------------------------------------------------------------------------------
    def allreduce_async(self, tensors: Tensors, op: str = "sum", algorithm: str | None = None, *,
                        explore: bool = True) -> Work:
        """Queue an in-place allreduce of ``tensors`` (one tensor collective); returns at once. ``explore=False``:
        on the size's pick as it stands (the model's, or a measured one), not on the explorer that may be timing its
        pipeline depths, for a caller that times this exchange against another way in a few calls (they would
        time the exploration instead)."""
        ex = self._executor_for(tensors, op, algorithm, explore)
        return Work(self._enqueue(ex, tensors, op, _label(ex), algorithm, explore), ex.schedule.algorithm)

    def allreduce(self, tensors: Tensors, op: str = "sum", algorithm: str | None = None) -> Tensors:
        """All-reduce in place and return ``tensors``; raises :class:`~gradsync.errors.PeerError` on a lost peer.

        Where this size runs on the backend's own collective, one tensor goes straight to it on the user's
        group, as :meth:`native_allreduce_async` sends it: no handoff to the communication thread and no switch
        between gloo groups, which at small sizes cost a visible share of the collective (docs/benchmarks.md,
        "vs-native"). It then does not wait for collectives queued before it (they run on gradsync's own group):
        as with ``torch.distributed``'s async ops, a tensor still in flight must be waited for before it is
        reused. Otherwise, when nothing is queued or running, the collective runs on the caller's thread: the
        same order (anything queued meanwhile waits for it), without two thread handoffs per call.
        """
        ex = self._executor_for(tensors, op, algorithm)
        if (isinstance(ex, NativeAllreduce) and isinstance(tensors, torch.Tensor) and not self._watches(ex, tensors)
                and (op == "sum" or tensors.is_floating_point() or tensors.is_complex())):
            t0, start = time.perf_counter(), TraceRecorder.now_us()
            work = self._native_issue(tensors, ex)
            if work is not None:
                try:
                    work.wait()  # the work itself, not its future: one wake-up fewer
                except RuntimeError as exc:
                    self._failed = self._named(native_failure(exc))
                    raise self._failed from exc
                finally:
                    self.comm_seconds += time.perf_counter() - t0
                self._trace_native(tensors, start, threading.current_thread())
                if op == "avg":
                    tensors.div_(self.world_size)
                return tensors
        with self._mutex:
            inline = self._pending == 0 and self._failed is None and not self.on_comm_thread()
            if inline:
                self._pending += 1
        if not inline:
            return self._enqueue(ex, tensors, op, _label(ex), algorithm).wait()
        try:
            with self._running:
                return self._run(ex, tensors, op, _label(ex), algorithm)
        finally:
            with self._mutex:
                self._pending -= 1

    def native_allreduce_async(self, tensor: torch.Tensor, algorithm: str | None = None, *,
                               always: bool = False) -> torch.futures.Future | None:
        """Sum one contiguous ``tensor`` over ranks in place with the backend's own async ``all_reduce`` on the
        user's process group (``capabilities.user_group``), issued on the caller's thread, when this runtime runs
        that size natively (``always``: whatever the size's plan, as a caller that measured both ways decides);
        otherwise None (queue it with :meth:`allreduce_async` instead). None too where the backend cannot take
        it here: no process group, a tensor on another device, a failed runtime, the communication thread.

        The future is the process group's (result: ``[tensor]``): no hand-off to the communication thread
        and back, which costs a DDP hook more than its whole allreduce on a fast link. It is what ``torch``'s
        own hooks do: on the caller's thread, in program order, the user's group. Alternating with gradsync's
        dedicated group within a step costs a gloo context switch each time (measured: ``gradsync bench hooks``).

        Whether it runs here depends only on the size's plan, which every rank shares, never on whether this
        rank's queue is busy: the queued collectives run on the dedicated group, in queue order, so the two
        groups each see the same sequence on every rank. (A choice that depended on timing would send one rank's
        collective to one group and its peer's to the other: a mismatch.)
        """
        ex = NATIVE_ANY if always else self.executor(algorithm, tensor.numel() * tensor.element_size())
        if self._watches(ex, tensor):
            return None
        work = self._native_issue(tensor, ex)
        if work is None:
            return None
        fut = work.get_future()
        if self.trace is not None:  # issued on the caller's thread, done when the backend finishes it
            start, caller = TraceRecorder.now_us(), threading.current_thread()
            fut.add_done_callback(lambda _: self._trace_native(tensor, start, caller))
        return fut

    def takes_native(self, device: torch.device) -> bool:
        """Whether :meth:`native_allreduce_async` with ``always=True`` issues a contiguous tensor on ``device`` here and
        now (a caller that prepares the tensor for the backend's sum alone asks first)."""
        return bool(self.caps.native) and device == self.device and self._failed is None and not self.on_comm_thread()

    def _watches(self, ex: Any, tensors: Tensors) -> bool:
        """Whether the watch counts an allreduce of ``tensors`` on ``ex`` (:meth:`Adapter.qualifies
        <gradsync.comm.adapt.Adapter.qualifies>`, by size alone): such a call takes the queued path, where the
        watch sees every one in the same order on every rank, not the native fast path beside it."""
        return self.adapt is not None and self.adapt.qualifies(ex, nbytes_of(tensors))

    def _native_issue(self, tensor: torch.Tensor, ex: Any) -> Any:
        """The process group's work of ``tensor``'s native allreduce, issued here, or None where ``ex`` (the size's
        executor) is not native or the tensor cannot go (another device than the backend's is staged on the
        queued path)."""
        if (not (isinstance(ex, NativeAllreduce) or ex is NATIVE_ANY) or not tensor.is_contiguous()
                or not self.takes_native(tensor.device)):
            return None
        self._record("allreduce", tensor)
        try:
            with profiled("gradsync::allreduce::native"):
                return dist.all_reduce(tensor, group=self.caps.native_group, async_op=True)
        except RuntimeError as exc:
            raise self._named(native_failure(exc)) from exc

    def _trace_native(self, tensor: torch.Tensor, start_us: float, caller: threading.Thread) -> None:
        if self.trace is not None:
            self.trace.record("gradsync::allreduce::native", "allreduce", "native",
                              tensor.numel() * tensor.element_size(), start_us, TraceRecorder.now_us(), caller)

    def _executor_for(self, tensors: Tensors, op: str, algorithm: str | None,
                      explore: bool = True) -> Runnable | Explorer:
        """The executor an allreduce of ``tensors`` runs on, after checking ``op``."""
        if op not in OPS:
            raise GradsyncError(f"op={op!r} is not one of {OPS}")
        return self.executor(algorithm, nbytes_of(tensors), explore=explore)

    def _enqueue(self, ex: Any, payload: Any, op: str | None, label: str,
                 algorithm: str | None = None, explore: bool = True) -> torch.futures.Future:
        """Queue one item for the communication thread; its future, failed at once if the runtime has. ``algorithm``
        and ``explore`` are how ``ex`` was resolved, for a collective whose executor is dropped before it runs."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._failed is not None:
            fut.set_exception(CommError(f"the gradsync runtime failed earlier and cannot run more collectives: {self._failed}"))
            return fut
        with self._mutex:
            self._pending += 1
        self._queue.put((ex, payload, op, label, fut, algorithm, explore))
        return fut

    def _run(self, ex: Any, payload: Any, op: str | None, label: str, algorithm: str | None = None,
             explore: bool = True) -> Any:
        """Run one item (a collective or a submitted callable) now, as the profiler range ``label``; a failure fails
        the runtime. A collective whose executor a replan dropped since it was queued runs on the current plan,
        resolved as it was (``algorithm``, ``explore``): a call that asked for the size's pick as it stands is not
        handed to an explorer."""
        t0 = time.perf_counter()
        start = TraceRecorder.now_us() if self.trace is not None else 0.0
        try:
            with profiled(label):
                if ex is _CALL:
                    return payload()
                if not isinstance(ex, Explorer) and not self.plans.owns(ex):
                    ex = self._executor_for(payload, op or "sum", algorithm, explore)
                self._record("allreduce", payload)
                adapt = self.adapt
                nbytes = nbytes_of(payload) if adapt is not None else 0
                watched = adapt is not None and adapt.watch(ex, nbytes)
                out = ex.run(payload, op)
                if watched:
                    adapt.after(ex, nbytes)  # type: ignore[union-attr]
                return out
        except BaseException as exc:
            named = self._named(exc)
            self._failed = named
            if named is not exc:
                raise named from exc
            raise
        finally:
            self.comm_seconds += time.perf_counter() - t0
            if self.trace is not None:
                if ex is _CALL:
                    self.trace.record(label, label.removeprefix("gradsync::"), None, None, start, TraceRecorder.now_us())
                else:
                    self.trace.record(label, "allreduce", ex.schedule.algorithm, nbytes_of(payload), start,
                                      TraceRecorder.now_us())

    # ---- additions for compression (issue 8): arbitrary work and allgather, in the same FIFO ----------
    def submit(self, fn: Callable[[], Any], name: str = "call") -> Work:
        """Queue ``fn()`` on the communication thread, in call order with every queued collective.

        ``fn`` may run several collectives back to back with :meth:`run_allreduce` and :meth:`run_allgather`
        (PowerSGD's two rounds, a compressed group's exchange and decode): nothing another caller queues can
        slip between them, so ranks that submit in the same order stay matched. Its return value is the
        future's result; an exception fails this work and, like a failed collective, the runtime.
        """
        if not callable(fn):
            raise GradsyncError(f"fn={fn!r} must be callable (it runs on the communication thread)")
        return Work(self._enqueue(_CALL, fn, None, f"gradsync::{name}"), name)

    def on_comm_thread(self) -> bool:
        """Whether the caller is this runtime's communication thread (where ``run_*`` may be called)."""
        return threading.current_thread() is self._thread

    def run_allreduce(self, tensors: Tensors, op: str = "sum", algorithm: str | None = None) -> Tensors:
        """All-reduce now, on the communication thread (inside :meth:`submit`); elsewhere use :meth:`allreduce`."""
        self._check_comm_thread("run_allreduce", "allreduce")
        ex = self._executor_for(tensors, op, algorithm)
        self._record("allreduce", tensors)
        return ex.run(tensors, op)

    def run_allgather(self, tensor: torch.Tensor, *, equal_sizes: bool = False) -> list[torch.Tensor]:
        """Every rank's 1-D ``tensor`` (sizes may differ between ranks), in rank order; comm thread only.

        gloo's ``all_gather`` needs equal sizes, so the sizes travel first and every tensor is padded to the
        largest, then trimmed. On a transport without a torch process group (MPI, in-process) the same two
        rounds go point to point. ``equal_sizes``: the caller knows every rank passes as many elements as
        this one (a payload whose size follows from the tensor's shape alone), so the sizes round is skipped --
        one collective instead of two, which counts when ranks share cores and each round waits for all of them.
        """
        self._check_comm_thread("run_allgather", "allgather")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            raise GradsyncError(f"allgather takes a 1-D tensor, got {getattr(tensor, 'shape', type(tensor).__name__)}; flatten it first")
        tensor = tensor.contiguous()
        self._record("allgather", tensor, sized=equal_sizes)
        if self.caps.native:
            return gather_torch(tensor, self.caps.group, self.world_size, equal_sizes, self.device)
        return gather_p2p(tensor, self.transport, self.timeout_s, equal_sizes)

    def allgather_async(self, tensor: torch.Tensor) -> Work:
        """Queue :meth:`run_allgather` of ``tensor``; the future holds the list of every rank's tensor."""
        return self.submit(lambda: self.run_allgather(tensor), "allgather")

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D ``tensor``, in rank order (sizes may differ); runs in order with queued collectives."""
        return self.allgather_async(tensor).wait()

    # ---- reduce-scatter and allgather on planned schedules (torch.distributed's tensor forms) ----------------
    def reduce_scatter_tensor_async(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                                    algorithm: str | None = None) -> Work:
        """Queue ``output = (sum over ranks of input)[rank's shard]``, as ``torch.distributed.reduce_scatter_tensor``:
        ``input`` has ``world_size * output.numel()`` elements, process rank ``p`` gets the ``p``-th equal slice;
        ``input`` is left unchanged. ``op``: ``sum`` or ``avg``."""
        if op not in OPS:
            raise GradsyncError(f"op={op!r} is not one of {OPS}")
        check_sharded("reduce_scatter_tensor", output, input, self.world_size, big="input")
        ex = self.sharded_executor("reduce_scatter", algorithm, nbytes_of(input))
        return self.submit(lambda: self._sharded("reduce_scatter", ex, output, input, op), "reduce_scatter")

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                              algorithm: str | None = None) -> torch.Tensor:
        """:meth:`reduce_scatter_tensor_async`, waited for; returns ``output``."""
        return self.reduce_scatter_tensor_async(output, input, op, algorithm).wait()

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> torch.Tensor:
        """This rank's equal shard of the sum of ``tensor`` over ranks, as a new 1-D tensor (``tensor`` unchanged)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"reduce_scatter takes a torch.Tensor, got {type(tensor).__name__}")
        n = tensor.numel()
        if n % self.world_size:
            raise GradsyncError(f"reduce_scatter needs a numel divisible by world_size={self.world_size}, got {n}; "
                                f"pad the tensor to {-(-n // self.world_size) * self.world_size} elements")
        out = tensor.new_empty(n // self.world_size)
        return self.reduce_scatter_tensor(out, tensor.contiguous(), op, algorithm)

    def all_gather_into_tensor_async(self, output: torch.Tensor, input: torch.Tensor,
                                     algorithm: str | None = None) -> Work:
        """Queue ``output[p-th slice] = input of process p`` for every ``p``, as
        ``torch.distributed.all_gather_into_tensor`` (``output`` has ``world_size * input.numel()`` elements)."""
        check_sharded("all_gather_into_tensor", input, output, self.world_size, big="output")
        ex = self.sharded_executor("allgather", algorithm, nbytes_of(output))
        return self.submit(lambda: self._sharded("all_gather_into_tensor", ex, input, output, None), "allgather")

    def _sharded(self, kind: str, ex: Executor, shard: torch.Tensor, full: torch.Tensor, op: str | None) -> torch.Tensor:
        self._record(kind, full)
        return run_sharded(ex, shard, full, op)

    def _record(self, kind: str, tensors: Tensors, *, sized: bool = True) -> None:
        """Count the call; a (kind, size, dtype) new to this rank goes on the board before it runs (gloo aborts a
        rank that receives more than it expects, and its peers then read its signatures there)."""
        if self.ledger.record(kind, tensors, sized=sized):
            self.caps.failures.share(self.rank, self.ledger.encode("running"))

    # ---- naming what differs when a collective fails -----------------------------------------------------------
    def _named(self, exc: BaseException) -> BaseException:
        """``exc`` with what differs between the ranks' calls in front (:mod:`gradsync.comm.ledger`), when it is a
        failed collective and the peers' ledgers say; otherwise ``exc`` itself.

        Runs only on the failure path: this rank posts its ledger to the transport's board and reads the others'
        for up to :data:`LEDGER_WAIT_S` (peers stuck in the same mismatch fail within about the same timeout;
        a rank that made fewer calls posted at shutdown)."""
        if not isinstance(exc, RuntimeError) or getattr(exc, "gradsync_named", False):
            return exc
        board = self.caps.failures
        mine = self.ledger.encode("failed")
        board.share(self.rank, mine)
        deadline = time.monotonic() + min(LEDGER_WAIT_S, self.timeout_s)
        peers = board.shared()
        while len(peers) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            peers = board.shared()
        peers.pop(self.rank, None)
        what = describe_mismatch(self.rank, mine, peers, self.world_size)
        if what is None:
            return exc
        message = f"{what} (seen by rank {self.rank}): {exc}"
        named: CommError = PeerError(message, exc.peer) if isinstance(exc, PeerError) else CommError(message)
        named.gradsync_named = True  # type: ignore[attr-defined]
        return named

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor,
                               algorithm: str | None = None) -> torch.Tensor:
        """:meth:`all_gather_into_tensor_async`, waited for; returns ``output``."""
        return self.all_gather_into_tensor_async(output, input, algorithm).wait()

    def _check_comm_thread(self, what: str, instead: str) -> None:
        if not self.on_comm_thread():
            raise GradsyncError(
                f"Runtime.{what} runs a collective immediately and must be called on the communication thread "
                f"(inside Runtime.submit); from other threads call Runtime.{instead} or {instead}_async"
            )

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            ex, payload, op, label, fut, algorithm, explore = item
            try:
                with self._running:
                    if self._failed is not None:
                        raise CommError(f"the gradsync runtime failed earlier: {self._failed}")
                    result = self._run(ex, payload, op, label, algorithm, explore)
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits
                fut.set_exception(exc)
                continue
            finally:
                with self._mutex:
                    self._pending -= 1
            fut.set_result(result)

    def shutdown(self) -> None:
        """Stop the communication thread once queued work is done. Does not destroy the process group."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(self.timeout_s)
            if self._failed is None:  # a peer still inside a collective can then name what this rank did
                self.caps.failures.share(self.rank, self.ledger.encode("finished"))
        self.plans.close()
        if not self._thread.is_alive():  # a thread still inside a collective keeps its transport
            claims.release(self.transport, self)
        if self.trace is not None:
            self.trace.write()


_RUNTIME: Runtime | None = None


def _init_process_group(backend: str | None, timeout_s: float) -> None:
    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise GradsyncError(
            f"environment variables {missing} are not set; launch with torchrun (or `gradsync run`), "
            f"or call torch.distributed.init_process_group() yourself and pass group=..."
        )
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    gpus = torch.cuda.device_count() if cuda else 0
    if backend is None:  # the processes on this host decide; a named backend needs no count of them
        local_ranks = _env_int("LOCAL_WORLD_SIZE", _env_int("WORLD_SIZE", 1))
        backend = default_backend(gpus, local_ranks)
        if backend == "gloo" and gpus:
            warnings.warn(f"gradsync: {local_ranks} processes on this host share {gpus} GPU(s), and NCCL needs a GPU "
                          "of its own for each, so torch.distributed runs on gloo; start one process per GPU for NCCL",
                          RuntimeWarning, stacklevel=3)
    if backend == "nccl" and not cuda:
        why = "no CUDA device is visible" if torch.backends.cuda.is_built() else "this torch is built without CUDA"
        raise GradsyncError(f"backend='nccl' needs CUDA GPUs and NCCL, but {why}; use backend='gloo' on CPUs")
    if backend == "nccl":
        local_rank = _env_int("LOCAL_RANK", 0)
        if local_rank >= gpus:
            raise GradsyncError(f"backend='nccl' puts LOCAL_RANK={local_rank} on GPU {local_rank}, but this host shows "
                                f"{gpus} GPU(s); start at most {gpus} process(es) per host (torchrun --nproc-per-node "
                                f"{gpus}), or use backend='gloo'")
        torch.cuda.set_device(local_rank)
    lifetime.init_process_group(backend, timeout_s)  # ours, so destroyed cleanly at exit


def _env_int(name: str, default: int) -> int:
    """A launcher's count from the environment (``default`` where unset); a value that is not one says which."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise GradsyncError(f"{name}={raw!r} must be an integer (torchrun and `gradsync run` set it); "
                            f"unset it or give the count") from None


def default_backend(gpus: int, local_ranks: int) -> str:
    """The backend ``gradsync.init`` starts when none is named: NCCL where every process on this host has a GPU of
    its own (NCCL refuses two ranks on one GPU), else gloo. Hosts alike in GPUs and processes per host (what
    torchrun starts) give every rank the same answer."""
    return "nccl" if 0 < local_ranks <= gpus else "gloo"


def init(
    topology: Topology | str | None = None,
    algorithm: str = "auto",
    *,
    transport: str = "torch",
    backend: str | None = None,
    group: Any = None,
    mapping: Sequence[int] | Mapping[str, int] | None = None,
    options: PlanOptions | None = None,
    timeout_s: float = 60.0,
    cost_model: CostModel | str | None = None,
    calibrate: bool | None = None,
    explore: bool | None = None,
    trace: str | os.PathLike[str] | None = None,
    adapt: bool | AdaptOptions | None = None,
) -> Runtime:
    """Start gradsync in this process and return the runtime (also kept as the default).

    ``transport="torch"`` initialises ``torch.distributed`` from the torchrun variables (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) unless it already is, and uses ``group`` (default: the world); ``backend``
    defaults to NCCL where each process on the host has a GPU of its own, else gloo (:func:`default_backend`).
    ``transport="mpi"`` uses ``mpi4py``'s COMM_WORLD. ``topology`` defaults to ``$GRADSYNC_TOPOLOGY`` or
    ``switch:<world_size>``; ``mapping`` places topology ranks on process ranks (default: in order).
    ``cost_model`` (a :class:`~gradsync.sim.cost.CostModel`, a JSON file, or ``$GRADSYNC_COST_MODEL``)
    prices schedules for ``algorithm="auto"``, which chooses per message size (native collective
    included); without one, the topology's own rates and default message costs are used, checked on the wire
    where that matters (below). ``calibrate=True`` measures the message costs, the wire's two-way loss, its
    burst (a shaper's token bucket) and the slowest path's rate (:meth:`Runtime.calibrate`, seconds) once per topology and model: the result is
    cached as JSON in ``$GRADSYNC_CACHE`` (default ``~/.cache/gradsync``); then ``auto`` times its candidates
    for the small size classes (:meth:`Runtime.tune`), cached the same way. The default (``None``) runs the
    quick calibration (the same with fewer repetitions, no small-class timing),
    cached the same way, only where the pick turns on them: ``auto`` on a topology where some plan beats the
    backend's ring in bandwidth (:meth:`Tuning.calibration_pays <gradsync.comm.tuning.Tuning.calibration_pays>`),
    with no ``cost_model`` given; a file whose rates are nominal (4 GB/s written, 60 Mbit/s on the wire) is
    then priced at the wire's. ``False`` measures nothing. After a calibration the first calls of each larger
    class time the model's pipeline depth beside its half and its double (:attr:`Runtime.explore`;
    ``explore`` turns that on or off, default: on where a calibration ran); each such pick joins the same
    cache, so the next job runs it from its first call. ``trace`` (default
    ``$GRADSYNC_TRACE``): a ``.json`` path where each rank writes a Chrome trace-event file of its collectives at
    shutdown (``name.rank<r>.json`` with several ranks, or put ``{rank}`` in the path; :mod:`gradsync.comm.trace`).
    ``adapt`` (default ``$GRADSYNC_ADAPT``, off): watch large allreduces' pair rates and replan, job-wide, when a
    link stays slower than the model for a few collectives, and back when it recovers (:mod:`gradsync.comm.adapt`;
    an :class:`~gradsync.comm.adapt.AdaptOptions` sets its thresholds, ``False`` turns it off).
    """
    global _RUNTIME
    if not timeout_s > 0:
        raise GradsyncError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    if transport in ("torch", "gloo", "nccl"):
        _init_process_group(backend or (transport if transport != "torch" else None), timeout_s)
        tr = create_transport("torch", group=group, timeout_s=timeout_s)
    else:
        tr = create_transport(transport, timeout_s=timeout_s)
    if _RUNTIME is not None:
        _RUNTIME.shutdown()
    model = load_cost_model(cost_model if cost_model is not None else os.environ.get("GRADSYNC_COST_MODEL"))
    _RUNTIME = Runtime(tr, topology, algorithm, options=options, mapping=mapping, timeout_s=timeout_s, cost_model=model,
                       trace=trace, adapt=adapt)
    tuning = _RUNTIME.tuning
    quick = calibrate is None and model is None and tuning.calibration_pays(algorithm)
    if calibrate or quick:
        tuning.load_or_calibrate(quick=not calibrate)
        tuning.load_or_tune(tune=bool(calibrate))
    _RUNTIME.explore = bool(calibrate or quick) if explore is None else bool(explore)
    _RUNTIME.start_pricing()  # after the calibration: the child prices with the job's cost model
    lifetime.on_exit(shutdown)  # a script may end without shutdown(): stop the thread before the groups go
    return _RUNTIME


def is_initialized() -> bool:
    return _RUNTIME is not None


_START = threading.Lock()


def get_runtime() -> Runtime:
    """The default runtime; started here with :func:`init`'s defaults when the user already made a
    torch.distributed process group (as with PyTorch's own hooks, no ``gradsync.init()`` is needed; it stops
    at exit like any runtime ``init`` starts)."""
    rt = _RUNTIME
    if rt is None:
        with _START:
            rt = _RUNTIME
            if rt is None:
                if not (dist.is_available() and dist.is_initialized()):
                    raise GradsyncError("gradsync is not initialised in this process: call gradsync.init(), or "
                                        "torch.distributed.init_process_group() and gradsync starts on first use")
                rt = init()
    return rt


def allreduce(tensors: Tensors, op: str = "sum", algorithm: str | None = None) -> Tensors:
    """All-reduce ``tensors`` in place with the default runtime's planned schedule (see :func:`init`)."""
    return get_runtime().allreduce(tensors, op, algorithm)


def allreduce_async(tensors: Tensors, op: str = "sum", algorithm: str | None = None) -> Work:
    return get_runtime().allreduce_async(tensors, op, algorithm)


def allgather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's 1-D ``tensor`` (uneven sizes allowed) with the default runtime, in order with its collectives."""
    return get_runtime().allgather(tensor)


def allgather_async(tensor: torch.Tensor) -> Work:
    return get_runtime().allgather_async(tensor)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                          algorithm: str | None = None) -> torch.Tensor:
    """``torch.distributed.reduce_scatter_tensor`` on the default runtime's planned schedule (see
    :meth:`Runtime.reduce_scatter_tensor`)."""
    return get_runtime().reduce_scatter_tensor(output, input, op, algorithm)


def reduce_scatter_tensor_async(output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                                algorithm: str | None = None) -> Work:
    return get_runtime().reduce_scatter_tensor_async(output, input, op, algorithm)


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> torch.Tensor:
    """This rank's equal shard of the sum of ``tensor`` over ranks (a new tensor), with the default runtime."""
    return get_runtime().reduce_scatter(tensor, op, algorithm)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, algorithm: str | None = None) -> torch.Tensor:
    """``torch.distributed.all_gather_into_tensor`` on the default runtime's planned schedule."""
    return get_runtime().all_gather_into_tensor(output, input, algorithm)


def all_gather_into_tensor_async(output: torch.Tensor, input: torch.Tensor, algorithm: str | None = None) -> Work:
    return get_runtime().all_gather_into_tensor_async(output, input, algorithm)


def shutdown() -> None:
    """Stop the default runtime's communication thread (the process group stays up until exit, when
    gradsync destroys the groups it created; see :mod:`gradsync.comm.lifetime`)."""
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.shutdown()
        _RUNTIME = None
