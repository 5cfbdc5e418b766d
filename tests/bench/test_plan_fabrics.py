"""bench plan-fabrics (issue 18 part 5) on two small cases: the JSON it writes, the goal lines, bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_small_cases_write_json_with_costs_bounds_and_goal_lines(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.plan_scaling", "--fabrics", "--cases",
                          "fattree:4/lp,switch:4/ring,a100x2/lp", "--repeats", "1", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads((tmp_path / "plan_fabrics.json").read_text())
    assert doc["type"] == "gradsync.bench.plan_fabrics" and (tmp_path / "plan_fabrics.png").stat().st_size > 0
    rows = {(r["spec"], r["algorithm"]): r for r in doc["cases"]}
    ft = rows[("fattree:4", "lp")]
    assert ft["ranks"] == 16 and ft["cost"] == ft["lower_bound"] == 2 * 15 / 16 and ft["gap"] == 0  # closed form
    ring = rows[("switch:4", "ring")]
    assert ring["cost"] == 2 * 3 / 4 and ring["transfers"] == 2 * 2 * 3 * 4  # two directed rings, 2(N-1)N each
    assert rows[("a100x2", "lp")]["ranks"] == 16  # read from benchmarks/topologies/a100x2.yaml
    # the four goals are always stated; cases not planned are "NOT met (not planned)", never silently met
    assert len(doc["summary"]) == 4 and all("NOT met" in line and "not planned" in line for line in doc["summary"])
    assert "SUMMARY: fattree:16 lp <= 30 s" in out.stdout


def test_bad_case_syntax_is_named() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.plan_fabrics", "--cases", "fattree:4"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "must be SPEC/ALG, e.g. fattree:16/lp" in out.stderr
    assert "Traceback" not in out.stderr
