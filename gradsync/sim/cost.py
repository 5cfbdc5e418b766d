"""One cost model for the planner, the simulator and the runtime: a schedule's time as the runtime runs it.

The executor (:mod:`gradsync.comm.executor`) moves each (sub-)chunk of a schedule as one message and
forwards or reduces it only once it has fully arrived: *store-and-forward per sub-chunk*. The messages
between two ranks share one TCP connection and go one after another; a rank's one thread handles its
arrivals one at a time, each costing a fixed software time α (waiting, adding, posting the next, the
transport's own handshakes); links are duplex, but a stream's acknowledgements take a share κ of its rate
on the opposite direction (so a link loaded both ways carries ``1/(1+κ)`` each way, as measured); a
transport reaches only a share of a link's rate (TCP goodput). That is exactly the event simulator with
``streaming=False, fifo=True`` (:func:`gradsync.sim.simulate`), ``message_s = α`` and ``reverse_share = κ``
on the topology with calibrated link rates (and ``burst_s``, a shaper's token bucket per link direction:
short messages after a gap cross faster than the rate), so the model *is* that simulation, not a
second formula that could drift from it. Closed forms it reproduces (tested):

* ring allreduce on N ranks, M bytes, link rate β:  ``2 (N-1) (M / (N β) + α)``;
* a chain of h hops pipelined in P sub-chunks:       ``(h + P - 1) (M / (P β) + α)`` -- so P trades α
  against overlap, and the best P grows like ``sqrt(M (h-1) / (α β))``;
* k ranks sending M to one rank of a switch:         ``k M / β + k α`` (the fan-in a PS owner pays).

The planner's fluid cost ``max_e c_e load_e`` (OMS) is the P → ∞, α → 0 limit of this model.

``native`` is the backend's own collective (``torch.distributed.all_reduce``: gloo's ring in rank order,
run in C++), priced by the same simulation of a rank-order ring with the backend's own α. A runtime whose
transport has a process group may choose it; a plan never contains it.

Calibration: the defaults are the topology file's rates with α for gloo over TCP on loopback; a
:class:`CostModel` can be measured (``gradsync.init(calibrate=True)``, cached per topology) or written by
hand, and is plain JSON (``to_dict``/``from_dict``, validated).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gradsync.errors import PlanError
from gradsync.plan.routing import router_for
from gradsync.plan.schedule import Chunk, Schedule
from gradsync.plan.synthesizers import ring_blocks, split_chunks
from gradsync.sim.engine import SimResult, simulate
from gradsync.topology.model import Topology, recorded_link_scales

__all__ = ["BURST_NOISE", "DEFAULT_SOURCE", "MAX_ORDERED_TRANSFERS", "NATIVE", "RATE_TOLERANCE", "CostModel", "burst_of", "native_schedule", "phase_order", "reverse_share_of", "size_class",
           "stream_rate_of"]

#: The pseudo-algorithm name for the backend's own allreduce.
NATIVE = "native"
#: Schedules up to this many transfers wait in predicted arrival order (:meth:`CostModel.wait_order`); larger ones
#: (thousands of ranks) keep step order rather than spend a simulation at plan time.
MAX_ORDERED_TRANSFERS = 200_000

#: A calibration stream slower than its path's modelled rate by more than this factor rescales the links
#: (:meth:`CostModel.refined`): the topology's rates are wrong, not merely TCP's goodput.
RATE_TOLERANCE = 2.0

#: :attr:`CostModel.source` of a model nothing was measured for: the file's rates, loopback's α.
DEFAULT_SOURCE = "defaults"

#: Smallest size class: every message up to this many bytes is planned as this size.
MIN_CLASS_BYTES = 4096


def reverse_share_of(samples: Sequence[tuple[float, float, float, float]], cap: float = 0.5) -> float:
    """κ from timings of one stream and of two opposite streams, each at two sizes ``m < M``.

    ``samples``: per repetition ``(one way m, one way M, both ways m, both ways M)`` seconds. A transfer's
    start (two streams ramping up at once into one bottleneck) costs a fixed time that the wire's steady
    state does not, and a collective's streams run long: so κ is measured on the extra ``M - m`` bytes,

        κ = median( (both(M) - both(m)) / (one(M) - one(m)) ) - 1,

    where the start-up and α cancel (on racks:2,3,4's uplink with gloo, either size alone gave a larger ratio
    than the difference, the smaller size the largest). A repetition whose differences are not positive (noise dwarfs the extra
    bytes, as on loopback) is skipped; with none left, the ratio of the large transfers stands in. The
    result is kept in ``[0, cap]``.
    """
    rows = [tuple(float(v) for v in row) for row in samples]
    if not rows or any(len(r) != 4 for r in rows):
        raise PlanError(f"reverse_share_of needs (one m, one M, both m, both M) per repetition; got {samples!r}")
    ratios = [(bl - bs) / (ol - os) for os, ol, bs, bl in rows if ol > os and bl > bs]
    if not ratios:
        ratios = [bl / ol for _, ol, _, bl in rows if ol > 0]
    if not ratios:
        return 0.0
    return min(cap, max(0.0, float(np.median(ratios)) - 1.0))


def stream_rate_of(samples: Sequence[tuple[float, float]], small_bytes: float, large_bytes: float) -> tuple[float, float]:
    """A stream's steady-state rate from one-way timings at two sizes, as ``(bytes, seconds)`` for
    :meth:`CostModel.refined`.

    ``samples``: per repetition ``(one way of small_bytes, one way of large_bytes)`` seconds. A transfer's
    start (connection warm-up, TCP's window opening, a shaper's burst, α) costs a fixed time that a
    collective's long streams do not pay per byte: timing the whole transfer alone mixes it into the rate
    and prices every byte too high. So the rate is the extra ``large - small`` bytes over the extra time,
    where the start cancels. Each size's fastest repetition is taken: a busy CPU or a competing flow only
    ever adds time, never removes it (a median of two on a loaded testbed read a 60 Mbit/s uplink as
    43 Mbit/s). Where the larger is not slower (noise dwarfs the extra bytes, as on loopback), the fastest
    large transfer whole stands in.
    """
    rows = [tuple(float(v) for v in row) for row in samples]
    if not rows or any(len(r) != 2 for r in rows) or not 0 < small_bytes < large_bytes:
        raise PlanError(f"stream_rate_of needs (one way small, one way large) per repetition and "
                        f"0 < small_bytes < large_bytes; got {samples!r}, {small_bytes!r}, {large_bytes!r}")
    small = min(r[0] for r in rows)
    large = min(r[1] for r in rows)
    if large > small:
        return float(large_bytes - small_bytes), large - small
    return float(large_bytes), large


#: A burst shorter than this share of the tiny transfer's own time is read as noise (no bucket): :func:`burst_of`.
BURST_NOISE = 1.0


def burst_of(samples: Sequence[tuple[float, float]], tiny_bytes: float, mid_bytes: float, rate_Bps: float) -> float:
    """Seconds of a token bucket on a stream's path (:attr:`CostModel.burst_s`) from one-way timings.

    ``samples``: per repetition ``(one way of tiny_bytes, one way of mid_bytes)`` seconds, on a path whose
    steady rate ``rate_Bps`` was measured on long streams (:func:`stream_rate_of`). Under a bucket of ``B``
    bytes a transfer of ``m > B`` after an idle spell takes its start plus ``(m - B) / rate``, and the tiny
    one is all start, so ``B = mid - rate (t(mid) - t(tiny))``. Each size's fastest repetition is taken (a
    busy CPU only adds time). ``B`` is kept in ``[0, mid]`` and returned as seconds at the rate, ``B / rate``;
    a burst that saves less than :data:`BURST_NOISE` times the tiny transfer's whole time is noise, and 0.
    """
    rows = [tuple(float(v) for v in row) for row in samples]
    ok = rows and all(len(r) == 2 and all(math.isfinite(v) and v >= 0 for v in r) for r in rows)
    if not ok or not 0 < tiny_bytes < mid_bytes or not (math.isfinite(rate_Bps) and rate_Bps > 0):
        raise PlanError(f"burst_of needs (one way tiny, one way mid) seconds per repetition, 0 < tiny_bytes < "
                        f"mid_bytes and a positive rate; got {samples!r}, {tiny_bytes!r}, {mid_bytes!r}, {rate_Bps!r}")
    tiny = min(r[0] for r in rows)
    mid = min(r[1] for r in rows)
    burst = min(float(mid_bytes), max(0.0, mid_bytes - rate_Bps * (mid - tiny)))
    seconds = burst / rate_Bps
    return seconds if seconds > BURST_NOISE * tiny else 0.0


def _bottleneck(topo: Topology, route: Any, src: int, dst: int) -> tuple[float, int]:
    """The slowest link direction (GB/s) on ``route``'s path from rank ``src`` to rank ``dst``, and its hops."""
    hops = topo.route_links(route(topo.ranks[src], topo.ranks[dst]))
    return min(topo.links[e].directed_GBps[d] for e, d in hops), len(hops)


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PlanError(f"{name}={value!r} must be a finite number of seconds >= 0")
    return float(value)


@dataclass(frozen=True)
class CostModel:
    """α–β costs of the runtime's messages; see the module docstring for the model.

    ``message_s``: α of one executor message (gloo p2p from Python). ``native_message_s``: α of one step
    of the backend's own ring allreduce (C++). ``goodput``: share of every link's rate a transport
    reaches, in (0, 1]. ``reverse_share``: κ in [0, 1), the share of a stream's rate its acknowledgements
    take on the opposite direction of each link it crosses (:func:`gradsync.sim.engine.with_reverse_share`;
    measured by ``gradsync testbed probe --duplex``: a link loaded both ways carries ``1 / (1 + κ)`` of a
    lone stream each way). ``burst_s``: seconds of tokens each link direction holds at its own rate (a
    token-bucket shaper: ``tc tbf``'s burst, a cloud NIC's burst credits; 0 for a wire that never runs above
    its rate; measured by the calibration, :func:`burst_of`). ``link_GBps``: measured rates per link class
    (``Link.kind``): each class's slowest link runs at it, the class's others keep their ratio to that link
    (:meth:`rates`, before ``goodput``). ``pipelines``: sub-chunk counts the chooser tries.
    ``source`` says where the numbers came from (``defaults``, ``measured``, ``probe``, a file).
    """

    message_s: float = 150e-6
    native_message_s: float = 60e-6
    goodput: float = 1.0
    reverse_share: float = 0.0
    burst_s: float = 0.0
    link_GBps: Mapping[str, float] = field(default_factory=dict)
    pipelines: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    source: str = DEFAULT_SOURCE

    def __post_init__(self) -> None:
        _seconds("message_s", self.message_s)
        _seconds("native_message_s", self.native_message_s)
        _seconds("burst_s", self.burst_s)
        g = self.goodput
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise PlanError(f"goodput={g!r} must lie in (0, 1]: the share of a link's rate a transport reaches")
        k = self.reverse_share
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 <= k < 1:
            raise PlanError(f"reverse_share={k!r} must lie in [0, 1): the share of a stream's rate its "
                            f"acknowledgements take on the opposite link direction (0: none)")
        for kind, bw in dict(self.link_GBps).items():
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
                raise PlanError(
                    f"link_GBps[{kind!r}]={bw!r}: a measured rate must be a positive number of GB/s "
                    f"(a link that measured 0 is down or the probe failed; fix it or drop the entry)"
                )
        if not self.pipelines or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in self.pipelines):
            raise PlanError(f"pipelines={self.pipelines!r} must be a non-empty tuple of integers >= 1")
        object.__setattr__(self, "link_GBps", dict(self.link_GBps))
        object.__setattr__(self, "pipelines", tuple(sorted(set(self.pipelines))))

    # ---- JSON ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"type": "gradsync.cost_model", "message_s": self.message_s, "native_message_s": self.native_message_s,
                "goodput": self.goodput, "reverse_share": self.reverse_share, "burst_s": self.burst_s, "link_GBps": dict(self.link_GBps), "pipelines": list(self.pipelines),
                "source": self.source}

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        if not isinstance(data, dict) or data.get("type") != "gradsync.cost_model":
            raise PlanError("a cost model file must be a JSON object with \"type\": \"gradsync.cost_model\"")
        known = {"message_s", "native_message_s", "goodput", "reverse_share", "burst_s", "link_GBps", "pipelines", "source"}
        extra = set(data) - known - {"type"}
        if extra:
            raise PlanError(f"unknown cost model fields {sorted(extra)}; known: {sorted(known)}")
        kw = {k: data[k] for k in known if k in data}
        if "pipelines" in kw:
            kw["pipelines"] = tuple(kw["pipelines"])
        if "link_GBps" in kw and not isinstance(kw["link_GBps"], dict):
            raise PlanError(f"link_GBps={kw['link_GBps']!r} must map link classes to GB/s")
        return cls(**kw)

    # ---- the model ------------------------------------------------------------------------------------------
    def rates(self, topology: Topology) -> Topology:
        """``topology`` with the link rates the runtime really gets: each measured class's slowest link direction at
        the class rate (``link_GBps``, the rate a probe gives a class), its other links keeping their ratio to that
        one (a file's 3:1 host links and uplinks of one kind stay 3:1), then ``goodput``. A link a runtime's belief
        scaled (``attrs[LINK_SCALE]``, :func:`gradsync.comm.watch.scaled_topology`) keeps its scales: the class is
        anchored on the links' rates before them, so the class rate replaces what the file says, not what the wire
        was seen to do since."""
        if not self.link_GBps and self.goodput == 1.0:
            return topology
        scaled = recorded_link_scales(topology)
        slowest: dict[str, float] = {}
        for lk in topology.links:
            if lk.kind in self.link_GBps:
                up, down = scaled.get((lk.a, lk.b), (1.0, 1.0))
                a_b, b_a = lk.directed_GBps
                slowest[lk.kind] = min(slowest.get(lk.kind, math.inf), a_b / up, b_a / down)
        links = tuple(lk.scaled(self.goodput * (self.link_GBps[lk.kind] / slowest[lk.kind] if lk.kind in slowest else 1.0))
                      for lk in topology.links)
        return replace(topology, links=links)

    def path_GBps(self, topology: Topology, src: int, dst: int) -> float:
        """The rate one stream from rank ``src`` to rank ``dst`` gets under this model: the slowest link
        direction of its route, measured class rates × goodput (:meth:`rates`)."""
        topo = self.rates(topology)
        return _bottleneck(topo, router_for(topo), src, dst)[0]

    def paths_from(self, topology: Topology, src: int) -> list[tuple[float, int]]:
        """Per rank ``dst``, ``(path_GBps, hops)`` of the route from rank ``src`` (``(inf, 0)`` for ``src``
        itself), with the rates and the router built once."""
        topo = self.rates(topology)
        route = router_for(topo)
        return [(math.inf, 0) if dst == src else _bottleneck(topo, route, src, dst) for dst in range(topo.world_size)]

    def refined(self, topology: Topology, src: int, dst: int, nbytes: float, seconds: float) -> tuple[CostModel, str | None]:
        """This model after one stream from rank ``src`` to rank ``dst`` moved ``nbytes`` in ``seconds``.

        A topology file that states rates the wire does not have (a library's 10 Gbit/s defaults on a
        200 Mbit/s network) makes ``auto`` price messages as free and choose for α alone. Where the stream
        ran more than :data:`RATE_TOLERANCE` times slower than :meth:`path_GBps` predicts, every link is
        scaled by ``measured / predicted`` through ``goodput`` (the share of the stated rates the transport
        really reaches), keeping the file's ratios between links and classes (the measured path is the
        bottleneck one; ``gradsync testbed probe`` measures each class). Within that tolerance, or
        faster, the model is returned unchanged: the measurement is one stream on a shared machine, and a
        fast loopback says nothing about a cluster's links. Returns ``(model, note)``; ``note`` says what was
        changed (None: nothing). A measurement that cannot be a rate (``nbytes`` or ``seconds`` not a
        positive finite number) leaves the model unchanged and says so in ``note``.
        """
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                 for v in (nbytes, seconds))
        if not ok:
            return self, (f"ignored a rate measurement of {nbytes!r} bytes in {seconds!r} s from rank {src} to "
                          f"rank {dst}: not a positive rate; the topology's rates are kept")
        expected = self.path_GBps(topology, src, dst)
        measured = nbytes / seconds / 1e9
        if measured * RATE_TOLERANCE >= expected:
            return self, None
        scale = measured / expected
        note = (f"rank {src} -> rank {dst} moved {nbytes / 2**20:.1f} MiB at {measured * 8:.3g} Gbit/s, "
                f"{expected / measured:.1f}x below the {expected * 8:.3g} Gbit/s the topology gives that path: "
                f"every link scaled by {scale:.3g} (goodput {self.goodput:.3g} -> {self.goodput * scale:.3g})")
        return replace(self, goodput=self.goodput * scale, source=f"{self.source}; {note}"), note

    def predict(self, schedule: Schedule, topology: Topology, size_bytes: float, *, native: bool = False) -> float:
        """Seconds to allreduce ``size_bytes`` with ``schedule`` as the runtime runs it (``native``: with the
        backend's α instead of the executor's)."""
        return self.run(schedule, topology, size_bytes, native=native).time_s

    def run(self, schedule: Schedule, topology: Topology, size_bytes: float, *, native: bool = False,
            start_delay_s: Mapping[int, float] | None = None) -> SimResult:
        """The simulation :meth:`predict` reads its time from (per transfer: :meth:`SimResult.transfer_times`,
        what :meth:`wait_order` orders by); ``start_delay_s``: late ranks, as :func:`~gradsync.sim.simulate` takes."""
        return simulate(schedule, self.rates(topology), float(size_bytes), streaming=False, fifo=True,
                        reverse_share=self.reverse_share, burst_s=self.burst_s, progress=False,
                        start_delay_s=start_delay_s, **self.messages(native))

    def messages(self, native: bool = False) -> dict[str, Any]:
        """:func:`~gradsync.sim.simulate`'s per-message arguments for a schedule the executor runs (its α, in series
        with the wire) or for the backend's own ring (``native``: the backend's α, overlapping the wire)."""
        return {"message_s": self.native_message_s if native else self.message_s, "message_overlap": native}

    def wait_order(self, schedule: Schedule, topology: Topology, size_bytes: float,
                   given: np.ndarray | None = None) -> np.ndarray:
        """Per transfer, the order in which the executor should wait for it: the model's predicted finish
        time, raised where needed so that it never decreases along a rank's phases of one chunk.

        The executor blocks on one message at a time (gloo's p2p work cannot be polled), the one with the
        smallest ``(order, step, ...)`` key. Waiting in step order makes a tree's root finish every
        sub-chunk of step 0 before it touches step 1's, whose early sub-chunks arrived long ago: its
        broadcast starts late (head-of-line blocking; on the racks testbed a large share of the allreduce).
        Waiting in predicted arrival order removes that. Deadlock-freedom needs a *global* order in which
        every transfer comes after its dependencies and after the earlier phases of its chunk at both
        ends; :func:`phase_order` gives exactly that (``key[t] >= key[u]`` for every such ``u``, ties
        broken by step), so the executor's induction still holds. ``given``: the per-transfer finish times of
        :meth:`run` for these arguments where the caller has them already (the chooser that priced the plan), so
        the same simulation is not run twice.
        """
        if not schedule.num_transfers:
            return np.zeros(0)

        def finish(delay: Mapping[int, float] | None) -> np.ndarray:
            return self.run(schedule, topology, size_bytes, start_delay_s=delay).transfer_times()[1]

        times = finish(None) if given is None else given
        late = schedule.meta.get("straggler")  # the rank a straggler plan lets join last (plan.straggler)
        if isinstance(late, int) and schedule.world_size > 1:
            # A plan for a late rank is waited on as if it came after everything that does not need it: in the
            # on-time order the others would block on its first message and leave the reduce among themselves,
            # the work its lateness is there to hide, until it arrives.
            times = finish({late: float(np.max(times[np.isfinite(times)], initial=0.0))})
        return phase_order(schedule, times)

    def predict_native(self, topology: Topology, size_bytes: float) -> float:
        """Seconds for the backend's own allreduce (a rank-order ring, :func:`native_schedule`)."""
        return self.predict(native_schedule(topology), topology, size_bytes, native=True)


def phase_order(schedule: Schedule, times: Sequence[float] | np.ndarray) -> np.ndarray:
    """``times`` (one per transfer) raised just enough that no transfer comes before a transfer of the same
    chunk at an earlier step at either of its ends: ``key[t] = max(times[t], key[u])`` over those ``u``, in
    one forward pass over the steps. With ties broken by step, ``(key, step)`` then orders every transfer
    after its dependencies and after the earlier phases of its chunk at both ends, for any ``times``.
    """
    a = schedule.arrays
    n = len(schedule.transfers)
    key = np.asarray(times, float).copy()
    if key.shape != (n,):
        raise PlanError(f"times has shape {key.shape}; give one time per transfer ({n})")
    if n == 0:
        return key
    c = len(schedule.chunks)
    src, dst = a["src"] * c + a["chunk"], a["dst"] * c + a["chunk"]
    last = np.full(len(schedule.ranks) * c, -np.inf)
    order = np.argsort(a["step"], kind="stable")
    for ids in np.split(order, np.flatnonzero(np.diff(a["step"][order])) + 1):
        key[ids] = np.maximum(key[ids], np.maximum(last[src[ids]], last[dst[ids]]))
        np.maximum.at(last, src[ids], key[ids])
        np.maximum.at(last, dst[ids], key[ids])
    return key


def native_schedule(topology: Topology) -> Schedule:
    """gloo's ring allreduce as a schedule: one ring in process-rank order, one chunk per rank."""
    n = topology.world_size
    if n == 1:
        return Schedule(NATIVE, topology.name, topology.ranks, (Chunk(0.0, 1.0, 0),), ())
    chunks, ids = split_chunks([1.0 / n] * n, 1)
    route = router_for(topology)
    order = list(range(n))
    routes = [route(topology.ranks[i], topology.ranks[(i + 1) % n]) for i in range(n)]
    blocks, chunks = ring_blocks([order], [[ids[p][0] for p in range(n)]], [routes], chunks)
    return Schedule(NATIVE, topology.name, topology.ranks, tuple(chunks), (), blocks=tuple(blocks))


def size_class(nbytes: float) -> int:
    """The power of two at or above ``nbytes`` (at least :data:`MIN_CLASS_BYTES`): plans are kept per class."""
    return max(MIN_CLASS_BYTES, 1 << max(0, math.ceil(math.log2(max(float(nbytes), 1.0)))))
