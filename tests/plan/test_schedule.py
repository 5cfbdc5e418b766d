from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gradsync.errors import ScheduleError
from gradsync.plan import PlanOptions, Schedule, Transfer, synthesize
from gradsync.topology import get_topology


@pytest.fixture
def ps3():
    t = get_topology("switch:3")
    return t, synthesize("ps", t)


def _with(schedule: Schedule, transfers) -> Schedule:
    return dataclasses.replace(schedule, explicit=tuple(transfers), blocks=())


def test_ps_schedule_shape(ps3):
    t, s = ps3
    assert len(s.chunks) == 3 and len(s.transfers) == 3 * 2 * 2
    # Every transfer crosses the switch: host -> sw0 -> host.
    assert all(tr.route[1] == "sw0" and len(tr.route) == 3 for tr in s.transfers)
    s.check(t)


def test_missing_transfer_names_rank_and_chunk(ps3):
    t, s = ps3
    drop = next(i for i, tr in enumerate(s.transfers) if tr.reduce and tr.chunk == 1 and tr.src == 2)
    broken = _with(s, [tr for i, tr in enumerate(s.transfers) if i != drop])
    with pytest.raises(ScheduleError, match=r"rank \d does not end with the full reduction of chunk 1: missing the contribution of rank\(s\) \[2\]"):
        broken.check(t)


def test_double_count_is_caught(ps3):
    t, s = ps3
    extra = next(tr for tr in s.transfers if tr.reduce)
    # The same reduce listed twice: the owner would add that contribution twice.
    broken = _with(s, [*s.transfers, extra])
    with pytest.raises(ScheduleError, match="twice"):
        broken.check(t)


def test_route_must_follow_links(ps3):
    t, s = ps3
    tr = s.transfers[0]
    bad = dataclasses.replace(tr, route=(tr.route[0], tr.route[-1]))
    with pytest.raises(ScheduleError, match="has no such link"):
        _with(s, [bad, *s.transfers[1:]]).check(t)
    with pytest.raises(ScheduleError, match="must start at"):
        _with(s, [dataclasses.replace(tr, route=tr.route[1:]), *s.transfers[1:]]).check(t)


def test_read_write_hazard_in_one_step(ps3):
    t, s = ps3
    # Pull a broadcast into the reduce step: the owner would send a chunk it is still receiving.
    moved = [dataclasses.replace(tr, step=0) if not tr.reduce else tr for tr in s.transfers]
    with pytest.raises(ScheduleError, match="both sent and received in step 0"):
        _with(s, moved).check(t)


def test_send_before_data():
    t = get_topology("ring:3")
    s = synthesize("ring", t)
    # A broadcast whose only transfer starts at a rank that is not the chunk's root.
    forged = [Transfer(0, 1, 2, ("gpu1", "gpu2"), False, 0)]
    b = dataclasses.replace(s, collective="broadcast", explicit=tuple(forged), blocks=())
    with pytest.raises(ScheduleError, match="before holding any data"):
        b.check(t)


@pytest.mark.parametrize("numel", [0, 1, 2, 7, 97, 1000])
def test_chunk_bounds_tile_the_buffer(numel):
    s = synthesize("lp", get_topology("dgx1"), PlanOptions(pipeline=3))
    bounds = s.chunk_bounds(numel)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(lo <= hi for lo, hi in bounds)


@pytest.mark.parametrize("algorithm", ["ring", "ps", "tree", "lp"])
def test_json_roundtrip(tmp_path, algorithm):
    t = get_topology("p2.8xlarge")
    s = synthesize(algorithm, t, PlanOptions(pipeline=2))
    back = Schedule.load(s.save(tmp_path / "s.json"))
    assert back == s
    back.check(t)
    assert np.allclose(back.link_loads(t).directed, s.link_loads(t).directed)


def test_malformed_schedule_file(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('{"type": "gradsync.schedule", "ranks": []}')
    with pytest.raises(ScheduleError, match="malformed schedule"):
        Schedule.load(f)
    f.write_text("[1, 2]")
    with pytest.raises(ScheduleError, match="not a gradsync schedule"):
        Schedule.load(f)


def test_wrong_topology_rejected():
    s = synthesize("ps", get_topology("switch:3"))
    with pytest.raises(ScheduleError, match="plan it again"):
        s.check(get_topology("switch:4"))


def test_dependencies_follow_steps():
    t = get_topology("ring:4")
    s = synthesize("tree", t)
    deps = s.dependencies()
    for i, tr in enumerate(s.transfers):
        for j in deps[i]:
            u = s.transfers[j]
            assert u.dst == tr.src and u.chunk == tr.chunk and u.step < tr.step
    # The root's broadcast waits for every reduce into it.
    root = s.chunks[0].root
    first_bcast = next(i for i, tr in enumerate(s.transfers) if not tr.reduce and tr.src == root)
    into_root = {i for i, tr in enumerate(s.transfers) if tr.reduce and tr.dst == root}
    assert set(deps[first_bcast]) == into_root


def test_pieces_split_every_tensor_by_the_chunk_fractions():
    s = synthesize("ps", get_topology("switch:4"))  # four chunks of 1/4
    numels = [10, 3, 0, 1000]
    pieces = s.pieces(numels)
    assert len(pieces) == 4
    # Every element of every tensor is covered exactly once.
    for i, n in enumerate(numels):
        covered = sorted((a, b) for chunk in pieces for (t, a, b) in chunk if t == i)
        assert sum(b - a for a, b in covered) == n
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    # Shares stay balanced: each chunk gets 1/4 of the big layer, not whole layers.
    assert [sum(b - a for t, a, b in chunk if t == 3) for chunk in pieces] == [250, 250, 250, 250]


def test_schedule_file_limits_depth_and_size(tmp_path, monkeypatch):
    """A schedule file nested 100k deep, or larger than the input limit, is one ScheduleError naming the
    limit and its override (the CLI turns it into one line, exit 2); a real schedule loads as before."""
    topo = get_topology("ring:3")
    good = synthesize("ring", topo).save(tmp_path / "ring.json")
    assert Schedule.load(good).to_dict() == synthesize("ring", topo).to_dict()
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ScheduleError, match="more than 64 deep.*GRADSYNC_MAX_INPUT_DEPTH"):
        Schedule.load(deep)
    monkeypatch.setenv("GRADSYNC_MAX_INPUT_BYTES", "100")
    with pytest.raises(ScheduleError, match=r"more than the limit of 100 bytes.*GRADSYNC_MAX_INPUT_BYTES=\d+"):
        Schedule.load(good)


def test_the_digest_follows_what_moves_and_not_the_name():
    """Equal for the same transfers under another name or meta, or spelled out from blocks; different when one
    transfer's route, step or priority, or one chunk's size, changes (what a simulation of it depends on)."""
    t = get_topology("racks:2,2,2")
    s = synthesize("tree", t, PlanOptions(pipeline=2))
    flat = s.expanded()
    assert dataclasses.replace(s, algorithm="other", meta={"x": 1}).digest == s.digest == flat.digest
    first = flat.transfers[0]
    other_route = next(tr.route for tr in flat.transfers if tr.route != first.route)
    changed = [
        _with(flat, [dataclasses.replace(first, route=other_route), *flat.transfers[1:]]),
        _with(flat, [dataclasses.replace(first, step=first.step + 1), *flat.transfers[1:]]),
        _with(flat, [dataclasses.replace(first, priority=first.priority + 1), *flat.transfers[1:]]),
        dataclasses.replace(flat, chunks=(dataclasses.replace(flat.chunks[0], size=0.4),
                                          dataclasses.replace(flat.chunks[1], offset=0.4, size=0.6))),
    ]
    digests = {c.digest for c in changed}
    assert s.digest not in digests and len(digests) == len(changed)
