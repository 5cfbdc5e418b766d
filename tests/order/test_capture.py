"""Capture (gradsync.order.capture): parameter reads and backward order from torch.fx and autograd."""

from __future__ import annotations

from gradsync.order import (
    capture,
    capture_autograd,
    capture_fx,
    example_input,
)


# ---- capture ---------------------------------------------------------------------------------------------
def test_capture_lenet5_params_reads_and_backward_order() -> None:
    from gradsync.models import create

    model = create("lenet5")
    dag = capture(model, example_input("lenet5"), name="lenet5")
    names = [n for n, _ in model.named_parameters()]
    assert [p.name for p in dag.params] == names and len(names) == 10
    assert dag.total_bytes == 4 * sum(p.numel() for p in model.parameters())
    forward = [op for op in dag.ops if op.kind not in ("backward", "send")]
    assert sorted(p for op in forward for p in op.reads) == sorted(names)  # each read by exactly one op
    assert sum(op.kind == "send" for op in dag.ops) == 10
    # Gradients become ready layer by layer from the output back: the reverse of forward order.
    layers = list(dict.fromkeys(n.rpartition(".")[0] for n in names))
    assert list(dict.fromkeys(n.rpartition(".")[0] for n in dag.grad_order)) == layers[::-1]
    assert sorted(dag.grad_order) == sorted(names)


def test_capture_leaves_the_model_unchanged() -> None:
    from gradsync.models import create

    model = create("resnet18")
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    capture(model, example_input("resnet18", image_size=32))
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert all(before_state[k].equal(after[k]) for k in before_state)  # batch-norm statistics untouched


def test_fx_and_autograd_capture_agree_on_parameter_reads() -> None:
    from gradsync.models import create

    model = create("resnet18")
    fx = capture_fx(model, None, "r18")
    ag = capture_autograd(model, example_input("resnet18", image_size=32), "r18")
    assert {p for op in fx.ops for p in op.reads} == {p for op in ag.ops for p in op.reads} == set(fx.param_index)
    # Both see conv1.weight first and the fc layer last among the parameter-reading ops (autograd reads
    # fc.weight in its own transpose op, next to the addmm that reads fc.bias).
    for dag in (fx, ag):
        reading = [op for op in dag.ops if op.reads]
        assert reading[0].reads == ("conv1.weight",)
        assert {"fc.weight", "fc.bias"} <= {p for op in reading[-2:] for p in op.reads}
