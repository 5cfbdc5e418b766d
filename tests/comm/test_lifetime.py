"""gradsync.comm.lifetime: what the exit hook leaves behind."""

from __future__ import annotations

import gc
import weakref

import torch

from gradsync.comm import Runtime, lifetime
from gradsync.comm.local import LocalFabric


def test_the_exit_hook_frees_a_shut_down_runtime_that_only_cycles_keep(monkeypatch):
    """A shut-down runtime is not freed by reference counting (its parts refer to each other), so without a
    collection at exit its transport's process group would be freed during interpreter finalization, where gloo's
    teardown can abort (tests/test_exit.py, exit 134). The exit hook collects it."""
    monkeypatch.setattr(lifetime, "_before", [])
    monkeypatch.setattr(lifetime, "_owned", [])  # nothing of the test session's own is destroyed
    gc.disable()
    try:
        rt = Runtime(LocalFabric(1).transport(0), "switch:1", "auto", timeout_s=5)
        rt.allreduce([torch.ones(4)])
        rt.shutdown()
        ref = weakref.ref(rt)
        del rt
        assert ref() is not None  # the cycles keep it: what the hook is there for
        lifetime._at_exit()
        assert ref() is None
    finally:
        gc.enable()
