"""A CPU-only guard for the GPU paths: CI has no GPU, so device mistakes must fail here.

Two checks stand in for a CUDA device:

* a static one: every tensor a hot module (``comm``, ``compress``, ``train``) creates names its device, or says
  on its line (``# host``) why it belongs on the host. A tensor created without a device lands on the CPU,
  which is what broke NCCL's allgather (a CPU sizes tensor), the compressed merge (a CPU zero-filled gap)
  and the sign vote (a CPU counter);
* a dynamic one: every compressor runs compress, decompress, combine and error feedback on the ``meta``
  device, which refuses a CPU tensor mixed in and any read of a value on the host (``.item()``,
  ``.tolist()``, ``.numpy()``): what a GPU turns into a crash or a synchronisation per step.

What neither catches (docs/runtime.md says so too): anything that needs a real GPU to run, such as NCCL's
point-to-point ordering, the staging copies' overlap, or the speed of a kernel.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.compress import COMPRESSORS, create
from gradsync.compress.base import TensorInfo

ROOT = Path(__file__).resolve().parents[1]
#: Modules whose tensors follow the gradients' device.
HOT = ("gradsync/comm", "gradsync/compress", "gradsync/train")
#: torch factories that put a tensor on the CPU unless told otherwise.
FACTORIES = frozenset({"zeros", "empty", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "randperm",
                       "linspace"})


def host_tensors(source: str) -> list[tuple[int, str]]:
    """Lines of ``source`` that call a torch factory with no ``device=`` and no ``# host`` note."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            span = " ".join(lines[node.lineno - 1:node.end_lineno])
            if "# host" not in span:
                found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_hot_modules_create_tensors_on_a_device_they_name():
    found = [f"{path.relative_to(ROOT)}:{line}: {text}" for hot in HOT for path in sorted((ROOT / hot).rglob("*.py"))
             for line, text in host_tensors(path.read_text())]
    assert found == [], "tensors created on the host by default; pass device= (or mark why: # host):\n" + "\n".join(found)


@pytest.mark.parametrize("source, bad", [
    # the sign vote's counter before the fix: a CPU tensor, added to the GPU's bits
    ("counts = torch.zeros(n, dtype=torch.uint8)\n", 1),
    # NCCL's allgather of sizes before the fix
    ("size = torch.tensor([t.numel()], dtype=torch.int64)\nsizes = [torch.zeros(1) for _ in range(w)]\n", 2),
    ("x = torch.zeros(n, device=t.device)\ny = torch.empty(\n    n,\n    dtype=d)  # host: why\n", 0),
])
def test_the_static_guard_flags_a_tensor_without_a_device(source, bad):
    assert len(host_tensors(source)) == bad


@pytest.mark.parametrize("shape", [(100, 10), (5000,)], ids=str)
@pytest.mark.parametrize("name", COMPRESSORS.names())
def test_every_compressor_keeps_to_the_input_device_and_never_reads_it_on_the_host(name, shape):
    compressor = create(name)
    info = TensorInfo("w", shape, torch.float32)
    x = torch.empty(shape, device="meta")
    payload, ctx = compressor.compress(x, info)
    decoded = compressor.decompress(payload, ctx)
    combined = compressor.combine([payload, payload], ctx)
    residual = compressor.subtract_decoded(x.clone(), payload, ctx, inplace=True)
    for t in (*payload, decoded, combined, residual):
        assert t.device.type == "meta", (name, t.device)


def test_the_dynamic_guard_refuses_a_host_tensor_and_a_host_read():
    """What the meta device refuses (an in-place op onto a host tensor it lets through: the static guard's job)."""
    x = torch.empty(10, device="meta")
    with pytest.raises(RuntimeError, match="same device"):  # a received sparse payload's indices on the host
        torch.zeros(10, device="meta").index_add_(0, torch.arange(10), x)
    with pytest.raises(RuntimeError, match="device"):
        torch.zeros(10) + x
    with pytest.raises(RuntimeError, match="meta"):
        float(x.sum())  # EF-SignSGD's decode read its scale on the host: one synchronisation per payload


def test_auto_on_nccl_runs_only_what_has_run_there():
    """On NCCL no planned schedule has been measured, so ``auto`` keeps the backend's collective at every size;
    a named algorithm still plans (the user asked for it)."""
    from dataclasses import replace

    from gradsync.comm import Runtime
    from gradsync.comm.local import LocalFabric
    from gradsync.comm.plans import PLANNED_BACKENDS

    assert "nccl" not in PLANNED_BACKENDS and "gloo" in PLANNED_BACKENDS
    transport = LocalFabric(4).transport(0)
    transport.capabilities = replace(transport.capabilities, group=object(), backend="nccl")
    rt = Runtime(transport, "racks:2,2,2", "auto", timeout_s=5)
    assert rt.chooser.algorithms == []
    assert {rt.choice(n)[0] for n in (4096, 1 << 20, 1 << 26)} == {"native"}
    assert rt.executor("lp", 1 << 20).schedule.algorithm == "lp"
    gloo = LocalFabric(4).transport(0)
    gloo.capabilities = replace(gloo.capabilities, group=object(), backend="gloo")
    on_gloo = Runtime(gloo, "racks:2,2,2", "auto", timeout_s=5)
    assert "lp" in on_gloo.chooser.algorithms and on_gloo.choice(1 << 26)[0] != "native"  # where NCCL's differs


def test_init_with_nccl_and_no_gpu_says_so_in_one_line(monkeypatch):
    import gradsync
    from gradsync.errors import GradsyncError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29999")):
        monkeypatch.setenv(var, value)
    with pytest.raises(GradsyncError, match=r"^backend='nccl' needs CUDA GPUs and NCCL, but .*; use backend='gloo'") as got:
        gradsync.init(backend="nccl")
    assert "\n" not in str(got.value)


def test_the_default_backend_is_nccl_only_where_each_process_has_a_gpu_of_its_own():
    from gradsync.comm.runtime import default_backend

    assert default_backend(gpus=8, local_ranks=8) == "nccl"
    assert default_backend(gpus=8, local_ranks=2) == "nccl"
    assert default_backend(gpus=1, local_ranks=3) == "gloo"  # NCCL refuses two ranks on one GPU
    assert default_backend(gpus=0, local_ranks=1) == "gloo"


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, gpus: int, local_rank: int, local_ranks: int) -> list[Any]:
    """torchrun's variables for a host with ``gpus`` GPUs, and a record of what init_process_group was asked."""
    import torch.distributed as dist

    from gradsync.comm import lifetime

    for var, value in (("RANK", str(local_rank)), ("WORLD_SIZE", str(local_ranks)), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29999"), ("LOCAL_RANK", str(local_rank)),
                       ("LOCAL_WORLD_SIZE", str(local_ranks))):
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    asked: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: asked.append(("device", d)))
    monkeypatch.setattr(lifetime, "init_process_group", lambda backend, timeout_s: asked.append(backend))
    return asked


def test_more_processes_than_gpus_start_gloo_with_a_warning_not_a_cuda_error(monkeypatch):
    """Three ranks on a one-GPU host (the test suite's own jobs, on a GPU machine): set_device(2) used to fail with
    CUDA's 'invalid device ordinal'."""
    from gradsync.comm.runtime import _init_process_group

    asked = _fake_gpus(monkeypatch, gpus=1, local_rank=2, local_ranks=3)
    with pytest.warns(RuntimeWarning, match="3 processes on this host share 1 GPU"):
        _init_process_group(None, 5.0)
    assert asked == ["gloo"]
    asked = _fake_gpus(monkeypatch, gpus=4, local_rank=2, local_ranks=3)
    _init_process_group(None, 5.0)
    assert asked == [("device", 2), "nccl"]


def test_nccl_named_with_a_rank_past_the_last_gpu_names_the_fix(monkeypatch):
    from gradsync.comm.runtime import _init_process_group
    from gradsync.errors import GradsyncError

    asked = _fake_gpus(monkeypatch, gpus=1, local_rank=2, local_ranks=3)
    with pytest.raises(GradsyncError, match=r"LOCAL_RANK=2 on GPU 2, but this host shows 1 GPU\(s\); start at most 1 "
                                            r"process\(es\) per host \(torchrun --nproc-per-node 1\), or use backend='gloo'"):
        _init_process_group("nccl", 5.0)
    assert asked == []


def test_a_launcher_count_that_is_not_an_integer_is_named_where_the_backend_is_chosen_by_it(monkeypatch):
    """``LOCAL_WORLD_SIZE`` picks the backend when none is named, and a value that is not a count says so; with a
    backend named the count is not read, so a stray value there does not stop the job."""
    from gradsync.comm.runtime import _init_process_group
    from gradsync.errors import GradsyncError

    _fake_gpus(monkeypatch, gpus=1, local_rank=0, local_ranks=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(GradsyncError, match=r"^LOCAL_WORLD_SIZE='two' must be an integer"):
        _init_process_group(None, 5.0)
    asked = _fake_gpus(monkeypatch, gpus=1, local_rank=0, local_ranks=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")  # a named backend needs no count of the host's processes
    _init_process_group("gloo", 5.0)
    assert asked == ["gloo"]
