"""The names users import stay where the README and the docs put them, whatever moves inside a package."""

from __future__ import annotations

import importlib

import pytest

#: (module, name): every public entry point a user script or a doc example imports.
PUBLIC = [
    *[("gradsync", n) for n in ("init", "allreduce", "allreduce_async", "reduce_scatter", "reduce_scatter_tensor",
                                "all_gather_into_tensor", "shutdown", "get_runtime", "is_initialized",
                                "DistributedOptimizer", "GradsyncHookState", "allreduce_hook", "CompressionHookState",
                                "compression_hook", "broadcast_parameters", "broadcast_optimizer_state", "kvstore", "GradsyncError", "CommError", "PeerError", "PlanError")],
    *[("gradsync.comm", n) for n in ("Runtime", "Work", "Executor", "LocalFabric", "LocalTransport", "TorchTransport",
                                     "Transport", "create_transport", "run_ranks", "allgather", "allgather_async",
                                     "AdaptOptions")],
    ("gradsync.comm.transport", "Capabilities"),
    *[("gradsync.kvstore", n) for n in ("create",)],
    *[("gradsync.compress", n) for n in ("create", "create_memory", "COMPRESSORS", "MEMORIES", "Compressor", "Memory",
                                         "TensorInfo", "register_compressor")],
    *[("gradsync.train", n) for n in ("DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "allreduce_hook", "compression_hook", "CompressionStep",
                                      "MergedGroups", "PSTrainer")],
    *[("gradsync.plan", n) for n in ("synthesize", "SYNTHESIZERS", "PlanOptions", "Schedule", "limits", "evaluate")],
    *[("gradsync.sim", n) for n in ("simulate", "synthesize", "algorithm_names", "Chooser", "CostModel", "plan_auto",
                                    "simulate_iteration")],
    *[("gradsync.topology", n) for n in ("get_topology", "BUILDERS", "save")],
]


@pytest.mark.parametrize("module, name", PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_imports(module: str, name: str) -> None:
    got = getattr(importlib.import_module(module), name)
    assert got is not None
    if name in getattr(importlib.import_module(module), "__all__", [name]) or module == "gradsync":
        return
    pytest.fail(f"{module}.{name} exists but is not in {module}.__all__")


def test_the_compressors_are_registered_by_importing_the_package() -> None:
    from gradsync.compress import COMPRESSORS

    assert {"none", "fp16", "topk", "randk", "dgc", "qsgd", "terngrad", "signsgd", "signum", "efsignsgd", "onebit",
            "powersgd"} <= set(COMPRESSORS.names())
