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


def _two_racks_linked_straight(hosts: int = 3, host_bw: float = 4.0, up_bw: float = 1.0):
    """Two racks as a user writes them without a spine: each rack switch's hosts, the two switches linked."""
    from gradsync.topology import from_dict

    devices = [{"name": f"tor{r}", "kind": "switch"} for r in range(2)]
    devices += [{"name": f"h{r}{h}", "kind": "host"} for r in range(2) for h in range(hosts)]
    links = [{"a": f"h{r}{h}", "b": f"tor{r}", "bandwidth_GBps": host_bw} for r in range(2) for h in range(hosts)]
    links.append({"a": "tor0", "b": "tor1", "bandwidth_GBps": up_bw})
    return from_dict({"name": "two-racks", "devices": devices, "links": links})


def test_two_rack_switches_linked_straight_plan_at_the_cut_bound():
    """No spine: the racks meet across their switches' link. Every exact allreduce moves the buffer once each
    way across that link (the cut bound), and hierarchical does exactly that, self-checked, every collective."""
    topo = _two_racks_linked_straight()
    for collective in ("allreduce", "reduce_scatter", "allgather"):
        s = synthesize("hierarchical", topo, PlanOptions(pipeline=2, collective=collective))
        if collective == "allreduce":
            report = evaluate(s, topo, 1e9)
            assert report.cost == pytest.approx(report.limits.cut, rel=1e-12) and report.cost == pytest.approx(1.0)
    from gradsync.topology.hierarchy import infer_hierarchy

    h = infer_hierarchy(topo)
    assert (h.family, h.radices) == ("racks", (3, 2))
    for level in (0, 1):  # every route is a path of links; across racks it takes the switches' link
        for r in range(topo.world_size):
            for b in h.group(r, level):
                route = h.route(r, b, level)
                assert all(topo.graph.has_edge(u, v) for u, v in zip(route, route[1:])), route
                assert (("tor0" in route) and ("tor1" in route)) == (level == 1), route
