"""The priorities API (gradsync.order.priorities): a rank per parameter name for every ordering."""

from __future__ import annotations

from gradsync.order import (
    priorities,
)


# ---- priorities API, JSON, errors ------------------------------------------------------------------------
def test_priorities_api_returns_a_rank_per_parameter_name() -> None:
    from gradsync.models import create

    names = [n for n, _ in create("lenet5").named_parameters()]
    for method in ("tac", "tic", "fifo", "random"):
        prio = priorities("lenet5", method=method, runs=1)
        assert set(prio) == set(names) and all(isinstance(v, int) and v >= 0 for v in prio.values())
    assert priorities("lenet5", method="fifo") == {n: i for i, n in enumerate(names)}
