"""Thin wrappers over ``ip`` and ``tc``: every failure names the command, its stderr and a fix.

Everything the testbed makes is named with :data:`PREFIX`, so :func:`leftovers` can find it after a crash
without the state file, and nothing else on the host is ever touched.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

from gradsync.testbed.errors import TestbedError

__all__ = [
    "PREFIX",
    "available",
    "require",
    "sh",
    "ip",
    "tc",
    "ns_exec",
    "list_netns",
    "list_links",
    "leftovers",
    "netns_pids",
    "kill_netns_pids",
    "write_sysctls",
    "counters",
]

#: Prefix of every namespace and interface the testbed creates (never anything else).
PREFIX = "gs-"
#: TCP congestion control the testbed's routes may name (``congctl``), and ``host``: no choice (the host's
#: default). ``cubic``, Linux's default, is the testbed's: results must not depend on how the host happens to
#: be tuned, and BBR (v1) leaves a tbf-shaped port that two flows share partly idle (measured on bcube:3,2:
#: BML's exchange, each NIC sending to and receiving from two peers, was slower under BBR than under cubic,
#: while gloo's ring, one flow per NIC, took the same time under both).
TCP_CC = ("cubic", "reno", "bbr", "host")
#: the testbed's choice unless told otherwise
DEFAULT_TCP_CC = TCP_CC[0]

_HINTS = (
    ("Operation not permitted", "run as root (or with CAP_NET_ADMIN and CAP_SYS_ADMIN), e.g. with sudo"),
    ("Permission denied", "run as root (or with CAP_NET_ADMIN and CAP_SYS_ADMIN), e.g. with sudo"),
    ("qdisc kind is unknown", "the kernel lacks this queueing discipline: modprobe sch_tbf / sch_netem "
                              "(package linux-modules-extra-$(uname -r)), or run without --delay"),
    ("Unknown device type", "the kernel lacks veth or bridge support: modprobe veth bridge"),
    ("File exists", "a testbed object is left over: run 'gradsync testbed down' first"),
)


def _hint(stderr: str) -> str:
    for needle, hint in _HINTS:
        if needle in stderr:
            return f"; {hint}"
    return ""


def sh(argv: Sequence[str], *, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one command (a list, never a shell) and raise :class:`TestbedError` with its stderr on failure."""
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (FileNotFoundError, PermissionError) as exc:
        raise TestbedError(
            f"cannot run {argv[0]!r} ({exc.strerror}) for: {shlex.join(argv)}; the testbed needs root and iproute2 "
            f"(apt-get install -y iproute2)"
        ) from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"command timed out after {timeout:g} s: {shlex.join(argv)}") from None
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()
        raise TestbedError(f"command failed (exit {proc.returncode}): {shlex.join(argv)}: {err}{_hint(err)}")
    return proc


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip [-n NS] ARGS``: ``-n`` switches namespace without ``ip netns exec``'s remount, so it is cheap."""
    return sh(["ip", *(["-n", ns] if ns else []), *args], check=check)


def tc(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``tc [-n NS] ARGS``."""
    return sh(["tc", *(["-n", ns] if ns else []), *args], check=check)


def ns_exec(ns: str, argv: Sequence[str]) -> list[str]:
    """The argv that runs ``argv`` inside namespace ``ns`` (``/sys`` then shows the namespace's interfaces)."""
    return ["ip", "netns", "exec", ns, *argv]


def list_netns(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix``."""
    out = ip("netns", "list").stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def list_links(prefix: str = PREFIX, kind: str | None = None) -> list[str]:
    """Interfaces of the root namespace whose name starts with ``prefix`` (optionally of one ``kind``)."""
    args = ["-j", "link", "show"] + (["type", kind] if kind else [])
    data = json.loads(ip(*args).stdout or "[]")
    return sorted(d["ifname"] for d in data if d.get("ifname", "").startswith(prefix))


def leftovers(prefix: str = PREFIX) -> dict[str, list[str]]:
    """What a previous testbed left behind (found by name, so also after a crash)."""
    return {"namespaces": list_netns(prefix), "links": list_links(prefix)}


def netns_pids(ns: str) -> list[int]:
    """Processes running inside ``ns`` (they keep it alive after ``ip netns del``)."""
    out = ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_netns_pids(ns: str) -> list[int]:
    """SIGKILL the processes inside one of the testbed's namespaces (leftover workers after a crash)."""
    pids = netns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


_SYSCTL_SCRIPT = """
import sys
for item in sys.argv[1:]:
    path, _, value = item.partition("=")
    optional = path.startswith("?")
    path = path.lstrip("?")
    try:
        with open(path, "w") as f:
            f.write(value)
    except FileNotFoundError:
        if not optional:
            raise
"""


def write_sysctls(ns: str, values: dict[str, str]) -> None:
    """Set per-namespace sysctls (``/proc/sys/net`` is per namespace); keys starting with ``?`` may be absent.

    Written by a tiny Python inside the namespace, so the ``sysctl`` binary (procps) is not needed.
    """
    items = [f"{k}={v}" for k, v in values.items()]
    sh(ns_exec(ns, [sys.executable, "-S", "-c", _SYSCTL_SCRIPT, *items]))


def counters(ns: str, ifname: str) -> dict[str, int]:
    """``rx_bytes``/``tx_bytes``/packets of one interface inside ``ns`` (from ``ip -s -j link``)."""
    data = json.loads(ip("-s", "-j", "link", "show", "dev", ifname, ns=ns).stdout)
    stats = data[0]["stats64"]
    return {
        "rx_bytes": int(stats["rx"]["bytes"]),
        "tx_bytes": int(stats["tx"]["bytes"]),
        "rx_packets": int(stats["rx"]["packets"]),
        "tx_packets": int(stats["tx"]["packets"]),
    }


def require() -> None:
    """Raise :class:`TestbedError` saying what is missing (root, ``ip``, ``tc``, namespace support)."""
    reason = available()
    if reason:
        raise TestbedError(reason)


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` when this machine can host a testbed, else the reason (tests skip with it).

    Checks root, the ``ip``/``tc`` binaries, and makes (and removes) one namespace, one bridge and a shaped
    veth, since being root in a container without CAP_NET_ADMIN/CAP_SYS_ADMIN is not enough.
    """
    if sys.platform != "linux":
        return f"the testbed needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, veth, tc): run as root, e.g. with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} not found on PATH; install iproute2: apt-get install -y iproute2"
    tag = f"{os.getpid() % 100000}"
    ns, br, veth = f"{PREFIX}chk{tag}", f"{PREFIX}cb{tag}", f"{PREFIX}cv{tag}"
    try:
        ip("netns", "add", ns)
        ip("link", "add", br, "type", "bridge")
        ip("link", "add", veth, "type", "veth", "peer", "name", "gs-nic0", "netns", ns)
        tc("qdisc", "replace", "dev", veth, "root", "tbf", "rate", "100mbit", "burst", "32kb", "latency", "25ms")
    except TestbedError as exc:
        return f"cannot build a testbed here: {exc}"
    finally:
        for args in (("link", "del", veth), ("link", "del", br), ("netns", "del", ns)):
            ip(*args, check=False)
    return None
