"""Iteration simulator: makespans derived by hand for small DAGs, sharing, partitioning, allreduce, plots."""

from __future__ import annotations

import pytest

from gradsync.errors import SimulationError
from gradsync.order import Dag, Op, Param, training_dag
from gradsync.sim import IterationConfig, plot_iteration, simulate_iteration

# 1 byte per second: parameter sizes read as transfer times.
SLOW = IterationConfig(bandwidth_GBps=1e-9)


def fig1() -> Dag:
    return Dag("fig1", (Param("recv1", 2), Param("recv2", 3)),
               (Op("op1", time_s=4.0, reads=("recv1",)), Op("op2", time_s=1.0, inputs=("op1",), reads=("recv2",))))


GOOD, BAD = {"recv1": 0, "recv2": 1}, {"recv1": 1, "recv2": 0}


def test_fig1_makespans_by_hand() -> None:
    # recv1 first: recv1 0-2, op1 2-6 while recv2 2-5, op2 6-7.  recv2 first: 0-3, recv1 3-5, op1 5-9, op2 9-10.
    good = simulate_iteration(fig1(), GOOD, SLOW)
    assert good.makespan_s == 7.0 and good.recv_order == (("recv1", "recv2"),)
    assert simulate_iteration(fig1(), BAD, SLOW).makespan_s == 10.0
    bars = {(e.resource, e.name): (e.start_s, e.end_s) for e in good.events}
    assert bars == {("downlink", "recv1"): (0, 2), ("downlink", "recv2"): (2, 5),
                    ("compute", "op1"): (2, 6), ("compute", "op2"): (6, 7)}


@pytest.mark.parametrize(("ma", "pa", "mb", "pb"), [(1, 3, 2, 1), (4, 2, 3, 6), (2, 5, 5, 2)])
def test_two_branches_follow_the_seed_formula(ma: int, pa: float, mb: int, pb: float) -> None:
    dag = Dag("case1", (Param("A", ma), Param("B", mb)),
              (Op("opA", time_s=pa, reads=("A",)), Op("opB", time_s=pb, reads=("B",))))
    assert simulate_iteration(dag, {"A": 0, "B": 1}, SLOW).makespan_s == ma + max(pa, mb) + pb
    assert simulate_iteration(dag, {"A": 1, "B": 0}, SLOW).makespan_s == mb + max(pb, ma) + pa


def test_training_iteration_by_hand() -> None:
    dag = training_dag(fig1()).with_times({})  # backward = 2x forward: bwd:op2 2 s, bwd:op1 8 s
    # pulls as above (op2 ends at 7); bwd:op2 7-9; push recv2 (3 s) 9-12; bwd:op1 9-17; push recv1 17-19.
    r = simulate_iteration(dag, GOOD, SLOW)
    assert r.makespan_s == 19.0
    ups = [(e.name, e.start_s, e.end_s) for e in r.events if e.resource == "uplink"]
    assert ups == [("recv2", 9, 12), ("recv1", 17, 19)]


def test_workers_with_different_orders_straggle() -> None:
    cfg = IterationConfig(workers=2, bandwidth_GBps=1e-9)
    r = simulate_iteration(fig1(), [GOOD, BAD], cfg)
    assert r.finish_s == (7.0, 10.0) and r.makespan_s == 10.0
    assert r.straggler_percent == pytest.approx(30.0)  # worker 0 waits 3 s of 10
    assert simulate_iteration(fig1(), GOOD, cfg).straggler_percent == 0.0


def test_random_orders_differ_per_worker_and_per_seed() -> None:
    dag = Dag("flat", tuple(Param(f"p{i}", 1) for i in range(6)), tuple(Op(f"o{i}", reads=(f"p{i}",)) for i in range(6)))
    r = simulate_iteration(dag, "random", IterationConfig(workers=3, bandwidth_GBps=1e-9), seed=3)
    assert len(set(r.recv_order)) > 1
    orders = {simulate_iteration(dag, "random", SLOW, seed=s).recv_order for s in range(5)}
    assert len(orders) > 1
    assert simulate_iteration(dag, "fifo", SLOW).recv_order == (tuple(f"p{i}" for i in range(6)),)


def test_server_nic_is_shared_max_min_fairly() -> None:
    dag = Dag("one", (Param("p", 10),), (Op("o", reads=("p",)),))
    alone = simulate_iteration(dag, "fifo", IterationConfig(workers=2, bandwidth_GBps=1e-9))
    assert alone.finish_s == (10.0, 10.0)
    shared = simulate_iteration(dag, "fifo", IterationConfig(workers=2, bandwidth_GBps=1e-9, server_bandwidth_GBps=1e-9))
    assert shared.finish_s == (20.0, 20.0)  # 0.5 B/s each
    wide = simulate_iteration(dag, "fifo", IterationConfig(workers=4, bandwidth_GBps=1e-9, server_bandwidth_GBps=2e-9))
    assert wide.makespan_s == 20.0  # 4 workers, server 2 B/s: 0.5 B/s each


def test_partitioning_latency_and_credit() -> None:
    dag = Dag("two", (Param("A", 4), Param("B", 4)), (Op("a", reads=("A",)), Op("b", reads=("B",))))
    prio = {"A": 0, "B": 1}

    def arrivals(cfg: IterationConfig) -> dict[str, float]:
        r = simulate_iteration(dag, prio, cfg)
        out: dict[str, float] = {}
        for e in r.events:
            if e.resource == "downlink":
                out[e.name.split("#")[0]] = max(out.get(e.name.split("#")[0], 0.0), e.end_s)
        return out

    assert arrivals(SLOW) == {"A": 4, "B": 8}
    # Chunks of 1 byte, one at a time: same bytes, same times; α is paid after the last byte and pipelines.
    cfg = IterationConfig(bandwidth_GBps=1e-9, partition_bytes=1, alpha_s=0.5)
    r = simulate_iteration(dag, prio, cfg)
    assert sum(e.resource == "downlink" for e in r.events) == 8 and r.makespan_s == 8.5
    # A credit of 8 bytes keeps both tensors in flight: they share the link and both land at 8.
    assert arrivals(IterationConfig(bandwidth_GBps=1e-9, credit_bytes=8)) == {"A": 8, "B": 8}


def test_allreduce_uses_the_ring_cost() -> None:
    dag = training_dag(Dag("one", (Param("p", 10),), (Op("o", time_s=1.0, reads=("p",)),))).with_times({})
    # 4 workers: a ring moves 2(W-1)/W = 1.5x the bytes: 15 s, then o (1 s) and bwd:o (2 s); the push is free.
    r = simulate_iteration(dag, "fifo", IterationConfig(workers=4, mode="allreduce", bandwidth_GBps=1e-9))
    assert r.makespan_s == 18.0 and r.finish_s == (18.0,) * 4
    assert {e.resource for e in r.events} == {"allreduce", "compute"}


def test_gantt_plot(tmp_path) -> None:
    r = simulate_iteration(training_dag(fig1()).with_times({}), "tac", IterationConfig(workers=2, bandwidth_GBps=1e-9))
    out = plot_iteration(r, tmp_path / "gantt.png")
    assert out.stat().st_size > 1000
    with pytest.raises(SimulationError, match=".png"):
        plot_iteration(r, tmp_path / "gantt.txt")
    with pytest.raises(SimulationError, match="record=True"):
        plot_iteration(simulate_iteration(fig1(), "tac", SLOW, record=False), tmp_path / "x.png")


@pytest.mark.parametrize(("kw", "message"), [
    ({"workers": 0}, "workers=0"),
    ({"mode": "ring"}, "unknown iteration mode 'ring'"),
    ({"bandwidth_GBps": -1.0}, "bandwidth_GBps=-1.0"),
    ({"server_bandwidth_GBps": 0}, "server_bandwidth_GBps=0"),
    ({"partition_bytes": 0}, "partition_bytes=0"),
    ({"alpha_s": -1e-3}, "alpha_s"),
])
def test_bad_configs(kw, message) -> None:
    with pytest.raises(SimulationError, match=message):
        IterationConfig(**kw)


def test_bad_orders() -> None:
    with pytest.raises(SimulationError, match="1 entries for 2 workers"):
        simulate_iteration(fig1(), [GOOD], IterationConfig(workers=2))
    with pytest.raises(ValueError, match="missing"):
        simulate_iteration(fig1(), {"recv1": 0})
