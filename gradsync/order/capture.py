"""DAG capture from a PyTorch model: which ops read which parameters, and the order gradients become ready.

TicTac's tracing module (§5) reads TensorFlow's graph; PyTorch has no static graph, so we get one
two ways, both in :data:`CAPTURES`:

* ``fx``: :func:`torch.fx.symbolic_trace`. Each ``call_module`` node reads its module's parameters, a
  ``get_attr`` node that names a parameter is the recv op itself, ``call_function``/``call_method`` nodes
  read nothing. No tensor is computed, so even ResNet-152 traces quickly.
* ``autograd``: run the forward once and walk ``grad_fn`` back from the output. Every autograd node is the
  op that produced a tensor, ``AccumulateGrad`` leaves are the parameters. It works for any model that
  runs, including data-dependent control flow that fx cannot trace, but only sees ops on the gradient path.

``method="auto"`` tries fx and falls back to autograd. For training graphs :func:`grad_ready_order` runs one
backward with post-accumulate-grad hooks and records the order gradients are ready; the model's buffers
(batch-norm statistics) and ``.grad`` are restored afterwards, so capture leaves the model as it found it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gradsync.order.dag import Dag, DagError, Op, Param, training_dag
from gradsync.registry import Registry

if TYPE_CHECKING:  # torch is imported where a model is touched, so `import gradsync.order` stays light
    import torch
    from torch import nn

__all__ = ["CAPTURES", "capture", "capture_autograd", "capture_fx", "example_input", "grad_ready_order", "param_table"]

CAPTURES: Registry[Callable[[Any, Any, str], Dag]] = Registry("DAG capture method", DagError)


def param_table(model: nn.Module) -> tuple[tuple[Param, ...], dict[int, str]]:
    """The model's parameters as :class:`Param` (forward registration order) and ``id(tensor) -> name``.

    ``named_parameters`` lists a tied (shared) parameter once, under its first name; every module that
    holds it then reads that one recv op.
    """
    params, by_id = [], {}
    for name, p in model.named_parameters():
        params.append(Param(name, int(p.numel()) * p.element_size(), tuple(int(s) for s in p.shape),
                            str(p.dtype).removeprefix("torch.")))
        by_id[id(p)] = name
    return tuple(params), by_id


def _as_tuple(example: Any) -> tuple[Any, ...]:
    return example if isinstance(example, tuple) else (example,)


@CAPTURES.register("fx")
def capture_fx(model: nn.Module, example: Any = None, name: str = "model") -> Dag:
    """Forward DAG from :func:`torch.fx.symbolic_trace` (``example`` is not needed: nothing runs)."""
    import torch.fx
    from torch import nn

    params, by_id = param_table(model)
    gm = torch.fx.symbolic_trace(model)
    modules = dict(gm.named_modules())
    ops: list[Op] = []
    op_names: set[str] = set()
    recv_of: dict[str, str] = {}  # get_attr node name -> parameter name
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj: Any = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, nn.Parameter) and id(obj) in by_id:
                recv_of[node.name] = by_id[id(obj)]
            continue
        if node.op not in ("call_module", "call_function", "call_method"):
            continue  # placeholder (local input data) and output
        reads = [recv_of[n.name] for n in node.all_input_nodes if n.name in recv_of]
        if node.op == "call_module":
            mod = modules[str(node.target)]
            reads += [by_id[id(p)] for p in mod.parameters() if id(p) in by_id]
            kind = type(mod).__name__.lower()
        elif node.op == "call_function":
            kind = getattr(node.target, "__name__", str(node.target))
        else:
            kind = str(node.target)
        inputs = tuple(dict.fromkeys(n.name for n in node.all_input_nodes if n.name in op_names))
        ops.append(Op(node.name, kind, 0.0, inputs, tuple(dict.fromkeys(reads))))
        op_names.add(node.name)
    return Dag(name, params, tuple(ops), source="fx")


def _outputs(out: Any) -> list[torch.Tensor]:
    """Tensors of a model's output (a tensor, a tuple/list, or a dict of them)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    return []


@CAPTURES.register("autograd")
def capture_autograd(model: nn.Module, example: Any, name: str = "model") -> Dag:
    """Forward DAG from the autograd graph of one forward pass on ``example`` (ops off the gradient path are not seen)."""
    if example is None:
        raise DagError("capture method 'autograd' runs the model: pass an example input (e.g. example_input('resnet50'))")
    import torch

    params, by_id = param_table(model)
    with torch.enable_grad(), _restored(model):
        roots = [t.grad_fn for t in _outputs(model(*_as_tuple(example))) if t.grad_fn is not None]
    if not roots:
        raise DagError(f"model {name!r}: the output has no autograd graph (no parameter requires grad?); "
                       f"use method='fx' or enable requires_grad")
    # Iterative post-order DFS: producers before consumers, i.e. a topological order of the forward.
    order: list[Any] = []
    seen: set[Any] = set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            fn, done = stack.pop()
            if done:
                order.append(fn)
                continue
            if fn in seen:
                continue
            seen.add(fn)
            stack.append((fn, True))
            stack.extend((nxt, False) for nxt, _ in reversed(fn.next_functions) if nxt is not None and nxt not in seen)
    names: dict[Any, str] = {}
    ops: list[Op] = []
    for fn in order:
        variable = getattr(fn, "variable", None)
        if variable is not None:  # AccumulateGrad: a parameter (a recv op), not an op
            continue
        inputs, reads = [], []
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            v = getattr(nxt, "variable", None)
            if v is not None:
                if id(v) in by_id:
                    reads.append(by_id[id(v)])
            elif nxt in names:
                inputs.append(names[nxt])
        kind = type(fn).__name__.removesuffix("Backward0").removesuffix("Backward1").lower()
        names[fn] = f"{kind}_{len(ops)}"
        ops.append(Op(names[fn], kind, 0.0, tuple(dict.fromkeys(inputs)), tuple(dict.fromkeys(reads))))
    return Dag(name, params, tuple(ops), source="autograd")


class _restored:
    """Context: on exit, put back the model's buffers (batch-norm statistics) and its parameters' ``.grad``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.grads = [(p, p.grad) for p in self.model.parameters()]

    def __exit__(self, *exc: object) -> None:
        import torch

        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g


def grad_ready_order(model: nn.Module, example: Any) -> tuple[str, ...]:
    """Parameter names in the order one backward pass (of ``sum(output)``) makes their gradients ready.

    Uses ``register_post_accumulate_grad_hook``, which fires once the gradient is fully accumulated, i.e.
    exactly when DDP or a PS push could send it. Parameters without a gradient are left out.
    """
    import torch

    _, by_id = param_table(model)
    order: list[str] = []
    handles = [p.register_post_accumulate_grad_hook(lambda t: order.append(by_id[id(t)]))
               for p in model.parameters() if p.requires_grad and id(p) in by_id]
    try:
        with torch.enable_grad(), _restored(model):
            for p in model.parameters():
                p.grad = None
            outs = _outputs(model(*_as_tuple(example)))
            loss = sum(o.float().sum() for o in outs if o.requires_grad)
            if isinstance(loss, torch.Tensor):
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    return tuple(dict.fromkeys(order))


def capture(model: nn.Module, example: Any = None, *, training: bool = True, method: str = "auto",
            name: str | None = None) -> Dag:
    """Capture ``model``'s worker DAG: forward ops, their parameter reads, and for ``training`` the backward
    ops, gradient sends and the real gradient-ready order (which needs ``example``).

    ``method``: ``auto`` (fx, falling back to autograd when fx cannot trace), ``fx`` or ``autograd``.
    """
    label = name or type(model).__name__.lower()
    if method == "auto":
        try:
            dag = capture_fx(model, example, label)
        except Exception as fx_error:  # fx raises many types (TraceError, TypeError, NotImplementedError...)
            if example is None:
                raise DagError(f"torch.fx cannot trace {label!r} ({fx_error}); pass an example input so the "
                               f"autograd capture can run it") from fx_error
            dag = capture_autograd(model, example, label)
    else:
        dag = CAPTURES.get(method)(model, example, label)
    if not training:
        return dag
    from dataclasses import replace

    order = grad_ready_order(model, example) if example is not None else ()
    return replace(training_dag(dag), grad_order=order)


def example_input(model_name: str, batch: int = 2, image_size: int | None = None) -> torch.Tensor:
    """A random input for registered model ``model_name``; ``image_size`` overrides its spatial size.

    Batch 2 by default: batch norm in training mode needs more than one value per channel.
    """
    import torch

    from gradsync.models import spec

    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise DagError(f"batch={batch!r} must be a positive integer")
    shape: Sequence[int] = spec(model_name).input_shape
    if image_size is not None:
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
            raise DagError(f"image_size={image_size!r} must be an integer >= 8 (pixels per side)")
        shape = (shape[0], *([image_size] * (len(shape) - 1)))
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(0))
