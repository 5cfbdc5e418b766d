"""VGG-16/19 (Simonyan & Zisserman 2014, configurations D and E), the torchvision architecture without batch
norm: 3x3 convs with bias, an ``AdaptiveAvgPool2d((7, 7))`` and the 4096-4096 classifier with dropout. So
parameter counts match torchvision's published numbers at 1000 classes (138,357,544 / 143,667,240) and module
names match torchvision's, so its state dicts load.

VGG is in the registry because its parameters are extremely lopsided (~89% sit in the first classifier
layer), the hard case for gradient bucketing and backward-order scheduling. The adaptive pool lets it run
on small inputs (e.g. 3x32x32) in tests. Modules are registered in forward order.
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.models import check_num_classes

__all__ = ["CONFIGS", "VGG", "vgg16", "vgg19"]

#: Conv widths per layer, ``"M"`` for a 2x2 max-pool: configuration D (VGG-16) and E (VGG-19).
CONFIGS: dict[str, tuple[int | str, ...]] = {
    "D": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    "E": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"),
}


def make_features(config: tuple[int | str, ...], in_channels: int = 3) -> nn.Sequential:
    """The conv trunk: ``conv3x3 -> ReLU`` per width, ``MaxPool2d(2)`` per ``"M"`` (torchvision's indices)."""
    layers: list[nn.Module] = []
    channels = in_channels
    for v in config:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            assert isinstance(v, int)
            layers += [nn.Conv2d(channels, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            channels = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """VGG trunk + ``AdaptiveAvgPool2d((7, 7))`` + 4096-4096 classifier; torchvision's initialisation."""

    def __init__(
        self, config: tuple[int | str, ...], num_classes: int = 1000, dropout: float = 0.5, in_channels: int = 3
    ) -> None:
        super().__init__()
        check_num_classes(num_classes)
        self.features = make_features(config, in_channels)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        on_meta = next(self.parameters()).is_meta  # weightless: nothing to fill, and meta normal_() is slow
        for m in () if on_meta else self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg16(num_classes: int = 1000, **kw: object) -> VGG:
    """VGG-16 (configuration D, no batch norm); 138,357,544 parameters at 1000 classes."""
    return VGG(CONFIGS["D"], num_classes=num_classes, **kw)  # type: ignore[arg-type]


def vgg19(num_classes: int = 1000, **kw: object) -> VGG:
    """VGG-19 (configuration E, no batch norm); 143,667,240 parameters at 1000 classes."""
    return VGG(CONFIGS["E"], num_classes=num_classes, **kw)  # type: ignore[arg-type]
