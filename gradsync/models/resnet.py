"""ResNet-18/50/152 (He et al. 2015), layer for layer the torchvision architecture (v1.5: the stride of a
bottleneck sits on its 3x3 conv), so parameter counts match torchvision's published numbers at 1000 classes
(11,689,512 / 25,557,032 / 60,192,808) and module names match torchvision's, so its state dicts load.

Written out here rather than imported because gradsync must not depend on torchvision. Modules are
registered in forward order (a block's ``downsample`` shortcut runs after its main path), which the
backward-order gradient scheduler relies on.
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.models import check_num_classes

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "init_conv_bn", "resnet18", "resnet50", "resnet152"]


def init_conv_bn(model: nn.Module) -> None:
    """torchvision's initialisation for conv + batch-norm networks (He normal, BN weight 1, bias 0)."""
    if next(model.parameters()).is_meta:  # weightless: nothing to fill, and meta normal_() is slow
        return
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs plus identity (or 1x1 projection) shortcut: the block of ResNet-18/34."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, plus shortcut: the block of ResNet-50/101/152."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem (7x7/2 conv, 3x3/2 max-pool), four stages of ``block`` x ``layers[i]``, global pool, linear.

    Any input of at least 32x32 works thanks to the adaptive pool; the canonical input is 3x224x224.
    Initialisation follows torchvision (Kaiming-normal fan-out convs, unit BN), with optional
    ``zero_init_residual`` (last BN of each block starts at zero, so blocks start as identities).
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int],
        num_classes: int = 1000,
        zero_init_residual: bool = False,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        check_num_classes(num_classes)
        self.inplanes = 64
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

        init_conv_bn(self)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(
        self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers.extend(block(self.inplanes, planes) for _ in range(1, blocks))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000, **kw: object) -> ResNet:
    """ResNet-18: BasicBlock x (2, 2, 2, 2); 11,689,512 parameters at 1000 classes."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes, **kw)  # type: ignore[arg-type]


def resnet50(num_classes: int = 1000, **kw: object) -> ResNet:
    """ResNet-50: Bottleneck x (3, 4, 6, 3); 25,557,032 parameters at 1000 classes."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes, **kw)  # type: ignore[arg-type]


def resnet152(num_classes: int = 1000, **kw: object) -> ResNet:
    """ResNet-152: Bottleneck x (3, 8, 36, 3); 60,192,808 parameters at 1000 classes."""
    return ResNet(Bottleneck, (3, 8, 36, 3), num_classes=num_classes, **kw)  # type: ignore[arg-type]
