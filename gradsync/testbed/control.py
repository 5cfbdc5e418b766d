"""Bring the emulated cluster up and down, and keep the state file that says what was made.

``up`` builds the plan of :mod:`gradsync.testbed.build` with ``ip``/``tc``; on any failure it tears down
what it made. ``down`` does not trust the state file: it removes every namespace and root-namespace
interface named with the ``gs-`` prefix, so it also cleans up after a crash, and it is idempotent.

Owners (issue 42): ``up`` records who started the testbed (user, pid, time, command) in the state file;
``down`` refuses a testbed another user started unless forced, so one user's ``down`` does not kill another's
measurement. Leftovers with no state file have no owner and are removed as before (crash cleanup).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import pwd
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from gradsync.testbed import netns
from gradsync.testbed.build import TestbedPlan, build_plan, parse_rate
from gradsync.testbed.errors import TestbedError
from gradsync.testbed.netns import DEFAULT_TCP_CC
from gradsync.topology.io import get_topology
from gradsync.topology.model import Topology

__all__ = ["DEFAULT_STATE_PATH", "STATE_ENV", "current_user", "load_owner", "owner_record", "resolve_state_path",
           "load_state", "set_link", "set_server_rate", "tbf_burst", "up", "down", "status"]

#: Where the state file goes unless a path or ``$GRADSYNC_TESTBED`` says otherwise (/run is tmpfs: a reboot,
#: which also removes every namespace, removes the state too).
DEFAULT_STATE_PATH = Path("/run/gradsync-testbed/state.json")
#: Environment variable naming the state file; ``run`` sets it for every worker so programs find the testbed.
STATE_ENV = "GRADSYNC_TESTBED"
#: tbf queue: how long a packet may wait for tokens (bounds the queue, so latency stays small).
_TBF_LATENCY = "25ms"


def tbf_burst(rate_mbit: float) -> int:
    """Bytes of tokens every shaped interface holds at ``rate_mbit``: at least 10 MTU frames and 4 ms of its
    rate (so a timer tick at HZ=250 never starves it). The cost model gives the same bucket
    (``CostModel.burst_s``, :func:`gradsync.testbed.probe.cost_model`)."""
    return max(15140, int(rate_mbit * 1e6 / 8 * 0.004))


def resolve_state_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The state file: ``path``, else ``$GRADSYNC_TESTBED``, else :data:`DEFAULT_STATE_PATH`."""
    if path:
        return Path(path)
    env = os.environ.get(STATE_ENV)
    return Path(env) if env else DEFAULT_STATE_PATH


def load_state(path: str | os.PathLike[str] | None = None) -> TestbedPlan:
    """The plan of the testbed that is up, read from its state file."""
    p = resolve_state_path(path)
    if not p.is_file():
        raise TestbedError(f"no testbed is up (no state file {p}); start one with "
                           f"'gradsync testbed up --topology switch:3 --rate 200mbit'")
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TestbedError(f"cannot read testbed state {p}: {exc}; run 'gradsync testbed down' and start again") from None
    return TestbedPlan.from_dict(data)


def current_user() -> str:
    """Who is asking: the user behind ``sudo`` where there is one (everyone is root under sudo), else the uid's name."""
    sudo = os.environ.get("SUDO_USER", "").strip()
    if sudo:
        return sudo
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return f"uid {os.getuid()}"


def owner_record(command: str | None = None) -> dict[str, Any]:
    """What ``up`` stores about who started the testbed."""
    return {"user": current_user(), "uid": os.getuid(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command or " ".join(sys.argv)}


def load_owner(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The owner recorded in the state file, or None (no state file, unreadable, or written before owners)."""
    p = resolve_state_path(path)
    try:
        owner = json.loads(p.read_text()).get("owner")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("user"), str) else None


def _describe(owner: dict[str, Any]) -> str:
    return (f"{owner['user']} (pid {owner.get('pid', '?')}, started {owner.get('started', '?')}, "
            f"command {owner.get('command', '?')!r})")


def _tbf(rate_mbit: float) -> tuple[str, ...]:
    """``tc qdisc`` arguments after the device: the root token-bucket shaper at ``rate_mbit``."""
    return ("root", "handle", "1:", "tbf", "rate", f"{max(1, round(rate_mbit * 1000))}kbit", "burst",
            str(tbf_burst(rate_mbit)), "latency", _TBF_LATENCY)


def _shape(ifname: str, rate_mbit: float, delay_ms: float | None = None, ns: str | None = None) -> None:
    """Egress shaping on one interface: tbf at the rate, optionally netem delay inside it."""
    netns.tc("qdisc", "replace", "dev", ifname, *_tbf(rate_mbit), ns=ns)
    if delay_ms:
        netns.tc("qdisc", "add", "dev", ifname, "parent", "1:1", "handle", "10:", "netem", "delay",
                 f"{delay_ms * 1000:.0f}us", ns=ns)


def set_server_rate(rank: int, rate: str | float | None, *,
                    state_path: str | os.PathLike[str] | None = None) -> float:
    """Change server ``rank``'s NICs to ``rate`` in both directions while the testbed runs (None: back to the
    rate the testbed was built with): a NIC renegotiating down, or back up. Only the shaper's rate and burst
    change (``tc qdisc change``): connections, routes and any netem delay stay. Returns the rate in Mbit/s."""
    server = load_state(state_path).server(rank)
    mbit = 0.0
    for nic in server.nics:
        mbit = nic.rate_mbit if rate is None else parse_rate(rate)
        netns.tc("qdisc", "change", "dev", nic.host_ifname, *_tbf(mbit))  # switch -> server
        netns.tc("qdisc", "change", "dev", nic.ifname, *_tbf(mbit), ns=server.namespace)  # server -> switch
    return mbit


def set_link(rank: int, peer: str, up: bool, *, state_path: str | os.PathLike[str] | None = None) -> TestbedPlan:
    """Cut (``up=False``) or mend the link between server ``rank`` and topology device ``peer`` (its switch, or the
    server at the other end of a direct cable) while the testbed runs: a failed cable or switch port. The
    switch-side end of the NIC's veth goes down, so the server's NIC loses its carrier (what a host sees of a dead
    link: ``/sys/class/net/<nic>/carrier`` reads 0) and the link carries nothing; then every server's routes that
    crossed it go around it (:attr:`TestbedPlan.cut`, :meth:`TestbedPlan.routes`), as a fabric's routing converges.
    Connections stay open: their packets take the new paths after a retransmission. Mending puts the link and the
    routes back. Returns the plan as it is now (also written to the state file)."""
    path = resolve_state_path(state_path)
    plan = load_state(path)
    server = plan.server(rank)
    ends = [nic for nic in server.nics if nic.peer == peer]
    if not ends:
        raise TestbedError(f"server {rank} ({server.device}) has no link to {peer!r}; its links go to "
                           f"{[nic.peer for nic in server.nics]}")
    nic = ends[0]
    # a direct cable has the other server's NIC on the same 2-port bridge: a cut cable is dead at both ends
    mine = [nic] + [x for s in plan.servers if s.device == peer for x in s.nics if x.bridge == nic.bridge]
    keys = {(x.rank, x.index) for x in mine}
    cut = sorted(set(plan.cut) - keys) if up else sorted(set(plan.cut) | keys)
    after = dataclasses.replace(plan, cut=tuple(cut))  # raises, before anything changes, if nothing routes around it
    for x in mine:  # the link first, then the routes: a cut the fabric's routing reacts to, a mend it then uses
        netns.ip("link", "set", x.host_ifname, "up" if up else "down")
    cc = () if plan.tcp_cc == "host" else ("congctl", plan.tcp_cc)
    for s in plan.servers:
        old = {r.dest: r for r in plan.routes(s.rank)}
        new = {r.dest: r for r in after.routes(s.rank)}
        for dest, r in new.items():
            if old.get(dest) != r:
                netns.ip("route", "replace", r.dest, "via", r.via, "dev", r.dev, *cc, ns=s.namespace)
        for dest in old.keys() - new.keys():
            netns.ip("route", "del", dest, ns=s.namespace, check=False)
    raw = json.loads(path.read_text())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**after.to_dict(), "owner": raw.get("owner")}, indent=1) + "\n")
    tmp.replace(path)
    return after


def _sysctls(forwarding: bool, idle_restart: bool = True) -> dict[str, str]:
    base = "/proc/sys/net"
    return {
        f"{base}/ipv4/ip_forward": "1" if forwarding else "0",
        # Per namespace: written either way, so the plan says what the kernel does (not the host's value).
        f"{base}/ipv4/tcp_slow_start_after_idle": "1" if idle_restart else "0",
        # Relayed replies may arrive on another NIC than the one the route to their source uses.
        f"{base}/ipv4/conf/all/rp_filter": "0",
        f"{base}/ipv4/conf/default/rp_filter": "0",
        # No IPv6 chatter (router solicitations, DAD) on the emulated links: counters show only our traffic.
        f"?{base}/ipv6/conf/all/disable_ipv6": "1",
        f"?{base}/ipv6/conf/default/disable_ipv6": "1",
    }


def _build(plan: TestbedPlan) -> None:
    for s in plan.servers:
        try:
            netns.ip("netns", "add", s.namespace)
        except TestbedError as exc:
            raise TestbedError(f"cannot create network namespace {s.namespace}: {exc}") from None
        netns.write_sysctls(s.namespace, _sysctls(s.forwarding, plan.idle_restart))
        netns.ip("link", "set", "lo", "up", ns=s.namespace)
    for b in plan.bridges:
        netns.ip("link", "add", "name", b.name, "type", "bridge", "stp_state", "0")
        netns.ip("link", "set", b.name, "addrgenmode", "none", "up")
    for t in plan.trunks:
        netns.ip("link", "add", t.a_ifname, "type", "veth", "peer", "name", t.b_ifname)
        for end, br in ((t.a_ifname, t.a), (t.b_ifname, t.b)):
            netns.ip("link", "set", end, "master", br, "addrgenmode", "none", "up")
            _shape(end, t.rate_mbit)
    for s in plan.servers:
        for nic in s.nics:
            netns.ip("link", "add", nic.host_ifname, "type", "veth", "peer", "name", nic.ifname, "netns", s.namespace)
            netns.ip("link", "set", nic.host_ifname, "master", nic.bridge, "addrgenmode", "none", "up")
            netns.ip("addr", "add", nic.cidr, "dev", nic.ifname, ns=s.namespace)
            netns.ip("link", "set", nic.ifname, "up", ns=s.namespace)
            _shape(nic.host_ifname, nic.rate_mbit)  # bridge -> server
            _shape(nic.ifname, nic.rate_mbit, plan.delay_ms, ns=s.namespace)  # server -> bridge
    cc = () if plan.tcp_cc == "host" else ("congctl", plan.tcp_cc)
    for s in plan.servers:
        for nic in s.nics:  # the kernel's route to the NIC's own subnet, again with the congestion control
            if cc:
                subnet = str(ipaddress.ip_interface(nic.cidr).network)
                netns.ip("route", "replace", subnet, "dev", nic.ifname, "proto", "kernel", "scope", "link", "src",
                         nic.address, *cc, ns=s.namespace)
        for r in s.routes:
            netns.ip("route", "add", r.dest, "via", r.via, "dev", r.dev, *cc, ns=s.namespace)


def up(topology: str | Topology, rate: str | float = "200mbit", delay: str | float | None = None, *,
       state_path: str | os.PathLike[str] | None = None, tcp_cc: str = DEFAULT_TCP_CC,
       idle_restart: bool = True, command: str | None = None) -> TestbedPlan:
    """Build the emulated cluster for ``topology`` (spec or object) and write its state file.

    ``rate`` is each unit link's rate in each direction (tc syntax: ``200mbit``); ``delay`` adds netem delay
    on every server's egress; ``tcp_cc`` is the TCP congestion control of every route (a route attribute, so
    the host's own default is left alone; ``"host"`` keeps that default: see :data:`TCP_CC`);
    ``idle_restart=False`` keeps a connection's congestion window across idle gaps (a cluster tuned for
    training: ``net.ipv4.tcp_slow_start_after_idle=0``; Linux restarts slow start after an idle RTO).
    Refuses to run over leftovers of another testbed. The state records the owner (:func:`owner_record`;
    ``command`` defaults to this process's argv).
    """
    netns.require()
    topo = get_topology(topology)
    plan = build_plan(topo, rate, delay, tcp_cc=tcp_cc, idle_restart=idle_restart)
    if isinstance(topology, str) and Path(topology).is_file():
        # a file's topology is named inside it: keep the path, so the state (and ``probe.cost_model``) can
        # load the topology again
        plan = dataclasses.replace(plan, topology=str(Path(topology).resolve()))
    left = netns.leftovers(plan.prefix)
    if left["namespaces"] or left["links"]:
        found = ", ".join(left["namespaces"] + left["links"])
        raise TestbedError(f"a testbed (or its leftovers) is already up: {found}; run 'gradsync testbed down' first")
    path = resolve_state_path(state_path)
    try:
        _build(plan)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**plan.to_dict(), "owner": owner_record(command)}, indent=1) + "\n")
        tmp.replace(path)
    except BaseException:
        down(state_path=path, force=True)
        raise
    return plan


def down(*, state_path: str | os.PathLike[str] | None = None, wait_s: float = 10.0,
         force: bool = False) -> dict[str, list[str]]:
    """Remove every ``gs-`` namespace and interface (and kill processes left inside); idempotent.

    Refused when the state file names another user as the owner, unless ``force``.
    Returns what was removed. Waits until the kernel has really released the interfaces, so a following
    ``up`` does not trip over them.
    """
    if os.geteuid() != 0:
        raise TestbedError("removing the testbed needs root: run 'sudo gradsync testbed down'")
    if shutil.which("ip") is None:
        raise TestbedError("'ip' not found on PATH; install iproute2: apt-get install -y iproute2")
    owner = load_owner(state_path)
    if owner is not None and owner["user"] != current_user() and not force:
        raise TestbedError(f"the testbed up is owned by {_describe(owner)}, not {current_user()}; its processes "
                           f"would be killed: ask them, or remove it anyway with 'gradsync testbed down --force'")
    prefix = netns.PREFIX
    removed: dict[str, list[str]] = {"namespaces": [], "links": [], "killed": []}
    for ns in netns.list_netns(prefix):
        removed["killed"] += [str(p) for p in netns.kill_netns_pids(ns)]
        netns.ip("netns", "del", ns, check=False)
        removed["namespaces"].append(ns)
    deadline = time.monotonic() + wait_s
    while True:
        links = netns.list_links(prefix)
        namespaces = netns.list_netns(prefix)
        if not links and not namespaces:
            break
        for ns in namespaces:
            netns.ip("netns", "del", ns, check=False)
        # Bridges last would leave enslaved veths dangling for a moment; order does not matter to the kernel.
        for link in links:
            if netns.ip("link", "del", link, check=False).returncode == 0 and link not in removed["links"]:
                removed["links"].append(link)
        if time.monotonic() > deadline:
            rest = netns.list_links(prefix) + netns.list_netns(prefix)
            if rest:
                raise TestbedError(f"could not remove {rest} within {wait_s:g} s; processes may still hold them "
                                   f"(see 'ip netns pids'); run 'gradsync testbed down' again")
            break
        time.sleep(0.05)
    p = resolve_state_path(state_path)
    try:
        p.unlink()
    except FileNotFoundError:
        pass
    return removed


def _processes(ns: str) -> list[dict[str, Any]]:
    """What runs in namespace ``ns``: pid and command line of each process."""
    out = []
    for pid in netns.netns_pids(ns):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended since it was listed
            continue
        out.append({"pid": pid, "command": " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)})
    return out


def status(*, state_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What is up: the state file's plan plus whether each namespace still exists, and any strays."""
    p = resolve_state_path(state_path)
    left = netns.leftovers() if os.geteuid() == 0 else {"namespaces": [], "links": []}
    if not p.is_file():
        return {"up": False, "state": str(p), "leftovers": left}
    plan = load_state(p)
    present = set(left["namespaces"])
    return {
        "up": all(ns in present for ns in plan.namespaces),
        "state": str(p),
        "owner": load_owner(p),
        "processes": {ns: _processes(ns) for ns in plan.namespaces if ns in present},
        "topology": plan.topology,
        "rate_mbit": plan.rate_mbit,
        "delay_ms": plan.delay_ms,
        "tcp_cc": plan.tcp_cc,
        "tcp_idle_restart": plan.idle_restart,
        "master_addr": plan.master_addr,
        "servers": [
            {"rank": s.rank, "device": s.device, "namespace": s.namespace, "address": s.address,
             "present": s.namespace in present,
             "nics": [{"ifname": n.ifname, "address": n.address, "bridge": n.bridge, "peer": n.peer,
                       "rate_mbit": n.rate_mbit} for n in s.nics]}
            for s in plan.servers
        ],
        "bridges": len(plan.bridges),
        "trunks": len(plan.trunks),
        "dropped_links": [list(d) for d in plan.dropped],
        "leftovers": {k: [x for x in v if x not in set(plan.namespaces) | set(plan.interface_names())]
                      for k, v in left.items()},
    }
