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
