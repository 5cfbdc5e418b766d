"""The side-by-side helpers every comparison benchmark uses (``gradsync.sim.bench``): the order methods run in,
and the paired ratio with its interval, checked against brute-force counts and closed forms."""

from __future__ import annotations

import collections
import itertools
import statistics

import pytest

from gradsync.errors import GradsyncError
from gradsync.sim.bench import balanced_orders, bootstrap_median_ci, paired_ratios


def _transitions(orders):
    flat = [m for order in orders for m in order]
    return collections.Counter(zip(flat[-1:] + flat[:-1], flat))  # cycling: the last round runs before the first


def test_three_methods_take_every_position_and_every_predecessor_equally_often():
    methods = ("ddp", "torch_fp16", "gradsync_fp16")
    orders = balanced_orders(methods)
    assert sorted(orders) == sorted(itertools.permutations(methods))  # each order once
    for pos in range(3):
        assert collections.Counter(order[pos] for order in orders) == dict.fromkeys(methods, 2)
    counts = _transitions(orders)
    assert counts == {(a, b): 3 for a in methods for b in methods if a != b}  # never after itself


def test_two_methods_alternate_abba_and_bad_lists_are_named():
    assert balanced_orders(["a", "b"]) == [("a", "b"), ("b", "a")]
    for bad in (["a"], ["a", "a"], ["a", "b", "c", "d"]):
        with pytest.raises(GradsyncError, match="2 or 3 distinct methods"):
            balanced_orders(bad)


def test_paired_ratios_and_the_bootstrap_interval():
    a, b = [2.0, 3.0, 9.0], [1.0, 2.0, 3.0]
    assert paired_ratios(a, b) == [2.0, 1.5, 3.0]
    with pytest.raises(GradsyncError, match="equal, non-zero lengths"):
        paired_ratios([1.0], [])
    values = [1.0 + 0.01 * ((i * 37) % 101) for i in range(301)]  # 1.00 .. 2.00, median 1.5
    low, high = bootstrap_median_ci(values)
    assert low <= statistics.median(values) <= high and high - low < 0.2
    assert bootstrap_median_ci(values) == (low, high)  # seeded: the same samples, the same interval
    assert bootstrap_median_ci([1.5] * 10) == (1.5, 1.5)  # no spread, no width
    wide = bootstrap_median_ci(values[:9])
    assert wide[1] - wide[0] > high - low  # fewer samples, a wider interval
    with pytest.raises(GradsyncError, match="0 < level < 1"):
        bootstrap_median_ci(values, level=1.0)
