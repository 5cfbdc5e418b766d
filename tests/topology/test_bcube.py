"""BCube(n, k) and k-ary Fat-Tree builders against their definitions (seed 001 §3.1, Al-Fares et al.)."""

from __future__ import annotations

import pytest

from gradsync.errors import TopologyError
from gradsync.topology import BUILDERS, get_topology, load, save


def address(r: int, n: int, k: int) -> list[int]:
    """[v_{k-1}, ..., v_0]: base-n digits of r, written as the seed writes server IDs."""
    return [(r // n**i) % n for i in reversed(range(k))]


# ---- BCube ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(2, 1), (5, 1), (2, 2), (3, 2), (4, 2), (2, 3), (3, 3), (4, 3), (2, 4)])
def test_bcube_counts(n, k):
    t = get_topology(f"bcube:{n},{k}")
    c = t.counts()
    big_n = n**k
    # Seed §3.1: n**k servers with k interfaces, k * n**(k-1) switches of n ports.
    assert c["host"] == big_n == t.world_size
    assert c["switch"] == k * n ** (k - 1) == k * big_n // n
    assert c["links"] == k * big_n  # one link per NIC
    assert "nic" not in c and len(c) == 4  # host, switch, links, ranks
    assert t.attrs == {"family": "bcube", "n": n, "k": k, "servers": big_n, "switches": k * n ** (k - 1), "nics": k * big_n}
    g = t.graph
    for d in t.devices:
        if d.kind == "switch":
            assert g.degree(d.name) == n and all(t.device(v).kind == "host" for v in g[d.name])  # n ports, no switch-switch
        else:
            assert g.degree(d.name) == k  # one NIC per level
    assert {lk.kind for lk in t.links} == {f"level{lv}" for lv in range(k)}
    assert all(lk.bandwidth_GBps == 1.25 for lk in t.links) and t.unit_bandwidth_GBps == 1.25


@pytest.mark.parametrize("n, k", [(3, 2), (2, 3), (4, 2), (3, 1)])
def test_bcube_wiring_matches_the_definition(n, k):
    t = get_topology(f"bcube:{n},{k}")
    g = t.graph
    for r, name in enumerate(t.ranks):
        assert t.device(name).attrs["digits"] == address(r, n, k)
    # A level-l switch joins exactly the servers that differ only in digit v_l (index k-1-l of the address).
    for lk in t.links:
        level = int(lk.kind[len("level"):])
        assert t.device(lk.b).attrs["level"] == level
    for d in t.devices:
        if d.kind != "switch":
            continue
        level = d.attrs["level"]
        addrs = [t.device(v).attrs["digits"] for v in g[d.name]]
        rest = {tuple(a[:k - 1 - level] + a[k - level:]) for a in addrs}
        assert len(rest) == 1 and sorted(a[k - 1 - level] for a in addrs) == list(range(n))


def test_bcube_3_2_names_and_one_hop_neighbours():
    t = get_topology("bcube:3,2")
    assert t.ranks == ("s00", "s01", "s02", "s10", "s11", "s12", "s20", "s21", "s22")
    assert t.rank_index["s12"] == 5  # [v1 v0] = [1, 2] is 1*3 + 2
    g = t.graph
    # Seed §3.1: "in Fig. 3 each server has four 1-hop neighboring servers".
    for s in t.ranks:
        one_hop = {v for sw in g[s] for v in g[sw]} - {s}
        assert len(one_hop) == 4
    assert set(g["s00"]) == {"L0.sw0", "L1.sw0"} and set(g["L0.sw0"]) == {"s00", "s01", "s02"}
    assert set(g["L1.sw2"]) == {"s02", "s12", "s22"}


def test_bcube_wide_switch_names_are_unambiguous():
    t = get_topology("bcube:12,2")
    assert t.ranks[12 * 11 + 3] == "s11.3" and len(set(t.ranks)) == 144


def test_bcube_round_trips_through_files(tmp_path):
    t = get_topology("bcube:3,2")
    for suffix in (".json", ".yaml"):
        back = load(save(t, tmp_path / f"b{suffix}"))
        assert back.ranks == t.ranks and back.attrs == t.attrs and back.counts() == t.counts()
        assert back.device("s12").attrs["digits"] == [1, 2]


@pytest.mark.parametrize("spec, match", [
    ("bcube:1,2", "n >= 2"), ("bcube:3,0", "k >= 1"), ("bcube:2,17", "n\\*\\*k = 131072"), ("bcube:3", "2 argument"),
    ("fattree:3", "even k"), ("fattree:0", "even k"), ("fattree:66", "too large"),
])
def test_bad_specs_name_the_value(spec, match):
    with pytest.raises(TopologyError, match=match):
        get_topology(spec)


def test_registered_with_examples():
    assert BUILDERS.get("bcube").example == "bcube:3,2" and BUILDERS.get("fattree").example == "fattree:4"
    assert get_topology(BUILDERS.get("bcube").example).name == "bcube:3,2"


# ---- the seed's cost claim (§3.1): BCube needs k*N/n switches, Fat-Tree 5*N/n ------------------------------
def test_switch_counts_bcube_vs_fattree():
    # 16 servers of 4-port switches (Fig. 5's small case): BCube(4,2) uses k/5 = 2/5 of Fat-Tree(4)'s switches.
    b, f = get_topology("bcube:4,2").counts(), get_topology("fattree:4").counts()
    assert b["host"] == f["host"] == 16
    assert (b["switch"], f["switch"]) == (8, 20) and b["switch"] / f["switch"] == pytest.approx(2 / 5)
    # ... paid for with NICs: k per server instead of one.
    assert (b["links"], sum(1 for lk in get_topology("fattree:4").links if lk.kind == "host")) == (32, 16)
    # 1024 servers (Fig. 5's large case): BCube(32,2) with 32-port switches, Fat-Tree(16) with 16-port ones.
    b, f = get_topology("bcube:32,2").counts(), get_topology("fattree:16").counts()
    assert b["host"] == f["host"] == 1024
    assert b["switch"] == 2 * 1024 // 32 == 64 and f["switch"] == 5 * 1024 // 16 == 320
    # The testbed's BCube(3,2): k*N/n = 6 switches, where the 5*N/n formula gives 15.
    assert get_topology("bcube:3,2").counts()["switch"] == 6 == 2 * 9 // 3
    # Same port count n, any k: the ratio is exactly k/5 (40%-80% for k = 2..4).
    for n, k in [(4, 2), (4, 3), (4, 4)]:
        big_n = n**k
        assert get_topology(f"bcube:{n},{k}").counts()["switch"] / (5 * big_n / n) == pytest.approx(k / 5)
    assert get_topology("fattree:4").counts()["switch"] == 5 * 16 // 4  # Fat-Tree's 5*N/n at N = n**3/4
