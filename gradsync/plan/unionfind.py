"""Disjoint sets (union-find): the one copy behind the planners' component labels.

Three places join items into components and then number them: the cut bound's greedy partition
(:mod:`gradsync.plan.cut_bound`), the slack-partition bound (:mod:`gradsync.plan.lp`) and MSCCL's
thread-block chains (:mod:`gradsync.plan.msccl.export`). Two of them number components by their roots,
so the roots must follow from the unions alone: ``union(a, b)`` always hangs ``a``'s root under ``b``'s
(no union by rank), and :meth:`DisjointSets.find` compresses paths without changing any root.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["DisjointSets"]

T = TypeVar("T", bound=Hashable)


class DisjointSets(Generic[T]):
    """Union-find over ``items``, each alone at first; ``find`` halves paths as it walks them."""

    def __init__(self, items: Iterable[T]) -> None:
        self._parent: dict[T, T] = {x: x for x in items}

    def find(self, x: T) -> T:
        """The root of ``x``'s set."""
        parent = self._parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: T, b: T) -> T:
        """Join ``a``'s set to ``b``'s: ``a``'s root goes under ``b``'s, which stays the root and is returned."""
        root = self.find(b)
        self._parent[self.find(a)] = root
        return root
