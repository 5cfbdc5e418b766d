"""gradsync: plan, simulate and run gradient synchronisation on one schedule representation.

Topology --plan--> Schedule --simulate/run--> time; ordering (TicTac) and compression (MergeComp) act on
the schedule's transfers. The packages form layers, each importing only from the layers below it
(``[tool.importlinter]`` in pyproject.toml holds the contract; the README shows the map)::

    cli, commands                      the gradsync command and its subcommands
    integrations                       the hooks inside trainers (Lightning's callback, Accelerate's recipe)
    train | kvstore                    DistributedOptimizer, DDP hooks, compression steps, PS training loops
    ps                                 parameter server, clients, KVStore (its collective kind runs on comm)
    comm | testbed                     the runtime (executor, transports) | the emulated cluster
    sim                                network and iteration simulators, the runtime's cost model
    plan | order | compress            synthesizers | TicTac | codecs, memories, merge search
    topology | models                  devices and links | model definitions
    launch | registry | paths, errors  worker launcher | name registries | output paths, exceptions

The runtime entry points (``gradsync.init``, ``gradsync.allreduce``, ``gradsync.DistributedOptimizer``...)
and ``gradsync.kvstore`` are loaded on first use, so planning and the CLI do not pay for importing
torch.distributed, ZeroMQ, mpi4py, matplotlib or scipy.
"""

from __future__ import annotations

from typing import Any

from gradsync.errors import CommError, GradsyncError, PeerError, PlanError, ScheduleError, TopologyError

__version__ = "0.1.0"

_RUNTIME_NAMES = (
    "init",
    "allreduce",
    "allreduce_async",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "shutdown",
    "get_runtime",
    "is_initialized",
    "DistributedOptimizer",
    "GradsyncHookState",
    "allreduce_hook",
    "CompressionHookState",
    "compression_hook",
    "broadcast_parameters",
    "broadcast_optimizer_state",
)

__all__ = [
    "CommError",
    "GradsyncError",
    "PeerError",
    "PlanError",
    "ScheduleError",
    "TopologyError",
    "__version__",
    *_RUNTIME_NAMES,
]


def __getattr__(name: str) -> Any:
    # Imports on first use keep ``import gradsync`` light; they are plain imports, so the layer contract sees them.
    if name == "DistributedOptimizer":
        from gradsync.train.optimizer import DistributedOptimizer

        return DistributedOptimizer
    if name in ("GradsyncHookState", "allreduce_hook"):
        from gradsync.train import hooks

        return getattr(hooks, name)
    if name in ("CompressionHookState", "compression_hook"):
        from gradsync.train import compressed_hook

        return getattr(compressed_hook, name)
    if name in ("broadcast_parameters", "broadcast_optimizer_state"):
        from gradsync.train import broadcast

        return getattr(broadcast, name)
    if name in _RUNTIME_NAMES:
        from gradsync import comm

        return getattr(comm, name)
    if name == "kvstore":  # ``import gradsync; gradsync.kvstore.create(...)`` needs no second import
        import gradsync.kvstore as kvstore  # not ``from gradsync import``: that would call this function again

        return kvstore
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
