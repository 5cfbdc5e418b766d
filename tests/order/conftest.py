"""Shared helpers for the TicTac tests: the seed's Fig. 1 DAG."""

from __future__ import annotations

from gradsync.order import Dag, Op, Param


def fig1(t1: int = 2, t2: int = 3, op1: float = 4.0, op2: float = 1.0) -> Dag:
    """Seed Fig. 1(a): recv1 -> op1; op1 + recv2 -> op2."""
    return Dag("fig1", (Param("recv1", t1), Param("recv2", t2)),
               (Op("op1", time_s=op1, reads=("recv1",)), Op("op2", time_s=op2, inputs=("op1",), reads=("recv2",))))
