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


def test_two_synthesizers_that_plan_the_same_transfers_are_simulated_once(monkeypatch):
    """On racks:2,3,4 the LP's optimum is one tree, the one ``tree`` plans: the chooser prices the two with one
    simulation (Schedule.digest) and gives both the time that simulation gives."""
    ch = Chooser(get_topology("racks:2,3,4"), CostModel(), algorithms=["tree", "lp"])
    a, b = ch.schedule("tree", 4), ch.schedule("lp", 4)
    assert a.algorithm != b.algorithm and a.digest == b.digest
    calls: list[str] = []
    real = CostModel.run  # the simulation predict() reads its time from
    monkeypatch.setattr(CostModel, "run", lambda self, s, *args, **kw: calls.append(s.algorithm) or real(self, s, *args, **kw))
    size = float(1 << 22)
    assert ch.predict(a, size) == ch.predict(b, size) == real(ch.model, b, ch.topology, size).time_s
    assert calls == ["tree"]
    ch.predict(ch.schedule("tree", 8), size)
    assert calls == ["tree", "tree"]  # another depth is other transfers


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


def _racks_file(tmp_path, hosts: list[float], uplink: float, direct: bool = False) -> str:
    """A hand-written two-tier file as a user writes one: no attrs, no link classes, no unit. ``hosts[i]``:
    the host-link rate of rack ``i`` (two hosts a rack); uplinks to a core, or two ToRs linked straight."""
    import yaml

    devices = [{"name": f"tor{i}", "kind": "switch"} for i in range(len(hosts))]
    links = []
    for i, rate in enumerate(hosts):
        for j in range(2):
            devices.append({"name": f"h{i}{j}", "kind": "host"})
            links.append({"a": f"h{i}{j}", "b": f"tor{i}", "bandwidth_GBps": rate})
    if direct:
        links.append({"a": "tor0", "b": "tor1", "bandwidth_GBps": uplink})
    else:
        devices.append({"name": "core", "kind": "switch"})
        links += [{"a": f"tor{i}", "b": "core", "bandwidth_GBps": uplink} for i in range(len(hosts))]
    path = tmp_path / f"fabric-{len(hosts)}-{direct}.yaml"
    path.write_text(yaml.safe_dump({"name": path.stem, "devices": devices, "links": links}))
    return str(path)


@pytest.mark.parametrize("racks, hosts", [(2, 2), (2, 3), (3, 3)])
def test_bandwidth_advantage_is_the_rings_uplink_load_over_the_cut_bound(tmp_path, racks, hosts):
    """r racks of s hosts (N = r s) at 4:1: the rank-order ring crosses each uplink once each way with
    2 (N-1)/N of the buffer; every exact allreduce moves 2 (r-1)/r of it over an uplink (the cut around one
    rack: (r-1)/r in and out), which the hierarchical plan reaches. The advantage is their ratio; on a flat
    switch it is 1 whatever the rates."""
    from gradsync.topology import Device, Link, Topology

    devs = [Device(f"tor{i}", "switch") for i in range(racks)] + [Device("core", "switch")]
    links = []
    for i in range(racks):
        for j in range(hosts):
            devs.append(Device(f"h{i}{j}", "host"))
            links.append(Link(f"h{i}{j}", f"tor{i}", 4.0))
        links.append(Link(f"tor{i}", "core", 1.0))
    topo = Topology("hand", tuple(devs), tuple(links))
    n = racks * hosts
    ring, cut = 2 * (n - 1) / n, 2 * (racks - 1) / racks if racks > 2 else 1.0
    got = Chooser(topo, CostModel(), native=True).bandwidth_advantage()
    assert got == pytest.approx(ring / cut, rel=1e-9)
    # rates scaled by the wire (a calibration's goodput) change no ratio
    assert Chooser(topo, CostModel(goodput=0.01), native=True).bandwidth_advantage() == pytest.approx(got, rel=1e-9)
    assert Chooser(get_topology(f"switch:{n}"), CostModel(), native=True).bandwidth_advantage() == pytest.approx(1.0)


DEPTHS = (1, 2, 4, 8, 16, 32)  # up to 32 (not the default 64): a 6-rank ring at depth 64 takes seconds to simulate
MODELS = {
    "defaults": CostModel(pipelines=DEPTHS),
    # a file's nominal rates on a wire 100x slower, with a loaded machine's message costs (what calibration finds)
    "calibrated": CostModel(message_s=1e-3, native_message_s=1.2e-3, goodput=0.01, pipelines=DEPTHS),
}
FABRICS = {"two racks, ToRs linked": ([4.0, 4.0], True), "three racks, one slower": ([4.0, 4.0, 2.0], False)}


@pytest.fixture(scope="module")
def hand_written(tmp_path_factory):
    """Each fabric's file, and its schedules per (algorithm, depth) planned once for every case."""
    from gradsync.plan import synthesize as plan
    from gradsync.plan.synthesizers import SYNTHESIZERS, PlanOptions
    from gradsync.sim.cost import native_schedule

    out = {}
    for fabric, (hosts, direct) in FABRICS.items():
        topo = get_topology(_racks_file(tmp_path_factory.mktemp("fabric"), hosts, 1.0, direct))
        schedules = {(NATIVE, 1): native_schedule(topo)}
        for name in SYNTHESIZERS.names():
            if not SYNTHESIZERS.get(name).applicable(topo):
                schedules.update({(name, p): plan(name, topo, PlanOptions(pipeline=p)) for p in DEPTHS})
        out[fabric] = (topo, schedules)
    return out


@pytest.mark.parametrize("fabric", sorted(FABRICS))
@pytest.mark.parametrize("model, size", [("defaults", 65536), ("defaults", 4 << 20), ("calibrated", 4 << 20)])
def test_auto_on_a_hand_written_file_is_the_fastest_candidate_in_the_event_simulator(hand_written, fabric, model, size):
    """On small hand-written files (no attrs) the chooser's pick is, by brute force over every applicable
    algorithm at every depth and the native ring, each simulated as the runtime runs it, the fastest, but
    for the chooser's exact prunings (PRUNE) and its margin for keeping the native ring. With the calibrated
    model on three racks lp's predictions fall, rise, then fall again with depth (DEPTH_PATIENCE)."""
    from gradsync.sim import simulate
    from gradsync.sim.choose import PRUNE

    topo, schedules = hand_written[fabric]
    m = MODELS[model]
    chooser = Chooser(topo, m, native=True)
    choice = chooser.choose(size, exact=True)
    fast = m.rates(topo)
    brute = {key: simulate(s, fast, float(size), streaming=False, fifo=True, reverse_share=m.reverse_share,
                           message_s=m.native_message_s if key[0] == NATIVE else m.message_s, progress=False).time_s
             for key, s in schedules.items()}
    assert ("hierarchical", 1) in brute  # inferred from the links, not attrs
    got = brute[choice.algorithm, choice.pipeline]
    best = min(brute.values())
    if choice.algorithm == NATIVE:  # kept unless something is faster by more than the margin
        assert best >= got * (1 - chooser.margin) - 1e-12, (choice, brute)
    else:
        assert got <= best / (1 - PRUNE) + 1e-12, (choice, brute)
        assert got < brute[NATIVE, 1] * (1 - chooser.margin)


class _Priced:
    """A stand-in schedule for :func:`_depths_priced`: its algorithm and depth, and no transfers."""

    def __init__(self, algorithm: str, pipeline: int) -> None:
        import numpy as np

        self.algorithm, self.pipeline, self.arrays = algorithm, pipeline, {"dst": np.zeros(0, dtype=int)}


def _depths_priced(monkeypatch, curves: dict, keep_within: float):
    """The chooser's pick and the depths it simulated per algorithm, where ``curves[algorithm][depth]`` is the
    predicted time (algorithms tried in the order given: the first has the least fluid time)."""
    order = list(curves)
    priced: dict[str, list[int]] = {a: [] for a in curves}
    monkeypatch.setattr(Chooser, "schedule", lambda self, a, p, check=False: _Priced(a, p))
    monkeypatch.setattr(Chooser, "fluid_s", lambda self, a, size: 0.01 * (1 + order.index(a)))
    monkeypatch.setattr(Chooser, "predict", lambda self, s, size: priced[s.algorithm].append(s.pipeline)
                        or curves[s.algorithm][s.pipeline])
    ch = Chooser(get_topology("racks:2,2,2"), CostModel(pipelines=(1, 2, 4, 8, 16, 32, 64)), algorithms=order,
                 keep_within=keep_within)
    choice = ch.choose(1 << 20, exact=True)
    return (choice.algorithm, choice.pipeline), priced


LEADER = {1: 10.0, 2: 6.0, 4: 4.0, 8: 3.0, 16: 2.5, 32: 2.3, 64: 2.4}
# behind: gains halve per doubling (4, 2, 1, 0.5, 0.25, ...), so from depth 16 on it cannot reach 2.3 (4.5 - 2 x 1)
FAR = {1: 12.0, 2: 8.0, 4: 6.0, 8: 5.0, 16: 4.5, 32: 4.25, 64: 4.125}
# behind by 6 %, and rising from depth 16: a close rival whose best depth (8) is found
CLOSE = {1: 3.0, 2: 2.6, 4: 2.45, 8: 2.44, 16: 2.46, 32: 2.47, 64: 2.5}


@pytest.mark.parametrize("keep_within, far_depths", [(0.0, [1, 2, 4, 8, 16]), (0.1, [1, 2, 4, 8, 16, 32])])
def test_an_algorithm_behind_stops_deepening_once_its_gains_cannot_catch_up(monkeypatch, keep_within, far_depths):
    """Deep pipelines are the costly simulations (9216 transfers took 14.5 s on the three-rack file at 16 MiB). An
    algorithm behind another's best stops once its latest gains per doubling, twice over, cannot bring it below
    that best (``keep_within=0``), or within ``keep_within`` of it (what the runtime's explorer reads rivals
    from). A close rival stops at its first rise; the leader keeps its patience (DEPTH_PATIENCE) and the pick
    is what brute force over every depth gives."""
    pick, priced = _depths_priced(monkeypatch, {"lp": LEADER, "forest": FAR, "hierarchical": CLOSE}, keep_within)
    assert pick == ("lp", 32)
    assert priced["lp"] == [1, 2, 4, 8, 16, 32, 64]
    assert priced["forest"] == far_depths
    assert priced["hierarchical"] == [1, 2, 4, 8, 16]  # without the stop, patience priced 32 as well


def test_the_leader_that_falls_rises_and_falls_again_is_still_followed(monkeypatch):
    """The stop applies only behind another algorithm: lp's own plans may fall, rise, then fall again with depth
    (a different forest at each), and its best beyond the rise is still found."""
    lp = {1: 10.0, 2: 6.0, 4: 3.0, 8: 3.01, 16: 2.8, 32: 2.7, 64: 2.75}
    far = {p: t + 1.0 for p, t in FAR.items()}
    for keep_within in (0.0, 0.1):
        pick, priced = _depths_priced(monkeypatch, {"lp": lp, "forest": far}, keep_within)
        assert pick == ("lp", 32) and priced["lp"] == [1, 2, 4, 8, 16, 32, 64], (keep_within, priced)
        assert priced["forest"][-1] < 64


def test_keep_within_out_of_range_is_a_clear_error():
    from gradsync.errors import PlanError

    with pytest.raises(PlanError, match=r"keep_within=1\.5 must lie in \[0, 1\)"):
        Chooser(get_topology("racks:2,2,2"), keep_within=1.5)


def test_explore_candidates_are_the_pick_its_depths_a_close_rival_and_the_backend():
    """What a runtime's explorer times, from the choice alone: a plan's double and half depth where the model prices
    and plans them, the best other algorithm within EXPLORE_RIVAL, the backend's collective where it was priced; for
    the backend's pick, a plan within EXPLORE_NATIVE."""
    from gradsync.sim.choose import EXPLORE_NATIVE, EXPLORE_RIVAL, Candidate, Choice

    c = Chooser(get_topology("racks:2,3,4"), CostModel(pipelines=(1, 2, 4, 8)), native=True)

    def choice(pick, *cands):
        return Choice(pick[0], pick[1], 1.0, 1 << 20, tuple(Candidate(a, p, t) for a, p, t in cands))

    near, far = 1 + EXPLORE_RIVAL * 0.9, 1 + EXPLORE_RIVAL * 1.1
    got = c.explore_candidates(choice(("forest", 8), ("native", 1, 2.0), ("forest", 8, 1.0), ("hierarchical", 2, near)))
    assert got == [("forest", 8), ("forest", 4), ("hierarchical", 2), ("native", 1)]  # 16 is not a priced depth
    got = c.explore_candidates(choice(("forest", 1), ("forest", 1, 1.0), ("hierarchical", 2, far)))
    assert got == [("forest", 1), ("forest", 2)]  # no depth 0, no rival that far, the backend not priced
    got = c.explore_candidates(choice(("forest", 2), ("forest", 2, 1.0), ("forest", 4, 1.0)), model=("forest", 4))
    assert got == [("forest", 4), ("forest", 8), ("forest", 2)]  # a measured pick replaced the model's
    native = choice(("native", 1), ("native", 1, 1.0), ("tree", 4, 1 + EXPLORE_NATIVE * 0.9))
    assert c.explore_candidates(native) == [("native", 1), ("tree", 4)]


def test_priced_gives_the_picks_finish_times_beside_a_neighbours():
    """A neighbour's finish times kept for the class (finish_of: an explorer's candidate) do not stand in for the
    pick's in what priced() hands on; finish_of simulates once and keeps."""
    import numpy as np

    c = Chooser(get_topology("racks:2,3,4"), CostModel(), native=True, keep_within=0.1)
    size = 8 << 20
    got = c.choose(size)
    pick = c.schedule(got.algorithm, got.pipeline)
    other = next(s for a, p in [(n, q) for n in c.algorithms for q in c.model.pipelines]
                 if (s := c.schedule(a, p)).digest != pick.digest)
    times = c.finish_of(other, size)
    assert c.finish_of(other, size) is times
    assert np.array_equal(times, c.model.run(other, c.topology, size).transfer_times()[1])
    digest, finish = c.priced(size)[1]
    assert digest == pick.digest and np.array_equal(finish, c.finish_times(pick, size))
    flat = Chooser(get_topology("switch:4"), CostModel(), native=True, keep_within=0.1)
    assert flat.choose(size).algorithm == NATIVE  # no wait order to hand on, whatever else is kept
    flat.finish_of(flat.schedule(flat.algorithms[0], 1), size)
    assert flat.priced(size)[1] is None
