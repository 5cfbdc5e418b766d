"""``auto`` by measurement: calibrate the cost model, tune small size classes, explore large ones, cache it all.

The cost model (:mod:`gradsync.sim.cost`) prices every plan; this module checks the prices on the job's own wire:

* :meth:`Tuning.calibrate` measures the per-message costs, the wire's two-way loss and burst, and prices with them;
* :meth:`Tuning.tune` times every candidate of each small size class, where α and a wire's short-transfer
  behaviour decide and the model is least sure;
* an :class:`Explorer` times the model's pipeline depth beside its half and its double on a large class's first
  calls (real work: every candidate computes the same sum);
* the results are kept as JSON beside the calibration (rank 0 writes, whole or not at all), so the next job on
  the same wire starts decided.

It works through :class:`~gradsync.comm.plans.PlanCache`'s public methods only, and runs its collectives on
the runtime's communication thread through the ``submit`` it is given.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from gradsync.comm.executor import Executor
from gradsync.comm.plans import ALLREDUCE, PLANNED_BACKENDS, Pick, PlanCache
from gradsync.errors import GradsyncError
from gradsync.plan.schedule import Schedule
from gradsync.plan.synthesizers import SYNTHESIZERS
from gradsync.sim.choose import PRUNE
from gradsync.sim.cost import NATIVE, CostModel, burst_of, reverse_share_of, size_class, stream_rate_of
from gradsync.topology.model import Topology

__all__ = ["BURST_PROBE_S", "BURST_TINY_BYTES", "DUPLEX_BYTES", "EXPLORE_DROP", "EXPLORE_DROP_AFTER", "EXPLORE_DROP_WARM", "EXPLORE_MARGIN", "EXPLORE_MAX_CALLS", "EXPLORE_REPS", "EXPLORE_STEPS", "MAX_REVERSE_SHARE", "QUICK_REPS", "TUNED_TYPE",
           "TUNE_MARGIN", "TUNE_MAX_BYTES", "EXPLORE_MIN_BYTES", "Explorer", "Tuning", "cache_file", "load_cost_model", "max_over_ranks", "tuned_choice",
           "write_cache"]

#: Bytes ranks 0 and 1 send one way and both ways when calibrating ``reverse_share`` (and half as many).
DUPLEX_BYTES = 4 << 20
#: Repetitions of the streams in the quick calibration ``init`` runs by default (:meth:`Tuning.load_or_calibrate`
#: with ``quick=True``): κ and the burst from three, not five; three so that a median stands on two of them, and one
#: busy repetition on shared cores cannot set a cost alone (docs/runtime.md). Even the quick one measures the
#: two-way loss: it moves every prediction on a link loaded both ways.
QUICK_REPS = 3
#: The burst probe (:func:`~gradsync.sim.cost.burst_of`): a one-way transfer of this many bytes (all start), and
#: one that takes about :data:`BURST_PROBE_S` at the measured rate (within [16 KiB, half of DUPLEX_BYTES]): long
#: enough that a few milliseconds of a shaper's tokens show above the start's noise, short enough to be cheap.
BURST_TINY_BYTES = 4096
BURST_PROBE_S = 0.025
#: A calibrated ``reverse_share`` above this is capped: a link loaded both ways at under 2/3 of one way is
#: a noisy measurement, not a property of the wire.
MAX_REVERSE_SHARE = 0.5
#: Size classes up to this many bytes are chosen by measurement after calibration (:meth:`Tuning.tune`):
#: there α and the wire's short-transfer behaviour (a shaper's burst, a switch's buffers) decide, which
#: the α-β model prices least well.
TUNE_MAX_BYTES = 256 << 10
#: The ``type`` of a cached :meth:`Tuning.tune` result.
TUNED_TYPE = "gradsync.tuned"
#: A measured candidate replaces the model's choice only when it is faster by more than this share.
TUNE_MARGIN = 0.1
#: Above :data:`TUNE_MAX_BYTES`, an exploring runtime's ``auto`` times the model's pipeline depth beside its
#: half and its double on each class's first calls (:class:`Explorer`): one warm-up call each, then this many
#: timed calls each, interleaved.
EXPLORE_REPS = 3
#: ... and keeps the model's depth unless another is faster by more than this share. Large messages time
#: steadily (the noise of a 4-64 KB call is in its fixed costs), so the margin is smaller than tuning's.
EXPLORE_MARGIN = 0.03
#: After :data:`EXPLORE_DROP_AFTER` timed rounds and each later one but the last, a candidate whose quickest call so
#: far (the slowest rank's) took this many times the quickest candidate's leaves the step, and a step left with one
#: candidate picks it: every call runs the candidate it times, so a plan at twice the backend's time costs the job
#: twice the backend's time on each call it is kept. A call's noise is mostly upward (a busy core: the calls
#: overlap training's backward), so the quickest of two calls is a fair reading of a candidate's pace; one call is
#: not (docs/runtime.md).
EXPLORE_DROP = 1.5
EXPLORE_DROP_AFTER = 2
#: Sooner, after a step's warm-up round, a candidate leaves where two readings agree that it is slow: the model priced
#: it at :data:`EXPLORE_DROP` times the incumbent's price or more, and its warm-up call (the slowest rank's) took this
#: many times the quickest warm-up call or more. A warm-up call carries a plan's first-call costs, so one reading alone
#: would not do; with the price beside it, a candidate dropped in error leaves the model's own ranking, which is what
#: ``auto`` runs without exploring. On the two-tier file at 300 Mbit/s the backend's ring, priced at 1.57-1.63x the
#: pick, measured 1.49-1.56x, and its two timed calls cost the job about 0.35 s each (docs/runtime.md).
EXPLORE_DROP_WARM = 1.25
#: When the double (or the half) wins, the explorer steps once more that way, the winner against the next
#: depth, at most this many times: the optimum is bracketed instead of assumed to lie one step away.
EXPLORE_STEPS = 2
#: The most calls an explorer runs before it picks: a warm-up round and EXPLORE_REPS timed ones of up to five
#: candidates (the model's depth, its double and half, a rival, the backend's collective), then of up to three
#: per step on.
EXPLORE_MAX_CALLS = (1 + EXPLORE_REPS) * (5 + 3 * EXPLORE_STEPS)
#: Size classes from this size up that tuning did not measure are explored (above :data:`TUNE_MAX_BYTES` always;
#: the default ``init`` calibrates without tuning). Below it a call is a few messages' fixed costs, which
#: calibration measures.
EXPLORE_MIN_BYTES = 64 << 10

Submit = Callable[[Callable[[], Any], str], Any]  # Runtime.submit: queue on the communication thread -> Work


def tuned_choice(measured: Mapping[Pick, float], model: Pick, margin: float = TUNE_MARGIN,
                 fallback: Pick | None = None) -> Pick:
    """The model's choice, unless a measured candidate beats it by more than ``margin`` (a share of its time):
    then the fastest. A tie within the margin keeps the model's choice, so noise does not flip it.

    ``fallback`` (the backend's own collective, when measured) needs no margin: within the margin it replaces
    the model's choice as soon as it measured faster. A near-tie is where gradsync would otherwise run a
    little slower than what the user had without it, and running the backend's collective costs nothing new."""
    if model not in measured:
        raise GradsyncError(f"the model's choice {model} was not measured; measured: {sorted(measured)}")
    fastest = min(measured, key=lambda k: (measured[k], k != model))
    if measured[fastest] < (1.0 - margin) * measured[model]:
        return fastest
    if fallback is not None and fallback in measured and measured[fallback] < measured[model]:
        return fallback
    return model


def max_over_ranks(group: Any, values: Sequence[float], device: torch.device) -> list[float]:
    """Each of ``values``' largest over the ranks of ``group`` (timings: the slowest rank's), the same on every
    rank; reduced on ``device``, where the backend takes its tensors (NCCL: this process's GPU)."""
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.tolist()]


def cache_file(prefix: str, key: Any) -> str:
    """``$GRADSYNC_CACHE/<prefix>-<digest of key>.json`` (default ``~/.cache/gradsync``): where a measured result
    valid for ``key`` (any JSON) is kept."""
    base = os.environ.get("GRADSYNC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradsync")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(base, f"{prefix}-{digest}.json")


def write_cache(path: str, doc: Any, what: str, stacklevel: int) -> None:
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


def load_cost_model(source: CostModel | str | None) -> CostModel | None:
    """A :class:`CostModel` as given, read from a JSON file (validated), or ``None`` for the defaults."""
    if source is None or source == "" or isinstance(source, CostModel):
        return source or None
    try:
        with open(source, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise GradsyncError(f"cost model file {source!r} cannot be read as JSON: {exc}; "
                            f"write one with CostModel(...).to_dict() or unset GRADSYNC_COST_MODEL") from exc
    return CostModel.from_dict(data)


class Tuning:
    """One runtime's measurements for ``auto``: calibration, tuned small classes, explored large ones.

    ``submit`` queues a callable on the runtime's communication thread (:meth:`Runtime.submit`), so the
    timings run in order with the job's collectives.
    """

    def __init__(self, plans: PlanCache, submit: Submit) -> None:
        self.plans = plans
        self._submit = submit
        #: measurements per size class (:meth:`tune`'s, and the explorers' with ``"online": true`` and each
        #: step's candidates, times and pick under ``"steps"``); a new cost model keeps them as a record, but
        #: its choices are priced afresh
        self.tuned: dict[int, dict[str, Any]] = {}
        #: whether ``auto`` measures the pipeline depths next to the model's on the first calls of each size
        #: class above :data:`TUNE_MAX_BYTES` (:class:`Explorer`)
        self.explore = False
        #: where rank 0 keeps :attr:`tuned` (:meth:`cache_path`), with the cost-model generation it is keyed by;
        #: each class the first calls settle is added, so the next job with the same wire and model runs the
        #: measured pick from its first call. None: kept nowhere.
        self.tuned_cache: tuple[str, int] | None = None
        self._explorers: dict[int, Explorer | None] = {}

    @property
    def rank(self) -> int:
        return self.plans.transport.rank

    @property
    def world_size(self) -> int:
        return self.plans.transport.world_size

    def set_cost_model(self, model: CostModel, topology: Topology | None = None) -> None:
        """Price with ``model`` (on ``topology``, when given) from now on: plans, choices and explorations made
        with the old ones are dropped."""
        self.plans.reset(model, topology)
        self._explorers.clear()

    # ---- the disk cache ---------------------------------------------------------------------------------
    def cache_path(self, kind: str = "cost_model") -> str:
        """Where the calibrated model is kept (``kind="cost_model"``: one file per topology, world size and base
        model) or, for the calibrated model, ``auto``'s measured choices (``kind="tuned"``)."""
        plans = self.plans
        return cache_file(kind, [plans.topology.name, self.world_size, plans.cost_model.to_dict()]
                          + ([TUNE_MAX_BYTES] if kind == "tuned" else []))

    def cached(self, kind: str, what: str, use: Callable[[Any], None], measure: Callable[[], Any], *,
               announce: bool = True) -> None:
        """Apply the cached ``kind`` result (:meth:`cache_path`) with ``use``, or ``measure()`` it: a JSON
        document (None: nothing worth keeping), which rank 0 writes. Rank 0 reads the cache for every rank; one
        that does not read back (``use`` raises) is measured again with a warning naming ``what``."""
        path = self.cache_path(kind)
        cached = self.plans.decide(f"{kind}/{os.path.basename(path)}",
                                   lambda: open(path, "rb").read() if os.path.isfile(path) else b"")
        if cached:
            try:
                use(json.loads(cached))
                return
            except (ValueError, GradsyncError) as exc:
                warnings.warn(f"ignoring the cached {what} {path} ({exc}); measuring again", stacklevel=4)
        t0 = time.perf_counter()
        announce = announce and self.rank == 0
        if announce:  # seconds of timed collectives at init: say so once, with how to skip it next time
            print(f"gradsync: measuring the {what} on this wire (cached in {path} for the next job; "
                  f"gradsync.init(calibrate=False) skips it)...", file=sys.stderr, flush=True)
        doc = measure()
        if announce:
            print(f"gradsync: {what} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        if self.rank == 0 and doc is not None:
            write_cache(path, doc, what, stacklevel=5)

    def load_or_calibrate(self, *, quick: bool = False) -> None:
        """The cached calibration for this topology and model, or :meth:`calibrate` now (``quick``: the one
        ``init`` runs by default, :data:`QUICK_REPS` repetitions, kept in a file of its own)."""
        kind = "quick_cost_model" if quick else "cost_model"
        self.cached(kind, "calibration", lambda doc: self.set_cost_model(CostModel.from_dict(doc)),
                    lambda: (self.calibrate(QUICK_REPS) if quick else self.calibrate()).to_dict())

    def calibration_pays(self, algorithm: str) -> bool:
        """Whether ``init``'s default calibrates: ``auto`` chooses among planned schedules and the backend's
        ring on this transport (a process group, a backend ``auto`` plans for, more than one rank, process
        order), and the topology lets some plan beat that ring in bandwidth
        (:meth:`~gradsync.sim.choose.Chooser.bandwidth_advantage` above ``1 / (1 - PRUNE)``). There the pick
        turns on the wire's real rates and message costs, which a file's nominal rates do not give; on a flat
        switch the ring stays whatever they are, and nothing is measured. Decided by rank 0 for every rank."""
        plans = self.plans
        caps = plans.caps
        if (algorithm != "auto" or not caps.native or caps.backend not in PLANNED_BACKENDS or self.world_size == 1
                or plans.mapping is not None):
            return False
        raw = plans.decide("calibration_pays", lambda: json.dumps(
            plans.chooser(ALLREDUCE).bandwidth_advantage() > 1 / (1 - PRUNE)).encode())
        return bool(json.loads(raw))

    def load_or_tune(self, *, tune: bool = True) -> None:
        """``auto``'s cached small-size choices for the (calibrated) model, or :meth:`tune` now (``tune=False``:
        only what an earlier job cached); then the larger classes' explored picks join the same file."""

        def measure() -> dict[str, Any] | None:
            tuned = self.tune() if tune else {}
            return {"type": TUNED_TYPE, "classes": {str(k): v for k, v in tuned.items()}} if tuned else None

        self.cached("tuned", "tuned choices", self.use_tuned, measure, announce=tune)
        self.tuned_cache = (self.cache_path("tuned"), self.plans.generation)

    def keep_tuned(self) -> None:
        """Rewrite :attr:`tuned_cache` with :attr:`tuned` (rank 0, :func:`write_cache`), while the cost model is
        still the one it is keyed by."""
        if self.tuned_cache is None or self.rank != 0:
            return
        path, generation = self.tuned_cache
        if generation != self.plans.generation:
            return  # a different cost model now: these picks are not that file's
        write_cache(path, self.tuned_doc(), "measured choices", stacklevel=3)

    def tuned_doc(self) -> dict[str, Any]:
        """:attr:`tuned` as the cache file holds it, what :meth:`use_tuned` takes back (a runtime of its own starts
        from another's measurements with it: the compression sweep's methods)."""
        return {"type": TUNED_TYPE, "classes": {str(size): {k: v for k, v in record.items() if k != "cached"}
                                                for size, record in sorted(self.tuned.items())}}

    def use_tuned(self, doc: Any) -> None:
        """Adopt :meth:`tune`'s choices from its cached JSON (``{"type": "gradsync.tuned", "classes": {bytes:
        {"choice": [algorithm, pipeline], ...}}}``), checked first: a wrong one raises and changes nothing.
        Larger classes there were settled by an earlier job's first calls (:attr:`explore`): they run their pick
        at once, with nothing timed (until a new cost model, which prices every class afresh)."""
        if not isinstance(doc, dict) or doc.get("type") != TUNED_TYPE or not isinstance(doc.get("classes"), dict):
            raise GradsyncError(f"tuned choices must be a JSON object with \"type\": \"{TUNED_TYPE}\" and \"classes\"")
        choices: dict[int, Pick] = {}
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
        for size, pick in choices.items():
            self.plans.choose(size, pick)
        self._explorers.update(dict.fromkeys(choices))  # measured already (a larger class: by an earlier job's calls)
        self.tuned = records

    def final_picks(self) -> dict[int, Pick]:
        """The size classes whose pick is final under this cost model (none of them still exploring), and their
        picks: what :meth:`restore` gives back."""
        return {size: pick for size, pick in self.plans.chosen().items()
                if (ex := self._explorers.get(size)) is None or ex.pick is not None}

    def restore(self, picks: dict[int, Pick]) -> None:
        """Run ``picks`` (from :meth:`final_picks`) at once, measured already: a generation's choices given back when the
        cluster is as it was then (:class:`~gradsync.comm.adapt.Adapter`), without choosing or exploring again."""
        for size, pick in picks.items():
            self.plans.choose(size, pick)
        self._explorers.update(dict.fromkeys(picks))

    # ---- measuring ----------------------------------------------------------------------------------------
    def slowest(self, fn: Callable[[], Any], reps: int) -> float:
        """The slowest rank's median of ``reps`` timings of ``fn`` (after two warm-up calls when ``reps > 1``):
        the same number on every rank."""
        import torch.distributed as dist

        caps = self.plans.caps
        if reps > 1:
            fn()
            fn()
        times = []
        for _ in range(reps):
            dist.barrier(group=caps.group)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return max_over_ranks(caps.group, [statistics.median(times)], caps.collective_device())[0]

    def calibrate(self, reps: int = 5, size_bytes: int = 4096, *, duplex: bool = True) -> CostModel:
        """Measure the per-message costs on this job's wire and price with them (returns the new model).

        Times a ``size_bytes`` allreduce (so bytes hardly count) on the planned ring through the executor,
        and the backend's own ``all_reduce``; the slowest rank's median of ``reps`` is the measurement. α is
        the value at which the model predicts exactly that time (the prediction is affine in α for
        messages this small), the same on every rank. Then rank 0 and the rank behind its slowest path
        (:meth:`duplex_peer`) send half of :data:`DUPLEX_BYTES` and all of it, one way and both ways at once:
        ``reverse_share`` κ is what a link loaded both ways loses on this wire in steady state (acknowledgements,
        the transport's one thread per peer), measured on the extra bytes so that two streams' start-up is not
        counted (:func:`~gradsync.sim.cost.reverse_share_of`; median over ``reps`` alternating repetitions,
        kept in ``[0, 0.5]``). The one-way streams also check the topology's rates, on the extra bytes of the
        larger so that the start is not counted (:func:`~gradsync.sim.cost.stream_rate_of`): a path more than
        ``RATE_TOLERANCE`` times slower than the file says rescales every link first
        (:meth:`~gradsync.sim.cost.CostModel.refined`, with a warning), and α is solved on those rates.
        ``duplex=False`` times the one-way streams only and keeps the model's κ. Last, a tiny and a mid-sized one-way transfer on the same path, each after an idle
        spell, say whether the wire passes a burst above its rate (a token-bucket shaper): ``burst_s``
        (:func:`~gradsync.sim.cost.burst_of`), which the model then gives every link direction. Runs on the communication thread, in order with queued collectives; needs a
        torch.distributed transport.
        """
        if not self.plans.caps.native:
            raise GradsyncError(f"calibration needs a torch.distributed transport; this one is "
                                f"{self.plans.transport.name!r}")
        if not isinstance(reps, int) or reps < 1:
            raise GradsyncError(f"reps={reps!r} must be an integer >= 1")
        if self.world_size == 1:
            return self.plans.cost_model
        return self._submit(lambda: self._calibrate(reps, int(size_bytes), duplex), "calibrate").wait()

    def _calibrate(self, reps: int, size: int, duplex: bool) -> CostModel:
        import torch.distributed as dist

        plans, group, rank = self.plans, self.plans.caps.group, self.rank
        ring, ex, buf = self._ring_probe(size)
        device = buf.device
        far = self.duplex_peer()
        pair = rank in (0, far)
        big = torch.zeros(DUPLEX_BYTES // 4, device=device) if pair else None
        got = torch.empty(DUPLEX_BYTES // 4, device=device) if pair else None

        def one_way(n: int) -> None:
            if rank == 0:
                dist.send(big[:n], group=group, group_dst=far)
            elif rank == far:
                dist.recv(got[:n], group=group, group_src=0)

        def both_ways(n: int) -> None:
            if pair:
                peer = far if rank == 0 else 0
                works = [dist.irecv(got[:n], group=group, group_src=peer),
                         dist.isend(big[:n], group=group, group_dst=peer)]
                for w in works:
                    w.wait()

        half, whole = DUPLEX_BYTES // 8, DUPLEX_BYTES // 4  # elements
        try:
            t_ex = self.slowest(lambda: ex.run(buf), reps)
            t_nat = self.slowest(lambda: dist.all_reduce(buf, group=group), reps)
            rows = []  # one way and both ways alternate, so a busy spell of the CPU hits both alike
            streams = ((one_way, half), (one_way, whole)) + (((both_ways, half), (both_ways, whole)) if duplex else ())
            for _ in range(reps + 1):  # the first repetition warms the connection up and is dropped
                rows.append(tuple(self.slowest(lambda f=f, n=n: f(n), 1) for f, n in streams))
            nbytes, seconds = stream_rate_of([r[:2] for r in rows[1:]], half * 4, whole * 4)
            rate = nbytes / seconds  # the same on every rank: from the slowest rank's timings
            tiny = BURST_TINY_BYTES // 4
            mid = int(min(half, max(4 * tiny, rate * BURST_PROBE_S // 4)))
            bursts = []
            for _ in range(reps + 1):  # idle before each: a barrier, and the bucket refills while ranks meet
                bursts.append(tuple(self.slowest(lambda n=n: one_way(n), 1) for n in (tiny, mid)))
        finally:
            ex.close()
        base = replace(plans.cost_model, burst_s=burst_of(bursts[1:], tiny * 4, mid * 4, rate))
        kappa = reverse_share_of(rows[1:], MAX_REVERSE_SHARE) if duplex else base.reverse_share
        if plans.mapping is None:  # the one-way streams also say whether the file's rates are the wire's
            base, note = base.refined(plans.topology, 0, far, nbytes, seconds)
            if note is not None and rank == 0:
                warnings.warn(f"calibration: {note}; give the topology its real link rates (or a cost model from "
                              f"`gradsync testbed probe --cost-model`) to plan with per-class rates", stacklevel=4)
        nbytes = buf.numel() * 4
        # α is solved on the refined rates: on rates the wire lacks it would absorb the missing transfer time
        zero = replace(base, message_s=0.0, native_message_s=0.0)
        one = replace(base, message_s=1e-3, native_message_s=1e-3)
        topo = plans.topology
        alpha = _solve_alpha(zero.predict(ring, topo, nbytes), one.predict(ring, topo, nbytes), t_ex, base.message_s)
        native = _solve_rising(lambda a: replace(base, native_message_s=a).predict_native(topo, nbytes), t_nat,
                               base.native_message_s)
        model = replace(base, message_s=alpha, native_message_s=native, reverse_share=kappa,
                        source=f"{base.source}; message costs calibrated on {self.world_size} ranks "
                               f"({alpha * 1e6:.0f} us executor, {native * 1e6:.0f} us native; both ways "
                               + (f"{1 / (1 + kappa):.3f} of one way" if duplex else "not measured")
                               + f"; burst {base.burst_s * 1e3:.3g} ms)")
        self.set_cost_model(model)
        return model

    def _ring_probe(self, size: int) -> tuple[Schedule, Executor, torch.Tensor]:
        """The planned ring, an executor for it and a ``size``-byte buffer where the backend takes tensors: what
        α is timed on. Lanes, as the runs the model mostly chooses for (over SMALL_RUN_BYTES) use: a small run's
        key-order waits are cheaper, so α measured with them would under-price every larger run."""
        plans = self.plans
        ring = plans.schedule("ring", 1, check=True)
        ex = Executor(ring, plans.transport, mapping=plans.mapping, timeout_s=plans.timeout_s, progress="lanes")
        return ring, ex, torch.zeros(max(1, size // 4), device=plans.caps.collective_device())

    def measure_message_s(self, reps: int = QUICK_REPS, size_bytes: int = 4096) -> float:
        """α of one executor message on this job's wire and host, as :meth:`calibrate` measures it (a small
        allreduce on the planned ring, the slowest rank's median, solved on the model's rates), without the
        streams or changing the model: every rank calls it at the same point. Ranks that share a host's cores
        wait on one another's messages, which no loopback default knows (docs/runtime.md)."""
        if not self.plans.caps.native:
            raise GradsyncError(f"measuring α needs a torch.distributed transport; this one is "
                                f"{self.plans.transport.name!r}")
        plans = self.plans
        ring, ex, buf = self._ring_probe(int(size_bytes))
        try:
            measured = self.slowest(lambda: ex.run(buf), reps)
        finally:
            ex.close()
        model, topo, nbytes = plans.cost_model, plans.topology, buf.numel() * 4
        at0 = replace(model, message_s=0.0).predict(ring, topo, nbytes)
        at1 = replace(model, message_s=1e-3).predict(ring, topo, nbytes)
        return _solve_alpha(at0, at1, measured, model.message_s)

    def duplex_peer(self) -> int:
        """The rank whose path from rank 0 has the slowest bottleneck (then the fewest hops): the links that
        bound the collectives are the ones whose loss both ways matters (rank 1 under a custom mapping)."""
        plans = self.plans
        if plans.mapping is not None:
            return 1
        paths = plans.cost_model.paths_from(plans.topology, 0)
        return min(range(1, self.world_size), key=lambda p: (*paths[p], p))

    def tune(self, max_bytes: int = TUNE_MAX_BYTES, reps: int = 3, *, auto: bool = True) -> dict[int, dict[str, Any]]:
        """Choose ``auto``'s plan for every size class up to ``max_bytes`` by measuring, not only pricing.

        For small messages the model's α-β prices are least sure: a few messages' fixed costs decide, and
        a wire may pass a short transfer faster than its rate (a shaper's token bucket, a switch's buffers).
        Per class, the model's choice, the native collective and every other algorithm at its best predicted
        pipeline depth and at depth 1 each run ``reps`` times after two warm-ups (the slowest rank's median,
        identical on every rank); a candidate replaces the model's choice only when it is more than
        :data:`TUNE_MARGIN` faster, and the native collective whenever it measured faster (gradsync is not to
        run slower than the backend where the two are near-equal).
        Returns ``{class bytes: {"choice": [algorithm, pipeline], "model": [...], "measured_s": {...}}}``
        (also kept in :attr:`tuned`). Runs on the communication thread like :meth:`calibrate`; a runtime
        that is not ``auto`` (``auto=False``), or has one rank or no torch.distributed transport, has nothing
        to tune.
        """
        if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
            raise GradsyncError(f"reps={reps!r} must be an integer >= 1")
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise GradsyncError(f"max_bytes={max_bytes!r} must be an integer >= 0 (0 tunes nothing)")
        if not self.plans.caps.native or self.world_size == 1 or not auto:
            return {}
        return self._submit(lambda: self._tune(max_bytes, reps), "tune").wait()

    def _tune(self, max_bytes: int, reps: int) -> dict[int, dict[str, Any]]:
        plans = self.plans
        results: dict[int, dict[str, Any]] = {}
        size = size_class(1)
        while size <= max_bytes:
            def candidates(size: int = size) -> bytes:  # priced by rank 0, like every choice
                choice = plans.chooser().choose(size)
                model = (choice.algorithm, choice.pipeline)
                best: dict[str, tuple[float, int]] = {}
                for c in choice.candidates:  # each algorithm at its best predicted depth
                    if c.algorithm not in best or c.predicted_s < best[c.algorithm][0]:
                        best[c.algorithm] = (c.predicted_s, c.pipeline)
                # ... and at depth 1, the fewest messages: at these sizes α, which pipelining multiplies, decides
                pairs = [*((a, p) for a, (_, p) in best.items()), *((a, 1) for a in best)]
                return json.dumps([model, *dict.fromkeys(pr for pr in pairs if pr != model)]).encode()

            tried = [(str(a), int(p)) for a, p in json.loads(plans.decide(f"tune/{size}", candidates))]
            model = tried[0]
            buf = torch.zeros(size // 4, device=plans.caps.collective_device())
            measured = {}
            had = plans.built()
            for name, pipeline in tried:
                ex = plans.executor(name, pipeline, size)
                measured[(name, pipeline)] = self.slowest(lambda ex=ex, buf=buf: ex.run(buf, "sum"), reps)
            pick = tuned_choice(measured, model, fallback=(NATIVE, 1))
            plans.choose(size, pick)
            # executors are cached per (algorithm, depth) with the wait order priced at their first size: drop
            # the candidates this class built but did not pick, so a larger size that runs one later prices
            # its own order, as without tuning (and no unused executor is kept)
            plans.drop(c for c in tried if c not in had and c != pick)
            results[size] = {"choice": list(pick), "model": list(model),
                             "measured_s": {f"{a}/{p}": t for (a, p), t in measured.items()}}
            size *= 2
        self.tuned = results
        return results

    # ---- exploring ----------------------------------------------------------------------------------------
    def explorer(self, size: int, model: Pick) -> Explorer | None:
        """The size class's :class:`Explorer` while it is still measuring (None: not exploring, a class below
        :data:`EXPLORE_MIN_BYTES` or one tuning measured, decided already, nothing to compare, or no process
        group)."""
        if not self.explore or size < EXPLORE_MIN_BYTES or (size <= TUNE_MAX_BYTES and size in self.tuned):
            return None
        if size not in self._explorers:
            self._explorers[size] = self._new_explorer(size, model)
        ex = self._explorers[size]
        return ex if ex is not None and ex.pick is None else None

    def _new_explorer(self, size: int, model: Pick) -> Explorer | None:
        plans = self.plans
        if not plans.caps.native or self.world_size == 1:
            return None

        def candidates() -> bytes:  # priced by rank 0, like every choice: each candidate with its price (or null)
            chooser = plans.chooser()
            choice = chooser.choose(size)
            tried = chooser.explore_candidates(choice, model)
            if len(tried) > 1:
                plans.prepare_orders(size)  # the child pricing ahead, if any, orders the candidates built next
            priced = {(c.algorithm, c.pipeline): c.predicted_s for c in choice.candidates}
            return json.dumps([[a, p, priced.get((a, p))] for a, p in tried]).encode()

        rows = json.loads(plans.decide(f"explore/{size}", candidates))
        tried = [(str(a), int(p)) for a, p, _ in rows]
        priced = {(str(a), int(p)): float(t) for a, p, t in rows if t is not None}
        return Explorer(self, plans.caps.group, size, tried, priced) if len(tried) > 1 else None

    def explored(self) -> dict[int, Explorer | None]:
        """Each large size class met while exploring, and its explorer (None: nothing was timed)."""
        return dict(self._explorers)

    def exploring(self) -> bool:
        """Whether some size class's first calls have started timing pipeline depths and not yet decided: a
        benchmark warms up until this is False, so it times what ``auto`` settled on. A class only planned
        (``executor()`` at set-up, no call run) does not count."""
        return any(ex is not None and ex.pick is None and ex.calls > 0 for ex in self._explorers.values())

    def in_use(self, besides: Explorer | None = None) -> set[Pick]:
        """What some class runs or is measuring (besides ``besides``; a class only planned builds its
        candidates again if it runs)."""
        measuring = {c for e in self._explorers.values() if e is not None and e is not besides
                     and e.pick is None and e.calls > 0 for c in e.candidates}
        return set(self.plans.chosen().values()) | measuring

    def settled(self, size: int, pick: Pick, record: dict[str, Any]) -> None:
        """An explorer's outcome: ``auto`` runs ``pick`` for the class, recorded and cached."""
        self.tuned[size] = record
        self.plans.choose(size, pick)
        self.keep_tuned()


class Explorer:
    """``auto``'s first calls of one large size class: the model's pipeline depth against its half and its
    double (and the best plan of another algorithm the model prices close to it, :data:`~gradsync.sim.choose.EXPLORE_RIVAL`),
    measured on the job's own allreduces, stepping on while the edge wins.

    Above :data:`TUNE_MAX_BYTES` the α-β model ranks algorithms well but not always depths: it charges each
    message's cost in series, while the executor's per-peer lanes overlap much of it. Timing the neighbours
    costs a few calls per class, once per job. Call ``i`` of a step runs candidate ``i mod m`` (the first round
    warms up: plans, scratch, lane threads); after :data:`EXPLORE_REPS` timed rounds the slowest rank's median
    per candidate (one small all-reduce, at the same call on every rank: all ranks run a class's calls in the
    same order) picks with :func:`tuned_choice` and :data:`EXPLORE_MARGIN`, the step's first candidate being
    the incumbent. After :data:`EXPLORE_DROP_AFTER` timed rounds and each later one but the last, a candidate whose
    quickest call so far (the slowest rank's) took :data:`EXPLORE_DROP` times the quickest candidate's leaves the
    step (one more small all-reduce), and a step left with one candidate picks it. When the pick is the double
    (the half), the optimum may lie further that way: up to :data:`EXPLORE_STEPS` more steps time the pick against
    its own double (half), with a fresh warm-up round; when it is the other algorithm, against that algorithm's
    own double and half. A pick that a later step timed again must still beat the model's choice by the margin on
    its latest time, or the model's choice runs (a step's winner is the lowest of several noisy medians, biased
    low); a plan is then held against the backend's latest time. Later calls run the last pick. It runs like an
    executor: every candidate computes the same sum, so the calls that measure are real work, not extra
    collectives.
    """

    def __init__(self, tuning: Tuning, group: Any, size: int, candidates: Sequence[Pick],
                 priced: Mapping[Pick, float] | None = None) -> None:
        self.tuning, self.plans, self.group, self.size = tuning, tuning.plans, group, size
        self.model = candidates[0]
        self.priced = dict(priced or {})  # the model's price of each candidate it priced
        self.calls = 0  # in this job, all steps
        self.pick: Pick | None = None
        #: each step's candidates (incumbent first), measured times and pick: the record ``tuning.tuned`` keeps
        self.steps: list[dict[str, Any]] = []
        self._latest: dict[Pick, float] = {}  # each candidate's latest step time, over every step
        self._had = self.plans.built()  # executors that existed before: never dropped here
        self._begin(candidates)
        #: the model's choice, planned now on the caller's thread (as ``auto`` without exploring would)
        self.first = self.plans.executor(*self.model, size)

    def _begin(self, candidates: Sequence[Pick]) -> None:
        self.candidates = list(candidates)  # those still timed in this step
        self.incumbent = self.candidates[0]
        self._entered = list(candidates)
        self.step_calls = 0  # in this step's rounds, of the candidates still timed
        self._step_start = self.calls
        self.times: dict[Pick, list[float]] = {c: [] for c in self.candidates}
        self._warm: dict[Pick, float] = {}  # this rank's warm-up call of each candidate
        self._pruned: dict[Pick, float] = {}  # left the step: the slowest rank's quickest call

    @property
    def schedule(self) -> Any:
        """The model's choice's schedule (what runs until the explorer picks)."""
        return self.first.schedule

    def run(self, tensors: Any, op: str = "sum") -> Any:
        if self.pick is not None:  # queued before the decision
            return self.plans.executor(*self.pick, self.size).run(tensors, op)
        self.plans.settling += 1  # a call that measures runs a candidate, not what the class will run
        m = len(self.candidates)
        cand = self.candidates[self.step_calls % m]
        ex = self.plans.executor(*cand, self.size)
        t0 = time.perf_counter()
        out = ex.run(tensors, op)
        if self.step_calls >= m:  # the first round warmed up
            self.times[cand].append(time.perf_counter() - t0)
        else:
            self._warm[cand] = time.perf_counter() - t0
        self.step_calls += 1
        self.calls += 1
        if self.step_calls == m and self._priced_slow():
            self._prune_warm()
        elif self.step_calls == m * (1 + EXPLORE_REPS):
            self._settle()
        elif self.step_calls >= m * (1 + EXPLORE_DROP_AFTER) and self.step_calls % m == 0:  # and a round is left
            self._prune()
        return out

    def _priced_slow(self) -> list[Pick]:
        """The step's candidates the model priced at :data:`EXPLORE_DROP` times the incumbent's price or more (none
        where the incumbent was not priced): the same on every rank."""
        mine = self.priced.get(self.incumbent)
        if mine is None:
            return []
        return [c for c in self.candidates if c != self.incumbent and self.priced.get(c, 0.0) >= EXPLORE_DROP * mine]

    def _prune_warm(self) -> None:
        """After the warm-up round: a candidate priced slow (:meth:`_priced_slow`) whose warm-up call (the slowest
        rank's) took :data:`EXPLORE_DROP_WARM` times the quickest warm-up call leaves the step; where one candidate is
        left, it is picked, its warm-up call standing as its time. The same on every rank: the values are agreed."""
        warm = dict(zip(self.candidates, max_over_ranks(self.group, [self._warm[c] for c in self.candidates],
                                                        self.plans.caps.collective_device())))
        fastest = min(warm.values())
        slow = {c: warm[c] for c in self._priced_slow() if warm[c] >= EXPLORE_DROP_WARM * fastest}
        if not slow:
            return
        self._leave(slow, rounds=1)
        if len(self.candidates) == 1:
            self.times[self.candidates[0]] = [warm[self.candidates[0]]]
            self._settle()

    def _leave(self, slow: Mapping[Pick, float], rounds: int) -> None:
        """``slow`` (each with the time it leaves with) leaves the step after ``rounds`` rounds (the warm-up
        included); its executors go unless they existed before or some class runs or measures them."""
        self._pruned.update(slow)
        self.candidates = [c for c in self.candidates if c not in slow]
        self.step_calls = rounds * len(self.candidates)
        in_use = self.tuning.in_use(besides=self)
        self.plans.drop(c for c in slow if c not in self._had and c not in in_use)  # lanes and scratch go

    def _prune(self) -> None:
        """Drop the candidates whose quickest call so far (the slowest rank's) took :data:`EXPLORE_DROP` times the
        quickest one's; pick the one left, if only one is. The same on every rank: the values are agreed."""
        rounds = self.step_calls // len(self.candidates)  # the warm-up included
        quickest = max_over_ranks(self.group, [min(self.times[c]) for c in self.candidates],
                                  self.plans.caps.collective_device())
        fastest = min(quickest)
        slow = {c: t for c, t in zip(self.candidates, quickest) if t >= EXPLORE_DROP * fastest}
        if not slow:
            return
        self._leave(slow, rounds)
        if len(self.candidates) == 1:
            self._settle()

    def _settle(self) -> None:
        """Agree on the step's timings (the slowest rank's) and pick; then step on, or record the pick and drop
        the executors nothing runs."""
        medians = [statistics.median(self.times[c]) for c in self.candidates]
        slowest = max_over_ranks(self.group, medians, self.plans.caps.collective_device())
        measured = dict(zip(self.candidates, slowest))
        timed = {**self._pruned, **measured}  # a candidate that left the step: its quickest call
        self._latest.update(timed)
        incumbent = self.incumbent
        # the pick is one that stayed, unless none beats the incumbent by the margin
        pool = {c: t for c, t in timed.items() if c in measured or c == incumbent}
        pick = tuned_choice(pool, incumbent, EXPLORE_MARGIN, fallback=(NATIVE, 1))
        self.steps.append({"candidates": [list(c) for c in self._entered], "pick": list(pick),
                           "measured_s": {f"{a}/{p}": t for (a, p), t in timed.items()},
                           "pruned": [f"{a}/{p}" for a, p in self._pruned], "calls": self.calls - self._step_start})
        beyond = self._beyond(pick, incumbent)
        keep = self.tuning.in_use(besides=self) | {pick}
        self.plans.drop(c for c in self.candidates if c not in self._had and c not in keep)  # lanes and scratch go
        if beyond:
            self._begin([pick, *beyond])
            return
        model = self.model
        if pick != model and model in self._latest:
            # the pick won its first step on one median among several candidates, the lowest of several noisy
            # draws; where a later step timed it again, its latest time must still beat the model's choice by the
            # margin, else the model's choice runs (docs/runtime.md)
            pick = self._held(pick, model, incumbent=model)
        native = (NATIVE, 1)
        if native in self._latest and pick != native:
            # later steps time the winner against its own depths only: held against the backend's latest time by
            # the rule of every step, a pick that drifted slower than the backend is not kept (docs/runtime.md)
            pick = self._held(pick, native, incumbent=pick, fallback=native)
        self.pick = pick
        self.tuning.settled(self.size, pick, {"choice": list(pick), "model": list(self.model), "online": True,
                                              "measured_s": {f"{a}/{p}": t for (a, p), t in self._latest.items()},
                                              "steps": self.steps})

    def _held(self, pick: Pick, rival: Pick, *, incumbent: Pick, fallback: Pick | None = None) -> Pick:
        """:func:`tuned_choice` between ``pick`` and ``rival`` on their latest times, ``incumbent`` (one of the two)
        kept within the margin; a pick given up releases its executor unless it existed before or is in use."""
        kept = tuned_choice({pick: self._latest[pick], rival: self._latest[rival]}, incumbent, EXPLORE_MARGIN,
                            fallback=fallback)
        if kept != pick and pick not in self._had and pick not in self.tuning.in_use(besides=self):
            self.plans.drop([pick])
        return kept

    def _beyond(self, pick: Pick, incumbent: Pick) -> list[Pick]:
        """The depths to time against ``pick`` when it beat the incumbent, while steps remain: past it (a step's
        other candidates are the incumbent's double and half, so the double's next is its double, the half's its
        half), or, for another algorithm, its own double and half; decided by rank 0 for every rank."""
        name, p = pick
        if pick == incumbent or name == NATIVE or len(self.steps) > EXPLORE_STEPS:
            return []
        if name != incumbent[0]:
            depths = [2 * p, p // 2]
        else:
            depths = [2 * p if p > incumbent[1] else p // 2]
        measured = {tuple(c) for step in self.steps for c in step["candidates"]}
        plans = self.plans
        raw = plans.decide(f"explore/{self.size}/{len(self.steps)}",
                           lambda: json.dumps([q for q in depths if q >= 1 and (name, q) not in measured
                                               and plans.plannable(name, q)]).encode())
        return [(name, int(q)) for q in json.loads(raw)]


def _solve_rising(predict: Callable[[float], float], measured: float, unchanged: float, rounds: int = 40) -> float:
    """The α at which ``predict`` (nondecreasing in α, not affine: the backend's ring overlaps α with the wire,
    :func:`gradsync.sim.simulate`'s ``message_overlap``) reaches ``measured``, by bisection to 0.1 %;
    ``unchanged`` where α does not move it, 1 µs where even α = 0 is slower than measured."""
    lo, hi = 0.0, 1e-3
    if predict(lo) >= measured:
        return 1e-6
    while predict(hi) < measured:
        if hi > 10.0:
            return unchanged
        hi *= 4
    for _ in range(rounds):
        if hi - lo <= 1e-3 * hi:
            break
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if predict(mid) < measured else (lo, mid)
    return max(1e-6, 0.5 * (lo + hi))


def _solve_alpha(at0: float, at1: float, measured: float, unchanged: float) -> float:
    """The α at which a prediction affine in α (``at0`` at 0, ``at1`` at 1 ms) equals ``measured``; ``unchanged``
    where α does not move it."""
    slope = (at1 - at0) / 1e-3
    return max(1e-6, (measured - at0) / slope) if slope > 0 else unchanged
