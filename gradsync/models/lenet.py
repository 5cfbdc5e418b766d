"""LeNet-5 (LeCun et al. 1998): the smallest model in the registry, for fast end-to-end checks on digits.

Layout for a 1x32x32 input (the paper's size, so 8x8 digits are upsampled to 32x32)::

    conv5x5(1->6) -> ReLU -> maxpool2   # 6x28x28 -> 6x14x14
    conv5x5(6->16) -> ReLU -> maxpool2  # 16x10x10 -> 16x5x5
    fc(400->120) -> ReLU -> fc(120->84) -> ReLU -> fc(84->num_classes)

The paper used tanh-like squashing, trainable subsampling and a partially connected C3 layer; we use the
common modern simplification (ReLU, max-pool, fully connected C3) because it trains faster and keeps the
parameter count a closed form: 156 + 2,416 + 48,120 + 10,164 + (84 + 1) * num_classes = 61,706 at 10
classes. Modules are registered in forward order so parameter order matches the backward pass in reverse.
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.models import check_num_classes

__all__ = ["LeNet5"]


class LeNet5(nn.Module):
    """LeNet-5 for ``in_channels`` x32x32 input (ReLU + max-pool variant, see module docstring)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        check_num_classes(num_classes)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(inplace=True),
            nn.Linear(120, 84),
            nn.ReLU(inplace=True),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
