"""``gradsync bench gpu`` as a CPU dry run: every part runs and writes one JSON a GPU run would fill the same
way (the GPU's name, torch's and NCCL's versions), and on the CPU every case passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_runs_on_the_cpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run `gradsync bench gpu` itself")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--quick", "--parts", "codecs,engines,staging,hooks",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_check-cpu.json").read_text())
    assert doc["type"] == "gradsync.bench.gpu" and doc["environment"]["cuda_available"] is False
    from gradsync.compress import COMPRESSORS

    names = set(COMPRESSORS.names())
    assert {r["codec"] for r in doc["codecs"]} == names
    assert all(r["ok"] for r in doc["codecs"]), [r for r in doc["codecs"] if not r["ok"]]
    gloo = [r for r in doc["engines"] if r.get("engine") == "gloo/2"]
    cases = {r["case"] for r in gloo}
    assert {f"optimizer/{n}" for n in names} | {f"hook/{n}" for n in names} <= cases
    assert {"allreduce/ring", "allreduce/auto"} <= cases
    assert all(r["ok"] for r in gloo), [r for r in gloo if not r["ok"]]
    assert [r for r in doc["engines"] if r.get("engine") == "nccl/1"] == [{"engine": "nccl/1",
                                                                         "skipped": "no CUDA GPU / NCCL here"}]
    assert doc["hooks"][0]["skipped"] and doc["failed"] == 0
    (staging,) = doc["staging"]  # host tensors only here: each method timed, exact (a wrong sum raises)
    assert staging["bytes"] == 4000 and staging["gradsync_ring/cpu"] > 0 and staging["gloo/cpu"] > 0
