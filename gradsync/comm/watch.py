"""Watching the wire while it runs: rolling estimates of link rates and late ranks, and a detector with
hysteresis that proposes a new cost model when the cluster leaves the one the plan was made for (issue 39).

Pure bookkeeping, no transport and no clock of its own: the caller hands in what the executor already knows
(when each message was posted and when it completed) and when each rank entered the collective, so the
same code runs on a real wire and on a fake clock in tests.

* :func:`collective_rates`: per key (a ``(src, dst)`` rank pair, or a link class) the bytes one collective
  moved divided by the time that key had a message in flight (the *union* of the ``[posted, done]``
  intervals). The messages of one pair share one connection and queue behind each other, so a single
  message's ``bytes / (done - posted)`` would count the queueing as slowness; the union counts each second
  of the connection's work once, and idle gaps (waiting for a dependency) not at all. Keys that moved fewer
  than ``min_bytes`` in a collective give no observation: their time is the per-message α, not the wire.
* :func:`arrival_delays`: per rank, how long after the others it entered the collective, measured from the
  *lower median* arrival (one early rank does not make everyone late; with two ranks it is the earlier one).
* :class:`RollingEstimates`: the last ``window`` per-collective values of each key and rank, and their
  median: O(window) memory and time per key, robust to one outlier, no lag beyond the window.
* :class:`Detector`: a run-length rule with hysteresis per key and per rank. A key is *degraded* after
  ``k`` consecutive collectives beyond the ``enter`` threshold and *healthy* again after ``k_leave``
  consecutive collectives back inside ``leave``; between the two thresholds nothing changes. So noise that
  stays below ``enter`` never switches, a single outlier resets the run, and a value that hovers at the
  threshold cannot flip plans each step. Every change of state is one :class:`Switch`: the new
  :class:`Conditions` (scaled link rates, a late rank), the plans before and after, the predicted gain when
  a predictor is given, a generation number, and one log line.

Links are compared with what the baseline (undegraded) cost model predicts for the plan that ran, as the
ratio ``measured / expected``: a sharing pattern the model already prices (a tree's fan-in) is not a slow
link, and recovery is visible because the baseline stays the reference after a switch. :func:`link_scales`
turns pair ratios into per-link-direction capacity scales for the planner (the fewest links that explain the
slow pairs), and :func:`scaled_topology` applies them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gradsync.errors import GradsyncError
from gradsync.plan.routing import router_for
from gradsync.topology.model import LINK_SCALE, Topology, recorded_link_scales

__all__ = ["Conditions", "Detector", "Hysteresis", "RollingEstimates", "Sample", "Switch", "arrival_delays",
           "collective_rates", "describe_switch", "link_scales", "on_time_pairs", "scaled_topology", "seen"]

#: Below this many bytes per key and collective, a rate measures α, not the wire (the executor's α is
#: ~150 µs; 256 KiB at 10 Gbit/s is ~200 µs).
MIN_BYTES = 256 * 1024


def _number(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise GradsyncError(f"{name}={value!r} must be a finite number {need}")
    return float(value)


# ---- estimates ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One message as its sender saw it: ``nbytes`` posted at ``posted_s`` (when its data was ready) and
    completed at ``done_s``, on ``key`` (a ``(src, dst)`` rank pair, or a link class)."""

    key: Hashable
    nbytes: float
    posted_s: float
    done_s: float

    def __post_init__(self) -> None:
        _number("nbytes", self.nbytes)
        for name in ("posted_s", "done_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise GradsyncError(f"{name}={v!r} must be a finite time in seconds")
        if self.done_s < self.posted_s:
            raise GradsyncError(f"message on {self.key!r} completed at {self.done_s!r} s, before it was posted at "
                                f"{self.posted_s!r} s; give both times from one clock")


def collective_rates(samples: Iterable[Sample], min_bytes: float = MIN_BYTES) -> dict[Hashable, float]:
    """Bytes per second per key over one collective: its bytes / the union of its messages' intervals."""
    by_key: dict[Hashable, list[Sample]] = {}
    for s in samples:
        by_key.setdefault(s.key, []).append(s)
    out: dict[Hashable, float] = {}
    for key, msgs in by_key.items():
        nbytes = sum(m.nbytes for m in msgs)
        if nbytes < min_bytes:
            continue
        busy, end = 0.0, -math.inf
        for m in sorted(msgs, key=lambda m: m.posted_s):
            start = max(m.posted_s, end)
            if m.done_s > start:
                busy += m.done_s - start
            end = max(end, m.done_s)
        if busy > 0:
            out[key] = nbytes / busy
    return out


def arrival_delays(arrivals_s: Sequence[float]) -> tuple[float, ...]:
    """Per rank, seconds after the lower-median rank that it entered the collective (0 for the early ones)."""
    times = [_number(f"arrivals_s[{r}]", t) for r, t in enumerate(arrivals_s)]
    if not times:
        return ()
    ref = sorted(times)[(len(times) - 1) // 2]
    return tuple(max(0.0, t - ref) for t in times)


def on_time_pairs(rates: Mapping[tuple[int, int], float], late: Collection[int]) -> dict[tuple[int, int], float]:
    """The pair ``rates`` that say something about the wire while the ranks in ``late`` are late: a pair with a late
    end reads its lateness (a message to it waits until it posts the receive; on gloo's kernel counters too, see
    docs/runtime.md), so it is left out."""
    late = set(late)
    return {k: v for k, v in rates.items() if not set(k) & late}


class RollingEstimates:
    """The last ``window`` per-collective values of every key and rank; the estimate is their median."""

    def __init__(self, window: int = 8) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise GradsyncError(f"window={window!r} must be an integer >= 1 (collectives the estimates remember)")
        self.window = window
        self._values: dict[Hashable, deque[float]] = {}

    def add(self, key: Hashable, value: float) -> None:
        self._values.setdefault(key, deque(maxlen=self.window)).append(float(value))

    def add_rates(self, rates: Mapping[Hashable, float]) -> None:
        for key, v in rates.items():
            self.add(("rate", key), v)

    def add_delays(self, delays: Sequence[float]) -> None:
        for rank, v in enumerate(delays):
            self.add(("delay", rank), v)

    def median(self, key: Hashable, last: int | None = None) -> float | None:
        """Median of the remembered values (of the ``last`` newest), or None when there are none."""
        vals = self._values.get(key)
        if not vals:
            return None
        return statistics.median(list(vals)[-last:] if last else vals)

    def rate(self, key: Hashable) -> float | None:
        return self.median(("rate", key))

    def delay(self, rank: int) -> float | None:
        return self.median(("delay", rank))


# ---- the detector ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hysteresis:
    """Enter after ``k`` consecutive collectives at or beyond ``enter``; leave after ``k_leave`` (default ``k``)
    consecutive collectives at or inside ``leave``. ``leave < enter``: the band between them holds the state."""

    enter: float
    leave: float
    k: int = 3
    k_leave: int | None = None

    def __post_init__(self) -> None:
        _number("enter", self.enter)
        _number("leave", self.leave)
        if not self.leave < self.enter:
            raise GradsyncError(f"leave={self.leave!r} must be below enter={self.enter!r}: the band between them is "
                                f"the hysteresis that keeps noise at the threshold from flipping plans")
        for name in ("k", "k_leave"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise GradsyncError(f"{name}={v!r} must be an integer >= 1 (consecutive collectives)")

    @property
    def k_out(self) -> int:
        return self.k if self.k_leave is None else self.k_leave


@dataclass(frozen=True)
class Conditions:
    """The cluster as the detector believes it, relative to the baseline cost model: the rate scale of every
    degraded key (``measured / expected`` < 1) and the late rank (None: nobody), with its delay."""

    link_scale: tuple[tuple[Hashable, float], ...] = ()
    straggler: int | None = None
    straggler_delay_s: float = 0.0

    @property
    def baseline(self) -> bool:
        return not self.link_scale and self.straggler is None


def default_plan_name(conditions: Conditions) -> str:
    """What the job would run under ``conditions`` when the caller does not say: a label, not a plan."""
    if conditions.straggler is not None:
        return f"straggler(late rank {conditions.straggler})"
    if conditions.link_scale:
        return f"replanned on {len(conditions.link_scale)} scaled link(s)"
    return "baseline plan"


@dataclass(frozen=True)
class Switch:
    """One change of plan: every rank that saw the same collectives proposes the same ``generation``."""

    generation: int
    collective: int
    before: Conditions
    after: Conditions
    old_plan: str
    new_plan: str
    #: Seconds per collective saved under the new conditions (old plan's predicted time minus the new one's).
    predicted_gain_s: float | None
    message: str


@dataclass
class _Track:
    degraded: bool = False
    run: int = 0


class Detector:
    """Per-key and per-rank hysteresis over per-collective observations; :meth:`observe` returns a
    :class:`Switch` when the believed conditions change, else None (module docstring).

    ``link``: thresholds on the slowdown ``expected / measured`` (1.5 / 1.2: a key measured below two thirds
    of its modelled rate for ``k`` collectives is degraded; back above 1/1.2 of it, healthy). ``late``:
    thresholds on a rank's delay as a fraction of ``reference_s``, the collective's undisturbed time (late by
    a quarter of it enters, a tenth leaves). ``plan_name(conditions)`` names the plan each conditions get;
    ``predictor(plan_conditions, world_conditions)`` gives the seconds one collective takes with the plan
    made for ``plan_conditions`` on a cluster in ``world_conditions`` (the cost model's simulation, with
    ``start_delay_s`` for a late rank), so the gain of a switch is the old plan against the new one on the
    cluster as it now is. Deterministic: the same observations give the same switches on every rank.
    """

    def __init__(self, link: Hysteresis | None = None, late: Hysteresis | None = None, *,
                 plan_name: Callable[[Conditions], str] = default_plan_name,
                 predictor: Callable[[Conditions, Conditions], float] | None = None, window: int = 8) -> None:
        self.link = link or Hysteresis(1.5, 1.2, 3)
        self.late = late or Hysteresis(0.25, 0.1, 3)
        for name, h in (("link", self.link), ("late", self.late)):
            if not isinstance(h, Hysteresis):
                raise TypeError(f"{name}={h!r} must be a Hysteresis(enter, leave, k)")
        self.plan_name = plan_name
        self.predictor = predictor
        #: Rolling per-collective values: ``("ratio", key)`` measured / expected, ``("delay", rank)`` seconds.
        self.estimates = RollingEstimates(max(window, self.link.k, self.link.k_out, self.late.k, self.late.k_out))
        self.conditions = Conditions()
        self.generation = 0
        self.collectives = 0
        self._links: dict[Hashable, _Track] = {}
        self._ranks: dict[int, _Track] = {}

    @property
    def pending(self) -> bool:
        """Whether some key or rank is partway to flipping (past its threshold for fewer than ``k`` collectives
        in a row): the watch then looks at every collective until it flips or falls back."""
        return any(t.run for t in self._links.values()) or any(t.run for t in self._ranks.values())

    def observe(self, rates: Mapping[Hashable, float], expected: Mapping[Hashable, float],
                delays: Sequence[float] = (), reference_s: float = 1.0) -> Switch | None:
        """One collective: measured ``rates`` (:func:`collective_rates`), the baseline model's ``expected``
        rates for the same keys, and every rank's ``delays`` (:func:`arrival_delays`)."""
        ref = _number("reference_s", reference_s, positive=True)
        self.collectives += 1
        changed = False
        for key, got in rates.items():
            want = expected.get(key)
            if want is None:
                raise GradsyncError(f"no expected rate for {key!r}; give the baseline model's rate of every key measured")
            slowdown = _number(f"expected[{key!r}]", want, positive=True) / max(_number(f"rates[{key!r}]", got), 1e-300)
            self.estimates.add(("ratio", key), 1.0 / slowdown)
            changed |= _step(self._links.setdefault(key, _Track()), slowdown, self.link)
        for rank, d in enumerate(delays):
            frac = _number(f"delays[{rank}]", d) / ref
            self.estimates.add(("delay", rank), float(d))
            changed |= _step(self._ranks.setdefault(rank, _Track()), frac, self.late)
        if not changed:
            return None
        return self._switch()

    def clear_links(self) -> Switch:
        """One collective in which the caller saw every degraded key's link back by other evidence (a pair across it
        faster than its degraded level): the switch to the conditions without them, late ranks kept."""
        self.collectives += 1
        for track in self._links.values():
            track.degraded, track.run = False, 0
        return self._switch()

    def _switch(self) -> Switch:
        before = self.conditions
        scale = tuple(sorted(((key, self._recent(("ratio", key), self.link.k)) for key, t in self._links.items()
                              if t.degraded), key=lambda kv: repr(kv[0])))
        late = [(self._recent(("delay", r), self.late.k), r) for r, t in self._ranks.items() if t.degraded]
        delay, straggler = max(late) if late else (0.0, None)  # the straggler schedule tolerates one late rank
        after = Conditions(scale, straggler, delay)
        self.conditions = after
        self.generation += 1
        old, new = self.plan_name(before), self.plan_name(after)
        times = None if self.predictor is None else (self.predictor(before, after), self.predictor(after, after))
        gain = None if times is None else times[0] - times[1]
        return Switch(self.generation, self.collectives, before, after, old, new, gain,
                      _line(self.generation, self.collectives, before, after, old, new, times))

    def _recent(self, key: Hashable, k: int) -> float:
        got = self.estimates.median(key, last=k)
        return 0.0 if got is None else got


def _step(track: _Track, value: float, h: Hysteresis) -> bool:
    """Advance one key's run-length state by one collective; True when its state flips."""
    if track.degraded:
        track.run = track.run + 1 if value <= h.leave else 0
        if track.run >= h.k_out:
            track.degraded, track.run = False, 0
            return True
    else:
        track.run = track.run + 1 if value >= h.enter else 0
        if track.run >= h.k:
            track.degraded, track.run = True, 0
            return True
    return False


def describe_switch(switch: Switch, old_plan: str, new_plan: str, times: tuple[float, float] | None) -> str:
    """``switch``'s one log line with the plans the caller really ran before and after it (the detector names
    plans before they are made) and their predicted seconds per collective (None: not predicted)."""
    return _line(switch.generation, switch.collective, switch.before, switch.after, old_plan, new_plan, times)


def seen(before: Conditions, after: Conditions) -> str:
    """What changed from ``before`` to ``after``, as a switch's log line says it."""
    slow = [f"{key!r} at {r:.2f}x its modelled rate" for key, r in after.link_scale]
    if after.straggler is not None:
        slow.append(f"rank {after.straggler} late by {after.straggler_delay_s:.3g} s")
    cleared = [f"{key!r} back to its modelled rate" for key, _ in before.link_scale if key not in dict(after.link_scale)]
    if before.straggler is not None and after.straggler != before.straggler:
        cleared.append(f"rank {before.straggler} on time again")
    return "; ".join(slow + cleared) or "nothing left degraded"


def _line(generation: int, collective: int, before: Conditions, after: Conditions, old: str, new: str,
          times: tuple[float, float] | None) -> str:
    """The one log line of a switch: what was seen, the old plan and the new one, the predicted gain."""
    what = seen(before, after)
    pred = ""
    if times is not None:
        pred = f", predicted {times[0]:.3g} s -> {times[1]:.3g} s per collective (gain {times[0] - times[1]:.3g} s)"
    return f"gradsync: plan generation {generation} at collective {collective}: {what}; {old} -> {new}{pred}"


# ---- from pair rates to link capacities ---------------------------------------------------------------------
def link_scales(topology: Topology, pair_scale: Mapping[tuple[int, int], float],
                healthy: Iterable[tuple[int, int]] = ()) -> dict[tuple[int, int], float]:
    """Per link direction ``(link index, direction)``, the capacity scale that explains slow rank pairs.

    ``pair_scale``: ``measured / expected`` of the degraded pairs (:attr:`Conditions.link_scale` with
    ``(src, dst)`` keys); ``healthy``: the pairs measured at their modelled rate.

    The fewest links that explain every slow pair, greedily: the link direction crossed by the most slow pairs
    not yet explained takes the largest scale among those it bounds (a link is at least as fast as the fastest
    pair it slows), and so on. A link bounds a pair when it is within 1% of the slowest on the pair's route, by
    the topology's rates; where it bounds none of them, the largest scale among all. A healthy pair clears only
    the links that bound it: a pair across a 4:1 uplink runs at the uplink's rate whether or not the NIC it
    leaves by is cut to a quarter, so it says nothing about that NIC. Nor does such a pair, slowed, set the NIC's
    scale: on the testbed with a NIC at a quarter, its rack-local pairs read 0.15-0.16x and its pairs across the
    uplink 0.41-0.54x (sharing the cut NIC with the others), and a NIC scaled to 0.54 priced no replan worth
    running. One slow NIC then scales that NIC's link alone: every pair through it is slow, and it is the one
    link they share.
    """
    route = router_for(topology)
    hops_of: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def hops(pair: tuple[int, int]) -> list[tuple[int, int]]:
        if pair not in hops_of:
            hops_of[pair] = topology.route_links(route(topology.ranks[pair[0]], topology.ranks[pair[1]]))
        return hops_of[pair]

    def rate(hop: tuple[int, int]) -> float:
        return topology.links[hop[0]].directed_GBps[hop[1]]

    bound_of: dict[tuple[int, int], set[tuple[int, int]]] = {}

    def bounding(pair: tuple[int, int]) -> set[tuple[int, int]]:
        if pair not in bound_of:
            path = hops(pair)
            slowest = min(map(rate, path)) if path else 0.0
            bound_of[pair] = {h for h in path if rate(h) <= slowest * 1.01}
        return bound_of[pair]

    cleared: set[tuple[int, int]] = set()
    for pair in healthy:
        cleared.update(bounding(pair))
    open_pairs = {p: min(1.0, float(s)) for p, s in sorted(pair_scale.items())}
    scales: dict[tuple[int, int], float] = {}
    while open_pairs:
        count: dict[tuple[int, int], int] = {}
        for pair in open_pairs:
            for h in hops(pair):
                if h not in cleared:
                    count[h] = count.get(h, 0) + 1
        if not count:  # what is left crosses only links a healthy pair runs at full rate on: no link to blame
            break
        best = min(count, key=lambda h: (-count[h], h))
        explained = [p for p in open_pairs if best in hops(p)]
        bound = [p for p in explained if best in bounding(p)] or explained
        scales[best] = max(open_pairs[p] for p in bound)
        for p in explained:
            del open_pairs[p]
    return {hop: s for hop, s in scales.items() if s < 1.0}


def scaled_topology(topology: Topology, scales: Mapping[tuple[int, int], float]) -> Topology:
    """``topology`` with each link direction's bandwidth multiplied by its scale (:func:`link_scales`).

    The scales are also recorded in ``attrs["link_scale"]`` (``(a, b, a->b scale, b->a scale)`` per scaled link, on
    top of any the topology had): a cost model with measured class rates replaces a link's bandwidth by its class's
    (:meth:`CostModel.rates <gradsync.sim.cost.CostModel.rates>`), and applies these after it, so a belief that a
    link runs slow survives a model that measured the class it belongs to."""
    links = list(topology.links)
    recorded = recorded_link_scales(topology)
    for e, lk in enumerate(links):
        up, down = scales.get((e, 0), 1.0), scales.get((e, 1), 1.0)
        if up != 1.0 or down != 1.0:
            a_b, b_a = lk.directed_GBps
            links[e] = replace(lk, bandwidth_GBps=a_b * up, bandwidth_down_GBps=b_a * down)
            was = recorded.get((lk.a, lk.b), (1.0, 1.0))
            recorded[(lk.a, lk.b)] = (was[0] * up, was[1] * down)
    attrs = {**topology.attrs, LINK_SCALE: tuple((a, b, u, d) for (a, b), (u, d) in recorded.items())}
    return replace(topology, links=tuple(links), attrs=attrs)
