"""The runtime a training job talks to: ``gradsync.init()``, ``gradsync.allreduce()``, and async work.

A :class:`Runtime` owns a transport, the topology the job runs on, one planned schedule (and executor)
per algorithm, and one communication thread. Every collective, synchronous or not, is queued to that
thread in call order: all ranks issue collectives in the same order, so the queue keeps them matched,
and backward can go on while gradients travel (wait-free backprop, Horovod's design).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from gradsync.comm import lifetime
from gradsync.comm.executor import OPS, Executor
from gradsync.comm.transport import Transport, create_transport
from gradsync.errors import CommError, GradsyncError, PlanError
from gradsync.plan.schedule import SHARDED, Schedule
from gradsync.plan.synthesizers import SYNTHESIZERS, PlanOptions
from gradsync.sim.cost import NATIVE, Chooser, CostModel, native_schedule, reverse_share_of, size_class
from gradsync.topology.io import get_topology
from gradsync.topology.model import Topology

__all__ = [
    "Runtime",
    "Work",
    "init",
    "allreduce",
    "allreduce_async",
    "allgather",
    "allgather_async",
    "all_gather_into_tensor",
    "all_gather_into_tensor_async",
    "dtype_groups",
    "get_runtime",
    "is_initialized",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_async",
    "shutdown",
]

Tensors = torch.Tensor | Sequence[torch.Tensor]

#: Schedules up to this many transfers wait in predicted arrival order; larger ones (thousands of ranks)
#: keep step order rather than spend a simulation at plan time.
MAX_ORDERED_TRANSFERS = 200_000
#: Bytes ranks 0 and 1 send one way and both ways when calibrating ``reverse_share`` (and half as many; ~0.1 s
#: at 400 Mbit/s).
DUPLEX_BYTES = 4 << 20
#: A calibrated ``reverse_share`` above this is capped: a link loaded both ways at under 2/3 of one way is
#: a noisy measurement, not a property of the wire.
MAX_REVERSE_SHARE = 0.5
#: Size classes up to this many bytes are chosen by measurement after calibration (:meth:`Runtime.tune`):
#: there α and the wire's short-transfer behaviour (a shaper's burst, a switch's buffers) decide, which
#: the α-β model prices least well.
TUNE_MAX_BYTES = 256 << 10
#: The ``type`` of a cached :meth:`Runtime.tune` result.
TUNED_TYPE = "gradsync.tuned"
#: A measured candidate replaces the model's choice only when it is faster by more than this share.
TUNE_MARGIN = 0.1
#: Above :data:`TUNE_MAX_BYTES`, a calibrated runtime's ``auto`` times the model's pipeline depth beside
#: its half and its double on each class's first calls (:class:`_Explorer`): one warm-up call each, then
#: this many timed calls each, interleaved.
EXPLORE_REPS = 3
#: ... and keeps the model's depth unless another is faster by more than this share. Large messages time
#: steadily (the noise of a 4-64 KB call is in its fixed costs), so the margin is smaller than tuning's.
EXPLORE_MARGIN = 0.03
#: When the double (or the half) wins, the explorer steps once more that way, the winner against the next
#: depth, at most this many times: the optimum is bracketed instead of assumed to lie one step away.
EXPLORE_STEPS = 2
#: How long ranks wait for rank 0 to price and publish a plan decision (it may simulate for a while).
PLAN_TIMEOUT_S = 600.0


@dataclass
class Work:
    """A queued collective. ``wait()`` returns its tensors or raises the error the collective hit."""

    future: torch.futures.Future
    name: str = ""

    def wait(self) -> Any:
        return self.future.wait()

    def done(self) -> bool:
        return self.future.done()


_STOP = object()
_CALL = object()  # marks a queued callable (``Runtime.submit``) among queued allreduces


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
    ) -> None:
        self.transport = transport
        if topology is None:
            topology = os.environ.get("GRADSYNC_TOPOLOGY") or f"switch:{transport.world_size}"
        self.topology = topology if isinstance(topology, Topology) else get_topology(str(topology))
        if self.topology.world_size != transport.world_size:
            raise GradsyncError(
                f"topology {self.topology.name!r} has {self.topology.world_size} ranks but the job has "
                f"world_size={transport.world_size}; pass a topology with {transport.world_size} ranks "
                f"(e.g. 'switch:{transport.world_size}') or select ranks like 'p3.16xlarge[0,1,2,3]'"
            )
        self.algorithm = algorithm
        self.options = options or PlanOptions()
        self.mapping = mapping
        self.timeout_s = timeout_s
        self.cost_model = cost_model or CostModel()
        self._chooser: Chooser | None = None
        self._named: Chooser | None = None
        self._choices: dict[int, tuple[str, int]] = {}
        #: :meth:`tune`'s measurements per size class (empty until it runs; a new cost model keeps them as a
        #: record, but its choices are priced afresh)
        self.tuned: dict[int, dict[str, Any]] = {}
        #: Whether ``auto`` measures the pipeline depths next to the model's on the first calls of each size
        #: class above :data:`TUNE_MAX_BYTES` (:class:`_Explorer`; ``init(calibrate=True)`` turns it on, as does
        #: ``init(explore=True)``). The outcome is recorded in :attr:`tuned` with ``"online": true`` and each
        #: step's candidates, times and pick under ``"steps"``.
        self.explore = False
        self._explorers: dict[int, _Explorer | None] = {}
        #: Where rank 0 keeps :attr:`tuned` (:func:`calibration_cache`), with the cost-model generation it is
        #: keyed by: ``init(calibrate=True)`` sets it, and each size class the first calls settle is added, so
        #: the next job with the same wire and model runs the measured pick from its first call. None: kept
        #: nowhere.
        self.tuned_cache: tuple[str, int] | None = None
        self._generation = 0  # bumped when the cost model changes: decisions are per model
        self._executors: dict[tuple[str, int], Executor | NativeAllreduce] = {}
        # reduce-scatter / allgather: a chooser per collective, choices and executors keyed by collective too
        self._sharded_choosers: dict[str, Chooser] = {}
        self._sharded_choices: dict[tuple[str, int], tuple[str, int]] = {}
        self._sharded: dict[tuple[str, str, int], Executor] = {}
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # collectives queued or running; 0 lets a blocking call run on the caller's thread
        self._mutex = threading.Lock()  # guards _pending
        self._running = threading.Lock()  # held while a collective runs: one at a time, in call order
        self._failed: BaseException | None = None
        self.comm_seconds = 0.0  # time the communication thread spent running collectives
        self._thread = threading.Thread(target=self._loop, name="gradsync-comm", daemon=True)
        self._thread.start()
        self.executor(algorithm)  # plan now: a bad algorithm fails at init, not in the first backward

    # ---- planning ---------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def chooser(self) -> Chooser:
        """Picks (algorithm, pipeline depth) per message-size class with the runtime's cost model.

        The backend's own allreduce (``native``) is a candidate when the transport has a process group and
        topology ranks are process ranks (it runs in process order), so ``auto`` never loses to it where
        the model says they are equal (a flat switch, small messages).
        """
        if self._chooser is None:
            native = getattr(self.transport, "group", None) is not None and self.mapping is None
            self._chooser = Chooser(self.topology, self.cost_model, native=native, options=self.options)
        return self._chooser

    def executor(self, algorithm: str | None = None, nbytes: float | None = None) -> Executor | NativeAllreduce:
        """The executor for ``algorithm`` (default: the runtime's), planned once and cached.

        ``auto`` chooses per size class of ``nbytes`` (default ``options.size_bytes``) with :attr:`chooser`
        (while :attr:`explore` times a large class's depths, the class's :class:`_Explorer`, which runs
        like an executor); a named algorithm runs at ``options.pipeline``. Every schedule comes from the chooser (one planning
        path, self-checked before it runs) and waits for its messages in the cost model's predicted
        arrival order (:meth:`~gradsync.sim.cost.CostModel.wait_order`).
        """
        name = algorithm or self.algorithm
        size = size_class(self.options.size_bytes if nbytes is None else nbytes)
        if name == "auto":
            name, pipeline = self._choice(size)
            if self.explore and size > TUNE_MAX_BYTES:
                explorer = self._explorer(size, (name, pipeline))
                if explorer is not None and explorer.pick is None:
                    return explorer  # type: ignore[return-value]  # runs like an executor
        else:
            pipeline = self.options.pipeline
        return self._executor_of(name, pipeline, size)

    def _executor_of(self, name: str, pipeline: int, size: int) -> Executor | NativeAllreduce:
        """The cached executor of ``(name, pipeline)``, planned (and its wait order priced at ``size``) once."""
        key = (name, pipeline)
        ex = self._executors.get(key)
        if ex is None:
            if name == NATIVE:
                if getattr(self.transport, "group", None) is None:
                    raise GradsyncError(f"algorithm {NATIVE!r} needs a torch.distributed transport; this one is {self.transport.name!r}")
                ex = NativeAllreduce(self.transport, native_schedule(self.topology))
            else:
                planner = self._chooser if self._chooser is not None else self._planner()
                schedule = planner.schedule(name, pipeline, check=True)
                order = None
                if schedule.num_transfers <= MAX_ORDERED_TRANSFERS:
                    raw = self._decide(f"g{self._generation}/order/{name}/{pipeline}/{size}", lambda: self.cost_model.wait_order(
                        schedule, self.topology, size).astype("<f8").tobytes())
                    order = np.frombuffer(raw, "<f8")
                ex = Executor(schedule, self.transport, mapping=self.mapping, timeout_s=self.timeout_s, order=order)
            self._executors[key] = ex
        return ex

    def _choice(self, size: int) -> tuple[str, int]:
        """``auto``'s (algorithm, pipeline) for a size class: priced once (by rank 0 where the transport can
        share it), the same on every rank."""
        got = self._choices.get(size)
        if got is None:
            def compute() -> bytes:
                c = self.chooser.choose(size)
                return json.dumps([c.algorithm, c.pipeline]).encode()

            name, pipeline = json.loads(self._decide(f"g{self._generation}/choice/{size}", compute))
            got = self._choices[size] = (str(name), int(pipeline))
        return got

    def choice(self, nbytes: float) -> tuple[str, int]:
        """The (algorithm, pipeline) ``auto`` runs for ``nbytes`` now: the model's, or what :meth:`tune` or
        the first calls' measurements (:attr:`explore`) replaced it with."""
        return self._choice(size_class(nbytes))  # a measured pick replaces the class's entry in _choices

    def exploring(self) -> bool:
        """Whether some size class's first calls have started timing pipeline depths and not yet decided
        (:attr:`explore`): a benchmark warms up until this is False, so it times what ``auto`` settled on. A
        class only planned (``executor()`` at set-up, no call run) does not count."""
        return any(ex is not None and ex.pick is None and ex.calls > 0 for ex in self._explorers.values())

    def _explorer(self, size: int, model: tuple[str, int]) -> _Explorer | None:
        """The size class's :class:`_Explorer` (None: nothing to compare: native, or no process group)."""
        if size in self._explorers:
            return self._explorers[size]
        group = getattr(self.transport, "group", None)
        ex = None
        if group is not None and self.world_size > 1 and model[0] != NATIVE:
            def candidates() -> bytes:  # priced by rank 0, like every choice
                return json.dumps([model] + [(model[0], q) for q in (2 * model[1], model[1] // 2)
                                             if self._plannable(model[0], q)]).encode()

            tried = [(str(a), int(p)) for a, p in json.loads(self._decide(f"g{self._generation}/explore/{size}",
                                                                           candidates))]
            if len(tried) > 1:
                ex = _Explorer(self, group, size, tried)
        self._explorers[size] = ex
        return ex

    def _plannable(self, name: str, pipeline: int) -> bool:
        """Whether ``name`` at depth ``pipeline`` may be explored: a depth the cost model prices, and planned here."""
        if pipeline not in self.cost_model.pipelines:
            return False
        try:
            self.chooser.schedule(name, pipeline)
        except PlanError:
            return False  # too large to plan here: not a candidate
        return True

    def _keep_tuned(self) -> None:
        """Rewrite :attr:`tuned_cache` with :attr:`tuned` (rank 0, :func:`_write_cache`), while the cost model is
        still the one it is keyed by."""
        if self.tuned_cache is None or self.rank != 0:
            return
        path, generation = self.tuned_cache
        if generation != self._generation:
            return  # a different cost model now: these picks are not that file's
        doc = {"type": TUNED_TYPE, "classes": {str(size): {k: v for k, v in record.items() if k != "cached"}
                                                for size, record in sorted(self.tuned.items())}}
        _write_cache(path, doc, "measured choices", stacklevel=3)

    def _decide(self, key: str, compute: Callable[[], bytes]) -> bytes:
        """``compute()`` once for the job (rank 0, shared through the transport) or here when it cannot share."""
        decide = getattr(self.transport, "decide", None)
        if decide is None:
            return compute()
        return bytes(decide(key, compute, max(self.timeout_s, PLAN_TIMEOUT_S)))

    def set_cost_model(self, model: CostModel) -> None:
        """Price with ``model`` from now on: plans and choices made with the old one are dropped."""
        self.cost_model = model
        self._chooser = self._named = None
        self._choices.clear()
        self._explorers.clear()
        self._sharded_choosers.clear()
        self._sharded_choices.clear()
        self._close_executors()
        self._executors.clear()
        self._generation += 1

    def _close_executors(self) -> None:
        """Stop the executors' waiting threads (the native one has none)."""
        for ex in [*self._executors.values(), *self._sharded.values()]:
            if isinstance(ex, Executor):
                ex.close()
        self._sharded.clear()

    def calibrate(self, reps: int = 5, size_bytes: int = 4096) -> CostModel:
        """Measure the per-message costs on this job's wire and price with them (returns the new model).

        Times a ``size_bytes`` allreduce (so bytes hardly count) on the planned ring through the executor,
        and the backend's own ``all_reduce``; the slowest rank's median of ``reps`` is the measurement. α is
        the value at which the model predicts exactly that time (the prediction is affine in α for
        messages this small), the same on every rank. Then rank 0 and the rank behind its slowest path
        (:meth:`_duplex_peer`) send half of :data:`DUPLEX_BYTES` and all of it, one way and both ways at once:
        ``reverse_share`` κ is what a link loaded both ways loses on this wire in steady state (acknowledgements,
        the transport's one thread per peer), measured on the extra bytes so that two streams' start-up is not
        counted (:func:`~gradsync.sim.cost.reverse_share_of`; median over ``reps`` alternating repetitions,
        kept in ``[0, 0.5]``). The one-way time of :data:`DUPLEX_BYTES` also checks the topology's rates: a
        path more than ``RATE_TOLERANCE`` times slower than the file says rescales every link first
        (:meth:`~gradsync.sim.cost.CostModel.refined`, with a warning), and α is solved on those rates. Runs
        on the communication thread, in order with queued collectives; needs a torch.distributed transport.
        """
        group = getattr(self.transport, "group", None)
        if group is None:
            raise GradsyncError(f"calibration needs a torch.distributed transport; this one is {self.transport.name!r}")
        if not isinstance(reps, int) or reps < 1:
            raise GradsyncError(f"reps={reps!r} must be an integer >= 1")
        if self.world_size == 1:
            return self.cost_model
        return self.submit(lambda: self._calibrate(group, reps, int(size_bytes)), "calibrate").wait()

    def _calibrate(self, group: Any, reps: int, size: int) -> CostModel:
        import statistics

        import torch.distributed as dist

        ring = self._planner().schedule("ring", 1, check=True)
        # lanes, as the runs the model mostly chooses for (over SMALL_RUN_BYTES) use: a small run's key-order
        # waits are cheaper, so α measured with them would under-price every larger run
        ex = Executor(ring, self.transport, mapping=self.mapping, timeout_s=self.timeout_s, progress="lanes")
        buf = torch.zeros(max(1, size // 4))

        def slowest(fn: Callable[[], Any], reps: int = reps) -> float:
            return self._slowest(group, fn, reps)

        far = self._duplex_peer()
        pair = self.rank in (0, far)
        big = torch.zeros(DUPLEX_BYTES // 4) if pair else None
        got = torch.empty(DUPLEX_BYTES // 4) if pair else None

        def one_way(n: int) -> None:
            if self.rank == 0:
                dist.send(big[:n], group=group, group_dst=far)
            elif self.rank == far:
                dist.recv(got[:n], group=group, group_src=0)

        def both_ways(n: int) -> None:
            if pair:
                peer = far if self.rank == 0 else 0
                works = [dist.irecv(got[:n], group=group, group_src=peer),
                         dist.isend(big[:n], group=group, group_dst=peer)]
                for w in works:
                    w.wait()

        half, whole = DUPLEX_BYTES // 8, DUPLEX_BYTES // 4  # elements
        try:
            t_ex = slowest(lambda: ex.run(buf))
            t_nat = slowest(lambda: dist.all_reduce(buf, group=group))
            rows = []  # one way and both ways alternate, so a busy spell of the CPU hits both alike
            for _ in range(reps + 1):  # the first repetition warms the connection up and is dropped
                rows.append(tuple(slowest(lambda f=f, n=n: f(n), reps=1)
                                  for f, n in ((one_way, half), (one_way, whole), (both_ways, half), (both_ways, whole))))
        finally:
            ex.close()
        kappa = reverse_share_of(rows[1:], MAX_REVERSE_SHARE)
        base = self.cost_model
        if self.mapping is None:  # the one-way stream also says whether the file's rates are the wire's
            base, note = base.refined(self.topology, 0, far, DUPLEX_BYTES, statistics.median(r[1] for r in rows[1:]))
            if note is not None and self.rank == 0:
                warnings.warn(f"calibration: {note}; give the topology its real link rates (or a cost model from "
                              f"`gradsync testbed probe --cost-model`) to plan with per-class rates", stacklevel=4)
        nbytes = buf.numel() * 4
        # α is solved on the refined rates: on rates the wire lacks it would absorb the missing transfer time
        zero = replace(base, message_s=0.0, native_message_s=0.0)
        one = replace(base, message_s=1e-3, native_message_s=1e-3)

        def solve(at0: float, at1: float, measured: float, unchanged: float) -> float:
            slope = (at1 - at0) / 1e-3
            return max(1e-6, (measured - at0) / slope) if slope > 0 else unchanged

        alpha = solve(zero.predict(ring, self.topology, nbytes), one.predict(ring, self.topology, nbytes), t_ex,
                      base.message_s)
        native = solve(zero.predict_native(self.topology, nbytes), one.predict_native(self.topology, nbytes), t_nat,
                       base.native_message_s)
        model = replace(base, message_s=alpha, native_message_s=native, reverse_share=kappa,
                        source=f"{base.source}; message costs calibrated on {self.world_size} ranks "
                               f"({alpha * 1e6:.0f} us executor, {native * 1e6:.0f} us native; both ways "
                               f"{1 / (1 + kappa):.3f} of one way)")
        self.set_cost_model(model)
        return model

    def tune(self, max_bytes: int = TUNE_MAX_BYTES, reps: int = 3) -> dict[int, dict[str, Any]]:
        """Choose ``auto``'s plan for every size class up to ``max_bytes`` by measuring, not only pricing.

        For small messages the model's α-β prices are least sure: a few messages' fixed costs decide, and
        a wire may pass a short transfer faster than its rate (a shaper's token bucket, a switch's buffers;
        on the racks:2,2,2 testbed an 84 KB tree allreduce took 1.7 ms where the model said 14.5). Per class,
        the model's choice, the native collective and every other algorithm at its best predicted pipeline
        depth and at depth 1 each run ``reps`` times after two warm-ups (the slowest rank's median,
        identical on every rank); a candidate replaces the model's choice only when it is more than
        :data:`TUNE_MARGIN` faster.
        Returns ``{class bytes: {"choice": [algorithm, pipeline], "model": [...], "measured_s": {...}}}``
        (also kept in :attr:`tuned`). Runs on the communication thread like :meth:`calibrate`; a runtime
        that is not ``auto``, or has one rank or no torch.distributed transport, has nothing to tune.
        """
        group = getattr(self.transport, "group", None)
        if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
            raise GradsyncError(f"reps={reps!r} must be an integer >= 1")
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise GradsyncError(f"max_bytes={max_bytes!r} must be an integer >= 0 (0 tunes nothing)")
        if group is None or self.world_size == 1 or self.algorithm != "auto":
            return {}
        return self.submit(lambda: self._tune(group, max_bytes, reps), "tune").wait()

    def use_tuned(self, doc: Any) -> None:
        """Adopt :meth:`tune`'s choices from its cached JSON (``{"type": "gradsync.tuned", "classes": {bytes:
        {"choice": [algorithm, pipeline], ...}}}``), checked first: a wrong one raises and changes nothing.
        Larger classes there were settled by an earlier job's first calls (:attr:`explore`): they run their pick
        at once, with nothing timed (until a new cost model, which prices every class afresh)."""
        if not isinstance(doc, dict) or doc.get("type") != TUNED_TYPE or not isinstance(doc.get("classes"), dict):
            raise GradsyncError(f"tuned choices must be a JSON object with \"type\": \"{TUNED_TYPE}\" and \"classes\"")
        choices: dict[int, tuple[str, int]] = {}
        records: dict[int, dict[str, Any]] = {}
        for key, entry in doc["classes"].items():
            choice = entry.get("choice") if isinstance(entry, dict) else None
            size = int(key) if isinstance(key, str) and key.isdigit() else -1
            if (size != size_class(max(1, size)) or not isinstance(choice, list) or len(choice) != 2
                    or not isinstance(choice[0], str) or not (choice[0] == NATIVE or choice[0] in SYNTHESIZERS)
                    or isinstance(choice[1], bool) or not isinstance(choice[1], int) or choice[1] < 1):
                raise GradsyncError(f"tuned class {key!r}: {entry!r} is not a size class with a choice "
                                    f"[algorithm, pipeline >= 1]; delete the file to measure again")
            choices[size] = (choice[0], choice[1])
            records[size] = {**entry, "cached": True}
        self._choices.update(choices)
        self._explorers.update(dict.fromkeys(choices))  # measured already (a larger class: by an earlier job's calls)
        self.tuned = records

    def _tune(self, group: Any, max_bytes: int, reps: int) -> dict[int, dict[str, Any]]:
        results: dict[int, dict[str, Any]] = {}
        size = size_class(1)
        while size <= max_bytes:
            def candidates(size: int = size) -> bytes:  # priced by rank 0, like every choice
                choice = self.chooser.choose(size)
                model = (choice.algorithm, choice.pipeline)
                best: dict[str, tuple[float, int]] = {}
                for c in choice.candidates:  # each algorithm at its best predicted depth
                    if c.algorithm not in best or c.predicted_s < best[c.algorithm][0]:
                        best[c.algorithm] = (c.predicted_s, c.pipeline)
                # ... and at depth 1, the fewest messages: at these sizes α, which pipelining multiplies, decides
                pairs = [*((a, p) for a, (_, p) in best.items()), *((a, 1) for a in best)]
                return json.dumps([model, *dict.fromkeys(pr for pr in pairs if pr != model)]).encode()

            tried = [(str(a), int(p)) for a, p in json.loads(self._decide(f"g{self._generation}/tune/{size}", candidates))]
            model = tried[0]
            buf = torch.zeros(size // 4)
            measured = {}
            had = set(self._executors)
            for name, pipeline in tried:
                ex = self._executor_of(name, pipeline, size)
                measured[(name, pipeline)] = self._slowest(group, lambda ex=ex, buf=buf: ex.run(buf, "sum"), reps)
            pick = tuned_choice(measured, model)
            self._choices[size] = pick
            # executors are cached per (algorithm, depth) with the wait order priced at their first size: drop
            # the candidates this class built but did not pick, so a larger size that runs one later prices
            # its own order, as without tuning (and no unused executor is kept)
            self._drop_built(tried, had, {pick})
            results[size] = {"choice": list(pick), "model": list(model),
                             "measured_s": {f"{a}/{p}": t for (a, p), t in measured.items()}}
            size *= 2
        self.tuned = results
        return results

    def _drop_built(self, keys: Sequence[tuple[str, int]], had: set[tuple[str, int]],
                    keep: set[tuple[str, int]]) -> None:
        """Close and forget the executors of ``keys`` that were built after ``had`` was taken and are not in
        ``keep``: candidates measured (:meth:`tune`, :class:`_Explorer`) that nothing goes on to run."""
        for key in keys:
            if key not in had and key not in keep:
                dropped = self._executors.pop(key, None)
                if isinstance(dropped, Executor):
                    dropped.close()

    def _slowest(self, group: Any, fn: Callable[[], Any], reps: int) -> float:
        """The slowest rank's median of ``reps`` timings of ``fn`` (after two warm-up calls when ``reps > 1``):
        the same number on every rank."""
        import statistics

        import torch.distributed as dist

        if reps > 1:
            fn()
            fn()
        times = []
        for _ in range(reps):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return _max_over_ranks(self.transport, group, [statistics.median(times)])[0]

    def _duplex_peer(self) -> int:
        """The rank whose path from rank 0 has the slowest bottleneck (then the fewest hops): the links that
        bound the collectives are the ones whose loss both ways matters (rank 1 under a custom mapping)."""
        if self.mapping is not None:
            return 1
        paths = self.cost_model.paths_from(self.topology, 0)
        return min(range(1, self.world_size), key=lambda p: (*paths[p], p))

    def _planner(self) -> Chooser:
        """A chooser without candidates of its own, for named algorithms (plans and checks them)."""
        if self._named is None:
            self._named = Chooser(self.topology, self.cost_model, algorithms=[], native=True, options=self.options)
        return self._named

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
        chooser = self._sharded_choosers.get(collective)
        if chooser is None:
            chooser = self._sharded_choosers[collective] = Chooser(
                self.topology, self.cost_model, native=False, options=replace(self.options, collective=collective))
        if name == "auto":
            got = self._sharded_choices.get((collective, size))
            if got is None:
                def compute() -> bytes:
                    c = chooser.choose(size)
                    return json.dumps([c.algorithm, c.pipeline]).encode()

                chosen, depth = json.loads(self._decide(f"g{self._generation}/choice/{collective}/{size}", compute))
                got = self._sharded_choices[(collective, size)] = (str(chosen), int(depth))
            name, pipeline = got
        else:
            pipeline = self.options.pipeline
        key = (collective, name, pipeline)
        ex = self._sharded.get(key)
        if ex is None:
            schedule = chooser.schedule(name, pipeline, check=True)
            order = None
            if schedule.num_transfers <= MAX_ORDERED_TRANSFERS:
                raw = self._decide(f"g{self._generation}/order/{collective}/{name}/{pipeline}/{size}",
                                   lambda: self.cost_model.wait_order(schedule, self.topology, size).astype("<f8").tobytes())
                order = np.frombuffer(raw, "<f8")
            ex = self._sharded[key] = Executor(schedule, self.transport, mapping=self.mapping, timeout_s=self.timeout_s,
                                               order=order)
        return ex

    # ---- collectives ---------------------------------------------------------------------------------------
    def allreduce_async(self, tensors: Tensors, op: str = "sum", algorithm: str | None = None) -> Work:
        """Queue an in-place allreduce of ``tensors`` (one tensor collective); returns at once."""
        ex = self._executor_for(tensors, op, algorithm)
        return Work(self._enqueue(ex, tensors, op), ex.schedule.algorithm)

    def allreduce(self, tensors: Tensors, op: str = "sum", algorithm: str | None = None) -> Tensors:
        """All-reduce in place and return ``tensors``; raises :class:`~gradsync.errors.PeerError` on a lost peer.

        When nothing is queued or running, the collective runs on the caller's thread: the same order
        (anything queued meanwhile waits for it), without two thread handoffs per call, which cost more
        than a small message's whole allreduce.
        """
        ex = self._executor_for(tensors, op, algorithm)
        with self._mutex:
            inline = self._pending == 0 and self._failed is None and not self.on_comm_thread()
            if inline:
                self._pending += 1
        if not inline:
            return self._enqueue(ex, tensors, op).wait()
        try:
            with self._running:
                return self._run(ex, tensors, op)
        finally:
            with self._mutex:
                self._pending -= 1

    def native_allreduce_async(self, tensor: torch.Tensor, algorithm: str | None = None) -> torch.futures.Future | None:
        """Sum one contiguous ``tensor`` over ranks in place with the backend's own async ``all_reduce`` on the
        user's process group (``transport.user_group``), issued on the caller's thread, when this runtime runs
        that size natively; otherwise None (queue it with :meth:`allreduce_async` instead).

        The future is the process group's (result: ``[tensor]``): no hand-off to the communication thread
        and back, which costs a DDP hook more than its whole allreduce on a fast link. It is what ``torch``'s
        own hooks do: on the caller's thread, in program order, the user's group. Alternating with gradsync's
        dedicated group within a step cost ~1 ms on loopback (``bench hooks``).

        Whether it runs here depends only on the size's plan, which every rank shares, never on whether this
        rank's queue is busy: the queued collectives run on the dedicated group, in queue order, so the two
        groups each see the same sequence on every rank. (A choice that depended on timing would send one rank's
        collective to one group and its peer's to the other: a mismatch.)
        """
        if not tensor.is_contiguous() or self._failed is not None or self.on_comm_thread():
            return None
        if not isinstance(self.executor(algorithm, tensor.numel() * tensor.element_size()), NativeAllreduce):
            return None
        import torch.distributed as dist

        try:
            work = dist.all_reduce(tensor, group=self.transport.user_group, async_op=True)  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise CommError(f"torch.distributed.all_reduce failed (a peer left or timed out?): {exc}") from exc
        return work.get_future()

    def _executor_for(self, tensors: Tensors, op: str, algorithm: str | None) -> Executor | NativeAllreduce:
        """The executor an allreduce of ``tensors`` runs on, after checking ``op``."""
        if op not in OPS:
            raise GradsyncError(f"op={op!r} is not one of {OPS}")
        return self.executor(algorithm, _nbytes(tensors))

    def _enqueue(self, ex: Any, payload: Any, op: str | None) -> torch.futures.Future:
        """Queue one item for the communication thread; its future, failed at once if the runtime has."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._failed is not None:
            fut.set_exception(CommError(f"the gradsync runtime failed earlier and cannot run more collectives: {self._failed}"))
            return fut
        with self._mutex:
            self._pending += 1
        self._queue.put((ex, payload, op, fut))
        return fut

    def _run(self, ex: Any, payload: Any, op: str | None) -> Any:
        """Run one item (a collective or a submitted callable) now; a failure fails the runtime."""
        t0 = time.perf_counter()
        try:
            return payload() if ex is _CALL else ex.run(payload, op)
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            self.comm_seconds += time.perf_counter() - t0

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
        return Work(self._enqueue(_CALL, fn, None), name)

    def on_comm_thread(self) -> bool:
        """Whether the caller is this runtime's communication thread (where ``run_*`` may be called)."""
        return threading.current_thread() is self._thread

    def run_allreduce(self, tensors: Tensors, op: str = "sum", algorithm: str | None = None) -> Tensors:
        """All-reduce now, on the communication thread (inside :meth:`submit`); elsewhere use :meth:`allreduce`."""
        self._check_comm_thread("run_allreduce", "allreduce")
        return self._executor_for(tensors, op, algorithm).run(tensors, op)

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
        group = getattr(self.transport, "group", None)
        if group is not None:
            return _gather_torch(tensor, group, self.world_size, equal_sizes)
        return _gather_p2p(tensor, self.transport, self.timeout_s, equal_sizes)

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
        _check_sharded("reduce_scatter_tensor", output, input, self.world_size, big="input")
        ex = self.sharded_executor("reduce_scatter", algorithm, _nbytes(input))
        return self.submit(lambda: _run_sharded(ex, output, input, op), "reduce_scatter")

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
        _check_sharded("all_gather_into_tensor", input, output, self.world_size, big="output")
        ex = self.sharded_executor("allgather", algorithm, _nbytes(output))
        return self.submit(lambda: _run_sharded(ex, input, output, None), "allgather")

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
            ex, payload, op, fut = item
            try:
                with self._running:
                    if self._failed is not None:
                        raise CommError(f"the gradsync runtime failed earlier: {self._failed}")
                    result = self._run(ex, payload, op)
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
        self._close_executors()


class _Explorer:
    """``auto``'s first calls of one large size class: the model's pipeline depth against its half and its
    double, measured on the job's own allreduces, stepping on while the edge wins.

    Above :data:`TUNE_MAX_BYTES` the α-β model ranks algorithms well but not always depths: it charges each
    message's cost in series, while the executor's per-peer lanes overlap much of it (BML on bcube:3,2:
    depth 2 measured 7.6% faster than the chosen depth 1 at 50 MiB, 1-7% at 12.5 MiB, and 7% slower at
    4 MiB). Timing the neighbours costs a few calls per class, once per job. Call ``i`` of a step runs
    candidate ``i mod m`` (the first round warms up: plans, scratch, lane threads); after
    :data:`EXPLORE_REPS` timed rounds the slowest rank's median per candidate (one small all-reduce, at the
    same call on every rank: all ranks run a class's calls in the same order) picks with
    :func:`tuned_choice` and :data:`EXPLORE_MARGIN`, the step's first candidate being the incumbent. When
    the pick is the double (the half), the optimum may lie further that way: up to :data:`EXPLORE_STEPS`
    more steps time the pick against its own double (half), with a fresh warm-up round. Later calls run
    the last pick. Every candidate computes the same sum, so the calls that measure are real work, not
    extra collectives.
    """

    def __init__(self, rt: Runtime, group: Any, size: int, candidates: Sequence[tuple[str, int]]) -> None:
        self.rt, self.group, self.size = rt, group, size
        self.model = candidates[0]
        self.calls = 0  # in this job, all steps
        self.pick: tuple[str, int] | None = None
        #: each step's candidates (incumbent first), measured times and pick: the record ``rt.tuned`` keeps
        self.steps: list[dict[str, Any]] = []
        self._had = set(rt._executors)  # executors that existed before: never dropped here
        self._begin(candidates)
        #: the model's choice, planned now on the caller's thread (as ``auto`` without exploring would)
        self.first = rt._executor_of(*self.model, size)

    def _begin(self, candidates: Sequence[tuple[str, int]]) -> None:
        self.candidates = list(candidates)
        self.step_calls = 0
        self.times: dict[tuple[str, int], list[float]] = {c: [] for c in self.candidates}

    @property
    def schedule(self) -> Schedule:
        """The model's choice's schedule (the candidates differ only in pipeline depth)."""
        return self.first.schedule

    def run(self, tensors: Tensors, op: str = "sum") -> Tensors:
        if self.pick is not None:  # queued before the decision
            return self.rt._executor_of(*self.pick, self.size).run(tensors, op)
        m = len(self.candidates)
        cand = self.candidates[self.step_calls % m]
        ex = self.rt._executor_of(*cand, self.size)
        t0 = time.perf_counter()
        out = ex.run(tensors, op)
        if self.step_calls >= m:  # the first round warmed up
            self.times[cand].append(time.perf_counter() - t0)
        self.step_calls += 1
        self.calls += 1
        if self.step_calls == m * (1 + EXPLORE_REPS):
            self._settle()
        return out

    def _settle(self) -> None:
        """Agree on the step's timings (the slowest rank's) and pick; then step on, or record the pick and drop
        the executors nothing runs."""
        import statistics

        slowest = _max_over_ranks(self.rt.transport, self.group, [statistics.median(self.times[c]) for c in self.candidates])
        measured = dict(zip(self.candidates, slowest))
        incumbent = self.candidates[0]
        pick = tuned_choice(measured, incumbent, EXPLORE_MARGIN)
        rt = self.rt
        self.steps.append({"candidates": [list(c) for c in self.candidates], "pick": list(pick),
                           "measured_s": {f"{a}/{p}": t for (a, p), t in measured.items()}})
        beyond = self._beyond(pick, incumbent)
        rt._drop_built(self.candidates, self._had, self._in_use() | {pick})  # their lanes and scratch go
        if beyond is not None:
            self._begin([pick, beyond])
            return
        measured_all = {k: v for step in self.steps for k, v in step["measured_s"].items()}  # latest time each
        rt.tuned[self.size] = {"choice": list(pick), "model": list(self.model), "online": True,
                               "measured_s": measured_all, "steps": self.steps}
        rt._choices[self.size] = pick
        self.pick = pick
        rt._keep_tuned()

    def _beyond(self, pick: tuple[str, int], incumbent: tuple[str, int]) -> tuple[str, int] | None:
        """The next depth past ``pick`` when it beat the incumbent (a step's other candidates are the incumbent's
        double and half, so the double's next is its double, the half's its half), while steps remain; decided
        by rank 0 for every rank."""
        name, p = pick
        if pick == incumbent or len(self.steps) > EXPLORE_STEPS:
            return None
        q = 2 * p if p > incumbent[1] else p // 2
        rt = self.rt
        measured = {tuple(c) for step in self.steps for c in step["candidates"]}
        raw = rt._decide(f"g{rt._generation}/explore/{self.size}/{len(self.steps)}",
                         lambda: json.dumps(q >= 1 and (name, q) not in measured and rt._plannable(name, q)).encode())
        return (name, q) if json.loads(raw) else None

    def _in_use(self) -> set[tuple[str, int]]:
        """What some class runs or is measuring (one only planned builds its candidates again if it runs)."""
        rt = self.rt
        return set(rt._choices.values()) | {c for e in rt._explorers.values() if e is not None and e is not self
                                            and e.pick is None and e.calls > 0 for c in e.candidates}


def _max_over_ranks(transport: Transport, group: Any, values: Sequence[float]) -> list[float]:
    """Each of ``values``' largest over the ranks of ``group`` (timings: the slowest rank's), the same on every
    rank; on the device the backend reduces on (NCCL: this process's GPU)."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if getattr(transport, "backend", "") == "nccl" else None
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.tolist()]


def _nbytes(tensors: Tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


class NativeAllreduce:
    """The backend's own ``torch.distributed.all_reduce`` behind the executor's interface (``auto`` picks
    it where the cost model says no planned schedule beats it). A tensor list of one dtype is reduced as
    one flat buffer; in place, like :meth:`Executor.run`."""

    def __init__(self, transport: Transport, schedule: Schedule) -> None:
        self.transport = transport
        self.schedule = schedule  # the rank-order ring it is priced as
        self.runs = 0

    def run(self, tensors: Tensors, op: str = "sum") -> Tensors:
        import torch.distributed as dist

        if op not in OPS:
            raise GradsyncError(f"op={op!r} is not one of {OPS}")
        single = isinstance(tensors, torch.Tensor)
        tlist = [tensors] if single else list(tensors)
        if op == "avg" and tlist and not (tlist[0].is_floating_point() or tlist[0].is_complex()):
            raise TypeError(f"op='avg' needs a floating-point tensor, got {tlist[0].dtype}; use op='sum' or convert first")
        group = self.transport.group  # type: ignore[attr-defined]
        try:
            for same in dtype_groups(tlist):
                if len(same) == 1 and same[0].is_contiguous():
                    dist.all_reduce(same[0], group=group)
                    flat = same[0]
                else:
                    flat = torch.cat([t.reshape(-1) for t in same])
                    dist.all_reduce(flat, group=group)
                    offset = 0
                    for t in same:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
                if op == "avg":
                    for t in same:
                        t.div_(self.transport.world_size)
        except RuntimeError as exc:
            raise CommError(f"torch.distributed.all_reduce failed (a peer left or timed out?): {exc}") from exc
        self.runs += 1
        return tensors if single else tlist


def _check_sharded(what: str, shard: torch.Tensor, full: torch.Tensor, world: int, *, big: str) -> None:
    """Validate a (shard, full) pair as torch.distributed's tensor collectives do, with messages naming the fix."""
    small = "output" if big == "input" else "input"
    for name, t in ((small, shard), (big, full)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} is a {type(t).__name__}; pass a torch.Tensor")
        if not t.is_contiguous():
            raise TypeError(f"{what}: {name} (shape {tuple(t.shape)}) is not contiguous; pass {name}.contiguous()")
    if shard.dtype != full.dtype or shard.device != full.device:
        raise TypeError(f"{what}: {small} is {shard.dtype} on {shard.device} but {big} is {full.dtype} on {full.device}; "
                        f"use one dtype and device")
    if full.numel() != world * shard.numel():
        raise GradsyncError(f"{what}: {big} has {full.numel()} elements but {small} has {shard.numel()}; {big} must "
                            f"have world_size({world}) x {shard.numel()} = {world * shard.numel()}")


def _run_sharded(ex: Executor, shard: torch.Tensor, full: torch.Tensor, op: str | None) -> torch.Tensor:
    """Run a reduce-scatter (``op`` given: ``full`` -> ``shard``) or an allgather (``shard`` -> ``full``).

    The schedule's shards are in *schedule*-rank order and the caller's in process-rank order: schedule rank
    ``r`` runs on process ``proc_of[r]``, so the work buffer holds the caller's slice ``proc_of[r]`` at
    shard ``r`` (the identity without a mapping, when an allgather runs in ``full`` itself).
    """
    proc_of = ex.proc_of
    k = shard.numel()
    flat_full = full.view(-1)
    identity = proc_of == list(range(len(proc_of)))
    if op is not None:  # reduce-scatter: work on a copy, so the input is left as it was
        work = flat_full.clone() if identity else torch.cat([flat_full[p * k:(p + 1) * k] for p in proc_of])
        ex.run(work, op)
        lo, hi = ex.schedule.shard(ex.rank, work.numel())
        shard.view(-1).copy_(work[lo:hi])
        return shard
    if identity:
        work = flat_full
    else:
        work = torch.empty_like(flat_full)
    lo, hi = ex.schedule.shard(ex.rank, work.numel())
    work[lo:hi].copy_(shard.view(-1))
    ex.run(work)
    if not identity:
        for r, p in enumerate(proc_of):
            flat_full[p * k:(p + 1) * k].copy_(work[r * k:(r + 1) * k])
    return full


def dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split by dtype, in order of first appearance: a tensor collective moves one dtype."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _gather_torch(tensor: torch.Tensor, group: Any, world: int, equal_sizes: bool = False) -> list[torch.Tensor]:
    import torch.distributed as dist

    if equal_sizes:
        out = [torch.empty_like(tensor) for _ in range(world)]
        if tensor.numel():
            dist.all_gather(out, tensor, group=group)
        return out
    size = torch.tensor([tensor.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    if longest == 0:
        return [tensor.new_zeros(0) for _ in range(world)]
    padded = tensor if tensor.numel() == longest else torch.cat([tensor, tensor.new_zeros(longest - tensor.numel())])
    out = [torch.empty(longest, dtype=tensor.dtype) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [o[:c] for o, c in zip(out, counts)]


def _gather_p2p(tensor: torch.Tensor, transport: Transport, timeout_s: float, equal_sizes: bool = False) -> list[torch.Tensor]:
    rank, world = transport.rank, transport.world_size
    peers = [p for p in range(world) if p != rank]
    size = torch.tensor([tensor.numel()], dtype=torch.int64)
    sizes = {p: size.clone() if equal_sizes else torch.zeros(1, dtype=torch.int64) for p in peers}
    handles = [] if equal_sizes else [transport.isend(size, p, 0) for p in peers] + [transport.irecv(sizes[p], p, 0) for p in peers]
    for h in handles:
        h.wait(timeout_s)
    out: list[torch.Tensor] = [tensor if p == rank else torch.empty(int(sizes[p].item()), dtype=tensor.dtype) for p in range(world)]
    handles = [transport.isend(tensor, p, 1) for p in peers if tensor.numel()]
    handles += [transport.irecv(out[p], p, 1) for p in peers if out[p].numel()]
    for h in handles:
        h.wait(timeout_s)
    return [o.clone() if p == rank else o for p, o in enumerate(out)]


_RUNTIME: Runtime | None = None


def _init_process_group(backend: str | None, timeout_s: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise GradsyncError(
            f"environment variables {missing} are not set; launch with torchrun (or `gradsync launch`), "
            f"or call torch.distributed.init_process_group() yourself and pass group=..."
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    lifetime.init_process_group(backend, timeout_s)  # ours, so destroyed cleanly at exit


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
    calibrate: bool = False,
    explore: bool | None = None,
) -> Runtime:
    """Start gradsync in this process and return the runtime (also kept as the default).

    ``transport="torch"`` initialises ``torch.distributed`` from the torchrun variables (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) unless it already is, and uses ``group`` (default: the world).
    ``transport="mpi"`` uses ``mpi4py``'s COMM_WORLD. ``topology`` defaults to ``$GRADSYNC_TOPOLOGY`` or
    ``switch:<world_size>``; ``mapping`` places topology ranks on process ranks (default: in order).
    ``cost_model`` (a :class:`~gradsync.sim.cost.CostModel`, a JSON file, or ``$GRADSYNC_COST_MODEL``)
    prices schedules for ``algorithm="auto"``, which chooses per message size (native collective
    included); without one, the topology's own rates and default message costs are used. ``calibrate``
    measures the message costs on this wire (:meth:`Runtime.calibrate`, a second or so) once per topology
    and model: the result is cached as JSON in ``$GRADSYNC_CACHE`` (default ``~/.cache/gradsync``); then
    ``auto`` times its candidates for the small size classes (:meth:`Runtime.tune`), cached the same way,
    and the first calls of each larger class time the model's pipeline depth beside its half and its
    double (:attr:`Runtime.explore`; ``explore`` turns that on or off, default: as ``calibrate``); each such
    pick joins the same cache, so the next job runs it from its first call.
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
    _RUNTIME = Runtime(tr, topology, algorithm, options=options, mapping=mapping, timeout_s=timeout_s, cost_model=model)
    if calibrate:
        _calibrated(_RUNTIME)
        _tuned(_RUNTIME)
    _RUNTIME.explore = calibrate if explore is None else bool(explore)
    lifetime.on_exit(shutdown)  # a script may end without shutdown(): stop the thread before the groups go
    return _RUNTIME


def tuned_choice(measured: Mapping[tuple[str, int], float], model: tuple[str, int],
                 margin: float = TUNE_MARGIN) -> tuple[str, int]:
    """The model's choice, unless a measured candidate beats it by more than ``margin`` (a share of its time):
    then the fastest. A tie within the margin keeps the model's choice, so noise does not flip it."""
    if model not in measured:
        raise GradsyncError(f"the model's choice {model} was not measured; measured: {sorted(measured)}")
    fastest = min(measured, key=lambda k: (measured[k], k != model))
    return fastest if measured[fastest] < (1.0 - margin) * measured[model] else model


def calibration_cache(rt: Runtime, kind: str = "cost_model") -> str:
    """Where :func:`init` keeps ``rt``'s calibrated model (``kind="cost_model"``: one file per topology, world
    size and base model) or, for the calibrated model, ``auto``'s measured choices (``kind="tuned"``)."""
    import hashlib

    base = os.environ.get("GRADSYNC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradsync")
    what = [rt.topology.name, rt.world_size, rt.cost_model.to_dict()] + ([TUNE_MAX_BYTES] if kind == "tuned" else [])
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(base, f"{kind}-{key}.json")


def _cached(rt: Runtime, kind: str, what: str, use: Callable[[Any], None], measure: Callable[[], Any]) -> None:
    """Apply ``rt``'s cached ``kind`` result (:func:`calibration_cache`) with ``use``, or ``measure()`` it: a
    JSON document (None: nothing worth keeping), which rank 0 writes. Rank 0 reads the cache for every rank;
    one that does not read back (``use`` raises) is measured again with a warning naming ``what``."""
    path = calibration_cache(rt, kind)
    cached = rt._decide(f"{kind}/{os.path.basename(path)}",
                        lambda: open(path, "rb").read() if os.path.isfile(path) else b"")
    if cached:
        try:
            use(json.loads(cached))
            return
        except (ValueError, GradsyncError) as exc:
            warnings.warn(f"ignoring the cached {what} {path} ({exc}); measuring again", stacklevel=4)
    doc = measure()
    if rt.rank == 0 and doc is not None:
        _write_cache(path, doc, what, stacklevel=5)


def _write_cache(path: str, doc: Any, what: str, stacklevel: int) -> None:
    """Write ``doc`` as JSON to ``path`` whole or not at all (a temporary file, then a rename: a job killed while
    writing leaves the old file). A failed write warns, naming ``what``, at ``stacklevel`` counted from here (1:
    this function), and the next job measures again."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"could not cache the {what} in {path} ({exc}); the next job measures again", stacklevel=stacklevel)
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _tuned(rt: Runtime) -> None:
    """Load ``auto``'s measured small-size choices for ``rt``'s calibrated model, or measure them
    (:meth:`Runtime.tune`)."""

    def measure() -> dict[str, Any] | None:
        tuned = rt.tune()
        return {"type": TUNED_TYPE, "classes": {str(k): v for k, v in tuned.items()}} if tuned else None

    _cached(rt, "tuned", "tuned choices", rt.use_tuned, measure)
    rt.tuned_cache = (calibration_cache(rt, "tuned"), rt._generation)  # the larger classes' picks join it


def _calibrated(rt: Runtime) -> None:
    """Load the cached calibration for ``rt`` or measure it (:meth:`Runtime.calibrate`)."""
    _cached(rt, "cost_model", "calibration", lambda doc: rt.set_cost_model(CostModel.from_dict(doc)),
            lambda: rt.calibrate().to_dict())


def load_cost_model(source: CostModel | str | None) -> CostModel | None:
    """A :class:`CostModel` as given, read from a JSON file (validated), or ``None`` for the defaults."""
    if source is None or source == "" or isinstance(source, CostModel):
        return source or None
    import json

    try:
        with open(source, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise GradsyncError(f"cost model file {source!r} cannot be read as JSON: {exc}; "
                            f"write one with CostModel(...).to_dict() or unset GRADSYNC_COST_MODEL") from exc
    return CostModel.from_dict(data)


def is_initialized() -> bool:
    return _RUNTIME is not None


_START = threading.Lock()


def get_runtime() -> Runtime:
    """The default runtime; started here with :func:`init`'s defaults when the user already made a
    torch.distributed process group (as with PyTorch's own hooks, no ``gradsync.init()`` is needed; it stops
    at exit like any runtime ``init`` starts)."""
    rt = _RUNTIME
    if rt is None:
        import torch.distributed as dist

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
