"""Reduce-scatter and allgather as MSCCL algorithms (issue 14 part 3, steps 4-5): the export, the replay
checker's post-conditions for ``coll="reducescatter"`` / ``"allgather"`` (msccl-tools' layouts), and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradsync.errors import MscclError
from gradsync.plan import SYNTHESIZERS, PlanOptions, synthesize
from gradsync.plan.msccl import check_msccl_xml, export_msccl, parse_msccl_xml
from gradsync.topology.io import get_topology

SHARDED = ("reduce_scatter", "allgather")
COLL = {"reduce_scatter": "reducescatter", "allgather": "allgather"}


@pytest.mark.parametrize("spec", ["switch:3", "p3.8xlarge", "bcube:2,2", "racks:2,2,2", "ring:5"])
@pytest.mark.parametrize("collective", SHARDED)
def test_every_planner_exports_a_replayable_sharded_algorithm(spec, collective):
    topo = get_topology(spec)
    n = topo.world_size
    for name, entry in SYNTHESIZERS.items():
        if entry.applicable(topo) or collective not in entry.collectives:
            continue
        export = export_msccl(synthesize(name, topo, PlanOptions(collective=collective)), topo)
        prog = parse_msccl_xml(export.xml)
        k = prog.nchunksperloop
        assert prog.coll == COLL[collective] and k % n == 0, name
        # msccl-tools' buffer sizes: reduce-scatter input K, output K/N; allgather input K/N, output K
        want = (k, k // n) if collective == "reduce_scatter" else (k // n, k)
        assert {(g.i_chunks, g.o_chunks) for g in prog.gpus} == {want}, name
        check_msccl_xml(export.xml)


def test_p3_8xlarge_sharded_bandwidth_from_the_files_chunk_counts():
    """lp's out-trees quantize exactly on p3.8xlarge: 133.3 GB/s each (the cut's 3/16 of the 25 GB/s unit)."""
    topo = get_topology("p3.8xlarge")
    for collective in SHARDED:
        export = export_msccl(synthesize("lp", topo, PlanOptions(collective=collective)), topo)
        assert export.quantization.loss == pytest.approx(0.0, abs=1e-9)
        assert export.algbw_GBps == pytest.approx(25.0 / (3 / 16))


# msccl-tools-style 3-GPU rings (old format, in-place), written by hand, independent of the exporter.
def _ring(coll: str, broken: bool = False) -> str:
    gpus = []
    for g in range(3):
        nxt, prv = (g + 1) % 3, (g - 1) % 3
        if coll == "allgather":  # GPU g's shard is o[g]; copy around the ring
            steps = [("s", g), ("rrcs" if broken else "rcs", prv), ("r", (g - 2) % 3)]
            buf, sizes = "o", 'i_chunks="1" o_chunks="3"'
        else:  # chunk c starts at c+1 and ends, summed, at its owner c (input index = chunk)
            steps = [("s", prv), ("rrs", (g - 2) % 3), ("rrc", g)]
            if broken:
                steps = steps[:2]  # the last receive is missing: the owner never gets its shard summed
            buf, sizes = "i", 'i_chunks="3" o_chunks="1"'
        body = "".join(f'<step s="{i}" type="{t}" srcbuf="{buf}" srcoff="{c}" dstbuf="{buf}" dstoff="{c}" cnt="1" '
                       f'depid="-1" deps="-1" hasdep="0"/>' for i, (t, c) in enumerate(steps))
        gpus.append(f'<gpu id="{g}" {sizes} s_chunks="0"><tb id="0" send="{nxt}" recv="{prv}" chan="0">{body}</tb></gpu>')
    return (f'<algo name="ring" proto="Simple" nchannels="1" nchunksperloop="3" ngpus="3" coll="{coll}" '
            f'inplace="1">{"".join(gpus)}</algo>')


@pytest.mark.parametrize("coll", ["reducescatter", "allgather"])
def test_hand_written_msccl_tools_rings_pass(coll):
    stats = check_msccl_xml(_ring(coll))
    assert stats.modes == ("in-place",) and stats.steps == 9


def test_broken_sharded_algorithms_are_named():
    with pytest.raises(MscclError, match=r"GPU \d, thread block 0, step 1 \(rrcs\)") as exc:
        check_msccl_xml(_ring("allgather", broken=True))  # adds into a chunk that holds nothing yet
    assert "before" in str(exc.value)
    with pytest.raises(MscclError, match="not its shard's full reduction|never|missing") as exc:
        check_msccl_xml(_ring("reducescatter", broken=True))
    assert "GPU" in str(exc.value)
    with pytest.raises(MscclError, match="MSCCL spells it 'reducescatter'"):
        check_msccl_xml(_ring("reducescatter").replace('coll="reducescatter"', 'coll="reduce_scatter"'))
    with pytest.raises(MscclError, match="multiple of 3"):
        check_msccl_xml(_ring("allgather").replace('nchunksperloop="3"', 'nchunksperloop="4"'))
    with pytest.raises(MscclError, match="needs at least 1 and 3"):
        check_msccl_xml(_ring("allgather").replace('o_chunks="3"', 'o_chunks="2"'))
    # an allgather that reduces counts a finished shard twice
    twice = _ring("allgather").replace('type="r" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2"',
                                       'type="rrc" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2"', 1)
    with pytest.raises(MscclError, match="reads|twice"):
        check_msccl_xml(twice)


def test_export_chunk_count_must_split_into_shards():
    topo = get_topology("p3.8xlarge")
    sched = synthesize("ring", topo, PlanOptions(collective="allgather"))
    with pytest.raises(MscclError, match="not a multiple of the 4 GPUs.*use 4 or 8"):
        export_msccl(sched, topo, nchunksperloop=6)


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_cli_plan_collective_export_and_errors(tmp_path):
    out = tmp_path / "rs.xml"
    p = _cli("plan", "-t", "p3.8xlarge", "-a", "lp", "--collective", "reduce_scatter", "--export", "msccl", "-o",
             str(out), "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["collective"] == "reduce_scatter" and rep["gap"] == pytest.approx(0, abs=1e-9)
    assert rep["algbw_GBps"] == pytest.approx(133.333, abs=1e-3) and rep["msccl"]["loss"] == pytest.approx(0, abs=1e-9)
    assert parse_msccl_xml(out.read_text()).coll == "reducescatter"
    sched = tmp_path / "ag.json"
    p = _cli("plan", "-t", "bcube:2,2", "-a", "bml", "-c", "allgather", "-o", str(sched), cwd=tmp_path)
    assert p.returncode == 0 and "allgather" in p.stdout and "gap 0.00%" in p.stdout, p.stderr
    p = _cli("simulate", "-t", "bcube:2,2", "--schedule", str(sched), "--json", cwd=tmp_path)
    assert p.returncode == 0 and json.loads(p.stdout)["sim_over_planned"] == pytest.approx(1.0, abs=0.05), p.stderr
    p = _cli("plan", "-t", "p3.8xlarge", "-a", "tree", "--collective", "gather", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert p.stderr.startswith("gradsync: error: collective='gather'") and "reduce_scatter, allgather" in p.stderr
    p = _cli("plan", "-t", "p3.8xlarge", "-a", "ring", "-c", "allgather", "--export", "msccl", "-o", str(out),
             "--chunks-per-loop", "6", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "use 4 or 8" in p.stderr
    p = _cli("plan", "-t", "switch:4", "-a", "bml", "-c", "allgather", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "does not apply" in p.stderr
