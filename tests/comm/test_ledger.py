"""The ledger's comparison (gradsync/comm/ledger.py) without processes: what each mismatch is called."""

from __future__ import annotations

import torch

from gradsync.comm.ledger import Ledger, describe_mismatch


def _ledger(*calls: tuple[str, int, torch.dtype]) -> Ledger:
    ledger = Ledger()
    for kind, n, dtype in calls:
        ledger.record(kind, torch.empty(n, dtype=dtype))
    return ledger


def test_one_call_fewer_names_both_counts():
    four, five = _ledger(*[("allreduce", 10, torch.float32)] * 4), _ledger(*[("allreduce", 10, torch.float32)] * 5)
    text = describe_mismatch(0, five.encode("failed"), {1: four.encode("finished")}, 2)
    assert text == ("ranks made different collective calls: rank 1 called allreduce 4 times, rank 0 5 times; "
                    "rank 1 had already shut down")


def test_sizes_and_dtypes_of_the_same_call_are_named_with_the_ranks():
    a, b, c = (_ledger(("allreduce", n, d)) for n, d in ((1000, torch.float32), (2000, torch.float32),
                                                         (2000, torch.float32)))
    text = describe_mismatch(0, a.encode("failed"), {1: b.encode("failed"), 2: c.encode("failed")}, 3)
    assert text == "allreduce #1 differs between ranks: rank 0 sent 1000 float32, ranks 1, 2 2000"
    half = _ledger(("allreduce", 1000, torch.float16))
    assert describe_mismatch(1, half.encode("failed"), {0: a.encode("failed")}, 2) == (
        "allreduce #1 differs between ranks: rank 0 sent 1000 float32, rank 1 1000 float16")


def test_different_collectives_and_silent_ranks():
    gather = Ledger()
    gather.record("allgather", torch.empty(5), sized=False)
    reduce = _ledger(("allreduce", 5, torch.float32))
    text = describe_mismatch(0, reduce.encode("failed"), {1: gather.encode("failed")}, 3)
    assert text.startswith("ranks made different collective calls: rank 0 called allgather 0 times, rank 1 once")
    assert text.endswith("(rank 2 did not report: still inside a collective, or gone)")


def test_nothing_to_name():
    same = _ledger(("allreduce", 5, torch.float32)).encode("failed")
    assert describe_mismatch(0, same, {1: same}, 2) is None
    assert describe_mismatch(0, same, {}, 2) is None  # nobody else reported: the transport's own error stands
    uneven = Ledger()
    uneven.record("allgather", torch.empty(7), sized=False)  # uneven allgathers differ in size by design
    other = Ledger()
    other.record("allgather", torch.empty(9), sized=False)
    assert describe_mismatch(0, uneven.encode("failed"), {1: other.encode("failed")}, 2) is None


def test_a_stale_post_still_names_a_size_the_silent_rank_never_used():
    """A rank that posted at its first 1000-element call and then died (gloo aborted it) without posting again."""
    silent = _ledger(("allreduce", 1000, torch.float32))
    me = _ledger(*[("allreduce", 1000, torch.float32)] * 3, ("allreduce", 64, torch.float32))
    text = describe_mismatch(0, me.encode("failed"), {1: silent.encode("running")}, 2)
    assert text == ("allreduce #4 differs between ranks: rank 0 sent 64 float32, which rank 1 never sent in an "
                    "allreduce (it sent 1000 float32, then stopped answering)")


def test_a_new_signature_is_reported_once():
    ledger = Ledger()
    assert ledger.record("allreduce", torch.empty(3)) is True
    assert ledger.record("allreduce", torch.empty(3)) is False
    assert ledger.record("allreduce", [torch.empty(3), torch.empty(2, dtype=torch.float16)]) is True
    assert ledger.last == ("allreduce", 3, 5, "float32+float16")
