"""Automorphism groups of fat trees and BCubes, and the seed trees whose orbits pack them optimally.

Why. The tree-packing LP of :mod:`gradsync.plan.lp` is convex and invariant under every automorphism
``g`` of the topology (a permutation of the devices that maps ranks to ranks and links to links of the
same cost): if ``alpha`` is optimal so is ``alpha o g``, and so is their average over a group ``H``.
So the LP has an ``H``-invariant optimum, whose link loads are constant on each *link orbit* ``O`` of
``H``. For a tree ``T`` let ``L_O(T) = sum_{e in O} L_eT``; the mix that gives each image ``g T``
(``g in H``) the weight ``alpha_T / |H|`` loads every link of ``O`` with ``sum_T alpha_T L_O(T) / |O|``
(``H`` is transitive on ``O``, so each link of ``O`` is hit ``|H| / |O|`` times). The LP therefore
reduces to its *orbit master* with one row per orbit (three on a fat tree, one on a BCube) instead of
one per link; :func:`gradsync.plan.lp.symmetric_packing` solves it and expands the trees.

A :class:`Symmetry` is ``H`` as a product of cyclic factors (generators of given orders), built per
topology family by a registered constructor and *verified* on the topology (each generator must map
devices, ranks and links onto themselves with equal directed costs), so a file that only claims to be
a fat tree, a selection of one, or one with a degraded link falls back to the plain LP.

Groups (products of cyclic factors; the fat tree's acts regularly on the servers, ``|H| = N``, the
BCube's on the server-switch links, ``|H| = k N``):

* ``fattree:k``: rotate pods (order k); rotate the edge switches of every pod together with the core
  switches of every group (order k/2); rotate the ports of every edge switch together with the
  aggregation switches and the core groups (order k/2). Orbits: host, aggregation and core links.
* ``bcube:n,k``: add 1 to digit ``l`` of every address (order n, one per level), and rotate the digit
  positions (order k, level ``l`` -> ``l + 1``). One orbit: every server-switch link.

Seeds (trees whose orbit average meets the cut bound, so no pricing is needed):

* fat tree: the Hamiltonian path over the servers in rank (pod, edge, port) order. Its orbit average
  loads every host link ``2 (N - 1) / N``, the cut bound; alone it loads no link more than twice
  (every edge switch, aggregation switch and pod is entered once and left once), a gap of ``1 / (N-1)``.
* BCube: ``k`` edge-disjoint spanning trees of the torus ``C_n^k`` (each server joined to the servers
  one up and one down in every digit, through that level's switch), see :func:`torus_trees`. Each
  server-switch link carries at most 2 tree edges over the ``k`` trees: cost ``2 / k`` against the
  optimum ``2 (N - 1) / (N k)`` (gap ``1 / (N - 1)``) with only ``k`` trees, and their orbit average is
  optimal. Tree ``j`` is tree 0 with its digits rotated ``j`` places, so one seed suffices.

Fewer images than ``|H|`` often balance the loads as well: :meth:`Symmetry.selections` lists the sets of
powers ``g_f^{d_f e}`` of the factors, and the packing takes the smallest whose mix meets the bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from gradsync.errors import PlanError
from gradsync.registry import Registry
from gradsync.topology.bcube import bcube_digits, bcube_server_name, bcube_switch_name
from gradsync.topology.fattree import (
    aggregation_switch_name,
    core_switch_name,
    edge_switch_name,
    fattree_server_name,
)
from gradsync.topology.model import Topology

__all__ = ["SYMMETRIES", "Symmetry", "directed_link_permutation", "link_permutation", "orbits", "regular_selection",
           "symmetry_of", "torus_trees"]


def orbits(size: int, permutations: Sequence[np.ndarray]) -> np.ndarray:
    """Orbit label of each of ``size`` items under the group the ``permutations`` generate (``p[i]`` is the
    image of item ``i``): the components of the graph joining every ``i`` to each ``p[i]``, numbered in order
    of their smallest item."""
    if not permutations:
        return np.arange(size)
    heads = np.concatenate([np.asarray(p, dtype=np.int64) for p in permutations])
    tails = np.tile(np.arange(size), len(permutations))
    graph = sp.csr_matrix((np.ones(len(heads)), (tails, heads)), shape=(size, size))
    return connected_components(graph, directed=True, connection="weak")[1]


@dataclass(frozen=True)
class Symmetry:
    """A group ``H`` of automorphisms of one topology as a product of cyclic factors.

    ``generators[f]`` permutes device indices (``g[i]`` is the image of device ``i``) and has order
    ``orders[f]``; every element is ``g_0^{e_0} o g_1^{e_1} o ...`` with ``0 <= e_f < orders[f]``,
    each exactly once (the product is direct or semidirect, so these are ``prod(orders)`` elements).
    """

    name: str
    generators: tuple[np.ndarray, ...]
    orders: tuple[int, ...]
    #: Seed trees as rank edge lists (see the module docstring); may be empty.
    seeds: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def order(self) -> int:
        return int(np.prod(self.orders, dtype=np.int64))

    def size(self, steps: Sequence[int]) -> int:
        """How many elements :meth:`elements` yields for ``steps``."""
        return int(np.prod([o // d for o, d in zip(self.orders, steps)], dtype=np.int64))

    def selections(self) -> list[tuple[int, ...]]:
        """Every ``steps`` (a divisor of each factor's order), smallest selection first.

        ``steps[f] = d`` takes the powers ``g_f^0, g_f^d, g_f^{2d}, ...`` of factor ``f``; ``d = order`` leaves
        it out. Fewer elements than ``H`` can already balance the loads: on a fat tree the pods rotated in
        steps of 2 leave two orbits of servers, and a path whose ends lie in different ones is then an end
        in exactly one image per server, so ``N / 2`` images meet the bound.
        """
        options = [[d for d in range(1, o + 1) if o % d == 0] for o in self.orders]
        return sorted(itertools.product(*options), key=self.size)

    def elements(self, steps: Sequence[int] | None = None,
                 generators: Sequence[np.ndarray] | None = None) -> Iterator[np.ndarray]:
        """The products ``g_0^{d_0 e_0} o g_1^{d_1 e_1} o ...`` for ``steps = (d_0, d_1, ...)`` (default all 1:
        every element of ``H``) as device permutations, or as the permutations ``generators`` induce on
        something else (links, ranks): the same elements in the same order, since composing the induced
        permutations induces the composition."""
        steps = (1,) * len(self.generators) if steps is None else steps
        gens = self.generators if generators is None else generators
        powers = []
        for g, order, step in zip(gens, self.orders, steps):
            g_step = np.arange(len(g))
            for _ in range(step):
                g_step = g[g_step]
            p = [np.arange(len(g))]
            for _ in range(order // step - 1):
                p.append(g_step[p[-1]])
            powers.append(p)
        size = len(gens[0])
        for combo in itertools.product(*powers):
            out = np.arange(size)
            for p in reversed(combo):
                out = p[out]
            yield out


def _permutation(topology: Topology, image: Callable[[str], str]) -> np.ndarray | None:
    """Device permutation ``i -> index(image(name_i))``, or ``None`` if some image is not a device or repeats."""
    idx = topology.device_index
    out = np.empty(len(topology.devices), dtype=np.int64)
    for i, d in enumerate(topology.devices):
        j = idx.get(image(d.name))
        if j is None:
            return None
        out[i] = j
    return out if len(np.unique(out)) == len(out) else None


def link_permutation(topology: Topology, perm: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lperm, flipped)``: link ``e`` maps to link ``lperm[e]``, reversed where ``flipped``; ``None`` if
    some link's image is not a link."""
    idx = topology.device_index
    n = len(topology.devices)
    a = np.array([idx[lk.a] for lk in topology.links], dtype=np.int64)
    b = np.array([idx[lk.b] for lk in topology.links], dtype=np.int64)
    keys = np.minimum(a, b) * n + np.maximum(a, b)
    order = np.argsort(keys)
    pa, pb = perm[a], perm[b]
    img = np.minimum(pa, pb) * n + np.maximum(pa, pb)
    pos = np.searchsorted(keys[order], img)
    if np.any(pos >= len(keys)) or np.any(keys[order][np.minimum(pos, len(keys) - 1)] != img):
        return None
    lperm = order[pos]
    return lperm, pa != a[lperm]


def directed_link_permutation(topology: Topology, perm: np.ndarray) -> np.ndarray | None:
    """Image of each link direction ``2 e + d`` (``d = 0``: ``a -> b``) as an index of the same form, or ``None``
    if some link's image is not a link. A device permutation maps the hop ``u -> v`` to ``perm u -> perm v``."""
    mapped = link_permutation(topology, perm)
    if mapped is None:
        return None
    lperm, flipped = mapped
    out = np.empty(2 * len(lperm), dtype=np.int64)
    out[0::2] = 2 * lperm + flipped
    out[1::2] = 2 * lperm + 1 - flipped
    return out


def regular_selection(topology: Topology, sym: Symmetry) -> tuple[int, ...] | None:
    """Steps (see :meth:`Symmetry.selections`) whose elements form a subgroup acting *regularly* on the ranks:
    exactly one element maps rank 0 to each rank. ``None`` if no selection does.

    Fat trees: the whole group (order ``N``). BCube: the digit additions without the rotation (order
    ``n^k = N``). Each candidate is checked, not assumed: its ``N`` elements must send rank 0 to every rank
    once, and be closed under the selected generators (so they are the subgroup those generate).
    """
    n = topology.world_size
    idx = topology.device_index
    ranks = np.array([idx[r] for r in topology.ranks], dtype=np.int64)
    want = np.sort(ranks)
    for steps in sym.selections():
        if sym.size(steps) != n:
            continue
        elements = list(sym.elements(steps))
        if not np.array_equal(np.sort([int(g[ranks[0]]) for g in elements]), want):
            continue
        known = {g.tobytes() for g in elements}
        closed = True
        for g, order, step in zip(sym.generators, sym.orders, steps):
            if step == order:
                continue
            h = np.arange(len(g))
            for _ in range(step):
                h = g[h]
            if any(h[e].tobytes() not in known for e in elements):
                closed = False
                break
        if closed:
            return tuple(steps)
    return None


def _is_automorphism(topology: Topology, perm: np.ndarray) -> bool:
    """Maps kinds to kinds, ranks onto ranks and every link onto a link with the same directed costs."""
    kinds = np.array([d.kind for d in topology.devices], dtype=object)
    if not np.array_equal(kinds[perm], kinds):
        return False
    idx = topology.device_index
    ranks = np.array([idx[r] for r in topology.ranks], dtype=np.int64)
    if set(perm[ranks].tolist()) != set(ranks.tolist()):
        return False
    mapped = link_permutation(topology, perm)
    if mapped is None:
        return False
    lperm, flipped = mapped
    d = topology.directed_costs
    image = np.where(flipped[:, None], d[lperm][:, ::-1], d[lperm])
    return bool(np.allclose(image, d, rtol=1e-12, atol=0.0))


def _order(perm: np.ndarray) -> int:
    g, k = perm.copy(), 1
    ident = np.arange(len(perm))
    while not np.array_equal(g, ident):
        g, k = perm[g], k + 1
    return k


#: family name (``topology.attrs["family"]``) -> constructor of its candidate group and seeds, or None.
SYMMETRIES: Registry[Callable[[Topology], Symmetry | None]] = Registry("symmetric topology family", PlanError)


@SYMMETRIES.register("fattree")
def _fattree_symmetry(topology: Topology) -> Symmetry | None:
    k = int(topology.attrs.get("k", 0))
    if k < 2 or k % 2:
        return None
    half = k // 2

    def parse(name: str) -> tuple[str, tuple[int, ...]]:
        if name.startswith("h"):
            return "h", tuple(int(x) for x in name[1:].split("."))
        if name.startswith("core"):
            return "core", tuple(int(x) for x in name[4:].split("."))
        pod, rest = name[1:].split(".", 1)
        if rest.startswith("edge"):
            return "edge", (int(pod), int(rest[4:]))
        return "agg", (int(pod), int(rest[3:]))

    def mapper(dp: int, de: int, dx: int) -> Callable[[str], str]:
        def image(name: str) -> str:
            try:
                kind, c = parse(name)
            except ValueError:
                return ""
            if kind == "h":
                return fattree_server_name((c[0] + dp) % k, (c[1] + de) % half, (c[2] + dx) % half)
            if kind == "edge":
                return edge_switch_name((c[0] + dp) % k, (c[1] + de) % half)
            if kind == "agg":
                return aggregation_switch_name((c[0] + dp) % k, (c[1] + dx) % half)
            return core_switch_name((c[0] + dx) % half, (c[1] + de) % half)
        return image

    gens = []
    for shift in ((1, 0, 0), (0, 1, 0), (0, 0, 1)):
        perm = _permutation(topology, mapper(*shift))
        if perm is None:
            return None
        gens.append(perm)
    path = tuple((r, r + 1) for r in range(topology.world_size - 1))
    return Symmetry(topology.name, tuple(gens), (k, half, half), (path,))


def torus_trees(n: int, k: int) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """``k`` edge-disjoint spanning trees of the torus ``C_n^k`` (``n >= 2``; for ``n = 2`` its double edges).

    Points are digit tuples ``x = (x_0, ..., x_{k-1})``; the dimension-``i`` edge at ``x`` joins ``x`` and
    ``x + u_i``. Tree ``j`` is built on the dimension-``j`` *lines* (fix every other digit): it keeps every
    line but one edge, and joins the lines with edges the other trees dropped. For a dimension-``i`` line
    write its other digits in cyclic order after ``i`` as ``y = (x_{i+1}, ..., x_{i+k-1})``; it drops its
    edge at ``x_i = y_{k-1}``. Let ``r`` be the length of the run of equal digits ending ``y`` (``r >= 1``):
    the dropped edge joins tree ``j = i - r`` (indices mod ``k``), except that the line whose digits all
    equal ``n - 1`` drops it for good (one such edge per dimension, ``k`` in all). In tree ``j``, the lines
    are grouped level by level by the digits ``x_{j+1}, x_{j+2}, ...``: at level ``r`` the groups of lines
    agreeing on ``x_{j+r+1}..x_{j+k-1}`` are joined along ``x_{j+r}``, and the received edges with run
    ``r`` are exactly ``n - 1`` steps ``a -> a + 1`` of distinct ``a`` per group: a path through the group's
    ``n`` sub-groups. By induction each tree is connected with ``n^k - 1`` edges, so a spanning tree; the
    ``k`` trees use every edge of the torus once except the ``k`` dropped for good.
    """
    if n < 2 or k < 1:
        raise PlanError(f"torus_trees needs n >= 2 and k >= 1, got n={n}, k={k}")
    trees: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = [[] for _ in range(k)]

    def edge(point: list[int], i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        up = list(point)
        up[i] = (up[i] + 1) % n
        return tuple(point), tuple(up)

    for i in range(k):
        for y in itertools.product(range(n), repeat=k - 1):
            point = [0] * k
            for m, v in enumerate(y, start=1):
                point[(i + m) % k] = v
            drop = y[-1] if y else n - 1  # k = 1: one line, drop its last edge
            for xi in range(n):
                if xi != drop:
                    point[i] = xi
                    trees[i].append(edge(point, i))
            if not y or all(v == n - 1 for v in y):
                continue
            run = 1
            while run < len(y) and y[-1 - run] == y[-1]:
                run += 1
            point[i] = drop
            trees[(i - run) % k].append(edge(point, i))
    return trees


@SYMMETRIES.register("bcube")
def _bcube_symmetry(topology: Topology) -> Symmetry | None:
    n, k = int(topology.attrs.get("n", 0)), int(topology.attrs.get("k", 0))
    if n < 2 or k < 1:
        return None
    rank_digits = {bcube_server_name(bcube_digits(r, n, k), n): bcube_digits(r, n, k) for r in range(n**k)}
    # A switch is named after any server on it: its image is that server's image's switch at the new level.
    switch_of: dict[str, tuple[int, tuple[int, ...]]] = {}
    for digits in rank_digits.values():
        for level in range(k):
            switch_of.setdefault(bcube_switch_name(level, digits, n), (level, digits))

    def mapper(move: Callable[[tuple[int, ...]], tuple[int, ...]], level_shift: int) -> Callable[[str], str]:
        def image(name: str) -> str:
            if name in rank_digits:
                return bcube_server_name(move(rank_digits[name]), n)
            if name in switch_of:
                level, digits = switch_of[name]
                return bcube_switch_name((level + level_shift) % k, move(digits), n)
            return ""
        return image

    def add_one(level: int) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
        pos = k - 1 - level  # digits are (v_{k-1}, ..., v_0)

        def move(d: tuple[int, ...]) -> tuple[int, ...]:
            return d[:pos] + ((d[pos] + 1) % n,) + d[pos + 1:]
        return move

    def rotate(d: tuple[int, ...]) -> tuple[int, ...]:
        return d[1:] + d[:1]  # v_l moves to position l + 1

    gens, orders = [], []
    for move, shift, order in [(rotate, 1, k)] + [(add_one(level), 0, n) for level in range(k)]:
        perm = _permutation(topology, mapper(move, shift))
        if perm is None:
            return None
        gens.append(perm)
        orders.append(order)
    # Seed: torus tree 0 over the ranks (torus point x = (x_0..x_{k-1}) is the server with v_l = x_l).
    rank_of = {tuple(reversed(d)): r for r, d in enumerate(rank_digits.values())}
    seed = tuple((rank_of[u], rank_of[v]) for u, v in torus_trees(n, k)[0])
    return Symmetry(topology.name, tuple(gens), tuple(orders), (seed,))


def symmetry_of(topology: Topology) -> Symmetry | None:
    """The verified group of a fat tree or BCube (by ``attrs["family"]``), or ``None`` where none applies.

    ``None`` also when the topology only resembles the family (a selection, an edited file): every
    generator is checked to be an automorphism with the order claimed.
    """
    family = topology.attrs.get("family")
    if not isinstance(family, str) or family not in SYMMETRIES or topology.world_size < 2:
        return None
    sym = SYMMETRIES.get(family)(topology)
    if sym is None:
        return None
    for g, order in zip(sym.generators, sym.orders):
        if not _is_automorphism(topology, g) or _order(g) != order:
            return None
    if any(max(max(e) for e in seed) >= topology.world_size for seed in sym.seeds if seed):
        return None
    return sym
