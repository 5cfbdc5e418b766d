"""An Inception-v1-style network (GoogLeNet, Szegedy et al. 2014): many medium-sized tensors in parallel
branches, a different gradient-size profile from ResNet's and VGG's for the schedulers to chew on.

Layout for a 3x224x224 input (spatial sizes in brackets)::

    stem:  conv7x7/2(3->64) [112] -> maxpool3/2 [56] -> conv1x1(64->64) -> conv3x3(64->192) -> maxpool3/2 [28]
    3a, 3b                                   -> maxpool3/2 [14]   # 256, 480 channels
    4a, 4b, 4c, 4d, 4e                       -> maxpool2/2 [7]    # 512, 512, 512, 528, 832 channels
    5a, 5b                                                        # 832, 1024 channels
    global average pool -> dropout(0.4) -> linear(1024->num_classes)

Each inception block concatenates four branches along channels: ``1x1``; ``1x1 -> 3x3``; ``1x1 -> 5x5``;
``maxpool3x3/1 -> 1x1``, with the paper's Table 1 widths (:data:`BLOCKS`). Every "conv" is conv (no bias)
+ BatchNorm + ReLU, as in torchvision's GoogLeNet, instead of the paper's LRN, so it trains without tuning.
Unlike torchvision (which uses 3x3 in the "5x5" branch) the 5x5 branch really is 5x5, and there are no
auxiliary classifiers, which keeps it to 7,005,832 parameters at 1000 classes. Modules are registered in
forward order (branches in concatenation order).
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.models import check_num_classes
from gradsync.models.resnet import init_conv_bn

__all__ = ["BLOCKS", "ConvBNReLU", "Inception", "InceptionBlock", "inception"]

#: Per block: (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj) output widths, from the paper's Table 1.
BLOCKS: dict[str, tuple[int, int, int, int, int, int]] = {
    "3a": (64, 96, 128, 16, 32, 32),
    "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64),
    "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64),
    "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128),
    "5a": (256, 160, 320, 32, 128, 128),
    "5b": (384, 192, 384, 48, 128, 128),
}


class ConvBNReLU(nn.Sequential):
    """``Conv2d`` without bias (the BN shift replaces it) + ``BatchNorm2d`` + ``ReLU``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(out_channels, eps=0.001),
            nn.ReLU(inplace=True),
        )


class InceptionBlock(nn.Module):
    """Four parallel branches (1x1, 3x3, 5x5, pool) concatenated along channels; spatial size unchanged."""

    def __init__(self, in_channels: int, widths: tuple[int, int, int, int, int, int]) -> None:
        super().__init__()
        c1, r3, c3, r5, c5, pool = widths
        self.branch1 = ConvBNReLU(in_channels, c1, 1)
        self.branch2 = nn.Sequential(ConvBNReLU(in_channels, r3, 1), ConvBNReLU(r3, c3, 3, padding=1))
        self.branch3 = nn.Sequential(ConvBNReLU(in_channels, r5, 1), ConvBNReLU(r5, c5, 5, padding=2))
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(kernel_size=3, stride=1, padding=1, ceil_mode=True), ConvBNReLU(in_channels, pool, 1)
        )
        self.out_channels = c1 + c3 + c5 + pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class Inception(nn.Module):
    """GoogLeNet-style network (see module docstring for the layout); works on inputs from ~32x32 up."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.4, in_channels: int = 3) -> None:
        super().__init__()
        check_num_classes(num_classes)
        self.stem = nn.Sequential(
            ConvBNReLU(in_channels, 64, 7, stride=2, padding=3),
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
            ConvBNReLU(64, 64, 1),
            ConvBNReLU(64, 192, 3, padding=1),
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
        )
        stages: list[nn.Module] = []
        channels = 192
        for name, widths in BLOCKS.items():
            block = InceptionBlock(channels, widths)
            stages.append(block)
            channels = block.out_channels
            if name == "3b":
                stages.append(nn.MaxPool2d(3, stride=2, ceil_mode=True))
            elif name == "4e":
                stages.append(nn.MaxPool2d(2, stride=2, ceil_mode=True))
        self.blocks = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(channels, num_classes)
        init_conv_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.blocks(self.stem(x)))
        return self.fc(self.dropout(torch.flatten(x, 1)))


def inception(num_classes: int = 1000, **kw: object) -> Inception:
    """Inception-v1-style network; 7,005,832 parameters at 1000 classes."""
    return Inception(num_classes=num_classes, **kw)  # type: ignore[arg-type]
