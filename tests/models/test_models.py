"""Models against independent expectations: published parameter counts, closed forms,
shapes, forward-order registration and a short real training run (the digits loader: test_data.py)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsync.errors import GradsyncError
from gradsync.models import MODELS, ModelSpec, create, describe, param_count, spec
from gradsync.models.lenet import LeNet5
from gradsync.models.resnet import resnet18

NAMES = ["lenet5", "resnet18", "resnet50", "resnet152", "vgg16", "vgg19", "inception"]

# torchvision's published numbers (1000 classes) and LeNet-5's closed form (10 classes).
PUBLISHED = {
    "lenet5": 61_706,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet152": 60_192_808,
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
}


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta(name: str, **kw) -> nn.Module:
    with torch.device("meta"):
        return create(name, **kw)


def inception_closed_form(num_classes: int) -> int:
    """GoogLeNet Table 1 widths, conv (no bias) + BN (2 per channel) everywhere, true 5x5, no aux heads."""

    def conv(k: int, cin: int, cout: int) -> int:
        return k * k * cin * cout + 2 * cout

    table = [
        (64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64), (192, 96, 208, 16, 48, 64),
        (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64), (112, 144, 288, 32, 64, 64),
        (256, 160, 320, 32, 128, 128), (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128),
    ]  # fmt: skip
    total = conv(7, 3, 64) + conv(1, 64, 64) + conv(3, 64, 192)
    cin = 192
    for c1, r3, c3, r5, c5, pool in table:
        total += conv(1, cin, c1) + conv(1, cin, r3) + conv(3, r3, c3) + conv(1, cin, r5) + conv(5, r5, c5)
        total += conv(1, cin, pool)
        cin = c1 + c3 + c5 + pool
    return total + cin * num_classes + num_classes


# ---- registry ---------------------------------------------------------------------------------------------
def test_registry_lists_the_models():
    assert MODELS.names() == NAMES
    for name in NAMES:
        s = spec(name)
        assert isinstance(s, ModelSpec) and s.name == name and s.summary
        assert len(s.input_shape) == 3 and s.num_classes >= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec("lenet5").num_classes = 3  # type: ignore[misc]


def test_submodules_are_not_shadowed_by_factories():
    import gradsync.models.inception as module

    assert isinstance(module, types.ModuleType) and "Inception" in module.__all__


def test_unknown_name_lists_known_ones():
    with pytest.raises(GradsyncError) as info:
        create("nope")
    for name in NAMES:
        assert name in str(info.value)
    with pytest.raises(GradsyncError, match="resnet18"):
        spec("resnet19")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_num_classes_validation(bad):
    with pytest.raises(GradsyncError, match=f"num_classes={bad!r}"):
        create("lenet5", num_classes=bad)
    with pytest.raises(ValueError, match="num_classes"):
        LeNet5(num_classes=bad)
    with pytest.raises(ValueError, match="num_classes"), torch.device("meta"):
        resnet18(num_classes=bad)


# ---- sizes -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_match_published(name):
    assert numel(meta(name)) == PUBLISHED[name]


def test_inception_matches_its_documented_layout():
    assert numel(meta("inception")) == inception_closed_form(1000)
    assert numel(meta("inception", num_classes=10)) == inception_closed_form(10)
    assert 5_000_000 < inception_closed_form(1000) < 7_100_000


def test_num_classes_only_changes_the_last_layer():
    assert numel(create("lenet5", num_classes=3)) == PUBLISHED["lenet5"] - 7 * 85
    assert numel(meta("resnet50", num_classes=10)) == PUBLISHED["resnet50"] - 990 * 2049
    assert numel(meta("vgg19", num_classes=10)) == PUBLISHED["vgg19"] - 990 * 4097


def test_describe():
    rows = describe()
    assert [r["name"] for r in rows] == NAMES
    for row in rows:
        assert set(row) == {"name", "params", "input_shape", "num_classes", "summary"}
        assert row["params"] == PUBLISHED.get(row["name"], inception_closed_form(1000))
        assert row["input_shape"] == spec(row["name"]).input_shape
    assert param_count("lenet5", num_classes=3) == PUBLISHED["lenet5"] - 7 * 85


# ---- forward ---------------------------------------------------------------------------------------------
def test_lenet_forward():
    torch.manual_seed(0)
    model = create("lenet5")
    assert model(torch.randn(4, 1, 32, 32)).shape == (4, 10)
    assert create("lenet5", num_classes=3)(torch.randn(2, 1, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize("name", ["resnet18", "inception"])
def test_small_input_forward_and_backward(name):
    torch.manual_seed(0)
    model = create(name, num_classes=7)
    out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_vgg16_real_forward_on_small_input():
    torch.manual_seed(0)
    model = create("vgg16", num_classes=10).eval()  # adaptive pool turns 1x1 into 7x7
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 32))
    assert out.shape == (1, 10) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_canonical_shape_and_forward_order_registration(name):
    """On the meta device (no compute): logits shape at the spec's input, and parameter registration order
    equals the order the forward pass uses them, which the backward-order gradient scheduler reverses."""
    s = spec(name)
    model = meta(name)
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    called: list[nn.Module] = []
    hooks = [m.register_forward_pre_hook(lambda mod, _args: called.append(mod)) for m in owners]
    out = model(torch.empty(2, *s.input_shape, device="meta"))
    for h in hooks:
        h.remove()
    assert out.shape == (2, s.num_classes)
    assert [id(m) for m in called] == [id(m) for m in owners]


# ---- a real training run -----------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """One intra-op thread: LeNet-sized ops gain nothing from more, and a busy 2-core box slows them ~5x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_lenet_learns_digits(digits, one_thread):
    torch.manual_seed(0)
    model = create("lenet5")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    steps, batch = 300, 64
    while steps:
        perm = torch.randperm(len(digits.y_train), generator=gen)
        for i in range(0, len(perm) - batch + 1, batch):
            idx = perm[i : i + batch]
            loss = F.cross_entropy(model(digits.x_train[idx]), digits.y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps -= 1
            if not steps:
                break
    model.eval()
    with torch.no_grad():
        accuracy = (model(digits.x_test).argmax(1) == digits.y_test).float().mean().item()
    # Observed 0.944-0.978 over seeds and learning rates; chance is 0.1.
    assert accuracy > 0.9
