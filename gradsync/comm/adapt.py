"""Plans that follow the cluster while the job runs (issue 39): watch the wire, replan, route around dead links.

The runtime hands every large allreduce to an :class:`Adapter`, planned or on the backend's own ring (those
take the queued path, not the native fast path, so every rank counts the same ones):

* **watch**: the executor records when each message this rank sent was posted and when it completed
  (:attr:`Executor.sent <gradsync.comm.executor.Executor.sent>`); :func:`~gradsync.comm.watch.collective_rates`
  turns them into one rate per ``(src, dst)`` pair this rank sends on. On gloo the kernel's counters of the
  pair's TCP connection replace it where the connection is found (:mod:`gradsync.comm.tcpinfo`,
  :attr:`AdaptOptions.wire`): a send's own timing also holds the time either process was not scheduled. Each
  rank also times its whole stay in the collective, which shows a late rank on any plan (the backend's ring
  gives nothing else);
* **agree**: the pair rates of all ranks travel in one small sum-allreduce (``world_size**2`` float64s, each
  entry written by its sender alone, so the sum is exact), so every rank feeds the *same* numbers to the same
  deterministic :class:`~gradsync.comm.watch.Detector` and sees the same switch at the same collective.
  Only collectives of at least :attr:`AdaptOptions.min_bytes` are watched, a size every rank shares: the extra
  collective is one message-cost round next to a wire-bound one;
* **compare**: each pair is compared with what the cost model predicts for the plan that ran (the simulated
  per-pair rate), times the ratio measured in the first :attr:`AdaptOptions.warmup` watched collectives, so a
  wire that never matched the model's absolute rates is not a degraded one. That factor belongs to the plan (how
  the wire runs its pairs beside the model): a plan explored or switched to learns its pairs' factors first, and a
  degraded pair is compared with the factor it was seen slow with until then. A plan switched to on a scaled
  belief learns, for its pairs across the links scaled then, their degraded level, and compares them with
  nothing (a switch held since does not change which): when they run above that level by the least gain the
  links' return should bring them (:func:`return_margins`) for ``k_leave`` collectives, the links are back and
  every rank returns to the baseline (the pairs that read slow may not be in the new plan at all). No rank is
  judged late in a collective with a pair slower than the cluster as believed, nor while the belief has a scaled
  link (the link's change also ends the ranks unevenly, and the scaled model does not time their ends as the wire
  does);
* **replan**: on a switch the degraded pairs become per-link capacity scales
  (:func:`~gradsync.comm.watch.link_scales`), the plan cache is reset on the scaled topology (a new
  generation: the choice and wait order are decided job-wide through ``decide`` under new keys, so every rank
  runs the same plan), the new plan is built at once, and rank 0 logs one line: what was seen, the old and
  the new plan, the predicted gain. When the pairs are back inside the leave threshold the detector switches
  back, the same way. A switch whose new plan the model prices less than :attr:`AdaptOptions.min_gain` faster
  than the plan that runs, on the cluster as it now is, is *held*: the plan, its executors and ``auto``'s
  measured choices stay, and rank 0 logs one line saying so (a NIC that slows every ring alike, or noise across
  the threshold, cost a new generation and a new exploration for nothing). Where the new belief only slows links
  and the running plan is priced within that share of the least any plan was priced before, it is held without
  choosing (a slower link makes no plan faster in the model);
* **reroute**: :meth:`Adapter.drop_link` removes a link from the topology and replans on the surviving graph;
  where no path joins every rank any more, it raises :class:`~gradsync.errors.PeerError` naming the link. A link
  whose NIC lost its carrier (:mod:`gradsync.comm.nics`: each rank reads its own, and the agreement round carries
  them) is dropped the same way by every rank at one watched collective, and comes back with its carrier.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from gradsync.comm import nics as _nics
from gradsync.comm.collectives import NativeAllreduce
from gradsync.comm.executor import Executor
from gradsync.comm.plans import ALLREDUCE, PlanCache
from gradsync.comm.tcpinfo import (
    MAX_ENDPOINTS,
    TcpReader,
    decode_endpoint,
    encode_endpoint,
    peer_ranks,
    read_connections,
    wire_rates,
)
from gradsync.comm.tuning import Tuning
from gradsync.comm.watch import (
    MIN_BYTES,
    Conditions,
    Detector,
    Hysteresis,
    Sample,
    Switch,
    arrival_delays,
    collective_rates,
    describe_switch,
    link_scales,
    on_time_pairs,
    scaled_topology,
    seen,
)
from gradsync.errors import GradsyncError, PeerError, SimulationError, TopologyError
from gradsync.plan.schedule import Schedule
from gradsync.sim.choose import PRUNE, Chooser
from gradsync.sim.cost import DEFAULT_SOURCE, NATIVE, CostModel, native_schedule, size_class
from gradsync.sim.engine import SimResult, simulate
from gradsync.topology.model import Link, Topology

__all__ = ["ADAPT_MIN_BYTES", "RETURN_GAIN", "RETURN_MIN", "WIRE_SOURCES", "AdaptOptions", "Adapter", "SwitchRecord",
           "adapt_from_env", "return_margins"]

#: Allreduces below this many bytes are not watched: their pairs move too little to measure the wire, and the
#: agreement round (one small allreduce) would be a visible share of them.
ADAPT_MIN_BYTES = 1 << 20
#: A pair across a scaled link shows it back by running this many times its degraded level, or less where the return
#: should gain it less (:func:`return_margins`).
RETURN_GAIN = 2.0
#: The least gain over its degraded level that shows a pair's link back, whatever the model says the return gains it:
#: above the noise of the kernel's per-connection rates (docs/runtime.md, "Plans that follow the cluster").
RETURN_MIN = 1.3
#: :attr:`AdaptOptions.wire`'s choices.
WIRE_SOURCES = ("auto", "timings")
_OFF = ("0", "false", "off", "no")


@dataclass(frozen=True)
class AdaptOptions:
    """How the runtime watches the wire. ``link``: the detector's thresholds on ``expected / measured`` pair
    rates and its ``k`` (consecutive watched collectives); ``late``: on a rank's arrival delay as a share of the
    collective's time without it; ``warmup``: watched collectives that learn each pair's
    measured / modelled ratio before the detector starts; ``min_bytes``: the smallest allreduce watched;
    ``pair_min_bytes``: the fewest bytes a pair must move in one collective to give a rate; ``min_gain``: the
    share of a collective's predicted time a replan must save to be run (below it the switch is held);
    ``every``: watch one allreduce in this many of those that qualify (the same ones on every rank), and every
    one while the detector has a key or rank partway to a switch (:attr:`Detector.pending
    <gradsync.comm.watch.Detector.pending>`, the same on every rank) or believes the cluster off its baseline (a
    degraded link or a late rank, switched to or held: its return is then seen at once, not up to ``every``
    collectives late). Why: a watched collective ends with a small
    agreement round that waits for the slowest rank, which costs about a quarter of a 4 MB loopback allreduce
    (``gradsync bench adapt``); sampling divides that cost by ``every``, and watching every collective once
    something looks wrong keeps the detection time at ``every + k - 1`` collectives, not ``every * k``.
    ``wire``: where a pair's rate comes from: ``"auto"`` (default) the kernel's counters of the connection to that
    peer where the transport runs on gloo's TCP connections and the peer's connection is found
    (:mod:`gradsync.comm.tcpinfo`: bytes acknowledged over the time the connection was busy, which leaves out the
    time either process was not scheduled), else the executor's own send timings; ``"timings"`` always those.
    ``nics``: this rank's NICs and the topology links they end, ``(interface, device, peer)`` each
    (:mod:`gradsync.comm.nics`); None (default) reads ``$GRADSYNC_NICS``, which ``gradsync testbed run`` sets. A
    NIC whose carrier is gone at a watched collective drops its link on every rank (a reroute); its carrier back,
    the link returns."""

    link: Hysteresis = field(default_factory=lambda: Hysteresis(1.5, 1.2, 3))
    late: Hysteresis = field(default_factory=lambda: Hysteresis(0.25, 0.1, 3))
    warmup: int = 5
    min_bytes: int = ADAPT_MIN_BYTES
    pair_min_bytes: float = MIN_BYTES
    min_gain: float = 0.05
    every: int = 16
    wire: str = "auto"
    nics: tuple[_nics.Nic, ...] | None = None

    def __post_init__(self) -> None:
        if self.nics is not None and (not isinstance(self.nics, tuple) or not all(
                isinstance(n, tuple) and len(n) == 3 and all(isinstance(x, str) and x for x in n) for n in self.nics)):
            raise TypeError(f"nics={self.nics!r} must be a tuple of (interface, device, peer) name triples")
        if self.wire not in WIRE_SOURCES:
            raise GradsyncError(f"wire={self.wire!r} must be one of {WIRE_SOURCES} (where pair rates come from)")
        for name in ("link", "late"):
            if not isinstance(getattr(self, name), Hysteresis):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a Hysteresis(enter, leave, k)")
        for name in ("warmup", "min_bytes", "every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "min_bytes" else 1):
                need = {"warmup": ">= 1 (watched collectives)", "min_bytes": ">= 0 (bytes)",
                        "every": ">= 1 (one watched allreduce in this many)"}[name]
                raise GradsyncError(f"{name}={v!r} must be an integer {need}")
        v = self.pair_min_bytes
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise GradsyncError(f"pair_min_bytes={v!r} must be a number of bytes >= 0")
        v = self.min_gain
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise GradsyncError(f"min_gain={v!r} must be a share of a collective's time in [0, 1) (0: every switch "
                                f"replans)")


def adapt_from_env(adapt: bool | AdaptOptions | None) -> AdaptOptions | None:
    """The options ``Runtime(adapt=...)`` means: None reads ``$GRADSYNC_ADAPT`` (off unless set and not
    0/false/off/no). Off by default until its cost is within 1% (``gradsync bench adapt``; docs/runtime.md)."""
    if adapt is None:
        adapt = os.environ.get("GRADSYNC_ADAPT", "0").strip().lower() not in _OFF
    if isinstance(adapt, AdaptOptions):
        return adapt
    if not isinstance(adapt, bool):
        raise TypeError(f"adapt={adapt!r} must be True, False or an AdaptOptions(...)")
    return AdaptOptions() if adapt else None


@dataclass(frozen=True)
class SwitchRecord:
    """One change of plan as every rank saw it (the same on every rank)."""

    generation: int
    collective: int  # watched collectives after the warm-up, counted from 1
    conditions: Conditions
    old_plan: str
    new_plan: str
    predicted_gain_s: float | None
    message: str
    #: a reroute's: the model's seconds for the new plan on the surviving graph (before its warm-up measures it)
    predicted_s: float | None = None


@dataclass
class _Trial:
    """A switch's new plan on probation (:meth:`Adapter._review`): the size class, the pick it replaced and
    their labels, the slowest rank's median seconds in the collectives before the switch, and those since."""

    size: int
    before: tuple[str, int]
    old_plan: str
    new_plan: str
    baseline_s: float
    samples: list[float]


@dataclass
class _Learned:
    """What the watch learned about one plan (:meth:`Adapter._learned`): the schedule (held, so that its id is not
    reused), the belief it ran on, each pair's ratios so far, and once it has :attr:`AdaptOptions.warmup` of them,
    its factor (their median) and floor (their least)."""

    schedule: Schedule
    world: Topology
    samples: dict[Hashable, list[float]] = field(default_factory=dict)
    factors: dict[Hashable, float] = field(default_factory=dict)
    floors: dict[Hashable, float] = field(default_factory=dict)


class Adapter:
    """One runtime's watch, detector and replanning (module docstring).

    ``share(tensor)`` sums a float64 tensor over ranks in place (the runtime's own allreduce, run at once);
    ``build(nbytes)`` returns the executor the runtime runs for ``nbytes`` now, planned if need be;
    ``label(nbytes)`` names it. ``clock`` times the messages (a test gives a fake one).
    """

    def __init__(self, plans: PlanCache, tuning: Tuning, options: AdaptOptions, *,
                 share: Callable[[torch.Tensor], object], build: Callable[[float], object],
                 label: Callable[[float], str], clock: Callable[[], float], auto: bool) -> None:
        self.plans, self.tuning, self.options = plans, tuning, options
        self._share, self._build, self._label, self.clock = share, build, label, clock
        #: whether the runtime chooses its plan (``auto``): only then can a late rank move it to ``straggler``
        self.auto = auto
        #: the plan options as the user gave them; a late rank is planned with ``straggler`` set on a copy
        self.base_options = plans.options
        self._entered = 0.0
        #: The topology as it is, before any scaling: the file's, less the links dropped since.
        self.base_topology: Topology = plans.topology
        #: Every switch and reroute so far (identical on every rank).
        self.switches: list[SwitchRecord] = []
        #: Switches the detector saw but that kept the plan, the replan priced below ``min_gain`` (module docstring).
        self.held: list[SwitchRecord] = []
        #: Collectives watched so far (warm-up included), and those that qualified (``options.every``).
        self.watched = 0
        self.eligible = 0
        #: The kernel's counters (``options.wire``): whether to read them, each peer connection's rank (None until
        #: the first watched collective maps them), the reading before the collective in progress, and of the last
        #: watched collective's pair rates how many came from them.
        self._tcp = options.wire == "auto" and plans.caps.backend == "gloo"
        self._tcp_peers: dict[tuple[str, int], int] | None = None
        self._tcp_reader: TcpReader | None = None
        self._tcp_before: dict | None = None
        self.tcp_pairs = 0
        #: the chooser rank 0 priced the last prospective replan with (:meth:`_prospect`)
        self._priced: Chooser | None = None
        #: The topology the job started on; the links dropped by hand (:meth:`drop_link`) and those a NIC's carrier
        #: says are dead (the same on every rank), which :attr:`base_topology` leaves out.
        self.full_topology: Topology = plans.topology
        self._dropped: dict[frozenset[str], str] = {}  # each as its caller named it, in the order dropped
        self.links_down: frozenset[frozenset[str]] = frozenset()
        #: this rank's NICs whose carrier the watch reads (:mod:`gradsync.comm.nics`)
        self.nics = self._own_nics(options.nics)
        self._fresh()

    def _own_nics(self, given: tuple[_nics.Nic, ...] | None) -> tuple[_nics.Nic, ...]:
        """This rank's NICs: ``given`` must all be this rank's links; from ``$GRADSYNC_NICS``, another device's are
        left out (a testbed job may plan on fewer servers than the testbed has). Each must be an interface here and a
        link of the topology, else the watch would drop a healthy link."""
        topo = self.full_topology
        me = topo.ranks[self.rank]
        listed = given if given is not None else _nics.nics_from_env()
        where = "AdaptOptions(nics=...)" if given is not None else f"${_nics.NICS_ENV}"
        mine = tuple(n for n in listed if given is not None or n[1] == me)
        if len(mine) > _nics.MAX_NICS:
            raise GradsyncError(f"{where} lists {len(mine)} NICs for {me!r}; the watch reads at most {_nics.MAX_NICS}")
        here = _nics.interfaces() if mine else []
        for ifname, device, peer in mine:
            if device != me:
                raise GradsyncError(f"{where} gives NIC {ifname!r} to {device!r}, but this is rank {self.rank} "
                                    f"({me!r}); list this rank's own NICs")
            if not topo.has_link(device, peer):
                raise GradsyncError(f"{where}: topology {topo.name!r} has no link {device}-{peer} for NIC {ifname!r}")
            if ifname not in here:
                raise GradsyncError(f"{where} names interface {ifname!r}, which this host does not have "
                                    f"(it has {here}); a missing NIC would read as a dead link")
        return mine

    def _fresh(self) -> None:
        self.detector = Detector(self.options.link, self.options.late)
        self._warmed = 0
        self._warm_slow: list[float] = []
        self._fast: dict[tuple[int, int], tuple[Schedule, float]] = {}  # per plan and size, its α-only seconds
        #: a replan's predictions, its prospect's and its log line's alike (the same plans on the same belief)
        self._priced_s: dict[tuple[int, int, float, float, tuple[tuple[int, float], ...]],
                             tuple[Schedule, Topology, float]] = {}
        #: per plan, size and slowdown, each rank's predicted end on the wire (:meth:`_ends_on_wire`)
        self._ends_s: dict[tuple[int, int, float, float], tuple[Schedule, Topology, tuple[float, ...]]] = {}
        self._back = 0  # watched collectives in a row with the scaled links' pairs faster than their degraded level
        self._slow_by: tuple[Topology, dict[Hashable, float]] | None = None
        #: ``auto``'s settled picks on the baseline, kept at the first switch away from it and given back on return
        self._baseline_picks: dict[int, tuple[str, int]] | None = None
        self._slowdown = 1.0
        #: per size class, the slowest rank's seconds in the last few watched collectives (a trial's baseline)
        self._recent: dict[int, deque[float]] = {}
        self._trial: _Trial | None = None
        #: per plan (by the schedule's id), what its pairs taught (:meth:`_learned`)
        self._plans_learned: dict[int, _Learned] = {}
        #: each degraded pair's factor on the plan it was seen slow on: what it is compared with on a plan that has
        #: not learned its own yet, so that its return is seen at once
        self._kept: dict[Hashable, float] = {}
        self._expected: dict[tuple[int, int, int], tuple[Schedule, Topology, dict[Hashable, float], list[float]]] = {}
        #: the cluster as the detector last believed it (the topology a switch scaled, replanned or held): what a
        #: pair without a factor is learned against, and when each rank is expected to leave the collective
        self._world: Topology = self.base_topology

    @property
    def rank(self) -> int:
        return self.plans.transport.rank

    @property
    def slowdown(self) -> float:
        """How many times slower than the cost model's the wire's rates are, fitted in the warm-up (1 before it
        ends; at least 1): the rates late arrivals are priced on (:meth:`predicted_s`)."""
        return self._slowdown

    @property
    def conditions(self) -> Conditions:
        return self.detector.conditions

    # ---- watching --------------------------------------------------------------------------------------
    def qualifies(self, ex: object, nbytes: float) -> bool:
        """Whether an allreduce of ``nbytes`` on ``ex`` is one the watch counts (the same answer on every rank):
        planned or the backend's own (a late rank shows in each rank's time in it, without pair rates). The
        runtime runs those through :meth:`watch`, never on its native fast path, so every rank counts the same
        collectives in the same order."""
        return (isinstance(ex, (Executor, NativeAllreduce)) and ex.schedule.collective == ALLREDUCE
                and nbytes >= self.options.min_bytes and ex.schedule.world_size >= 2)

    def watch(self, ex: object, nbytes: float) -> bool:
        """Whether this run of ``ex`` is watched (the same answer on every rank); if so, ``ex`` starts recording."""
        if not self.qualifies(ex, nbytes):
            return False
        self.eligible += 1
        if ((self.eligible - 1) % self.options.every and not self.detector.pending
                and self.detector.conditions.baseline):  # off the baseline: every one, to see it come back
            return False
        if isinstance(ex, Executor):  # the backend's own collective has no messages of ours to time
            ex.sent, ex.clock = [], self.clock
            if self._tcp:
                if self._tcp_peers is None:
                    self._tcp_peers = self._map_connections(ex.schedule.world_size)
                    self._tcp_reader = TcpReader(self._tcp_peers)
                self._tcp_before = self._tcp_reader.read() if self._tcp_reader and self._tcp_peers else None
        self._entered = self.clock()
        return True

    def _map_connections(self, world: int) -> dict[tuple[str, int], int]:
        """Which rank each of this process's TCP connections leads to: every rank's local endpoints in one
        sum-allreduce (each row has one writer: exact), then :func:`~gradsync.comm.tcpinfo.peer_ranks`. Every
        rank calls it at the same watched collective (the first)."""
        mine = list(read_connections())
        local = sorted({c.local for c in mine})[:MAX_ENDPOINTS]
        vec = torch.zeros(world * MAX_ENDPOINTS, dtype=torch.float64)  # host: read back at once
        for i, (address, port) in enumerate(local):
            vec[self.rank * MAX_ENDPOINTS + i] = encode_endpoint(address, port)
        self._share(vec)
        rows = vec.view(world, MAX_ENDPOINTS).tolist()
        listed = {r: [decode_endpoint(c) for c in row if c > 0] for r, row in enumerate(rows)}
        return peer_ranks(mine, listed, self.rank)

    def after(self, ex: Executor | NativeAllreduce, nbytes: float) -> SwitchRecord | None:
        """``ex`` just ran a watched allreduce of ``nbytes``: agree on the pair rates, and switch when the
        detector says so (every rank does, at this collective)."""
        seconds = self.clock() - self._entered
        self.watched += 1
        shared, spent, down = self._agree(ex.schedule.world_size, self._measure(ex), seconds)
        if down != self.links_down:
            self.links_down = down
            return self._relink(nbytes)
        expected, _ = self._expected_rates(ex.schedule, nbytes, self.base_topology)
        _, finish = self._expected_rates(ex.schedule, nbytes, self._world)
        shared = {k: v for k, v in shared.items() if k in expected}
        if self._warmed < self.options.warmup:
            self._warm_up(ex.schedule, nbytes, shared, expected, max(spent), max(finish))
            return None
        delays = self._delays(spent, self._ends_on_wire(ex.schedule, nbytes, self._world))
        # Late "by a share of the collective" as it ran, not as the model says it would: a slow link shifts the
        # ranks' end times unevenly too, by a share of a collective it also makes longer.
        reference = max(spent)
        size = size_class(nbytes)
        self._recent.setdefault(size, deque(maxlen=self._trial_length)).append(reference)
        # A late rank's timed pairs are neither learned nor compared while it is late, by the detector's conditions
        # or by this collective's delays (compared, they replanned a healthy wire around the late rank's links).
        # While the belief has a scaled link, only a confirmed late rank counts: the slow link's own rank ends late on
        # a wire the scaled model does not time exactly, and its pairs are the ones that show the link coming back.
        late_now = {r for r, d in enumerate(delays)
                    if reference > 0 and d > self.options.late.leave * reference and not self._scaled}
        if self.detector.conditions.straggler is not None:
            late_now.add(self.detector.conditions.straggler)
        shared = on_time_pairs(shared, late_now)
        # A pair without a factor on this plan (a warm-up on the backend's own collective, which gives no pair
        # rates; a plan explored or switched to since) learns it first: a factor belongs to a plan (how the wire
        # runs that plan's pairs beside the model: compared with another plan's, healthy pairs read half their
        # rate), and a wire that never matched the model is not a degraded one.
        learned = self._learned(ex.schedule)
        factors = learned.factors
        # Its factors hold a scaled belief: learned since a switch, on the belief that switch made. A switch held since
        # (a pair read slow that no replan would gain from) changes the belief, not what the plan's pairs learned: the
        # links scaled when they learned are the ones whose return they show (compared with nothing after a held
        # switch, they left the NIC's return unseen until two replans later: docs/runtime.md).
        here = self._scaled and learned.world is not self.base_topology
        degraded = dict(self.detector.conditions.link_scale)
        fresh = {k: v for k, v in shared.items() if k not in factors}
        if fresh:
            self._learn_pairs(ex.schedule, fresh, expected)
        # On such a plan a pair across a link the belief scaled learned its degraded level: it is not compared (it is
        # what the belief explains) but shows the link's return, as a run faster than that level (below).
        slow_by = self._believed_slowdown(learned.world) if here else {}
        across = {k for k in shared if slow_by.get(k, 1.0) > 1.05}
        cross = {k: v for k, v in shared.items() if k in across and k in factors}
        use = {k: factors[k] if k in factors else self._kept[k] for k in shared
               if k not in fresh and k not in across and (k in factors or (k in degraded and k in self._kept))}
        if self._links_back(ex.schedule, nbytes, learned, cross if degraded else {}, slow_by, expected):
            self._world = self.base_topology  # back: the baseline's plans again, at this collective
            return self._replan(self.detector.clear_links(), self._world, ex.schedule, nbytes)
        believed = expected if here else self._expected_rates(ex.schedule, nbytes, self._world)[0]
        shared = {k: v for k, v in shared.items() if k in use}
        want = {k: expected[k] * use[k] for k in shared}
        # A pair slower than the cluster as believed says a link changed, which also ends the ranks unevenly (a
        # slow NIC made the ranks the model ends last look late by the difference): no rank is judged late on it.
        link_news = any(believed[k] * use[k] >= self.options.link.enter * v for k, v in shared.items())
        # Nor while the belief has a scaled link: its model of the ranks' ends is not the wire's.
        judged = delays if reference > 0 and not link_news and not self._scaled else ()
        switch = self.detector.observe(shared, want, judged, reference if reference > 0 else 1.0)
        if switch is None:
            return self._review(size, reference)
        degraded = dict(switch.after.link_scale)
        self._kept = {k: use.get(k, self._kept.get(k)) for k in degraded if k in use or k in self._kept}
        healthy = [k for k in shared if k not in degraded]
        scales = link_scales(self.base_topology, degraded, healthy)  # type: ignore[arg-type]
        self._world = scaled_topology(self.base_topology, scales) if scales else self.base_topology
        return self._replan(switch, self._world, ex.schedule, nbytes)

    def _measure(self, ex: Executor | NativeAllreduce) -> dict[Hashable, float]:
        """This rank's rate to each peer it sent to in the collective ``ex`` ran: the executor's send timings,
        replaced by the kernel's counters where the pair's connection is known; nothing for the backend's own
        collective (it gives each rank's time alone)."""
        self.tcp_pairs = 0  # of this collective's rates: none until the kernel's counters give some
        if not isinstance(ex, Executor):
            return {}
        me = self.rank
        sent, ex.sent = ex.sent or [], None
        rates = collective_rates((Sample((me, ex.proc_of.index(peer)), b, t0, t1) for peer, b, t0, t1 in sent),
                                 self.options.pair_min_bytes)
        before, self._tcp_before = self._tcp_before, None
        if before is not None and self._tcp_reader is not None and self._tcp_peers:  # the kernel's, where it has it
            wire = wire_rates(before, self._tcp_reader.read(), self._tcp_peers, self.options.pair_min_bytes)
            tcp = {(me, ex.proc_of.index(p)): r for p, r in wire.items() if p in ex.proc_of}
            rates.update({k: v for k, v in tcp.items() if k in rates})
            self.tcp_pairs = sum(1 for k in tcp if k in rates)
        return rates

    def _agree(self, n: int, rates: dict[Hashable, float], seconds: float
               ) -> tuple[dict[Hashable, float], list[float], frozenset[frozenset[str]]]:
        """Every rank's pair rates, seconds in the collective and dead links, the same on every rank: ``[pair rates
        (n*n) | each rank's seconds (n) | each rank's NICs without carrier (n*MAX_NICS)]`` in one sum-allreduce,
        every entry with one writer, so the sum is exact."""
        k = _nics.MAX_NICS
        vec = torch.zeros(n * n + n + n * k, dtype=torch.float64)  # host: read back at once; plans run on gloo
        for (src, dst), r in rates.items():
            vec[src * n + dst] = r
        vec[n * n + self.rank] = max(seconds, 0.0)
        if self.nics:
            start = n * n + n + self.rank * k
            for i, code in enumerate(_nics.encode_down(self.nics, self.full_topology, _nics.carrier)):
                vec[start + i] = code
        self._share(vec)
        pairs = vec[: n * n].tolist()
        down = _nics.decode_down(vec[n * n + n:].view(n, k).tolist(), self.full_topology)
        return {(i // n, i % n): r for i, r in enumerate(pairs) if r}, vec[n * n: n * n + n].tolist(), down

    def _warm_up(self, schedule: Schedule, nbytes: float, shared: dict[Hashable, float],
                 expected: dict[Hashable, float], spent_s: float, finish_s: float) -> None:
        """One warm-up collective: learn how the pairs' wire, and the run as a whole, compare with the model."""
        self._learn_pairs(schedule, shared, expected)
        if finish_s > 0:
            self._warm_slow.append(self._rate_slowdown(schedule, nbytes, spent_s, finish_s))
        self._warmed += 1
        if self._warmed >= self.options.warmup:
            self._slowdown = statistics.median(self._warm_slow) if self._warm_slow else 1.0
            self._measure_alpha()

    def _measure_alpha(self) -> None:
        """Measure the executor's α where nobody measured or wrote one: ``init`` calibrates only where the
        baseline's pick turns on it (not on a flat switch, whose pick is the backend's ring), and loopback's
        default α is several times too small where ranks share a host's cores. The plans the watch switches to (a late rank's, a tree around a slow
        link) turn on it: priced at the default, a late rank's plan was run at depth 64 on the testbed where 16 was
        faster (docs/runtime.md). Every rank, at the same watched collective (the warm-up's last); the model's
        pipeline choices are made afresh with it, job-wide."""
        plans = self.plans
        model = plans.cost_model
        if (model.source != DEFAULT_SOURCE or model.message_s != CostModel().message_s  # measured, or set by hand
                or not plans.caps.native or plans.transport.world_size < 2):
            return
        alpha = self.tuning.measure_message_s()
        self.tuning.set_cost_model(replace(model, message_s=alpha, source=f"{model.source}; executor α measured by "
                                                                          f"the watch ({alpha * 1e6:.0f} us)"))
        self._expected.clear()
        self._priced_s.clear()
        self._ends_s.clear()
        self._plans_learned = {}

    def _delays(self, spent: list[float], ends: list[float]) -> list[float]:
        """Each rank's arrival delay. A rank leaves the collective when the plan's last message to or from it is done,
        which the model predicts (``ends``, on the wire as the warm-up measured it: :meth:`_ends_on_wire`): a rank
        that spent less than that in it, by more than the others did, came late by the difference. No common clock
        is needed, and a plan in which ranks finish at different times (the straggler schedule) is not mistaken for
        a late rank."""
        excess = [t - e for t, e in zip(spent, ends)]
        top = max(excess)
        return arrival_delays([top - e for e in excess])

    def _links_back(self, schedule: Schedule, nbytes: float, learned: _Learned, cross: dict[Hashable, float],
                    slow_by: dict[Hashable, float], expected: dict[Hashable, float]) -> bool:
        """Whether the scaled links are back: ``cross`` (the pairs across them that learned their degraded level on
        ``learned``'s belief) ran above that level by the gain the return should bring them (:func:`return_margins`,
        their median, against the slowest they learned: a link back while they learned is still seen) for
        ``k_leave`` watched collectives in a row."""
        if not cross:
            self._back = 0
            return False
        on_belief = self._expected_rates(schedule, nbytes, learned.world)[0]
        margins = return_margins(cross, {k: expected[k] * learned.floors[k] for k in cross}, slow_by,
                                 {k: expected[k] / on_belief[k] for k in cross if on_belief.get(k)})
        self._back = self._back + 1 if margins and statistics.median(margins) >= 1.0 else 0
        if self._back < self.options.link.k_out:
            return False
        self._back = 0
        return True

    def _learned(self, schedule: Schedule) -> _Learned:
        """What ``schedule``'s pairs taught so far (nothing yet for a plan not seen before)."""
        got = self._plans_learned.get(id(schedule))
        if got is None or got.schedule is not schedule:  # new, or a dead plan's id reused
            got = self._plans_learned[id(schedule)] = _Learned(schedule, self._world)
        return got

    @property
    def _scaled(self) -> bool:
        """Whether the detector believes some link slower than the baseline's (a switch scaled it, made or held)."""
        return self._world is not self.base_topology

    def _believed_slowdown(self, belief: Topology) -> dict[Hashable, float]:
        """Per ordered rank pair, how many times slower ``belief`` makes one stream's path than the baseline does
        (its bottleneck link's rate on the base topology over the scaled one; cached per belief)."""
        if self._slow_by is None or self._slow_by[0] is not belief:
            model, n = self.plans.cost_model, belief.world_size
            got: dict[Hashable, float] = {}
            for src in range(n):
                base, now = model.paths_from(self.base_topology, src), model.paths_from(belief, src)
                got.update({(src, dst): base[dst][0] / now[dst][0] for dst in range(n) if dst != src})
            self._slow_by = (belief, got)
        return self._slow_by[1]

    def _learn_pairs(self, schedule: Schedule, shared: dict[Hashable, float], expected: dict[Hashable, float]) -> None:
        """Record each pair's measured / modelled rate on ``schedule`` toward its factor there, which settles (the
        median) once it has :attr:`AdaptOptions.warmup` of them."""
        learned = self._learned(schedule)
        for k, v in shared.items():
            samples = learned.samples.setdefault(k, [])
            samples.append(v / expected[k])
            if len(samples) >= self.options.warmup:
                learned.floors[k] = min(samples)
                learned.factors[k] = statistics.median(learned.samples.pop(k))

    @property
    def _trial_length(self) -> int:
        """Watched collectives behind a verdict: as many as the detector needs to switch (either side)."""
        return max(self.options.link.k, self.options.late.k)

    def _sim_args(self, schedule: Schedule) -> dict[str, Any]:
        """:func:`~gradsync.sim.simulate`'s arguments for ``schedule`` besides its rates, as the cost model prices it
        (:meth:`CostModel.run <gradsync.sim.cost.CostModel.run>`): the reverse direction's share, the token buckets,
        and how its messages cost (:meth:`CostModel.messages <gradsync.sim.cost.CostModel.messages>`: the backend's
        α, overlapping the wire, for its own ring; else the executor's, in series)."""
        model = self.plans.cost_model
        return {"streaming": False, "fifo": True, "reverse_share": model.reverse_share, "burst_s": model.burst_s,
                "progress": False, **model.messages(schedule.algorithm == NATIVE)}

    def _late(self, conditions: Conditions) -> dict[int, float]:
        return {} if conditions.straggler is None else {conditions.straggler: conditions.straggler_delay_s}

    def _predict(self, schedule: Schedule, topology: Topology, nbytes: float, late: dict[int, float]) -> float:
        """Seconds of ``schedule`` on ``topology`` with the ranks in ``late`` arriving late (measured seconds),
        priced as :meth:`CostModel.predict <gradsync.sim.cost.CostModel.predict>` prices (the backend's α for
        its own ring, :func:`~gradsync.sim.cost.native_schedule`) on the wire as the warm-up measured it.

        Why on the warm-up's rates (:attr:`slowdown`): a late arrival is measured on the wire, the plans are
        priced on the model, and an uncalibrated model (a flat switch, where ``init`` skips calibration) can be
        far off the wire: a delay of one real collective beside one the model prices many times shorter hides
        every plan's difference. The watched collectives are large (wire-bound), so the gap goes on the rates,
        not on α."""
        key = (id(schedule), id(topology), float(nbytes), self.slowdown, tuple(sorted(late.items())))
        got = self._priced_s.get(key)
        if got is None or got[0] is not schedule or got[1] is not topology:
            got = self._priced_s[key] = (schedule, topology, self._on_wire(schedule, topology, nbytes, late).time_s)
        return got[2]

    def _on_wire(self, schedule: Schedule, topology: Topology, nbytes: float, late: dict[int, float]) -> SimResult:
        """The simulation :meth:`_predict` and :meth:`_ends_on_wire` read: the model's rates divided by the warm-up's
        slowdown, the plan's α (the backend's for its own ring), the ranks in ``late`` arriving late."""
        return simulate(schedule, _slowed(self.plans.cost_model.rates(topology), self.slowdown), float(nbytes),
                        start_delay_s=late or None, **self._sim_args(schedule))

    def _rate_slowdown(self, schedule: Schedule, nbytes: float, measured_s: float, modelled_s: float) -> float:
        """The factor ``g >= 1`` by which the model's rates must be divided for ``schedule`` to take
        ``measured_s``: the model's time is its α part (the same schedule on near-infinite rates) plus a
        bandwidth part that scales with ``g``."""
        key = (id(schedule), size_class(nbytes))
        got = self._fast.get(key)
        if got is None or got[0] is not schedule:  # the same every warm-up collective of the plan: once
            got = self._fast[key] = (schedule, simulate(
                schedule, _slowed(self.plans.cost_model.rates(self.base_topology), 1e-6), float(nbytes),
                **self._sim_args(schedule)).time_s)
        fast = got[1]
        wire = modelled_s - fast
        return max(1.0, (measured_s - fast) / wire) if wire > 0 else 1.0

    def predicted_s(self, nbytes: float) -> float | None:
        """The model's seconds for an allreduce of ``nbytes`` on the plan that runs now, on the cluster as the
        detector last saw it (scaled links, a late rank's arrival); None where that plan cannot be priced. What a
        benchmark puts beside the measured steady state. Every rank calls it at the same point: a size not yet
        run is priced job-wide."""
        try:  # what the runtime runs for this size: auto's pick (or its explorer, on the model's), or the plan asked for
            schedule = self._build(nbytes).schedule
            return self._predict(schedule, self.plans.topology, nbytes, self._late(self.conditions))
        except (GradsyncError, KeyError, SimulationError):
            return None

    def _schedule_of(self, pick: Sequence[str | int], topology: Topology) -> Schedule:
        """The schedule ``auto``'s ``pick`` (name, depth) runs as: the backend's own is priced as its ring."""
        name, depth = str(pick[0]), int(pick[1])
        return native_schedule(topology) if name == NATIVE else self.plans.schedule(name, depth)

    def _straggler_pick(self, nbytes: float, late: dict[int, float]) -> None:
        """With a rank late, ``auto`` runs the straggler schedule for this size class where the model, told of the
        late arrival, prices it faster than the class's own choice (decided by rank 0 for every rank)."""
        plans = self.plans
        size = size_class(nbytes)
        current = plans.choice(size)

        def compute() -> bytes:
            topo = plans.topology
            try:
                best = (self._predict(self._schedule_of(current, topo), topo, nbytes, late), list(current))
            except (GradsyncError, KeyError):
                return json.dumps(list(current)).encode()  # a plan that cannot be priced stays
            for depth in plans.cost_model.pipelines:
                try:
                    t = self._predict(plans.schedule("straggler", depth), topo, nbytes, late)
                except GradsyncError:
                    continue
                best = min(best, (t, ["straggler", depth]))
            return json.dumps(best[1]).encode()

        name, depth = json.loads(plans.decide(f"adapt/straggler/{size}", compute))
        plans.choose(size, (str(name), int(depth)))

    def _expected_rates(self, schedule: Schedule, nbytes: float,
                        topology: Topology) -> tuple[dict[Hashable, float], list[float]]:
        """Per pair, the rate the cost model predicts for ``schedule`` on ``topology``, and per rank, when its
        last message is done (cached)."""
        key = (id(schedule), size_class(nbytes), id(topology))
        got = self._expected.get(key)
        if got is None or got[0] is not schedule or got[1] is not topology:
            sim = simulate(schedule, self.plans.cost_model.rates(topology), float(nbytes), **self._sim_args(schedule))
            start, finish = sim.transfer_times()
            arr = schedule.arrays
            frac = np.array([c.size for c in schedule.chunks])[arr["chunk"]]
            samples = (Sample((int(s), int(d)), float(f) * nbytes, float(a), float(max(a, b)))
                       for s, d, f, a, b in zip(arr["src"], arr["dst"], frac, start, finish)
                       if np.isfinite(a) and np.isfinite(b))  # a transfer of no bytes has no flow
            got = self._expected[key] = (schedule, topology, collective_rates(samples, self.options.pair_min_bytes),
                                         _rank_ends(schedule, finish))
        return got[2], got[3]

    def _ends_on_wire(self, schedule: Schedule, nbytes: float, topology: Topology) -> list[float]:
        """Per rank, when its last message of ``schedule`` is done, priced as :meth:`_predict` prices (the model's
        rates divided by the warm-up's slowdown, α unscaled: a measured α is the wire's already; scaling the whole
        time instead multiplied a large α by the rates' factor and hid a late rank's return)."""
        key = (id(schedule), id(topology), float(nbytes), self.slowdown)
        got = self._ends_s.get(key)
        if got is None or got[0] is not schedule or got[1] is not topology:
            sim = self._on_wire(schedule, topology, nbytes, {})
            got = self._ends_s[key] = (schedule, topology, _rank_ends(schedule, sim.transfer_times()[1]))
        return list(got[2])

    # ---- replanning --------------------------------------------------------------------------------------
    def _prospect(self, switch: Switch, topology: Topology, old: Schedule, nbytes: float) -> tuple[str, float, float] | None:
        """For a switch of link rates alone: the plan a replan on ``topology`` would run for ``nbytes`` and the
        predicted seconds of the running plan and of it there (rank 0 prices, every rank reads the same); None
        where a late rank is involved (the straggler pick prices its own) or the replan cannot be priced."""
        if switch.after.straggler is not None or switch.before.straggler is not None:
            return None
        plans, model = self.plans, self.plans.cost_model
        size = size_class(nbytes)

        def compute() -> bytes:
            try:
                if self.auto:
                    current = plans.chooser()
                    bound = self._no_gain_bound(current, topology, old, nbytes)
                    if bound is not None:
                        return json.dumps(bound).encode()
                    chooser = Chooser(topology, model, algorithms=current.algorithms, native=current.native,
                                      options=plans.options, margin=current.margin, keep_within=current.keep_within)
                    pick = chooser.choose(nbytes)
                    name, depth = pick.algorithm, pick.pipeline
                    self._priced = chooser  # the replan's own: adopted if it runs (rank 0 prices every choice)
                else:
                    chooser = Chooser(topology, model, algorithms=[], native=True, options=plans.options)
                    name, depth = old.algorithm, plans.choice(size)[1]
                new_s = (model.predict_native(topology, float(nbytes)) if name == NATIVE
                         else self._predict(chooser.schedule(name, depth), topology, nbytes, {}))
                old_s = self._predict(old, topology, nbytes, {})
            except (GradsyncError, KeyError):
                return b"null"
            return json.dumps([f"{name}/{depth}", old_s, new_s]).encode()

        got = json.loads(plans.decide(f"adapt/prospect/{self.detector.generation}/{size}", compute))
        return None if got is None else (str(got[0]), float(got[1]), float(got[2]))

    def _no_gain_bound(self, current: Chooser, topology: Topology, old: Schedule,
                       nbytes: float) -> list[str | float] | None:
        """A hold priced without choosing: ``["", now, floor]`` where the running plan, priced ``now`` on ``topology``,
        is within :attr:`AdaptOptions.min_gain` of ``floor``, a lower bound on every plan there; else None (choose).

        ``current`` chose this size on the cluster the running generation planned for, and no plan was priced under
        its least candidate there (less the chooser's pruning share). In the model a slower link makes no plan
        faster, so where ``topology`` only slows links that bound holds on it too (where it speeds some up, by
        at most the largest speed-up). A pair that reads slow for a few collectives on a degraded plan would
        otherwise have rank 0 choose among every plan, while every rank waits, to keep the plan (docs/runtime.md)."""
        size = size_class(nbytes)
        choice = current.chosen(size)
        before, now = current.topology, topology
        if (choice is None or not choice.candidates
                or [(lk.a, lk.b) for lk in before.links] != [(lk.a, lk.b) for lk in now.links]):
            return None
        model = current.model
        rated_before, rated_now = model.rates(before), model.rates(now)
        faster = max([1.0, *(b / a for la, lb in zip(rated_before.links, rated_now.links)
                             for a, b in zip(la.directed_GBps, lb.directed_GBps))])
        floor = min(c.predicted_s for c in choice.candidates) * (1 - PRUNE) / faster
        now_s = model.predict(old, now, size, native=old.algorithm == NATIVE)
        if now_s * (1 - self.options.min_gain) > floor:
            return None
        return ["", now_s, floor]

    def _replan(self, switch: Switch, topology: Topology, old: Schedule, nbytes: float) -> SwitchRecord:
        old_plan = self._label(nbytes)
        self._priced_s.clear()  # the last replan's plans are gone: nothing kept alive past it
        self._ends_s.clear()
        late_kept = switch.after.straggler is not None and switch.after.straggler == switch.before.straggler
        if (self.options.min_gain > 0 and topology == self.plans.topology
                and (late_kept or (switch.after.straggler is None and switch.before.straggler is None))):
            # The slow pairs put no link below the rates the running plan was made for (noise on pairs no link
            # explains, or a return to them): a replan would price the same plan, at a planning's cost on rank 0
            # while every rank waits, on each such flip of the detector.
            if late_kept:
                # With a rank late, its return must still be judged, which no collective is while a pair reads
                # slower than the belief: the pairs learn their level on this plan again, as on a new plan (a
                # healthy pair on the straggler plan's fan-out can read slow for a few collectives: docs/runtime.md).
                learned = self._learned(old)
                for key, _ in switch.after.link_scale:
                    for table in (learned.samples, learned.factors, learned.floors):
                        table.pop(key, None)
            return self._hold(switch, old_plan, "no link is slower than the plan assumes", 0.0)
        # Back to the baseline: its own plans and measured picks are what it runs, with nothing chosen again
        home = (self.auto and self._baseline_picks is not None and switch.after.baseline
                and topology is self.base_topology)
        prospect = (self._prospect(switch, topology, old, nbytes) if self.options.min_gain > 0 and not home
                    else None)
        if prospect is not None and prospect[2] >= prospect[1] * (1 - self.options.min_gain):
            new_label, old_s, new_s = prospect
            share = f"{self.options.min_gain:.0%}"
            why = (f"replanned ({new_label}) it would save under {share}, predicted {old_s:.3g} s -> {new_s:.3g} s "
                   f"per collective" if new_label else
                   f"no plan would save {share}: it is priced {old_s:.3g} s per collective on the cluster as now seen, "
                   f"and none under {new_s:.3g} s before (a slower link makes no plan faster)")
            return self._hold(switch, old_plan, why, 0.0 if not new_label else old_s - new_s)
        late = self._late(switch.after)
        size = size_class(nbytes)
        before = self.plans.choice(size) if self.auto else None  # the size ran: its pick is known on every rank
        recent = self._recent.get(size)
        self._trial, self._recent = None, {}
        if (self.auto and self._baseline_picks is None and self.plans.topology is self.base_topology
                and self.plans.options.straggler is None):  # the baseline's own plans are running: keep its picks
            self._baseline_picks = self.tuning.final_picks()
        self.plans.options = replace(self.base_options, straggler=switch.after.straggler)
        self.tuning.set_cost_model(self.plans.cost_model, topology)  # a new generation: decided afresh, job-wide
        if home:
            self.tuning.restore(self._baseline_picks or {})
            self._baseline_picks = None
        priced, self._priced = self._priced, None
        if (priced is not None and priced.topology is topology and priced.model is self.plans.cost_model
                and priced.options == self.plans.options):
            self.plans.adopt(priced)  # what the prospect planned and priced on rank 0 is not done again
        self._expected.clear()
        self._plans_learned = {}  # the plans of the old generation are gone
        if late and self.auto:
            self._straggler_pick(nbytes, late)
        if self.auto and not home:
            # the watched size runs the model's pick for the new belief at once: an explorer's calls are not watched,
            # so while it explored the links' return would go unseen (docs/runtime.md)
            self.tuning.restore({size: self.plans.choice(size)})
        new = getattr(self._build(nbytes), "schedule", None)
        new_plan = self._label(nbytes)
        times = None
        if self.rank == 0 and isinstance(new, Schedule):  # only rank 0 logs: only it prices the gain
            try:
                times = (self._predict(old, topology, nbytes, late), self._predict(new, topology, nbytes, late))
            except (SimulationError, GradsyncError):
                times = None
        message = describe_switch(switch, old_plan, new_plan, times)
        record = SwitchRecord(switch.generation, switch.collective, switch.after, old_plan, new_plan,
                              None if times is None else times[0] - times[1], message)
        self.switches.append(record)
        self._say(message)
        if before is not None and recent and new_plan != old_plan and (late or switch.after.link_scale):
            self._trial = _Trial(size, before, old_plan, new_plan, statistics.median(recent), [])
        return record

    def _review(self, size: int, seconds: float) -> SwitchRecord | None:
        """One watched collective of a plan on trial (:class:`_Trial`): after as many as the detector needed to
        switch, a plan whose median is slower than the plan it replaced measured before the switch, on the same
        cluster, goes back to that plan for this size (every rank alike: the times are the shared ones). The
        model chose it, the wire decides: the executor's own costs on a loaded host are what no model prices
        (docs/runtime.md, "Plans that follow the cluster")."""
        trial = self._trial
        if trial is None or trial.size != size:
            return None
        trial.samples.append(seconds)
        if len(trial.samples) < self._trial_length:
            return None
        self._trial = None
        got = statistics.median(trial.samples)
        if got <= trial.baseline_s:
            return None
        self.plans.choose(size, trial.before)
        message = (f"gradsync: plan {trial.new_plan} measured {got:.3g} s per collective against {trial.old_plan}'s "
                   f"{trial.baseline_s:.3g} s before the switch, on the same cluster: back to {trial.old_plan}")
        conditions = self.detector.conditions
        record = SwitchRecord(self.detector.generation, self.detector.collectives, conditions, trial.new_plan,
                              trial.old_plan, trial.baseline_s - got, message)
        self.switches.append(record)
        self._say(message)
        return record

    def _hold(self, switch: Switch, old_plan: str, why: str, gain_s: float) -> SwitchRecord:
        """Keep ``old_plan`` through ``switch`` (no new generation): recorded in :attr:`held`, one line from rank 0."""
        self._priced = None
        message = (f"gradsync: plan held at collective {switch.collective}: {seen(switch.before, switch.after)}; "
                   f"keeping {old_plan}: {why}")
        record = SwitchRecord(switch.generation, switch.collective, switch.after, old_plan, old_plan, gain_s, message)
        self.held.append(record)
        self._say(message)
        return record

    def drop_link(self, u: str | int, v: str | int, nbytes: float) -> SwitchRecord:
        """Remove the link between devices ``u`` and ``v`` (names, or rank indices) and replan on the surviving
        graph; every rank calls it at the same point. No path left between some ranks: :class:`PeerError`."""
        topo = self.full_topology
        a, b = (topo.ranks[x] if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < topo.world_size
                else x for x in (u, v))
        key = frozenset((a, b))
        if not topo.has_link(a, b):
            near = sorted(f"{lk.a}-{lk.b}" for lk in topo.links if a in lk.key or b in lk.key)[:8]
            raise GradsyncError(f"topology {topo.name!r} has no link {a}-{b} to drop (given {u!r}, {v!r}); links "
                                f"at those devices: {near or 'none'}")
        self._dropped.setdefault(key, f"{a}-{b}")
        return self._relink(nbytes)

    def _relink(self, nbytes: float) -> SwitchRecord:
        """Replan on :attr:`full_topology` less the links dropped by hand and those without carrier (every rank at
        the same collective): one log line names the links gone or back, the old plan and the new one, and what
        the model predicts for it. No path left between some ranks: :class:`PeerError` naming the link."""
        topo = self.full_topology
        names = {**{lk.key: f"{lk.a}-{lk.b}" for lk in topo.links if lk.key in self.links_down}, **self._dropped}
        gone = set(names)
        before = {lk.key for lk in self.base_topology.links}
        links = [lk for lk in topo.links if lk.key not in gone]
        if len(links) == len(topo.links):
            survived = topo
        else:
            try:
                # the family's own router and symmetry assume every link of the family is there: plan as a graph
                attrs = {k: val for k, val in topo.attrs.items() if k != "family"}
                name = "-".join([topo.name, *names.values()])
                survived = replace(topo, name=name, links=tuple(links), attrs=attrs)
            except TopologyError as exc:
                parts = [_component(links, r, topo) for r in topo.ranks]
                main = max(parts, key=lambda part: sum(r in part for r in topo.ranks))
                cut_off = [r for r in topo.ranks if r not in main]
                dead = ", ".join(names.values())
                who = topo.ranks.index(cut_off[0]) if cut_off else -1
                raise PeerError(f"link{'s' if len(names) > 1 else ''} {dead} {'are' if len(names) > 1 else 'is'} "
                                f"down and no other path joins rank(s) {cut_off} to the others in "
                                f"{topo.name!r}; the job cannot go on without it ({exc})", who) from exc
        now = {lk.key for lk in survived.links}
        what = "; ".join(x for x in (
            ", ".join(f"link {names[k]} {'dropped' if k in self._dropped else 'is down (no carrier)'}"
                      for k in names if k in before - now),
            ", ".join(f"link {lk.a}-{lk.b} is back" for lk in topo.links if lk.key in now - before)) if x)
        old_plan = self._label(nbytes)
        self.base_topology = survived
        self._fresh()
        self.plans.options = self.base_options
        self.tuning.set_cost_model(self.plans.cost_model, survived)
        self._build(nbytes)
        new_plan = self._label(nbytes)
        predicted = self.predicted_s(nbytes)  # the model's price: the watch's slowdown and conditions are reset
        on = (f"replanned on the {len(links)} surviving links" if survived is not topo
              else f"replanned on all {len(links)} links")
        message = (f"gradsync: {what or 'links unchanged'} in {topo.name!r}: {on}; {old_plan} -> {new_plan}"
                   + (f" (predicted {predicted:.3g} s)" if predicted is not None else ""))
        record = SwitchRecord(self.plans.generation, 0, Conditions(), old_plan, new_plan, None, message, predicted)
        self.switches.append(record)
        self._say(message)
        return record

    def _say(self, message: str) -> None:
        if self.rank == 0:
            print(message, file=sys.stderr, flush=True)


def return_margins(rates: Mapping[Hashable, float], levels: Mapping[Hashable, float], path_gain: Mapping[Hashable, float],
                   plan_gain: Mapping[Hashable, float]) -> list[float]:
    """Per pair across a scaled link: its measured rate over the rate that says the link is back, its degraded level
    (``levels``) times ``max(RETURN_MIN, min(RETURN_GAIN, sqrt(path gain), sqrt(plan gain)))``, the middle (in ratio)
    between that level and the pair's rate once back, by the smaller of two gains the return should bring: its
    path's bottleneck rate (``path_gain``, the belief's slowdown of the path) and its rate in the model of the
    running plan (``plan_gain``: the model's rate for the plan on the baseline over that on the belief; a pair
    without one is judged by its path). A plan chosen around a slow link leans on it little, so its pair there gains
    less than the path does (a tree with the cut NIC's rank as a leaf). The model can also miss what the wire gains
    (a ring's pairs wait on its slowest whatever their own rate), so the bar never drops below :data:`RETURN_MIN`,
    above the kernel's per-connection noise. The testbed runs behind both are in docs/runtime.md."""
    out = []
    for k, v in rates.items():
        level, path = levels.get(k), path_gain.get(k, 1.0)
        if not level:
            continue
        need = min(RETURN_GAIN, math.sqrt(path), math.sqrt(plan_gain.get(k, path)))
        out.append(v / (level * max(RETURN_MIN, need)))
    return out


def _slowed(topology: Topology, factor: float) -> Topology:
    """``topology`` with every link's rate divided by ``factor``."""
    if factor == 1.0:
        return topology
    return replace(topology, links=tuple(lk.scaled(1.0 / factor) for lk in topology.links))


def _component(links: list[Link], start: str, topo: Topology) -> set[str]:
    """Devices reachable from ``start`` over ``links``."""
    adj: dict[str, list[str]] = {d.name: [] for d in topo.devices}
    for lk in links:
        adj[lk.a].append(lk.b)
        adj[lk.b].append(lk.a)
    seen, todo = {start}, [start]
    while todo:
        for nxt in adj[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _rank_ends(schedule: Schedule, finish: np.ndarray) -> tuple[float, ...]:
    """Per rank, the latest of ``finish`` (per transfer) over the transfers it sends or receives."""
    arr = schedule.arrays
    ends = np.zeros(schedule.world_size)
    done = np.where(np.isfinite(finish), finish, 0.0)
    m = len(done)
    np.maximum.at(ends, arr["src"][:m], done)
    np.maximum.at(ends, arr["dst"][:m], done)
    return tuple(float(e) for e in ends)
