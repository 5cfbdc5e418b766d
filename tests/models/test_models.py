"""Models and the digits loader against independent expectations: published parameter counts, closed forms,
shapes, forward-order registration, exact batch partitions and a short real training run."""

from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsync.errors import GradsyncError
from gradsync.models import MODELS, ModelSpec, create, describe, param_count, spec
from gradsync.models.data import Digits, load_digits, shard
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


# ---- digits ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits() -> Digits:
    return load_digits()


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
