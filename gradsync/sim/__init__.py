"""Simulation: a flow-level, event-driven network simulator for any schedule (plan -> simulate -> run).

``simulate(schedule, topology, size)`` moves every transfer as a fluid flow over its route, shares link
directions max-min fairly, honours the schedule's dependencies (streaming or store-and-forward) and the
links' α–β costs, and returns a :class:`SimResult` with the time, per-link busy time and the timeline.

``synthesize(algorithm, topology, options)`` plans any synthesizer or ``auto``, the pick with the least
predicted time (:mod:`gradsync.sim.choose`).

``simulate_iteration(dag, order, IterationConfig(...))`` simulates one training/inference iteration of W
workers (compute DAG + parameter transfers in a given order, PS or allreduce) for TicTac.
"""

from gradsync.sim.choose import Chooser, algorithm_names, plan_auto, synthesize
from gradsync.sim.cost import CostModel
from gradsync.sim.engine import FAIRNESS, SimResult, simulate
from gradsync.sim.flows import FlowSet, SimulationError, build_flows, by_step, schedule_dependencies, tensor_sizes
from gradsync.sim.iteration import (
    ITERATION_MODES,
    IterationConfig,
    IterationEvent,
    IterationResult,
    plot_iteration,
    resolve_priorities,
    simulate_iteration,
)
from gradsync.sim.timeline import plot_timeline

__all__ = [
    "Chooser",
    "CostModel",
    "FAIRNESS",
    "FlowSet",
    "ITERATION_MODES",
    "IterationConfig",
    "IterationEvent",
    "IterationResult",
    "SimResult",
    "SimulationError",
    "algorithm_names",
    "build_flows",
    "by_step",
    "plot_iteration",
    "plan_auto",
    "plot_timeline",
    "resolve_priorities",
    "schedule_dependencies",
    "simulate",
    "simulate_iteration",
    "synthesize",
    "tensor_sizes",
]
