"""``gradsync bench compression-sweep`` (issue 40 part 3): the quick mode end to end on loopback, the paired
arithmetic against hand-computed numbers, the goals, and the testbed cells with the root-only steps faked."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch.distributed as dist

import benchmarks.compression_sweep as bench
from benchmarks.compression_sweep_worker import ANCHOR, FIXED, extra_steps, method_names
from gradsync.errors import GradsyncError
from tests.bench.fake_testbed import fake_testbed


def _method(samples: list[float], accuracy: float | None = 0.9, first: list[float] | None = None) -> dict:
    return {"median_s": statistics.median(samples), "samples_s": samples, "first_steps_s": first or [],
            "accuracy": accuracy, "test_loss": 0.3, "replicas_identical": True, "stats": {}}


def _config(**methods: dict) -> dict:
    return {"model": "mlp", "path": "hook", "parameters": 10, "methods": methods}


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_quick_mode_writes_the_json_and_the_heat_map_with_ratios_from_the_paired_samples(tmp_path, capsys):
    """With a budget no configuration can spend, the steps run to --max-steps on both ranks (rank 0's count,
    broadcast: were the ranks to disagree, the replicas' collectives would hang or fail)."""
    pytest.importorskip("sklearn")  # the digits
    pytest.importorskip("matplotlib")
    max_steps = bench.QUICK["steps"] + 14  # beyond where timing starts (auto chose until step 13-14 on 2 cores)
    assert bench.main(["--quick", "--budget-s", "3600", "--max-steps", str(max_steps), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "compression_sweep_quick.png").stat().st_size > 0
    doc = json.loads((tmp_path / "compression_sweep_quick.json").read_text())
    assert doc["type"] == bench.RESULT_TYPE and doc["complete"] and doc["allow"] == "any"
    assert set(doc["goals"]) >= {"never_loses", "wire_bound_vs_ddp", "accuracy_points_vs_ddp", "choose_share", "met"}
    (cell,) = doc["cells"]
    assert cell["mode"] == "loopback" and cell["world_size"] == 2
    assert cell["runtimes"] == "one per method and configuration"
    (config,) = cell["configs"]
    assert (config["model"], config["path"]) == ("lenet5", "optimizer")
    # timed from --warmup on, once auto stopped choosing; then --steps less --warmup steps at least, and to --max-steps
    start, warmup = config["timed_from"], bench.QUICK["warmup"]
    rows = config["methods"]
    assert start >= warmup and rows["auto"]["choosing_steps"] <= start
    steps = max(max_steps, start + bench.QUICK["steps"] - warmup)
    assert config["steps"] == steps and config["accuracy_steps"] == bench.QUICK["steps"]
    assert list(rows) == method_names() == ["ddp", ANCHOR, "none", *FIXED, "auto"]
    for name, r in rows.items():
        assert len(r["samples_s"]) == steps - start and all(s > 0 for s in r["samples_s"]), name
        assert r["median_s"] == statistics.median(r["samples_s"]), name
        assert len(r["losses"]) == steps and len(r["first_steps_s"]) == steps, name
        assert 0.0 <= r["accuracy"] <= 1.0 and r["test_loss"] > 0, name  # at --steps
        assert 0.0 <= r["accuracy_final"] <= 1.0 and r["test_loss_final"] > 0, name  # after the budget's steps
        assert r["replicas_identical"] is True, name
    groups = sum(rows["auto"]["stats"]["codecs"].values())  # the partition chosen with the codec (merge="auto")
    assert rows["auto"]["stats"]["settled"] and 1 <= groups <= 10, rows["auto"]["stats"]  # of LeNet-5's 10 tensors
    (summary,) = doc["configs"]
    best = summary["best_fixed"]
    assert best in bench.fixed_pool(list(rows), "any") and best != "auto"
    # torch's allreduce_hook on DDP is measured beside auto as an anchor (any Python hook's cost), never a fixed choice
    assert ANCHOR not in bench.fixed_pool(list(rows), "any")
    anchor = rows[ANCHOR]["samples_s"]
    assert summary["auto_vs_anchor"] == bench.compare(rows["auto"]["samples_s"], anchor)
    assert summary["anchor_vs_ddp"] == bench.compare(anchor, rows["ddp"]["samples_s"])
    assert rows[best]["median_s"] == min(rows[m]["median_s"] for m in rows if m not in ("auto", ANCHOR))
    # the ratios are recomputed here from the raw paired samples: best[i] / auto[i], DDP's likewise
    for key, other in (("auto_vs_best", best), ("auto_vs_ddp", "ddp"), ("auto_vs_none", "none")):
        ratios = [o / a for o, a in zip(rows[other]["samples_s"], rows["auto"]["samples_s"])]
        got = summary[key]
        assert got["median"] == pytest.approx(statistics.median(ratios)) and got["pairs"] == len(ratios), key
        assert got["ratio_of_medians"] == pytest.approx(rows[other]["median_s"] / rows["auto"]["median_s"]), key
        assert min(ratios) <= got["ci95"][0] <= got["median"] <= got["ci95"][1] <= max(ratios), key
    out = capsys.readouterr().out
    assert "[1/1] lenet5/optimizer on loopback: step 5/8" in out and "cell 1/1 done" in out  # progress lines
    assert "auto/best fixed" in out and "goals met:" in out


def test_each_gradsync_method_runs_on_a_runtime_of_its_own_with_inits_tuning_and_nothing_explored_since():
    """A size class one method's calls settled (here: a 32 MB class picked after init) is not the others': each
    gradsync method starts from what the job had at init (the tuned small classes, the cost model, exploring), on a
    transport of its own (the sweep's made a rank read another runtime's decision: a collective mismatch)."""
    from benchmarks.compression_sweep_worker import own_runtimes, tuned_at_init
    from gradsync.comm.local import LocalFabric
    from gradsync.comm.runtime import Runtime
    from gradsync.comm.tuning import TUNED_TYPE

    rt = Runtime(LocalFabric(1).transport(0))
    own: dict = {}
    try:
        assert tuned_at_init(rt) is None
        rt.tuning.use_tuned({"type": TUNED_TYPE, "classes": {"4096": {"choice": ["tree", 1], "measured_s": {}}}})
        rt.explore = True
        start = tuned_at_init(rt)
        assert start == {"type": TUNED_TYPE, "classes": {"4096": {"choice": ["tree", 1], "measured_s": {}}}}
        rt.plans.choose(1 << 25, ("ring", 2))  # settled by some method's calls after init
        own = own_runtimes(rt, start, ["ddp", "none", "fp16", "auto"], lambda: LocalFabric(1).transport(0))
        assert sorted(own) == ["auto", "fp16", "none"] and len({id(r) for r in own.values()}) == 3
        assert len({id(r.transport) for r in [rt, *own.values()]}) == 4  # a decision is keyed by its transport's group
        for runtime in own.values():
            assert runtime is not rt and runtime.cost_model is rt.cost_model
            assert runtime.plans.chosen() == {4096: ("tree", 1)} and runtime.explore
        assert rt.plans.chosen()[1 << 25] == ("ring", 2)
    finally:
        for runtime in own.values():
            runtime.shutdown()
        rt.shutdown()


def test_a_runtime_that_cannot_start_ends_the_ones_started_before_it():
    from benchmarks.compression_sweep_worker import own_runtimes
    from gradsync.comm.local import LocalFabric
    from gradsync.comm.runtime import Runtime
    from tests.threads import comm_threads

    made: list = []

    def transport():
        if made:
            raise GradsyncError("no second group")
        made.append(LocalFabric(1).transport(0))
        return made[-1]

    rt = Runtime(LocalFabric(1).transport(0))
    try:
        before = len(comm_threads())
        with pytest.raises(GradsyncError, match="no second group"):
            own_runtimes(rt, None, ["none", "auto"], transport)
        assert len(made) == 1 and len(comm_threads()) == before  # the first one's thread ended
    finally:
        rt.shutdown()


def test_a_configuration_is_judged_against_the_fastest_fixed_method_the_policy_allows():
    """By hand: auto 0.4/0.45/0.8 s (median 0.45). With allow="any" the best fixed is topk-1% (median 0.6):
    ratios 0.6/0.4, 0.9/0.45, 0.4/0.8 = 1.5, 2.0, 0.5 -> median 1.5; ratio of medians 0.6/0.45 = 1.333.
    With allow="cast" top-k is out and fp16 (median 1.1) is best: 1.2/0.4, 1.0/0.45, 1.1/0.8 = 3, 2.222, 1.375 ->
    2.222. DDP: 2/0.4, 2/0.45, 2/0.8 -> 4.444; its 2 s >= 2 x 0.45: wire-bound. Accuracy 95.5 % vs 96 %: -0.5
    points. Choosing: auto's first steps 2.65 s, 0.45 s beyond 4 x its mean pace 0.55 (not its median: 0.85 s);
    DDP's 0.3 s beyond 4 x 2.0 are a job's own start-up: (0.45 - 0.3) / 2.65. Without DDP's first steps, none's
    (0.5 s beyond 4 x 1.5) stand in: (0.45 - 0.5) / 2.65. Against the quickest fixed gradsync codec with first steps
    (top-k's: 3.8 s, 3.8 - 4 x 0.6333 = 1.2667 s beyond its pace; fp16 has none recorded) instead of DDP:
    (0.45 - 1.2667) / 2.65."""
    config = _config(ddp=_method([2.0, 2.0, 2.0], 0.96, first=[2.3, 2.0, 2.0, 2.0]),
                     none=_method([1.5, 1.5, 1.5], first=[2.0, 1.5, 1.5, 1.5]),
                     fp16=_method([1.2, 1.0, 1.1]), **{"topk-1%": _method([0.6, 0.9, 0.4], first=[1.9, 0.6, 0.9, 0.4])},
                     auto=_method([0.4, 0.45, 0.8], 0.955, first=[1.0, 0.4, 0.45, 0.8]))
    got = bench.summarize_config(config, "any")
    assert got["best_fixed"] == "topk-1%"
    assert got["auto_vs_best"]["median"] == pytest.approx(1.5)
    assert got["auto_vs_best"]["ratio_of_medians"] == pytest.approx(0.6 / 0.45)
    assert 0.5 <= got["auto_vs_best"]["ci95"][0] <= 1.5 <= got["auto_vs_best"]["ci95"][1] <= 2.0
    assert got["auto_vs_ddp"]["median"] == pytest.approx(2.0 / 0.45) and got["wire_bound"]
    assert got["auto_vs_none"]["median"] == pytest.approx(1.5 / 0.45)
    assert got["accuracy_points_vs_ddp"] == pytest.approx(-0.5)
    assert got["choose_share"] == pytest.approx((0.45 - 0.3) / 2.65) and got["choose_reference"] == "ddp"
    assert got["choose_share_vs_fixed"] == pytest.approx((0.45 - (3.8 - 4 * 1.9 / 3)) / 2.65)
    assert got["choose_fixed_reference"] == "topk-1%"
    config["methods"]["ddp"]["first_steps_s"] = []
    alone = bench.summarize_config(config, "any")
    assert alone["choose_share"] == pytest.approx((0.45 - 0.5) / 2.65) and alone["choose_reference"] == "none"
    cast = bench.summarize_config(config, "cast")
    assert cast["best_fixed"] == "fp16" and cast["auto_vs_best"]["median"] == pytest.approx(1.0 / 0.45)
    assert cast["choose_fixed_reference"] == "none"  # top-k is out, fp16 recorded no first steps
    assert cast["choose_share_vs_fixed"] == pytest.approx((0.45 - 0.5) / 2.65)
    assert bench.fixed_pool(list(config["methods"]), "cast") == ["ddp", "none", "fp16"]
    assert bench.fixed_pool(list(config["methods"]), "lossless") == ["ddp", "none"]


def test_a_budget_adds_the_steps_that_fit_at_the_pace_and_no_more_than_the_limit():
    assert extra_steps(elapsed_s=10.0, pace_s=0.5, budget_s=45.0, steps=30, max_steps=300) == 70  # (45 - 10) / 0.5
    assert extra_steps(elapsed_s=10.0, pace_s=0.3, budget_s=45.0, steps=30, max_steps=0) == 116  # whole steps only
    assert extra_steps(elapsed_s=10.0, pace_s=0.01, budget_s=45.0, steps=30, max_steps=300) == 270  # the limit
    assert extra_steps(elapsed_s=50.0, pace_s=0.5, budget_s=45.0, steps=30, max_steps=300) == 0  # over already
    assert extra_steps(elapsed_s=10.0, pace_s=0.5, budget_s=0.0, steps=30, max_steps=300) == 0  # no budget


def test_equal_paired_ratios_give_an_interval_of_that_one_value():
    got = bench.compare([0.2, 0.4, 0.8, 1.0], [0.3, 0.6, 1.2, 1.5])
    assert got["median"] == pytest.approx(1.5) and got["ci95"] == pytest.approx([1.5, 1.5]) and got["pairs"] == 4


def test_goals_say_which_configuration_lost_and_where_the_wire_was_the_bottleneck():
    """Config a: auto ties 'none' (lower bound 1.0) and DDP is not wire-bound. Config b: auto is 10 % slower than
    topk every step (lower bound 0.909 < 0.97: auto lost), and DDP (3 s vs 1.1 s) is wire-bound with auto only
    2.73x faster: that goal holds. With allow='cast' the -2 points of b would miss the accuracy goal."""
    a = _config(ddp=_method([1.0] * 3), none=_method([1.0] * 3), auto=_method([1.0] * 3, first=[1.0] * 3))
    b = _config(ddp=_method([3.0] * 3, 0.96), none=_method([2.0] * 3), **{"topk-1%": _method([1.0] * 3)},
                auto=_method([1.1] * 3, 0.94))
    rows = [{"where": "x", **bench.summarize_config(c, "any")} for c in (a, b)]
    g = bench.goals(rows, "any")
    assert g["never_loses"]["worst_ci_low"] == pytest.approx(1 / 1.1) and not g["never_loses"]["met"]
    assert g["wire_bound_vs_ddp"]["configs"] == 1 and g["wire_bound_vs_ddp"]["met"]
    assert g["accuracy_points_vs_ddp"]["met"] and not g["accuracy_points_vs_ddp"]["applies"]
    assert g["choose_share"]["worst"] == pytest.approx(0.0) and not g["met"]
    cast = bench.goals([{"where": "x", **bench.summarize_config(c, "cast")} for c in (a, b)], "cast")
    assert cast["accuracy_points_vs_ddp"]["worst"] == pytest.approx(-2.0) and not cast["accuracy_points_vs_ddp"]["met"]
    lines = bench.summary_lines(rows, g, "any")
    assert "auto/best fixed (topk-1%) x0.909" in lines[1] and "(wire-bound)" in lines[1]
    assert "auto never loses (worst lower bound 0.909, goal >= 0.97): NOT met" in lines


def test_bad_arguments_are_refused_before_anything_runs():
    for argv in (["--models", "vgg"], ["--paths", "ps"], ["--fabrics", "ring:4"], ["--methods", "ddp,zstd"],
                 ["--quick", "--steps", "4", "--warmup", "4"], ["--quick", "--procs", "1"], ["--allow", "lossy"],
                 ["--quick", "--budget-s", "-1"], ["--quick", "--max-steps", "5"]):  # fewer than --steps (8)
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2, argv


def _fake_testbed(monkeypatch, calls: list, fail_at: int | None = None) -> None:
    """The testbed's root-only steps replaced by recorders; each run writes one config of fake samples."""

    def run(cmd, env=None, timeout=None):
        calls.append(("run", list(cmd), dict(env or {})))
        if fail_at is not None and sum(c[0] == "run" for c in calls) == fail_at:
            return 3
        methods = {m: _method([0.5 if m == "auto" else 1.0] * 4) for m in ("ddp", "none", "auto")}
        config = {**_config(**methods), "model": "lenet5", "path": "optimizer"}
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"world_size": 4, "configs": [config]}))
        return 0

    fake_testbed(monkeypatch, calls, run)


def test_every_fabric_and_rate_is_a_cell_of_its_own_testbed_with_the_probed_model(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    calls: list = []
    _fake_testbed(monkeypatch, calls)
    code = bench.main(["--rates", "100mbit,1gbit", "--models", "lenet5", "--paths", "optimizer", "--out", str(tmp_path)])
    ups = [c[1:] for c in calls if c[0] == "up"]
    assert ups == [(bench.FABRICS[f], r) for r in ("100mbit", "1gbit") for f in bench.FABRICS]
    assert [c[0] for c in calls] == ["up", "probe", "run", "down"] * 4
    cmd, env = calls[2][1], calls[2][2]
    assert cmd[cmd.index("--topology") + 1] == "switch:4" and "--calibrate" in cmd
    assert cmd[cmd.index("--configs") + 1] == "lenet5/optimizer" and cmd[cmd.index("--total") + 1] == "4"
    assert Path(env["GRADSYNC_COST_MODEL"]).name == "cost_model.json"
    doc = json.loads((tmp_path / "compression_sweep.json").read_text())
    assert doc["complete"] and len(doc["configs"]) == 4 and (tmp_path / "compression_sweep.png").stat().st_size > 0
    assert [c["where"] for c in doc["configs"]] == ["switch:4 at 100mbit", "two-tier-4to1 at 100mbit",
                                                     "switch:4 at 1gbit", "two-tier-4to1 at 1gbit"]
    assert all(c["auto_vs_best"]["median"] == pytest.approx(2.0) for c in doc["configs"])
    assert code == 0 and doc["goals"]["met"]  # auto twice as fast as DDP everywhere, DDP wire-bound


def test_a_failed_cell_takes_its_testbed_down_and_keeps_the_cells_before_it(monkeypatch, tmp_path):
    calls: list = []
    _fake_testbed(monkeypatch, calls, fail_at=2)
    with pytest.raises(GradsyncError, match=r"two-tier-4to1 at 100mbit: workers failed \(exit 3\)"):
        bench.main(["--rates", "100mbit", "--models", "lenet5", "--paths", "hook", "--out", str(tmp_path)])
    assert calls[-1] == ("down",)
    doc = json.loads((tmp_path / "compression_sweep.json").read_text())
    assert not doc["complete"] and [c["where"] for c in doc["configs"]] == ["switch:4 at 100mbit"]


def test_without_the_testbed_the_error_names_the_quick_mode(monkeypatch):
    import gradsync.testbed as tb

    monkeypatch.setattr(tb, "available", lambda: "needs root")
    with pytest.raises(GradsyncError, match=r"cannot run here: needs root \(--quick or --loopback"):
        bench.main([])
