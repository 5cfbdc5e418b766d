"""``benchmarks/ps_loopback.py``'s goal check (the benchmark itself runs processes: not a unit test)."""

from __future__ import annotations

import benchmarks.ps_loopback as bench


def test_goals_take_the_worst_ratio_of_the_sizes_each_covers() -> None:
    rows = [{"bytes": 4096, "ps_over_gloo": 2.9}, {"bytes": 65536, "ps_over_gloo": 9.0},
            {"bytes": 1 << 20, "ps_over_gloo": 1.4}, {"bytes": 4 << 20, "ps_over_gloo": 1.6}]
    got = bench.goals(rows, "ps")
    assert got == {"4 KB": {"worst": 2.9, "goal": 3.0, "met": True},  # 64 KB has no goal
                   ">= 1 MB": {"worst": 1.6, "goal": 1.5, "met": False}}
    assert bench.goals(rows[:2], "ps") == {"4 KB": {"worst": 2.9, "goal": 3.0, "met": True}}  # --quick-like
