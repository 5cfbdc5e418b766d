"""The tree pricer (gradsync.plan.trees) against the plain closure's minimum spanning tree."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra, minimum_spanning_tree

from gradsync.plan.trees import TreePricer, tree_loads
from gradsync.topology import Device, Link, Topology
from tests.conftest import random_fabric


# ---- the exact path ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_pricer_matches_the_plain_closure_mst(seed: int) -> None:
    # Fabrics with switches and ranks of degree 1 (anchored at their neighbour) and of higher degree.
    t = random_fabric(seed, max_nodes=12, max_ranks=8, max_switches=5)
    leafy = Topology(t.name + "-leaves", t.devices + (Device("leaf", "gpu"),),
                     t.links + (Link("leaf", t.devices[-1].name, 3.0),))
    for topo in (t, leafy):
        pricer = TreePricer(topo)
        rng = np.random.default_rng(seed)
        for _ in range(4):
            w = rng.uniform(0.1, 2.0, len(topo.links))
            tree = pricer.cheapest(w)
            dist = dijkstra(pricer.graph(w), directed=False, indices=pricer.terminals)[:, pricer.terminals]
            best = minimum_spanning_tree(csr_matrix(np.triu(dist, 1))).sum()
            assert float(w @ tree.loads) == pytest.approx(best, rel=1e-12)
            assert np.array_equal(tree_loads(topo, tree.routes), tree.loads)
