"""Pricing ahead in a child process (gradsync.sim.pricing): the same bits as pricing here, plain data on the pipe, and
a child that fails or is closed leaves the pricing to the parent and nothing behind."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import numpy as np
import pytest

from gradsync.errors import PlanError
from gradsync.sim.choose import Chooser
from gradsync.sim.cost import CostModel
from gradsync.sim.pricing import NICE, Pricer, adopt_priced, chooser_from_spec, chooser_spec, priced_doc
from gradsync.topology.io import get_topology
from gradsync.topology.model import LINK_SCALE

MODEL = CostModel(message_s=2e-4, native_message_s=2e-4, link_GBps={"uplink": 0.25})  # a probed class rate
MIB = 1 << 20


def _chooser(topology=None) -> Chooser:
    return Chooser(topology or get_topology("racks:2,3,4"), MODEL, native=True, keep_within=0.1)


def _pick_finish(c: Chooser, size: int) -> np.ndarray | None:
    got = c.choose(size)
    return c.finish_times(c.schedule(got.algorithm, got.pipeline), size)


def _until(pricer: Pricer, size: int, timeout_s: float = 120.0) -> bool:
    """Take ``size`` once the child priced it (False if it failed first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pricer.take(size, timeout_s):
            return True
        if pricer.failed is not None:
            return False
        time.sleep(0.02)
    raise AssertionError(f"the child did not price {size} in {timeout_s} s")


def test_a_chooser_rebuilt_from_its_spec_makes_the_same_choices_and_a_scaled_link_travels():
    """A replan's belief (a link scaled, recorded in the topology's attrs) is priced the same by the copy; without the
    record the model's class rate would put the link back at its class's rate."""
    from gradsync.comm.watch import scaled_topology

    topo = get_topology("racks:2,3,4")
    last = len(topo.links) - 1
    scaled = scaled_topology(topo, {(last, 0): 0.25, (last, 1): 0.25})
    for t in (topo, scaled):
        c = _chooser(t)
        copy = chooser_from_spec(json.loads(json.dumps(chooser_spec(c))))
        assert copy.choose(8 * MIB) == c.choose(8 * MIB)  # every candidate's prediction, bit for bit
    forgot = _chooser(replace(scaled, attrs={k: v for k, v in scaled.attrs.items() if k != LINK_SCALE}))
    assert forgot.choose(8 * MIB).predicted_s != _chooser(scaled).choose(8 * MIB).predicted_s


def test_a_chooser_whose_inputs_json_cannot_carry_is_not_sent():
    topo = get_topology("racks:2,3,4")
    for attrs, why in (({"owner": object()}, "not JSON"), ({"ids": {1: "a"}}, "does not survive JSON")):
        with pytest.raises(PlanError, match=why):
            chooser_spec(_chooser(replace(topo, attrs=attrs)))


def test_a_malformed_spec_is_refused_by_name():
    doc = chooser_spec(_chooser())
    with pytest.raises(PlanError, match='"type": "gradsync.chooser"'):
        chooser_from_spec({**doc, "type": "other"})
    with pytest.raises(PlanError, match="must be exactly"):
        chooser_from_spec({k: v for k, v in doc.items() if k != "native"})
    with pytest.raises(PlanError, match="native='yes' must be true or false"):
        chooser_from_spec({**doc, "native": "yes"})
    with pytest.raises(PlanError, match=r"options \['nope'\]"):
        chooser_from_spec({**doc, "options": {"nope": 1}})
    with pytest.raises(PlanError, match="unknown algorithm 'no-such-planner'"):
        chooser_from_spec({**doc, "algorithms": ["no-such-planner"]})
    with pytest.raises(PlanError, match=r"algorithms \['bml'\] are not all applicable"):
        chooser_from_spec({**doc, "algorithms": ["bml"]})  # BCube's, not a rack fabric's


def test_an_adopted_class_is_what_pricing_here_gives_without_simulating(monkeypatch):
    """priced_doc -> JSON -> adopt_priced: the choice, its candidates and the pick's finish times (the executor's wait
    order) are the bits a fresh chooser computes, and the adopting chooser simulates nothing for the class."""
    size = 4 * MIB
    there = _chooser()
    doc = json.loads(json.dumps(priced_doc(there, size)))
    here = _chooser()

    def no_simulation(*a, **kw):
        raise AssertionError("an adopted class is not simulated again")

    monkeypatch.setattr(here.model.__class__, "run", no_simulation)
    adopt_priced(here, doc)
    got = here.choose(size)
    monkeypatch.undo()
    fresh = _chooser()
    assert got == fresh.choose(size)
    schedule = here.schedule(got.algorithm, got.pipeline)
    assert np.array_equal(here.finish_times(schedule, size), _pick_finish(fresh, size))


def test_adopt_refuses_a_damaged_class():
    size = 2 * MIB
    doc = priced_doc(_chooser(), size)
    with pytest.raises(PlanError, match="needs size, choice, predicted and finish"):
        adopt_priced(_chooser(), {"size": size})
    with pytest.raises(PlanError, match="must be a size class"):
        adopt_priced(_chooser(), {**doc, "size": size + 1})
    if doc["finish"] is not None:
        short = {**doc["finish"], "count": doc["finish"]["count"] + 1}
        with pytest.raises(PlanError, match="finite values, not"):
            adopt_priced(_chooser(), {**doc, "finish": short})
    with pytest.raises(PlanError, match="malformed"):
        adopt_priced(_chooser(), {**doc, "choice": {"algorithm": "tree"}})


def test_the_child_prices_what_it_is_asked_first_before_the_rest_and_the_parent_adopts_the_same_bits():
    """Three classes asked in order, then the last again as ``first``: the child, still importing, reads both asks
    before it starts and prices that one first. Each class the parent takes is the choice a chooser here makes."""
    c = _chooser()
    pricer = Pricer(c)
    try:
        sizes = [1 * MIB, 2 * MIB, 8 * MIB]
        pricer.ask(sizes)
        pricer.ask([8 * MIB], first=True)
        for size in sizes:
            assert _until(pricer, size), pricer.failed
        assert pricer.finished == [8 * MIB, 1 * MIB, 2 * MIB] and pricer.adopted == sizes
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, pricer._proc.pid) == min(19, mine + NICE)  # training's cores first
        fresh = _chooser()
        for size in sizes:
            assert c.choose(size) == fresh.choose(size)
            assert np.array_equal(_pick_finish(c, size), _pick_finish(fresh, size))
        assert not pricer.take(4 * MIB, 1.0)  # never asked: the caller prices it
    finally:
        pricer.close()
    assert pricer._proc.poll() is not None and not os.path.exists(pricer._spec_path)
    assert not pricer.alive and not pricer.take(1 * MIB)  # closed: nothing to take, nothing fails
    pricer.ask([16 * MIB])


def test_a_child_that_fails_says_why_and_leaves_the_pricing_to_the_parent():
    c = _chooser()
    pricer = Pricer(c)
    try:
        os.unlink(pricer._spec_path)  # before the child, still importing, reads it
        pricer.ask([2 * MIB])
        assert not _until(pricer, 2 * MIB)
        assert "FileNotFoundError" in (pricer.failed or "") and not pricer.alive
        assert c.chosen(2 * MIB) is None  # the parent prices it itself
    finally:
        pricer.close()
    with pytest.raises(OSError):
        Pricer(c, python="/nonexistent/python")


def test_a_class_the_parent_prices_itself_leaves_the_childs_queue():
    pricer = Pricer(_chooser())
    try:
        pricer.ask([1 * MIB, 2 * MIB, 4 * MIB])
        pricer.skip(1 * MIB)  # read with the asks, while the child still imports
        assert _until(pricer, 4 * MIB)
        assert pricer.finished == [2 * MIB, 4 * MIB]
    finally:
        pricer.close()


def _orders_of(pricer: Pricer, size: int, candidates, timeout_s: float = 120.0) -> dict:
    """Each candidate's finish times from the child, polled until it has sent them all."""
    c = pricer.chooser
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(candidates):
        assert pricer.failed is None, pricer.failed
        assert time.monotonic() < deadline, f"the child did not order {candidates} in {timeout_s} s"
        for cand in candidates:
            if cand not in got:
                times = pricer.order(size, c.schedule(*cand).digest, timeout_s)
                if times is not None:
                    got[cand] = times
        time.sleep(0.02)
    return got


def test_the_child_orders_an_explorers_neighbours_first_when_asked_with_the_bits_simulated_here():
    """A class's neighbours asked for (its explorer started) come before the queued classes: the child prices the
    class (and says so: the parent adopts it), then sends each planned neighbour's finish times, the arrays a
    simulation here gives, before it prices the first class queued earlier."""
    from gradsync.sim.pricing import order_candidates

    size = 8 * MIB
    c = _chooser()
    pricer = Pricer(c)
    try:
        pricer.ask([1 * MIB, 2 * MIB])
        pricer.want_orders(size)  # read with the asks, while the child still imports
        fresh = _chooser()
        neighbours = order_candidates(fresh, size)
        assert len(neighbours) >= 2 and all(a != "native" for a, _ in neighbours)
        assert (fresh.choose(size).algorithm, fresh.choose(size).pipeline) not in neighbours
        assert _until(pricer, 1 * MIB)  # priced after the neighbours: every one of them was heard before it
        assert pricer.finished[:2] == [size, 1 * MIB]
        assert {(size, fresh.schedule(*n).digest) for n in neighbours} <= set(pricer._orders)
        got = _orders_of(pricer, size, neighbours)
        for cand, times in got.items():
            schedule = fresh.schedule(*cand)
            assert np.array_equal(times, fresh.model.run(schedule, fresh.topology, size).transfer_times()[1])
        assert pricer.ordered == [(size, fresh.schedule(*n).digest) for n in neighbours]
        assert _until(pricer, size) and c.choose(size) == fresh.choose(size)  # the class itself is adopted
        assert pricer.order(size, "no-such-digest", 1.0) is None  # not prepared: the caller simulates
    finally:
        pricer.close()
    assert pricer.order(size, fresh.schedule(*neighbours[0]).digest) is None  # closed


@pytest.mark.parametrize("orders_from", [None, 4 * MIB])
def test_the_child_orders_unasked_only_from_orders_from_up_once_idle(orders_from):
    """Started with ``orders_from``, the child orders the neighbours of every class it priced of at least that size
    once nothing else is asked; without it, only those asked for (here: another class's, asked after the first is
    priced and taken), and a class under ``orders_from`` is never ordered unasked."""
    from gradsync.sim.pricing import order_candidates

    big, small = 8 * MIB, 2 * MIB
    fresh = _chooser()
    pricer = Pricer(_chooser(), orders_from=orders_from)
    try:
        pricer.ask([small, big])
        assert _until(pricer, big)
        if orders_from is not None:
            _orders_of(pricer, big, order_candidates(fresh, big))
        pricer.want_orders(16 * MIB)
        _orders_of(pricer, 16 * MIB, order_candidates(fresh, 16 * MIB))
        pricer.poll()
        assert not any(size == small for size, _ in pricer._orders) and small not in {s for s, _ in pricer.ordered}
        if orders_from is None:
            assert not any(size == big for size, _ in [*pricer._orders, *pricer.ordered])
    finally:
        pricer.close()
    with pytest.raises(PlanError, match="orders_from"):
        Pricer(_chooser(), orders_from=-1)


def test_a_damaged_neighbour_order_is_refused():
    from gradsync.sim.pricing import order_candidates, order_doc, read_order

    c = _chooser()
    doc = json.loads(json.dumps(order_doc(c, 4 * MIB, order_candidates(c, 4 * MIB)[0])))
    size, digest, times = read_order(doc)
    assert size == 4 * MIB and digest == c.schedule(*order_candidates(c, 4 * MIB)[0]).digest and times.size
    with pytest.raises(PlanError, match="need order, digest and finish"):
        read_order({"order": size})
    with pytest.raises(PlanError, match="not a size class"):
        read_order({**doc, "order": size + 1})
    with pytest.raises(PlanError, match="finite values, not"):
        read_order({**doc, "finish": {**doc["finish"], "count": times.size + 1}})
    with pytest.raises(PlanError, match="base64"):
        read_order({**doc, "finish": {**doc["finish"], "data": "not base64!"}})


def test_neighbours_that_would_run_in_step_order_are_not_ordered(monkeypatch):
    """A neighbour over MAX_ORDERED_TRANSFERS runs in step order (the plan cache orders none that large): the child
    prepares nothing for it."""
    import gradsync.sim.pricing as pricing

    c = _chooser()
    every = pricing.order_candidates(c, 8 * MIB)
    counts = {n: c.schedule(*n).num_transfers for n in every}
    assert len(set(counts.values())) > 1
    bound = min(counts.values())
    monkeypatch.setattr(pricing, "MAX_ORDERED_TRANSFERS", bound)
    assert pricing.order_candidates(c, 8 * MIB) == [n for n in every if counts[n] <= bound] != every
