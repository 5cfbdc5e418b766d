"""The exact cut bound against brute force over every partition, the LP optimum and closed forms."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from gradsync.plan import limits, pack_trees
from gradsync.plan.cut_bound import cut_bound, family_bound
from gradsync.plan.limits import _singleton_cut
from gradsync.topology import DGX1_NVLINKS, Device, Link, Topology, get_topology
from tests.conftest import random_fabric, random_topology, set_partitions


# ---- independent brute force ---------------------------------------------------------------------------------
def boundary(topology: Topology, members: set[str]) -> float:
    return sum(1 / c for lk, c in zip(topology.links, topology.costs) if (lk.a in members) != (lk.b in members))


def brute_cut(topology: Topology) -> float:
    """The theorem's definition: max over rank partitions of 2(q-1) / sum_i min{w(δ(X)) : X ∩ R = A_i}."""
    names = [d.name for d in topology.devices]
    ranks = set(topology.ranks)
    h: dict[frozenset[str], float] = {}
    for size in range(len(names) + 1):
        for xs in itertools.combinations(names, size):
            key = frozenset(ranks.intersection(xs))
            h[key] = min(h.get(key, float("inf")), boundary(topology, set(xs)))
    best = 0.0
    for parts in set_partitions(list(topology.ranks)):
        if len(parts) >= 2:
            best = max(best, 2 * (len(parts) - 1) / sum(h[frozenset(p)] for p in parts))
    return best


def brute_aggregation_partition(topology: Topology) -> float:
    """The partition bound over partitions of all devices whose parts each hold a rank (aggregating switches)."""
    best = 0.0
    ranks = set(topology.ranks)
    for parts in set_partitions([d.name for d in topology.devices]):
        if len(parts) >= 2 and all(ranks.intersection(p) for p in parts):
            where = {v: i for i, p in enumerate(parts) for v in p}
            cap = sum(1 / c for lk, c in zip(topology.links, topology.costs) if where[lk.a] != where[lk.b])
            best = max(best, (len(parts) - 1) / cap)
    return best


# ---- multi-box fabrics (ForestColl's A100 boxes; DGX-1 boxes on InfiniBand) -------------------------------------
def dgx1_boxes(boxes: int) -> Topology:
    """DGX-1 boxes (hybrid cube-mesh, 25 GB/s NVLinks); GPUs 2i, 2i+1 share NIC i (12 GB/s PCIe, 12.5 GB/s IB)."""
    devices, links = [Device("ib", "switch")], []
    for m in range(boxes):
        devices += [Device(f"n{m}.gpu{i}", "gpu") for i in range(8)]
        links += [Link(f"n{m}.gpu{i}", f"n{m}.gpu{j}", 25.0 * DGX1_NVLINKS[i][j], kind="nvlink")
                  for i in range(8) for j in range(i + 1, 8) if DGX1_NVLINKS[i][j]]
        for k in range(4):
            devices.append(Device(f"n{m}.nic{k}", "nic"))
            links += [Link(f"n{m}.gpu{g}", f"n{m}.nic{k}", 12.0, kind="pcie") for g in (2 * k, 2 * k + 1)]
            links.append(Link(f"n{m}.nic{k}", "ib", 12.5, kind="network"))
    return Topology(f"dgx1x{boxes}", tuple(devices), tuple(links), unit_bandwidth_GBps=25.0)


def a100_boxes(boxes: int) -> Topology:
    """ForestColl's ``a100_topology`` (8 GPUs on an NVSwitch, 300 GB/s, one 25 GB/s NIC each, two IB rails),
    transcribed in ``benchmarks/topologies/a100x{2,4,8}.yaml``."""
    return get_topology(str(Path(__file__).resolve().parents[2] / "benchmarks" / "topologies" / f"a100x{boxes}.yaml"))


# ---- tests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_cut_equals_brute_force_and_bounds_the_lp(seed):
    t = random_fabric(seed)
    b = cut_bound(t)
    assert b.exact
    assert b.value == pytest.approx(brute_cut(t), rel=1e-12)
    # the family it reports attains the value (each part's best boundary, by brute force)
    assert sorted(r for p in b.parts for r in p) == sorted(t.ranks)
    # never above what a forwarding-only schedule achieves, never below the aggregation partitions
    assert b.value <= pack_trees(t).cost * (1 + 1e-9)
    assert b.value >= brute_aggregation_partition(t) * (1 - 1e-12) >= _singleton_cut(t) * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_cut_is_the_nash_williams_optimum_without_switches(seed):
    t = random_topology(2 + seed % 7, seed % 11, seed)
    assert cut_bound(t).value == pytest.approx(brute_aggregation_partition(t), rel=1e-12)
    assert cut_bound(t).value == pytest.approx(pack_trees(t).cost, rel=1e-7)


def test_dgx1_boxes_box_cut():
    t = dgx1_boxes(2)
    b = cut_bound(t)
    # The box is the bottleneck: 4 IB links of 12.5 GB/s = 2 NVLink units out of each box, so 1/2.
    assert b.value == pytest.approx(0.5, rel=1e-12)
    assert sorted(len(p) for p in b.parts) == [8, 8]
    box = [{d.name for d in t.devices if d.name.startswith(f"n{m}.")} for m in (0, 1)]
    assert family_bound(t, box) == pytest.approx(0.5, rel=1e-12)
    assert _singleton_cut(t) == pytest.approx(15 / (48 + 15 * 12 / 25), rel=1e-12)  # 0.272: the old bound
    bounds = limits(t)
    assert bounds.lower_bound == pytest.approx(pack_trees(t).cost, rel=1e-9)  # certified optimal


def test_a100_boxes():
    t = a100_boxes(2)
    b = cut_bound(t)
    # Every GPU alone (12 + 1 units each): 2*15/(16*13) = 0.1442, above the box cut 8 NICs -> 1/8.
    assert b.value == pytest.approx(30 / 208, rel=1e-12)
    box = [{f"n{m}.gpu{i}" for i in range(8)} | {f"n{m}.nvswitch"} | {f"n{m}.nic{i}" for i in range(8)} for m in (0, 1)]
    assert family_bound(t, box) == pytest.approx(0.125, rel=1e-12)
    assert _singleton_cut(t) == pytest.approx(15 / 195, rel=1e-12)  # 0.077: the old bound
    assert limits(t).lower_bound == pytest.approx(pack_trees(t).cost, rel=1e-9) == pytest.approx(30 / 208)
    # four boxes: now the boxes bind, 2*3 / (4 * 8)
    assert cut_bound(a100_boxes(4)).value == pytest.approx(6 / 32, rel=1e-12)


@pytest.mark.parametrize("spec, closed", [
    ("fattree:4", 2 * 15 / 16), ("fattree:6", 2 * 53 / 54), ("bcube:3,1", 4 / 3), ("bcube:3,2", 2 * 8 / 18),
    ("bcube:4,2", 2 * 15 / 32), ("switch:5", 8 / 5), ("p2.16xlarge", 15 / 8), ("minsky:4", 1.5),
    ("racks:2,3,4", 4.0), ("p3.16xlarge", 7 / 24), ("p3.16xlarge[0,1,2,4,5]", 0.5),
])
def test_tight_where_the_lp_is_optimal(spec, closed):
    t = get_topology(spec)
    assert cut_bound(t).value == pytest.approx(closed, rel=1e-12)
    assert pack_trees(t).cost == pytest.approx(closed, rel=1e-7)
    # without the LP the cut bound alone certifies the optimum
    assert limits(t, max_lp_ranks=1).lower_bound == pytest.approx(closed, rel=1e-12)


def test_fattree_large_is_certified_without_the_lp():
    t = get_topology("fattree:12")  # 432 hosts: above the LP's rank limit
    b = limits(t)
    assert b.method == "cut" and b.lower_bound == pytest.approx(2 * 431 / 432, rel=1e-12)


def test_inexact_capacities_still_give_a_valid_bound():
    # Incommensurable bandwidths: rounded to integers, the family is re-evaluated on the true capacities.
    rng = random.Random(7)
    t = random_fabric(3)
    t = Topology(t.name, t.devices, tuple(Link(lk.a, lk.b, lk.bandwidth_GBps * (1 + rng.random() * 3 ** 0.5))
                                          for lk in t.links))
    b = cut_bound(t)
    assert not b.exact
    assert b.value <= brute_cut(t) * (1 + 1e-12)
    assert b.value >= brute_cut(t) * (1 - 1e-4)


def test_single_rank_has_no_bound():
    t = get_topology("switch:1")
    assert cut_bound(t).value == 0.0


def test_a_schedule_that_meets_the_cut_skips_the_lp():
    t = get_topology("fattree:4")
    b = limits(t, achieved=2 * 15 / 16)
    assert b.method == "cut" and b.lower_bound == pytest.approx(2 * 15 / 16, rel=1e-12)
    assert limits(t, achieved=2.5).method == "lp"  # not met: the LP's certificate is still computed
