"""hierarchical and bml on topology files: the hierarchy comes from the links, so a builder's fabric written
out without attrs plans at the builder's cost (the same schedule), in any rank order; others are refused
with the algorithms that do apply."""

from __future__ import annotations

import random

import pytest

from gradsync.errors import PlanError
from gradsync.plan import PlanOptions, evaluate, synthesize
from gradsync.topology import get_topology
from tests.conftest import random_topology
from tests.topology.test_hierarchy import BCUBES, FATTREES, RACKS, stripped


def _cost(schedule, topology) -> float:
    return evaluate(schedule, topology, 1e9).cost


@pytest.mark.parametrize("spec", RACKS + FATTREES + BCUBES)
def test_a_stripped_file_plans_like_its_builder(spec, tmp_path):
    built = get_topology(spec)
    file = stripped(built, tmp_path)
    algorithms = ["hierarchical", "bml"] if spec.startswith("bcube") else ["hierarchical"]
    for alg in algorithms:
        for collective in ("allreduce", "reduce_scatter", "allgather"):
            opts = PlanOptions(pipeline=2, collective=collective)
            ours, theirs = synthesize(alg, file, opts), synthesize(alg, built, opts)  # both self-checked
            assert _cost(ours, file) == pytest.approx(_cost(theirs, built), rel=1e-12)
            assert (ours.chunks, ours.transfers) == (theirs.chunks, theirs.transfers)
            assert ours.meta == theirs.meta


@pytest.mark.parametrize("spec", ["racks:3,2,4", "fattree:4", "bcube:3,2", "bcube:2,3"])
def test_any_rank_order_plans_at_the_same_cost(spec, tmp_path):
    built = get_topology(spec)
    ranks = list(built.ranks)
    random.Random(3).shuffle(ranks)
    file = stripped(built, tmp_path, ranks)
    algorithms = ["hierarchical", "bml"] if spec.startswith("bcube") else ["hierarchical"]
    for alg in algorithms:
        for collective in ("allreduce", "reduce_scatter", "allgather"):
            opts = PlanOptions(collective=collective)
            ours = synthesize(alg, file, opts)  # checks: every rank ends with the sum / its shard
            assert _cost(ours, file) == pytest.approx(_cost(synthesize(alg, built, opts), built), rel=1e-12)


def test_bml_refuses_a_tree_and_points_to_hierarchical(tmp_path):
    file = stripped(get_topology("fattree:4"), tmp_path)
    with pytest.raises(PlanError, match="'fabric' is not a BCube: its links form a fattree hierarchy.*hierarchical"):
        synthesize("bml", file)


@pytest.mark.parametrize("topology", [get_topology("ring:5"), random_topology(7, 4, seed=2), get_topology("switch:4"),
                                      get_topology("p3.16xlarge[0,1,2,3]")])
@pytest.mark.parametrize("algorithm", ["hierarchical", "bml"])
def test_no_hierarchy_names_what_applies(topology, algorithm):
    with pytest.raises(PlanError, match=r"no switch hierarchy: .*use --algorithm with one of ring, .*tree, lp"):
        synthesize(algorithm, topology)
