"""``broadcast_parameters`` / ``broadcast_optimizer_state``'s checks, in one process (the broadcasts themselves run on
2 ranks in tests/train/test_dist.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gradsync.errors import GradsyncError
from gradsync.train.broadcast import broadcast_optimizer_state, broadcast_parameters


def _runtime(native: bool = True) -> SimpleNamespace:
    return SimpleNamespace(world_size=2, rank=0, caps=SimpleNamespace(native=native))


@pytest.mark.parametrize("root", [-1, 2, True, 0.0])
def test_a_root_outside_the_job_is_named(root):
    with pytest.raises(GradsyncError, match=r"root_rank=.* must be a rank of the job, 0..1"):
        broadcast_parameters([torch.zeros(2)], root_rank=root, runtime=_runtime())


def test_a_transport_without_a_process_group_is_refused():
    with pytest.raises(GradsyncError, match="needs a torch.distributed process group"):
        broadcast_parameters([torch.zeros(2)], runtime=_runtime(native=False))


def test_non_tensors_and_non_optimizers_are_named():
    with pytest.raises(GradsyncError, match="'x' is a str, not a tensor"):
        broadcast_parameters({"'x'": "nope"}, runtime=_runtime())
    with pytest.raises(TypeError, match="torch.optim.Optimizer or a DistributedOptimizer"):
        broadcast_optimizer_state(object(), runtime=_runtime())
