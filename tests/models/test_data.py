"""The digits loader and shards (gradsync.models.data): shapes, a stratified split, determinism, exact batch partitions."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradsync.models.data import load_digits, shard


# ---- digits ------------------------------------------------------------------------------------------------
def test_digits_shapes_and_dtypes(digits):
    assert digits.x_train.dtype == digits.x_test.dtype == torch.float32
    assert digits.y_train.dtype == digits.y_test.dtype == torch.int64
    assert digits.x_train.shape[1:] == digits.x_test.shape[1:] == (1, 32, 32)
    assert digits.x_train.shape[0] == digits.y_train.shape[0] and digits.x_test.shape[0] == digits.y_test.shape[0]
    assert len(digits.y_train) + len(digits.y_test) == 1797
    assert set(digits.y_train.tolist()) == set(range(10)) == set(digits.y_test.tolist())
    assert 0.18 < len(digits.y_test) / 1797 < 0.22


def test_digits_split_is_stratified_and_a_partition(digits):
    from sklearn.datasets import load_digits as sk_load_digits

    counts = np.bincount(sk_load_digits().target, minlength=10)
    train = np.bincount(digits.y_train.numpy(), minlength=10)
    test = np.bincount(digits.y_test.numpy(), minlength=10)
    np.testing.assert_array_equal(train + test, counts)
    assert np.all(np.abs(test - 0.2 * counts) <= 1)


def test_digits_normalisation_and_upsampling():
    native = load_digits(size=8)
    assert native.x_train.shape[1:] == (1, 8, 8)
    assert abs(native.x_train.mean().item()) < 1e-5 and abs(native.x_train.std().item() - 1) < 1e-5
    big = load_digits(size=32)
    expected = F.interpolate(native.x_test, size=(32, 32), mode="bilinear", align_corners=False)
    torch.testing.assert_close(big.x_test, expected)


def test_digits_deterministic(digits):
    again = load_digits()
    for a, b in zip(dataclasses.astuple(digits), dataclasses.astuple(again)):
        assert torch.equal(a, b)
    other = load_digits(seed=1)
    assert not torch.equal(digits.y_train, other.y_train)


@pytest.mark.parametrize("kw", [{"size": 0}, {"size": 2.0}, {"test_fraction": 0.0}, {"test_fraction": 1.0}])
def test_digits_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        load_digits(**kw)


def test_digits_without_sklearn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match="pip install scikit-learn"):
        load_digits()


# ---- sharding ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [4, 5, 7, 64, 65])
def test_shards_partition_the_batch(world_size, batch):
    x = torch.arange(batch * 3, dtype=torch.float32).reshape(batch, 3)
    y = torch.arange(batch)
    parts = [shard(x, y, r, world_size) for r in range(world_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    sizes = [len(p[1]) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    for px, py in parts:
        assert torch.equal(px[:, 0], py.float() * 3)  # x and y rows stay aligned


@pytest.mark.parametrize(
    ("rank", "world_size", "batch", "match"),
    [(0, 0, 4, "world_size"), (4, 4, 8, "rank"), (-1, 2, 4, "rank"), (0, 5, 4, "empty"), (0, 2.0, 4, "world_size")],
)
def test_shard_bad_arguments(rank, world_size, batch, match):
    with pytest.raises(ValueError, match=match):
        shard(torch.zeros(batch, 2), torch.zeros(batch), rank, world_size)
    with pytest.raises(ValueError, match="match"):
        shard(torch.zeros(4, 2), torch.zeros(3), 0, 2)
