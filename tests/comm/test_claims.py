"""One live runtime a transport, and a later runtime on it never reads an earlier one's decisions
(:mod:`gradsync.comm.claims`)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from gradsync.comm.local import LocalFabric
from gradsync.comm.runtime import Runtime
from gradsync.errors import GradsyncError, PlanError
from tests.threads import comm_threads


def _pair(fabric: LocalFabric) -> list[Runtime]:
    return [Runtime(fabric.transport(r), "switch:2") for r in range(2)]


def test_a_transport_serves_one_runtime_until_it_is_shut_down() -> None:
    fabric = LocalFabric(1)
    transport = fabric.transport(0)
    first = Runtime(transport, "switch:1")
    with pytest.raises(GradsyncError, match="already serves a runtime.*shutdown"):
        Runtime(transport, "switch:1")
    other = Runtime(fabric.transport(0), "switch:1")  # another transport of the same fabric: its own
    first.shutdown()
    second = Runtime(transport, "switch:1")
    assert (first.plans.namespace, second.plans.namespace, other.plans.namespace) == ("", "r1/", "")
    second.shutdown()
    other.shutdown()


def test_a_runtime_that_fails_to_start_frees_its_transport_and_ends_its_thread() -> None:
    transport = LocalFabric(1).transport(0)
    before = set(comm_threads())
    with pytest.raises(PlanError):
        Runtime(transport, "switch:1", "no-such-algorithm")
    assert set(comm_threads()) <= before
    Runtime(transport, "switch:1").shutdown()


def test_a_later_runtime_on_the_transports_never_reads_an_earlier_ones_decision() -> None:
    """Rank 1 of the second pair asks before rank 0 of that pair has decided: it must wait for that answer, not
    take the first pair's answer to the same key."""
    fabric = LocalFabric(2, decide=True)
    first = _pair(fabric)
    assert first[0].plans.decide("k", lambda: b"first") == b"first"
    assert first[1].plans.decide("k", lambda: b"unused") == b"first"
    for rt in first:
        rt.shutdown()
    transports = [rt.transport for rt in first]
    third = [Runtime(t, "switch:2") for t in transports]
    assert [rt.plans.namespace for rt in third] == ["r1/", "r1/"]
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(third[1].plans.decide("k", lambda: b"unused")))
    reader.start()
    time.sleep(0.2)  # rank 1 is waiting (reading the first pair's key instead, it would be done already)
    assert third[0].plans.decide("k", lambda: b"third") == b"third"
    reader.join(10)
    assert got == [b"third"]
    for rt in third:
        rt.shutdown()


def test_a_runtime_whose_thread_outlives_shutdown_keeps_its_transport() -> None:
    """shutdown() waits ``timeout_s`` for the communication thread; one still running then (stuck in a collective)
    would meet a new runtime's messages on the transport, so the transport stays claimed."""
    transport = LocalFabric(1).transport(0)
    first = Runtime(transport, "switch:1")
    thread = first._thread
    first._thread = SimpleNamespace(is_alive=lambda: True, join=lambda timeout=None: None)  # stuck
    first.shutdown()
    with pytest.raises(GradsyncError, match="already serves a runtime"):
        Runtime(transport, "switch:1")
    first._thread = thread
    first.shutdown()  # the thread ends: the transport is free
    Runtime(transport, "switch:1").shutdown()
