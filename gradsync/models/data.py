"""A real, small, download-free dataset for end-to-end training checks, and per-rank batch sharding.

:func:`load_digits` wraps scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes, shipped
inside the package, so tests and examples never touch the network), upsampled to LeNet-5's 32x32.
:func:`shard` gives each data-parallel rank its contiguous slice of a global batch; the slices partition
the batch, so synchronised per-rank gradients can be checked against single-process training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Digits", "load_digits", "shard"]


@dataclass(frozen=True)
class Digits:
    """A train/test split: float32 images ``(N, 1, size, size)`` (normalised) and int64 labels ``(N,)``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_classes(self) -> int:
        return 10


def _stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices: per class, a seeded permutation whose first ``round(n * test_fraction)``
    (at least 1, at most n - 1) go to test; both sides are then shuffled so batches mix classes."""
    rng = np.random.default_rng(seed)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = min(max(int(round(len(idx) * test_fraction)), 1), len(idx) - 1)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def load_digits(size: int = 32, test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """scikit-learn's 8x8 digits as ``size`` x ``size`` images, split per class with a seeded permutation.

    Pixels 0..16 are scaled to [0, 1], normalised with the *training* pixels' mean and std (so no test
    information leaks in), then upsampled with bilinear interpolation (``align_corners=False``). The same
    ``seed`` always gives the same split and order.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size={size!r} must be a positive integer (output image side in pixels)")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r} must lie strictly between 0 and 1")
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as exc:
        raise ImportError(
            "gradsync.models.data.load_digits needs scikit-learn (its bundled digits dataset): "
            "pip install scikit-learn"
        ) from exc

    bunch = sk_load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / 16.0  # (1797, 8, 8) in [0, 1]
    labels = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = _stratified_split(labels, test_fraction, seed)

    x = torch.from_numpy(images).unsqueeze(1)  # (N, 1, 8, 8)
    x_train, x_test = x[train_idx], x[test_idx]
    mean, std = x_train.mean(), x_train.std()

    def prepare(t: torch.Tensor) -> torch.Tensor:
        t = (t - mean) / std
        if size != t.shape[-1]:
            t = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)
        return t.contiguous()

    y = torch.from_numpy(labels)
    return Digits(prepare(x_train), y[train_idx].clone(), prepare(x_test), y[test_idx].clone())


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s contiguous slice of the batch ``(x, y)`` split along dim 0 into ``world_size`` parts.

    Sizes differ by at most one (the first ``len % world_size`` ranks get one extra sample, as
    :func:`torch.tensor_split`), and concatenating the shards in rank order gives the batch back exactly.
    A batch smaller than ``world_size`` is refused: some rank would get an empty shard and its mean loss is
    undefined. Note that with uneven shards the global mean gradient is the shard-size-weighted average.
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an integer")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError("x and y must have a batch dimension (dim 0)")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}; they must match")
    if x.shape[0] < world_size:
        raise ValueError(f"a batch of {x.shape[0]} cannot be split over world_size={world_size} ranks without empty shards")
    return torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
