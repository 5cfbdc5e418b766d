"""gradsync: plan, simulate and run gradient synchronisation on one schedule representation.

Topology --plan--> Schedule --simulate/run--> time; ordering (TicTac) and compression (MergeComp) act on
the schedule's transfers. See ARCHITECTURE in the README for the package map.

The runtime entry points (``gradsync.init``, ``gradsync.allreduce``, ``gradsync.DistributedOptimizer``...)
are loaded on first use, so planning and the CLI do not pay for importing torch.distributed.
"""

from __future__ import annotations

from typing import Any

from gradsync.errors import CommError, GradsyncError, PeerError, PlanError, ScheduleError, TopologyError

__version__ = "0.1.0"

_RUNTIME_NAMES = (
    "init",
    "allreduce",
    "allreduce_async",
    "shutdown",
    "get_runtime",
    "is_initialized",
    "DistributedOptimizer",
    "GradsyncHookState",
    "allreduce_hook",
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
    if name in _RUNTIME_NAMES:
        from gradsync import comm

        return getattr(comm, name)
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
