"""The switch hierarchy inferred from links: builders' fabrics written out as files without attrs infer their
builders' groups and labels, checked against graph distances; graphs without one say why."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import networkx as nx
import pytest

from gradsync.errors import TopologyError
from gradsync.topology import Device, Link, Topology, from_dict, get_topology, load, save
from gradsync.topology.hierarchy import SwitchHierarchy, infer_hierarchy, switch_hierarchy
from tests.conftest import random_topology

RACKS = ["racks:2,3,4", "racks:3,2,1", "racks:4,1,2", "racks:2,5,3", "racks:3,3,2"]
FATTREES = ["fattree:2", "fattree:4", "fattree:6"]
BCUBES = ["bcube:2,2", "bcube:3,2", "bcube:2,3", "bcube:4,2", "bcube:3,3"]


def stripped(topology: Topology, tmp_path: Path, ranks: list[str] | None = None) -> Topology:
    """``topology`` saved as a JSON file, every ``attrs`` removed, loaded back: what a user would write."""
    data = json.loads(save(topology, tmp_path / "fabric.json").read_text())
    data.pop("attrs", None)
    for d in data["devices"]:
        d.pop("attrs", None)
    if ranks is not None:
        data["ranks"] = ranks
    data["name"] = "fabric"
    path = tmp_path / "fabric-stripped.json"
    path.write_text(json.dumps(data))
    out = load(path)
    assert not out.attrs and not any(d.attrs for d in out.devices)
    return out


def builder_digits(topology: Topology) -> list[tuple[int, ...]]:
    """The builder's own addresses, from its attrs (level 0 first)."""
    family = topology.attrs["family"]
    at = [topology.device(r).attrs for r in topology.ranks]
    if family == "racks":
        return [(a["index"], a["rack"]) for a in at]
    if family == "fattree":
        return [(a["index"], a["edge"], a["pod"]) for a in at]
    return [tuple(reversed(a["digits"])) for a in at]


def switch_hops(topology: Topology) -> dict[tuple[int, int], int]:
    """Brute force: switches crossed on a shortest path between every pair of ranks (no relaying ranks)."""
    g = topology.graph.copy()
    out = {}
    for i, a in enumerate(topology.ranks):
        dist = nx.single_source_shortest_path_length(g, a)
        for j, b in enumerate(topology.ranks):
            out[(i, j)] = dist[b]
    return out


def check_against_graph(h: SwitchHierarchy, topology: Topology) -> None:
    """Routes are paths of the graph meeting at a switch; addresses agree with graph distances."""
    names = set(topology.ranks)
    for lv in range(len(h.radices)):
        for a in range(h.world_size):
            for b in h.group(a, lv):
                route = h.route(a, b, lv)
                assert route[0] == topology.ranks[a] and route[-1] == topology.ranks[b]
                assert all(topology.has_link(u, v) for u, v in itertools.pairwise(route)), route
                assert not names & set(route[1:-1]), route  # only switches relay
    hops = switch_hops(topology)
    for (a, b), d in hops.items():
        differ = [lv for lv in range(len(h.radices)) if h.digits[a][lv] != h.digits[b][lv]]
        if h.family == "bcube":  # one switch per corrected digit: distance 2 x Hamming distance
            assert d == 2 * len(differ), (a, b)
        elif differ:  # trees: the highest differing level decides how far up the path climbs
            assert d == 2 * (max(differ) + 1), (a, b, d, differ)


@pytest.mark.parametrize("spec", RACKS + FATTREES + BCUBES)
def test_a_stripped_file_infers_its_builders_hierarchy(spec, tmp_path):
    built = get_topology(spec)
    file = stripped(built, tmp_path)
    h = infer_hierarchy(file)
    assert h.family == built.attrs["family"]
    assert list(h.digits) == builder_digits(built)  # labels too, not only groups: rank order decides them
    assert h == switch_hierarchy(built)
    assert h.paths == switch_hierarchy(built).paths
    check_against_graph(h, file)


@pytest.mark.parametrize("spec", ["racks:3,2,1", "fattree:4", "bcube:3,2", "bcube:2,3"])
def test_shuffled_rank_order_infers_the_same_groups(spec, tmp_path):
    built = get_topology(spec)
    ranks = list(built.ranks)
    random.Random(7).shuffle(ranks)
    file = stripped(built, tmp_path, ranks)
    h, ref = infer_hierarchy(file), switch_hierarchy(built)

    def blocks(hier: SwitchHierarchy, order: tuple[str, ...], lv: int) -> set[frozenset[str]]:
        """Ranks agreeing on every digit above ``lv`` (a leaf's, a pod's): the same whatever the port labels."""
        out: dict[tuple[int, ...], set[str]] = {}
        for r, d in enumerate(hier.digits):
            out.setdefault(d[lv + 1:], set()).add(order[r])
        return {frozenset(b) for b in out.values()}

    def named(groups: list[frozenset[int]], order: tuple[str, ...]) -> set[frozenset[str]]:
        return {frozenset(order[r] for r in g) for g in groups}

    assert h.radices == ref.radices
    for lv in range(len(h.radices)):
        assert blocks(h, file.ranks, lv) == blocks(ref, built.ranks, lv)
        if h.family == "bcube":  # a BCube group is one switch's ranks, so it has no labels to choose
            assert named(h.groups(lv), file.ranks) == named(ref.groups(lv), built.ranks)
    assert sorted(h.rank_at) == list(range(len(ranks))) and h.rank_at != ref.rank_at  # a permutation
    check_against_graph(h, file)


def test_rates_do_not_define_the_structure(tmp_path):
    """A slower rack and unequal uplinks: the links still say racks under one core."""
    built = get_topology("racks:3,2,1")
    links = []
    for lk in built.links:
        if lk.a in ("host0", "host1"):
            lk = Link(lk.a, lk.b, 0.125, kind="slow")
        elif lk.b == "core":
            lk = Link(lk.a, lk.b, {"tor0": 1.25, "tor1": 0.5, "tor2": 4.0}[lk.a], bandwidth_down_GBps=0.25)
        links.append(lk)
    file = from_dict({**stripped(built, tmp_path).to_dict(), "links": [
        {"a": lk.a, "b": lk.b, "bandwidth_up_GBps": lk.directed_GBps[0], "bandwidth_down_GBps": lk.directed_GBps[1]}
        for lk in links]})
    h = infer_hierarchy(file)
    assert (h.family, h.radices, list(h.digits)) == ("racks", (2, 3), builder_digits(built))


def test_a_rack_selection_of_a_fattree_is_two_tier():
    """fattree:4[0,1,2,3] is one pod: two leaves under two common aggregation switches, one per port."""
    h = switch_hierarchy(get_topology("fattree:4[0,1,2,3]"))
    assert (h.family, h.radices) == ("racks", (2, 2))
    assert [p[1][-1] for p in h.paths] == ["p0.agg0", "p0.agg1", "p0.agg0", "p0.agg1"]


def test_the_builders_family_admits_one_switch(tmp_path):
    """racks:1,s,o and bcube:n,1 keep their one-level hierarchy; the same graph as a file has none."""
    assert switch_hierarchy(get_topology("racks:1,3,4")).radices == (3, 1)
    assert switch_hierarchy(get_topology("bcube:4,1")).radices == (4,)
    for spec in ("racks:1,3,4", "bcube:4,1"):
        with pytest.raises(TopologyError, match="no switch hierarchy: every rank hangs off one switch"):
            infer_hierarchy(stripped(get_topology(spec), tmp_path))


def _dual_homed() -> Topology:
    """Four hosts each on two switches, but not as a BCube: both switches hold hosts 0-2 and 1-3."""
    hosts = [Device(f"h{i}", "host") for i in range(4)]
    sws = [Device(f"sw{i}", "switch") for i in range(3)]
    pairs = [("h0", "sw0"), ("h1", "sw0"), ("h2", "sw0"), ("h0", "sw1"), ("h3", "sw1"), ("h1", "sw2"),
             ("h2", "sw2"), ("h3", "sw2")]
    return Topology("dual", tuple(hosts + sws), tuple(Link(a, b, 1.0) for a, b in pairs))


@pytest.mark.parametrize("topology,why", [
    (get_topology("ring:5"), "rank 'gpu0' is linked straight to rank 'gpu1'"),
    (random_topology(6, 3, seed=1), "linked straight to rank"),
    (get_topology("switch:4"), "every rank hangs off one switch 'sw0'"),
    (get_topology("p3.16xlarge[0,1,2,3]"), "linked straight"),
    (get_topology("fattree:4[0,1,2]"), "leaf switches hold unequal numbers of ranks"),
    (get_topology("p2.16xlarge"), "no core switch that is linked to every pod"),
    (_dual_homed(), "switch links|BCube-like"),
])
def test_no_hierarchy_says_why(topology, why):
    with pytest.raises(TopologyError, match=f"{re.escape(repr(topology.name))} has no switch hierarchy: .*({why})"):
        infer_hierarchy(topology)


def test_addresses_must_be_distinct():
    with pytest.raises(TopologyError, match="share address"):
        SwitchHierarchy("racks", ("rack",), (2,), ((0,), (0,)), ((("a", "s"),), (("b", "s"),)))


def test_a_single_rank_or_an_unlinked_rank_has_no_hierarchy():
    """One rank (a selection like ``p3.16xlarge[3]``) has no links: no hierarchy, said as such, not a crash."""
    from gradsync.errors import TopologyError
    from gradsync.topology import get_topology
    from gradsync.topology.hierarchy import infer_hierarchy

    with pytest.raises(TopologyError, match="has no links .one rank: nothing to aggregate."):
        infer_hierarchy(get_topology("p3.16xlarge[3]"))
