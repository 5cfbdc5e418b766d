"""The up-front planning estimate (issue 42)."""

from __future__ import annotations

import pytest

from gradsync.plan import PlanOptions
from gradsync.plan.estimate import TIME_MODELS, TimeModel, estimate_plan
from gradsync.plan.synthesizers import TRANSFER_BYTES
from gradsync.topology import get_topology


def test_time_model_is_the_power_law():
    m = TimeModel(10.0, 100, 2.0)
    assert m.seconds(100) == pytest.approx(10.0)
    assert m.seconds(300) == pytest.approx(90.0)


def test_lp_estimate_reproduces_its_measurements_and_grows_superlinearly():
    small = estimate_plan("lp", get_topology("ring:500"))
    big = estimate_plan("lp", get_topology("ring:1000"))
    assert small.time_s == pytest.approx(24.0)
    assert 200 < big.time_s < 300  # measured 247 s
    assert big.ranks == 1000 and big.algorithm == "lp"


def test_ps_memory_is_the_transfer_floor():
    n = 40
    est = estimate_plan("ps", get_topology(f"ring:{n}"), PlanOptions())
    assert est.memory_bytes == pytest.approx(2 * (n - 1) * n * TRANSFER_BYTES)
    assert est.time_s == pytest.approx(TIME_MODELS["ps"].seconds_at * (n / 500) ** 2)


def test_pipeline_scales_transfer_planners_and_unknown_names_are_not_estimated():
    topo = get_topology("ring:100")
    one = estimate_plan("ring", topo, PlanOptions(pipeline=1)).time_s
    four = estimate_plan("ring", topo, PlanOptions(pipeline=4)).time_s
    assert four == pytest.approx(4 * one)
    auto = estimate_plan("auto", topo)
    assert auto.time_s == 0.0 and auto.memory_bytes == 0.0
    assert estimate_plan("lp", get_topology("ring:2")).time_s > 0


def test_symmetric_lp_is_not_priced_as_column_generation():
    est = estimate_plan("lp", get_topology("fattree:24"))  # 3456 ranks, planned by the symmetric packing
    assert est.ranks == 3456 and est.time_s == 0.0
    assert estimate_plan("ring", get_topology("fattree:24")).time_s > 0
