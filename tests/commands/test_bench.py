"""gradsync bench (gradsync.commands.bench) end to end: it lists the registry and runs sim-scaling."""

from __future__ import annotations

import json

import pytest

from tests.commands.conftest import run


def test_cli_bench_lists_and_runs(tmp_path):
    p = run("bench")
    assert p.returncode == 0 and "sim-scaling" in p.stdout
    p = run("bench", "sim-scaling", "--cases", "ps-switch16", "--modes", "store-and-forward", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "sim_scaling.json").read_text())
    assert doc["type"] == "gradsync.bench.sim_scaling" and len(doc["runs"]) == 2
    assert all(r["gst_over_tf"] == pytest.approx(2 * 15 / 16) for r in doc["runs"] if r["latency_s"] == 0)
    assert (tmp_path / "sim_scaling.png").exists()
