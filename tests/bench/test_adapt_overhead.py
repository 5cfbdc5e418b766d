"""``gradsync bench adapt`` end to end at a toy size: every runtime sums exactly, the default watch watches one
collective in ``every``, and a wire that does not change makes no switch (the benchmark's own figure is its JSON,
not this)."""

from __future__ import annotations

import json

import pytest

import benchmarks.adapt_overhead as bench


def test_a_short_run_writes_its_report_and_the_watch_watched_one_collective_in_every(tmp_path) -> None:
    code = bench.main(["--procs", "2", "--rounds", "4", "--warmup", "6", "--size", str(1 << 20), "--out", str(tmp_path)])
    assert code == 0
    out = json.loads((tmp_path / "adapt.json").read_text())
    assert out["type"] == bench.RESULT_TYPE
    assert all(row["exact"] and len(row["samples_s"]) == 4 for row in out["methods"].values())
    # one allreduce in AdaptOptions.every is watched, warm-up rounds included (the watch learns from them)
    assert out["every"] == 16 and out["watched"] == 1  # rounds 0 of 10: the first qualifying one
    assert out["every1_paired_ratio_median"] > 0
    assert out["switches"] == []
    assert (tmp_path / "adapt.png").stat().st_size > 0


@pytest.mark.parametrize("argv", [["--algorithm", "auto"], ["--size", "6"], ["--procs", "1"]])
def test_bad_options_exit_with_a_usage_error(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
