"""``auto``: the (algorithm, pipeline depth) with the least predicted time, chosen among the synthesizers.

``auto`` is not a synthesizer: it prices every applicable synthesizer's schedule with the runtime's cost model
(:mod:`gradsync.sim.cost`, a simulation) and keeps the fastest, so it sits one layer above :mod:`gradsync.plan`.
:func:`synthesize` is the planner's front door with ``auto`` included: a named algorithm goes to
:func:`gradsync.plan.synthesize` unchanged. The runtime's plan cache (:mod:`gradsync.comm.plans`), the CLI and
the benchmarks all choose through :class:`Chooser`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gradsync.errors import PlanError
from gradsync.plan import synthesizers as _plan
from gradsync.plan.schedule import Schedule
from gradsync.plan.synthesizers import SYNTHESIZERS, PlanOptions
from gradsync.sim.cost import NATIVE, CostModel, native_schedule, size_class
from gradsync.topology.model import Topology

__all__ = ["AUTO", "DEPTH_GAIN_FACTOR", "DEPTH_PATIENCE", "EXPLORE_NATIVE", "EXPLORE_RIVAL", "Candidate", "Choice", "Chooser",
           "Pick", "algorithm_names", "algorithms_for", "native_rival_of", "plan_auto", "rival_of", "synthesize"]

#: The name that asks for the chooser's pick instead of one synthesizer.
AUTO = "auto"

#: A candidate that cannot beat the best so far by this fraction (by its lower bounds) is not simulated.
PRUNE = 0.01
#: An algorithm's deeper pipelines are still priced until this many depths in a row failed to beat its best:
#: a planner may plan a different forest at the next depth (lp), so one rise is not yet its minimum.
DEPTH_PATIENCE = 2
#: An algorithm behind the best so far stops deepening once its time less this many times its latest gains per
#: doubling of the depth cannot beat the best: each doubling at most halves the fill time it gains from (and adds
#: as many messages again), so the gains at least halve and sum to no more than the last one; twice that leaves
#: room for a planner's different forest at the next depth.
DEPTH_GAIN_FACTOR = 2.0
#: A runtime's explorer (:class:`~gradsync.comm.tuning.Explorer`) also times the best plan of another algorithm that
#: the model prices within this share of its choice: near-equal algorithms are where the model's ranking is least sure
#: (docs/runtime.md). The runtime's allreduce chooser prices each algorithm's deeper pipelines until it cannot come
#: this close (``keep_within``).
EXPLORE_RIVAL = 0.1
#: ... and the backend's own collective beside every planned choice, so that ``auto`` settles on a plan only where it
#: measured no slower than the collective the user had without gradsync (the model prices the backend's ring well on
#: a wire, not on cores a plan's executor shares with training). Where the model chose the backend, the best plan is
#: timed beside it where priced within this share.
EXPLORE_NATIVE = 0.25

#: An (algorithm, pipeline depth) pair: what a choice picks and what an executor runs.
Pick = tuple[str, int]


def algorithm_names() -> list[str]:
    """Every name :func:`synthesize` accepts: the registered synthesizers, then ``auto``."""
    return [*SYNTHESIZERS.names(), AUTO]


def algorithms_for(topology: Topology, collective: str = "allreduce") -> list[str]:
    """The names of :func:`algorithm_names` that plan ``collective`` on ``topology`` (``auto`` wherever one does)."""
    able = [n for n, e in SYNTHESIZERS.items() if not e.applicable(topology) and collective in e.supported]
    return [*able, AUTO] if able else []


@dataclass(frozen=True)
class Candidate:
    algorithm: str
    pipeline: int
    predicted_s: float


@dataclass(frozen=True)
class Choice:
    """The chosen (algorithm, pipeline) for one size class, with every candidate's prediction."""

    algorithm: str
    pipeline: int
    predicted_s: float
    size_bytes: float
    candidates: tuple[Candidate, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "pipeline": self.pipeline, "predicted_s": self.predicted_s,
                "size_bytes": self.size_bytes,
                "candidates": [{"algorithm": c.algorithm, "pipeline": c.pipeline, "predicted_s": c.predicted_s}
                               for c in self.candidates]}

    @classmethod
    def from_dict(cls, data: Any) -> Choice:
        """The choice :meth:`to_dict` wrote (another process's: :mod:`gradsync.sim.pricing`), its fields checked."""
        try:
            cands = tuple(Candidate(str(x["algorithm"]), int(x["pipeline"]), float(x["predicted_s"]))
                          for x in data["candidates"])
            return cls(str(data["algorithm"]), int(data["pipeline"]), float(data["predicted_s"]),
                       float(data["size_bytes"]), cands)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"a choice is malformed ({type(exc).__name__}: {exc}): {data!r:.200}") from None


def rival_of(choice: Choice, model: Pick) -> list[Pick]:
    """The best-priced plan of an algorithm other than ``model``'s (the backend's own excluded) among ``choice``'s
    candidates, when the model prices it within :data:`EXPLORE_RIVAL` of ``model``; else nothing.

    An algorithm whose plans are priced exactly as ``model``'s family is the same plan under another name (``lp``
    where one tree meets the cut bound is ``tree``: on the hand-written 4:1 file the rival timed at 1 MiB was
    ``lp``/32 beside ``tree``/32, where ``forest`` was the one to time), so it is passed over."""
    priced = {(c.algorithm, c.pipeline): c.predicted_s for c in choice.candidates}
    mine = priced.get(tuple(model))
    families: dict[str, dict[int, float]] = {}
    for (a, p), t in priced.items():
        families.setdefault(a, {})[p] = t
    same = {a for a, family in families.items() if family == families.get(model[0])}  # model's own included
    others = [(t, pick) for pick, t in priced.items() if pick[0] != NATIVE and pick[0] not in same]
    if mine is None or not others:
        return []
    t, pick = min(others)
    return [pick] if t <= mine * (1 + EXPLORE_RIVAL) else []


def native_rival_of(choice: Choice, model: Pick) -> list[Pick]:
    """What to time against the backend's own collective: for a planned ``model``, the backend's collective wherever
    it was priced (there is a process group); for the backend's, the best-priced plan where the model prices it
    within :data:`EXPLORE_NATIVE` of the backend (a near-tie, where α and the wire's short-transfer behaviour
    decide)."""
    priced = {(c.algorithm, c.pipeline): c.predicted_s for c in choice.candidates}
    mine = priced.get(tuple(model))
    if mine is None:
        return []
    if model[0] != NATIVE:
        return [(NATIVE, 1)] if (NATIVE, 1) in priced else []
    plans = [(t, pick) for pick, t in priced.items() if pick[0] != NATIVE]
    if not plans:
        return []
    t, pick = min(plans)
    return [pick] if t <= mine * (1 + EXPLORE_NATIVE) else []


class Chooser:
    """Plans every applicable algorithm at every pipeline depth once, and picks per size class.

    ``native=True`` adds the backend's own allreduce as a candidate (the runtime does, when its transport
    has a process group). Ties go to the earlier candidate: ``native`` first, so gradsync only replaces the
    backend's collective where the model says it is faster by more than ``margin`` (a fraction).
    ``keep_within``: an algorithm behind the best is priced at deeper pipelines until it cannot come within
    this fraction of the best (0: until it cannot win), so that whoever reads the candidates for a close rival
    (the runtime's explorer) finds that rival's best depth priced. Deterministic: every rank that builds a
    chooser from the same inputs makes the same choices.
    """

    def __init__(self, topology: Topology, model: CostModel | None = None, *, algorithms: Iterable[str] | None = None,
                 native: bool = False, options: PlanOptions | None = None, margin: float = 0.03,
                 keep_within: float = 0.0) -> None:
        self.topology = topology
        self.model = model or CostModel()
        self.options = options or PlanOptions()
        self.native = native
        if not 0 <= margin < 1:
            raise PlanError(f"margin={margin!r} must lie in [0, 1)")
        self.margin = margin
        if not 0 <= keep_within < 1:
            raise PlanError(f"keep_within={keep_within!r} must lie in [0, 1)")
        self.keep_within = keep_within
        names = (list(algorithms) if algorithms is not None
                 else [n for n in SYNTHESIZERS.names() if SYNTHESIZERS.get(n).candidate(self.options)])
        collective = self.options.collective
        if native and collective != "allreduce":
            raise PlanError(f"the backend's native collective is priced for allreduce only, not {collective}; "
                            f"build the chooser with native=False")
        self.algorithms = [n for n in names if not SYNTHESIZERS.get(n).applicable(topology)
                           and collective in SYNTHESIZERS.get(n).supported]
        if not self.algorithms and not native:
            raise PlanError(f"no algorithm plans {collective} on topology {topology.name!r}")
        self._schedules: dict[tuple[str, int], Schedule] = {}
        self._checked: set[tuple[str, int]] = set()
        self._choices: dict[int, Choice] = {}
        self._predicted: dict[tuple[str, float], float] = {}
        self._finish: dict[tuple[str, float], np.ndarray] = {}  # per transfer, of each simulation behind _predicted

    def schedule(self, algorithm: str, pipeline: int, *, check: bool = False) -> Schedule:
        """``algorithm`` planned at ``pipeline`` sub-chunks (cached); ``check``: also self-checked (once),
        as a schedule must be before it runs. Pricing a candidate does not need the check."""
        key = (algorithm, pipeline)
        if key not in self._schedules:
            if algorithm == NATIVE:
                self._schedules[key] = native_schedule(self.topology)
            else:
                self._schedules[key] = _plan.synthesize(algorithm, self.topology, replace(self.options, pipeline=pipeline),
                                                  check=False)
        if check and key not in self._checked:
            self._schedules[key].check(self.topology)
            self._checked.add(key)
        return self._schedules[key]

    def predict(self, schedule: Schedule, size: float) -> float:
        """:meth:`CostModel.predict` of ``schedule`` on this topology, once per distinct set of transfers
        (:attr:`Schedule.digest`): where ``lp``'s optimum is one tree it plans what ``tree`` plans, and a second
        simulation of the same transfers would only repeat the first."""
        key = (schedule.digest, float(size))
        if key not in self._predicted:
            self._simulate(schedule, size)
        return self._predicted[key]

    def _simulate(self, schedule: Schedule, size: float) -> None:
        """One simulation of ``schedule`` for ``size`` bytes: its predicted time and per-transfer finish times kept."""
        key = (schedule.digest, float(size))
        run = self.model.run(schedule, self.topology, size)
        self._predicted[key] = run.time_s
        self._finish[key] = run.transfer_times()[1]

    def finish_times(self, schedule: Schedule, size: float) -> np.ndarray | None:
        """Per transfer, when :meth:`predict` simulated it finishing for ``size`` bytes (None if it did not price
        these transfers at that size): what :meth:`CostModel.wait_order <gradsync.sim.cost.CostModel.wait_order>`
        orders an executor's waits by, without simulating the plan a second time."""
        return self._finish.get((schedule.digest, float(size)))

    def finish_of(self, schedule: Schedule, size: float) -> np.ndarray:
        """:meth:`finish_times`, simulated here where they are not kept (and kept from then on): the finish times of
        a plan the choice did not pick, which a runtime's explorer builds an executor of (:meth:`explore_candidates`)."""
        key = (schedule.digest, float(size))
        if key not in self._finish:
            self._simulate(schedule, size)  # deterministic: a prediction kept already is the same
        return self._finish[key]

    def plannable(self, algorithm: str, pipeline: int) -> bool:
        """Whether ``algorithm`` at depth ``pipeline`` may be measured: a depth the cost model prices, and one that
        plans here."""
        if pipeline not in self.model.pipelines:
            return False
        try:
            self.schedule(algorithm, pipeline)
        except PlanError:
            return False  # too large to plan here: not a candidate
        return True

    def explore_candidates(self, choice: Choice, model: Pick | None = None) -> list[Pick]:
        """What a runtime's explorer times on ``choice``'s class, ``model`` (the choice's pick unless a measurement
        replaced it) first: for a plan, its double and half depth, the best rival algorithm (:func:`rival_of`) and the
        backend's collective (:func:`native_rival_of`); for the backend's, a plan priced close to it. Pure in the
        choice, so whoever prices the class can prepare these candidates' wait orders ahead."""
        model = (choice.algorithm, choice.pipeline) if model is None else (str(model[0]), int(model[1]))
        if model[0] == NATIVE:
            return [model, *native_rival_of(choice, model)]
        depths = [(model[0], q) for q in (2 * model[1], model[1] // 2) if self.plannable(model[0], q)]
        return [model, *depths, *rival_of(choice, model), *native_rival_of(choice, model)]

    def fluid_s(self, algorithm: str, size: float) -> float:
        """``algorithm``'s fluid time for ``size`` bytes on the model's rates (at the first pipeline depth):
        its busiest link's load over that link's rate, the P → ∞, α → 0 limit of :meth:`CostModel.predict`."""
        fast = self.model.rates(self.topology)
        pipeline = 1 if algorithm == NATIVE else self.model.pipelines[0]
        unit = float(self.topology.unit_bandwidth_GBps or 1.0) * 1e9
        return self.schedule(algorithm, pipeline).link_loads(fast).cost(fast.directed_costs) * size / unit

    def bandwidth_advantage(self) -> float:
        """The backend's ring's fluid time over the least of the applicable synthesizers' (1.0 with none).

        Above 1 where the topology lets a plan move fewer bytes over its bottleneck than the rank-order ring
        (racks, BCube): there the choice between plans turns on the link rates the model prices with, so a
        wrong rate (a file's nominal one) picks wrongly. On a flat switch it is 1: the native ring stays
        whatever the rates, and nothing about the wire needs measuring to know it. A candidate too large to
        plan here is left out."""
        best = math.inf
        for name in self.algorithms:
            try:
                best = min(best, self.fluid_s(name, 1.0))
            except PlanError:
                continue
        native = self.fluid_s(NATIVE, 1.0)
        return native / best if best > 0 and math.isfinite(best) else 1.0

    def candidates(self) -> list[tuple[str, int]]:
        """Every (algorithm, pipeline) the chooser may consider, ``native`` first."""
        return ([(NATIVE, 1)] if self.native else []) + [(n, p) for n in self.algorithms for p in self.model.pipelines]

    def chosen(self, nbytes: float) -> Choice | None:
        """The choice already made for ``nbytes``'s size class, or None (nothing is priced)."""
        return self._choices.get(size_class(nbytes))

    def choose(self, nbytes: float, *, exact: bool = False) -> Choice:
        """The choice for ``nbytes``'s size class (cached), or for ``nbytes`` itself with ``exact``."""
        if exact:
            return self._choose(float(nbytes))
        size = size_class(nbytes)
        got = self._choices.get(size)
        if got is None:
            got = self._choices[size] = self._choose(size)
            # keep the finish times of the pick only (the executor built next is ordered by them): one array per
            # transfer of each candidate would hold hundreds of MB on a large fabric across the size classes
            keep = None if got.algorithm == NATIVE else (self.schedule(got.algorithm, got.pipeline).digest, float(size))
            for key in [k for k in self._finish if k[1] == float(size) and k != keep]:
                del self._finish[key]
        return got

    def priced(self, size: float) -> tuple[dict[str, float], tuple[str, np.ndarray] | None]:
        """What pricing ``size``'s class left behind: each simulated schedule's predicted time (by
        :attr:`Schedule.digest <gradsync.plan.schedule.Schedule.digest>`), and the pick's digest and finish times
        (None for the backend's own collective): what :meth:`adopt` records in an identical chooser elsewhere."""
        size = float(size)
        predicted = {digest: t for (digest, s), t in self._predicted.items() if s == size}
        choice = self._choices.get(size_class(size))
        finish = None
        if choice is not None and choice.algorithm != NATIVE:
            digest = self.schedule(choice.algorithm, choice.pipeline).digest
            times = self._finish.get((digest, size))
            finish = None if times is None else (digest, times)
        return predicted, finish

    def adopt(self, choice: Choice, predicted: dict[str, float],
              finish: tuple[str, np.ndarray] | None) -> None:
        """Record ``choice`` as this chooser's for its size class, with :meth:`priced`'s leftovers, as priced by an
        identical chooser in another process (:mod:`gradsync.sim.pricing`): the chooser is deterministic, so these are
        the bits :meth:`choose` would compute. A class chosen here already keeps its own."""
        size = size_class(choice.size_bytes)
        if size in self._choices:
            return
        for digest, t in predicted.items():
            self._predicted.setdefault((digest, float(size)), t)
        if finish is not None:
            self._finish[(finish[0], float(size))] = finish[1]
        self._choices[size] = choice

    def _choose(self, size: float) -> Choice:
        """Least predicted time over the candidates, with exact prunings by two lower bounds of a
        schedule's prediction: its fluid time ``cost * size / unit_bw`` (which pipelining approaches from
        above) and ``α`` times the most messages one rank receives (it handles them one at a time). A
        candidate whose bound is within :data:`PRUNE` of the best so far is not simulated: it could win by
        less than that at most (lp converging on BML's optimum at depth 64 would otherwise cost minutes).
        Algorithms are tried by increasing fluid time, so the first good one prunes the rest; an
        algorithm's pipeline depths are tried in increasing order until the bound passes the best (α grows
        with the depth while the fill time shrinks) or :data:`DEPTH_PATIENCE` depths in a row failed to beat
        the algorithm's best (α against fill has one minimum, but lp may plan a different forest at each
        depth: on three racks with a slower one it priced 0.650, 0.651, 0.621, 0.616 s at depths 4 to 32). An
        algorithm behind another's best also stops where its gains per doubling say it cannot catch up
        (:meth:`_done_deepening`): the deepest pipelines are the costliest simulations, and on three racks at
        16 MiB most of the pricing went to plans that lost by 10 % or more."""
        cands: list[Candidate] = []
        if self.native:
            cands.append(Candidate(NATIVE, 1, self.model.predict_native(self.topology, size)))
        fluid: dict[str, float] = {}
        refused: dict[str, str] = {}
        for name in self.algorithms:
            try:
                fluid[name] = self.fluid_s(name, size)
            except PlanError as exc:  # too large to plan here (the planner's memory estimate): not a candidate
                refused[name] = str(exc)
        for name in sorted(fluid, key=lambda n: fluid[n]):  # stable: registry order on ties
            best_so_far = min((c.predicted_s for c in cands), default=math.inf)
            if fluid[name] >= best_so_far * (1 - PRUNE):
                break  # every later algorithm's fluid time is larger still
            mine, misses, gains, last = math.inf, 0, [], math.inf
            for p in self.model.pipelines:
                try:
                    sched = self.schedule(name, p)
                except PlanError:
                    break  # deeper pipelines only grow
                dst = sched.arrays["dst"]
                busiest = int(np.bincount(dst).max()) if dst.size else 0
                if max(fluid[name], busiest * self.model.message_s) >= best_so_far * (1 - PRUNE):
                    break  # this depth cannot win, and deeper ones only receive more messages
                t = self.predict(sched, size)
                cands.append(Candidate(name, p, t))
                misses = 0 if t < mine else misses + 1
                if misses >= DEPTH_PATIENCE:
                    break
                if math.isfinite(last):
                    gains = (gains + [last - t])[-DEPTH_PATIENCE:]
                last, mine = t, min(mine, t)
                if gains and mine > best_so_far and self._done_deepening(mine, t - DEPTH_GAIN_FACTOR * max(gains),
                                                                           best_so_far, misses):
                    break
                best_so_far = min(best_so_far, t)
        if not cands:
            raise PlanError(f"no algorithm can be planned for {self.topology.name!r} here: "
                            + "; ".join(f"{n}: {why}" for n, why in refused.items()))
        best = min(cands, key=lambda c: c.predicted_s)
        if self.native and best.algorithm != NATIVE:
            nat = cands[0]
            if best.predicted_s > nat.predicted_s * (1 - self.margin):
                best = nat  # not clearly faster: keep the backend's own collective
            elif fluid[best.algorithm] >= self.fluid_s(NATIVE, size) * (1 - PRUNE):
                # No bandwidth advantage over the backend's ring (a flat switch): any predicted gain is in
                # the per-message costs, where calibration is least certain and the backend runs in C++.
                best = nat
        return Choice(best.algorithm, best.pipeline, best.predicted_s, size, tuple(cands))

    def _done_deepening(self, mine: float, floor: float, best: float, misses: int) -> bool:
        """Whether an algorithm behind ``best`` (another's) stops deepening: by its gains per doubling it cannot get
        below ``floor`` (:data:`DEPTH_GAIN_FACTOR`), so it cannot win, and either it cannot come within
        ``keep_within`` of ``best`` or it is that close already and its last depth did not improve on ``mine`` (a
        rival's best depth is found; the explorer steps over its depths by measurement)."""
        floor = min(mine, floor)
        if floor < best * (1 - PRUNE):
            return False
        close = best * (1 + self.keep_within)
        return not self.keep_within or floor >= close or (mine <= close and misses > 0)

    def table(self, sizes: Sequence[float]) -> list[Choice]:
        return [self.choose(s) for s in sizes]


def plan_auto(topology: Topology, options: PlanOptions) -> Schedule:
    """The (algorithm, pipeline depth) with the least time for ``size_bytes`` under the runtime's cost model
    (store-and-forward per sub-chunk, a cost per message), not the fluid cost. The schedule's ``meta["auto"]``
    records the pick and every candidate's predicted time."""
    chooser = Chooser(topology, options=options)
    choice = chooser.choose(options.size_bytes, exact=True)
    chosen = chooser.schedule(choice.algorithm, choice.pipeline)
    times = {f"{c.algorithm}/{c.pipeline}": c.predicted_s for c in choice.candidates}
    meta = {**dict(chosen.meta), "auto": {"chosen": chosen.algorithm, "pipeline": choice.pipeline,
                                          "algorithms": list(chooser.algorithms), "predicted_time_s": times}}
    return replace(chosen, meta=meta)


def synthesize(algorithm: str, topology: Topology, options: PlanOptions | None = None, *, check: bool = True,
               max_bytes: float = _plan.MAX_PLAN_BYTES) -> Schedule:
    """:func:`gradsync.plan.synthesize`, with ``auto`` (:func:`plan_auto`) among the names."""
    if algorithm != AUTO:
        return _plan.synthesize(algorithm, topology, options, check=check, max_bytes=max_bytes)
    schedule = plan_auto(topology, options or PlanOptions())
    if check:
        schedule.check(topology)
    return schedule
