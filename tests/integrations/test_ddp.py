"""register_comm_hook on a DDP model, and the Accelerate recipe (``prepare()``, then the hook) under torchrun."""

from __future__ import annotations

import pytest
import torch

import gradsync
from gradsync.integrations.ddp import hook_for, register_comm_hook
from tests.dist_launch import torchrun
from tests.integrations.trainer_checks import check_replicas


def test_each_state_names_its_hook_and_anything_else_is_refused_with_the_fix():
    assert hook_for(gradsync.GradsyncHookState()) is gradsync.allreduce_hook
    assert hook_for(gradsync.CompressionHookState("fp16")) is gradsync.compression_hook
    with pytest.raises(TypeError, match="GradsyncHookState"):
        hook_for({"op": "avg"})


def test_a_model_without_ddp_gets_no_hook():
    # one process: accelerate's prepare() returns the module itself, and there is nothing to synchronise
    assert register_comm_hook(torch.nn.Linear(2, 2), gradsync.GradsyncHookState()) is False


def test_plain_fp16_and_powersgd_hooks_run_under_accelerate_with_torchrun_and_keep_replicas_identical(tmp_path):
    pytest.importorskip("accelerate")
    check_replicas(torchrun("tests/workers/trainer_worker.py", ["accelerate", str(tmp_path)], 2, tmp_path))
