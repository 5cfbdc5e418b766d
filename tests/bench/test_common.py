"""``benchmarks.common.run_loopback_workers``: every worker it starts is ended, on time or not."""

from __future__ import annotations

import sys
import time

from benchmarks.common import run_loopback_workers


def test_workers_get_torchrun_ranks_and_their_exit_codes_come_back(tmp_path) -> None:
    script = "import os, sys; open(sys.argv[1] + os.environ['RANK'], 'w').write(os.environ['WORLD_SIZE']); sys.exit(int(os.environ['RANK']))"
    codes = run_loopback_workers([sys.executable, "-c", script, str(tmp_path / "r")], 3, timeout_s=60, what="test")
    assert codes == [0, 1, 2]
    assert [(tmp_path / f"r{r}").read_text() for r in range(3)] == ["3", "3", "3"]


def test_a_worker_past_the_timeout_is_killed_with_the_others_and_said_so(tmp_path, capsys) -> None:
    script = "import os, sys, time; open(sys.argv[1] + os.environ['RANK'], 'w').write(str(os.getpid())); time.sleep(60)"
    t0 = time.monotonic()
    codes = run_loopback_workers([sys.executable, "-c", script, str(tmp_path / "pid")], 2, timeout_s=3, what="bench x")
    assert codes is None and time.monotonic() - t0 < 30
    assert "bench x: a worker ran past 3 s; killed" in capsys.readouterr().err
    for r in range(2):
        written = tmp_path / f"pid{r}"
        if not written.is_file() or not written.read_text():
            continue  # killed before it got that far: nothing left to look for
        pid = int(written.read_text())
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split()[2] == "Z", f"worker {pid} still runs"  # reaped, or at most a zombie
        except FileNotFoundError:
            pass  # gone


def test_the_code_revision_is_dirty_for_uncommitted_code_only(tmp_path, monkeypatch) -> None:
    """A result's ``code`` says ``+dirty`` where the code it ran differs from the commit, not where a doc, a test or
    an earlier run's result does."""
    import subprocess

    import benchmarks.common as common

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    files = ["gradsync/a.py", "benchmarks/b.py", "benchmarks/results/r.json", "docs/d.md", "tests/t.py",
             "pyproject.toml"]
    git("init", "-q")
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "0")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    clean = common.code_revision()
    assert len(clean) == 12 and not clean.endswith("+dirty"), clean
    for name in files:
        (tmp_path / name).write_text("1\n")
        assert common.code_revision() == clean + ("+dirty" if name.split("/")[0] in ("gradsync", "pyproject.toml")
                                                  or name == "benchmarks/b.py" else ""), name
        git("checkout", "--", name)
