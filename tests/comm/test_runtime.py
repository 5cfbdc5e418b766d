"""The runtime (gradsync.comm.runtime) on the in-process fabric: its communication thread and the module API without a process group."""

from __future__ import annotations

import pytest
import torch

from gradsync.comm import run_ranks
from gradsync.errors import GradsyncError


def test_blocking_allreduce_runs_on_the_callers_thread_only_when_nothing_is_queued():
    """``Runtime.allreduce`` skips the communication thread when it is idle, but never overtakes queued work:
    a blocking call behind a queued one runs after it, on the communication thread, and every sum is exact."""
    import threading

    from gradsync.comm import Runtime

    def body(tr):
        rt = Runtime(tr, "switch:3", "ring", timeout_s=20)
        ex = rt.executor()
        ran: list[tuple[str, float]] = []
        real_run = ex.run

        def spy(tensors, op="sum"):
            ran.append((threading.current_thread().name, float(tensors.flatten()[0])))
            return real_run(tensors, op)

        ex.run = spy
        gate = threading.Event()
        xs = [torch.full((517,), float(10 ** i * (tr.rank + 1))) for i in range(3)]
        rt.submit(lambda: gate.wait(10))  # holds the queue until the timer fires
        first = rt.allreduce_async(xs[0])
        threading.Timer(0.2, gate.set).start()
        rt.allreduce(xs[1])  # queued work ahead: must wait its turn on the communication thread
        assert first.done()
        rt.allreduce(xs[2])  # idle: runs right here
        rt.shutdown()
        return ran, [float(x[0]) for x in xs], threading.current_thread().name

    for got in run_ranks(3, body):
        assert not isinstance(got, BaseException), got
        ran, sums, caller = got
        assert sums == [6.0, 60.0, 600.0]
        assert [who for who, _ in ran] == ["gradsync-comm", "gradsync-comm", caller]
        assert ran[0][1] < 10 <= ran[1][1]  # the queued one went first, before the blocking one


def test_get_runtime_without_a_process_group_says_how_to_start():
    import torch.distributed as dist

    import gradsync

    if dist.is_initialized() or gradsync.is_initialized():
        pytest.skip("a process group or runtime exists in this test process")
    with pytest.raises(GradsyncError, match=r"call gradsync.init\(\), or torch.distributed.init_process_group\(\)"):
        gradsync.get_runtime()


def test_every_collective_is_a_named_range_in_the_profiler(tmp_path):
    """Each collective runs inside ``record_function("gradsync::<what>")``: an inline allreduce shows on the
    caller's thread in any trace; queued work runs on the communication thread, which torch's profiler records
    with ``profile_all_threads``, and the Chrome trace a user opens holds it."""
    import json

    from torch.profiler import ProfilerActivity, profile

    from gradsync.comm import LocalFabric, Runtime

    try:
        from torch._C._profiler import _ExperimentalConfig

        every_thread = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        pytest.skip("this torch's profiler cannot record every thread")
    rt = Runtime(LocalFabric(1).transport(0), "switch:1", "ring", timeout_s=10)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as caller_only:
            rt.allreduce(torch.ones(10))
        assert "gradsync::allreduce::ring" in {e.name for e in caller_only.events()}
        with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
            rt.allreduce_async(torch.ones(10)).wait()
            rt.allgather(torch.ones(3))
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
    finally:
        rt.shutdown()
    names = {e["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if "name" in e}
    assert {"gradsync::allreduce::ring", "gradsync::allgather"} <= names


def test_settling_grows_on_a_size_classs_first_call_and_not_on_the_next():
    """A size class's first allreduce prices its choice (both ranks agree on it; its executor, one per algorithm and
    depth, may exist already): ``Runtime.settling`` grows across it, so a timing of that call is not one of the
    exchange. The second call of the same size, and of another size in the same class, settles nothing; a larger
    class does again."""
    from gradsync.comm import Runtime

    def body(tr):
        rt = Runtime(tr, "switch:2", "auto", timeout_s=20)
        grew = []
        for n in (1000, 1000, 900, 100_000):
            before = rt.settling
            rt.allreduce(torch.ones(n))
            grew.append(rt.settling - before)
        rt.shutdown()
        return grew

    for got in run_ranks(2, body):
        assert not isinstance(got, BaseException), got
        assert got[0] >= 1 and got[1] == got[2] == 0 and got[3] >= 1, got


def test_auto_prices_nothing_at_init_and_each_size_class_at_its_first_call(monkeypatch):
    """``auto`` knows its candidates at init but prices no size class there: the default class was priced on a
    model that calibration replaced right after (every candidate simulated, most of init on 9 ranks). The first
    call of a class prices exactly that class. A named algorithm is still planned at init, so a bad one fails
    there."""
    from gradsync.comm import Runtime
    from gradsync.sim.choose import Chooser

    priced: list[float] = []
    original = Chooser._choose
    monkeypatch.setattr(Chooser, "_choose", lambda self, size: priced.append(size) or original(self, size))

    def body(tr):
        rt = Runtime(tr, "racks:2,2,2", "auto", timeout_s=20)
        at_init = dict(rt.plans.chosen())
        rt.allreduce(torch.ones(1000))
        after = dict(rt.plans.chosen())
        rt.shutdown()
        return at_init, after

    for got in run_ranks(4, body):
        assert not isinstance(got, BaseException), got
        at_init, after = got
        assert at_init == {} and len(after) == 1, got
    assert len(set(priced)) == 1 and priced[0] < 1e6, priced  # the one class it ran, not options.size_bytes'

    def named(tr):
        try:
            Runtime(tr, "switch:2", "no-such-plan", timeout_s=20)
        except Exception as exc:  # noqa: BLE001 - the message is what the test reads
            return f"{type(exc).__name__}: {exc}"
        return None

    for got in run_ranks(2, named):
        assert isinstance(got, str) and "no-such-plan" in got, got


def test_a_works_finish_runs_once_on_the_thread_that_waits_and_not_after_a_failure():
    """``Work(future, finish=f)``: the first ``wait()`` applies ``f`` to the collective's result on the waiting
    thread, later waits return the same object without running it again; a collective that failed raises from
    ``wait()`` and ``f`` never sees its result."""
    import threading

    from gradsync.comm.runtime import Work

    seen: list[tuple[list[int], threading.Thread]] = []

    def finish(value: list[int]) -> list[int]:
        seen.append((value, threading.current_thread()))
        return [2 * v for v in value]

    fut: torch.futures.Future = torch.futures.Future()
    work = Work(fut, "w", finish=finish)
    done = threading.Thread(target=lambda: fut.set_result([1, 2]))
    done.start()
    done.join()
    first = work.wait()
    assert first == [2, 4] and work.wait() is first
    assert seen == [([1, 2], threading.main_thread())]
    assert Work(fut, "plain").wait() == [1, 2]  # no finish: the collective's own result

    failed: torch.futures.Future = torch.futures.Future()
    failed.set_exception(RuntimeError("peer lost"))
    with pytest.raises(RuntimeError, match="peer lost"):
        Work(failed, "bad", finish=finish).wait()
    assert len(seen) == 1
