"""Reduce-scatter and allgather simulated and run (issue 14 part 3, step 3): the event simulator's time equals
the planned cost, and the runtime gives torch.distributed's exact results in-process for every synthesizer
that plans them (the gloo multi-process run is in tests/comm/test_dist.py)."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm import Runtime, run_ranks
from gradsync.errors import GradsyncError
from gradsync.plan import PlanOptions, synthesize
from gradsync.sim.choose import algorithms_for
from gradsync.sim.engine import simulate
from gradsync.topology.io import get_topology

SHARDED = ("reduce_scatter", "allgather")


def _planners(topology: str, collective: str) -> list[str]:
    return algorithms_for(get_topology(topology), collective)


@pytest.mark.parametrize("spec", ["p3.8xlarge", "bcube:2,2", "racks:2,2,2"])
@pytest.mark.parametrize("collective", SHARDED)
def test_streaming_simulation_equals_the_planned_cost(spec, collective):
    """Without latency, chunks stream, so the event simulator's time is the fluid cost * S / unit_bw."""
    topo = get_topology(spec)
    size = 1e8
    for name in _planners(spec, collective):
        if name == "auto":
            continue
        s = synthesize(name, topo, PlanOptions(collective=collective, pipeline=4))
        want = s.link_loads(topo).cost(topo.directed_costs) * size / (topo.unit_bandwidth_GBps * 1e9)
        assert simulate(s, topo, size, latency=False).time_s == pytest.approx(want, rel=1e-6), name


def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(numel, dtype=torch.float64) % 97) * (rank + 1) + 3 * rank).to(dtype)


def _check_every_planner(topology: str, world: int, mapping: list[int] | None = None) -> None:
    names = sorted(set(_planners(topology, "reduce_scatter")) & set(_planners(topology, "allgather")))

    def body(tr):
        rt = Runtime(tr, topology, "ring", timeout_s=30, mapping=mapping, options=PlanOptions(pipeline=2))
        bad = []
        try:
            for name in names:
                for dtype in (torch.float32, torch.int64):
                    for k in (0, 1, 7, 250):
                        x = _data(tr.rank, world * k, dtype)
                        keep = x.clone()
                        out = torch.empty(k, dtype=dtype)
                        rt.reduce_scatter_tensor(out, x, algorithm=name)
                        full = sum(_data(r, world * k, torch.float64) for r in range(world))
                        if not (torch.equal(out.double(), full[tr.rank * k:(tr.rank + 1) * k]) and torch.equal(x, keep)):
                            bad.append(f"reduce_scatter {name} {dtype} {k}")
                        mine = _data(tr.rank, k, dtype)
                        got = torch.full((world * k,), -1, dtype=dtype)
                        rt.all_gather_into_tensor(got, mine, algorithm=name)
                        if not torch.equal(got, torch.cat([_data(r, k, dtype) for r in range(world)])):
                            bad.append(f"allgather {name} {dtype} {k}")
                avg = torch.empty(3, dtype=torch.float64)
                rt.reduce_scatter_tensor(avg, torch.full((3 * world,), float(tr.rank + 1), dtype=torch.float64), "avg",
                                         algorithm=name)
                if not torch.allclose(avg, torch.full((3,), (world + 1) / 2, dtype=torch.float64)):
                    bad.append(f"avg {name}")
            shard = rt.reduce_scatter(torch.ones(2 * world))  # the convenience form: a new shard
            if not torch.equal(shard, torch.full((2,), float(world))):
                bad.append("reduce_scatter()")
        finally:
            rt.shutdown()
        return bad

    for rank, got in enumerate(run_ranks(world, body, timeout_s=120)):
        assert got == [], (rank, got)
    assert {"ring", "ps", "tree", "lp", "auto"} <= set(names)


@pytest.mark.parametrize("topology,world", [("switch:2", 2), ("p3.8xlarge[0,1,2]", 3), ("bcube:2,2", 4)])
def test_runtime_gives_torch_results_for_every_planner(topology, world):
    _check_every_planner(topology, world)


def test_a_rank_mapping_keeps_process_rank_shards():
    """Topology rank r runs on process mapping[r]; process p still gets the p-th slice, as torch does."""
    _check_every_planner("p3.8xlarge", 4, mapping=[2, 0, 3, 1])


def test_bad_shapes_and_collectives_are_named():
    def body(tr):
        rt = Runtime(tr, "switch:2", "ring", timeout_s=10)
        try:
            with pytest.raises(GradsyncError, match=r"input must have world_size\(2\) x 3 = 6"):
                rt.reduce_scatter_tensor(torch.empty(3), torch.empty(5))
            with pytest.raises(TypeError, match="input is torch.float32 .* but output is torch.float64"):
                rt.all_gather_into_tensor(torch.empty(4, dtype=torch.float64), torch.empty(2))
            with pytest.raises(GradsyncError, match="pad the tensor to 4 elements"):
                rt.reduce_scatter(torch.empty(3))
            with pytest.raises(GradsyncError, match="'bml' does not apply|does not plan"):
                rt.sharded_executor("allgather", "bml")
        finally:
            rt.shutdown()
        return True

    assert run_ranks(2, body) == [True, True]
