"""The topology model (gradsync.topology.model): bad topologies name the problem; a rank must compute."""
from __future__ import annotations

import pytest

from gradsync.errors import TopologyError
from gradsync.topology import Device, Link, Topology, from_dict

BAD = [
    ({"name": "x", "devices": [{"name": "a"}], "links": [{"a": "a", "b": "zz", "bandwidth_GBps": 1}]}, "unknown device 'zz'"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": 0}]}, "positive number"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": -3}]}, "positive"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "a"}], "links": []}, "appears twice"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": []}, "disconnected"),
    ({"name": "x", "devices": [{"name": "a", "kind": "tpu"}], "links": []}, "kind 'tpu'"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": 1, "bw": 2}]}, "unknown field"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": 1}, {"a": "b", "b": "a", "bandwidth_GBps": 1}]}, "summed bandwidth"),
    ({"name": "x", "devices": [{"name": "s", "kind": "switch"}], "links": []}, "no compute device"),
    ({"name": "x", "devices": [{"name": "a"}], "links": [], "ranks": ["q"]}, "not a declared device"),
    ({"devices": [], "links": []}, "missing the required field 'name'"),
    ({"name": "x", "devices": [{"name": "a"}, {"name": "b"}], "links": [{"a": "a", "b": "b", "bandwidth_GBps": 1, "latency_s": -1}]}, "latency_s"),
]


@pytest.mark.parametrize("data, message", BAD)
def test_bad_topologies_name_the_problem(data, message):
    with pytest.raises(TopologyError, match=message.replace("(", r"\(")):
        from_dict(data)


def test_rank_must_compute():
    with pytest.raises(TopologyError, match="cannot hold or add data"):
        Topology("t", (Device("a"), Device("s", "switch")), (Link("a", "s", 1.0),), ranks=("a", "s"))
