"""Training: where the algorithms and the engines meet a model, its gradients and its optimizer.

Everything that binds planning, compression and ordering to a training loop lives here, above the engines
(:mod:`gradsync.comm`, :mod:`gradsync.ps`), which know nothing of compression or training:

``optimizer``: :class:`DistributedOptimizer` (gradients start their allreduce from backward's hooks,
optionally compressed and merged). ``hooks``: the DDP hook on the planned schedule
(:func:`allreduce_hook`). ``compressed_hook``: the compressed DDP hook (:func:`compression_hook`; the module has
another name than the function, so importing one never hides the other).
``communicator``: the communicators (allreduce on the planned schedule, allgather, through the parameter
server) and :class:`CompressionStep`, which joins them to a compressor and a memory. ``grouped``:
MergeComp's merged groups, overlapped with backward (:class:`MergedGroups`), and the profiled cost model.
``auto_compression``: ``compression="auto"`` (:class:`AutoCompression`: a codec per group, measured against none).
``ps_trainer``: dist/mpi SGD, ASGD and ESGD on a KVStore as training loops (:class:`PSTrainer`).
``broadcast``: Horovod's :func:`broadcast_parameters` and :func:`broadcast_optimizer_state` (every replica
starts from one rank's values). ``ps_overlap``: forward pre-hooks that wait for each parameter's pull. ``demo``: ``gradsync demo``'s workers.

Names are loaded on first use, so ``gradsync.DistributedOptimizer`` does not import ZeroMQ.
"""

from typing import Any

_EXPORTS = {
    "DistributedOptimizer": "optimizer",
    "broadcast_parameters": "broadcast", "broadcast_optimizer_state": "broadcast",
    "GradsyncHookState": "hooks", "allreduce_hook": "hooks",
    "CompressionHookState": "compressed_hook", "compression_hook": "compressed_hook",
    "COMMUNICATOR_TYPES": "communicator", "AllgatherCommunicator": "communicator",
    "AllreduceCommunicator": "communicator", "Communicator": "communicator", "CompressionStep": "communicator",
    "PSCommunicator": "communicator", "create_communicator": "communicator", "register_communicator": "communicator",
    "AutoCompression": "auto_compression",
    "MergedGroups": "grouped", "profile_cost_model": "grouped",
    "ALGORITHMS": "ps_trainer", "PSTrainer": "ps_trainer", "create_trainer": "ps_trainer",
    "PullWaits": "ps_overlap", "attach_pull_waits": "ps_overlap",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"gradsync.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'gradsync.train' has no attribute {name!r}")
