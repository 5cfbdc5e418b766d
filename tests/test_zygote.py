"""The tests' launcher forks worker ranks from preloaded zygotes (tests/zygote.py): a forked rank must look like the
fresh interpreter it stands for, and the launch must see its exit the way it sees a process's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import zygote
from tests.dist_launch import launch

#: A rank that reports what it sees before it imports anything, then ends as its first argument says.
WORKER = r'''
import sys
preloaded = "torch" in sys.modules
import json, os, signal
import torch
out, ending = sys.argv[1], sys.argv[2]
report = {"rank": os.environ["RANK"], "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
          "hash": hash("gradsync"), "preloaded": preloaded, "name": __name__, "pid": os.getpid(),
          "ppid": os.getppid(), "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
          "draws": [torch.rand(1).item(), float(__import__("numpy").random.rand())]}
with open(os.path.join(out, "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(report, f)
print("printed by rank", os.environ["RANK"])
print("to stderr", file=sys.stderr)
if ending == "exit3" and os.environ["RANK"] == "1":
    sys.exit(3)
if ending == "raise" and os.environ["RANK"] == "1":
    raise RuntimeError("the worker's own error")
if ending == "killed" and os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
if ending == "sleep":
    __import__("time").sleep(120)
'''


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    script = tmp_path / "zygote_worker.py"
    script.write_text(WORKER)
    return script


@pytest.mark.skipif(not zygote.enabled(), reason="GRADSYNC_TEST_ZYGOTE=0: ranks start fresh interpreters")
def test_a_forked_rank_sees_its_own_rank_argv_and_paths_and_hashes_strings_as_a_fresh_process_would(worker, tmp_path):
    reports = launch(str(worker), [str(tmp_path), "ok"], 2, tmp_path)
    for r, rep in enumerate(reports):
        assert rep["preloaded"], rep  # forked: torch was there before the script ran
        assert rep["ppid"] != os.getpid(), rep  # a zygote's child, not this process's
        assert rep["rank"] == str(r) and rep["argv"] == [str(tmp_path), "ok"] and rep["name"] == "__main__", rep
        assert rep["cwd"] == str(zygote.ROOT) and rep["path0"] == str(worker.parent), rep
        # torch's intra-op threads as OMP_NUM_THREADS says (the launch sets 1), read where OpenMP loaded
        assert rep["omp"] is not None and rep["threads"] == int(rep["omp"]), rep
        log = (tmp_path / f"rank{r}.log").read_text()
        assert f"printed by rank {r}" in log and "to stderr" in log, log
    # each rank index has its own zygote, so its own hash seed, as two fresh interpreters have
    same_seed = "PYTHONHASHSEED" in os.environ
    assert (reports[0]["hash"] == reports[1]["hash"]) == same_seed, reports
    # unseeded draws differ between two launches of the same rank, as between two fresh interpreters
    again = launch(str(worker), [str(tmp_path), "ok"], 2, tmp_path)
    for before, after in zip(reports, again):
        assert before["draws"][0] != after["draws"][0] and before["draws"][1] != after["draws"][1], (before, after)


def test_with_zygotes_off_each_rank_is_a_fresh_interpreter(worker, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSYNC_TEST_ZYGOTE", "0")
    reports = launch(str(worker), [str(tmp_path), "ok"], 2, tmp_path)
    assert [rep["preloaded"] for rep in reports] == [False, False]
    assert all(rep["threads"] == int(rep["omp"]) for rep in reports), reports
    assert {rep["ppid"] for rep in reports} == {os.getpid()}


@pytest.mark.parametrize("ending, code", [("exit3", 3), ("raise", 1), ("killed", -9)])
def test_a_forked_ranks_exit_reaches_the_launch_as_a_processs_would(worker, tmp_path, ending, code):
    with pytest.raises(AssertionError, match=f"rank 1 exited {code}") as failed:
        launch(str(worker), [str(tmp_path), ending], 2, tmp_path)
    if ending == "raise":
        assert "RuntimeError: the worker's own error" in str(failed.value)
    # what a rank printed before it died is in its log: the launch sets PYTHONUNBUFFERED, as torchrun does
    assert "printed by rank 1" in str(failed.value)
    reports = launch(str(worker), [str(tmp_path), ending], 2, tmp_path, allow_exit={1: code})
    assert reports[1]["rank"] == "1"


def test_a_request_under_another_environment_gets_a_zygote_that_imported_under_it(worker, tmp_path, monkeypatch):
    if not zygote.enabled():
        pytest.skip("GRADSYNC_TEST_ZYGOTE=0")
    launch(str(worker), [str(tmp_path), "ok"], 1, tmp_path)
    before = zygote._ZYGOTES[0]
    monkeypatch.setenv("GRADSYNC_SOMETHING_READ_AT_IMPORT", "1")
    launch(str(worker), [str(tmp_path), "ok"], 1, tmp_path)
    after = zygote._ZYGOTES[0]
    assert after is not before and not before.alive()
    assert after.shared["GRADSYNC_SOMETHING_READ_AT_IMPORT"] == "1"
    # the per-rank variables and pytest's name of the running test do not count
    assert "RANK" not in after.shared and "PYTEST_CURRENT_TEST" not in after.shared


def test_a_launch_that_fails_to_start_a_rank_ends_the_ranks_it_started(worker, tmp_path, monkeypatch):
    """A zygote that cannot fork rank 1 (it died, or gave no reply) fails the launch, and rank 0, already running,
    ends with it rather than outliving the test."""
    started = []
    spawn = zygote.spawn

    def failing(rank, *args, **kwargs):
        if rank == 1:
            raise RuntimeError("a test zygote gave no reply")
        proc = spawn(rank, *args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(zygote, "spawn", failing)
    with pytest.raises(RuntimeError, match="gave no reply"):
        launch(str(worker), [str(tmp_path), "sleep"], 2, tmp_path, timeout_s=60)
    assert len(started) == 1
    if started[0] is not None:  # forked (None: zygotes off, and dist_launch started it with Popen itself)
        assert started[0].poll() == -9
