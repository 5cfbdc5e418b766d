"""compression="auto" on a live optimizer (issue 40), one rank, a fake wire and a fake clock: measuring drops a
codec slower than none, the choices are cached for the next job and ignored when the wire or the parameters change."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.comm.local import LocalFabric
from gradsync.comm.runtime import Runtime
from gradsync.compress.auto import TRY_GAIN, AlphaBeta, quicker_by, whole_steps_lose
from gradsync.compress.base import CompressionError, TensorInfo
from gradsync.errors import GradsyncError
from gradsync.train.auto_compression import PLANNED, PROBE_STEPS, AutoCompression, param_signature
from gradsync.train.optimizer import DistributedOptimizer
from tests.train.fake_clock import FakeClock


@dataclass(frozen=True)
class AnyWorldWire:
    """A slow wire that prices one rank as if it had peers (AlphaBeta's one rank costs nothing)."""

    seconds_per_byte: float

    def __call__(self, collective: str, nbytes: float, world: int) -> float:
        return nbytes * self.seconds_per_byte

    def to_dict(self) -> dict:
        return {"type": "test.wire", "seconds_per_byte": self.seconds_per_byte}


SLOW = AnyWorldWire(1e-3)


def _slow_any_world(collective: str, nbytes: float, world: int) -> float:
    return nbytes * 1e-3  # one rank has no wire: price it as if it had a slow one


@pytest.fixture(autouse=True)
def _casts_time_none_first(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Most tests here follow a group through timing "none" and then its codec, on wires that price fp16 exactly 2x
    ahead (free codecs): a cast's own trust (CAST_MARGIN, which would time fp16 alone) is off unless the test is
    marked ``cast_trust``."""
    if request.node.get_closest_marker("cast_trust") is None:
        from gradsync.compress.auto import MARGIN
        from gradsync.train import auto_compression

        monkeypatch.setattr(auto_compression, "CAST_MARGIN", MARGIN)


@pytest.fixture(autouse=True)
def _two_launches_a_trial(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """The fake clocks here charge per clock call, so a trial's first launch (more calls) reads longer than its second:
    the third launch disagreeing launches get (``wants_another``: a codec's, or quick ones) is off unless the test is
    marked ``third_launch``, so the step counts below stay those of two launches a trial."""
    if request.node.get_closest_marker("third_launch") is None:
        from gradsync.train import auto_compression

        monkeypatch.setattr(auto_compression, "wants_another", lambda times_s, probe_steps, **_: False)


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    """One rank whose exchanges never count as settling: the fake clocks below charge a launch by its codec only,
    so a first call's planning costs nothing here (what it does to a trial: ``settling_rt``)."""
    monkeypatch.setattr(Runtime, "settling", property(lambda self: 0))
    runtime = Runtime(LocalFabric(1).transport(0))
    yield runtime
    runtime.shutdown()


@pytest.fixture
def settling_rt() -> Iterator[Runtime]:
    """One rank, its settling counter as the runtime keeps it."""
    runtime = Runtime(LocalFabric(1).transport(0))
    yield runtime
    runtime.shutdown()


def _model(wide: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, wide), torch.nn.ReLU(), torch.nn.Linear(wide, 2))


def _before_close(auto: AutoCompression, rest: Callable[[list], None]) -> None:
    """Make ``auto`` run ``rest(launches)`` as each step closes, once the step's groups' own times are in and before
    the step is closed (once a step): what the rest of that step costs, outside the groups' own timings."""
    close_step = auto.close_step

    def closing() -> None:
        auto._wait_records()
        if auto._closed_at is None:
            rest(auto._this_step)
        close_step()

    auto.close_step = closing  # type: ignore[method-assign]


def _train(rt: Runtime, auto: AutoCompression, steps: int, wide: int = 16,
           merge: int | str = 2) -> tuple[DistributedOptimizer, list[str]]:
    model = _model(wide)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto, merge=merge)
    first: list[str] = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        if step == 0:
            first = [c for c in (auto.current,)]
        opt.step()
        opt.zero_grad()
    return opt, first


def _auto(rt: Runtime, clock: FakeClock, wire=_slow_any_world, signature=None) -> AutoCompression:
    auto = AutoCompression("cast", runtime=rt, wire=wire, codec_cost=lambda codec, numel: 0.0, clock=clock,
                           signature=signature)
    clock.auto = auto
    return auto


@pytest.mark.cast_trust
@pytest.mark.parametrize("fp16_s, trusted", [(1e-4, False), (1.0, True)])
def test_a_choice_measured_slower_than_none_is_dropped(rt: Runtime, fp16_s: float, trusted: bool) -> None:
    """The slow wire prices fp16 2x ahead of "none"; on the clock it is slower. Not trusted on a cast's margin (the
    optimizer's, where its search saw no gain), "none" is timed first and the review drops fp16 (100x slower, seconds
    far under the wire's). Trusted (CAST_MARGIN), fp16 runs first; measured beyond 1/CAST_MARGIN of "none"'s price
    (1 s a call against the wire's 0.2-0.5 s), it breaks the trust: "none" is timed after all, and the review drops
    fp16 the same way."""
    from gradsync.compress.auto import MARGIN

    clock = FakeClock({"none": 1e-6, "other": fp16_s})
    auto = _auto(rt, clock)
    if not trusted:
        auto.cast_margin = MARGIN
    _train(rt, auto, 3 * PROBE_STEPS + 1)
    rows = auto.table()
    assert len(rows) == 2 and auto.settled
    for row in rows:  # the slow wire made the model pick fp16; measuring dropped it
        assert (row["codec"], row["reason"]) == ("none", "dropped"), rows
        assert list(auto._groups[row["group"]].times) == (["fp16", "none"] if trusted else ["none", "fp16"])
    assert "dropped" in auto.report() and "predicted us" in auto.report()


def test_a_choice_measured_faster_than_none_is_kept(rt: Runtime) -> None:
    clock = FakeClock({"none": 1e-4, "other": 1e-6})
    auto = _auto(rt, clock)
    _train(rt, auto, 2 * PROBE_STEPS + 1)
    rows = auto.table()
    assert [(r["codec"], r["reason"]) for r in rows] == [("fp16", "measured")] * 2
    assert all(r["measured_s"] is not None and r["predicted_s"] > 0 for r in rows)


@pytest.mark.third_launch
@pytest.mark.parametrize(("counted", "charged", "extra_s"),
                         [(True, 2, 1e-3), (False, 2, 1e-3), (False, 1, 1e-3), (False, 1, 1.0)])
def test_a_launch_timed_while_the_runtime_settled_its_exchange_waits_for_a_settled_one(
        monkeypatch: pytest.MonkeyPatch, counted: bool, charged: int, extra_s: float) -> None:
    """fp16's first two launches per group cost ``extra_s`` (1 ms) each (its payload's first calls: priced, planned,
    explored), later ones 0.1 us, "none" 1 us a call. Counted as settling (the runtime's counter grew across them),
    those launches are kept apart and the trial runs two more: fp16 is kept. Were they counted in (``counted=False``:
    the counter stands still), their 1 ms would drop fp16 for "none" (both of the trial's launches are slow, so is
    their median). One slow launch of the two (``charged=1``), counted in, leaves fp16 kept all the same: two
    launches 10,000x apart get a third (``wants_another``), and the median of the three reads 0.1 us, where the mean
    of the two read 0.5 ms and dropped it. A codec's trial takes that third launch however slow the off one is
    (``extra_s=1.0``, far above ``QUICK_LAUNCH_S``)."""
    settled = [0]
    monkeypatch.setattr(Runtime, "settling", property(lambda self: settled[0]))
    runtime = Runtime(LocalFabric(1).transport(0))
    slow: dict[str, int] = {}  # per group, its fp16 launches charged
    seen: list[object] = []  # the launches whose clock reading after launching (t1) was taken

    class SettlingClock(FakeClock):
        def __call__(self) -> float:
            launches = self.auto._this_step if self.auto is not None else []
            if threading.current_thread() is threading.main_thread() and launches:
                launch = launches[-1]
                if launch.codec == "fp16" and not any(launch is x for x in seen):  # this launch's t1
                    seen.append(launch)
                    if slow.get(launch.key, 0) < charged:
                        slow[launch.key] = slow.get(launch.key, 0) + 1
                        settled[0] += counted
                        self.now += extra_s
                        return self.now
            return super().__call__()

    try:
        clock = SettlingClock({"none": 1e-6, "fp16": 1e-7, "other": 1e-7})
        auto = _auto(runtime, clock)
        # the groups' own choices only: whole steps here read however many clock calls land on this thread, which
        # varies with the exchanges' threads, and the whole-step check would decide on that (test_settled_codecs...)
        auto.verified = True
        # one group: two groups' exchanges overlap, and one's slow launch could bump the counter across the other's
        _train(runtime, auto, 2 * PROBE_STEPS + 6, wide=8, merge=1)
        (row,) = auto.table()
    finally:
        runtime.shutdown()
    assert auto.settled, row
    # a settled fp16 launch reads the clock a few times (0.1 us each; how many depends on which thread runs its done
    # callback), far under the slow launches' extra_s: its time is one of those, not a slow one's
    quick = 1e-4
    if counted:
        assert (row["codec"], row["reason"], row["settling_launches"]) == ("fp16", "measured", 2), row
        assert row["measured_s"] < quick, row
    elif charged == 2:
        assert (row["codec"], row["reason"], row["settling_launches"]) == ("none", "dropped", 0), row
    else:
        assert (row["codec"], row["reason"], row["settling_launches"]) == ("fp16", "measured", 0), row
        assert row["measured_s"] < quick, row


@pytest.mark.parametrize("fp16_s, kept", [(1e-5, False), (1e-7, True)])
def test_a_trial_whose_exchange_never_settles_ends_early_only_where_it_clearly_loses(
        monkeypatch: pytest.MonkeyPatch, fp16_s: float, kept: bool) -> None:
    """Every fp16 launch is timed while the runtime settles (its counter moves across each, as while an explorer runs
    one candidate a launch), "none" 1 us a clock call. At 10 us a call, fp16's trial ends after SETTLING_READINGS
    launches, not the whole SETTLING_LAUNCHES (cut to 8 here) it may wait for a settled one, and the group drops it.
    At 0.1 us, quicker than "none", it waits them out and is kept on those rough times."""
    import itertools

    from gradsync.train import auto_compression
    from gradsync.train.auto_compression import SETTLING_READINGS

    monkeypatch.setattr(auto_compression, "SETTLING_LAUNCHES", 8)
    assert SETTLING_READINGS < PROBE_STEPS + 8
    ticks, owner = itertools.count(1), []
    monkeypatch.setattr(Runtime, "settling", property(
        lambda self: next(ticks) if owner and owner[0].current == "fp16" else 0))
    runtime = Runtime(LocalFabric(1).transport(0))
    try:
        clock = FakeClock({"none": 1e-6, "fp16": fp16_s, "other": fp16_s})
        auto = _auto(runtime, clock)
        owner.append(auto)
        auto.verified = True  # the groups' own choices only (as in the test above)
        _train(runtime, auto, 2 * PROBE_STEPS + 14, wide=8, merge=1)
        (row,) = auto.table()
    finally:
        runtime.shutdown()
    assert auto.settled and auto.trials[row["group"]] == ["none", "fp16"], (row, auto.trials)
    assert len(auto.trial_times[row["group"]]["fp16"]) == 0, auto.trial_times  # no settled launch
    if kept:
        assert (row["codec"], row["reason"], row["settling_launches"]) == ("fp16", "measured", PROBE_STEPS + 8), row
    else:
        assert (row["codec"], row["reason"], row["settling_launches"]) == ("none", "dropped", SETTLING_READINGS), row


def test_an_infinitely_fast_wire_runs_none_without_a_trial(rt: Runtime) -> None:
    clock = FakeClock({"none": 1e-6, "other": 1e-6})
    auto = _auto(rt, clock, wire=AlphaBeta(0.0, float("inf")))
    _train(rt, auto, PROBE_STEPS + 1)
    assert auto.settled and {r["codec"] for r in auto.table()} == {"none"}


def test_cached_choices_are_reused_and_ignored_after_a_change(rt: Runtime, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADSYNC_CACHE", str(tmp_path))
    sig = param_signature(_model().named_parameters())
    auto = _auto(rt, FakeClock({"none": 1e-4, "other": 1e-6}), wire=SLOW, signature=sig)
    _train(rt, auto, 2 * PROBE_STEPS + 1)
    assert not auto.cached and {c.codec for c in auto.choices.values()} == {"fp16"}
    assert len(list(tmp_path.glob("compression-auto-*.json"))) == 1

    # the next job: same parameters, wire and device -> decided from its first step, nothing measured
    again = _auto(rt, FakeClock({"none": 1e-6, "other": 1e-4}), wire=SLOW, signature=sig)
    _, first = _train(rt, again, 1)
    assert again.cached and first == ["fp16"] and again.settled
    assert {r["reason"] for r in again.table()} == {"cached"}

    # another wire model: the cache does not apply
    other_wire = _auto(rt, FakeClock({"none": 1e-6, "other": 1e-6}), wire=AnyWorldWire(2e-3), signature=sig)
    _, first = _train(rt, other_wire, 1)
    assert not other_wire.cached and first == ["none"]

    # another parameter signature (a wider hidden layer): the cache does not apply
    wide = param_signature(_model(wide=32).named_parameters())
    other_model = _auto(rt, FakeClock({"none": 1e-6, "other": 1e-6}), wire=SLOW, signature=wide)
    _, first = _train(rt, other_model, 1, wide=32)
    assert not other_model.cached and first == ["none"]


def test_bad_arguments_are_refused(rt: Runtime) -> None:
    with pytest.raises(CompressionError, match="allow='some'"):
        AutoCompression("some", runtime=rt)
    with pytest.raises(CompressionError, match="probe_steps=0"):
        AutoCompression(runtime=rt, probe_steps=0)
    model = _model()
    with pytest.raises(GradsyncError, match="allow='cast' only applies"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt, compression="fp16", allow="cast")
    with pytest.raises(GradsyncError, match="memory='residual'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt, compression="auto",
                             memory="residual")
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression="auto", allow="any")
    assert isinstance(opt.compression, AutoCompression) and opt.compression.allow == "any"
    opt.remove_hooks()


def test_auto_refuses_a_transport_that_cannot_share_its_decision() -> None:
    """Two ranks of the in-process fabric have no job-wide decide: each would choose from its own timings."""
    fabric = LocalFabric(2)
    runtimes = [Runtime(fabric.transport(r)) for r in range(2)]
    try:
        assert runtimes[0].caps.decide is None
        auto = AutoCompression(runtime=runtimes[0])
        with pytest.raises(CompressionError, match="shares one decision"):
            auto._decide("choose/g0", lambda: b"{}")
    finally:
        for runtime in runtimes:
            runtime.shutdown()


def test_two_autos_on_one_runtime_never_share_a_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuilt model's AutoCompression names the same groups as the first one's: its job-wide decisions must not
    read the first one's (a rank reading a stale choice would exchange another codec than its peers)."""
    from types import SimpleNamespace

    keys: list[str] = []
    fake = SimpleNamespace(world_size=2, caps=SimpleNamespace(decide=object()),
                           plans=SimpleNamespace(decide=lambda key, compute: keys.append(key) or compute()))
    monkeypatch.setattr(AutoCompression, "runtime", property(lambda self: fake))
    first, second = AutoCompression("cast", cache=False), AutoCompression("cast", cache=False)
    assert first._decide("choose/g", lambda: b"a") == b"a" and second._decide("choose/g", lambda: b"b") == b"b"
    assert len(set(keys)) == 2 and all(k.endswith("/choose/g") for k in keys), keys


@pytest.mark.parametrize("wire, compressed", [(AlphaBeta(0.0, float("inf")), False), (SLOW, True)])
def test_merge_auto_chooses_the_partition_with_the_codec(rt: Runtime, wire, compressed: bool) -> None:
    """merge="auto" with compression="auto": after the timed first step the partition comes from the joint search
    on auto's wire and codec costs, and training goes on in its groups."""
    clock = FakeClock({"none": 1e-6, "other": 1e-6})
    auto = AutoCompression("cast", runtime=rt, wire=wire, codec_cost=lambda codec, numel: 0.0 if codec == "none"
                           else 1e-6, clock=clock, cache=False)
    clock.auto = auto
    opt, _ = _train(rt, auto, 2 * PROBE_STEPS + 2, merge="auto")
    joint = auto.joint
    assert joint is not None and opt.partition == joint.partition and joint.partition.n == 4
    assert (joint.codec != "none") is compressed, joint
    assert joint.predicted_s == min(joint.per_codec_s.values())
    if compressed:  # a slow wire: fp16 halves the bytes; each group's codec call costs 1 us, so fewer groups
        assert joint.partition.num_groups < 4 and joint.per_codec_s["fp16"] < joint.per_codec_s["none"]
    # the groups that trained are the partition's: auto's table has one row per group
    assert len(auto.table()) == joint.partition.num_groups


@pytest.mark.filterwarnings("ignore:gradsync. a gradient of the step")
@pytest.mark.parametrize("backend", [False, True])
def test_merge_autos_calibration_steps_run_uncompressed_outside_every_choice(rt: Runtime, monkeypatch, backend) -> None:
    """merge="auto"'s two calibration steps run groups that are thrown away after them: DDP's buckets (here one),
    each averaged outside every choice (the backend's allreduce where it takes it, else the "none" exchange), and auto
    records, times and decides nothing for them -- the first step's dtype (on this slow wire, fp16), the partition,
    and whether the timed step may stand for DDP's buckets, are its only decisions. The untimed first step sums its
    buckets in fp16 on the backend (checked: a NaN skips the step), or, where the backend takes nothing, on the "none"
    step's exchange (its marks: skipped too). The timed step sends them uncompressed, DDP's own way: on the backend's
    allreduce the sum is not checked, as without compression, and a NaN step is taken, NaN and all. (Layer-wise, and
    priced, timed and profiled for like the job's own groups, LeNet-5's ten tensors cost its first two steps 3-6x a
    settled one on switch:4.)"""
    import gradsync.train.auto_compression as ac

    if backend:
        _with_planned_none(rt, monkeypatch)
    casts: list[torch.dtype] = []  # the casts the backend summed
    real_cast = ac.native_cast_sum_async

    def cast_sum(runtime, flat, wire, **kw):
        fut = real_cast(runtime, flat, wire, **kw)
        if fut is not None:
            casts.append(wire)
        return fut

    monkeypatch.setattr(ac, "native_cast_sum_async", cast_sum)
    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0 if c == "none" else 1e-6,
                           cache=False)
    keys: list[str] = []
    real = auto._decide

    def spy(key, compute):
        keys.append(key)
        return real(key, compute)

    monkeypatch.setattr(auto, "_decide", spy)
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto, merge="auto")
    before = [p.detach().clone() for p in model.parameters()]
    _skips_a_nan_step(model, opt)
    assert casts == ([torch.float16] if backend else [])  # where the backend takes nothing, the "none" exchange
    opt.zero_grad()
    if backend:
        _takes_a_nan_step(model, opt)
        with torch.no_grad():  # the weights back, for the steps that follow
            for a, p in zip(before, model.parameters()):
                p.copy_(a)
    else:
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        opt.step()
    assert casts == ([torch.float16] if backend else [])  # the timed step uncompressed
    assert keys == ["calibration-wire/1", "calibration-stands", "joint/4"] and not auto._groups and auto.joint is not None, (keys, list(auto._groups))
    assert auto.native_launches == (2 if backend else 0)  # one bucket a step
    for step in range(2 * PROBE_STEPS + 2):  # then the partition's own groups are chosen for as usual
        opt.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(2 + step))).square().sum().backward()
        opt.step()
    assert len(auto.table()) == auto.joint.partition.num_groups and any(k.startswith("first/") for k in keys), keys


@pytest.mark.parametrize("backend, host", [(False, True), (True, True), (True, False)])
def test_the_timed_calibration_steps_collectives_time_in_flight_reaches_the_joint_search(rt: Runtime, monkeypatch,
                                                                                          backend, host) -> None:
    """The timed calibration step records how long its groups' collectives were in flight (each from its launch to
    its future's end; here one bucket whose collective is held 80 ms), and the partition's search gets it beside the
    step's time, to read a slow wire as the wire's (choose_joint's ``observed_busy_s``). The untimed first step is not
    recorded, and nothing is recorded once the partition is chosen. Where a future's end is not the collective's
    (``host`` False: a GPU's buffers, whose NCCL futures end once queued), nothing is recorded and the search fits
    the step as before."""
    import gradsync.train.auto_compression as ac
    import gradsync.train.grouped as grouped
    import gradsync.train.optimizer as optimizer_module
    from gradsync.comm.runtime import Work

    assert grouped.ends_on_host(torch.zeros(1)) and not grouped.ends_on_host(torch.zeros(1, device="meta"))
    if not host:
        monkeypatch.setattr(grouped, "ends_on_host", lambda buf: False)
    if backend:
        _with_planned_none(rt, monkeypatch)
    held: list[float] = []
    real_launch = AutoCompression.plain_launch

    def held_launch(self, *a, **k):
        work = real_launch(self, *a, **k)
        later = torch.futures.Future()
        hold = 0.08 if held else 0.0  # the untimed step's collective is not held
        held.append(hold)

        def finish() -> None:
            time.sleep(hold)
            later.set_result(work.wait())

        threading.Thread(target=finish, daemon=True).start()
        return Work(later, work.name)

    monkeypatch.setattr(AutoCompression, "plain_launch", held_launch)
    spans: list[list] = []
    real_busy = optimizer_module.busy_seconds
    monkeypatch.setattr(optimizer_module, "busy_seconds", lambda timeline: (spans.extend(timeline),
                                                                            real_busy(timeline))[1])
    searched: list[dict] = []
    real_joint = ac.choose_joint
    monkeypatch.setattr(ac, "choose_joint", lambda *a, **k: (searched.append(k), real_joint(*a, **k))[1])
    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0 if c == "none" else 1e-6,
                           cache=False)
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto, merge="auto")
    for step in range(4):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    (kw,) = searched
    if not host:
        assert held[:2] == [0.0, 0.08] and not spans and kw["observed_busy_s"] is None, (held, spans, kw)
        return
    assert held[:2] == [0.0, 0.08] and len(spans) == 1, (held, spans)  # one bucket, the timed step's
    (start, end), = spans
    assert end - start >= 0.08
    seconds = kw["observed"][1]
    assert kw["observed_busy_s"] == pytest.approx(end - start) and 0.08 <= kw["observed_busy_s"] <= seconds, kw
    assert opt._groups.timeline is None and (opt._buckets is None or opt._buckets.timeline is None)


def test_busy_seconds_is_the_union_of_the_spans() -> None:
    from gradsync.train.grouped import busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([[3.0, 4.0], [0.0, 1.0], [0.5, 2.0]]) == pytest.approx(3.0)  # side by side count once
    assert busy_seconds([[0.0, 2.0], [0.5, 1.0]]) == pytest.approx(2.0)  # one inside another
    assert busy_seconds([[0.0, 1.0], [1.0, 1.5]]) == pytest.approx(1.5)
    assert busy_seconds([[0.0, 1.0], [0.5, None]]) is None  # not done


def test_the_codec_profile_is_cached_per_device_and_codecs_and_widened_when_a_group_falls_outside(rt, tmp_path,
                                                                                                  monkeypatch):
    """The first job profiles the allowed codecs on the fixed points covering its groups and writes them; the next
    job (same device, dtype, torch, codecs) reads them and measures nothing; another policy (other codecs) misses;
    a range outside the points profiles again on the wider points; a corrupt file warns and profiles again."""
    import gradsync.train.auto_compression as ac
    from gradsync.compress.auto import profile_ladder

    monkeypatch.setenv("GRADSYNC_CACHE", str(tmp_path))
    calls: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
    real = ac.profile_codecs

    def counting(options, sizes, dtype, **kw):
        calls.append((tuple(o.name for o in options), tuple(sizes)))
        return real(options, sizes, dtype, repeats=1, **kw)

    monkeypatch.setattr(ac, "profile_codecs", counting)
    sig = [["w", [4], "torch.float32"]]

    def fresh(allow: str = "cast") -> AutoCompression:
        return AutoCompression(allow, runtime=rt, wire=SLOW, signature=sig)

    first = fresh()
    first._profile(100, 5000, torch.float32)
    assert calls == [(("none", "fp16"), profile_ladder(100, 5000))] and profile_ladder(100, 5000) == (64, 512, 4096, 32768)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("codec-profile-"), files
    second = fresh()
    second._profile(64, 32768, torch.float32)  # inside the cached points: read, not measured
    assert len(calls) == 1
    for n in (64, 1000, 32768):
        assert second.codec_cost("fp16", n) == first.codec_cost("fp16", n)
    fresh("any")._profile(100, 5000, torch.float32)  # other codecs: another file
    assert len(calls) == 2 and len(list(tmp_path.iterdir())) == 2
    second._profile(100, 300_000, torch.float32)  # a group beyond the points: the wider ladder
    assert calls[-1][1] == profile_ladder(64, 300_000) == (64, 512, 4096, 32768, 262144, 2097152)
    second._profile(100, 50_000_000, torch.float32)  # beyond the CPU's cap: priced along the last segment, not measured
    assert len(calls) == 3
    for p in tmp_path.iterdir():
        p.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the cached codec profile"):
        fresh()._profile(100, 5000, torch.float32)
    assert len(calls) == 4
    given = AutoCompression("cast", runtime=rt, wire=SLOW, signature=sig, codec_cost=lambda c, n: 1.0)
    given._profile(1, 1 << 30, torch.float32)  # a caller's cost model is never replaced
    assert len(calls) == 4 and given.codec_cost("fp16", 7) == 1.0


def test_a_native_bucket_is_timed_from_its_own_launch_while_the_group_runs_buckets_side_by_side(rt, monkeypatch):
    """Two DDP buckets averaged by the process group (native "none"), A launched at 0 and B at 0.1, B done at 0.5 and
    A at 1.0 (the group ran them side by side): A's time is 1.0, not 1.0 - 0.5 (the queue rule for gradsync's own
    exchanges), and B's is 0.4."""
    futures: list[torch.futures.Future] = []

    def native(tensor, algorithm=None, always=False):
        futures.append(torch.futures.Future())
        return futures[-1]

    monkeypatch.setattr(rt, "native_allreduce_async", native)
    now = [0.0]
    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, clock=lambda: now[0],
                           cache=False)
    from gradsync.compress.base import TensorInfo

    a, b = torch.zeros(8), torch.zeros(4)
    auto.step_async([a], [TensorInfo("a", (8,), torch.float32)], key="A", flat=a)
    now[0] = 0.1
    auto.step_async([b], [TensorInfo("b", (4,), torch.float32)], key="B", flat=b)
    assert auto.native_launches == 2
    now[0] = 0.5
    futures[1].set_result([b])
    now[0] = 1.0
    futures[0].set_result([a])
    auto.end_step()
    assert auto._groups["A"].times["none"] == [pytest.approx(1.0)]
    assert auto._groups["B"].times["none"] == [pytest.approx(0.4)]


def test_a_groups_slack_leaves_out_later_groups_choosing_and_keeps_the_least_a_step_measured(rt, monkeypatch):
    """Bucket A launches at 0 and B at 0.1, but B's first choice holds the thread 0.2 s (rank 0 profiling): B starts
    at 0.3, and A's slack is 0.1 (backward's), not 0.3. The next step B starts 0.5 s after A (an exchange slowing
    backward): A keeps 0.1, the least seen, which the model prices it with; the table shows it."""
    monkeypatch.setattr(rt, "native_allreduce_async", lambda tensor, algorithm=None, always=False: _done([tensor]))
    now = [0.0]
    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, clock=lambda: now[0],
                           cache=False)
    real = auto._decide

    def decide(key, compute):
        def slow():
            now[0] += 0.2 if key.endswith("/B") else 0.0
            return compute()
        return real(key, slow)

    monkeypatch.setattr(auto, "_decide", decide)
    from gradsync.compress.base import TensorInfo

    a, b = torch.zeros(8), torch.zeros(4)
    for start, gap in ((0.0, 0.1), (1.0, 0.5)):
        now[0] = start
        auto.step_async([a], [TensorInfo("a", (8,), torch.float32)], key="A", flat=a)
        now[0] = start + gap
        auto.step_async([b], [TensorInfo("b", (4,), torch.float32)], key="B", flat=b)
        auto.end_step()
        assert auto._groups["A"].slack_s == pytest.approx(0.1), start
    assert auto._groups["A"].now().slack_s == pytest.approx(0.1)
    assert {r["group"]: r["slack_s"] for r in auto.table()} == {"A": pytest.approx(0.1), "B": 0.0}


def test_plain_groups_need_inputs_given_up(rt: Runtime) -> None:
    """Plain groups are averaged in place: without reuse_inputs a caller's gradients would be overwritten."""
    from gradsync.compress.merge import MergeError, Partition
    from gradsync.train.grouped import MergedGroups

    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, cache=False)
    with pytest.raises(MergeError, match="reuse_inputs=True"):
        MergedGroups(auto, ["a"], [(2,)], torch.float32, Partition.layerwise(1), plain=True)
    assert MergedGroups(auto, ["a"], [(2,)], torch.float32, Partition.layerwise(1), plain=True,
                        reuse_inputs=True).plain


def test_a_settled_launch_the_backend_cannot_take_leaves_the_step_to_the_general_path(rt: Runtime) -> None:
    """Where the backend cannot sum the buffer (here: no process group), a lean group's settled launch returns None
    and opens no step: the caller's step_async opens it (opened twice, the launch would close its own step)."""
    from gradsync.compress.auto import AutoChoice, GroupSpec
    from gradsync.train.auto_compression import _Group

    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, cache=False)
    auto._groups["A"] = _Group(GroupSpec("A", ((8,),), torch.float32),
                               choice=AutoChoice("A", 32, "none", 32, 1.0, 1.0, "measured"), final=True)
    auto._lean = frozenset({"A"})
    assert auto.settled_launch(torch.zeros(8), "A") is None
    assert auto.boundary._open is None and auto.native_launches == 0 and auto.settled_launches == 0


def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


@pytest.mark.parametrize("native_s, planned_s, penalty", [(1e-3, 1e-5, 0.0), (1e-5, 1e-3, 0.0), (1e-3, 1e-5, 1.0),
                                                      (1e-3, 1.8e-3, 0.0), (1e-3, 0.7e-3, 0.0)])
def test_none_is_the_quicker_of_the_backends_allreduce_and_the_runtimes_planned_exchange(
        rt, monkeypatch, tmp_path, native_s, planned_s, penalty):
    """Where the runtime plans a group's size itself, "none" is timed both ways (the backend's allreduce of the
    flat buffer, then the planned exchange) and the quicker one carries every later "none" launch; the next job
    reads it from the cache. Fake clock: one way 100x the other, or the planned way a little quicker (at most 1.11x:
    under TRY_GAIN, the backend's is kept, a close call whose whole steps then decide; at least 1.43x: over it). A
    backend launch reads the clock twice on this thread, its launch and its done callback, so it measures 2
    native_s; a planned one reads it
    once or twice (its callback runs here only if the exchange was done first). With ``penalty``, every whole step on the planned
    way costs that much more elsewhere (its thread taking backward's cores): the whole-step check sends the group
    back to the backend's allreduce (reason "step"), however quick its own exchange measured."""
    monkeypatch.setenv("GRADSYNC_CACHE", str(tmp_path))
    _with_planned_none(rt, monkeypatch)
    natives: list[bool] = []
    fake = rt.native_allreduce_async

    def native(tensor, algorithm=None, always=False):
        natives.append(always)
        return fake(tensor, algorithm, always)

    monkeypatch.setattr(rt, "native_allreduce_async", native)
    sig = param_signature(_model().named_parameters())
    clear = planned_s * TRY_GAIN <= 2 * native_s  # the planned way clears the bar
    close = not clear and planned_s < TRY_GAIN * 2 * native_s  # the backend's way is not TRY_GAIN quicker either
    want_planned = clear and not penalty
    for job in ("first", "next"):
        clock = FakeClock({"none": native_s, PLANNED: planned_s, "other": 1.0})
        auto = AutoCompression("lossless", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, clock=clock,
                               signature=sig)
        clock.auto = auto

        def costly(launches: list, clock: FakeClock = clock) -> None:  # the penalty is the rest of this step's
            if any(launch.codec == PLANNED for launch in launches):
                clock.now += penalty

        _before_close(auto, costly)
        natives.clear()
        steps = 6 * PROBE_STEPS + 3 if job == "first" else 3
        _train(rt, auto, steps, merge=1)
        (row,) = auto.table()
        check = auto.step_check
        group = auto._groups[row["group"]]
        if close and job == "first":
            # a planned launch reads the clock once or twice (above), so the per-launch lead is 1.11x or a 1.8x loss,
            # and its whole steps read either way too: where the times made it a close call, the whole steps decide
            lost = not quicker_by(group.time_s("none"), group.time_s(PLANNED), TRY_GAIN)
            assert (check["restore"] == {row["group"]: PLANNED}) is lost, (check, group.times)
            want_planned = lost and whole_steps_lose(check["dropped_s"], check["restored_s"])
        assert auto.settled and row["codec"] == "none" and row["planned"] is want_planned, (job, row)
        assert all(natives)  # "none" on the backend is its allreduce whatever the plan (always=True)
        # first job: PROBE_STEPS launches each way, then the kept one; a kept planned way is checked against the
        # backend's in whole steps, alternating (PROBE_STEPS more of the backend's), unless its first settled step
        # took less than 1/TRY_GAIN of the probe's "none" step (no penalty here). The next job: the cached way.
        if job == "next":
            assert len(natives) == (0 if want_planned else steps), natives
        elif clear:
            want = (PROBE_STEPS, PROBE_STEPS) if penalty else (0, 1)  # (baseline steps, settled steps)
            assert (len(check["baseline_s"]), len(check["settled_s"])) == want, check
            assert check["early_none_s"] and all(s * TRY_GAIN <= min(check["early_none_s"])
                                                 for s in check["settled_s"][:1]) is not bool(penalty), check
            assert (row["reason"] == "step") is bool(penalty), row
            assert len(natives) == PROBE_STEPS + (steps - 3 * PROBE_STEPS if penalty else 0), natives
        elif close and check["restore"]:  # the restore part's PROBE_STEPS steps on the planned way
            assert len(check["restored_s"]) == PROBE_STEPS and check["verified"], check
            if not want_planned:  # then the backend's way everywhere
                assert len(natives) == steps - 2 * PROBE_STEPS and not check["baseline_s"], (natives, check)
        else:
            assert len(natives) == steps - PROBE_STEPS and not check["baseline_s"], (natives, check)
            assert not check["restore"], check
        assert check["verified"], check


def test_choosing_is_not_charged_to_the_codec_it_chooses(rt):
    """Profiling and choosing happen at a group's first codec launch (rank 0 measures, every rank waits); that
    time is not the codec's: a choice whose profile took 100 s on the fake clock is kept, with its launches timed
    at their own cost."""
    clock = FakeClock({"none": 1.0, "other": 1e-3})

    def slow_profile(codec: str, numel: int) -> float:
        clock.now += 100.0  # a long profile: every call to the cost model
        return 0.0 if codec == "none" else 1e-6

    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=slow_profile, clock=clock, cache=False)
    clock.auto = auto
    _train(rt, auto, 2 * PROBE_STEPS + 2, merge=1)
    (row,) = auto.table()
    assert row["codec"] != "none" and row["reason"] == "measured", row
    assert row["measured_s"] < 1.0, row


def _any_auto(rt: Runtime, clock: FakeClock) -> AutoCompression:
    auto = AutoCompression("any", runtime=rt, wire=SLOW, codec_cost=lambda codec, numel: 0.0, clock=clock, cache=False)
    clock.auto = auto
    return auto


def test_a_codec_far_ahead_of_none_is_kept_without_ever_timing_none(rt: Runtime) -> None:
    """On a slow wire an error-feedback codec is predicted far more than 2x ahead of "none": its trial runs first,
    measures inside the margin, and the group settles without one "none" launch (what choosing costs most)."""
    clock = FakeClock({"none": 1e-4, "other": 1e-6})
    auto = _any_auto(rt, clock)
    _train(rt, auto, PROBE_STEPS + 1)
    rows = auto.table()
    assert auto.settled and len(rows) == 2
    assert all(r["codec"] != "none" and r["reason"] == "measured" for r in rows), rows
    assert all("none" not in auto._groups[r["group"]].times for r in rows), rows


@pytest.mark.cast_trust
@pytest.mark.parametrize("merge, joint_gain", [("auto", None), ("auto", 1.0), ("auto", 1.2), ("auto", 1.3),
                                               (2, None)])
def test_a_cast_well_ahead_is_kept_without_timing_none_where_the_bucket_check_follows(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, merge, joint_gain: float | None) -> None:
    """A cast is at best 2x quicker than "none", never beyond MARGIN, but it is trusted on CAST_MARGIN: with two
    fixed groups fp16, priced 2x ahead on a slow wire (free codecs) and measured inside 1/CAST_MARGIN of "none"'s
    price, settles without one "none" launch. With merge="auto" the optimizer's check against DDP's buckets follows,
    so the margin is TRY_GAIN and the same holds, and the whole steps against DDP's buckets uncompressed are the
    check. Unless the partition's search put no codec TRY_GAIN ahead of "none" for the whole step (its answer faked,
    with ``joint_gain``: "none" itself, or fp16 1.2x ahead; 1.3x is trusted): a group's first price, with no slack
    measured, is then not trusted on a cast's narrow margin, and "none" is timed first."""
    from gradsync.compress.auto import CAST_MARGIN, MARGIN, JointChoice
    from gradsync.compress.merge_model import Partition
    from gradsync.train import auto_compression

    if joint_gain is not None:
        codec = "none" if joint_gain == 1.0 else "fp16"
        monkeypatch.setattr(auto_compression, "choose_joint", lambda sizes, *a, **k: JointChoice(
            codec, Partition.layerwise(len(sizes)), 1.0, {"none": joint_gain, "fp16": 1.0}))
    clock = FakeClock({"none": 1e-4, "other": 1e-6})
    auto = _auto(rt, clock)
    opt, _ = _train(rt, auto, 2 + 2 * PROBE_STEPS + 8, merge=merge)
    searched = merge == "auto" and (joint_gain is None or joint_gain >= TRY_GAIN)
    trusted = searched or merge != "auto"
    assert auto.settled and auto.margin == (TRY_GAIN if searched else MARGIN)
    assert auto.cast_margin == (CAST_MARGIN if trusted else MARGIN)
    fp16 = [g for g in auto._groups.values() if g.choice is not None and g.choice.codec == "fp16"]
    assert fp16, auto.table()
    if trusted:
        assert all("none" not in g.times for g in fp16), auto.table()
        assert all(g.choice.reason == "measured" for g in fp16)
        if merge == "auto":
            assert auto.buckets is not None and opt._buckets is None, auto.buckets  # the bucket check ran
    else:
        assert all(g.times.get("none") for g in fp16), auto.table()


@pytest.mark.cast_trust
def test_a_group_settled_on_a_codec_hands_over_the_gradients_themselves(rt: Runtime, monkeypatch) -> None:
    """Once a merged group settles on a codec that encodes each member as it is (fp16 on the planned exchange: one
    rank on a local fabric has no backend to cast on), the optimizer hands over the gradients, not the group's
    buffer: the aggregates come back in the ``.grad`` tensors themselves, with no copy into the buffer and none back
    (AutoCompression.needs_flat). Training takes the same bits as through the buffer (needs_flat held True)."""
    import gradsync.train.communicator as communicator

    def run(flat: bool) -> tuple[list[torch.Tensor], list[int], AutoCompression]:
        copied: list[int] = []  # per step: the aggregates copied into .grad (not decoded there)
        real = communicator.write_aggregates

        def spy(dests, results):
            copied.append(sum(not communicator._in_place(d, r) for d, r in zip(dests, results)))
            return real(dests, results)

        with monkeypatch.context() as m:
            m.setattr(communicator, "write_aggregates", spy)
            if flat:
                m.setattr(AutoCompression, "needs_flat", lambda self, key: True)
            auto = _auto(rt, FakeClock({"none": 1e-4, "other": 1e-6}))
            opt, _ = _train(rt, auto, 2 + 2 * PROBE_STEPS + 8, merge=2)
        return [p.detach().clone() for _, p in opt._params], copied, auto

    params, copied, auto = run(flat=False)
    rows = auto.table()
    assert auto.settled and [r["codec"] for r in rows] == ["fp16", "fp16"], rows
    merged = [r["group"] for r in rows if len(auto._groups[r["group"]].names) > 1]
    assert [len(auto._groups[k].names) for k in merged] == [3], rows  # and 0.weight alone, in place already
    assert not any(auto.needs_flat(r["group"]) for r in rows)
    assert copied[-3:] == [0, 0, 0], copied  # the settled steps decode into .grad itself
    through, copied_flat, _ = run(flat=True)
    assert copied_flat[-1] == 3, copied_flat  # through the buffer: the merged group's members copied back
    assert all(torch.equal(a, b) for a, b in zip(params, through))


def test_a_wide_margin_that_measurement_breaks_times_rivals_then_none_and_reviews(rt: Runtime) -> None:
    """The same wide-margin codec measuring far above its prediction: rival codecs are timed while each is as far
    off (the model missed what codecs cost here), up to MAX_CODECS; all break the margin, so "none" is timed after
    all and the review drops the quickest of them, slower than "none" as measured."""
    from gradsync.train.auto_compression import MAX_CODECS

    clock = FakeClock({"none": 1e-4, "other": 1e3})
    auto = _any_auto(rt, clock)
    _train(rt, auto, (MAX_CODECS + 1) * PROBE_STEPS + 1)
    rows = auto.table()
    assert auto.settled and [(r["codec"], r["reason"]) for r in rows] == [("none", "dropped")] * 2, rows
    for r in rows:
        times = auto._groups[r["group"]].times
        assert len(times) == MAX_CODECS + 1 and list(times)[-1] == "none", times
        assert all(len(t) == PROBE_STEPS for t in times.values()), times


def test_a_codec_far_above_its_prediction_loses_to_a_rival_that_measures_quicker(rt: Runtime) -> None:
    """The model's pick measures 1000x its prediction; the rival it then times measures quicker and is kept (the
    wide margin still holds for it), and "none" is never timed."""
    first: dict[str, str] = {}
    now = [0.0]

    def tick() -> float:  # the first codec tried costs 1 s a call, any other 1 us ("none" is never timed here)
        codec = auto.current
        if threading.current_thread() is threading.main_thread() and codec != "none":
            now[0] += 1.0 if first.setdefault("codec", codec) == codec else 1e-6
        return now[0]

    auto = AutoCompression("any", runtime=rt, wire=SLOW, codec_cost=lambda codec, numel: 0.0, clock=tick, cache=False)
    _train(rt, auto, 2 * PROBE_STEPS + 1)
    rows = auto.table()
    assert auto.settled and all(r["codec"] not in ("none", first["codec"]) and r["reason"] == "measured"
                                for r in rows), (first, rows)
    assert all("none" not in auto._groups[r["group"]].times for r in rows)


def _owed(auto: AutoCompression, names: list[str]) -> dict[tuple[str, str], float]:
    """What each codec's error feedback still owes each name (the largest magnitude), where it owes something."""
    out = {}
    for codec, step in auto._steps.items():
        for name in names:
            debt = step.memory.owed(name)
            if debt is not None:
                out[(codec, name)] = float(debt.abs().max())
    return out


def _dropping_its_codecs(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> AutoCompression:
    """allow="any" on a slow wire, where every codec measures 10^6x slower than "none": each group tries one codec
    (MAX_CODECS = 1), one with error feedback, and drops it."""
    from gradsync.train import auto_compression

    monkeypatch.setattr(auto_compression, "MAX_CODECS", 1)
    clock = FakeClock({"none": 1e-6, "other": 1.0})
    auto = AutoCompression("any", runtime=rt, wire=_slow_any_world, codec_cost=lambda codec, numel: 0.0, clock=clock,
                           cache=False)
    clock.auto = auto
    return auto


def test_a_codec_dropped_after_its_trial_loses_none_of_the_gradient_it_held_back(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """allow="any" on a slow wire: each group tries a codec with error feedback (top-k keeps 1 element of 128), which
    measures 10^6x slower than "none" and is dropped. The gradients do not depend on the weights (loss = sum(w * c_t)),
    so plain SGD at lr 1 on one rank must end at w_0 - sum_t c_t whatever auto did, if every part of every gradient was
    sent: what a codec held back during its trial goes out with the group's next launch on "none", and no codec owes
    anything after. (One codec a group, MAX_CODECS = 1: DGC's momentum, which a rival could be, sends more than the
    gradients by design.)"""
    auto = _dropping_its_codecs(rt, monkeypatch)
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16)),
               torch.nn.Parameter(torch.randn(2, 16))]
    start = [w.detach().clone() for w in weights]
    names = [f"w{i}" for i in range(len(weights))]
    opt = DistributedOptimizer(torch.optim.SGD(weights, lr=1.0), list(zip(names, weights)), runtime=rt,
                               compression=auto, merge=2)
    sent = [torch.zeros_like(w) for w in weights]
    for step in range(3 * PROBE_STEPS + 4):
        gen = torch.Generator().manual_seed(step)
        cs = [torch.randn(w.shape, generator=gen) for w in weights]
        sum((w * c).sum() for w, c in zip(weights, cs)).backward()
        opt.step()
        opt.zero_grad()
        for total, c in zip(sent, cs):
            total += c
    trials = auto.trials
    assert auto.settled and {c.codec for c in auto.choices.values()} == {"none"}, auto.table()
    lenders = {"topk-1%", "dgc-0.1%", "efsignsgd", "powersgd-r1", "powersgd-r4"}
    assert all(t[0] in lenders and t[-1] == "none" for t in trials.values()), trials  # a codec with a debt, dropped
    assert _owed(auto, names) == {}
    for w, w0, total in zip(weights, start, sent):
        torch.testing.assert_close(w0 - w.detach(), total, rtol=0, atol=1e-4)

    opt.remove_hooks()


@pytest.mark.filterwarnings("ignore:gradsync. a gradient:RuntimeWarning")
def test_a_debt_repaid_on_a_step_that_is_skipped_stays_owed_and_goes_out_with_the_next(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the first step after the codec trials (the first on "none", which repays the codecs' debts)
    has a NaN in one gradient: the optimizer skips it and every codec keeps its debt, so no group launches lean
    (which would never send it); the next step repays it, and SGD ends at w_0 - sum of the finite steps' c_t."""
    auto = _dropping_its_codecs(rt, monkeypatch)
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(2, 16))]
    start = [w.detach().clone() for w in weights]
    names = ["w0", "w1"]
    opt = DistributedOptimizer(torch.optim.SGD(weights, lr=1.0), list(zip(names, weights)), runtime=rt,
                               compression=auto, merge=1)
    sent = [torch.zeros_like(w) for w in weights]
    bad = None
    for step in range(3 * PROBE_STEPS + 4):
        gen = torch.Generator().manual_seed(step)
        cs = [torch.randn(w.shape, generator=gen) for w in weights]
        trials = {k: list(v) for k, v in auto.trials.items()}
        if bad is None and trials and all(t[-1] != "none" and auto._groups[k].trial_over(PROBE_STEPS)
                                          for k, t in trials.items()):
            bad = step  # every group's codec trial is over: this step's launches are the first on "none"
            cs[0][0, 0] = float("nan")
        sum((w * c).sum() for w, c in zip(weights, cs)).backward()
        skipped = opt.step() is None
        opt.zero_grad()
        if step == bad:
            assert skipped and opt.nonfinite_steps == 1
            assert _owed(auto, names) and auto._lean is None  # the debts stayed, so no group went lean
            assert all(auto.trials[k][-1] == "none" for k in trials), auto.trials
            continue
        for total, c in zip(sent, cs):
            total += c
    assert bad is not None and auto.settled and {c.codec for c in auto.choices.values()} == {"none"}, auto.table()
    assert _owed(auto, names) == {} and auto._lean is not None
    for w, w0, total in zip(weights, start, sent):
        torch.testing.assert_close(w0 - w.detach(), total, rtol=0, atol=1e-4)
    # a debt still owed once the groups settled keeps them off the lean path too
    key, group = next(iter(auto._groups.items()))
    codec = auto.trials[key][0]
    memory = auto._steps[codec].memory
    memory._propose(group.names[0], torch.ones(group.spec.shapes[0]))
    memory.commit(TensorInfo(group.names[0], group.spec.shapes[0], torch.float32), True)
    auto._owing.setdefault(group.names[0], set()).add(codec)
    assert auto._lean_groups() is None
    opt.remove_hooks()


HOOK_DEBT_SCRIPT = r"""
import sys, threading
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import gradsync
from gradsync.train import auto_compression
from gradsync.train.auto_compression import AutoCompression

auto_compression.MAX_CODECS = 1  # one codec a bucket, then "none" (DGC's momentum would send more by design)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
now = [0.0]

def clock():  # a codec's launch 1 s, "none" 1 us: every codec measures slower than "none" and is dropped
    if threading.current_thread() is threading.main_thread() and sys._getframe(1).f_code.co_name != "record":
        now[0] += 1e-6 if auto.current == "none" else 1.0
    return now[0]

auto = AutoCompression("any", wire=lambda collective, nbytes, world: nbytes * 1e-3, codec_cost=lambda c, n: 0.0,
                       clock=clock, cache=False)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 2, bias=False))
weights = list(net.parameters())
start = [w.detach().clone() for w in weights]
model = DDP(net, bucket_cap_mb=0.0001)  # a bucket per weight
model.register_comm_hook(gradsync.CompressionHookState(auto, model=net), gradsync.compression_hook)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
sent = [torch.zeros_like(w) for w in weights]
x = torch.ones(1, 8)
for step in range(12):
    gen = torch.Generator().manual_seed(step)
    cs = [torch.randn(w.shape, generator=gen) for w in weights]
    # gradients that do not depend on the weights: sum(w * c) through the model's own parameters
    loss = sum((w * c).sum() for w, c in zip(model.module.parameters(), cs)) + 0.0 * model(x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    for total, c in zip(sent, cs):
        total += c
trials = {k: t for k, t in auto.trials.items() if k in auto._current_groups()}  # DDP's buckets after its rebuild
lenders = {"topk-1%", "dgc-0.1%", "efsignsgd", "powersgd-r1", "powersgd-r4"}
assert len(trials) == 2 and all(t[0] in lenders and t[-1] == "none" for t in trials.values()), auto.trials
assert auto.settled and {c.codec for c in auto.choices.values()} == {"none"}, auto.table()
for step in auto._steps.values():
    for name in auto._owing:
        assert step.memory.owed(name) is None, name
for w, w0, total in zip(weights, start, sent):
    torch.testing.assert_close(w0 - w.detach(), total, rtol=0, atol=1e-4)
print("ok")
gradsync.shutdown()
dist.destroy_process_group()
"""


def test_the_hooks_buckets_send_what_a_dropped_codec_held_back(tmp_path: Path) -> None:
    """The DDP hook's way: each bucket tries a codec with error feedback, which measures slower than "none" and is
    dropped; the bucket's next launch on "none" (the backend's allreduce of the bucket, its gradients views of it)
    carries what the codec held back, so SGD at lr 1 on one rank ends at w_0 - sum_t c_t."""
    from tests.dist_launch import run_outside_a_launcher

    p = run_outside_a_launcher(HOOK_DEBT_SCRIPT, str(tmp_path / "store"))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]


def test_a_plain_launch_sends_what_the_codecs_still_owe_its_members(rt: Runtime) -> None:
    """The optimizer's DDP buckets (plain launches) take the job's groups' place: what a codec's error feedback still
    owes a member is added to the bucket's sum, and the codec forgets it."""
    auto = AutoCompression("any", runtime=rt, wire=SLOW, codec_cost=lambda codec, numel: 0.0, cache=False)
    a, b = TensorInfo("a", (3, 4), torch.float32), TensorInfo("b", (5,), torch.float32)
    topk = auto._step("topk-1%")
    grads = [torch.arange(12.0).view(3, 4), torch.arange(5.0) - 2]
    topk.step_async([g.clone() for g in grads], [a, b], verdict=auto.boundary.verdict_for(["a", "b"])).wait()
    auto.boundary.close()
    for name in ("a", "b"):  # what step_async records of a codec's launch
        auto._owing.setdefault(name, set()).add("topk-1%")
    debts = [topk.memory.owed("a").clone(), topk.memory.owed("b").clone()]
    assert all(float(d.abs().sum()) > 0 for d in debts)
    flat = torch.cat([torch.ones(12), torch.full((5,), 2.0)])
    bucket = TensorInfo("bucket0", (17,), torch.float32)
    views = [flat[:12].view(3, 4), flat[12:]]
    (out,) = auto.plain_launch(flat, bucket, tensors=views, infos=(a, b)).wait()
    torch.testing.assert_close(out, torch.cat([1 + debts[0].reshape(-1), 2 + debts[1]]), rtol=0, atol=0)
    auto.boundary.close()
    assert _owed(auto, ["a", "b"]) == {}


def test_the_optimizers_merged_groups_reach_auto_with_their_members_shapes_and_one_buffer(rt: Runtime) -> None:
    """A merged group of the optimizer reaches auto as its members (shapes, in backward order: PowerSGD sees the
    weight matrices, and the model prices it so), views of one flat buffer that "none" averages in place."""
    seen: list[tuple[list[tuple[int, ...]], bool, str | None]] = []
    auto = AutoCompression("cast", runtime=rt, wire=AlphaBeta(0.0, float("inf")), codec_cost=lambda c, n: 0.0,
                           cache=False)
    real = auto.step_async

    def spy(tensors, infos, *, reuse=False, key=None, flat=None):
        seen.append(([tuple(t.shape) for t in tensors],
                     flat is not None and all(t.data_ptr() >= flat.data_ptr() for t in tensors), key))
        return real(tensors, infos, reuse=reuse, key=key, flat=flat)

    auto.step_async = spy
    opt, _ = _train(rt, auto, 2, merge=1)
    assert seen[-1][0] == [(2,), (2, 16), (16,), (16, 8)] and seen[-1][1], seen  # backward order, views of flat
    assert seen[-1][2] is not None and seen[-1][2].startswith("merged[0:4]"), seen
    (group,) = [g for k, g in auto._groups.items() if k == seen[-1][2]]
    assert group.spec.shapes == ((2,), (2, 16), (16,), (16, 8))


def _sums_natively(rt: Runtime, monkeypatch: pytest.MonkeyPatch, natively: Callable[[], bool]) -> None:
    """Make ``rt``'s pick for every size the backend's own allreduce (``natively()`` True) or a plan of its own, with
    no explorer in front: ``runs_natively`` and ``picks_native`` agree."""
    monkeypatch.setattr(rt, "runs_natively", lambda nbytes, algorithm=None: natively())
    monkeypatch.setattr(rt, "picks_native", lambda nbytes: natively())


def _with_planned_none(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``rt`` look like a runtime whose backend takes every buffer (a native allreduce done at once) and that
    plans every size itself: "none" has two ways (and a cast codec, like a fixed one, takes the planned one)."""
    def native(tensor, algorithm=None, always=False):
        if not always:  # the runtime plans this size: only a caller that measured both ways takes the backend
            return None
        fut = torch.futures.Future()
        fut.set_result([tensor])
        return fut

    monkeypatch.setattr(rt, "native_allreduce_async", native)
    _sums_natively(rt, monkeypatch, lambda: False)


@pytest.mark.parametrize("penalty, profile_s, kept, planned_s, warm_s, between_s",
                         [(0.0, 0.0, True, None, 0.0, 0.0), (1.0, 0.0, False, None, 0.0, 0.0),
                          (1.0, 100.0, False, None, 0.0, 0.0), (1.0, 0.0, False, 10.0, 0.0, 0.0),
                          (1.0, 0.0, False, None, 1.0, 0.0), (0.0, 0.0, True, None, 0.0, 5.0)])
def test_settled_codecs_whose_whole_steps_run_slower_than_none_go_back_to_none(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, penalty: float, profile_s: float, kept: bool,
        planned_s: float | None, warm_s: float, between_s: float) -> None:
    """Each group's fp16 measures quicker than its "none" (fake clock), but every step that ran a codec costs
    ``penalty`` more elsewhere (encoding on backward's thread, as on shared cores). After settling, auto times
    whole steps: with the penalty they are slower than the steps that ran "none", and every group goes back to
    "none" (reason "step"); without it, fp16 stays. The time spent in a job-wide decision (a ``profile_s`` codec
    profile, inside auto's first step timed whole, a "none" probe) is not that step's: counted, that step would
    look far slower than the settled ones and end the check at once, fp16 kept. With ``planned_s``, "none" also has a
    planned way, far slower (each clock reading in its launches costs that much): the backend's way is kept, and
    the planned way's trial steps are not the baseline (counted, they would hide the penalty too). With
    ``warm_s``, auto's first step timed whole, a "none" probe, takes that much longer (warming up), as long as a
    settled step: that step alone cannot end the check (a settled step must be TRY_GAIN times quicker than every
    probe step for that), and the baseline timed after settling, alternating with the settled steps, decides.
    Without the penalty the first settled step is that much quicker, and no baseline step runs. With
    ``between_s``, the job spends that long between a "none" step and the next one (a data loader, another
    model's step): not the next step's time, which runs from its first launch to its end."""
    if planned_s is not None:
        _with_planned_none(rt, monkeypatch)
    clock = FakeClock({"none": 1e-4, PLANNED: planned_s or 0.0, "other": 1e-6})

    def profile() -> bytes:
        clock.now += profile_s
        return b""

    auto = AutoCompression("cast", runtime=rt, wire=_slow_any_world, codec_cost=lambda c, n: 0.0, clock=clock)
    clock.auto = auto

    def costly(launches: list) -> None:  # the penalty is the rest of this step's
        if any(launch.codec not in ("none", PLANNED) for launch in launches):
            clock.now += penalty

    _before_close(auto, costly)
    model = _model()
    # two fixed groups: with merge="auto" the check against DDP's buckets would follow (test_the_choices_are_timed_
    # against_ddps_buckets...), and a cast the model puts TRY_GAIN ahead would be kept without timing "none"
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto, merge=2)
    warmed = False
    for step in range(5 * PROBE_STEPS + 3):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        if auto._ended == 1 and not warmed:  # auto's first step is not timed whole: its second is
            clock.now += warm_s
            auto._decide("test/profile", profile)
            warmed = True
        ran = auto.current
        opt.step()
        opt.zero_grad()
        if ran == "none":
            clock.now += between_s
    rows = auto.table()
    assert auto.verified and auto.settled, rows
    reasons = {(r["codec"], r["reason"]) for r in rows}
    check = auto.step_check
    assert check["early_none_s"] and warmed, check
    if kept:
        assert ("fp16", "measured") in reasons and not {"step"} & {r for _, r in reasons}, rows
        assert not check["baseline_s"] and len(check["settled_s"]) == 1, check  # the gap ended the check
    else:  # every codec back to "none" (a group the model left on "none" keeps its own reason)
        assert len(check["baseline_s"]) == PROBE_STEPS, check
        assert ("none", "step") in reasons and all(r["codec"] == "none" for r in rows), rows


@pytest.mark.parametrize("jitter, decide_s", [(0.0, 0.0), (1.0, 0.0), (1.0, 0.5)])
def test_the_whole_step_check_goes_on_while_its_sides_overlap_and_decides_on_all_its_steps(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, jitter: float, decide_s: float) -> None:
    """fp16 measures quicker than "none" on each group, but every step that runs it costs 1 s more elsewhere (every
    step 1 s, 2 s with fp16): whole steps lose, and fp16 goes back to "none" (reason "step"). With ``jitter``, the check's first settled step is
    that much quicker and its first "none" step that much slower, so its first two steps a side are the same two
    times, each side a quick and a slow one: their medians tie, and a check that stopped there kept fp16. It goes on
    while the sides overlap, to STEP_CHECK_ROUNDS times as many steps a side, and the medians of all of them send
    fp16 back. Without the jitter the sides are apart at PROBE_STEPS, where the check ends. Whether the check goes on
    is decided for the job between steps (``decide_s``: what each such decision takes): that time is no step's, and
    the next step's sample keeps its full length."""
    from gradsync.compress.auto import STEP_CHECK_ROUNDS

    clock = FakeClock({"none": 1e-4, PLANNED: 0.0, "other": 1e-6})
    auto = AutoCompression("cast", runtime=rt, wire=_slow_any_world, codec_cost=lambda c, n: 0.0, clock=clock)
    clock.auto = auto

    def costly(launches: list) -> None:  # every step 1 s more elsewhere, 2 s where it ran fp16
        checking = auto.settled and not auto.verified and all(launch.final for launch in launches)
        settled, baseline = len(auto._settled_steps), len(auto._baseline_steps)
        clock.now += 1.0
        if any(launch.codec not in ("none", PLANNED) for launch in launches):
            clock.now += 1.0 - (jitter if checking and settled == 0 else 0.0)
        elif checking and auto._turn and baseline == 0:
            clock.now += jitter

    _before_close(auto, costly)
    decide = auto._decide

    def slow(key: str, compute: Callable[[], bytes]) -> bytes:
        def timed() -> bytes:
            if key.startswith("turns/"):
                clock.now += decide_s
            return compute()

        return decide(key, timed)

    auto._decide = slow  # type: ignore[method-assign]
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto, merge=2)
    for step in range(8 * PROBE_STEPS + 4):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    rows = auto.table()
    check = auto.step_check
    assert auto.verified and auto.settled, (rows, check)
    assert ("none", "step") in {(r["codec"], r["reason"]) for r in rows} and all(r["codec"] == "none" for r in rows), (rows, check)
    steps = STEP_CHECK_ROUNDS * PROBE_STEPS if jitter else PROBE_STEPS
    assert len(check["baseline_s"]) == len(check["settled_s"]) == steps, check
    if jitter:  # the first two a side alone: a tie
        assert not whole_steps_lose(check["settled_s"][:PROBE_STEPS], check["baseline_s"][:PROBE_STEPS]), check
    # every step after the jittered first of each side: 2 s with fp16, 1 s without, whatever the decisions took
    assert check["settled_s"][1:] == pytest.approx([2.0] * (steps - 1), abs=1e-2), check
    assert check["baseline_s"][1:] == pytest.approx([1.0] * (steps - 1), abs=1e-2), check


def test_a_cast_codec_on_one_buffer_takes_the_fixed_fp16_hooks_path_with_the_same_bits(rt, monkeypatch) -> None:
    """fp16 on a group handed over as one buffer (a DDP bucket): the buffer is cast whole, summed in fp16 by the
    backend's allreduce where the runtime runs that size natively (as the fixed fp16 hook asks),
    cast back and averaged -- the bits of fp16's own step, without its per-tensor host time. Where the runtime plans
    the size itself (None), fp16's own step runs, on the planned exchange."""
    from gradsync.compress.base import TensorInfo
    from gradsync.train.communicator import CompressionStep

    calls: list[tuple[torch.dtype, bool]] = []
    natively = [True]

    def native(tensor, algorithm=None, always=False):
        calls.append((tensor.dtype, always))
        if not natively[0]:
            return None
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([tensor])  # one rank: the sum is the tensor
        return fut

    monkeypatch.setattr(rt, "native_allreduce_async", native)
    _sums_natively(rt, monkeypatch, lambda: natively[0])
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) / 3
    info = TensorInfo("w", (1000,), torch.float32)
    expected = CompressionStep("fp16", runtime=rt).step_async([x.clone()], [info]).wait()[0]
    assert not torch.equal(expected, x)  # fp16 rounds: the test can tell the paths from no cast at all
    for planned in (False, True):
        natively[0] = not planned
        auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, cache=False)
        for _ in range(2 * PROBE_STEPS + 2):  # "none" is timed first, then the choice it informs: fp16 on this wire
            flat = x.clone()
            calls.clear()
            work = auto.step_async([flat], [info], key="g", flat=flat)
            out = work.wait()[0]
            if auto.current == "fp16":
                break
        assert auto.current == "fp16", auto.table()
        # a planned size is not cast for nothing; where "none" ran on the backend, the cast goes there too
        assert calls == ([] if planned else [(torch.float16, True)])
        assert torch.equal(out, expected)
        if not planned:
            assert out is flat  # averaged in its own buffer, as the hook's bucket is


def _with_native(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Make ``rt`` look like a runtime whose backend takes every buffer natively (one rank: the sum is the buffer,
    done at once); the dtypes it was handed, in order."""
    sent: list[torch.dtype] = []

    def native(tensor, algorithm=None, always=False):
        sent.append(tensor.dtype)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([tensor])
        return fut

    monkeypatch.setattr(rt, "native_allreduce_async", native)
    _sums_natively(rt, monkeypatch, lambda: True)
    return sent


@pytest.mark.parametrize("wire, codec", [(AlphaBeta(0.0, float("inf")), "none"), (SLOW, "fp16")])
def test_a_lean_optimizer_group_is_averaged_and_checked_on_the_thread_that_waits_for_it(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, wire: Any, codec: str) -> None:
    """Once settled, the optimizer's lean groups (:meth:`AutoCompression.settled_work`) take their finite verdict and
    their average on the thread that waits for them (``step()``'s), not in callbacks on the thread where the
    backend's sum completes: such a callback first takes the GIL from the training thread, twice a launch. The
    backend's sums here complete on a thread of their own, as gloo's do. A cast (fp16, on a slow wire) is checked
    there and its NaN step skipped; a group on "none" is not checked at all, as without compression (a pass over the
    sum on the step's critical path): its NaN step is taken and not counted, and its steps are the plain one's."""
    from gradsync.train import auto_compression

    _with_native(rt, monkeypatch)
    auto = AutoCompression("cast", runtime=rt, wire=wire, codec_cost=lambda c, n: 0.0,
                           clock=FakeClock({"none": 1e-4, PLANNED: 1.0, "other": 1e-6}), cache=False)
    auto.clock.auto = auto  # type: ignore[attr-defined]
    model, plain = _model(), _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto, merge=1)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)

    def train(step: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for net, o in ((model, opt), (plain, ref)):
            net(x).square().sum().backward()
            o.step()
            o.zero_grad()

    step = 0
    while auto._lean is None:
        assert step < 40, auto.table()
        train(step)
        step += 1

    def later(tensor, algorithm=None, always=False):  # the sum completes on another thread, as the backend's does
        fut: torch.futures.Future = torch.futures.Future()
        threading.Timer(0.005, lambda: fut.set_result([tensor])).start()
        return fut

    checked: list[threading.Thread] = []
    real = auto_compression.all_finite

    def spy(tensor):
        checked.append(threading.current_thread())
        return real(tensor)

    monkeypatch.setattr(rt, "native_allreduce_async", later)
    monkeypatch.setattr(auto_compression, "all_finite", spy)
    before = auto.settled_launches
    for s in range(step, step + 3):
        train(s)
    assert auto.settled_launches - before == 3 and {c.codec for c in auto.choices.values()} == {codec}, auto.table()
    if codec == "none":
        assert not checked
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.equal(p, q)
        _takes_a_nan_step(model, opt)
        return
    assert checked and all(t is threading.main_thread() for t in checked), [t.name for t in checked]
    _skips_a_nan_step(model, opt)


def _lean_steps(auto: AutoCompression, rt: Runtime, *counts: Callable[[], int]
                ) -> tuple[list[tuple[int, ...]], torch.nn.Module, torch.nn.Module, DistributedOptimizer]:
    """``auto``'s optimizer (one merged group) and a plain one stepping on the same batches, 6 * PROBE_STEPS + 4
    steps: per step, its ``step_async`` launches (the slow path) and how much each of ``counts`` grew; then both
    models and ``auto``'s optimizer."""
    slow: list[int] = []
    real = auto.step_async

    def spy(*args, **kwargs):
        slow.append(1)
        return real(*args, **kwargs)

    auto.step_async = spy  # type: ignore[method-assign]
    model, plain = _model(), _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto, merge=1)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    per_step: list[tuple[int, ...]] = []
    for step in range(6 * PROBE_STEPS + 4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        before = (len(slow), *(count() for count in counts))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        per_step.append(tuple(b - a for a, b in zip(before, (len(slow), *(count() for count in counts)))))
        plain(x).square().sum().backward()
        ref.step()
        ref.zero_grad()
    return per_step, model, plain, opt


def _takes_a_nan_step(model: torch.nn.Module, opt: DistributedOptimizer) -> None:
    """A NaN gradient's step sent uncompressed is taken, as without compression: not checked, not counted."""
    counted = opt.nonfinite_steps
    model(torch.full((4, 8), float("nan"))).square().sum().backward()
    opt.step()
    assert opt.nonfinite_steps == counted and all(p.isnan().all() for p in model.parameters())


def _skips_a_nan_step(model: torch.nn.Module, opt: DistributedOptimizer) -> None:
    """A NaN gradient's step is skipped and counted, the weights left as they were."""
    weights = [p.detach().clone() for p in model.parameters()]
    counted = opt.nonfinite_steps
    model(torch.full((4, 8), float("nan"))).square().sum().backward()
    assert opt.step() is None and opt.nonfinite_steps == counted + 1
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


@pytest.mark.parametrize("allow, wire, natively, stateless", [("cast", AlphaBeta(0.0, float("inf")), True, True),
                                                              ("cast", SLOW, True, True), ("cast", SLOW, False, True),
                                                              ("any", SLOW, True, False)])
def test_settled_stateless_choices_launch_as_a_plain_allreduce_and_a_codec_with_state_never_does(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, allow: str, wire, natively: bool, stateless: bool) -> None:
    """Once every group's choice is settled and checked, a stateless one ("none" on an infinitely fast wire, fp16
    on a slow one) launches by :meth:`AutoCompression.settled_launch`: the backend's allreduce of the group's buffer
    and nothing else (no per-launch timing, no step_async), the same bits as before it settled; the optimizer still
    skips a step whose gradient is NaN after a cast, and takes it after "none" (not checked, as without
    compression). A codec with state (error feedback under allow="any") keeps step_async: its
    step's finite verdict is what rolls the state back. fp16 where the runtime plans the size itself (``natively``
    False) still launches lean: the group's "none" measured quicker on the backend's allreduce, and so its cast runs
    there (a cast of a group kept on the planned way takes that way and step_async: the test after the next)."""
    sent = _with_native(rt, monkeypatch)
    if not natively:
        _sums_natively(rt, monkeypatch, lambda: False)
    # a codec measures quicker than "none" (it is kept), the planned way far slower (the backend's is kept)
    clock = FakeClock({"none": 1e-4, PLANNED: 1.0, "other": 1e-6})
    auto = AutoCompression(allow, runtime=rt, wire=wire, codec_cost=lambda c, n: 0.0, clock=clock, cache=False)
    clock.auto = auto
    per_step, model, plain, opt = _lean_steps(auto, rt, lambda: auto.settled_launches)
    codecs = {c.codec for c in auto.choices.values()}
    assert auto.settled and auto.verified, auto.table()
    if not stateless:
        assert (codecs - {"none", "fp16", "bf16"} if natively else codecs == {"fp16"}), auto.table()
        assert auto._lean is None, auto.table()
        assert all(n == 0 for _, n in per_step) and all(s > 0 for s, _ in per_step), per_step
        return
    assert per_step[-1] == (0, 1) and per_step[-2] == (0, 1), (per_step, auto.table())  # one group, lean
    assert sent[-1] == (torch.float32 if codecs == {"none"} else torch.float16), (sent, codecs)
    if codecs == {"none"}:  # one rank and no rounding: the plain optimizer's bits
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.equal(p, q)
    if codecs == {"none"}:  # sent as it is: not checked, as without compression
        _takes_a_nan_step(model, opt)
    else:  # a cast's verdict joins the step on the lean path too
        _skips_a_nan_step(model, opt)


def test_a_group_settled_on_the_planned_none_launches_its_flat_buffer_on_the_planned_exchange(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group whose "none" measured quicker on the runtime's planned exchange than on the backend's allreduce launches
    lean once settled and checked: its flat buffer goes to ``runtime.allreduce_async`` as it is (one job, what
    GradsyncHookState's hook runs), not through the "none" step's per-tensor payloads and finite marks. Its
    ``"none/planned"`` trial ran that same flat launch: the "none" step never ran. The optimizer steps as the plain
    one, a NaN step included (a group sent as it is is not checked, as without compression)."""
    _with_native(rt, monkeypatch)
    _sums_natively(rt, monkeypatch, lambda: False)  # the runtime plans the size
    planned: list[int] = []
    explored: list[bool] = []
    real_allreduce = rt.allreduce_async

    def allreduce_async(tensors, op="sum", algorithm=None, explore=True):
        planned.append(tensors.data_ptr() if isinstance(tensors, torch.Tensor) else -1)
        explored.append(explore)
        return real_allreduce(tensors, op, algorithm, explore=explore)

    monkeypatch.setattr(rt, "allreduce_async", allreduce_async)
    clock = FakeClock({"none": 1e-3, PLANNED: 1e-5, "other": 1e-6})
    auto = AutoCompression("cast", runtime=rt, wire=AlphaBeta(0.0, float("inf")), codec_cost=lambda c, n: 0.0,
                           clock=clock, cache=False)
    clock.auto = auto
    per_tensor: list[int] = []
    monkeypatch.setattr(auto.base, "step_async", lambda *a, **k: per_tensor.append(1))  # never: fails if it runs
    per_step, model, plain, opt = _lean_steps(auto, rt, lambda: auto.settled_launches, lambda: len(planned),
                                              lambda: auto.native_launches)
    assert auto.settled and auto.verified, auto.table()
    group = next(iter(auto._groups.values()))
    assert group.planned and {c.codec for c in auto.choices.values()} == {"none"}, auto.table()
    # one planned job of the flat buffer a step, lean; none on the backend's allreduce
    assert per_step[-1] == (0, 1, 1, 0) and per_step[-2] == (0, 1, 1, 0), (per_step, auto.table())
    assert not per_tensor and auto.trials[next(iter(auto.trials))][:2] == ["none", PLANNED], auto.trials
    assert len(planned) > sum(n for _, n, _, _ in per_step), per_step  # the trial's launches were planned jobs too
    # the trial ran the runtime's pick as it stands; the lean launches let the runtime explore its depths
    trial = len(planned) - sum(n for _, n, _, _ in per_step)
    assert not any(explored[:trial]) and all(explored[-2:]), (trial, explored)
    for p, q in zip(model.parameters(), plain.parameters()):  # one rank: the plain optimizer's bits
        assert torch.equal(p, q)
    _takes_a_nan_step(model, opt)  # sent as it is: not checked, as without compression


def test_a_groups_mean_prefers_settled_launches_and_its_trial_ends_on_enough_of_them_or_none_left() -> None:
    from gradsync.compress.auto import GroupSpec
    from gradsync.train.auto_compression import _Group

    g = _Group(GroupSpec("g", ((4,),), torch.float32), trials=["fp16"], left=3)
    g.unsettled["fp16"] = [1.0]
    assert g.time_s("fp16") == 1.0 and g.time_s("none") == float("inf")  # rough times only where nothing else
    g.times["fp16"] = [0.25]
    assert g.time_s("fp16") == 0.25 and not g.trial_over(2)
    g.times["fp16"].append(0.75)
    assert g.trial_over(2)  # two settled launches
    g.times["fp16"], g.left = [0.25], 0
    assert g.trial_over(2)  # no launch left to wait with


class LaunchClock(FakeClock):
    """Charges each launch ``cost[codec]`` once, at its first reading after it started (however many readings its
    done callback adds on this thread)."""

    def __init__(self, cost: dict[str, float]) -> None:
        super().__init__(cost)
        self.seen: list[object] = []

    def __call__(self) -> float:
        launches = self.auto._this_step if self.auto is not None else []
        if threading.current_thread() is threading.main_thread() and launches:
            launch = launches[-1]
            if not any(launch is x for x in self.seen):
                self.seen.append(launch)
                self.now += self.cost.get(launch.codec, self.cost["other"])
        return self.now


def _recording_sends(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, bool]]:
    """Record each buffer ``rt``'s backend is handed (its dtype, and whether ``always`` was asked), then hand it on
    to the ``native_allreduce_async`` already installed."""
    installed = rt.native_allreduce_async
    sent: list[tuple[torch.dtype, bool]] = []

    def native(tensor, algorithm=None, always=False):
        sent.append((tensor.dtype, always))
        return installed(tensor, algorithm, always=always)

    monkeypatch.setattr(rt, "native_allreduce_async", native)
    return sent


@pytest.mark.parametrize("planned_kept", [False, True])
def test_a_cast_is_sent_the_way_its_groups_none_measured_quicker(rt: Runtime, monkeypatch: pytest.MonkeyPatch,
                                                                 planned_kept: bool) -> None:
    """The runtime plans every size (the cast's payload too); the group's "none" measured quicker on the backend's
    allreduce (the planned way 1 s a launch) or on the planned exchange (10 us against 1 ms). fp16 then runs the same
    way: cast whole and summed by the backend (``always``, whatever the runtime plans for its size), or its own
    step on the planned exchange, as a fixed cast would."""
    _with_planned_none(rt, monkeypatch)
    sent = _recording_sends(rt, monkeypatch)
    clock = LaunchClock({"none": 1e-3, PLANNED: 1e-5 if planned_kept else 1.0, "other": 1e-6})
    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, clock=clock, cache=False)
    auto.margin = math.inf  # "none" is timed first
    clock.auto = auto
    _train(rt, auto, 4 * PROBE_STEPS + 2, wide=8, merge=1)
    group = next(iter(auto._groups.values()))
    assert group.trials[:3] == ["none", PLANNED, "fp16"] and group.planned is planned_kept, group
    casts = [s for s in sent if s[0] == torch.float16]
    assert casts == ([] if planned_kept else [(torch.float16, True)] * len(casts)) and (casts or planned_kept), sent
    assert ("fp16" in group.threaded) is planned_kept, group


@pytest.mark.parametrize("picks_native", [False, True])
def test_a_planned_way_is_timed_only_where_the_runtimes_pick_for_the_size_is_a_plan(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, picks_native: bool) -> None:
    """The runtime does not run the group's size natively now (an explorer, say): where its pick for the size is a
    plan, "none" on the planned exchange is timed after "none" on the backend's; where the pick is the backend's own
    collective (the explorer would time a plan against it), it is not: "none" has timed the backend already."""
    _with_native(rt, monkeypatch)
    monkeypatch.setattr(rt, "runs_natively", lambda nbytes, algorithm=None: False)
    monkeypatch.setattr(rt, "picks_native", lambda nbytes: picks_native)
    clock = LaunchClock({"none": 1e-3, PLANNED: 1e-3, "other": 1e-3})
    auto = AutoCompression("cast", runtime=rt, wire=AlphaBeta(0.0, float("inf")), codec_cost=lambda c, n: 0.0,
                           clock=clock, cache=False)
    clock.auto = auto
    _train(rt, auto, 2 * PROBE_STEPS + 2, wide=8, merge=1)
    group = next(iter(auto._groups.values()))
    assert group.native and (PLANNED in group.trials) is not picks_native, group.trials


@pytest.mark.parametrize("picks_native", [False, True])
def test_a_cast_timed_before_none_goes_to_the_backend_where_the_runtime_picks_it_for_the_payload(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, picks_native: bool) -> None:
    """fp16 priced far ahead runs first, before any "none" launch. The runtime does not run its payload's size
    natively now (an explorer, say, times a plan against the backend's collective): where its pick for the size is
    the backend's, the cast goes there (``always``), not into that exploration; where the pick is a plan, fp16's own
    step runs on the planned exchange, as a fixed cast would."""
    _with_planned_none(rt, monkeypatch)
    sent = _recording_sends(rt, monkeypatch)
    asked: list[float] = []
    monkeypatch.setattr(rt, "picks_native", lambda nbytes: asked.append(nbytes) or picks_native)
    clock = LaunchClock({"none": 1e-3, PLANNED: 1.0, "other": 1e-6})
    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, clock=clock, cache=False)
    auto.margin = auto.cast_margin = 1.0  # any lead is wide: the codec is timed first
    clock.auto = auto
    _train(rt, auto, 2, wide=8, merge=1)  # 90 floats in one group: fp16's payload is 180 bytes
    group = next(iter(auto._groups.values()))
    assert group.trials == ["fp16"] and not group.native, group
    assert asked and set(asked) == {180}, asked
    assert sent == ([(torch.float16, True)] * 2 if picks_native else []), sent


@pytest.mark.parametrize("allow, codec_s, kept", [("any", 0.9e-3, False), ("any", 0.5e-3, True), ("cast", 0.9e-3, True)])
def test_a_codec_on_gradsyncs_thread_must_beat_none_on_the_backend_by_try_gain(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, allow: str, codec_s: float, kept: bool) -> None:
    """"none" on the backend's allreduce takes 1 ms a launch (the runtime's planned exchange of the group, far
    slower, is not kept); the codec 0.9 ms (1.11x quicker) or 0.5 ms (2x). A codec with an exchange of its own
    (allow="any": the model's pick on a slow wire) runs on gradsync's thread, and is kept only 1.25x quicker
    (TRY_GAIN): dropped at 1.11x, kept at 2x. A cast (allow="cast": fp16) goes to the backend's allreduce beside
    "none" though the runtime plans its payload's size, and any lead keeps it."""
    _with_planned_none(rt, monkeypatch)
    clock = LaunchClock({"none": 1e-3, PLANNED: 1.0, "other": codec_s})
    auto = AutoCompression(allow, runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, clock=clock, cache=False)
    auto.margin = math.inf  # "none" is timed first, however far ahead the model puts the codec
    clock.auto = auto
    _train(rt, auto, 3 * PROBE_STEPS + 2, wide=8, merge=1)  # 8*8+8+8*2+2 = 90 floats in one group
    (row,) = auto.table()
    group = auto._groups[row["group"]]
    (codec,) = group.candidates
    assert (codec == "fp16") is (allow == "cast"), group.candidates
    assert group.native and not group.planned and (codec in group.threaded) is (allow == "any"), (row, group)
    assert (row["codec"], row["reason"]) == ((codec, "measured") if kept else ("none", "dropped")), row


def test_every_rank_ends_a_trial_when_rank_0_does_whatever_its_own_timings_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a launch was timed while the runtime settled an exchange is each rank's own reading. Here rank 1 reads
    every one of its launches so (its settling count moves between each launch and its record), rank 0 none: on its
    own, rank 1 would keep timing "none" for SETTLING_LAUNCHES more launches while rank 0 moves to fp16, and the two
    would run different exchanges (before, the MLP's optimizer on the two-tier file hung so for 600 s). Rank 0's
    timings end each trial for both: the same trials, the same codec at every step, the same choices."""
    import itertools

    from tests.train.local_ranks import on_ranks

    ticks = itertools.count()
    monkeypatch.setattr(Runtime, "settling", property(lambda self: next(ticks) if self.rank == 1 else 0))
    steps = 4 * PROBE_STEPS + 2
    seeding = threading.Lock()

    def rank(r: int, rt: Runtime) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
        auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda codec, numel: 0.0, cache=False)
        auto._serial = -1  # the ranks are threads of one process: one serial, as one process per rank would have
        with seeding:
            model = _model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                   runtime=rt, compression=auto, merge=1)
        ran = []
        for step in range(steps):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
            ran.append(auto.current)
            opt.step()
            opt.zero_grad()
        opt.remove_hooks()
        rough = sum(len(v) for g in auto._groups.values() for v in g.unsettled.values())
        assert (rough > 0) is (r == 1), rough  # rank 1 read its timings as settling, rank 0 did not
        return (ran, auto.trials,
                {k: c.codec for k, c in auto.choices.items()})

    (ran0, trials0, chose0), (ran1, trials1, chose1) = on_ranks(2, rank, timeout_s=60, decide=True)
    assert ran0 == ran1 and trials0 == trials1 and chose0 == chose1, (ran0, ran1, trials0, trials1)
    assert ran0[:PROBE_STEPS] == ["none"] * PROBE_STEPS and "fp16" in ran0, ran0  # rank 0's trial lengths


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("merge, fused", [(1, False), (1, True), ("layerwise", False)])
def test_a_lean_none_group_is_averaged_while_copied_in_and_every_rank_gets_the_mean(
        monkeypatch: pytest.MonkeyPatch, world: int, merge, fused: bool) -> None:
    """A group settled lean on "none" is scaled by 1/world as its gradients are copied into its buffer (DDP's
    copy-and-divide: member by member in one pass for a large group, ``fused``, else copied whole then scaled) and the
    backend's sum is the average: no pass after it. Its ``"none"`` trials, before, scale the buffer before the sum
    too: every step hands the backend what DDP would, the same bits on any number of ranks. Every step, before and after the group went lean, each rank's
    ``.grad`` is the mean of the ranks' own gradients (exact on two ranks, where scaling by 1/2 commutes with the
    sum's rounding; to rounding on three), on one merged group and on one group per tensor."""
    import gradsync.train.grouped as grouped
    from tests.train.local_ranks import on_ranks

    monkeypatch.setattr(grouped, "FUSED_SCALE_BYTES", 0 if fused else 1 << 40)

    steps = 3 * PROBE_STEPS + 4
    seeding = threading.Lock()

    def x_of(step: int, r: int) -> torch.Tensor:
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + r))

    def rank(r: int, rt: Runtime) -> tuple[list[list[torch.Tensor]], list[int]]:
        def native(tensor, algorithm=None, always=False):  # the backend's sum: here, the runtime's own (blocking)
            handed[-1].append(tensor.detach().clone())
            rt.allreduce(tensor, "sum")
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result([tensor])
            return fut

        rt.native_allreduce_async = native  # type: ignore[method-assign]
        rt.takes_native = lambda device: True  # type: ignore[method-assign]
        rt.runs_natively = lambda nbytes, algorithm=None: True  # type: ignore[method-assign]
        rt.picks_native = lambda nbytes: True  # type: ignore[method-assign]
        auto = AutoCompression("lossless", runtime=rt, wire=AlphaBeta(0.0, float("inf")),
                               codec_cost=lambda codec, numel: 0.0, cache=False)
        auto._serial = -1  # the ranks are threads of one process: one serial, as one process per rank would have
        scaled: list[int] = []
        handed: list[list[torch.Tensor]] = []  # what each step handed the backend to sum
        real = auto.lean_scale

        def spy(key, device):
            s = real(key, device)
            scaled[-1] += s is not None
            return s

        auto.lean_scale = spy  # type: ignore[method-assign]
        with seeding:  # _model() seeds the global generator: one rank at a time, so every rank has the same weights
            model = _model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), runtime=rt,
                                   compression=auto, merge=merge)
        grads = []
        for step in range(steps):
            scaled.append(0)
            handed.append([])
            opt.zero_grad()
            model(x_of(step, r)).square().sum().backward()
            opt.step()
            grads.append([p.grad.clone() for p in model.parameters()])
        opt.remove_hooks()
        return grads, scaled, handed

    out = on_ranks(world, rank, decide=True)
    ref_model = _model()  # lr=0: the parameters every rank's gradients were taken at
    for step in range(steps):
        local = []
        for r in range(world):
            ref_model.zero_grad()
            ref_model(x_of(step, r)).square().sum().backward()
            local.append([p.grad.clone() for p in ref_model.parameters()])
        mean = [sum(g[i] for g in local) / world for i in range(len(local[0]))]
        for r, (grads, _, handed) in enumerate(out):
            # every step, choosing or settled, hands the backend each gradient times 1/world, as DDP scales its bucket
            # (backward order: the reverse of the parameters')
            want_sent = torch.cat([g.reshape(-1) for g in reversed(local[r])]).mul_(1 / world)
            assert torch.equal(torch.cat([t.reshape(-1) for t in handed[step]]), want_sent), (step, r)
            for got, want in zip(grads[step], mean):
                if world == 2:
                    assert torch.equal(got, want), (step, r)
                else:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    groups = 1 if merge == 1 else len(list(ref_model.parameters()))
    for _, scaled, _ in out:
        assert scaled[-2:] == [groups, groups], scaled  # settled, lean, scaled while copied in


def _charged_sides(monkeypatch: pytest.MonkeyPatch, chosen_cost: float) -> tuple[list[float], list[str]]:
    """A fake clock (``now[0]``) charged 1 per launch of one of DDP's buckets (plain groups) and ``chosen_cost`` / 4
    per launch of a chosen group (four layer-wise groups), and the side of every launch, in order."""
    from gradsync.train.grouped import MergedGroups

    now = [0.0]
    sides: list[str] = []
    real = MergedGroups._launch

    def launch(self, g):
        sides.append("buckets" if self.plain else "chosen")
        now[0] += 1.0 if self.plain else chosen_cost / 4
        real(self, g)

    monkeypatch.setattr(MergedGroups, "_launch", launch)
    return now, sides


@pytest.mark.parametrize("chosen_cost, kept, turns", [(4.0, False, "CCBB"), (1.0, False, "CCBBBC"),
                                                       (0.9, True, "CCBBBC"), (0.7, True, "CCBB"), (0.6, True, "CC")])
def test_the_choices_are_timed_against_ddps_buckets_and_the_quicker_runs(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, chosen_cost: float, kept: bool, turns: str) -> None:
    """``merge="auto"``: once the choices settle, whole steps with them (C) and with DDP's buckets uncompressed (B)
    are timed. The timed calibration step ran those buckets (1 on the clock), so the choices go first, for
    BUCKET_APART_STEPS steps: each at least CALIBRATION_GAIN (1.5) times quicker than it (0.6), they stay and DDP's
    buckets are never timed. Else the buckets' turns follow until the pairs are even: after BUCKET_APART_STEPS pairs
    a gap of TRY_GAIN either way decides (4x slower; 0.7x, 1.43x quicker, short of CALIBRATION_GAIN of the
    calibration step and past TRY_GAIN of the buckets' own steps); else after BUCKET_CHECK_STEPS pairs the choices stay only where their median step is
    quicker (0.9x; a tie goes to DDP's buckets). DDP's
    buckets run from then on where they won, and the table says so. A fake clock charges each launch of a chosen
    group ``chosen_cost`` / 4 (four layer-wise groups) and each of DDP's buckets 1 (one bucket)."""
    from gradsync.compress.auto import CALIBRATION_GAIN, JointChoice
    from gradsync.compress.merge_model import Partition
    from gradsync.train.optimizer import BUCKET_APART_STEPS, BUCKET_CHECK_STEPS

    assert (BUCKET_APART_STEPS, BUCKET_CHECK_STEPS) == (2, 3)

    now, sides = _charged_sides(monkeypatch, chosen_cost)
    auto = AutoCompression("lossless", runtime=rt, wire=AlphaBeta(0.0, float("inf")), codec_cost=lambda c, n: 0.0,
                           clock=lambda: now[0], cache=False)
    monkeypatch.setattr(auto, "plan_partition", lambda sizes, *a, **k: JointChoice(
        "none", Partition.layerwise(len(sizes)), 0.0, {"none": 0.0}))
    model, plain = _model(), _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    per_step, choosing = [], []
    for step in range(24):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        before = len(sides)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        per_step.append(set(sides[before:]))
        choosing.append(opt.choosing)
        plain(x).square().sum().backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip(model.parameters(), plain.parameters()):  # one rank: every side's average is the gradient
        assert torch.equal(p, q)
    assert per_step[:2] == [{"buckets"}, {"buckets"}]  # the calibration steps: DDP's buckets, uncompressed
    check = auto.buckets
    assert check is not None and check["kept"] is kept, (check, per_step)
    assert check["buckets_s"] == [1.0] * turns.count("B")
    assert check["chosen_s"] == pytest.approx([chosen_cost] * turns.count("C"))
    assert check["calibration_s"] == 1.0 and CALIBRATION_GAIN == 1.5, check
    side = {"C": {"chosen"}, "B": {"buckets"}}
    done = choosing.index(False)  # the check's last step: choosing is over after it
    first = done + 1 - len(turns)
    assert not any(choosing[done:]) and first > 2, (choosing, turns)
    assert per_step[2:first] == [{"chosen"}] * (first - 2), per_step  # settling: the choices' own groups
    assert per_step[first : done + 1] == [side[t] for t in turns], per_step
    assert all(s == ({"chosen"} if kept else {"buckets"}) for s in per_step[done + 1:]), per_step
    rows = auto.table()
    if kept:
        assert opt.partition == Partition.layerwise(4) and len(rows) == 4
    else:
        assert opt.partition == Partition.single(4)
        assert [(r["group"], r["codec"], r["reason"]) for r in rows] == [("bucket0", "none", "buckets")]
        assert rows[0]["bytes"] == sum(p.numel() * 4 for p in model.parameters())
    report = auto.report()
    assert "DDP's buckets" in report and ("(the calibration step)" in report) == ("B" not in turns), report


def _layerwise_auto(rt: Runtime, monkeypatch: pytest.MonkeyPatch,
                    now: list[float]) -> tuple[AutoCompression, torch.nn.Module, DistributedOptimizer]:
    """``compression="auto"`` on :func:`_model`'s optimizer whose search settles on "none" layer-wise, on the fake
    clock ``now``."""
    from gradsync.compress.auto import JointChoice
    from gradsync.compress.merge_model import Partition

    auto = AutoCompression("lossless", runtime=rt, wire=AlphaBeta(0.0, float("inf")), codec_cost=lambda c, n: 0.0,
                           clock=lambda: now[0], cache=False)
    monkeypatch.setattr(auto, "plan_partition", lambda sizes, *a, **k: JointChoice(
        "none", Partition.layerwise(len(sizes)), 0.0, {"none": 0.0}))
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto)
    return auto, model, opt


@pytest.mark.parametrize("settles", [False, True])
def test_a_calibration_step_in_which_the_runtime_settled_does_not_stand_for_ddps_buckets(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, settles: bool) -> None:
    """As above with the choices 0.6 of the calibration step: they stay untimed against the buckets, unless the
    runtime settled something during that step (its sizes priced, depths explored: a slower step than the buckets
    will run), when the buckets are timed (turns CCBB) and the verdict keeps no calibration time."""

    count = [0]
    monkeypatch.setattr(Runtime, "settling", property(lambda self: count[0]))
    now, sides = _charged_sides(monkeypatch, 0.6)
    auto, model, opt = _layerwise_auto(rt, monkeypatch, now)
    per_step = []
    for step in range(24):
        before = len(sides)
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        if step == 1 and settles:  # the timed calibration step: its size explored meanwhile
            count[0] += 1
        opt.step()
        opt.zero_grad()
        per_step.append(set(sides[before:]))
    check = auto.buckets
    assert check is not None and check["kept"] is True, (check, per_step)
    assert len(check["buckets_s"]) == (2 if settles else 0), check
    assert ("calibration_s" in check) is not settles, check


@pytest.mark.parametrize("settles", [False, True])
def test_a_step_of_the_bucket_check_in_which_the_runtime_settled_runs_again(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, settles: bool) -> None:
    """The choices 4x slower than DDP's buckets (fake clock as above): the check ends on their gap after two pairs and
    DDP's buckets run. Where the runtime settles something during the choices' first step of the check (their new
    sizes explored: a step slower than they will run), that step does not count and the choices run again: one step
    more of the check, still two times a side, the same verdict."""
    from gradsync.train.optimizer import DistributedOptimizer as Opt

    count = [0]
    monkeypatch.setattr(Runtime, "settling", property(lambda self: count[0]))
    now, sides = _charged_sides(monkeypatch, 4.0)
    turns: list[bool | None] = []
    original = Opt._next_bucket_turn

    def next_turn(self: Opt) -> bool | None:
        got = original(self)
        if got is False and settles and False not in turns:
            count[0] += 1  # the choices' first step of the check: the runtime explores meanwhile
        turns.append(got)
        return got

    monkeypatch.setattr(Opt, "_next_bucket_turn", next_turn)
    auto, model, opt = _layerwise_auto(rt, monkeypatch, now)
    for step in range(24):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    check = auto.buckets
    assert check is not None and check["kept"] is False, check
    assert check["chosen_s"] == pytest.approx([4.0, 4.0]) and check["buckets_s"] == [1.0, 1.0], check
    assert [t for t in turns if t is not None] == ([False] * (3 if settles else 2) + [True, True]), turns


@pytest.mark.parametrize("chosen_cost, kept", [(4.0, False), (0.1, True)])
def test_the_next_job_starts_with_the_cached_partition_and_bucket_verdict(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, chosen_cost: float, kept: bool) -> None:
    """``merge="auto"``: the first job searches its partition, settles and checks it against DDP's buckets (fake clock
    as above: the choices 4x slower, or 10x quicker than the calibration step, which stands for them). The next job with the same parameters and wire takes the cached
    partition (no search) and the verdict: after its two calibration steps it runs DDP's buckets where they won, or
    the cached choices without a bucket check where those did, and stops choosing within two steps. A DDP hook's job
    on the same parameters neither reads nor overwrites that cache. Another parameter signature searches and checks
    again."""
    from gradsync.compress.auto import JointChoice
    from gradsync.compress.merge_model import Partition
    from gradsync.train import auto_compression

    monkeypatch.setenv("GRADSYNC_CACHE", str(tmp_path))
    searched: list[int] = []

    def joint(sizes, *a, **k):
        searched.append(len(sizes))
        return JointChoice("none", Partition.layerwise(len(sizes)), 0.0, {"none": 0.0})

    monkeypatch.setattr(auto_compression, "choose_joint", joint)
    now, sides = _charged_sides(monkeypatch, chosen_cost)

    def job(wide: int = 16) -> tuple[AutoCompression, list[set[str]], list[bool]]:
        model = _model(wide)
        auto = AutoCompression("lossless", runtime=rt, wire=AlphaBeta(0.0, float("inf")),
                               codec_cost=lambda c, n: 0.0, clock=lambda: now[0],
                               signature=param_signature(model.named_parameters()))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                   runtime=rt, compression=auto)
        per_step, choosing = [], []
        for step in range(16):
            before = len(sides)
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
            opt.step()
            opt.zero_grad()
            per_step.append(set(sides[before:]))
            choosing.append(opt.choosing)
        return auto, per_step, choosing

    first, steps, _ = job()
    assert first.buckets is not None and first.buckets["kept"] is kept and "cached" not in first.buckets
    # (10x quicker than the calibration step, which ran DDP's buckets: those are not timed again)
    assert searched == [4] and ({"buckets"} in steps[2:]) is not kept and {"chosen"} in steps[2:], steps
    again, steps, choosing = job()
    assert searched == [4], searched  # the cached partition: no search
    assert again.buckets is not None and again.buckets["kept"] is kept and again.buckets["cached"], again.buckets
    assert again.joint is not None and again.joint.partition == Partition.layerwise(4)
    assert steps[:2] == [{"buckets"}, {"buckets"}]  # the calibration steps
    assert all(s == ({"chosen"} if kept else {"buckets"}) for s in steps[2:]), steps  # no bucket check
    # choosing until the calibration is over (DDP's buckets won) or the cached choices' first step timed whole
    assert choosing[:2] == [True, kept] and not any(choosing[4:]), choosing
    if kept:
        assert again.cached and {r["reason"] for r in again.table()} == {"cached"}
    # a DDP hook's job on the same parameters and wire has a cache of its own: it reads nothing of the optimizer's
    # (its verdict is about the optimizer's partition), and what it writes leaves the optimizer's as it was
    hook_side = AutoCompression("lossless", runtime=rt, wire=AlphaBeta(0.0, float("inf")),
                                codec_cost=lambda c, n: 0.0, signature=param_signature(_model().named_parameters()))
    hook_side.bind("hook")
    hook_side._load_once()
    assert not hook_side.cached and hook_side.buckets is None and hook_side.cache_path() != again.cache_path()
    hook_side._write_cache()
    third, _, _ = job()
    assert searched == [4] and third.joint is not None and third.buckets is not None and third.buckets["cached"]
    unbound = AutoCompression("lossless", runtime=rt, wire=AlphaBeta(0.0, float("inf")), signature=[])
    unbound.bind("optimizer")
    unbound.bind("optimizer")  # the same path again is no change
    with pytest.raises(CompressionError, match="already chooses for the 'optimizer' path"):
        unbound.bind("hook")
    late = AutoCompression("lossless", runtime=rt, wire=AlphaBeta(0.0, float("inf")), signature=[])
    late._load_once()
    with pytest.raises(CompressionError, match="bind it before training"):
        late.bind("hook")
    other, steps, _ = job(wide=32)
    assert searched == [4, 4] and other.buckets is not None and "cached" not in other.buckets
    assert ({"buckets"} in steps[2:]) is not kept and {"chosen"} in steps[2:], steps


@pytest.mark.parametrize("allow, wire, checked", [("lossless", AlphaBeta(0.0, float("inf")), False),
                                                  ("cast", SLOW, True)])
def test_choices_on_ddps_own_buckets_are_checked_only_where_they_compress(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, allow: str, wire, checked: bool) -> None:
    """The joint choice keeps DDP's one bucket: settled on ``"none"`` on the backend's allreduce it is DDP's own step,
    and nothing is timed against it; settled on a cast (a slow wire) it is timed against DDP's bucket uncompressed
    all the same (here, costing the same, the tie goes to DDP's bucket)."""
    from gradsync.compress.auto import JointChoice
    from gradsync.compress.merge_model import Partition
    from gradsync.train.grouped import MergedGroups

    now = [0.0]
    _with_native(rt, monkeypatch)
    auto = AutoCompression(allow, runtime=rt, wire=wire, codec_cost=lambda c, n: 0.0, clock=lambda: now[0],
                           cache=False)
    monkeypatch.setattr(auto, "plan_partition", lambda sizes, *a, **k: JointChoice(
        "none", Partition.single(len(sizes)), 0.0, {"none": 0.0}))
    real = MergedGroups._launch

    def launch(self, g):
        now[0] += 1.0
        real(self, g)

    monkeypatch.setattr(MergedGroups, "_launch", launch)
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), runtime=rt,
                               compression=auto)
    for step in range(30):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert auto.settled and auto.verified
    codecs = {c.codec for c in auto.choices.values()}
    assert codecs == ({"fp16"} if checked else {"none"}), auto.table()
    assert (auto.buckets is not None) is checked and opt._buckets is None, auto.buckets
    if checked:
        assert auto.buckets["kept"] is False and opt.partition == Partition.single(4)
        assert [r["reason"] for r in auto.table()] == ["buckets"]


def test_the_hook_state_is_choosing_until_autos_choices_are_settled_and_checked(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradsync.train.compressed_hook import CompressionHookState

    assert CompressionHookState("fp16", runtime=rt).choosing is False
    auto = AutoCompression("cast", runtime=rt, cache=False)
    state = CompressionHookState(auto, runtime=rt)
    assert state.choosing is True  # nothing seen yet
    monkeypatch.setattr(AutoCompression, "settled", property(lambda self: True))
    assert state.choosing is True  # settled, the whole-step check not over
    auto.verified = True
    assert state.choosing is False


@pytest.mark.parametrize("path, codec, planned, says", [("hook", "none", False, True), ("hook", "fp16", False, False),
                                                     ("hook", "none", True, False), ("optimizer", "none", False, False)])
def test_the_report_says_when_a_hook_that_compresses_nothing_costs_a_pass_ddp_does_not(
        rt: Runtime, path: str, codec: str, planned: bool, says: bool) -> None:
    """Once every DDP bucket settled on "none" on the backend's allreduce, the hook runs DDP's own exchange plus the
    average's pass (DDP fuses it into its copy into the bucket only without a hook): the report says so. Not where a
    bucket compresses or runs the planned exchange (DDP has neither), nor on the optimizer's path."""
    from gradsync.compress.auto import AutoChoice, GroupSpec
    from gradsync.train.auto_compression import _Group

    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, cache=False)
    auto.bind(path)
    group = _Group(GroupSpec("bucket0", ((4,),), torch.float32), native=not planned, planned=planned, final=True)
    group.choice = AutoChoice("bucket0", 16, codec, 16 if codec == "none" else 8, 1e-3, 1e-3, "measured")
    auto._groups["bucket0"] = group
    assert ("without a comm hook" in auto.report()) is False  # the whole-step check is not over
    auto.verified = True
    assert ("without a comm hook" in auto.report()) is says, auto.report()


@pytest.mark.parametrize("gain", [TRY_GAIN, 1.0])
def test_a_way_on_gradsyncs_thread_is_kept_on_the_lead_threaded_gain_asks(rt: Runtime, gain: float) -> None:
    """The planned exchange measured 1.11x quicker than the backend's allreduce, and a threaded fp16 1.11x quicker
    than that allreduce: short of TRY_GAIN, both are refused (the backend's "none" stays); with ``threaded_gain`` 1
    (the optimizer's whole steps against DDP's buckets follow), both are kept on their lead."""
    from gradsync.compress.auto import AutoChoice, GroupSpec
    from gradsync.train.auto_compression import _Group

    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, cache=False)
    auto.threaded_gain = gain
    kept = gain == 1.0
    planned = _Group(GroupSpec("planned", ((4,),), torch.float32), native=True,
                     times={"none": [2.0e-3, 2.0e-3], PLANNED: [1.8e-3, 1.8e-3]})
    auto._agree_planned(planned)
    assert planned.planned is kept

    codec = _Group(GroupSpec("fp16", ((4,),), torch.float32), native=True, threaded={"fp16"},
                   times={"none": [2.0e-3, 2.0e-3], "fp16": [1.8e-3, 1.8e-3]})
    codec.choice = AutoChoice("fp16", 16, "fp16", 8, 1.0e-3, 2.0e-3)
    assert auto._agree_review(codec).codec == ("fp16" if kept else "none")


@pytest.mark.parametrize("merge", ["auto", 2])
def test_the_optimizer_lowers_threaded_gain_where_its_bucket_check_follows(rt: Runtime, merge: int | str) -> None:
    """merge="auto": after calibrating, whole steps against DDP's buckets sent uncompressed are to come, and they
    decide a threaded way's lead (threaded_gain 1); a partition of the caller's has no such check (TRY_GAIN)."""
    auto = _auto(rt, FakeClock({"none": 1e-4, "other": 1e-6}))
    opt, _ = _train(rt, auto, 3, merge=merge)
    assert auto.threaded_gain == (1.0 if merge == "auto" else TRY_GAIN)
    assert (opt._buckets is not None) is (merge == "auto")


def test_one_auto_compression_serves_one_optimizer_or_hook(rt: Runtime) -> None:
    """Shared by two DistributedOptimizers (or two hook states), one AutoCompression would take the second's launches
    for the first's next step; the second is refused with the fix, and one whose first owner is gone is taken."""
    import gc

    from gradsync.train.compressed_hook import CompressionHookState

    auto = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, cache=False)
    first, second = _model(), _model()
    opt = DistributedOptimizer(torch.optim.SGD(first.parameters(), lr=0.1), first.named_parameters(), runtime=rt,
                               compression=auto)
    auto.bind("optimizer", opt)  # its own owner again: no change
    with pytest.raises(CompressionError, match="already chooses for a DistributedOptimizer; give this "
                                               "DistributedOptimizer an AutoCompression of its own"):
        DistributedOptimizer(torch.optim.SGD(second.parameters(), lr=0.1), second.named_parameters(), runtime=rt,
                             compression=auto)
    opt.remove_hooks()  # its gradient hooks hold it alive as long as the model
    del opt
    gc.collect()
    DistributedOptimizer(torch.optim.SGD(second.parameters(), lr=0.1), second.named_parameters(), runtime=rt,
                         compression=auto)

    hooked = AutoCompression("cast", runtime=rt, wire=SLOW, codec_cost=lambda c, n: 0.0, cache=False)
    state = CompressionHookState(hooked, runtime=rt, model=first)
    with pytest.raises(CompressionError, match="already chooses for a CompressionHookState"):
        CompressionHookState(hooked, runtime=rt, model=second)
    assert state.auto is hooked


@pytest.mark.parametrize("ratio", [1.4, 2.0])
def test_a_settled_step_ends_the_whole_step_check_only_calibration_gain_ahead_of_the_probes(
        rt: Runtime, ratio: float) -> None:
    """The groups' probes ran "none" everywhere in a few steps before the codecs (still warming). A first settled
    step ``ratio`` times quicker than all of them ends the whole-step check at once only from CALIBRATION_GAIN (1.5)
    on, the bar the optimizer's calibration step is held to; at 1.4x (past TRY_GAIN) "none" is timed warm, alternating
    with the settled steps, before fp16 is kept."""
    from gradsync.compress.auto import CALIBRATION_GAIN

    clock = FakeClock({"none": 1e-4, "other": 1e-6})
    auto = AutoCompression("cast", runtime=rt, wire=_slow_any_world, codec_cost=lambda c, n: 0.0, clock=clock,
                           cache=False)
    clock.auto = auto

    def paced(launches: list) -> None:
        """A step running the settled codecs ends ``1 / ratio`` of the quickest probe step after its first launch."""
        if (auto.settled and launches and auto._early_none_steps
                and any(launch.codec != "none" for launch in launches)):
            start = min(launch.t0 for launch in launches)
            clock.now = max(clock.now, start + min(auto._early_none_steps) / ratio)

    _before_close(auto, paced)
    _train(rt, auto, 5 * PROBE_STEPS + 3)
    check = auto.step_check
    assert auto.verified and check["early_none_s"] and check["settled_s"], check
    assert {r["codec"] for r in auto.table()} == {"fp16"}, auto.table()
    apart = min(check["early_none_s"]) / check["settled_s"][0]
    assert apart == pytest.approx(ratio, rel=0.05), check  # the span the check reads, within a few % of the pace
    if ratio >= CALIBRATION_GAIN:
        assert not check["baseline_s"] and len(check["settled_s"]) == 1, check  # the gap ended the check
    else:
        assert len(check["baseline_s"]) == PROBE_STEPS, check  # "none" timed warm before fp16 stays


@pytest.mark.parametrize("fp16_s, penalty, planned, restored",
                         [(1.1e-4, 1e-3, False, True), (1.1e-4, 1e-3, True, True), (1.1e-4, 0.0, False, False),
                          (2e-4, 1e-3, False, None)])
def test_a_codec_dropped_on_a_close_call_comes_back_where_its_whole_steps_are_quicker(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, fp16_s: float, penalty: float, planned: bool,
        restored: bool | None) -> None:
    """One group's fp16 measures ``fp16_s`` a launch against "none"'s 1e-4: 1.1x slower, a close call its review
    drops, yet every settled step that runs "none" costs ``penalty`` more elsewhere (its exchange holding the cores
    backward needs). The whole-step check first alternates steps with the drop and with fp16 put back: with the
    penalty fp16 comes back (reason "step"; where the group's "none" was the planned exchange, fp16 then runs in its
    place) and the check against "none" everywhere keeps it; without it the drop stands. A drop by more than
    TRY_GAIN (2x slower) is no close call: no step puts it back."""
    if planned:
        _with_planned_none(rt, monkeypatch)
    # with a planned way, "none" on the backend measures 1.3x slower than it: the planned way is the group's "none"
    clock = LaunchClock({"none": 1.3e-4 if planned else 1e-4, "fp16": fp16_s, PLANNED: 1e-4, "other": 1e-6})
    auto = _close_call_auto(rt, clock, {"none", PLANNED}, penalty)
    (row,) = auto.table()
    check = auto.step_check
    assert auto._groups[row["group"]].planned is (planned and not restored), row
    if restored is None:
        assert not check["restore"] and not check["dropped_s"] and not check["restored_s"], check
        assert (row["codec"], row["reason"]) == ("none", "dropped"), row
        return
    assert check["restore"] == {row["group"]: "fp16"}, (check, auto.trial_times)
    assert len(check["dropped_s"]) == len(check["restored_s"]) == PROBE_STEPS, check
    if restored:
        assert (row["codec"], row["reason"]) == ("fp16", "step"), row
        assert len(check["baseline_s"]) == PROBE_STEPS, check  # then timed against "none" everywhere, and kept
    else:
        assert (row["codec"], row["reason"]) == ("none", "dropped"), row


def _close_call_auto(rt: Runtime, clock: LaunchClock, penalized: set[str], penalty: float) -> AutoCompression:
    """An auto that trains one group through its choices and the whole-step checks on ``clock``, each settled step
    that launched a codec of ``penalized`` costing ``penalty`` more at its close."""
    auto = AutoCompression("cast", runtime=rt, wire=_slow_any_world, codec_cost=lambda c, n: 0.0, clock=clock,
                           cache=False)
    clock.auto = auto

    def costly(launches: list) -> None:
        if auto.settled and any(launch.codec in penalized for launch in launches):
            clock.now += penalty

    _before_close(auto, costly)
    _train(rt, auto, 6 * PROBE_STEPS + 3, wide=8, merge=1)  # one group, timed at its codec's cost a launch
    assert auto.settled and auto.verified, (auto.table(), auto.step_check)
    return auto


@pytest.mark.parametrize("planned_s, penalty, restored", [(1.1e-4, 1e-3, True), (1.1e-4, 0.0, False),
                                                          (2e-4, 1e-3, None)])
def test_a_planned_way_lost_on_a_close_call_comes_back_where_its_whole_steps_are_quicker(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, planned_s: float, penalty: float, restored: bool | None) -> None:
    """The group's planned exchange measures ``planned_s`` a launch against the backend's 1e-4: 1.1x slower, a close
    call, so the backend's "none" is kept; fp16 (3e-4) is then dropped far behind. Where every settled step on the
    backend's "none" costs ``penalty`` more, the whole steps put the planned way back (reason "step"); without the
    penalty the backend's way stays. 2x slower is no close call: no step puts it back."""
    _with_planned_none(rt, monkeypatch)
    clock = LaunchClock({"none": 1e-4, "fp16": 3e-4, PLANNED: planned_s, "other": 1e-6})
    auto = _close_call_auto(rt, clock, {"none"}, penalty)
    (row,) = auto.table()
    check = auto.step_check
    assert row["codec"] == "none" and auto._groups[row["group"]].planned is bool(restored), row
    if restored is None:
        assert not check["restore"] and not check["restored_s"], check
        return
    assert check["restore"] == {row["group"]: PLANNED}, check
    assert len(check["dropped_s"]) == len(check["restored_s"]) == PROBE_STEPS, check
    assert row["reason"] == ("step" if restored else "dropped"), row
    if restored:  # then timed against "none" on the backend everywhere, and kept
        assert len(check["baseline_s"]) == PROBE_STEPS, check


def test_auto_has_the_runtime_price_ahead_the_groups_it_may_send(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer, before its calibration steps: every run class of the model's tensors as fp16's payload (the
    partition is not chosen yet; "lossless" would anticipate them uncompressed). Each group, at its first launch: its
    own payloads, fp16's then "none"'s, first."""
    from gradsync.compress.auto import run_classes

    asked: list[tuple[list[float], bool]] = []
    monkeypatch.setattr(Runtime, "anticipate", lambda self, sizes, first=False: asked.append((list(sizes), first)))
    monkeypatch.setattr("gradsync.train.auto_compression.AHEAD_FLOOR_BYTES", 64)  # the tiny model's classes too
    auto = _auto(rt, FakeClock({"none": 1e-6, "other": 1e-6}))
    opt, _ = _train(rt, auto, 3, wide=64)
    params = [p.numel() * 4 for p in _model(64).parameters()]
    classes = run_classes(params, 64)
    assert asked[0] == ([c // 2 for c in classes], False)  # fp16's: "none"'s first call comes with no lead
    groups = [(name, g.spec.nbytes) for name, g in auto._groups.items()]
    assert len(groups) >= 2 and asked[1:] == [([n // 2, n], True) for _, n in groups]
    asked.clear()
    AutoCompression("lossless", runtime=rt).anticipate_model(list(_model(64).parameters()))
    assert asked == [(classes, False)]  # no cast allowed: the classes as they are


def test_the_auto_hook_given_the_model_prices_its_buckets_classes_ahead(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP's buckets are runs of the model's tensors: a hook state given the model and a runtime anticipates their
    classes as the optimizer does, then, first, the payloads of the buckets DDP's first backward sends (its default
    limits, the parameters in reverse: torch's own bucket assignment, here with limits small enough for several);
    without the model it knows nothing before the first bucket."""
    import torch.distributed as dist

    from gradsync.compress.auto import run_classes
    from gradsync.train.compressed_hook import CompressionHookState

    asked: list[tuple[list[float], bool]] = []
    monkeypatch.setattr(Runtime, "anticipate", lambda self, sizes, first=False: asked.append((list(sizes), first)))
    monkeypatch.setattr("gradsync.train.auto_compression.AHEAD_FLOOR_BYTES", 64)
    monkeypatch.setattr("gradsync.train.grouped.FIRST_BUCKET_BYTES", 256)
    monkeypatch.setattr("gradsync.train.grouped.DDP_BUCKET_BYTES", 1024)
    model = _model(64)
    CompressionHookState("auto", runtime=rt, model=model)
    classes = run_classes([p.numel() * 4 for p in model.parameters()], 64)
    params = list(reversed(list(model.parameters())))
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [256, 1024])
    nbytes = [sum(params[i].numel() * 4 for i in bucket) for bucket in buckets]
    assert len(nbytes) > 1 and asked == [([c // 2 for c in classes], False), ([n // 2 for n in nbytes] + nbytes, True)]
    CompressionHookState("auto", runtime=rt)
    assert len(asked) == 2  # nothing more
