"""``gradsync testbed up|run|down|probe|status|link``: the emulated cluster (:mod:`gradsync.testbed`) on the command line.

Each handler returns the exit code; errors are :class:`~gradsync.testbed.errors.TestbedError` (a
``GradsyncError``), which the main CLI prints as one line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gradsync.testbed.errors import TestbedError
from gradsync.testbed.netns import DEFAULT_TCP_CC, TCP_CC

__all__ = ["add_parser", "cmd_testbed", "parse_pairs"]


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``0-1,2-3`` -> ``[(0, 1), (2, 3)]``."""
    out = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise TestbedError(f"cannot read pairs {text!r}; write SRC-DST pairs of ranks like 0-1,0-3")
        out.append((int(a), int(b)))
    return out


def _cmd_up(args: argparse.Namespace) -> int:
    from gradsync.testbed.control import resolve_state_path, up

    plan = up(args.topology, args.rate, args.delay, state_path=args.state, tcp_cc=args.tcp_cc,
              idle_restart=args.idle_restart)
    nics = sum(len(s.nics) for s in plan.servers)
    print(f"testbed {plan.topology}: {plan.world_size} servers, {len(plan.bridges)} bridges, {nics} NICs "
          f"at {plan.rate_mbit:g} Mbit/s" + (f", {plan.delay_ms:g} ms delay" if plan.delay_ms else "")
          + f", TCP {plan.tcp_cc}" + ("" if plan.idle_restart else ", no slow start after idle"))
    if plan.dropped:
        print(f"  {len(plan.dropped)} redundant switch links left out (STP is off; one L2 tree per domain)")
    for s in plan.servers:
        print(f"  rank {s.rank:<3} {s.device:<12} {s.namespace:<8} " + " ".join(f"{n.ifname}={n.address}" for n in s.nics))
    print(f"MASTER_ADDR={plan.master_addr}; state in {resolve_state_path(args.state)}")
    print("next: gradsync testbed probe | gradsync testbed run -- python train.py | gradsync testbed down")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from gradsync.launch import worker_command
    from gradsync.testbed.runner import run

    cmd = worker_command(args.cmd, "nothing to run: write 'gradsync testbed run -- python train.py'", TestbedError)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    return run(cmd, timeout=args.timeout, ranks=ranks, state_path=args.state)


def _cmd_down(args: argparse.Namespace) -> int:
    from gradsync.testbed.control import down

    removed = down(state_path=args.state, force=args.force)
    print(f"removed {len(removed['namespaces'])} namespaces and {len(removed['links'])} interfaces"
          + (f"; killed {len(removed['killed'])} leftover processes" if removed["killed"] else ""))
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    from gradsync.testbed.probe import probe

    pairs = parse_pairs(args.pairs) if args.pairs else None
    rows = probe(pairs, args.seconds, state_path=args.state, tolerance=args.tolerance, duplex=args.duplex)
    if args.json:
        print(json.dumps(rows, indent=1))
    if args.cost_model:
        from pathlib import Path

        from gradsync.testbed.control import load_state
        from gradsync.testbed.probe import cost_model

        good = [r for r in rows if r["ok"]]
        if len(good) < len(rows):
            print(f"warning: {len(rows) - len(good)} of {len(rows)} pairs missed the expected rate and are left out of "
                  f"the cost model" + ("" if good else "; it uses the TCP header arithmetic for the goodput instead"))
        from gradsync.topology.io import get_topology

        model = cost_model(load_state(args.state), good,
                           topology=get_topology(args.topology) if args.topology else None)
        try:
            Path(args.cost_model).write_text(json.dumps(model.to_dict(), indent=1) + "\n", encoding="utf-8")
        except OSError as exc:
            raise TestbedError(f"cannot write the cost model to {args.cost_model!r}: {exc}") from None
        print(f"cost model ({model.source}, goodput {model.goodput:.3f}, reverse share {model.reverse_share:.3f}) written to {args.cost_model}; "
              f"use it with GRADSYNC_COST_MODEL={args.cost_model} or gradsync.init(cost_model=...)")
    return 0 if all(r["ok"] for r in rows) else 1


def _cmd_status(args: argparse.Namespace) -> int:
    from gradsync.testbed.control import status

    info: dict[str, Any] = status(state_path=args.state)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    stray = info["leftovers"]["namespaces"] + info["leftovers"]["links"]
    if "topology" not in info:
        print(f"no testbed is up (no state file {info['state']})")
    else:
        print(f"testbed {info['topology']} ({'up' if info['up'] else 'BROKEN: namespaces missing'}), "
              f"{info['rate_mbit']:g} Mbit/s per unit link, TCP {info['tcp_cc']}"
              f"{'' if info['tcp_idle_restart'] else ' (no slow start after idle)'}, MASTER_ADDR={info['master_addr']}, "
              f"state {info['state']}")
        owner = info.get("owner")
        print(f"  owner: {owner['user']} (pid {owner['pid']}, started {owner['started']}, command {owner['command']!r})"
              if owner else "  owner: not recorded")
        procs = [(ns, p) for ns, ps in info.get("processes", {}).items() for p in ps]
        print(f"  running: {len(procs)} processes" if procs else "  running: nothing")
        for ns, p in procs:
            print(f"    {ns:<8} pid {p['pid']:<7} {p['command'][:100]}")
        for s in info["servers"]:
            nics = " ".join(f"{n['ifname']}={n['address']}" for n in s["nics"])
            print(f"  rank {s['rank']:<3} {s['namespace']:<8} {'ok ' if s['present'] else 'GONE'} {nics}")
    if stray:
        print(f"leftovers not in the state file: {' '.join(stray)}; remove with 'gradsync testbed down'")
    return 0


def _cmd_link(args: argparse.Namespace) -> int:
    from gradsync.testbed.control import set_link

    plan = set_link(args.rank, args.peer, args.state_ == "up", state_path=args.state)
    moved = sum(1 for s in plan.servers for r in plan.routes(s.rank) if r not in s.routes)
    print(f"link {plan.server(args.rank).device}-{args.peer} {args.state_}: "
          + (f"{len(plan.cut)} NIC(s) cut, {moved} routes go around them" if plan.cut else "every route as built"))
    return 0


def cmd_testbed(args: argparse.Namespace) -> int:
    """Dispatch ``gradsync testbed ACTION``."""
    return int(args.testbed_func(args))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``testbed`` (with ``up``, ``run``, ``down``, ``probe``, ``status``, ``link``) to the main CLI's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state", default=None, metavar="PATH",
                        help="state file (default $GRADSYNC_TESTBED or /run/gradsync-testbed/state.json)")
    tb = subparsers.add_parser(
        "testbed", help="emulate a cluster on this machine (namespaces, veth, bridges, tc); needs root",
        description="An emulated cluster: one network namespace per server, veth NICs, Linux bridges as switches, "
                    "tc shaping every NIC in both directions. Needs root and iproute2.",
    )
    tb.set_defaults(func=cmd_testbed)
    sub = tb.add_subparsers(dest="testbed_action", required=True, metavar="ACTION")

    u = sub.add_parser("up", parents=[common], help="build the emulated cluster for a topology")
    u.add_argument("--topology", "-t", required=True, help="switch:N, bcube:n,k, fattree:k, ring:n or a file")
    u.add_argument("--rate", "-r", default="200mbit", help="rate of a unit link per direction, tc syntax (200mbit)")
    u.add_argument("--delay", "-d", default=None, help="extra one-way delay per server egress (netem), e.g. 1ms")
    u.add_argument("--tcp-cc", default=DEFAULT_TCP_CC, choices=TCP_CC,
                   help="TCP congestion control on every route (default cubic, Linux's default, whatever this "
                        "host's own is; 'host' keeps the host's)")
    u.add_argument("--no-idle-restart", dest="idle_restart", action="store_false",
                   help="keep each connection's congestion window across idle gaps "
                        "(net.ipv4.tcp_slow_start_after_idle=0, as clusters tuned for training set it; "
                        "default: Linux's slow start again after an idle RTO)")
    u.set_defaults(testbed_func=_cmd_up)

    r = sub.add_parser("run", parents=[common], help="run a command once per server, torchrun-style")
    r.add_argument("--timeout", type=float, default=None, help="seconds before all workers are stopped (exit 124)")
    r.add_argument("--ranks", default=None, help="servers to use, e.g. 0,1 (default: all)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    r.set_defaults(testbed_func=_cmd_run)

    d = sub.add_parser("down", parents=[common], help="remove every gs- namespace, bridge and veth (idempotent)")
    d.add_argument("--force", action="store_true", help="remove it even when another user started it")
    d.set_defaults(testbed_func=_cmd_down)

    p = sub.add_parser("probe", parents=[common], help="measure the rate between pairs of servers")
    p.add_argument("--pairs", default=None, help="SRC-DST pairs, e.g. 0-1,0-3 (default: all, or a sample)")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds per pair")
    p.add_argument("--tolerance", type=float, default=0.15, help="allowed relative deviation from the expected rate")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--duplex", action="store_true",
                   help="also measure each pair loaded both ways at once (the cost model's reverse_share)")
    p.add_argument("--cost-model", default=None, metavar="FILE",
                   help="write the runtime's cost model (link rates of this testbed, measured goodput) as JSON")
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="with --cost-model: the topology file the testbed was built from (a built-in name is found "
                        "from the testbed's state)")
    p.set_defaults(testbed_func=_cmd_probe)

    s = sub.add_parser("status", parents=[common], help="show the testbed that is up")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(testbed_func=_cmd_status)

    lk = sub.add_parser("link", parents=[common],
                        help="cut or mend a server's link while the testbed runs (the routes go around a cut link)")
    lk.add_argument("state_", choices=("down", "up"), metavar="down|up", help="cut the link, or mend it")
    lk.add_argument("--rank", type=int, required=True, help="the server")
    lk.add_argument("--peer", required=True, help="the topology device at the link's other end, e.g. L0.sw0")
    lk.set_defaults(testbed_func=_cmd_link)
    return tb
