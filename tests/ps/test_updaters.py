"""The server's update rules (gradsync.ps.updaters): torch.optim as the reference for SGD/Adam, seed 002 eq. (2) by hand."""

from __future__ import annotations

import pytest
import torch

from gradsync.errors import GradsyncError
from gradsync.ps.updaters import create_updater


# ---- update rules ---------------------------------------------------------------------------------------
def test_server_sgd_momentum_matches_torch() -> None:
    torch.manual_seed(0)
    w0 = torch.randn(10)
    grads = [torch.randn(10) for _ in range(5)]
    rule = create_updater("sgd", lr=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5)
    w, state = w0.clone(), {}
    for g in grads:
        rule.apply(w, g, 1, state)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    for g in grads:
        p.grad = g * 0.5
        opt.step()
    assert torch.allclose(w, p.detach(), atol=1e-6)


def test_server_adam_matches_torch() -> None:
    torch.manual_seed(1)
    w0 = torch.randn(10, dtype=torch.float64)
    grads = [torch.randn(10, dtype=torch.float64) for _ in range(6)]
    rule = create_updater("adam", lr=0.01)
    w, state = w0.clone(), {}
    for g in grads:
        rule.apply(w, g, 1, state)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adam([p], lr=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert torch.allclose(w, p.detach(), atol=1e-12)


def test_elastic_is_seed_equation_2() -> None:
    center, w = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    create_updater("elastic", alpha=0.25).apply(center, w, 1, {})
    assert torch.equal(center, torch.tensor([1.0 + 0.25 * 2.0, 2.0 + 0.25 * -4.0]))


def test_updater_errors_name_the_value() -> None:
    with pytest.raises(GradsyncError, match="lr=-1"):
        create_updater("sgd", lr=-1)
    with pytest.raises(GradsyncError, match="no hyper-parameter beta"):
        create_updater("sgd", beta=0.3)
    with pytest.raises(GradsyncError, match="unknown server update rule 'sgdd'.*Did you mean 'sgd'"):
        create_updater("sgdd")
    assert create_updater("momentum").momentum == 0.9  # type: ignore[attr-defined]
