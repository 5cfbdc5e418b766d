"""The simulator's timeline as Chrome trace-event JSON (gradsync.sim.trace), read back with the format's own rules
(tests/trace_events.py), not with our writer."""

from __future__ import annotations

import pytest

from gradsync.plan import PlanOptions
from gradsync.sim import simulate, synthesize
from gradsync.sim.trace import complete_event, into_lanes, name_event, simulation_trace, write_trace
from gradsync.topology import get_topology
from tests.trace_events import load_trace, spans, thread_names


def test_a_ring_simulation_is_one_span_per_flow_at_its_simulated_times(tmp_path):
    topo = get_topology("switch:4")
    result = simulate(synthesize("ring", topo, PlanOptions(size_bytes=4e6)), topo, 4e6, streaming=False)
    events = load_trace(simulation_trace(result, tmp_path / "sim.json"))
    got = spans(events)
    assert len(got) == result.num_flows > 0
    # independent expectation: a ring on 4 ranks is 2(p-1) = 6 steps, each rank sending only to its ring
    # neighbours; the last span ends when the simulation does
    assert {e["args"]["step"] for e in got} == set(range(6))
    pairs = {(e["pid"], int(e["name"].split("->")[1])) for e in got}
    assert pairs and all(d in ((s + 1) % 4, (s - 1) % 4) for s, d in pairs), pairs
    assert max(e["ts"] + e["dur"] for e in got) == pytest.approx(result.time_s * 1e6, rel=1e-9)
    assert min(e["ts"] for e in got) == pytest.approx(0.0, abs=1e-6)
    assert all(e["args"]["algorithm"] == "ring" for e in got)


def test_overlapping_spans_of_one_thread_go_to_lanes_of_their_own(tmp_path):
    events = [name_event("thread_name", "main", 0, 5),
              complete_event("a", "t", 0, 10, 0, 5), complete_event("b", "t", 5, 10, 0, 5),
              complete_event("c", "t", 12, 1, 0, 5)]
    out = load_trace(write_trace(tmp_path / "t.json", events))  # the reader refuses overlapping spans on a thread
    tid = {e["name"]: e["tid"] for e in spans(out)}
    assert tid["a"] == tid["c"] == 5 and tid["b"] != 5
    assert thread_names(out)[(0, tid["b"])] == "main #1"
    assert len(into_lanes(events)) == 5  # one more thread name, no span lost


def test_a_trace_file_must_be_json(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.json"):
        write_trace(tmp_path / "t.png", [])
