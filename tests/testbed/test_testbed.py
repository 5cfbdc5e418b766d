"""The emulated cluster (gradsync.testbed): the build plan without root, then real namespaces when root.

The root tests bring up ``switch:3`` and ``bcube:2,2`` at 100 Mbit/s, run gloo all_reduce across the
namespaces, probe rates and read interface counters; every testbed is removed in a ``finally``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import networkx as nx
import pytest

from gradsync.commands.testbed import add_parser, parse_pairs
from gradsync.errors import GradsyncError
from gradsync.testbed import (
    TestbedError,
    TestbedPlan,
    available,
    build_plan,
    down,
    leftovers,
    load_state,
    parse_delay,
    parse_rate,
    probe,
    run,
    sample_pairs,
    up,
)
from gradsync.testbed import netns as tb_netns
from gradsync.testbed import status as tb_status
from gradsync.testbed.control import current_user, load_owner, owner_record, set_link, set_server_rate
from gradsync.topology import get_topology

SPECS = ("switch:3", "switch:9", "bcube:2,2", "bcube:3,2", "bcube:2,3", "fattree:4", "ring:2", "ring:5")

_REASON = available()
needs_root = pytest.mark.skipif(_REASON is not None, reason=f"testbed unavailable: {_REASON}")

ALLREDUCE = """
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
r, w = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(r + 1)])
dist.all_reduce(t)
print("sum", t.item(), flush=True)
assert t.item() == w * (w + 1) / 2, t.item()
dist.destroy_process_group()
"""


def plan_for(spec: str, rate: str = "100mbit") -> TestbedPlan:
    return build_plan(get_topology(spec), rate)


# ---- pure: the build plan -------------------------------------------------------------------------------
def test_parse_rate_and_delay() -> None:
    assert parse_rate("200mbit") == 200
    assert parse_rate("1gbit") == 1000
    assert parse_rate("500kbit") == 0.5
    assert parse_rate(50) == 50
    for bad in ("100mbps", "fast", "0mbit"):
        with pytest.raises(TestbedError):
            parse_rate(bad)
    assert parse_delay(None) is None and parse_delay("0ms") is None
    assert parse_delay("5ms") == 5 and parse_delay("200us") == pytest.approx(0.2) and parse_delay("0.1s") == 100
    with pytest.raises(TestbedError, match="delay"):
        parse_delay("soon")


@pytest.mark.parametrize("spec", SPECS)
def test_plan_addresses_unique_names_short_every_nic_rated(spec: str) -> None:
    plan = plan_for(spec)
    topo = get_topology(spec)
    assert plan.world_size == len(topo.ranks)
    addresses = [n.address for s in plan.servers for n in s.nics]
    assert len(addresses) == len(set(addresses))
    assert all(a.startswith("10.213.") for a in addresses)
    assert len({s.namespace for s in plan.servers}) == plan.world_size
    names = plan.interface_names()
    assert len(names) == len(set(names))
    assert all(len(x) <= 15 and x.startswith("gs-") for x in names + [n.ifname for s in plan.servers for n in s.nics])
    assert all(n.rate_mbit == pytest.approx(100) for s in plan.servers for n in s.nics)
    assert all(t.rate_mbit == pytest.approx(100) for t in plan.trunks)
    # A subnet is one L2 domain: every NIC on it hangs off a bridge of that subnet.
    subnet_of_bridge = {b.name: b.subnet for b in plan.bridges}
    assert all(subnet_of_bridge[n.bridge] == n.subnet for s in plan.servers for n in s.nics)
    # Every server reaches every other one through the planned routes, at the NIC rate.
    for a, b in sample_pairs(plan, 40):
        assert plan.path(a, b)[-1] == b and plan.path(b, a)[-1] == a
        assert plan.expected_mbit(a, b) == pytest.approx(100)


def test_bcube22_four_servers_two_nics_level_subnets() -> None:
    plan = plan_for("bcube:2,2")
    assert plan.world_size == 4
    for s in plan.servers:
        assert len(s.nics) == 2 and s.forwarding
        assert [n.peer[:2] for n in s.nics] == ["L0", "L1"]  # NIC l is the level-l port
    assert len(plan.bridges) == 4 and not plan.trunks
    assert plan.master_addr == plan.servers[0].nics[0].address == "10.213.0.1"


def test_bcube_routes_relay_and_neighbours_use_the_shared_level() -> None:
    plan = plan_for("bcube:2,2")  # s00=0, s01=1, s10=2, s11=3
    assert plan.path(0, 1) == [0, 1] and plan.path(0, 2) == [0, 2]
    assert plan.path(0, 3) == [0, 2, 3]  # highest digit first: 00 -> 10 -> 11, relayed by s10
    assert plan.path(1, 2) == [1, 3, 2]
    (out, into), = plan.hops(0, 1)
    assert out.ifname == "gs-nic0" and into.rank == 1  # level-0 neighbours: level-0 NIC
    (out, into), = plan.hops(0, 2)
    assert out.ifname == "gs-nic1" and into.ifname == "gs-nic1"  # level-1 neighbours: level-1 NIC
    routes = {r.dest: r for r in plan.servers[0].routes}
    assert routes[f"{plan.servers[2].address}/32"].dev == "gs-nic1"  # /32 to the neighbour's primary address
    assert routes[f"{plan.servers[3].address}/32"].via == plan.servers[2].nics[1].address
    relay = plan.hops(0, 3)
    assert [(a.rank, a.ifname) for a, _ in relay] == [(0, "gs-nic1"), (2, "gs-nic0")]
    bigger = plan_for("bcube:3,2")
    assert bigger.path(0, 8) == [0, 6, 8]  # s00 -> s20 -> s22


def test_fattree_is_one_loop_free_l2_tree_and_ring_relays() -> None:
    plan = plan_for("fattree:4")
    topo = get_topology("fattree:4")
    switches = [d for d in topo.devices if d.kind == "switch"]
    switch_links = [lk for lk in topo.links if lk.kind != "host"]
    assert len(plan.bridges) == len(switches) and len(plan.trunks) == len(switches) - 1
    assert len(plan.trunks) + len(plan.dropped) == len(switch_links)
    assert {n.subnet for s in plan.servers for n in s.nics} == {0}
    assert all(not s.routes and not s.forwarding for s in plan.servers)
    ring = plan_for("ring:5")
    assert all(len(s.nics) == 2 and s.forwarding for s in ring.servers)
    assert ring.path(0, 2) == [0, 1, 2] and ring.path(0, 3) == [0, 4, 3]


def _server_graph(plan: TestbedPlan) -> nx.Graph:
    """Servers joined where they share a subnet on NICs that are not cut (brute force over every pair)."""
    g = nx.Graph()
    g.add_nodes_from(range(plan.world_size))
    for a in plan.servers:
        for b in plan.servers:
            live = [(x, y) for x in a.nics for y in b.nics if x.subnet == y.subnet and a.rank < b.rank
                    and (a.rank, x.index) not in plan.cut and (b.rank, y.index) not in plan.cut]
            if live:
                g.add_edge(a.rank, b.rank)
    return g


@pytest.mark.parametrize("spec,cut", [("bcube:3,2", [(0, 0)]), ("bcube:3,2", [(4, 1), (8, 0)]), ("ring:5", [(0, 0)])])
def test_a_cut_nic_is_routed_around_and_every_other_route_stays(spec: str, cut: list[tuple[int, int]]) -> None:
    """Every server reaches every address of every other without touching a cut NIC; a path that crossed none keeps
    its routes hop by hop; a new one is a shortest path on the surviving server graph."""
    built = plan_for(spec)
    plan = dataclasses.replace(built, cut=tuple(cut))
    g = _server_graph(plan)
    changed = 0
    for src in plan.servers:
        for dst in plan.servers:
            for target in dst.nics if dst.rank != src.rank else ():
                old = built.walk(src.rank, target.address)
                new = plan.walk(src.rank, target.address)
                assert new[-1][1].rank == dst.rank
                assert not any((x.rank, x.index) in plan.cut for hop in new for x in hop), (src.rank, target)
                if not any((x.rank, x.index) in plan.cut for hop in old for x in hop):
                    assert new == old
                else:
                    changed += 1
                    assert len(new) == nx.shortest_path_length(g, src.rank, dst.rank)
    assert changed > 0
    unchanged = [r for r in range(plan.world_size) if plan.routes(r) == built.routes(r)]
    assert len(unchanged) < plan.world_size
    again = TestbedPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.cut == plan.cut and again.routes(1) == plan.routes(1)
    assert TestbedPlan.from_dict(json.loads(json.dumps(built.to_dict()))).cut == ()


def test_every_worker_is_told_which_nic_ends_which_topology_link() -> None:
    """GRADSYNC_NICS in each worker's environment: its own NICs, each the end of a link of the topology, in the
    form the runtime's watch reads (gradsync.comm.nics)."""
    from gradsync.comm.nics import parse_nics
    from gradsync.testbed.runner import worker_env

    plan = plan_for("bcube:3,2")
    topo = get_topology("bcube:3,2")
    for rank in (0, 5):
        env = worker_env(plan, rank, list(range(plan.world_size)), 29500, "/tmp/state.json", {})
        nics = parse_nics(env["GRADSYNC_NICS"])
        assert [n[0] for n in nics] == [x.ifname for x in plan.server(rank).nics]
        assert all(device == topo.ranks[rank] and topo.has_link(device, peer) for _, device, peer in nics)


def test_cutting_every_link_of_a_server_is_refused_with_the_rank_named() -> None:
    plan = plan_for("bcube:2,2")
    with pytest.raises(TestbedError, match="leaves rank 0 without a path to rank 1"):
        dataclasses.replace(plan, cut=((0, 0), (0, 1)))
    with pytest.raises(TestbedError, match=r"cut NIC \(0, 5\) is not a NIC"):
        dataclasses.replace(plan, cut=((0, 5),))


def test_plan_round_trips_through_json_and_scales_rates() -> None:
    plan = plan_for("bcube:3,2", "50mbit")
    again = TestbedPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.path(0, 8) == plan.path(0, 8)
    data = plan.to_dict()
    assert data["ranks"]["0"]["address"] == data["master_addr"] == "10.213.0.1"
    assert again.tcp_cc == data["tcp_cc"] == "cubic"  # Linux's default, not the host's, unless asked
    old = {k: v for k, v in data.items() if k != "tcp_cc"}  # a state from before the choice: the host's
    assert TestbedPlan.from_dict(old).tcp_cc == "host"
    with pytest.raises(TestbedError, match="tcp_cc='vegas': choose one of cubic, reno, bbr, host"):
        build_plan(get_topology("switch:2"), "50mbit", tcp_cc="vegas")
    # slow start after idle: Linux's default unless asked, also for states written before the choice
    assert again.idle_restart is True and data["tcp_idle_restart"] is True
    assert TestbedPlan.from_dict({k: v for k, v in data.items() if k != "tcp_idle_restart"}).idle_restart is True
    tuned = build_plan(get_topology("switch:2"), "50mbit", idle_restart=False)
    assert TestbedPlan.from_dict(json.loads(json.dumps(tuned.to_dict()))).idle_restart is False
    with pytest.raises(TestbedError, match="idle_restart='no' must be True .* or False"):
        build_plan(get_topology("switch:2"), "50mbit", idle_restart="no")  # type: ignore[arg-type]
    # A link of twice the unit bandwidth gets twice the rate (p3.16xlarge: 2 NVLinks = 50 GB/s).
    dgx = plan_for("p3.16xlarge")
    assert {n.rate_mbit for s in dgx.servers for n in s.nics} == {100.0, 200.0}


def test_probe_rows_become_the_runtimes_cost_model() -> None:
    """Link classes at the testbed's shaped rates, goodput = median measured/expected; a pair that measured
    nothing is left out, and with no usable pair the TCP header arithmetic stands in (never a model that
    cannot run)."""
    from gradsync.testbed.probe import TCP_GOODPUT, cost_model

    plan = plan_for("racks:2,3,4", "400mbit")
    rows = [{"measured_mbit": 383.0, "expected_mbit": 400.0}, {"measured_mbit": 95.0, "expected_mbit": 100.0},
            {"measured_mbit": 0.0, "expected_mbit": 400.0}]
    m = cost_model(plan, rows, message_s=1e-4)
    assert m.link_GBps == {"network": pytest.approx(0.05), "uplink": pytest.approx(0.0125)}
    assert m.goodput == pytest.approx((383 / 400 + 95 / 100) / 2) and m.message_s == 1e-4
    assert "2 pairs" in m.source
    fallback = cost_model(plan, [{"measured_mbit": 0.0, "expected_mbit": 400.0}])
    assert fallback.goodput == TCP_GOODPUT and "headers" in fallback.source
    assert m.reverse_share == 0.0 and fallback.reverse_share == 0.0  # nothing probed both ways
    both = cost_model(plan, [{**rows[0], "reverse_share": 0.02}, {**rows[1], "reverse_share": 0.1},
                             {**rows[1], "reverse_share": 0.06}, {**rows[2], "reverse_share": None}])
    assert both.reverse_share == pytest.approx(0.06) and "both ways" in both.source
    # the shaper's bucket: 4 ms of the slowest class's rate (100 Mbit/s uplinks), its floor of 10 frames below
    assert m.burst_s == pytest.approx(0.004)
    assert cost_model(plan_for("switch:2", "10mbit")).burst_s == pytest.approx(15140 / (10e6 / 8))
    topo = get_topology("racks:2,3,4")
    # the model's rates are the testbed's: the uplink is 1/4 of a NIC, as shaped
    fast = m.rates(topo)
    assert {lk.kind: lk.bandwidth_GBps for lk in fast.links} == {"network": pytest.approx(0.05 * m.goodput),
                                                                "uplink": pytest.approx(0.0125 * m.goodput)}


def test_a_probed_model_of_a_hand_written_file_gives_each_link_its_shaped_rate() -> None:
    """A file names every link's kind alike (``link``: host links at 3 GB/s, uplinks at 1): the probe's class rate is
    the slowest link's shaped rate, and the model's rates are the testbed's for every link, 3:1 as shaped (the class
    rate used to flatten the class, and the racks were gone from the model)."""
    from gradsync.testbed.probe import cost_model

    topo = get_topology(str(Path(__file__).resolve().parents[2] / "benchmarks" / "fabrics" / "three-rack.yaml"))
    plan = build_plan(topo, "60mbit")
    m = cost_model(plan, [{"measured_mbit": 57.0, "expected_mbit": 60.0}], topology=topo)
    assert set(m.link_GBps) == {"link"}
    unit = float(topo.unit_bandwidth_GBps or 1.0)
    shaped = [60 * lk.bandwidth_GBps / unit / 8e3 * m.goodput for lk in topo.links]
    assert [lk.bandwidth_GBps for lk in m.rates(topo).links] == pytest.approx(shaped)
    assert len({round(r, 12) for r in shaped}) == 2  # two rates, as the file says
    with pytest.raises(TestbedError, match="three-rack.*no built-in name.*--topology"):
        cost_model(plan)  # the state names the file's topology, which no builder knows


def test_unsupported_topology_and_bad_state_are_clear_errors() -> None:
    with pytest.raises(TestbedError, match="neither a rank nor a switch"):
        plan_for("minsky:2")
    with pytest.raises(TestbedError, match="testbed down"):
        TestbedPlan.from_dict({"type": "gradsync.testbed"})
    assert issubclass(TestbedError, GradsyncError)


def test_owner_record_round_trips_and_sudo_user_is_the_owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUDO_USER", "alice")
    assert current_user() == "alice"
    rec = owner_record("gradsync testbed up -t switch:3")
    assert rec["user"] == "alice" and rec["pid"] == os.getpid() and rec["command"] == "gradsync testbed up -t switch:3"
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"type": "gradsync.testbed", "owner": rec}))
    assert load_owner(state) == rec
    state.write_text(json.dumps({"type": "gradsync.testbed"}))  # written before owners: none recorded
    assert load_owner(state) is None and load_owner(tmp_path / "missing.json") is None
    monkeypatch.delenv("SUDO_USER")
    assert current_user() != "alice"


def test_not_root_or_no_iproute2_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    tb_netns.available.cache_clear()
    try:
        monkeypatch.setattr(tb_netns.os, "geteuid", lambda: 1000)
        assert "run as root" in (tb_netns.available() or "")
        tb_netns.available.cache_clear()
        with pytest.raises(TestbedError, match="root"):
            tb_netns.require()
        with pytest.raises(TestbedError, match="root"):
            down()
        monkeypatch.setattr(tb_netns.os, "geteuid", lambda: 0)
        monkeypatch.setattr(tb_netns.shutil, "which", lambda name: None)
        tb_netns.available.cache_clear()
        assert "apt-get install -y iproute2" in (tb_netns.available() or "")
    finally:
        tb_netns.available.cache_clear()
    with pytest.raises(TestbedError, match="iproute2"):
        tb_netns.sh(["gs-no-such-binary-here", "x"])
    with pytest.raises(TestbedError, match=r"command failed \(exit 1\): .*false"):
        tb_netns.sh(["false"])


def test_cli_parser_builds_every_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="gradsync")
    add_parser(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(["testbed", "up", "--topology", "bcube:2,2", "--rate", "100mbit", "--delay", "1ms"])
    assert (a.testbed_action, a.topology, a.rate, a.delay) == ("up", "bcube:2,2", "100mbit", "1ms")
    a = parser.parse_args(["testbed", "run", "--timeout", "5", "--", "python", "-c", "print(1)"])
    assert a.cmd[-3:] == ["python", "-c", "print(1)"] and a.timeout == 5
    for action in ("down", "probe", "status"):
        assert parser.parse_args(["testbed", action, "--state", "/tmp/x.json"]).testbed_action == action
    a = parser.parse_args(["testbed", "link", "down", "--rank", "4", "--peer", "L0.sw1"])
    assert (a.testbed_action, a.state_, a.rank, a.peer) == ("link", "down", 4, "L0.sw1")
    assert parse_pairs("0-1,2-3") == [(0, 1), (2, 3)]
    with pytest.raises(TestbedError):
        parse_pairs("0:1")


# ---- root: real namespaces --------------------------------------------------------------------------------
def _no_gs_objects() -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in ns.splitlines() if line.startswith("gs-")]
    found += [line.split(": ")[1].split("@")[0] for line in links.splitlines() if ": gs-" in line]
    return found


@contextlib.contextmanager
def _bring_up(spec: str, state: Path, **options: Any) -> Iterator[TestbedPlan]:
    left = leftovers()
    if left["namespaces"] or left["links"]:
        pytest.skip(f"a gs- testbed is already up ({left}); run 'gradsync testbed down' to run these tests")
    try:
        yield up(spec, "100mbit", state_path=state, **options)
    finally:
        down(state_path=state)


def _check_idle_restart(plan: TestbedPlan, state: Path, restart: bool) -> None:
    """The plan, the status and every namespace's kernel agree on slow start after idle."""
    assert plan.idle_restart is restart and tb_status(state_path=state)["tcp_idle_restart"] is restart
    for s in plan.servers:
        got = subprocess.run(tb_netns.ns_exec(s.namespace, ["cat", "/proc/sys/net/ipv4/tcp_slow_start_after_idle"]),
                             capture_output=True, text=True, timeout=30)
        assert got.returncode == 0 and got.stdout.strip() == str(int(restart)), (s.namespace, got)


def _tx(ns: str, ifname: str, what: str = "tx_bytes") -> int:
    path = f"/sys/class/net/{ifname}/statistics/{what}"
    return int(subprocess.run(["ip", "netns", "exec", ns, "cat", path], capture_output=True, text=True, check=True).stdout)


@pytest.fixture(scope="class")
def switch3_bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestbedPlan, Path]]:
    state = tmp_path_factory.mktemp("testbed") / "state.json"
    with _bring_up("switch:3", state) as plan:
        yield plan, state


@needs_root
@pytest.mark.timeout(180)
class TestSwitch3:

    def test_up_writes_state_and_refuses_a_second_testbed(self, switch3_bed: tuple[TestbedPlan, Path]) -> None:
        plan, state = switch3_bed
        data = json.loads(state.read_text())
        assert data["namespaces"] == ["gs-h0", "gs-h1", "gs-h2"] and data["master_addr"] == "10.213.0.1"
        with pytest.raises(TestbedError, match="gradsync testbed down"):
            up("switch:2", "100mbit", state_path=state.with_name("other.json"))

    def test_gloo_all_reduce_across_namespaces(self, switch3_bed: tuple[TestbedPlan, Path]) -> None:
        plan, state = switch3_bed
        out = io.StringIO()
        rc = run([sys.executable, "-c", ALLREDUCE], ranks=[0, 1], timeout=120, state_path=state, stream=out)
        text = out.getvalue()
        assert rc == 0, text
        assert "[rank 0] sum 3.0" in text and "[rank 1] sum 3.0" in text

    def test_run_sets_torchrun_env_and_returns_the_worst_exit_code(self, switch3_bed: tuple[TestbedPlan, Path]) -> None:
        plan, state = switch3_bed
        prog = ("import os, sys; e = os.environ; print(e['RANK'], e['WORLD_SIZE'], e['MASTER_ADDR'], "
                "e['GLOO_SOCKET_IFNAME'], e['GRADSYNC_TESTBED'], e['EXTRA']); sys.exit(3 if e['RANK'] == '2' else 0)")
        out = io.StringIO()
        rc = run([sys.executable, "-S", "-c", prog], env={"EXTRA": "yes"}, timeout=60, state_path=state, stream=out)
        assert rc == 3
        for r in range(3):
            assert f"[rank {r}] {r} 3 10.213.0.1 gs-nic0 {state.resolve()} yes" in out.getvalue()
        assert run([sys.executable, "-S", "-c", "import time; time.sleep(30)"], timeout=1, state_path=state,
                   stream=io.StringIO()) == 124

    def test_tcp_between_servers_uses_the_testbeds_congestion_control(
            self, switch3_bed: tuple[TestbedPlan, Path]) -> None:
        """A connection from server 0 to server 1 runs cubic (the route's congctl), whatever this host's own
        default is; the kernel reports it per socket (TCP_CONGESTION)."""
        plan, state = switch3_bed
        assert plan.tcp_cc == "cubic" and tb_status(state_path=state)["tcp_cc"] == "cubic"
        peer = plan.servers[1].address
        listen = (f"import socket; s = socket.create_server(('{peer}', 0)); print(s.getsockname()[1], flush=True); "
                  "c, _ = s.accept(); c.recv(1)")
        server = subprocess.Popen(tb_netns.ns_exec("gs-h1", [sys.executable, "-S", "-c", listen]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())  # type: ignore[union-attr]
            connect = (f"import socket; c = socket.create_connection(('{peer}', {port})); "
                       "print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b'\\0')[0].decode()); "
                       "c.send(b'x')")
            got = subprocess.run(tb_netns.ns_exec("gs-h0", [sys.executable, "-S", "-c", connect]), capture_output=True,
                                 text=True, timeout=30)
            assert got.returncode == 0 and got.stdout.strip() == "cubic", got
        finally:
            server.wait(timeout=30)

    def test_every_server_slow_starts_after_idle_as_the_plan_says(self, switch3_bed: tuple[TestbedPlan, Path]) -> None:
        """``net.ipv4.tcp_slow_start_after_idle`` is per namespace: written from the plan (Linux's 1 by
        default), whatever the host's own value is."""
        _check_idle_restart(*switch3_bed, True)

    def test_probe_is_within_15_percent_of_100mbit(self, switch3_bed: tuple[TestbedPlan, Path]) -> None:
        plan, state = switch3_bed
        out = io.StringIO()
        (row,) = probe([(0, 1)], seconds=1.0, state_path=state, stream=out)
        assert row["expected_mbit"] == 100
        assert abs(row["measured_mbit"] - 100) <= 15, out.getvalue()
        assert row["ok"] and "1/1 pairs" in out.getvalue()

    def test_owner_is_recorded_shown_and_guards_down(self, switch3_bed: tuple[TestbedPlan, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
        plan, state = switch3_bed
        owner = json.loads(state.read_text())["owner"]
        assert owner["user"] == current_user() and owner["pid"] == os.getpid() and owner["uid"] == os.getuid()
        sleeper = subprocess.Popen(tb_netns.ns_exec("gs-h1", ["sleep", "60"]))
        try:
            deadline = time.monotonic() + 10
            while not tb_netns.netns_pids("gs-h1") and time.monotonic() < deadline:
                time.sleep(0.05)
            info = tb_status(state_path=state)
            assert info["owner"] == owner
            assert any(p["command"] == "sleep 60" for p in info["processes"]["gs-h1"]), info["processes"]
            assert info["processes"]["gs-h0"] == []
        finally:
            sleeper.terminate()
            sleeper.wait(timeout=10)
        env = {**os.environ, "SUDO_USER": "someone-else", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        out = subprocess.run([sys.executable, "-m", "gradsync", "testbed", "down", "--state", str(state)],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert f"owned by {owner['user']}" in out.stderr and "not someone-else" in out.stderr and "--force" in out.stderr
        assert state.exists() and sorted(tb_netns.list_netns()) == ["gs-h0", "gs-h1", "gs-h2"]
        monkeypatch.setenv("SUDO_USER", "someone-else")
        with pytest.raises(TestbedError, match="--force"):
            down(state_path=state)

    def test_a_servers_rate_changes_while_up_and_comes_back(self, switch3_bed: tuple[TestbedPlan, Path]) -> None:
        """set_server_rate: server 1's NIC cut to 25 Mbit/s both ways (the probe, 0 -> 1, measures it), then back
        to the plan's 100."""
        plan, state = switch3_bed
        try:
            assert set_server_rate(1, "25mbit", state_path=state) == 25
            (row,) = probe([(0, 1)], seconds=1.0, state_path=state, stream=io.StringIO())
            assert abs(row["measured_mbit"] - 25) <= 25 * 0.15, row
        finally:
            assert set_server_rate(1, None, state_path=state) == 100
        (row,) = probe([(0, 1)], seconds=1.0, state_path=state, stream=io.StringIO())
        assert abs(row["measured_mbit"] - 100) <= 15, row
        with pytest.raises(TestbedError, match="out of range"):
            set_server_rate(7, "25mbit", state_path=state)

    def test_down_leaves_nothing_behind_and_is_idempotent(self, switch3_bed: tuple[TestbedPlan, Path]) -> None:
        plan, state = switch3_bed
        removed = down(state_path=state)
        assert sorted(removed["namespaces"]) == ["gs-h0", "gs-h1", "gs-h2"]
        assert _no_gs_objects() == [] and not state.exists()
        assert down(state_path=state) == {"namespaces": [], "links": [], "killed": []}


@pytest.fixture(scope="class")
def bcube22_bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestbedPlan, Path]]:
    state = tmp_path_factory.mktemp("testbed") / "state.json"
    with _bring_up("bcube:2,2", state, idle_restart=False) as plan:  # a cluster tuned for training
        yield plan, state


@needs_root
@pytest.mark.timeout(180)
class TestBcube22:

    def test_no_idle_restart_is_written_in_every_namespace(self, bcube22_bed: tuple[TestbedPlan, Path]) -> None:
        _check_idle_restart(*bcube22_bed, False)

    def test_level0_neighbours_use_the_level0_nic(self, bcube22_bed: tuple[TestbedPlan, Path]) -> None:
        plan, state = bcube22_bed
        before = {i: _tx("gs-h0", f"gs-nic{i}") for i in (0, 1)}
        (row,) = probe([(0, 1)], seconds=0.5, state_path=state, stream=io.StringIO())
        sent = {i: _tx("gs-h0", f"gs-nic{i}") - before[i] for i in (0, 1)}
        # The rate itself is checked to ±15% on switch:3; here the point is which NIC carries it.
        assert row["measured_mbit"] >= 0.5 * row["expected_mbit"], row
        assert sent[0] >= row["bytes"] and sent[1] < 0.1 * row["bytes"], (sent, row)

    def test_non_neighbours_are_relayed(self, bcube22_bed: tuple[TestbedPlan, Path]) -> None:
        plan, state = bcube22_bed
        watch = [("gs-h0", "gs-nic1"), ("gs-h2", "gs-nic0"), ("gs-h0", "gs-nic0"), ("gs-h1", "gs-nic0"),
                 ("gs-h1", "gs-nic1")]
        before = {w: _tx(*w) for w in watch}
        (row,) = probe([(0, 3)], seconds=0.5, state_path=state, stream=io.StringIO())
        sent = {w: _tx(*w) - before[w] for w in watch}
        assert row["path"] == [0, 2, 3] and row["measured_mbit"] >= 0.5 * row["expected_mbit"], row
        # Data: s00 -> (level 1) -> s10 relays -> (level 0) -> s11. BCube routing is not symmetric: the ACKs
        # go s11 -> s01 -> s00, so s01's level-0 NIC carries a few percent (ACKs) and the rest stay quiet.
        assert sent[("gs-h0", "gs-nic1")] >= row["bytes"]
        assert sent[("gs-h2", "gs-nic0")] >= row["bytes"]
        for quiet in watch[2:]:
            assert sent[quiet] < 0.1 * row["bytes"], (quiet, sent, row)

    def test_gloo_all_reduce_over_relays(self, bcube22_bed: tuple[TestbedPlan, Path]) -> None:
        plan, state = bcube22_bed
        out = io.StringIO()
        rc = run([sys.executable, "-c", ALLREDUCE], timeout=150, state_path=state, stream=out)
        assert rc == 0, out.getvalue()
        assert all(f"[rank {r}] sum 10.0" in out.getvalue() for r in range(4))


AUTO_ON_RACKS = """
import os, torch, gradsync
rt = gradsync.init("racks:2,2,4", timeout_s=60)
buf = torch.full((1 << 18,), float(rt.rank + 1))  # 1 MiB of float32
gradsync.allreduce(buf)
choice = rt.chooser.choose(buf.numel() * 4)
ok = bool(torch.all(buf == 10.0))
print("choice", choice.algorithm, choice.pipeline, "exact", ok, flush=True)
gradsync.shutdown()
"""


@needs_root
@pytest.mark.timeout(240)
def test_auto_plans_around_a_thin_uplink_and_stays_exact(tmp_path: Path) -> None:
    """Two racks of two servers whose rack uplinks run at 1/4 of a NIC: with the testbed's cost model,
    ``auto`` replaces gloo's rank-order ring (which crosses the uplinks with 3/2 of the buffer per
    direction) by a topology-aware plan, and the sum is exact on every rank."""
    from gradsync.testbed.probe import cost_model

    state = tmp_path / "state.json"
    with _bring_up("racks:2,2,4", state) as plan:
        model = tmp_path / "model.json"
        model.write_text(json.dumps(cost_model(plan).to_dict()))
        os.chmod(tmp_path, 0o755)
        out = io.StringIO()
        rc = run([sys.executable, "-c", AUTO_ON_RACKS], env={"GRADSYNC_COST_MODEL": str(model)}, timeout=200,
                 state_path=state, stream=out)
    text = out.getvalue()
    assert rc == 0, text
    lines = [ln for ln in text.splitlines() if "choice" in ln]
    assert len(lines) == 4 and all("exact True" in ln for ln in lines), text
    algorithms = {ln.split("choice ")[1].split()[0] for ln in lines}
    assert len(algorithms) == 1 and algorithms <= {"tree", "lp", "forest", "ps", "hierarchical"}, text


@needs_root
@pytest.mark.timeout(60)
def test_delay_needs_netem_or_cleans_up(tmp_path: Path) -> None:
    """With sch_netem the delay is installed; without it ``up`` fails with the fix and leaves nothing."""
    left = leftovers()
    if left["namespaces"] or left["links"]:
        pytest.skip(f"a gs- testbed is already up ({left})")
    state = tmp_path / "state.json"
    try:
        plan = up("switch:2", "100mbit", delay="2ms", state_path=state)
    except TestbedError as exc:
        assert "netem" in str(exc)
        assert _no_gs_objects() == [] and not state.exists()
        return
    try:
        assert plan.delay_ms == 2
        qdisc = subprocess.run(["tc", "-n", "gs-h0", "qdisc", "show", "dev", "gs-nic0"], capture_output=True,
                               text=True).stdout
        assert "netem" in qdisc and "tbf" in qdisc
    finally:
        down(state_path=state)
    assert _no_gs_objects() == []


def _kernel_route(ns: str, address: str) -> tuple[str, str | None]:
    """(dev, via) the kernel of namespace ``ns`` sends a packet for ``address`` on."""
    words = subprocess.run(["ip", "-n", ns, "route", "get", address], capture_output=True, text=True,
                           check=True).stdout.split()
    return words[words.index("dev") + 1], words[words.index("via") + 1] if "via" in words else None


@needs_root
@pytest.mark.timeout(120)
def test_a_cut_link_loses_its_carrier_and_the_kernel_routes_around_it(tmp_path: Path) -> None:
    """set_link: the server's NIC reads no carrier, every namespace's kernel sends each address the way the plan's
    routes say (around the cut), a connection open across the cut carries its bytes, and mending puts it all back."""
    state = tmp_path / "state.json"
    with _bring_up("bcube:2,2", state) as plan:
        with pytest.raises(TestbedError, match="has no link to 'L9.sw0'; its links go to"):
            set_link(0, "L9.sw0", False, state_path=state)
        cut = set_link(0, "L0.sw0", False, state_path=state)
        assert cut.cut == ((0, 0),) and load_state(state).cut == ((0, 0),)
        carrier = subprocess.run(["ip", "netns", "exec", "gs-h0", "cat", "/sys/class/net/gs-nic0/carrier"],
                                 capture_output=True, text=True)
        assert carrier.stdout.strip() in ("0", "")  # no carrier (reading it may fail on a down link)
        for mend in (False, True):
            now = set_link(0, "L0.sw0", True, state_path=state) if mend else cut
            for src in now.servers:
                for dst in now.servers:
                    if dst.rank == src.rank:
                        continue
                    for target in dst.nics:
                        (nic, into), *_ = now.walk(src.rank, target.address)
                        via = None if into.address == target.address and not any(
                            r.dest == f"{target.address}/32" for r in now.routes(src.rank)) else into.address
                        assert _kernel_route(src.namespace, target.address) == (nic.ifname, via)
        assert load_state(state).cut == () and load_state(state).routes(1) == plan.routes(1)


@needs_root
@pytest.mark.timeout(60)
def test_down_cleans_up_after_a_crash_without_state(tmp_path: Path) -> None:
    """A crashed session leaves namespaces, veths and a worker behind; ``down`` finds them by name."""
    left = leftovers()
    if left["namespaces"] or left["links"]:
        pytest.skip(f"a gs- testbed is already up ({left})")
    state = tmp_path / "state.json"
    try:
        up("ring:3", "100mbit", state_path=state)
        worker = subprocess.Popen(["ip", "netns", "exec", "gs-h1", sys.executable, "-S", "-c", "import time; time.sleep(60)"])
        state.unlink()
        removed = down(state_path=state)
        assert sorted(removed["namespaces"]) == ["gs-h0", "gs-h1", "gs-h2"]
        assert str(worker.pid) in removed["killed"]
        assert worker.wait(timeout=10) != 0
        assert _no_gs_objects() == []
    finally:
        down(state_path=state)


def test_colocate_without_testbed_is_a_clear_error() -> None:
    from gradsync.ps.launch import PSJob

    with pytest.raises(GradsyncError, match="--colocate places servers on testbed hosts; add --testbed"):
        PSJob(workers=2, servers=1, colocate=True)


@needs_root
@pytest.mark.timeout(240)
def test_ps_launch_places_servers_and_workers_in_the_testbed(tmp_path: Path) -> None:
    """``gradsync launch --testbed``: 4 workers on hosts 0-3 and 2 servers on hosts 4-5 of ``switch:6``; each
    worker pushes rank+1, so every pull of every round is W(W+1)/2 = 10 (tests/workers/ps_worker.py's oracle). The
    servers listen on their hosts' testbed addresses and their NICs carry the replies (at least the pulled
    bytes), so the traffic crossed the emulated links. Too many processes for the hosts is a clear error."""
    from gradsync.ps.launch import PSJob, launch

    root = Path(__file__).resolve().parents[2]
    worker = [sys.executable, str(root / "tests" / "workers" / "ps_worker.py"), "oracle", "dist_sync"]
    state = tmp_path / "state.json"
    with _bring_up("switch:6", state) as plan:
        before = [_tx(plan.server(h).namespace, plan.server(h).ifname) for h in (4, 5)]
        out = io.StringIO()
        rc = launch(worker, PSJob(workers=4, servers=2, timeout_s=180, testbed=True, testbed_state=str(state)),
                    env={"PYTHONPATH": str(root)}, stream=out)
        text = out.getvalue()
        after = [_tx(plan.server(h).namespace, plan.server(h).ifname) for h in (4, 5)]
        with pytest.raises(GradsyncError, match=r"need 7 hosts; the testbed switch:6 has 6\. Add --colocate"):
            launch(worker, PSJob(workers=5, servers=2, testbed=True, testbed_state=str(state)))
    assert rc == 0, text[-3000:]
    assert sorted(ln.split("] ", 1)[1] for ln in text.splitlines() if " OK " in ln) == \
        [f"OK dist_sync rank {r} of 4" for r in range(4)], text[-3000:]
    for i, h in enumerate((4, 5)):
        assert f"[server {i}] gradsync-ps server {i} listening on tcp://{plan.server(h).address}:" in text, text[-3000:]
    pulled = 5 * 4 * (3000 * 4 + 7 * 8)  # 5 rounds, 4 workers, the sliced "w" and key 1, from both servers
    assert sum(a - b for a, b in zip(after, before)) >= pulled, (before, after)


@needs_root
@pytest.mark.timeout(120)
def test_a_testbed_from_a_file_keeps_its_path_so_its_cost_model_loads(tmp_path: Path) -> None:
    """A topology file names its topology inside it: the state keeps the file's path, so the probe's cost model
    (what the compression sweep prices with) loads the topology again; it failed on the name before."""
    from gradsync.testbed.control import load_state
    from gradsync.testbed.probe import cost_model

    spec = tmp_path / "pair.yaml"
    spec.write_text("name: my-pair\ndevices:\n  - {name: sw, kind: switch}\n  - {name: a, kind: host}\n"
                    "  - {name: b, kind: host}\nlinks:\n  - {a: a, b: sw, bandwidth_GBps: 1}\n"
                    "  - {a: b, b: sw, bandwidth_GBps: 1}\n")
    state = tmp_path / "state.json"
    with _bring_up(str(spec), state):
        plan = load_state(state)
        assert plan.topology == str(spec.resolve()), plan.topology
        model = cost_model(plan)
        assert model.link_GBps and model.burst_s > 0
