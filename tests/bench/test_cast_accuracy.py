"""benchmarks/cast_accuracy.py: each way of combining the ranks' gradients against an independent computation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import cast_accuracy as ca


def _grads(*rows: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def test_the_shared_scale_is_the_power_of_two_that_leaves_the_headroom():
    # 65504 / (16 * 2 * 1.0) = 2047 -> 2^10; no previous aggregate (or an all-zero one): no scale
    assert ca.shared_scale(1.0, 2) == 2.0**10
    assert ca.shared_scale(0.5, 2) == 2.0**11
    assert ca.shared_scale(None, 2) == ca.shared_scale(0.0, 2) == ca.shared_scale(float("nan"), 2) == 1.0


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_codec_combines_as_the_allreduce_sums_its_payloads(name, dtype):
    g = _grads([0.1, -3.3, 1e-3, 7.0], [0.2, 1.1, 2e-3, -7.5])
    got = ca.COMBINE[name](g, {"name": "w"}, torch.Generator())
    want = (g[0].to(dtype) + g[1].to(dtype)).float() / 2  # cast on each rank, summed in the wire dtype
    assert torch.equal(got, want)
    assert got.dtype == torch.float32


def test_the_jitter_moves_every_element_by_exactly_one_float32_ulp():
    g = _grads([0.1, -3.3, 0.0, 1e-30, 7.0], [0.3, 1.1, 0.0, 1e-30, -7.5])
    exact = ca.COMBINE["exact"](g, {}, torch.Generator())
    assert torch.equal(exact, (g[0] + g[1]) / 2)
    got = ca.COMBINE["jitter"](g, {}, torch.Generator().manual_seed(3))
    spacing = np.spacing(np.abs(exact.numpy()))
    assert np.array_equal(np.abs(got.numpy() - exact.numpy()), spacing)


def test_the_scaled_fp16_keeps_a_gradient_that_plain_fp16_flushes_to_zero():
    g = _grads([1e-8, 0.5], [1e-8, 0.5])
    plain = ca.COMBINE["fp16"](g, {"name": "w"}, torch.Generator())
    assert plain[0] == 0.0  # below fp16's smallest subnormal (5.96e-8)
    state = {"max": 0.5}
    scaled = ca.COMBINE["fp16-scaled"](g, state, torch.Generator())
    assert scaled[0] == pytest.approx(1e-8, rel=1e-2)
    assert scaled[1] == 0.5
    assert state["max"] == 0.5 and "overflows" not in state


def test_the_scaled_fp16_that_overflows_sends_the_exact_average_and_counts_it():
    g = _grads([1.0, -2.0], [3.0, 4.0])
    state = {"max": 1e-12}  # a scale far too large for these gradients
    got = ca.COMBINE["fp16-scaled"](g, state, torch.Generator())
    assert torch.equal(got, torch.tensor([2.0, 1.0]))
    assert state["overflows"] == 1 and state["max"] == 2.0


def test_a_short_run_writes_the_differences_from_exact(tmp_path):
    assert ca.main(["--models", "lenet5", "--variants", "exact,fp16", "--seeds", "1", "--checkpoints", "1,2",
                    "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "cast_accuracy.json").read_text())
    assert doc["type"] == ca.RESULT_TYPE and (tmp_path / "cast_accuracy.png").is_file()
    rows = doc["models"]["lenet5"]["summary"]
    assert set(rows) == {"exact", "fp16"} and set(rows["fp16"]) == {"1", "2"}
    assert rows["exact"]["2"]["points_vs_exact"] == 0.0
    r = rows["fp16"]["2"]
    assert r["points_vs_exact"] == pytest.approx(100 * (r["seeds"][0] - rows["exact"]["2"]["seeds"][0]))


@pytest.mark.parametrize("argv,needle", [
    (["--variants", "fp16"], "'exact' among them"),
    (["--variants", "exact,fp8"], "each of"),
    (["--checkpoints", "0,5"], ">= 1"),
    (["--checkpoints", "ten"], "comma-separated step counts"),
    (["--batch", "1", "--world", "2"], "at least --world"),
])
def test_bad_arguments_name_the_value_and_the_fix(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        ca.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
