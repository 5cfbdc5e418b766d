"""What ``gradsync plan`` prints: cost, bounds, predicted time and per-link utilisation of a schedule.

Time model (bandwidth-only, streaming): links are duplex, the reduce and the broadcast run at once, and
chunks stream through every route, so an allreduce of S bytes takes ``cost * S / unit_bw``. With a latency
(from ``--latency`` or the links' own ``latency_s``), each step of the schedule adds the slowest route's
latency in that step. The simulator gives the exact event-driven time; this is the planner's estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradsync.plan.forest import gather_cut_bound
from gradsync.plan.limits import Limits, limits
from gradsync.plan.schedule import SHARDED, Schedule
from gradsync.topology.model import Topology

__all__ = ["PlanReport", "evaluate", "predicted_time", "latency_term", "sharded_limits"]


def latency_term(schedule: Schedule, topology: Topology, latency_s: float | None) -> float:
    """Sum over steps of the largest route latency in that step (``latency_s`` per hop overrides links)."""
    per_step: dict[int, float] = {}
    cache: dict[tuple[str, ...], float] = {}

    def latency(route: tuple[str, ...]) -> float:
        lat = cache.get(route)
        if lat is None:
            hops = topology.route_links(route)
            lat = len(hops) * latency_s if latency_s is not None else sum(topology.links[e].latency_s for e, _ in hops)
            cache[route] = lat
        return lat

    for t in schedule.explicit:
        per_step[t.step] = max(per_step.get(t.step, 0.0), latency(t.route))
    for b in schedule.blocks:  # per block, not per transfer: every chunk of a block uses the same routes per step
        for step, lat in b.step_latency(schedule, latency).items():
            per_step[step] = max(per_step.get(step, 0.0), lat)
    return sum(per_step.values())


def sharded_limits(topology: Topology, collective: str) -> Limits:
    """Bounds of a reduce-scatter or allgather (:mod:`gradsync.plan.forest`): ForestColl's cut bound is the
    optimum of schedules whose switches only forward; ``aggregation_cut`` is the part of it that holds even
    for switches that could multicast or add: the cuts ``V - {r}`` (or ``{r}``), every switch on the far side,
    ``(N - 1) / (N w_in(r))`` (``w_out`` for reduce-scatter)."""
    bound = gather_cut_bound(topology, collective).value
    n = topology.world_size
    single = 0.0
    if n > 1:
        d = topology.directed_costs
        into = np.zeros(len(topology.devices))
        idx = topology.device_index
        for lk, (ab, ba) in zip(topology.links, d):
            # allgather: what enters rank r (a -> b enters b); reduce-scatter: what leaves it
            fwd, back = (ab, ba) if collective == "allgather" else (ba, ab)
            into[idx[lk.b]] += 1 / fwd
            into[idx[lk.a]] += 1 / back
        single = max((n - 1) / (n * into[idx[r]]) for r in topology.ranks)
    return Limits(bound, bound, None, None, None, None, method="cut", aggregation_cut=single)


def predicted_time(
    schedule: Schedule, topology: Topology, size_bytes: float, latency_s: float | None = None, *, cost: float | None = None
) -> float:
    """Planner's time estimate (module docstring); pass ``cost`` when the link loads are already summed."""
    if cost is None:
        cost = schedule.link_loads(topology).cost(topology.directed_costs)
    assert topology.unit_bandwidth_GBps is not None
    return cost * size_bytes / (topology.unit_bandwidth_GBps * 1e9) + latency_term(schedule, topology, latency_s)


@dataclass(frozen=True)
class PlanReport:
    """The numbers of one planned schedule on one topology for one message size."""

    topology: str
    algorithm: str
    size_bytes: float
    unit_bandwidth_GBps: float
    cost: float
    aggregation_cost: float
    half_duplex_cost: float
    limits: Limits
    time_s: float
    algbw_GBps: float
    steps: int
    chunks: int
    transfers: int
    links: list[dict[str, Any]] = field(default_factory=list)
    link_classes: dict[str, dict[str, float]] = field(default_factory=dict)
    trees: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    collective: str = "allreduce"

    @property
    def lower_bound(self) -> float:
        return self.limits.lower_bound

    @property
    def gap(self) -> float:
        """Relative distance of ``cost`` above the lower bound (0 means provably optimal)."""
        return self.cost / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "gradsync.plan",
            "topology": self.topology,
            "algorithm": self.algorithm,
            "collective": self.collective,
            "size_bytes": self.size_bytes,
            "unit_bandwidth_GBps": self.unit_bandwidth_GBps,
            "cost": self.cost,
            "aggregation_cost": self.aggregation_cost,
            "half_duplex_cost": self.half_duplex_cost,
            "lower_bound": self.lower_bound,
            "gap": self.gap,
            "bounds": self.limits.to_dict(),
            "time_s": self.time_s,
            "algbw_GBps": self.algbw_GBps,
            "steps": self.steps,
            "chunks": self.chunks,
            "transfers": self.transfers,
            "link_classes": self.link_classes,
            "links": self.links,
            "trees": self.trees,
            "meta": self.meta,
        }


def evaluate(
    schedule: Schedule,
    topology: Topology,
    size_bytes: float,
    latency_s: float | None = None,
    bounds: Limits | None = None,
) -> PlanReport:
    """Cost in OMS's units, bounds, predicted time and utilisation per link and per link class."""
    costs = topology.costs
    directed_costs = topology.directed_costs
    loads = schedule.link_loads(topology)
    cost = loads.cost(directed_costs)
    unit = float(topology.unit_bandwidth_GBps or 1.0)
    time_s = predicted_time(schedule, topology, size_bytes, latency_s, cost=cost)
    links = []
    classes: dict[str, dict[str, float]] = {}
    for i, lk in enumerate(topology.links):
        busy = float((loads.directed[i] * directed_costs[i]).max())
        util = busy / cost if cost > 0 else 0.0
        links.append({
            "a": lk.a, "b": lk.b, "kind": lk.kind, "bandwidth_GBps": lk.bandwidth_GBps,
            **({} if lk.symmetric else {"bandwidth_down_GBps": lk.bandwidth_down_GBps}),
            "load_ab": float(loads.directed[i, 0]), "load_ba": float(loads.directed[i, 1]),
            "busy_cost": busy, "utilisation": util,
        })
        cls = classes.setdefault(lk.kind, {"links": 0, "max_busy_cost": 0.0, "max_utilisation": 0.0, "mean_utilisation": 0.0})
        cls["links"] += 1
        cls["max_busy_cost"] = max(cls["max_busy_cost"], busy)
        cls["max_utilisation"] = max(cls["max_utilisation"], util)
        cls["mean_utilisation"] += util
    for cls in classes.values():
        cls["mean_utilisation"] /= cls["links"]
    return PlanReport(
        topology=topology.name,
        algorithm=schedule.algorithm,
        size_bytes=float(size_bytes),
        unit_bandwidth_GBps=unit,
        cost=cost,
        aggregation_cost=loads.aggregation_cost(costs),
        half_duplex_cost=loads.half_duplex_cost(costs),
        limits=bounds or (sharded_limits(topology, schedule.collective) if schedule.collective in SHARDED
                          else limits(topology, achieved=cost)),
        time_s=time_s,
        algbw_GBps=size_bytes / time_s / 1e9 if time_s > 0 else float("inf"),
        steps=schedule.num_steps,
        chunks=len(schedule.chunks),
        transfers=schedule.num_transfers,
        links=links,
        link_classes=classes,
        trees=[t.to_dict(schedule.ranks) for t in schedule.trees],
        meta=dict(schedule.meta),
        collective=schedule.collective,
    )
