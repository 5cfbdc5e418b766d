"""Gantt charts of a simulation: one row per link direction (or per sending rank), one bar per flow.

A bar spans ``[start, sent]`` of a flow: when it first and last put bytes on the wire (its route latency
comes after). Bars of one row are spread over sub-lanes by step (``step % 24``) and coloured by step,
so a step-synchronous schedule reads as a staircase in store-and-forward mode and as overlapping lanes
when it streams. Rows are the busiest ``max_rows`` link directions (or ranks) so large topologies stay
legible; everything is drawn as one ``PolyCollection``, so 10^5 bars render in about a second.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gradsync.sim.engine import SimResult
from gradsync.sim.flows import SimulationError, _ranges

__all__ = ["plot_timeline"]

_FORMATS = (".png", ".svg", ".pdf")


def _time_unit(t: float) -> tuple[float, str]:
    for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if t >= 10 * scale:
            return scale, name
    return 1e-9, "ns"


def plot_timeline(result: SimResult, path: str | Path, *, by: str = "link", max_rows: int = 48,
                  max_bars: int = 200_000) -> Path:
    """Write a Gantt chart of ``result`` to ``path`` (``.png``, ``.svg`` or ``.pdf``); returns the path.

    ``by="link"``: a row per link direction ``a->b`` (a flow appears on every hop of its route);
    ``by="rank"``: a row per sending rank. Only the ``max_rows`` busiest rows and at most ``max_bars``
    bars (the longest) are drawn; the title says when some were left out.
    """
    out = Path(path)
    if out.suffix.lower() not in _FORMATS:
        raise SimulationError(f"timeline file {str(out)!r} must end in one of {', '.join(_FORMATS)}")
    if by not in ("link", "rank"):
        raise SimulationError(f"by={by!r}; draw the timeline by 'link' or by 'rank'")
    if max_rows < 1 or max_bars < 1:
        raise SimulationError("max_rows and max_bars must be >= 1")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    start, sent, step = result.start_s, result.sent_s, result.flow_step
    if by == "link":
        counts = np.diff(result.flow_link_ptr)
        flow = np.repeat(np.arange(result.num_flows), counts)
        row_key = result.flow_link_idx[_ranges(result.flow_link_ptr[:-1], counts)]
        busy = result.link_busy_s.ravel()

        def label(k: int) -> str:
            a, b, _ = result.links[k // 2]
            return f"{a}->{b}" if k % 2 == 0 else f"{b}->{a}"
    else:
        flow = np.arange(result.num_flows)
        row_key = result.flow_src
        busy = np.bincount(row_key, weights=sent - start, minlength=int(row_key.max(initial=-1)) + 1)

        def label(k: int) -> str:
            return f"rank {k}"
    keys = np.flatnonzero(busy > 0)
    keys = keys[np.argsort(-busy[keys], kind="stable")][:max_rows]
    keys.sort()
    row_of = np.full(busy.shape[0], -1)
    row_of[keys] = np.arange(keys.size)
    keep = row_of[row_key] >= 0
    flow, rows = flow[keep], row_of[row_key[keep]]
    dropped_bars = 0
    if flow.size > max_bars:
        longest = np.argsort(-(sent[flow] - start[flow]), kind="stable")[:max_bars]
        dropped_bars = flow.size - max_bars
        flow, rows = flow[longest], rows[longest]
    steps = int(step.max(initial=0)) + 1
    lanes = max(1, min(steps, 24))
    scale, unit = _time_unit(result.time_s)
    x0, x1 = start[flow] / scale, sent[flow] / scale
    h = 0.8 / lanes
    y0 = rows - 0.4 + (step[flow] % lanes) * h
    verts = np.stack([np.c_[x0, y0], np.c_[x1, y0], np.c_[x1, y0 + h], np.c_[x0, y0 + h]], axis=1)
    cmap = plt.get_cmap("viridis", max(steps, 2))
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.25 * max(keys.size, 4)))
    ax.add_collection(PolyCollection(verts, facecolors=cmap(step[flow]), edgecolors="none"))
    ax.axvline(result.time_s / scale, color="black", lw=1, ls="--")
    ax.set_xlim(0, max(result.time_s / scale, 1e-12) * 1.02)
    ax.set_ylim(-0.6, keys.size - 0.4)
    ax.set_yticks(np.arange(keys.size))
    ax.set_yticklabels([label(int(k)) for k in keys], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    mode = "streaming" if result.streaming else "store-and-forward"
    left = []
    if busy.size and np.count_nonzero(busy > 0) > keys.size:
        left.append(f"busiest {keys.size} of {np.count_nonzero(busy > 0)} rows")
    if dropped_bars:
        left.append(f"{dropped_bars} short bars left out")
    ax.set_title(
        f"{result.algorithm} on {result.topology} ({mode}): {result.time_s / scale:.4g} {unit}, "
        f"{result.gst_over_tf:.4g} T_F" + (f"\n{'; '.join(left)}" if left else ""),
        fontsize=9,
    )
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=matplotlib.colors.Normalize(0, max(steps - 1, 1)))
    fig.colorbar(sm, ax=ax, label="step", fraction=0.03)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
