"""gradsync order (gradsync.commands.order): the JSON report and a bad model name."""

from __future__ import annotations

import json

from gradsync.cli import main


def test_cli_order_json(capsys) -> None:
    assert main(["order", "lenet5", "--json", "--runs", "1", "--random-runs", "2", "--workers", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["type"] == "gradsync.order" and report["params"] == 10
    assert sorted(report["priorities"].values()) == list(range(10))
    assert 0 <= report["metrics"]["E"] <= 1
    assert main(["order", "nosuchmodel"]) == 2
    assert "unknown model" in capsys.readouterr().err
