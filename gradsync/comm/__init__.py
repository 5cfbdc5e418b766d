"""The runtime: run any planned schedule on real processes (OMS, BML, MXNET-MPI).

Follow a tensor from planner to wire: :func:`init` plans a :class:`~gradsync.plan.schedule.Schedule` for
the job's topology; :class:`Executor` compiles this rank's phases of it; a :class:`Transport`
(``torch.distributed`` gloo/NCCL, MPI, or in-process) moves each chunk. This package is an engine: it
knows nothing of compression or training; the DDP hooks and ``DistributedOptimizer``, which feed gradients
in as backward produces them, are in :mod:`gradsync.train`.
"""

# ``mpi`` registers the "mpi" transport; it loads neither mpi4py nor MPI until an MPITransport is created.
from gradsync.comm import mpi  # noqa: F401
from gradsync.comm.adapt import AdaptOptions
from gradsync.comm.executor import OPS, ExecStats, Executor, RankProgram, compile_program, process_mapping
from gradsync.comm.local import LocalFabric, LocalTransport, run_ranks
from gradsync.comm.runtime import (
    Runtime,
    Work,
    all_gather_into_tensor,
    all_gather_into_tensor_async,
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    get_runtime,
    init,
    is_initialized,
    reduce_scatter,
    reduce_scatter_tensor,
    reduce_scatter_tensor_async,
    shutdown,
)
from gradsync.comm.transport import TRANSPORTS, Handle, TorchTransport, Transport, create_transport

__all__ = [
    "OPS",
    "AdaptOptions",
    "TRANSPORTS",
    "ExecStats",
    "Executor",
    "Handle",
    "LocalFabric",
    "LocalTransport",
    "RankProgram",
    "Runtime",
    "TorchTransport",
    "Transport",
    "Work",
    "all_gather_into_tensor",
    "all_gather_into_tensor_async",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_async",
    "compile_program",
    "create_transport",
    "get_runtime",
    "init",
    "is_initialized",
    "process_mapping",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_async",
    "run_ranks",
    "shutdown",
]
