"""Simulation: a flow-level, event-driven network simulator for any schedule (plan -> simulate -> run).

``simulate(schedule, topology, size)`` moves every transfer as a fluid flow over its route, shares link
directions max-min fairly, honours the schedule's dependencies (streaming or store-and-forward) and the
links' α–β costs, and returns a :class:`SimResult` with the time, per-link busy time and the timeline.
"""

from gradsync.sim.engine import FAIRNESS, SimResult, simulate
from gradsync.sim.flows import FlowSet, SimulationError, build_flows, by_step, schedule_dependencies, tensor_sizes
from gradsync.sim.timeline import plot_timeline

__all__ = [
    "FAIRNESS",
    "FlowSet",
    "SimResult",
    "SimulationError",
    "build_flows",
    "by_step",
    "plot_timeline",
    "schedule_dependencies",
    "simulate",
    "tensor_sizes",
]
