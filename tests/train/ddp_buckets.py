"""What a DDP hook state is asked to price ahead, against torch's own bucket assignment: one small model whose
parameters fall in several buckets under limits small enough for several, on a one-rank runtime."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from gradsync.comm.local import LocalFabric
from gradsync.comm.runtime import Runtime

#: DDP's first-bucket and bucket limits in these tests (patched into gradsync.train.grouped as well)
LIMITS = (256, 1024)


@dataclass
class FirstBuckets:
    rt: Runtime
    model: torch.nn.Module
    #: the parameters in reverse (backward) order, and torch's buckets of them (indices into ``params``)
    params: list[torch.nn.Parameter]
    buckets: list[list[int]]
    #: the sizes each Runtime.anticipate call asked for
    asked: list[list[float]]


@contextmanager
def first_buckets(monkeypatch: pytest.MonkeyPatch) -> Iterator[FirstBuckets]:
    """A runtime whose ``anticipate`` records what it is asked, gradsync's DDP limits set to :data:`LIMITS`, and the
    model's buckets as torch assigns them under the same limits (more than one); the runtime is shut down after."""
    asked: list[list[float]] = []
    monkeypatch.setattr(Runtime, "anticipate", lambda self, sizes, first=False: asked.append(list(sizes)))
    monkeypatch.setattr("gradsync.train.grouped.FIRST_BUCKET_BYTES", LIMITS[0])
    monkeypatch.setattr("gradsync.train.grouped.DDP_BUCKET_BYTES", LIMITS[1])
    rt = Runtime(LocalFabric(1).transport(0))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
        params = list(reversed(list(model.parameters())))
        buckets, _ = dist._compute_bucket_assignment_by_size(params, list(LIMITS))
        assert len(buckets) > 1
        yield FirstBuckets(rt, model, params, [list(b) for b in buckets], asked)
    finally:
        rt.shutdown()
