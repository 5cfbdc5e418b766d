"""The runtime's plans: one cache of choices and executors that serves allreduce, reduce-scatter and allgather.

A plan is chosen per (collective, message-size class) and built once per (collective, algorithm, pipeline
depth): the schedule from the collective's :class:`~gradsync.sim.choose.Chooser` (self-checked before it
runs) and an :class:`~gradsync.comm.executor.Executor` that waits for its messages in the cost model's predicted
arrival order. Every decision a rank could make differently (``auto``'s pick, that order) is made once for the
job through the transport's ``decide`` and keyed by the cost model's generation: a new model prices afresh.
Tuning (:mod:`gradsync.comm.tuning`) works only through the public methods here.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from gradsync.comm.collectives import NativeAllreduce
from gradsync.comm.executor import Executor
from gradsync.comm.transport import Transport
from gradsync.env import env_number
from gradsync.errors import GradsyncError, PlanError
from gradsync.plan.schedule import Schedule
from gradsync.plan.synthesizers import PlanOptions
from gradsync.sim.choose import EXPLORE_RIVAL, PRUNE, Chooser, Pick
from gradsync.sim.cost import MAX_ORDERED_TRANSFERS, NATIVE, CostModel, native_schedule, size_class
from gradsync.sim.pricing import Pricer
from gradsync.topology.model import Topology

__all__ = ["ALLREDUCE", "ANNOUNCE_PRICING_S", "PLANNED_BACKENDS", "PLAN_TIMEOUT_S",
           "PRICE_AHEAD_ENV", "Pick", "PlanCache", "price_ahead"]

#: How long ranks wait for rank 0 to price and publish a plan decision (it may simulate for a while).
PLAN_TIMEOUT_S = 600.0
#: A size class whose pricing took at least this many seconds is announced on rank 0's stderr: the stall it puts in
#: a job's first steps (every rank waits for rank 0's simulations), said once, with its cause.
ANNOUNCE_PRICING_S = 1.0
#: The environment variable that turns pricing ahead off (``0``; :meth:`PlanCache.anticipate`).
PRICE_AHEAD_ENV = "GRADSYNC_PRICE_AHEAD"
#: The collective every synthesizer plans, and the only one the backend's native collective is priced for.
ALLREDUCE = "allreduce"
#: Backends on which ``auto`` chooses among the planned schedules too. Elsewhere (NCCL) it runs the backend's
#: own collective: no planned schedule has been measured there yet, and ``auto`` never picks a path that has
#: not run on its engine. A named algorithm still runs, over the backend's point-to-point messages.
PLANNED_BACKENDS = frozenset({"gloo", ""})

Runnable = Executor | NativeAllreduce


class PlanCache:
    """Choices per (collective, size class) and executors per (collective, algorithm, depth), for one job.

    ``auto``'s chooser for allreduce has the backend's own collective among its candidates when the transport
    has a process group and topology ranks are process ranks (it runs in process order), so ``auto`` never
    loses to it where the model says they are equal (a flat switch, small messages).
    """

    def __init__(self, transport: Transport, topology: Topology, *, options: PlanOptions,
                 mapping: Sequence[int] | Mapping[str, int] | None, timeout_s: float, cost_model: CostModel) -> None:
        self.transport = transport
        self.caps = transport.capabilities
        self.topology = topology
        self.options = options
        self.mapping = mapping
        self.timeout_s = timeout_s
        self.cost_model = cost_model
        #: bumped by :meth:`reset`: decisions are per cost model
        self.generation = 0
        #: what this cache's decisions are keyed under besides the generation: a runtime that is not its transport's
        #: first sets it (:mod:`gradsync.comm.claims`), so it never reads an earlier runtime's answer to a key
        self.namespace = ""
        #: bumped whenever a call settles something before or while it runs: a size class's choice priced, a planned
        #: executor built (not the backend's own collective's, which costs nothing to make), an exploring call
        #: (:class:`~gradsync.comm.tuning.Explorer`). A call that bumped it took longer than the exchange it will run
        #: from then on, so a timing that spans a bump is not that exchange's (:attr:`Runtime.settling
        #: <gradsync.comm.runtime.Runtime.settling>`)
        self.settling = 0
        self._choosers: dict[str, Chooser] = {}
        self._planner: Chooser | None = None  # named allreduce plans, without pricing any candidate
        self._choices: dict[tuple[str, int], Pick] = {}
        self._executors: dict[tuple[str, str, int], Runnable] = {}
        #: the child pricing allreduce classes ahead (:meth:`anticipate`), for this generation
        self.pricer: Pricer | None = None
        #: why this generation prices nothing ahead (None: not asked yet, or it does)
        self.ahead_refused: str | None = None
        self._ahead_lock = threading.Lock()

    # ---- planning ---------------------------------------------------------------------------------------
    def chooser(self, collective: str = ALLREDUCE) -> Chooser:
        """Picks (algorithm, pipeline depth) per size class of ``collective`` with the cost model."""
        got = self._choosers.get(collective)
        if got is None:
            if collective == ALLREDUCE:
                native = self.caps.native and self.mapping is None
                algorithms = None if self.caps.backend in PLANNED_BACKENDS or not native else []
                got = Chooser(self.topology, self.cost_model, algorithms=algorithms, native=native,
                              options=self.options, keep_within=EXPLORE_RIVAL)
            else:
                got = Chooser(self.topology, self.cost_model, native=False,
                              options=replace(self.options, collective=collective))
            self._choosers[collective] = got
        return got

    def schedule(self, name: str, pipeline: int, collective: str = ALLREDUCE, *, check: bool = False) -> Schedule:
        """``name`` planned at ``pipeline`` for ``collective`` (cached; ``check``: self-checked once). A named
        allreduce is planned without building ``auto``'s candidates."""
        if collective == ALLREDUCE and collective not in self._choosers:
            if self._planner is None:
                self._planner = Chooser(self.topology, self.cost_model, algorithms=[], native=True,
                                        options=self.options)
            return self._planner.schedule(name, pipeline, check=check)
        return self.chooser(collective).schedule(name, pipeline, check=check)

    def shared_schedule(self, name: str, pipeline: int, collective: str = ALLREDUCE) -> Schedule:
        """``name`` at ``pipeline`` for ``collective`` as every rank runs it: rank 0's plan (kept from its pricing, or
        planned now), its plain data shared through :meth:`decide` and checked here. Each rank planning its own copy
        cost every other rank the plan's solve (``forest``'s LP), which rank 0 had made already while pricing and then
        waited for in the plan's first call (docs/runtime.md), and rested on every rank's solver finding the same
        optimum; a shared plan is the one rank 0 priced and ordered the waits of."""
        mine: list[Schedule] = []

        def planned() -> bytes:
            mine.append(self.schedule(name, pipeline, collective, check=True))
            return json.dumps(mine[0].to_dict()).encode()

        raw = self.decide(f"schedule/{collective}/{name}/{pipeline}", planned)
        if mine:  # this rank planned it (rank 0, or a transport that decides locally): checked already
            return mine[0]
        try:
            schedule = Schedule.from_dict(json.loads(raw))
            schedule.check(self.topology)
        except (ValueError, GradsyncError) as exc:
            raise PlanError(f"the {name} plan at depth {pipeline} that rank 0 shared for {collective} does not run "
                            f"on {self.topology.name!r} here: {exc}; every rank must start gradsync with the same "
                            "topology and options") from exc
        return schedule

    def plannable(self, name: str, pipeline: int) -> bool:
        """Whether allreduce by ``name`` at depth ``pipeline`` may be measured: a depth the cost model prices,
        and one that plans here."""
        return self.chooser().plannable(name, pipeline)

    def decide(self, key: str, compute: Callable[[], bytes]) -> bytes:
        """``compute()`` once for the job (rank 0, shared through the transport) under this cost model, or
        here when the transport cannot share."""
        if self.caps.decide is None:
            return compute()
        return bytes(self.caps.decide(f"{self.namespace}g{self.generation}/{key}", compute,
                                      max(self.timeout_s, PLAN_TIMEOUT_S)))

    # ---- choices ----------------------------------------------------------------------------------------
    def adopt(self, chooser: Chooser) -> None:
        """Price allreduce with ``chooser``, made for this cache's topology, cost model and options by whoever
        priced a replan before it ran (:class:`~gradsync.comm.adapt.Adapter`): its plans and choices are not
        made a second time while every rank waits."""
        if (chooser.topology is not self.topology or chooser.model is not self.cost_model
                or chooser.options != self.options):
            raise GradsyncError("adopt() takes a chooser made for this plan cache's topology, cost model and "
                                "options; build one with PlanCache.chooser() instead")
        with self._ahead_lock:
            if self.pricer is not None and self.pricer.chooser is not chooser:
                self.pricer.close()  # it prices for the chooser replaced
                self.pricer, self.ahead_refused = None, None
        self._choosers[ALLREDUCE] = chooser

    def choice(self, size: int, collective: str = ALLREDUCE) -> Pick:
        """``auto``'s pick for a size class: a measured one (:meth:`choose`), or the model's, priced once for
        the job."""
        got = self._choices.get((collective, size))
        if got is None:
            chooser = self.chooser(collective)

            def compute() -> bytes:
                t0 = time.perf_counter()
                pricer = self.pricer
                if pricer is not None and collective == ALLREDUCE and not pricer.take(size, max(self.timeout_s,
                                                                                                PLAN_TIMEOUT_S)):
                    pricer.skip(size)  # not priced ahead (yet): priced here, and the child goes on to the next
                c = chooser.choose(size)
                took = time.perf_counter() - t0
                if took >= ANNOUNCE_PRICING_S and self.transport.rank == 0:
                    who = "every rank prices it" if self.caps.decide is None else "the other ranks wait for rank 0"
                    print(f"gradsync: priced {collective} plans for the {_mib(size)} size class on "
                          f"{self.topology.name!r} in {took:.1f} s ({len(c.candidates)} candidates; a size's first call "
                          f"pays it, and {who}): {c.algorithm} at depth {c.pipeline}", file=sys.stderr, flush=True)
                return json.dumps([c.algorithm, c.pipeline]).encode()

            where = "" if collective == ALLREDUCE else f"{collective}/"
            name, pipeline = json.loads(self.decide(f"choice/{where}{size}", compute))
            got = self._choices[(collective, size)] = (str(name), int(pipeline))
            self.settling += 1
        return got

    def anticipate(self, sizes: Iterable[float], *, first: bool = False, orders_from: int | None = None) -> None:
        """Have the allreduce size classes of ``sizes`` priced ahead of their first calls, in this order (before those
        asked for earlier with ``first``: a caller about to need them), by a child
        process (:class:`~gradsync.sim.pricing.Pricer`): their first calls then adopt the choice instead of every
        rank waiting while rank 0 simulates. Only where it pays: on rank 0 of a transport that shares its decisions,
        where ``auto`` has plans to price and the fabric gives a plan a bandwidth advantage over the backend's ring
        (elsewhere the pricing prunes at once). A child that cannot start or
        fails leaves the pricing here, as without it. ``orders_from``: the child also prepares the wait orders of
        the neighbours an explorer times (:meth:`prepare_orders`) for each class of at least that many bytes it priced,
        once nothing else is asked (None: only those asked for; set when the child starts)."""
        todo = [n for n in sizes if (ALLREDUCE, size_class(n)) not in self._choices]
        with self._ahead_lock:  # callers' threads (a hook's, the optimizer's) and a replan's close
            if todo and self._started(orders_from):
                self.pricer.ask(todo, first=first)  # type: ignore[union-attr]  (started: a child runs)

    def start_ahead(self, *, orders_from: int | None = None) -> bool:
        """Start the child pricing ahead now, before any size is asked, where :meth:`anticipate` would: its
        interpreter's start and imports take seconds, and a model's optimizer or hook anticipates its sizes about a
        step before it sends them, so a child started then was still starting at the first call, and rank 0 priced
        the class itself while every rank waited (docs/runtime.md). Whether a child runs; ``orders_from`` as in
        :meth:`anticipate`."""
        with self._ahead_lock:
            return self._started(orders_from)

    def _started(self, orders_from: int | None) -> bool:
        """The child pricing ahead, started here if none runs yet and this generation prices ahead (the caller holds
        the lock); whether one runs."""
        if self.pricer is not None:
            return True
        if self.ahead_refused is not None:
            return False
        self.ahead_refused = self._ahead_refusal()
        if self.ahead_refused is not None:
            return False
        try:
            self.pricer = Pricer(self.chooser(), orders_from=orders_from)
        except (PlanError, OSError) as exc:
            self.ahead_refused = f"the pricer did not start: {exc}"
            return False
        return True

    def prepare_orders(self, size: int) -> None:
        """A size class's explorer starts: have the child pricing ahead (if there is one) prepare the finish times of
        the neighbours it will build executors of on its next calls, so that their wait orders need no simulation
        while every rank waits (:meth:`executor`)."""
        with self._ahead_lock:
            if self.pricer is not None:  # one that stopped says nothing more (Pricer._send)
                self.pricer.want_orders(size)

    def _ahead_refusal(self) -> str | None:
        """Why this generation does not price ahead (None: it does)."""
        if self.caps.decide is None:
            return "every rank prices its own choices on this transport (a child each would cost a core per rank)"
        if self.transport.rank != 0:
            return "rank 0 prices for the job"
        chooser = self.chooser()
        if not chooser.algorithms:
            return "no plan is priced here (the backend's own collective only)"
        if chooser.bandwidth_advantage() <= 1 / (1 - PRUNE):
            return "no plan moves fewer bytes than the backend's ring here: pricing prunes at once"
        return None

    def choose(self, size: int, pick: Pick, collective: str = ALLREDUCE) -> None:
        """Run ``pick`` for the size class from now on (a measurement replaced the model's choice)."""
        self._choices[(collective, size)] = pick

    def chosen(self, collective: str = ALLREDUCE) -> dict[int, Pick]:
        """The size classes decided so far, and their picks."""
        return {size: pick for (c, size), pick in self._choices.items() if c == collective}

    # ---- executors --------------------------------------------------------------------------------------
    def executor(self, name: str, pipeline: int, size: int, collective: str = ALLREDUCE) -> Runnable:
        """The executor of ``(name, pipeline)`` for ``collective``, built once; its wait order is priced at the
        ``size`` it is first built for."""
        key = (collective, name, pipeline)
        ex = self._executors.get(key)
        if ex is None:
            if name == NATIVE:
                if collective != ALLREDUCE or not self.caps.native:
                    raise GradsyncError(f"algorithm {NATIVE!r} runs the backend's allreduce, which needs a "
                                        f"torch.distributed transport; this one is {self.transport.name!r} and the "
                                        f"collective {collective!r}")
                ex = NativeAllreduce(self.transport, native_schedule(self.topology))
            else:
                schedule = self.shared_schedule(name, pipeline, collective)
                order = None
                if schedule.num_transfers <= MAX_ORDERED_TRANSFERS:
                    def ordered() -> bytes:
                        # priced when it was chosen, or prepared by the child pricing ahead (an explorer's neighbour)
                        known = self.chooser(collective).finish_times(schedule, size)
                        pricer = self.pricer
                        if known is None and pricer is not None and collective == ALLREDUCE:
                            known = pricer.order(size, schedule.digest, max(self.timeout_s, PLAN_TIMEOUT_S))
                        return self.cost_model.wait_order(schedule, self.topology, size, known).astype("<f8").tobytes()

                    raw = self.decide(f"order/{collective}/{name}/{pipeline}/{size}", ordered)
                    order = np.frombuffer(raw, "<f8")
                ex = Executor(schedule, self.transport, mapping=self.mapping, timeout_s=self.timeout_s, order=order)
                self.settling += 1  # planned, checked and ordered: the backend's own collective costs nothing to make
            self._executors[key] = ex
        return ex

    def owns(self, ex: object) -> bool:
        """Whether ``ex`` is one of the executors this cache runs now (a queued collective whose executor was
        dropped since, by a replan, picks its executor again)."""
        return any(v is ex for v in self._executors.values())

    def built(self, collective: str = ALLREDUCE) -> set[Pick]:
        """The (algorithm, depth) pairs with an executor for ``collective``."""
        return {(name, p) for (c, name, p) in self._executors if c == collective}

    def drop(self, picks: Iterable[Pick], collective: str = ALLREDUCE) -> None:
        """Close and forget the executors of ``picks`` (measured candidates nothing goes on to run)."""
        for name, pipeline in picks:
            dropped = self._executors.pop((collective, name, pipeline), None)
            if isinstance(dropped, Executor):
                dropped.close()

    def reset(self, model: CostModel, topology: Topology | None = None) -> None:
        """Price with ``model`` (and plan on ``topology``, when given: a link scaled or dropped while the job
        runs) from now on: every choice, plan and executor made with the old ones goes."""
        self.close()
        self.cost_model = model
        if topology is not None:
            self.topology = topology
        self._choosers.clear()
        self._planner = None
        self._choices.clear()
        self.ahead_refused = None
        self.generation += 1

    def stop_ahead(self, why: str = "stopped") -> None:
        """End the child pricing ahead, if one runs, and start none again for this generation (``why``: what
        :attr:`ahead_refused` then says): sizes are priced at their first call from now on, as without it."""
        with self._ahead_lock:
            if self.pricer is not None:
                self.pricer.close()
                self.pricer = None
            self.ahead_refused = why

    def close(self) -> None:
        """Stop every executor's waiting threads and forget the executors (the native one has none); end the child
        pricing ahead."""
        self.stop_ahead("closed")
        for ex in self._executors.values():
            if isinstance(ex, Executor):
                ex.close()
        self._executors.clear()


def price_ahead() -> bool:
    """Whether a runtime prices sizes ahead when asked (:meth:`PlanCache.anticipate`): ``GRADSYNC_PRICE_AHEAD``, 1 (the
    default) or 0."""
    on = env_number(PRICE_AHEAD_ENV, 1, int)
    if on not in (0, 1):
        raise GradsyncError(f"{PRICE_AHEAD_ENV}={on} must be 0 (off) or 1 (price sizes ahead in a child process); "
                            f"unset it for 1")
    return bool(on)


def _mib(nbytes: int) -> str:
    """``nbytes`` for a person: KiB below a MiB, MiB from there."""
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"
