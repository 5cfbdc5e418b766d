"""The emulated cluster's root-only steps (up, probe, run, down) replaced by recorders, for the testbed
benchmarks' tests: nothing real starts, and each call lands in ``calls``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace

import pytest

#: A worker run: ``(cmd, env, timeout) -> exit code``; it writes the worker's result to the path after ``--out``.
Run = Callable[..., int]


def fake_testbed(monkeypatch: pytest.MonkeyPatch, calls: list, run: Run) -> None:
    """Record ``up``, ``probe`` and ``down`` in ``calls``; ``run`` stands for the worker's run (it records itself).
    The probe's cost model is ``{"fake": 1}`` on a 4-rank state."""
    import gradsync.testbed as tb

    control = importlib.import_module("gradsync.testbed.control")
    probe_module = importlib.import_module("gradsync.testbed.probe")
    monkeypatch.setattr(tb, "available", lambda: None)
    monkeypatch.setattr(tb, "up", lambda topology, rate: calls.append(("up", topology, rate)))
    monkeypatch.setattr(tb, "probe", lambda pairs, seconds: calls.append(("probe", list(pairs))) or [{"ok": True}])
    monkeypatch.setattr(tb, "run", run)
    monkeypatch.setattr(tb, "down", lambda: calls.append(("down",)))
    monkeypatch.setattr(control, "load_state", lambda: SimpleNamespace(world_size=4))
    monkeypatch.setattr(probe_module, "cost_model", lambda state, rows: SimpleNamespace(to_dict=lambda: {"fake": 1}))
