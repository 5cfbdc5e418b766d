"""Measure what the emulated links really carry: one TCP stream per pair of servers, one pair at a time.

A stdlib-only receiver (``_probe_worker.py``) listens in the destination namespace on a kernel-chosen
port and a sender in the source namespace pushes data for ``seconds``; the receiver's rate is bytes over
the time from first to last byte. Expected is the bottleneck of the planned path (the NIC rate on a
single switch; relays and trunks on the way count too). TCP goodput is ~95% of the shaped line rate
(Ethernet, IP and TCP headers are shaped but not delivered), well inside the default 15% tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gradsync.testbed import netns
from gradsync.testbed.build import TestbedPlan, sample_pairs
from gradsync.testbed.control import load_state, tbf_burst
from gradsync.testbed.errors import TestbedError

if TYPE_CHECKING:
    from gradsync.sim.cost import CostModel
    from gradsync.topology.model import Topology

__all__ = ["probe", "probe_pair", "probe_duplex", "format_table", "cost_model", "DEFAULT_TOLERANCE", "MAX_PAIRS", "TCP_GOODPUT"]

#: Allowed relative deviation of the measured rate from the expected one.
DEFAULT_TOLERANCE = 0.15
#: Pairs measured by default; larger testbeds get a fixed sample (see :func:`~gradsync.testbed.build.sample_pairs`).
MAX_PAIRS = 16
_WORKER = str(Path(__file__).with_name("_probe_worker.py"))
#: TCP payload per shaped byte at MTU 1500 with timestamps: 1448 of every 1514 bytes on the wire.
TCP_GOODPUT = 1448 / 1514


def cost_model(plan: TestbedPlan, rows: Sequence[dict[str, Any]] = (), *, topology: Topology | None = None,
               **fields: Any) -> CostModel:
    """The runtime's :class:`~gradsync.sim.cost.CostModel` for this testbed: every link class at its shaped
    rate, and the goodput share the probe measured (the median of ``rows``' measured/expected, capped at 1;
    :data:`TCP_GOODPUT` without rows), and the median ``reverse_share`` of rows probed both ways
    (``probe(duplex=True)``; 0 without), and the shaper's token bucket (``burst_s``: :func:`tbf_burst` at the
    slowest class's rate, in seconds of that rate). ``fields`` set the rest (``message_s``...). ``topology``: the
    one the testbed was built from, where its name alone does not find it (a file).

    Rows that measured nothing (a probe that failed) are left out with the others' median; when none is
    usable the header arithmetic is used, so a bad probe never yields a model that cannot run.
    """
    import statistics

    from gradsync.sim.cost import CostModel
    from gradsync.topology.io import get_topology

    if topology is None:
        from gradsync.errors import TopologyError

        try:
            topology = get_topology(plan.topology)
        except TopologyError:
            raise TestbedError(f"the testbed was built from topology {plan.topology!r}, which is no built-in name: give "
                               f"the file it was built from (`gradsync testbed probe --cost-model FILE --topology "
                               f"TOPOLOGY_FILE`, or cost_model(..., topology=...))") from None
    unit = float(topology.unit_bandwidth_GBps or 1.0)
    rates: dict[str, float] = {}
    for lk in topology.links:
        rate = plan.rate_mbit * lk.bandwidth_GBps / unit / 8e3  # GB/s
        rates[lk.kind] = min(rates.get(lk.kind, rate), rate)
    shares = [float(r["measured_mbit"]) / float(r["expected_mbit"]) for r in rows
              if float(r.get("measured_mbit") or 0) > 0 and float(r.get("expected_mbit") or 0) > 0]
    goodput = min(1.0, statistics.median(shares)) if shares else TCP_GOODPUT
    source = f"probe of testbed {plan.topology} at {plan.rate_mbit:g} Mbit/s ({len(shares)} pairs)" if shares \
        else f"testbed {plan.topology} at {plan.rate_mbit:g} Mbit/s (goodput from TCP headers)"
    kappas = [float(r["reverse_share"]) for r in rows if isinstance(r.get("reverse_share"), (int, float))
              and 0 <= float(r["reverse_share"]) < 1]
    slowest = min(rates.values()) * 8e3  # Mbit/s
    extra: dict[str, Any] = {"burst_s": tbf_burst(slowest) / (slowest * 1e6 / 8)}
    if kappas:
        extra["reverse_share"] = statistics.median(kappas)
        source += f", both ways {1 / (1 + extra['reverse_share']):.3f} of one way"
    return CostModel(**{"link_GBps": rates, "goodput": goodput, "source": source, **extra, **fields})


def _receiver(plan: TestbedPlan, dst: int) -> tuple[subprocess.Popen[str], str]:
    """A probe receiver listening in ``dst``'s namespace, and its port."""
    target = plan.server(dst).address
    recv = subprocess.Popen(netns.ns_exec(plan.server(dst).namespace, [sys.executable, "-S", _WORKER, "recv", target]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert recv.stdout is not None
    first = recv.stdout.readline().split()
    if len(first) != 2 or first[0] != "PORT":
        recv.kill()
        err = recv.communicate()[1]
        raise TestbedError(f"probe receiver in {plan.server(dst).namespace} did not start: {' '.join(first)} {err}")
    return recv, first[1]


def _streams(plan: TestbedPlan, pairs: Sequence[tuple[int, int]], seconds: float) -> list[dict[str, Any]]:
    """Run one stream per ``(src, dst)`` in ``pairs`` at the same time; each one's receiver measurement."""
    recvs: list[subprocess.Popen[str]] = []
    sends: list[subprocess.Popen[str]] = []
    try:
        ports = []
        for _, dst in pairs:
            proc, port = _receiver(plan, dst)
            recvs.append(proc)
            ports.append(port)
        for (src, dst), port in zip(pairs, ports):
            cmd = [sys.executable, "-S", _WORKER, "send", plan.server(dst).address, port, f"{seconds:g}"]
            sends.append(subprocess.Popen(netns.ns_exec(plan.server(src).namespace, cmd),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        out = []
        for (src, dst), send, recv in zip(pairs, sends, recvs):
            _, err = send.communicate(timeout=seconds + 30)
            if send.returncode != 0:
                raise TestbedError(f"probe sender rank {src} -> rank {dst} ({plan.server(dst).address}) failed: "
                                   f"{err.strip()}")
            got, err = recv.communicate(timeout=30)
            if recv.returncode != 0:
                raise TestbedError(f"probe receiver rank {dst} failed: {err.strip()}")
            out.append(dict(json.loads(got.strip().splitlines()[-1])))
        return out
    except subprocess.TimeoutExpired:
        raise TestbedError(f"probe of {list(pairs)} timed out; are the routes and namespaces intact?") from None
    finally:
        for proc in recvs + sends:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def probe_pair(plan: TestbedPlan, src: int, dst: int, seconds: float = 1.0) -> dict[str, Any]:
    """Send from ``src`` to ``dst``'s primary address for ``seconds``; returns bytes, seconds and Mbit/s."""
    return _streams(plan, [(src, dst)], seconds)[0]


def probe_duplex(plan: TestbedPlan, a: int, b: int, seconds: float = 1.0) -> dict[str, Any]:
    """Streams ``a -> b`` and ``b -> a`` at once: the rate each way when the path is loaded both ways.

    Returns ``mbit`` (the mean of the two directions), ``mbit_ab`` and ``mbit_ba``. Against a lone
    stream's rate this gives the cost model's ``reverse_share`` κ = lone / duplex - 1: the share of a
    stream's rate its acknowledgements take on the opposite direction (:func:`cost_model`).
    """
    ab, ba = _streams(plan, [(a, b), (b, a)], seconds)
    return {"mbit": (float(ab["mbit"]) + float(ba["mbit"])) / 2, "mbit_ab": float(ab["mbit"]),
            "mbit_ba": float(ba["mbit"])}


def probe(pairs: Iterable[tuple[int, int]] | None = None, seconds: float = 1.0, *,
          state_path: str | os.PathLike[str] | None = None, tolerance: float = DEFAULT_TOLERANCE,
          stream: TextIO | None = None, max_pairs: int = MAX_PAIRS, attempts: int = 3,
          duplex: bool = False) -> list[dict[str, Any]]:
    """Measure each pair ``(src, dst)`` (default: every pair, or a sample of ``max_pairs``) and print a table.

    A pair that misses ``tolerance`` is measured again, up to ``attempts`` times, and its best rate is kept:
    the probe asks what the emulated link can carry, and on a shared machine one second of TCP can lose much
    of its rate to CPU stalls in the Python sender or receiver while the host is busy.

    Each row: ``src``, ``dst``, ``path`` (ranks crossed), ``measured_mbit``, ``expected_mbit``, ``ok``
    (within ``tolerance``), ``bytes``, ``seconds``, ``attempts``. With ``duplex`` each pair is also measured
    loaded both ways (:func:`probe_duplex`, best of ``attempts``): ``duplex_mbit`` (each way) and
    ``reverse_share`` = ``measured_mbit / duplex_mbit - 1`` (at least 0), what :func:`cost_model` uses.
    """
    if seconds <= 0:
        raise TestbedError(f"probe seconds must be positive, got {seconds!r}")
    if attempts < 1:
        raise TestbedError(f"probe attempts must be >= 1, got {attempts!r}")
    netns.require()
    plan = load_state(state_path)
    todo = sample_pairs(plan, max_pairs) if pairs is None else [(int(a), int(b)) for a, b in pairs]
    for src, dst in todo:  # check every pair before spending seconds on the first
        plan.server(src), plan.server(dst)
        if src == dst:
            raise TestbedError(f"probe pair ({src}, {dst}) names one server twice")
    rows: list[dict[str, Any]] = []
    for src, dst in todo:
        expected = plan.expected_mbit(src, dst)
        best: dict[str, Any] | None = None
        tries = 0
        while tries < attempts:
            tries += 1
            got = probe_pair(plan, src, dst, seconds)
            if best is None or float(got["mbit"]) > float(best["mbit"]):
                best = got
            if abs(float(best["mbit"]) - expected) <= tolerance * expected:
                break
        assert best is not None
        measured = float(best["mbit"])
        rows.append({
            "src": src, "dst": dst, "path": plan.path(src, dst), "measured_mbit": round(measured, 2),
            "expected_mbit": round(expected, 2), "ok": abs(measured - expected) <= tolerance * expected,
            "bytes": int(best["bytes"]), "seconds": round(float(best["seconds"]), 3), "attempts": tries,
        })
        if duplex:
            both = max((probe_duplex(plan, src, dst, seconds) for _ in range(attempts)), key=lambda d: d["mbit"])
            rows[-1]["duplex_mbit"] = round(both["mbit"], 2)
            rows[-1]["reverse_share"] = round(max(0.0, measured / both["mbit"] - 1.0), 4) if both["mbit"] > 0 else None
    print(format_table(rows, tolerance), file=stream or sys.stdout, flush=True)
    return rows


def format_table(rows: Sequence[dict[str, Any]], tolerance: float = DEFAULT_TOLERANCE) -> str:
    """The human-readable table ``probe`` prints."""
    duplex = any("duplex_mbit" in r for r in rows)
    lines = [f"{'src':>4} {'dst':>4} {'path':<16} {'measured':>10} {'expected':>10}  ok (±{tolerance:.0%})"
             + ("  both ways   κ" if duplex else "")]
    for r in rows:
        path = "-".join(map(str, r["path"]))
        line = (f"{r['src']:>4} {r['dst']:>4} {path:<16} {r['measured_mbit']:>6.1f} Mb/s "
                f"{r['expected_mbit']:>6.1f} Mb/s  {'yes' if r['ok'] else 'NO '}")
        if r.get("duplex_mbit") is not None:
            line += f"  {r['duplex_mbit']:>6.1f} Mb/s {r['reverse_share'] or 0:.3f}"
        lines.append(line)
    bad = sum(not r["ok"] for r in rows)
    lines.append(f"{len(rows) - bad}/{len(rows)} pairs within {tolerance:.0%} of the expected rate")
    return "\n".join(lines)
