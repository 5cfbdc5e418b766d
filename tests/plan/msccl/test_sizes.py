"""MSCCL's set by message size: one replayed algorithm per range, the ranges tiling [0, inf), each range's
algorithm the fastest under the planner's model (brute force over the candidates, each exported on its own)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradsync.errors import MscclError
from gradsync.plan import SYNTHESIZERS, PlanOptions, synthesize
from gradsync.plan.msccl import check_msccl_xml, check_tiling, export_msccl, export_msccl_sizes, parse_msccl_xml
from gradsync.plan.msccl.sizes import DEFAULT_STEP_LATENCY_S, SMALLEST_CLASS
from gradsync.plan.report import latency_term
from gradsync.topology import get_topology


@pytest.mark.parametrize("spec", ["p3.16xlarge", "p3.8xlarge", "racks:2,2,2"])
def test_each_range_runs_the_fastest_export_and_the_ranges_tile_every_size(spec):
    topo = get_topology(spec)
    largest = 1 << 28
    sized = export_msccl_sizes(topo, largest=largest)
    check_tiling([(e.min_bytes, e.max_bytes) for e in sized])
    unit = topo.unit_bandwidth_GBps * 1e9
    times = {}
    for name, entry in SYNTHESIZERS.items():
        if entry.applicable(topo):
            continue
        s = synthesize(name, topo, PlanOptions())
        cost = export_msccl(s, topo).quantization.quantized_cost
        lat = latency_term(s, topo, DEFAULT_STEP_LATENCY_S)
        times[name] = lambda size, cost=cost, lat=lat: cost * size / unit + lat
    size = SMALLEST_CLASS
    while size <= largest:
        for probe in (size // 2 + 1, size):  # the class's ends
            here = [e for e in sized if e.min_bytes <= probe and (e.max_bytes == 0 or probe < e.max_bytes)]
            assert len(here) == 1, (probe, sized)
            assert times[here[0].algorithm](size) <= min(t(size) for t in times.values()) * (1 + 1e-12), (probe, here)
        size *= 2
    for e in sized:  # every file says its range and is an exact allreduce when replayed
        prog = parse_msccl_xml(e.export.xml)
        assert (prog.min_bytes, prog.max_bytes) == (e.min_bytes, e.max_bytes)
        check_msccl_xml(e.export.xml)
    best_bw = max(export_msccl(synthesize(n, topo, PlanOptions()), topo).algbw_GBps for n in times)
    assert sized[-1].export.algbw_GBps == pytest.approx(best_bw)  # large messages: the bandwidth-optimal one


def test_p3_16xlarge_no_longer_runs_ps_for_large_messages():
    sized = export_msccl_sizes(get_topology("p3.16xlarge"))
    assert sized[-1].algorithm != "ps" and sized[-1].export.algbw_GBps > 80


@pytest.mark.parametrize("ranges", [[(1, 0)], [(0, 10), (11, 0)], [(0, 10), (5, 0)], [(0, 10)], [(0, 0), (0, 0)],
                                    [(0, 10), (10, 10), (10, 0)]])
def test_tiling_is_refused_with_a_gap_an_overlap_or_an_open_end(ranges):
    with pytest.raises(MscclError, match="do not tile"):
        check_tiling(ranges)


def test_the_cli_writes_the_set_into_a_directory(tmp_path):
    out = tmp_path / "algos"
    p = subprocess.run([sys.executable, "-m", "gradsync", "plan", "-t", "p3.8xlarge", "-a", "auto", "--export", "msccl",
                        "-o", str(out), "--size", "64MB"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    files = sorted(f.name for f in out.iterdir())
    assert files and all(f.endswith(".xml") for f in files) and files[0].startswith("p3.8xlarge-")
    ranges = sorted((parse_msccl_xml(f.read_text()).min_bytes, parse_msccl_xml(f.read_text()).max_bytes)
                    for f in out.iterdir())
    check_tiling(sorted(ranges, key=lambda r: r[0]))
    file = tmp_path / "a.xml"
    file.write_text("x")
    p = subprocess.run([sys.executable, "-m", "gradsync", "plan", "-t", "p3.8xlarge", "-a", "auto", "--export", "msccl",
                        "-o", str(file)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "is a file" in p.stderr and "Traceback" not in p.stderr
