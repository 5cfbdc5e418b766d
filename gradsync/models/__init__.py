"""Small model definitions in plain PyTorch (no torchvision), named in a registry like everything else.

The models are the workloads gradient synchronisation is judged on: LeNet-5 for fast end-to-end checks on
real data (:mod:`gradsync.models.data`), ResNet-18/50/152 and VGG-16/19 with torchvision's exact
architectures (so parameter counts, and hence gradient sizes, match published numbers), and an
Inception-v1-style network with many parallel medium-sized tensors. Every model registers its modules in
forward order, so parameter order is forward order and reversed it is the order gradients become ready.

``create("resnet50")`` builds a model; ``describe()`` lists them (for ``gradsync models``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gradsync.errors import GradsyncError
from gradsync.registry import Registry

__all__ = ["MODELS", "ModelError", "ModelSpec", "check_num_classes", "create", "describe", "param_count", "spec"]


class ModelError(GradsyncError):
    """A model name is unknown, or an option (such as ``num_classes``) is out of range."""


def check_num_classes(num_classes: object) -> int:
    """Validate ``num_classes`` (a positive int) so a bad value fails here, not deep inside ``nn.Linear``."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"num_classes={num_classes!r} must be a positive integer (the number of output logits)")
    return num_classes


# The submodules import ``check_num_classes`` from here, so they are imported after it is defined.
# Modules, not their functions: ``inception.inception`` must not shadow the ``gradsync.models.inception`` module.
from gradsync.models import inception, lenet, resnet, vgg  # noqa: E402


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: ``factory(num_classes=..., **kw)`` builds it for ``input_shape`` (C, H, W) input.

    ``num_classes`` and ``input_shape`` are the canonical defaults (ImageNet-sized for the large models);
    the convolutional models accept other spatial sizes thanks to adaptive pooling.
    """

    name: str
    factory: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int
    summary: str


MODELS: Registry[ModelSpec] = Registry("model", ModelError)

_IMAGENET = (3, 224, 224)
for _spec in (
    ModelSpec("lenet5", lenet.LeNet5, (1, 32, 32), 10, "LeNet-5 (LeCun 1998), ReLU + max-pool, for 32x32 digits"),
    ModelSpec("resnet18", resnet.resnet18, _IMAGENET, 1000, "ResNet-18, torchvision architecture (BasicBlock 2-2-2-2)"),
    ModelSpec("resnet50", resnet.resnet50, _IMAGENET, 1000, "ResNet-50 v1.5, torchvision architecture (Bottleneck 3-4-6-3)"),
    ModelSpec("resnet152", resnet.resnet152, _IMAGENET, 1000, "ResNet-152 v1.5, torchvision architecture (3-8-36-3)"),
    ModelSpec("vgg16", vgg.vgg16, _IMAGENET, 1000, "VGG-16 (config D, no batch norm), torchvision architecture"),
    ModelSpec("vgg19", vgg.vgg19, _IMAGENET, 1000, "VGG-19 (config E, no batch norm), torchvision architecture"),
    ModelSpec("inception", inception.inception, _IMAGENET, 1000, "Inception-v1-style (GoogLeNet layout + BN, no aux heads)"),
):
    MODELS.add(_spec.name, _spec)
del _spec


def spec(name: str) -> ModelSpec:
    """The registered :class:`ModelSpec` for ``name``; an unknown name raises :class:`ModelError` listing the known ones."""
    return MODELS.get(name)


def create(name: str, num_classes: int | None = None, **kw: object) -> nn.Module:
    """Build model ``name`` with ``num_classes`` outputs (default: the spec's); ``kw`` go to the factory.

    Builds on torch's current default device, so ``with torch.device("meta"): create("vgg19")`` gives a
    weightless model for shape and size questions in milliseconds.
    """
    s = spec(name)
    n = s.num_classes if num_classes is None else check_num_classes(num_classes)
    return s.factory(num_classes=n, **kw)


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@functools.cache
def _default_param_count(name: str) -> int:
    with torch.device("meta"):
        return _numel(create(name))


def param_count(name: str, num_classes: int | None = None) -> int:
    """Number of parameters of model ``name`` (built on the meta device: no memory, no initialisation)."""
    canonical = MODELS.canonical(name)
    if num_classes is None:
        return _default_param_count(canonical)
    with torch.device("meta"):
        return _numel(create(canonical, num_classes))


def describe() -> list[dict[str, object]]:
    """One dict per registered model (name, params, input_shape, num_classes, summary) for ``gradsync models``."""
    return [
        {
            "name": name,
            "params": param_count(name),
            "input_shape": s.input_shape,
            "num_classes": s.num_classes,
            "summary": s.summary,
        }
        for name, s in MODELS.items()
    ]


