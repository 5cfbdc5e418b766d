"""``gradsync bench adapt-testbed`` without root: the phases' medians and goals, the rate-change handshake."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from benchmarks import adapt_testbed as at


def _report(static: float, adaptive: float, gloo: float) -> dict:
    """10 rounds: 1 s everywhere, degraded rounds 4..7 (first one settling) at the given seconds."""
    cfg = {"degrade_at": 4, "restore_at": 8, "settle": 1, "rounds": 10}
    series = {m: [1.0] * 10 for m in at.METHODS}
    for i in range(4, 8):
        series["static"][i], series["adaptive"][i], series["gloo"][i] = static, adaptive, gloo
    series["adaptive"][4] = 99.0  # the round it switched in: left out (settle)
    return {"config": cfg, "samples_s": series, "exact": {m: True for m in at.METHODS}}


def test_summary_takes_each_phases_median_and_the_goals_ratios() -> None:
    s = at.summarize(_report(static=4.0, adaptive=2.0, gloo=3.0))
    assert s["medians_s"]["adaptive"] == {"before": 1.0, "degraded": 2.0, "after": 1.0}
    assert s["ratios"] == {"degraded_vs_static": 2.0, "degraded_vs_gloo": 1.5, "recovered": 1.0}
    assert all(s["met"].values()) and s["all_exact"]
    worse = at.summarize(_report(static=2.2, adaptive=2.0, gloo=2.0))
    assert worse["met"] == {"degraded_vs_static": False, "degraded_vs_gloo": False, "recovered": True}


def test_the_late_scenario_has_its_own_goals_and_puts_the_prediction_beside_the_steady_state() -> None:
    """Scenario b's goals (1.15x static, 1.2x gloo) are not a; measured / predicted of adaptive while late."""
    report = _report(static=1.2, adaptive=1.0, gloo=1.25)
    assert not any(at.summarize(report)["met"][k] for k in ("degraded_vs_static", "degraded_vs_gloo"))
    report["config"]["scenario"] = "late"
    report["predicted_degraded_s"] = {"adaptive_plan": "straggler/4", "adaptive": 0.8}
    s = at.summarize(report)
    assert all(s["met"].values()) and s["goals"] == at.GOALS["late"]
    assert s["adaptive_degraded_over_predicted"] == pytest.approx(1.25)


def _degrade_and_restore(control: Path, args: dict) -> list:
    """Rank 0's two asks (degrade at round 20, restore at 40) against a driver thread; the driver's log."""
    stop = threading.Event()
    log: list = []
    driver = threading.Thread(target=lambda: log.extend(at._drive(control, type("A", (), args)(), stop)))
    driver.start()
    try:
        at._ask(control, "degrade", 20)
        at._ask(control, "restore", 40)
    finally:
        stop.set()
        driver.join(timeout=5)
    return log


def test_rank0_asks_and_the_driver_changes_the_rate_once_per_ask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, str | None]] = []
    monkeypatch.setattr("gradsync.testbed.control.set_server_rate",
                        lambda rank, rate, **kw: calls.append((rank, rate)) or 25.0)
    log = _degrade_and_restore(tmp_path, {"rate": "100mbit", "factor": 4.0, "slow_rank": 2, "scenario": "nic"})
    assert calls == [(2, "25.0mbit"), (2, None)] and [e["ask"] for e in log] == ["degrade 20", "restore 40"]


def test_the_dead_link_scenario_cuts_and_mends_the_link_and_judges_the_reroutes_prediction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario c: the driver cuts the link at the first ask and mends it at the second; the goal is the time after
    the reroute against the model's price of the surviving graph's plan, and one reroute line in the log."""
    calls: list[tuple[int, str, bool]] = []
    monkeypatch.setattr("gradsync.testbed.control.set_link",
                        lambda rank, peer, up, **kw: calls.append((rank, peer, up)) or type("P", (), {"cut": ()})())
    _degrade_and_restore(tmp_path, {"rate": "100mbit", "factor": 4.0, "slow_rank": 0, "scenario": "dead",
                                    "peer": "L0.sw0"})
    assert calls == [(0, "L0.sw0", False), (0, "L0.sw0", True)]
    report = _report(static=1.5, adaptive=1.1, gloo=2.0)
    report["config"]["scenario"] = "dead"
    report["predicted_degraded_s"] = {"adaptive": 1.1, "at_reroute": 1.0, "reroute_plan": "lp/8"}
    report["switches"] = [{"message": "gradsync: link s00-L0.sw0 is down (no carrier) in 'bcube:3,2': ..."},
                          {"message": "gradsync: link s00-L0.sw0 is back in 'bcube:3,2': ..."}]
    s = at.summarize(report)
    assert s["adaptive_degraded_over_predicted_at_reroute"] == pytest.approx(1.1) and all(s["met"].values())
    report["predicted_degraded_s"]["at_reroute"] = 0.9  # 1.22x the prediction: beyond 15%
    assert at.summarize(report)["met"] == {"predicted": False, "logged": True}


def test_bad_rounds_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        at.main(["--degrade-at", "30", "--restore-at", "20"])
    assert "--degrade-at" in capsys.readouterr().err
