"""The cost model's price of one seed-002 round (``benchmarks.mxnet_mpi``'s :func:`ps_round`) against closed forms."""

from __future__ import annotations

from pathlib import Path

import pytest

import benchmarks.mxnet_mpi as bench
from gradsync.sim.bench import BENCHMARKS
from gradsync.sim.cost import CostModel
from gradsync.topology import get_topology

_ROOT = Path(bench.__file__).resolve().parents[1]

M = 4e6
TOPO = get_topology("switch:10")
BETA = TOPO.links[0].bandwidth_GBps * 1e9
FREE = CostModel(message_s=0.0)  # bytes only: the closed forms below


def test_dist_sgd_round_is_bound_by_the_servers_links():
    """8 workers push M/2 to each of 2 servers, then pull it back: each server NIC carries 8 M/2 per
    direction, once for the pushes and once, after every push arrived, for the pulls: 2 * 8 * (M/2) / β."""
    assert bench.predicted_comm_s("dist-sgd", 8, 8, 2, M, 1, TOPO, FREE) == pytest.approx(2 * 8 * (M / 2) / BETA, rel=1e-9)


def test_pure_allreduce_is_gloos_ring():
    """No servers: one client of all 8 workers, a ring allreduce: 2 (n - 1) M / (n β)."""
    assert bench.predicted_comm_s("allreduce", 0, 8, 2, M, 1, TOPO, FREE) == pytest.approx(2 * 7 * M / (8 * BETA), rel=1e-9)


def test_one_client_adds_ring_push_pull_and_a_binomial_broadcast():
    """C = 1: ring allreduce (14 steps of M/8), one push and one pull of M/2 per server through the root's
    NIC (M each way), then log2(8) = 3 broadcast rounds of M: 14 M/8 + 2 M/... per phase, summed."""
    ring = 2 * 7 * M / (8 * BETA)
    push_pull = 2 * M / BETA  # the root's NIC carries both slices, M, each way
    bcast = 3 * M / BETA
    assert bench.predicted_comm_s("mpi-sgd", 1, 8, 2, M, 1, TOPO, FREE) == pytest.approx(ring + push_pull + bcast,
                                                                                          rel=1e-9)


def test_esgd_exchanges_every_interval_rounds():
    sgd = bench.predicted_comm_s("mpi-sgd", 2, 8, 2, M, 8, TOPO, FREE)
    assert bench.predicted_comm_s("mpi-esgd", 2, 8, 2, M, 8, TOPO, FREE) == pytest.approx(sgd / bench.ESGD_INTERVAL)


def test_testbed_run_finds_its_model_from_any_directory_before_the_testbed_comes_up(monkeypatch, tmp_path):
    """``gradsync bench`` loads the checkout's ``benchmarks`` package wherever it runs, the checkout not on
    ``sys.path``: with ``--testbed`` the benchmark imports seed 001's LeNet-5 from it, and only then brings the
    testbed up (a failure before the run's ``try`` would leave the testbed up). ``up`` is stubbed to stop there:
    no root needed."""
    import sys

    import gradsync.testbed as testbed

    class Reached(Exception):
        pass

    def fake_up(spec, rate):
        assert "benchmarks.bml_testbed_worker" in sys.modules  # the model came first
        raise Reached(spec)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != _ROOT])
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(testbed, "up", fake_up)
    main = BENCHMARKS.get("mxnet-mpi").load()
    with pytest.raises(Reached, match="switch:10"):
        main(["--testbed", "--out", str(tmp_path)])
