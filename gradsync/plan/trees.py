"""Routed spanning trees over the ranks: the columns of the LP and the shape of tree schedules.

On a switch-free graph a spanning tree is a set of links. With switches (seed 000 §3) data must cross
devices that cannot aggregate, so a tree is a spanning tree over the *ranks* whose edges are routed along
device paths; a link's load is the number of tree edges whose route crosses it (in each direction: the
reduce goes up every route and the broadcast comes back down it).

The cheapest routed tree under link prices ``w_e >= 0`` is found exactly: route every rank pair along a
shortest ``w``-path, then take a minimum spanning tree of that metric closure. (A routed tree costs the sum
of its routes; each route can be chosen independently, so shortest paths are optimal, and the tree is then
an MST of the closure.) When every device is a rank the closure MST is just the graph's MST.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra, minimum_spanning_tree

from gradsync.plan.schedule import Tree
from gradsync.topology.model import Topology

__all__ = ["RoutedTree", "cheapest_tree", "root_tree", "tree_loads"]


@dataclass(frozen=True)
class RoutedTree:
    """An unrooted spanning tree over rank indices; ``routes[i]`` is the device path of ``edges[i]``."""

    edges: tuple[tuple[int, int], ...]
    routes: tuple[tuple[str, ...], ...]
    #: Number of tree edges routed across each link (same in both directions).
    loads: np.ndarray

    @property
    def key(self) -> tuple[tuple[str, ...], ...]:
        return tuple(sorted(self.routes))


def _link_matrix(topology: Topology, weights: np.ndarray) -> csr_matrix:
    n = len(topology.devices)
    idx = topology.device_index
    rows, cols = [], []
    for lk in topology.links:
        rows += [idx[lk.a], idx[lk.b]]
        cols += [idx[lk.b], idx[lk.a]]
    data = np.repeat(weights, 2)
    return csr_matrix((data, (rows, cols)), shape=(n, n))


def tree_loads(topology: Topology, routes: Sequence[Sequence[str]]) -> np.ndarray:
    loads = np.zeros(len(topology.links))
    for route in routes:
        for e, _ in topology.route_links(route):
            loads[e] += 1
    return loads


def cheapest_tree(topology: Topology, weights: np.ndarray) -> RoutedTree:
    """The routed spanning tree over the ranks minimising ``sum_e weights[e] * load_e`` (exact).

    ``weights`` must be strictly positive (callers add a tiny floor) so zero-cost hops are not mistaken
    for missing edges by SciPy's sparse graph routines.
    """
    names = [d.name for d in topology.devices]
    didx = topology.device_index
    term = np.array([didx[r] for r in topology.ranks])
    k = len(term)
    if k == 1:
        return RoutedTree((), (), np.zeros(len(topology.links)))
    graph = _link_matrix(topology, weights)
    if not topology.has_forwarders:
        # Ranks are all the devices: the closure MST is the graph's MST (no routes through others needed).
        mst = minimum_spanning_tree(graph).tocoo()
        ridx = topology.rank_index
        edges = []
        routes = []
        for a, b in zip(mst.row, mst.col):
            u, v = names[a], names[b]
            edges.append((ridx[u], ridx[v]))
            routes.append((u, v))
    else:
        dist, pred = dijkstra(graph, directed=False, indices=term, return_predecessors=True)
        closure = dist[:, term]
        mst = minimum_spanning_tree(csr_matrix(np.triu(closure, 1))).tocoo()
        edges, routes = [], []
        for i, j in zip(mst.row, mst.col):
            path = [int(term[j])]
            while path[-1] != term[i]:
                path.append(int(pred[i, path[-1]]))
            path.reverse()
            edges.append((int(i), int(j)))
            routes.append(tuple(names[p] for p in path))
    return RoutedTree(tuple(edges), tuple(routes), tree_loads(topology, routes))


def root_tree(tree: RoutedTree, weight: float, root: int | None = None) -> Tree:
    """Orient a routed tree toward ``root`` (default: a centre, which minimises the number of steps)."""
    adj: dict[int, list[tuple[int, tuple[str, ...]]]] = {}
    for (u, v), route in zip(tree.edges, tree.routes):
        adj.setdefault(u, []).append((v, route))
        adj.setdefault(v, []).append((u, tuple(reversed(route))))
    if root is None:
        root = _centre(adj) if adj else 0
    edges: list[tuple[int, int]] = []
    routes: list[tuple[str, ...]] = []
    seen = {root}
    stack = [root]
    while stack:
        p = stack.pop()
        for c, route_pc in adj.get(p, []):
            if c not in seen:
                seen.add(c)
                edges.append((c, p))
                routes.append(tuple(reversed(route_pc)))
                stack.append(c)
    return Tree(weight, root, tuple(edges), tuple(routes))


def _centre(adj: dict[int, list[tuple[int, tuple[str, ...]]]]) -> int:
    """A centre of the tree: peel leaves until one or two nodes remain; pick the smaller index."""
    degree = {v: len(n) for v, n in adj.items()}
    alive = set(adj)
    leaves = [v for v in alive if degree[v] <= 1]
    while len(alive) > 2:
        nxt = []
        for leaf in leaves:
            alive.discard(leaf)
            for u, _ in adj[leaf]:
                if u in alive:
                    degree[u] -= 1
                    if degree[u] == 1:
                        nxt.append(u)
        leaves = nxt
    return min(alive)
