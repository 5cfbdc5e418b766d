"""``gradsync bench price-ahead`` in miniature: both ways choose the same, and the report holds what the doc says."""

from __future__ import annotations

import json

import benchmarks.price_ahead as bench


def test_price_ahead_reports_both_ways_with_the_same_choices(tmp_path):
    assert bench.main(["--topology", "racks:2,3,4", "--sizes", str(1 << 20), "--leads", "0.5", "--rounds", "2", "--gap-s", "0.05",
                       "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "price_ahead.json").read_text())
    row = out["leads"]["0.5"]
    assert out["type"] == bench.RESULT_TYPE and row["same_choices"] is True and row["same_orders"] is True
    assert all(len(row["neighbours_samples_s"][m]) == 2 for m in bench.METHODS)
    assert all(len(row["samples_s"][m]) == 2 and min(row["samples_s"][m]) > 0 for m in bench.METHODS)
    assert row["ratio_ci95"][0] <= row["ratio_median"] <= row["ratio_ci95"][1]
    assert (tmp_path / "price_ahead.png").stat().st_size > 0
