"""The runtime's Chrome trace (GRADSYNC_TRACE / init(trace=...)): one span per collective, with its algorithm,
bytes and group size, on the thread that ran it; read back with the format's own rules (tests/trace_events.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from gradsync.comm import LocalFabric, Runtime
from gradsync.comm.trace import rank_trace_path
from tests.trace_events import load_trace, spans, thread_names


def test_each_rank_writes_its_own_file():
    assert str(rank_trace_path("t.json", 1, 2)) == "t.rank1.json"
    assert str(rank_trace_path("t.json", 0, 1)) == "t.json"
    assert str(rank_trace_path("run-{rank}.json", 3, 4)) == "run-3.json"
    with pytest.raises(ValueError, match=r"must end in \.json"):
        rank_trace_path("t.txt", 0, 2)


def test_two_ranks_trace_one_span_per_collective(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSYNC_TRACE", str(tmp_path / "run.json"))
    fabric = LocalFabric(2)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            rt = Runtime(fabric.transport(r), "switch:2", "ring", timeout_s=20)
            try:
                rt.allreduce(torch.ones(10))                    # inline, on this thread
                rt.allreduce_async(torch.ones(100)).wait()      # queued, on the communication thread
                rt.allgather(torch.ones(3))                     # a submitted job
            finally:
                rt.shutdown()                                   # writes the file
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for r in range(2):
        events = load_trace(tmp_path / f"run.rank{r}.json")
        got = spans(events)
        names = thread_names(events)
        assert [e["name"] for e in sorted(got, key=lambda e: e["ts"])] == [
            "gradsync::allreduce::ring", "gradsync::allreduce::ring", "gradsync::allgather"]
        assert all(e["pid"] == r and e["args"]["group_size"] == 2 for e in got)
        ring = [e["args"] for e in got if e["args"]["collective"] == "allreduce"]
        assert sorted(a["bytes"] for a in ring) == [40, 400] and {a["algorithm"] for a in ring} == {"ring"}
        by_bytes = {e["args"]["bytes"]: names[(e["pid"], e["tid"])] for e in got if e["args"]["bytes"]}
        assert by_bytes == {40: f"rank{r}", 400: "gradsync-comm"}
