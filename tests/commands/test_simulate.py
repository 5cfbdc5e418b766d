"""gradsync simulate (gradsync.commands.simulate) end to end: its JSON, the store-and-forward timeline, one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.commands.conftest import run


def test_cli_simulate_json():
    p = run("simulate", "--topology", "p3.16xlarge", "--algorithm", "lp", "--size", "1GB", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["type"] == "gradsync.simulation" and out["mode"] == "streaming"
    assert out["gst_over_tf"] == pytest.approx(7 / 24, rel=1e-6)
    assert out["time_s"] == pytest.approx(1e9 / 85.714285714e9, rel=1e-6)
    assert out["planned"]["cost"] == pytest.approx(7 / 24) and out["sim_over_planned"] == pytest.approx(1.0)


def test_cli_simulate_store_and_forward_latency_timeline(tmp_path):
    p = run("simulate", "-t", "switch:4", "-a", "ring", "--size", "100MB,100MB", "--latency", "1e-4",
            "--store-and-forward", "--timeline", "tl.png", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "store-and-forward" in p.stdout and "simulated / planned = 1" in p.stdout
    assert (tmp_path / "tl.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["simulate", "-t", "p3.16xlarge", "--size", "lots"], "cannot read size 'lots'"),
    (["simulate", "-t", "p3.16xlarge", "--size", "1GB,"], "cannot read sizes"),
    (["simulate", "-t", "p3.16xlarge", "--timeline", "x.txt"], "must end in .png"),
    (["bench", "nosuch"], "known: sim-scaling"),
])
def test_cli_errors_are_one_line(args, message, tmp_path):
    p = run(*args, cwd=tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: error:") and message in lines[0]


def test_cli_simulate_trace_writes_chrome_trace_events(tmp_path):
    from tests.trace_events import load_trace, spans

    p = run("simulate", "-t", "switch:3", "-a", "ring", "--size", "1MB", "--trace", "sim.json", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    got = spans(load_trace(tmp_path / "sim.json"))
    assert out["trace"] == "sim.json" and len(got) == out["flows"] > 0
    assert max(e["ts"] + e["dur"] for e in got) == pytest.approx(out["time_s"] * 1e6, rel=1e-9)
    p = run("simulate", "-t", "switch:3", "--trace", "sim.txt", cwd=tmp_path)
    assert p.returncode == 2 and "must end in .json" in p.stderr and len(p.stderr.strip().splitlines()) == 1
