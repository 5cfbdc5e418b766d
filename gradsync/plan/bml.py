"""BML's gradient synchronisation on BCube(n, k) (§3.2, Algorithm 1, Fig. 4).

Every server runs ``k`` threads ``t``; the buffer is split into ``k N`` equal pieces ``g = <e, v_{k-1} .. v_0>``
(``N = n**k``), and thread ``t`` handles the pieces with ``e = t``. Piece ``g``'s digits are written like a
server address: ``g.d[i] = v_i`` and ``g.d[k] = e``.

* Aggregation step ``w`` (``w = 0 .. k-1``): thread ``t`` of server ``a`` uses level ``l = (t + w) mod k`` and
  sends to each 1-hop neighbour ``s`` under its level-``l`` switch the pieces ``CalcGset(s, w)`` -- those
  whose digits at levels ``t, t+1, .., t+w (mod k)`` equal ``s``'s -- which ``s`` adds into its own copy.
  That is ``N / n**(w+1)`` pieces per neighbour; after step ``w`` server ``a`` holds the pieces matching it
  on those ``w+1`` levels, summed over the ``n**(w+1)`` servers that differ from it only there. After
  ``k`` steps server ``q`` holds piece ``<t, q>`` summed over all ``N`` servers: it is that piece's root.
* Broadcast step ``w``: level ``l = (k - 1 - w + t) mod k``; server ``a`` copies ``CalcGset(a, k-1-w)`` (the
  ``n**w`` finished pieces it holds) to its level-``l`` neighbours -- the aggregation run backwards.

Per link direction every server's level-``l`` link carries ``sum_w (n-1) N / n**(w+1) = N - 1`` pieces in
the aggregation stage (one thread per level per step, so the ``k`` threads never share a link) and as many
in the broadcast stage, each ``1 / (k N)`` of the buffer:

    cost = 2 (N - 1) / (k N)   (in T_F; 16 T_C = 8/9 T_F on BCube(3, 2)),

``1/k`` of the parameter server's ``2 (N - 1) / N`` on a non-blocking Fat-Tree (§2, §3.2).

Schedule encoding: piece ``<e, q>`` (``q`` the number whose base-``n`` digits are ``v``) is chunk ``e N + q``
(times ``pipeline`` sub-chunks), rooted at the server with address ``v`` (rank ``q`` when ranks are in address
order, as ``bcube:n,k`` numbers them; the levels and addresses come from the links, so a topology file of a
BCube plans the same way, see :mod:`gradsync.topology.hierarchy`); aggregation step ``w`` is schedule step ``w`` (reduce)
and broadcast step ``w`` is schedule step ``k + w`` (copy). Steps order transfers per chunk, so pieces run
independently, as the paper's per-thread queues do. Its per-layer split (§4.1: every layer cut into ``k N``
pieces) is what the schedule's chunk fractions mean for a tensor list: each tensor is cut the same way.
Every route is ``server -> level-l switch -> server``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradsync.errors import PlanError
from gradsync.plan.hierarchical import switch_hierarchy_of
from gradsync.plan.schedule import Schedule, Transfer
from gradsync.plan.synthesizers import PlanOptions, split_chunks, synthesizer, unless_raises
from gradsync.topology.model import Topology

__all__ = [
    "BCubeShape",
    "bcube_shape",
    "bml_closed_form",
    "calc_gset",
    "check_digits",
    "piece_digits",
    "piece_index",
    "plan_bml",
]


@dataclass(frozen=True)
class BCubeShape:
    """A BCube topology as BML sees it: ``n``, ``k`` and every rank's digits ``d`` (``d[i] = v_i``).

    ``switches[r][l]`` names rank ``r``'s level-``l`` switch; ``rank_at[q]`` is the rank whose digits read
    ``q`` in base ``n`` (``q`` itself when ranks are in address order, as the builder numbers them).
    """

    n: int
    k: int
    #: Per rank, the paper's ``s.d[0..k-1]`` (least significant first: ``d[0] = v_0``).
    digits: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    switches: tuple[tuple[str, ...], ...]
    rank_at: tuple[int, ...]

    @property
    def servers(self) -> int:
        return self.n**self.k

    def neighbours(self, a: int, level: int) -> list[int]:
        """``N_l(a)``: the ``n - 1`` ranks under ``a``'s level-``level`` switch (only digit ``level`` differs)."""
        step = self.n**level
        base = sum(d * self.n**i for i, d in enumerate(self.digits[a])) - self.digits[a][level] * step
        return [self.rank_at[base + x * step] for x in range(self.n) if x != self.digits[a][level]]

    def switch(self, a: int, level: int) -> str:
        return self.switches[a][level]

    def route(self, a: int, s: int, level: int) -> tuple[str, str, str]:
        """``a -> level switch -> s``; ``a`` and ``s`` must be level-``level`` neighbours."""
        return (self.names[a], self.switch(a, level), self.names[s])


def bcube_shape(topology: Topology) -> BCubeShape:
    """``n``, ``k``, the server digits and switches of a BCube, read from the links, or :class:`PlanError`.

    Any topology whose ranks are each linked to one switch per level, the switches of a level partitioning
    the ranks by one digit, is BCube(n, k) (:mod:`gradsync.topology.hierarchy`); a rank selection of a
    BCube is not, nor is a tree of switches.
    """
    sh = switch_hierarchy_of(topology)
    if sh.family != "bcube":
        raise PlanError(
            f"{topology.name!r} is not a BCube: its links form a {sh.family} hierarchy ({', '.join(sh.levels)}), "
            f"not servers on one switch per level; use --algorithm hierarchical there, or a 'bcube:n,k' topology"
        )
    return BCubeShape(sh.radices[0], len(sh.radices), sh.digits, tuple(topology.ranks),
                      tuple(tuple(path[1] for path in levels) for levels in sh.paths), sh.rank_at)


# ---- Algorithm 1, literally --------------------------------------------------------------------------------
def check_digits(g: Sequence[int], s: Sequence[int], w: int, t: int, k: int) -> bool:
    """Algorithm 1, lines 21-25: piece ``g`` (``g[k]`` its thread) belongs to thread ``t`` and agrees with
    server ``s`` on digits ``(i + t) mod k`` for ``i = 0 .. w``."""
    for i in range(w + 1):
        j = (i + t) % k
        if g[j] != s[j] or g[k] != t:
            return False
    return True


def piece_index(g: Sequence[int], n: int, k: int) -> int:
    """Chunk number of piece ``g = (v_0, .., v_{k-1}, e)``: ``e N + sum_i v_i n**i``."""
    return g[k] * n**k + sum(g[i] * n**i for i in range(k))


def piece_digits(index: int, n: int, k: int) -> tuple[int, ...]:
    """Inverse of :func:`piece_index`: ``(v_0, .., v_{k-1}, e)``."""
    e, q = divmod(index, n**k)
    out = []
    for _ in range(k):
        q, d = divmod(q, n)
        out.append(d)
    return (*out, e)


def calc_gset(s: Sequence[int], w: int, t: int, n: int, k: int) -> list[int]:
    """Algorithm 1, lines 16-20, as piece indices: ``{g : CheckDigits(g, s, w)}`` over all ``k N`` pieces.

    Enumerated directly (the ``n**(k-w-1)`` pieces of thread ``t`` with the ``w + 1`` checked digits fixed to
    ``s``'s) instead of filtering all ``k N`` ids, which would make planning ``O(k**2 N**3)``; the tests
    compare it with the literal filter.
    """
    fixed = {(i + t) % k for i in range(w + 1)}
    base = t * n**k + sum(s[j] * n**j for j in fixed)
    offsets = [0]
    for level in range(k):
        if level not in fixed:
            offsets = [o + x * n**level for o in offsets for x in range(n)]
    return sorted(base + o for o in offsets)


def bml_closed_form(n: int, k: int) -> float:
    """The paper's GST of BML in T_F: ``2 (N - 1) / (k N)`` with ``N = n**k``."""
    big_n = n**k
    return 2 * (big_n - 1) / (k * big_n)


@synthesizer("bml", applicable=unless_raises(bcube_shape), halves=True)
def plan_bml(topology: Topology, options: PlanOptions) -> Schedule:
    """BML on BCube(n,k) (Algorithm 1): k threads, k*N pieces, k aggregation then k broadcast steps."""
    shape = bcube_shape(topology)
    n, k, big_n = shape.n, shape.k, shape.servers
    sub = options.pipeline
    pieces = k * big_n
    chunks, _ = split_chunks([1.0 / pieces] * pieces, sub, [shape.rank_at[p % big_n] for p in range(pieces)])
    routes: dict[tuple[int, int], tuple[str, str, str]] = {}

    def route(a: int, s: int, level: int) -> tuple[str, str, str]:
        key = (a, s)
        r = routes.get(key)
        if r is None:
            r = routes[key] = shape.route(a, s, level)
        return r

    transfers: list[Transfer] = []
    # RunAggregation(w) on every thread t of every server a.
    for w in range(k):
        for a in range(big_n):
            for t in range(k):
                level = (w + t) % k
                for s in shape.neighbours(a, level):
                    r = route(a, s, level)
                    for g in calc_gset(shape.digits[s], w, t, n, k):
                        for c in range(g * sub, g * sub + sub):
                            transfers.append(Transfer(c, a, s, r, True, w))
    # RunBroadcast(w): the finished pieces travel back along the levels in reverse order.
    for w in range(k):
        for a in range(big_n):
            for t in range(k):
                level = (k - 1 - w + t) % k
                gset = calc_gset(shape.digits[a], k - 1 - w, t, n, k)
                for s in shape.neighbours(a, level):
                    r = route(a, s, level)
                    for g in gset:
                        for c in range(g * sub, g * sub + sub):
                            transfers.append(Transfer(c, a, s, r, False, k + w))
    meta = {"bcube": {"n": n, "k": k, "pieces": pieces, "closed_form_cost": bml_closed_form(n, k)}}
    return Schedule("bml", topology.name, topology.ranks, tuple(chunks), tuple(transfers), meta=meta)
