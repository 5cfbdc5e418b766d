"""Planning: the Schedule representation, synthesizers in a registry, and physical limits (OMS, BML, MXNET-MPI)."""

from gradsync.plan import bml, hierarchical, straggler  # noqa: F401  (register the bml, hierarchical and straggler synthesizers)
from gradsync.plan.cut_bound import CutBound, cut_bound
from gradsync.plan.forest import ForestPacking, GatherBound, gather_cut_bound, pack_arborescences
from gradsync.plan.limits import Limits, limits
from gradsync.plan.lp import TreePacking, bottleneck_tree, pack_trees, partition_bound
from gradsync.plan.report import PlanReport, evaluate, predicted_time
from gradsync.plan.schedule import COLLECTIVES, SHARDED, Chunk, LinkLoads, Schedule, Transfer, Tree
from gradsync.plan.synthesizers import PLANNED_COLLECTIVES, SYNTHESIZERS, PlanOptions, Synthesizer, synthesize

__all__ = [
    "COLLECTIVES",
    "PLANNED_COLLECTIVES",
    "SHARDED",
    "SYNTHESIZERS",
    "Chunk",
    "CutBound",
    "ForestPacking",
    "GatherBound",
    "LinkLoads",
    "Limits",
    "PlanOptions",
    "PlanReport",
    "Schedule",
    "Synthesizer",
    "Transfer",
    "Tree",
    "TreePacking",
    "bottleneck_tree",
    "cut_bound",
    "evaluate",
    "gather_cut_bound",
    "limits",
    "pack_arborescences",
    "pack_trees",
    "partition_bound",
    "predicted_time",
    "synthesize",
]
