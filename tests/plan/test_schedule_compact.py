"""Compact schedules (tree and ring blocks) against their spelled-out form, which stays the reference.

Issue 18 part 1: the compact form must give the same transfers, link loads, latencies, simulator times and
runtime results as the explicit one, check itself structurally without expanding, and catch what the replay
catches.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from gradsync.comm import Executor, run_ranks
from gradsync.errors import ScheduleError
from gradsync.plan import PlanOptions, Schedule, synthesize
from gradsync.plan.report import latency_term
from gradsync.plan.schedule import Chunk, RingBlock, Tree, TreeBlock, tree_transfers
from gradsync.sim import simulate
from gradsync.topology import get_topology

TOPOLOGIES = ["switch:2", "switch:5", "ring:4", "p3.8xlarge", "dgx1", "bcube:3,2", "fattree:4", "racks:2,3,4"]
COMPACT = ("ring", "multiring", "tree", "lp")


def _cases():
    for spec in TOPOLOGIES:
        for algorithm in COMPACT:
            for pipeline in (1, 3):
                yield spec, algorithm, pipeline


@pytest.mark.parametrize("spec,algorithm,pipeline", list(_cases()))
def test_compact_and_explicit_forms_agree(spec: str, algorithm: str, pipeline: int) -> None:
    topo = get_topology(spec)
    s = synthesize(algorithm, topo, PlanOptions(pipeline=pipeline), check=False)
    assert s.compact and not s.explicit
    s.check(topo)  # structural: must not expand the blocks
    loads = s.link_loads(topo)
    lat = latency_term(s, topo, 1e-5)
    assert "transfers" not in s.__dict__, "the structural check, loads and latencies expanded the blocks"
    e = s.expanded()
    assert not e.compact and e.transfers == s.transfers and len(e.transfers) == s.num_transfers
    e.check(topo)  # the replay, as the reference
    ref = e.link_loads(topo)
    np.testing.assert_allclose(loads.directed, ref.directed, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(loads.reduce_directed, ref.reduce_directed, rtol=1e-12, atol=1e-15)
    assert lat == pytest.approx(latency_term(e, topo, 1e-5), rel=1e-12)
    assert s.num_steps == e.num_steps == 1 + max(t.step for t in e.transfers)
    assert [c.root for c in s.chunks] == [c.root for c in e.chunks]
    assert simulate(s, topo, 2**24).time_s == simulate(e, topo, 2**24).time_s


@pytest.mark.parametrize("spec,algorithm", [("fattree:4", "ring"), ("bcube:3,2", "lp"), ("p3.8xlarge", "multiring")])
def test_compact_schedule_round_trips_through_json_and_stays_small(tmp_path, spec: str, algorithm: str) -> None:
    topo = get_topology(spec)
    s = synthesize(algorithm, topo, PlanOptions(pipeline=2))
    back = Schedule.load(s.save(tmp_path / "s.json"))
    assert back == s and back.compact
    back.check(topo)
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["version"] == 2 and data["transfers"]["chunk"] == []
    explicit_size = (s.expanded().save(tmp_path / "e.json")).stat().st_size
    assert (tmp_path / "s.json").stat().st_size < explicit_size
    assert Schedule.load(tmp_path / "e.json").transfers == s.transfers


def test_compact_and_explicit_give_bit_identical_runtime_results() -> None:
    topo = get_topology("p3.8xlarge")
    s = synthesize("lp", topo, PlanOptions(pipeline=2))
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1013, generator=gen) for _ in range(topo.world_size)]

    def run(schedule: Schedule) -> list[torch.Tensor]:
        def body(tr):
            x = inputs[tr.rank].clone()
            Executor(schedule, tr, timeout_s=20).run(x)
            return x

        return run_ranks(schedule.world_size, body)

    compact, explicit = run(s), run(s.expanded())
    total = torch.stack(inputs).double().sum(0)
    for a, b in zip(compact, explicit):
        assert not isinstance(a, BaseException) and not isinstance(b, BaseException)
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), total, rtol=1e-5, atol=1e-4)


# ---- the structural check catches what the replay catches ---------------------------------------------
def _tree_schedule() -> tuple[object, Schedule]:
    topo = get_topology("p3.8xlarge")
    return topo, synthesize("tree", topo)


def _replace_tree(s: Schedule, **changes) -> Schedule:
    tree = dataclasses.replace(s.trees[0], **changes)
    return dataclasses.replace(s, trees=(tree, *s.trees[1:]))


def _chain(edges: tuple[tuple[int, int], ...]) -> tuple[object, Schedule]:
    """A hand-built tree schedule on switch:4 rooted at rank 0 (every route crosses the switch)."""
    topo = get_topology("switch:4")
    names = topo.ranks
    tree = Tree(1.0, 0, edges, tuple((names[c], "sw0", names[p]) for c, p in edges))
    return topo, Schedule("hand", topo.name, names, (Chunk(0.0, 1.0, 0),), (), trees=(tree,), blocks=(TreeBlock(0, (0,)),))


def test_a_tree_that_does_not_span_is_caught_by_both_checks() -> None:
    topo, good = _chain(((1, 0), (2, 1), (3, 2)))
    good.check(topo)
    good.expanded().check(topo)
    topo, cycle = _chain(((1, 0), (2, 3), (3, 2)))  # 2 and 3 hang on each other, not on the root
    with pytest.raises(ScheduleError, match=r"reaches 2 of 4 ranks \(not rank 2\)"):
        cycle.check(topo)
    with pytest.raises(ScheduleError):
        tree_transfers(cycle.trees[0], (0,), topo.ranks)  # the explicit form cannot even be spelled out


def test_a_rank_with_two_parents_is_named() -> None:
    topo, s = _tree_schedule()
    tree = s.trees[0]
    (c, p), *rest = tree.edges
    other = next(r for r in range(topo.world_size) if r not in (c, p))
    broken = _replace_tree(s, edges=(*tree.edges[:-1], (c, other)), routes=(*tree.routes[:-1], tree.routes[0]))
    with pytest.raises(ScheduleError, match=f"rank {c} has two parents"):
        broken.check(topo)


def test_block_routes_must_follow_links() -> None:
    topo = get_topology("fattree:4")
    s = synthesize("ring", topo)
    b = s.blocks[0]
    assert isinstance(b, RingBlock)
    r0 = b.routes[0]
    short = dataclasses.replace(b, routes=((r0[0], r0[-1]), *b.routes[1:]))
    broken = dataclasses.replace(s, blocks=(short, *s.blocks[1:]))
    with pytest.raises(ScheduleError, match="ring position 0 .* has no such link"):
        broken.check(topo)
    with pytest.raises(ScheduleError, match="has no such link"):
        broken.expanded().check(topo)


def test_ring_order_must_be_a_permutation_and_chunks_belong_to_one_block() -> None:
    topo = get_topology("switch:4")
    s = synthesize("ring", topo)
    b = s.blocks[0]
    dup = dataclasses.replace(b, order=(b.order[0], b.order[0], *b.order[2:]))
    with pytest.raises(ScheduleError, match="not a permutation"):
        dataclasses.replace(s, blocks=(dup, *s.blocks[1:])).check(topo)
    twice = dataclasses.replace(s, blocks=(s.blocks[0], s.blocks[0]))
    with pytest.raises(ScheduleError, match="carried by blocks 0 and 1"):
        twice.check(topo)
    # chunks no block carries: the replay finds them unreduced, naming the chunk
    half = dataclasses.replace(s, blocks=s.blocks[:1])
    missing = next(c for c in range(len(s.chunks)) if c not in s.blocks[0].chunks)
    with pytest.raises(ScheduleError, match=f"full reduction of chunk {missing}"):
        half.check(topo)


def test_chunk_roots_must_match_the_block() -> None:
    topo, s = _tree_schedule()
    wrong = (s.trees[0].root + 1) % topo.world_size
    chunks = (dataclasses.replace(s.chunks[0], root=wrong), *s.chunks[1:])
    with pytest.raises(ScheduleError, match=f"chunk 0 has root rank {wrong}, but block 0 \\(tree\\)"):
        dataclasses.replace(s, chunks=chunks).check(topo)


def test_blocks_are_allreduce_only_and_name_valid_trees() -> None:
    topo, s = _tree_schedule()
    with pytest.raises(ScheduleError, match="compute an allreduce, not a reduce_scatter"):
        dataclasses.replace(s, collective="reduce_scatter")
    bad = dataclasses.replace(s, blocks=(TreeBlock(len(s.trees), s.blocks[0].chunks),))
    with pytest.raises(ScheduleError, match="names tree"):
        bad.check(topo)


def test_fattree16_ring_plans_without_spelling_out_its_transfers() -> None:
    """4.2 M transfers in explicit form; the compact plan holds 2 ring blocks (both directions) of 1024 routes."""
    topo = get_topology("fattree:16")
    s = synthesize("ring", topo)
    assert s.num_transfers == 4 * 1023 * 1024 and [len(b.routes) for b in s.blocks] == [1024, 1024]
    loads = s.link_loads(topo)
    assert loads.cost(topo.directed_costs) == pytest.approx(2 * 1023 / 1024)
    assert "transfers" not in s.__dict__
