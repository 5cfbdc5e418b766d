"""Smoke test of ``gradsync bench bml-fig5`` (seed 001 Fig. 5) at 16 servers: BCube(4,2) and Fat-Tree(4)."""

import json

import pytest

from gradsync.sim.bench import BENCHMARKS


def test_bml_fig5_16_servers(tmp_path):
    main = BENCHMARKS.get("bml-fig5").load()
    assert main(["--scales", "16", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bml_fig5.json").read_text())
    assert data["type"] == "gradsync.bench.bml_fig5"
    cases = data["cases"]
    assert len(cases) == 4
    assert {(c["topology"], c["algorithm"]) for c in cases} == {
        ("bcube:4,2", "bml"), ("bcube:4,2", "ps"), ("fattree:4", "hierarchical"), ("fattree:4", "ps")}
    want = {"bml": 2 * 15 / (2 * 16), "ps@bcube:4,2": 2 * 3 / 4, "hierarchical": 2 * 15 / 16, "ps@fattree:4": 2 * 15 / 16}
    for c in cases:
        assert c["simulated_gst_over_tf"] == pytest.approx(c["closed_form"], rel=1e-6)
        assert c["planned_gst_over_tf"] == pytest.approx(c["closed_form"], rel=1e-6)
        key = c["algorithm"] if c["algorithm"] != "ps" else f"ps@{c['topology']}"
        assert c["closed_form"] == pytest.approx(want[key], rel=1e-12)
        assert c["servers"] == 16 and c["transfers"] > 0
    assert {c["topology"]: c["switches"] for c in cases} == {"bcube:4,2": 8, "fattree:4": 20}
    assert (tmp_path / "bml_fig5.png").stat().st_size > 0
