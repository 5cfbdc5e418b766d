"""BML's Fig. 5: the GST of BML and the parameter server on BCube against hierarchical and PS on Fat-Tree.

The seed (§3.3, Fig. 5) compares the gradient synchronisation time (GST, in units of ``T_F``, the time to
send the whole model once over one link) of four combinations at two scales:

* 16 servers: BCube(4, 2) against Fat-Tree(4); 1024 servers: BCube(32, 2) against Fat-Tree(16);
* ``bml`` on BCube, ``ps`` on BCube, ``hierarchical`` on Fat-Tree and ``ps`` on Fat-Tree.

For every scale and combination this benchmark synthesizes the schedule (timed, then verified with
``Schedule.check`` unless ``--no-check``), computes its planned cost from the link loads
(``schedule.link_loads(topo).cost(topo.costs)``, the GST in T_F under the planner's fluid model; the slow
bounds of ``evaluate()`` are not computed), simulates it with :func:`gradsync.sim.simulate` (streaming,
per-hop latency 0; timed) and reports both next to the closed forms:

* BML on BCube(n, k): ``2 (N - 1) / (k N)`` with ``N = n**k`` (§3.2);
* PS on Fat-Tree and hierarchical on Fat-Tree: ``2 (N - 1) / N`` -- one NIC per server carries
  ``(N - 1) / N`` of the buffer in each stage, whichever way the traffic is grouped (§2, §3.3);
* PS on BCube(n, 2) with BCube's digit-correcting routing: exactly ``2 (n - 1) / n``. Each server's
  level-0 NIC carries its own flows to the ``n (n - 1)`` servers that differ in digit 0, and its level-1
  NIC its own ``n - 1`` flows that differ only in digit 1 plus the ``(n - 1)**2`` flows it relays, each
  ``1 / N`` of the buffer: ``(n - 1) / n`` per NIC and stage.

The seed says PS on BCube "will double the GST compared with running BML". That is the ``n -> oo`` limit:
for ``k = 2`` the ratio is ``(2 (n - 1) / n) / ((n**2 - 1) / n**2) = 2 n / (n + 1)`` -- 1.5 at n = 3,
1.6 at n = 4, 1.94 at n = 32 -- because the relayed PS flows spread over both NICs instead of leaving
the second one idle. Fat-Tree's single NIC gives exactly ``k = 2`` times BML's GST at both scales.

The figure also shows the switch counts, the other half of the claim: BCube(n, k) needs ``k N / n``
n-port switches, a Fat-Tree ``5 N / n``, i.e. ``k / 5`` as many at one port count (8 against 20 at 16
servers, both 4-port; 64 32-port against 320 16-port switches at 1024 servers).

The 1024-server schedules are large (BML on BCube(32, 2): 4.2M transfers, PS on either network 2.1M,
hierarchical on Fat-Tree(16) 2M), so the cases run one at a time and each schedule and simulation result
is dropped before the next; synthesis, check, link loads and simulation take 5-45 s each, about 5 minutes in
all on 2 cores. Peak memory is about 4 GB, set by BML's 4.2M transfer objects. ``--size`` only scales
``time_s``: GST / T_F does not depend on it.

Writes ``bml_fig5.json`` (``"type": "gradsync.bench.bml_fig5"``) and ``bml_fig5.png`` to ``--out``
(default ``benchmarks/results``); exits 1 when a planned or simulated GST misses its closed form.
Run from the repository root::

    gradsync bench bml-fig5                        # both scales, a few minutes
    .venv/bin/python -m benchmarks.bml_fig5 --scales 16
    .venv/bin/python -m benchmarks.bml_fig5 --no-simulate    # planned costs only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradsync.cli import parse_size
from gradsync.errors import GradsyncError
from gradsync.plan import synthesize
from gradsync.plan.bml import bml_closed_form
from gradsync.sim import simulate
from gradsync.topology import Topology, get_topology

RESULT_TYPE = "gradsync.bench.bml_fig5"
#: Servers -> (BCube, Fat-Tree) with that many servers, as in the seed's Fig. 5.
SCALES: dict[int, tuple[str, str]] = {16: ("bcube:4,2", "fattree:4"), 1024: ("bcube:32,2", "fattree:16")}
#: (label, network, algorithm) in the seed's legend order.
COMBOS: tuple[tuple[str, str, str], ...] = (
    ("BML / BCube", "bcube", "bml"),
    ("PS / BCube", "bcube", "ps"),
    ("Hierarchical / Fat-Tree", "fattree", "hierarchical"),
    ("PS / Fat-Tree", "fattree", "ps"),
)
FAMILY_NAMES = {"bcube": "BCube", "fattree": "Fat-Tree"}
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")
REL_TOL = 1e-6


@dataclass
class Fig5Case:
    scale: int
    topology: str
    algorithm: str
    label: str
    servers: int
    switches: int
    transfers: int = 0
    planned_gst_over_tf: float = 0.0
    simulated_gst_over_tf: float | None = None
    closed_form: float | None = None
    synth_s: float = 0.0
    check_s: float | None = None
    loads_s: float = 0.0
    sim_s: float | None = None
    time_s: float | None = None
    peak_rss_mb: float = 0.0


def pretty(spec: str) -> str:
    """``bcube:32,2`` -> ``BCube(32,2)``, ``fattree:16`` -> ``Fat-Tree(16)``."""
    family, _, params = spec.partition(":")
    return f"{FAMILY_NAMES.get(family, family)}({params})"


def closed_form(algorithm: str, topo: Topology) -> float | None:
    """The GST in T_F this combination should reach (``None`` where no closed form is known)."""
    family, big_n = topo.attrs.get("family"), topo.world_size
    if family == "bcube":
        n, k = int(topo.attrs["n"]), int(topo.attrs["k"])
        if algorithm == "bml":
            return bml_closed_form(n, k)
        if algorithm == "ps" and k == 2:
            return 2 * (n - 1) / n
        return None
    if family == "fattree" and algorithm in ("ps", "hierarchical"):
        return 2 * (big_n - 1) / big_n
    return None


def _peak_rss_mb() -> float:
    """This process's peak resident set so far (MiB; ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _machine() -> dict[str, Any]:
    import numpy as np
    import scipy

    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "memory_GiB": round(mem, 1) if mem else None, "numpy": np.__version__, "scipy": scipy.__version__}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gradsync bench bml-fig5",
        description="BML Fig. 5: GST (in T_F) of BML and PS on BCube vs hierarchical and PS on Fat-Tree, "
                    "planned, simulated and in closed form; writes bml_fig5.{json,png}.",
    )
    p.add_argument("--scales", default="16,1024",
                   help=f"comma-separated server counts, from {sorted(SCALES)} (default 16,1024)")
    p.add_argument("--size", default="548MB", help="allreduce size (default 548MB, VGG-19); only scales time_s")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    p.add_argument("--no-simulate", action="store_true", help="report planned costs only (no simulation)")
    p.add_argument("--no-check", action="store_true", help="skip Schedule.check (saves ~20 s per 1024-server case)")
    args = p.parse_args(argv)
    try:
        args.scale_list = [int(s) for s in args.scales.split(",") if s.strip()]
    except ValueError:
        raise GradsyncError(f"--scales {args.scales!r}: write server counts like 16,1024") from None
    unknown = [s for s in args.scale_list if s not in SCALES]
    if unknown or not args.scale_list:
        raise GradsyncError(f"--scales {args.scales!r}: known scales are {', '.join(map(str, SCALES))}")
    args.size_bytes = parse_size(args.size)
    return args


def _close(value: float | None, want: float | None) -> bool:
    return value is None or want is None or abs(value - want) <= REL_TOL * abs(want)


def _fmt(x: float | None, spec: str = "9.5f") -> str:
    return format(x, spec) if x is not None else format("-", spec.split(".")[0].rstrip("f") + "s")


def _row(c: Fig5Case) -> str:
    return (f"{c.scale:5d} {c.label:24s} {pretty(c.topology):12s} {c.switches:8d} {c.transfers:9d} "
            f"{c.planned_gst_over_tf:9.5f} {_fmt(c.simulated_gst_over_tf)} {_fmt(c.closed_form)} "
            f"{c.synth_s:7.2f} {_fmt(c.sim_s, '7.2f')} {c.peak_rss_mb:8.0f}")


HEADER = (f"{'scale':>5s} {'combination':24s} {'topology':12s} {'switches':>8s} {'transfers':>9s} "
          f"{'planned':>9s} {'simulated':>9s} {'closed':>9s} {'synth_s':>7s} {'sim_s':>7s} {'peak_MB':>8s}")


def run_case(scale: int, label: str, spec: str, algorithm: str, topo: Topology, args: argparse.Namespace,
             tag: str) -> Fig5Case:
    """Synthesize, check, cost and simulate one combination; nothing large outlives the call."""
    case = Fig5Case(scale, spec, algorithm, label, topo.world_size, topo.counts().get("switch", 0),
                    closed_form=closed_form(algorithm, topo))
    print(f"{tag} {label} on {pretty(spec)}: synthesizing ...", flush=True)
    t0 = time.perf_counter()
    schedule = synthesize(algorithm, topo, check=False)
    case.synth_s = time.perf_counter() - t0
    case.transfers = schedule.num_transfers
    print(f"{tag}   {case.transfers} transfers in {case.synth_s:.2f} s", flush=True)
    if not args.no_check:
        t0 = time.perf_counter()
        schedule.check(topo)
        case.check_s = time.perf_counter() - t0
        print(f"{tag}   Schedule.check passed in {case.check_s:.2f} s", flush=True)
    t0 = time.perf_counter()
    case.planned_gst_over_tf = float(schedule.link_loads(topo).cost(topo.costs))
    case.loads_s = time.perf_counter() - t0
    print(f"{tag}   planned GST {case.planned_gst_over_tf:.6f} T_F (link loads in {case.loads_s:.2f} s)", flush=True)
    if not args.no_simulate:
        t0 = time.perf_counter()
        result = simulate(schedule, topo, args.size_bytes, streaming=True, latency_s=0.0, progress=False)
        case.sim_s = time.perf_counter() - t0
        case.simulated_gst_over_tf, case.time_s = float(result.gst_over_tf), float(result.time_s)
        print(f"{tag}   simulated GST {case.simulated_gst_over_tf:.6f} T_F = {case.time_s:.4f} s "
              f"in {case.sim_s:.2f} s", flush=True)
        del result
    del schedule
    gc.collect()
    case.peak_rss_mb = _peak_rss_mb()
    return case


def plot(path: Path, cases: Sequence[Fig5Case]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = sorted({c.scale for c in cases})
    by = {(c.scale, c.label): c for c in cases}
    simulated = all(c.simulated_gst_over_tf is not None for c in cases)
    fig, ax = plt.subplots(figsize=(9.5, 5.6))
    width = 0.2
    top = 0.0
    for j, ((label, _, _), color) in enumerate(zip(COMBOS, COLORS)):
        xs, ys, forms = [], [], []
        for i, scale in enumerate(scales):
            c = by.get((scale, label))
            if c is None:
                continue
            value = c.simulated_gst_over_tf if c.simulated_gst_over_tf is not None else c.planned_gst_over_tf
            xs.append(i + (j - 1.5) * width)
            ys.append(value)
            forms.append(c.closed_form)
        bars = ax.bar(xs, ys, width * 0.92, color=color, label=label, edgecolor="black", linewidth=0.5)
        ax.bar_label(bars, labels=[f"{y:.4f}" for y in ys], fontsize=8.5, padding=2)
        fx = [x for x, f in zip(xs, forms) if f is not None]
        fy = [f for f in forms if f is not None]
        ax.scatter(fx, fy, marker="_", s=260, color="black", linewidths=1.2, zorder=3,
                   label="closed form" if j == 0 else None)
        top = max([top, *ys, *fy])
    ticks = []
    for scale in scales:
        bc, ft = (by[(scale, COMBOS[0][0])] if (scale, COMBOS[0][0]) in by else None,
                  by[(scale, COMBOS[2][0])] if (scale, COMBOS[2][0]) in by else None)
        line = f"{scale} servers"
        if bc and ft:
            line += (f"\n{pretty(bc.topology)}: {bc.switches} switches\n"
                     f"{pretty(ft.topology)}: {ft.switches} switches (BCube needs {bc.switches / ft.switches:.0%})")
        ticks.append(line)
    ax.set_xticks(range(len(scales)))
    ax.set_xticklabels(ticks, fontsize=9)
    ax.set_xlim(-0.6, len(scales) - 0.4)
    ax.set_ylim(0, max(top * 1.18, 0.1))
    ax.set_ylabel("GST (× $T_F$)")
    how = "simulated (streaming, no latency)" if simulated else "planned (link loads)"
    ax.set_title("BML Fig. 5: gradient synchronisation time, BML / PS on BCube vs Fat-Tree\n"
                 f"{how}; BML = 2(N−1)/(kN), PS on BCube(n,2) = 2(n−1)/n, Fat-Tree = 2(N−1)/N", fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    order = [i for i, n in enumerate(names) if n != "closed form"] + [i for i, n in enumerate(names) if n == "closed form"]
    ax.legend([handles[i] for i in order], [names[i] for i in order], fontsize=9, loc="upper left", ncol=5, columnspacing=1.0, handlelength=1.4, frameon=False,
              bbox_to_anchor=(0.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run every (scale, combination); print progress and a table; write JSON and PNG; 1 on a mismatch."""
    args = _parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"scales": args.scale_list, "size_bytes": args.size_bytes, "simulate": not args.no_simulate,
              "check": not args.no_check, "out": str(args.out)}
    print(" ".join(f"{k}={v}" for k, v in config.items()), flush=True)
    total = len(args.scale_list) * len(COMBOS)
    cases: list[Fig5Case] = []
    t_all = time.perf_counter()
    for scale in args.scale_list:
        specs = dict(zip(("bcube", "fattree"), SCALES[scale]))
        topos = {net: get_topology(spec) for net, spec in specs.items()}
        for label, net, algorithm in COMBOS:
            tag = f"[{len(cases) + 1}/{total}]"
            cases.append(run_case(scale, label, specs[net], algorithm, topos[net], args, tag))
            print(f"{tag}   done (peak RSS so far {cases[-1].peak_rss_mb:.0f} MB)", flush=True)
        del topos
        gc.collect()
    wall = time.perf_counter() - t_all

    print(HEADER, flush=True)
    for c in cases:
        print(_row(c), flush=True)
    bad = [c for c in cases if not (_close(c.planned_gst_over_tf, c.closed_form)
                                    and _close(c.simulated_gst_over_tf, c.closed_form))]
    lines = [f"all planned{' and simulated' if not args.no_simulate else ''} GSTs equal their closed forms "
             f"(rel {REL_TOL:g}): {'yes' if not bad else 'NO: ' + ', '.join(f'{c.scale} {c.label}' for c in bad)}"]
    for scale in args.scale_list:
        got = {c.label: (c.simulated_gst_over_tf or c.planned_gst_over_tf) for c in cases if c.scale == scale}
        sw = {c.topology: c.switches for c in cases if c.scale == scale}
        bml = got[COMBOS[0][0]]
        lines.append(f"{scale} servers: PS/BCube = {got[COMBOS[1][0]] / bml:.4f} x BML, "
                     f"Hierarchical/Fat-Tree = {got[COMBOS[2][0]] / bml:.4f} x BML, "
                     f"PS/Fat-Tree = {got[COMBOS[3][0]] / bml:.4f} x BML; switches "
                     + " vs ".join(f"{pretty(k)} {v}" for k, v in sw.items()))
    lines.append(f"total wall {wall:.1f} s, peak RSS {_peak_rss_mb():.0f} MB")
    for line in lines:
        print("SUMMARY: " + line, flush=True)

    json_path, png_path = args.out / "bml_fig5.json", args.out / "bml_fig5.png"
    json_path.write_text(json.dumps({
        "type": RESULT_TYPE, "size_bytes": args.size_bytes, "machine": _machine(), "config": config,
        "cases": [asdict(c) for c in cases], "wall_s": wall, "summary": lines,
    }, indent=2) + "\n")
    plot(png_path, cases)
    print(f"wrote {json_path} and {png_path}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
