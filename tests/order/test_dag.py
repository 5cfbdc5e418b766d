"""The DAG (gradsync.order.dag): JSON round trip, and bad DAGs, files and inputs named."""

from __future__ import annotations

import json

import pytest

from gradsync.errors import GradsyncError
from gradsync.order import (
    Dag,
    DagError,
    LinkModel,
    Op,
    Param,
    check_priorities,
    ordering,
    training_dag,
)
from tests.order.conftest import fig1


def test_json_round_trip(tmp_path) -> None:
    dag = training_dag(fig1()).with_times({"op1": 4.0})
    dag = Dag(dag.name, dag.params, dag.ops, grad_order=("recv2", "recv1"), source="hand")
    path = dag.save(tmp_path / "fig1.json")
    back = Dag.load(path)
    assert back == dag and back.op("bwd:op1").time_s == 8.0
    assert json.loads(path.read_text())["type"] == "gradsync.order.dag"


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Dag("d", (Param("p", 4),), (Op("a", inputs=("b",)), Op("b"))), "comes later"),
    (lambda: Dag("d", (Param("p", 4),), (Op("a", inputs=("zz",)),)), "'zz', which is unknown"),
    (lambda: Dag("d", (Param("p", 4),), (Op("a", reads=("q",)),)), "parameter 'q'"),
    (lambda: Dag("d", (Param("p", 4), Param("p", 8)), ()), "listed twice"),
    (lambda: Op("a", time_s=-1.0), "time_s=-1.0"),
    (lambda: Param("p", -3), "nbytes=-3"),
    (lambda: Op("a", kind="send"), "sends="),
])
def test_bad_dags_are_rejected_naming_the_value(build, message) -> None:
    with pytest.raises(DagError, match=message):
        build()


def test_bad_files_and_inputs(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "gradsync.schedule", "version": 1}))
    with pytest.raises(DagError, match="not a DAG file"):
        Dag.load(bad)
    bad.write_text("{not json")
    with pytest.raises(DagError, match="not valid JSON"):
        Dag.load(bad)
    bad.write_text(json.dumps({"type": "gradsync.order.dag", "version": 1, "params": [{"nbytes": 3}]}))
    with pytest.raises(DagError, match="missing"):
        Dag.load(bad)
    with pytest.raises(DagError, match="does not exist"):
        Dag.load(tmp_path / "nope.json")
    dag = fig1()
    with pytest.raises(DagError, match="missing"):
        check_priorities(dag, {"recv1": 0})
    with pytest.raises(DagError, match="integers >= 0"):
        check_priorities(dag, {"recv1": 0, "recv2": -1})
    with pytest.raises(GradsyncError, match="unknown ordering 'tacc'.*Did you mean 'tac'"):
        ordering(dag, "tacc")
    with pytest.raises(DagError, match="does not have"):
        dag.with_times({"op9": 1.0})
    with pytest.raises(DagError, match="bandwidth_GBps=0"):
        LinkModel(0)
