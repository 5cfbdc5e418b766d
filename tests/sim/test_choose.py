"""The chooser (gradsync.sim.choose): native unless a synthesizer is clearly faster under the cost model."""

from __future__ import annotations

import pytest

from gradsync.sim.choose import Chooser
from gradsync.sim.cost import NATIVE, CostModel
from gradsync.topology import get_topology


def test_chooser_keeps_native_where_nothing_is_clearly_faster():
    """Two ranks on one switch: every schedule is the same two messages, so the backend's ring stays."""
    t = get_topology("switch:2")
    ch = Chooser(t, CostModel(), native=True)
    for size in (4096, 1 << 20, 1 << 26):
        c = ch.choose(size)
        assert c.algorithm == NATIVE and c.candidates[0].algorithm == NATIVE


def test_chooser_picks_bml_on_bcube_for_large_messages():
    """BCube(3,2): the rank-order ring crosses both switch levels; BML's 2k steps use every NIC (seed 001)."""
    t = get_topology("bcube:3,2")
    c = Chooser(t, CostModel(), native=True).choose(50 << 20)
    native = c.candidates[0].predicted_s
    assert c.algorithm != NATIVE and c.predicted_s < native / 1.8


def test_chooser_skips_candidates_the_planner_refuses(monkeypatch):
    """A candidate too large to plan (the planner's memory estimate raises PlanError) is not a candidate:
    deeper pipelines of it stop, other algorithms still compete; with none left, the error names each."""
    import gradsync.plan.synthesizers as synthesizers
    from gradsync.errors import PlanError
    from gradsync.topology.io import get_topology

    real = synthesizers.synthesize

    def guarded(name, topology, options, **kw):
        if name == "ring" or (name == "tree" and options.pipeline >= 4):
            raise PlanError(f"{name} at pipeline {options.pipeline} needs too much memory")
        return real(name, topology, options, **kw)

    monkeypatch.setattr(synthesizers, "synthesize", guarded)  # what the chooser plans with
    topo = get_topology("racks:2,2,4")
    choice = Chooser(topo, algorithms=["ring", "tree"]).choose(1 << 22, exact=True)
    seen = {(c.algorithm, c.pipeline) for c in choice.candidates}
    assert seen and all(a == "tree" and p < 4 for a, p in seen)
    with pytest.raises(PlanError, match="no algorithm can be planned .* ring: ring at pipeline 1 needs too much"):
        Chooser(topo, algorithms=["ring"]).choose(1 << 22, exact=True)


def test_chooser_keeps_the_native_ring_where_the_topology_gives_no_bandwidth_advantage():
    """On a flat switch every schedule's fluid time equals the backend's ring; a predicted gain would come
    only from per-message costs (calibrated on the wire, least certain): native stays, even when α says
    otherwise. Where the topology does give an advantage (racks), a planned schedule still wins."""
    flat = Chooser(get_topology("switch:8"), CostModel(message_s=1e-6, native_message_s=2e-3), native=True)
    assert flat.choose(4 << 20).algorithm == NATIVE
    racks = Chooser(get_topology("racks:2,3,4"), CostModel(message_s=1e-4, native_message_s=1e-4), native=True)
    assert racks.choose(16 << 20).algorithm != NATIVE


def test_auto_considers_the_straggler_schedule_only_when_a_late_rank_is_named():
    """A schedule for a condition the topology does not show is no candidate until something reports it."""
    from gradsync.plan import PlanOptions

    topo = get_topology("switch:4")
    assert "straggler" not in Chooser(topo).algorithms
    assert "straggler" in Chooser(topo, options=PlanOptions(straggler=2)).algorithms
    assert "straggler" in Chooser(topo, algorithms=["straggler", "ring"]).algorithms  # named: always
