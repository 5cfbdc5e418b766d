"""Draw a topology as PNG/SVG: ranks, forwarding devices and links scaled by bandwidth."""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from gradsync.topology.model import Topology

__all__ = ["draw"]

_COLOURS = {"gpu": "#76b900", "cpu": "#1f77b4", "host": "#1f77b4", "switch": "#bbbbbb", "nic": "#ff7f0e"}


def draw(topology: Topology, path: str | Path) -> Path:
    """Write a picture of ``topology``; edge width grows with bandwidth, labels give GB/s."""
    g = topology.graph
    pos = nx.kamada_kawai_layout(g) if len(g) > 2 else nx.spring_layout(g, seed=0)
    # the object API draws into its own canvas: no pyplot, no backend chosen for the whole process (a notebook's stays)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    widths = [1 + 2 * g.edges[e]["bandwidth"] / topology.unit_bandwidth_GBps for e in g.edges]
    nx.draw_networkx_edges(g, pos, ax=ax, width=widths, edge_color="#555555")
    nx.draw_networkx_edge_labels(
        g, pos, ax=ax, font_size=7, edge_labels={e: f"{g.edges[e]['bandwidth']:g}" for e in g.edges}
    )
    colours = [_COLOURS[g.nodes[n]["kind"]] for n in g.nodes]
    shapes_rank = [n in topology.rank_index for n in g.nodes]
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=colours, node_size=[500 if r else 300 for r in shapes_rank])
    nx.draw_networkx_labels(g, pos, ax=ax, font_size=7)
    ax.set_title(f"{topology.name}  (link labels: GB/s per direction)")
    ax.axis("off")
    out = Path(path)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    return out
