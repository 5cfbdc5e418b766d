"""``gradsync bench vs-native`` on topology files: arguments, the shipped hand-written fabrics, the summary."""

from __future__ import annotations

import pytest

from benchmarks import vs_native
from gradsync.sim.choose import Chooser
from gradsync.topology import get_topology
from gradsync.topology.hierarchy import infer_hierarchy

MIB = 2**20


def test_topology_files_run_as_a_user_would_and_fabrics_expand_to_files_and_their_builtins(tmp_path):
    path = vs_native.FABRICS / "two-tier-4to1.yaml"
    args = vs_native._args(["--topology", str(path)])
    (case,) = args.case_list
    assert case.as_user and case.topology == str(path) and case.rate == "60mbit" and case.pairs == ()
    assert args.sizes == ",".join(map(str, vs_native.FABRIC_SIZES))
    args = vs_native._args(["--cases", "fabrics", "--sizes", "4194304"])
    assert [c.name for c in args.case_list] == list(vs_native.FABRIC_CASES) and args.sizes == "4194304"
    assert all(c.as_user for c in args.case_list)
    assert vs_native._args([]).sizes == f"{4 * MIB},13107200,{50 * MIB}"  # the built-in cases keep theirs
    with pytest.raises(SystemExit) as err:
        vs_native._args(["--topology", str(tmp_path / "missing.yaml")])
    assert err.value.code == 2
    with pytest.raises(SystemExit):
        vs_native._args(["--cases", "nope"])


def test_a_builtin_twin_gets_the_files_uplink_rate():
    """A file's unit is its slowest link (the uplink), a built-in's its NIC: racks:2,3,4 at 4x the rate has
    the same 60 Mbit/s uplinks as the 4:1 file at 60 Mbit/s."""
    from gradsync.testbed.build import build_plan

    file_case, twin = vs_native.CASES["file-4to1"], vs_native.CASES["builtin-4to1"]
    rates = []
    for case in (file_case, twin):
        plan = build_plan(get_topology(case.topology), case.rate)
        nics = {round(n.rate_mbit, 6) for s in plan.servers for n in s.nics}
        rates.append(sorted(nics | {round(t.rate_mbit, 6) for t in plan.trunks}))
    assert rates[0] == rates[1] == [60.0, 240.0], rates


@pytest.mark.parametrize("name", ["two-tier-4to1", "two-tier-3to1", "three-rack", "slow-rack"])
def test_the_shipped_fabrics_are_written_by_hand_and_planned_from_their_links(name):
    """No attrs (the hierarchy is inferred from the links) and a bandwidth advantage for a plan over the ring."""
    topo = get_topology(str(vs_native.FABRICS / f"{name}.yaml"))
    assert not topo.attrs and topo.unit_bandwidth_GBps == 1.0
    assert infer_hierarchy(topo) is not None
    assert Chooser(topo, native=True).bandwidth_advantage() > 1.3


def _row(size: int, native: float, gradsync: float) -> dict:
    return {"size_bytes": size, "median_s": {"native": native, "gradsync": gradsync},
            "predicted_s": {"native": native, "gradsync": gradsync}, "ran": ["hierarchical", 4],
            "correct": {"native": True, "gradsync": True}, "cpu_busy_share": 0.5}


def test_the_advantage_starts_at_the_smallest_size_from_which_gradsync_stays_ahead():
    rows = [_row(1 << 18, 1.0, 1.1), _row(1 << 20, 1.0, 0.9), _row(1 << 22, 1.0, 1.05), _row(1 << 24, 1.0, 0.8),
            _row(1 << 26, 1.0, 0.7)]
    assert vs_native.advantage_from(rows) == 1 << 24
    assert vs_native.advantage_from(rows[:3]) is None
    assert vs_native.advantage_from([_row(1 << 20, 1.0, 0.5)]) == 1 << 20


def test_the_summary_compares_a_file_with_its_builtin_twin():
    file_rows = [_row(4 << 20, 1.0, 0.62)]  # 1.61x
    twin_rows = [_row(4 << 20, 1.0, 0.60)]  # 1.67x: the file within 10 %
    results = [{"case": "file-4to1", "topology": "two-tier-4to1.yaml", "rate": "60mbit", "allreduce": file_rows,
                "as_user": True, "twin": "builtin-4to1", "goal": 1.5, "goal_from": 4 << 20, "cost_model": {}},
               {"case": "builtin-4to1", "topology": "racks:2,3,4", "rate": "240mbit", "allreduce": twin_rows,
                "as_user": True, "goal": 0.97, "cost_model": {}}]
    lines, met = vs_native.summarize(results)
    assert met and any("vs built-in builtin-4to1 1.67 (-3%; within 10%: met)" in ln for ln in lines), lines
    results[0]["allreduce"] = [_row(4 << 20, 1.0, 0.66)]  # 1.52x: 9 % below the twin, still met
    assert vs_native.summarize(results)[1]
    results[0]["allreduce"] = [_row(4 << 20, 1.0, 0.68)]  # 1.47x: below the 1.5x goal and 12 % below the twin
    lines, met = vs_native.summarize(results)
    assert not met and any("NOT met" in ln for ln in lines)


def test_short_sizes_get_more_alternating_samples_up_to_a_cap():
    """At least ``reps`` each; then on until every method ran ``min_seconds``; never past 20x ``reps``."""
    from benchmarks.vs_native_worker import enough

    def rows(n: int, each: float) -> dict[str, list[float]]:
        return {"native": [each] * n, "gradsync": [each * 0.5] * n}

    assert not enough(rows(4, 1.0), 5, 1.0)  # too few reps, however long
    assert enough(rows(5, 1.0), 5, 1.0)
    assert not enough(rows(5, 0.02), 5, 1.0)  # 5 x 20 ms: keep going
    assert not enough(rows(60, 0.02), 5, 1.0)  # native has its second, gradsync (10 ms each) 0.6 s
    assert enough(rows(100, 0.02), 5, 1.0)  # both past 1 s, and at the cap anyway
    assert enough(rows(100, 1e-4), 5, 1.0)  # the cap: 20 x reps
    assert enough(rows(5, 0.02), 5, 0.0)  # min_seconds 0: exactly reps, as before
