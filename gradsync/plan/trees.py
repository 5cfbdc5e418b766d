"""Routed spanning trees over the ranks: the columns of the LP and the shape of tree schedules.

On a switch-free graph a spanning tree is a set of links. With switches (OMS §3) data must cross
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

__all__ = ["RoutedTree", "TreePricer", "cheapest_tree", "root_tree", "tree_loads"]


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


class TreePricer:
    """:func:`cheapest_tree` for many price vectors on one topology (the pricing step of column generation).

    The sparse graph's structure, the terminals and the (device pair -> link) lookup are built once; each
    call only writes the prices into the matrix. Loads are counted with one vectorised lookup per tree.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.names = np.array([d.name for d in topology.devices], dtype=object)
        idx = topology.device_index
        a = np.array([idx[lk.a] for lk in topology.links], dtype=np.int64)
        b = np.array([idx[lk.b] for lk in topology.links], dtype=np.int64)
        n = len(topology.devices)
        self.n_devices = n
        self.n_links = len(topology.links)
        rows = np.concatenate([a, b])
        cols = np.concatenate([b, a])
        # CSR with sorted indices; `slot[i]` is the link behind the i-th stored entry.
        order = np.lexsort((cols, rows))
        self.slot = np.concatenate([np.arange(self.n_links)] * 2)[order]
        self.indptr = np.searchsorted(rows[order], np.arange(n + 1)).astype(np.int32)
        self.indices = cols[order].astype(np.int32)
        keys = np.minimum(a, b) * n + np.maximum(a, b)
        self.key_order = np.argsort(keys)
        self.sorted_keys = keys[self.key_order]
        self.terminals = np.array([idx[r] for r in topology.ranks], dtype=np.int64)
        rank_of = np.full(n, -1, dtype=np.int64)
        rank_of[self.terminals] = np.arange(len(self.terminals))
        self.rank_of = rank_of
        # A rank with one link (a fat-tree host, a GPU behind one switch port) reaches everything through its
        # neighbour: its shortest paths are that link plus the neighbour's. Dijkstra then runs from the
        # distinct *anchors* (128 edge switches instead of 1024 hosts on fattree:16), not from every rank.
        degree = np.bincount(rows, minlength=n)
        first = self.indptr[self.terminals]
        single = degree[self.terminals] == 1
        # (indexed only where single: a one-rank topology has no links, and np.where evaluates both sides)
        self.anchor = self.terminals.copy()
        self.anchor[single] = self.indices[first[single]]
        self.anchor_link = np.full(len(self.terminals), -1, dtype=np.int64)
        self.anchor_link[single] = self.slot[first[single]]
        self.sources, self.source_of = np.unique(self.anchor, return_inverse=True)

    def graph(self, weights: np.ndarray) -> csr_matrix:
        return csr_matrix((np.asarray(weights, dtype=float)[self.slot], self.indices, self.indptr),
                          shape=(self.n_devices, self.n_devices))

    def link_ids(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Link index of each device pair ``(u[i], v[i])`` (which must be joined by a link)."""
        keys = np.minimum(u, v) * self.n_devices + np.maximum(u, v)
        return self.key_order[np.searchsorted(self.sorted_keys, keys)]

    def loads_of_hops(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.bincount(self.link_ids(u, v), minlength=self.n_links).astype(float)

    def paths(self, weights: np.ndarray, ranks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dijkstra from the anchors of ``ranks`` (default: all): ``(dist, pred, row)``, where ``row[r]`` is
        the row of rank ``r``'s anchor in ``dist`` and ``pred`` (-1 for ranks not asked for)."""
        ranks = np.arange(len(self.terminals)) if ranks is None else np.asarray(ranks, dtype=np.int64)
        used, inverse = np.unique(self.source_of[ranks], return_inverse=True)
        dist, pred = dijkstra(self.graph(weights), directed=False, indices=self.sources[used],
                              return_predecessors=True)
        row = np.full(len(self.terminals), -1, dtype=np.int64)
        row[ranks] = inverse
        return dist, pred, row

    def route(self, pred: np.ndarray, row: np.ndarray, i: int, j: int) -> list[int]:
        """Device path from rank ``i`` to rank ``j`` along :meth:`paths`'s predecessors."""
        start = int(self.anchor[i])
        back = pred[row[i]]
        path = [int(self.terminals[j])]
        while path[-1] != start:
            path.append(int(back[path[-1]]))
        if start != self.terminals[i]:
            path.append(int(self.terminals[i]))
        path.reverse()
        return path

    def routed(self, pred: np.ndarray, row: np.ndarray, pairs: Sequence[tuple[int, int]]) -> RoutedTree:
        """The tree whose rank edges are ``pairs``, each routed along :meth:`paths`'s shortest paths."""
        return self._tree(pairs, [self.route(pred, row, i, j) for i, j in pairs])

    def shortest_tree(self, weights: np.ndarray, pairs: Sequence[tuple[int, int]], block: int = 256) -> RoutedTree:
        """The tree whose rank edges are ``pairs``, each routed along a cheapest path under ``weights``.

        Dijkstra runs from at most ``block`` anchors at a time, so memory stays ``block x devices`` (a BCube(16, 3)
        seed would otherwise hold 4096 x 4864 distances and predecessors).
        """
        paths: list[list[int]] = [[] for _ in pairs]
        start = np.array([self.source_of[i] for i, _ in pairs], dtype=np.int64)
        anchors = np.unique(start)
        for lo in range(0, len(anchors), block):
            chunk = anchors[lo:lo + block]
            members = np.flatnonzero(np.isin(start, chunk))
            ranks = np.unique([pairs[m][0] for m in members])
            _, pred, row = self.paths(weights, ranks)
            for m in members.tolist():
                paths[m] = self.route(pred, row, *pairs[m])
        return self._tree(pairs, paths)

    def _tree(self, pairs: Sequence[tuple[int, int]], paths: Sequence[list[int]]) -> RoutedTree:
        names = self.names
        hop_u = [h for path in paths for h in path[:-1]]
        hop_v = [h for path in paths for h in path[1:]]
        routes = tuple(tuple(names[path].tolist()) for path in paths)
        loads = self.loads_of_hops(np.array(hop_u, dtype=np.int64), np.array(hop_v, dtype=np.int64))
        return RoutedTree(tuple((int(i), int(j)) for i, j in pairs), routes, loads)

    def cheapest(self, weights: np.ndarray) -> RoutedTree:
        """The routed spanning tree minimising ``sum_e weights[e] * load_e`` (see :func:`cheapest_tree`)."""
        term = self.terminals
        if len(term) == 1:
            return RoutedTree((), (), np.zeros(self.n_links))
        names = self.names
        if not self.topology.has_forwarders:
            # Ranks are all the devices: the closure MST is the graph's MST (no routes through others needed).
            mst = minimum_spanning_tree(self.graph(weights)).tocoo()
            u, v = mst.row.astype(np.int64), mst.col.astype(np.int64)
            edges = tuple(zip(self.rank_of[u].tolist(), self.rank_of[v].tolist()))
            routes = tuple(zip(names[u].tolist(), names[v].tolist()))
            return RoutedTree(edges, routes, self.loads_of_hops(u, v))
        dist, pred, row = self.paths(weights)
        w = np.asarray(weights, dtype=float)
        offset = np.where(self.anchor_link >= 0, w[np.maximum(self.anchor_link, 0)], 0.0)
        closure = dist[row][:, term] + offset[:, None]
        mst = minimum_spanning_tree(csr_matrix(np.triu(closure, 1))).tocoo()
        return self.routed(pred, row, list(zip(mst.row.tolist(), mst.col.tolist())))


def tree_loads(topology: Topology, routes: Sequence[Sequence[str]]) -> np.ndarray:
    loads = np.zeros(len(topology.links))
    for route in routes:
        for e, _ in topology.route_links(route):
            loads[e] += 1
    return loads


def cheapest_tree(topology: Topology, weights: np.ndarray) -> RoutedTree:
    """The routed spanning tree over the ranks minimising ``sum_e weights[e] * load_e`` (exact).

    ``weights`` must be strictly positive (callers add a tiny floor) so zero-cost hops are not mistaken
    for missing edges by SciPy's sparse graph routines. Use a :class:`TreePricer` for many calls.
    """
    return TreePricer(topology).cheapest(weights)


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
