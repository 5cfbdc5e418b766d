"""``gradsync bench price-ahead`` in miniature: every way chooses the same, and the report holds what the doc says."""

from __future__ import annotations

import json

import benchmarks.price_ahead as bench


def test_price_ahead_reports_every_way_with_the_same_choices(tmp_path):
    assert bench.main(["--topology", "racks:2,3,4", "--sizes", str(1 << 20), "--leads", "0.5", "--rounds", "2", "--gap-s", "0.05",
                       "--started-s", "0.2", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "price_ahead.json").read_text())
    row = out["leads"]["0.5"]
    assert out["type"] == bench.RESULT_TYPE and row["same_choices"] is True and row["same_orders"] is True
    assert all(len(row["neighbours_samples_s"][m]) == 2 for m in bench.METHODS)
    assert all(len(row["samples_s"][m]) == 2 and min(row["samples_s"][m]) > 0 for m in bench.METHODS)
    assert set(bench.METHODS) == {"inline", *bench.CHILD} and out["config"]["started_s"] == 0.2
    for prefix in bench.CHILD.values():  # each way with a child against inline, first calls and neighbours
        for what in ("", "neighbours_"):
            lo, hi = row[f"{prefix}{what}ratio_ci95"]
            assert lo <= row[f"{prefix}{what}ratio_median"] <= hi
    assert (tmp_path / "price_ahead.png").stat().st_size > 0
