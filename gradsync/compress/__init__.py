"""Gradient compression with error feedback: the compressors MergeComp schedules (§2.1, Table 1).

GRACE's split (STYLE.md): a :class:`Compressor` (``compress``/``decompress``/``aggregate`` and
``payload_bytes`` so a scheduler can price a merge without compressing) and a :class:`Memory` (error
feedback); :func:`simulate_step` is the in-process reference of the step that joins them to a communicator.
Also here: payloads as one self-describing buffer (:func:`pack_payload`), MergeComp's merge search on a cost
model (:func:`search_optimal`, :func:`search_mergecomp`, :func:`resolve_merge`) and the codec profiler.

This package knows no engine. What runs compression on real processes -- the communicators (allreduce on
the planned schedule, allgather, through the parameter server), :class:`~gradsync.train.CompressionStep`,
:class:`~gradsync.train.MergedGroups` and the compressed DDP hook -- is in :mod:`gradsync.train`.

    >>> import torch
    >>> from gradsync.compress import create
    >>> create("topk", ratio=0.01).payload_bytes((1000, 1000), torch.float32)  # 10^4 values + int32 indices
    80000
"""

from __future__ import annotations

# Import the families in the order ``COMPRESSORS.names()`` should list them: baseline and quantizers,
# sparsifiers, 1-bit methods, low rank.
# isort: off
from gradsync.compress import quantize, sparsify, sign, lowrank  # noqa: F401

# isort: on
from gradsync.compress.base import (
    COMMUNICATORS,
    COMPRESSORS,
    MEMORIES,
    CompressionError,
    Compressor,
    Context,
    Memory,
    TensorInfo,
    TwoRoundCompressor,
    create,
    create_memory,
    payload_nbytes,
    register_compressor,
    register_memory,
    simulate_step,
)
from gradsync.compress.lowrank import PowerSGD
from gradsync.compress.memory import DEFAULT_MEMORY, DGCMemory, NoMemory, ResidualMemory, default_memory
from gradsync.compress.merge import (
    MERGE_MODES,
    Cost,
    LinearCost,
    MergeCompSearch,
    MergeCostModel,
    MergeError,
    Partition,
    PipelineTrace,
    ScaledCost,
    ShiftedCost,
    equal_partition,
    fit_group_overhead,
    fit_wire_scale,
    optimal_per_y,
    probe_sizes,
    resolve_merge,
    search_mergecomp,
    search_mergecomp_trace,
    search_optimal,
)
from gradsync.compress.packing import pack_bits, pack_uint, packed_nbytes, unpack_bits, unpack_uint
from gradsync.compress.payload import pack_payload, unpack_payload
from gradsync.compress.profile import (
    DriftCheck,
    LinearFit,
    MeasuredCost,
    Samples,
    fit_linear,
    measure_codec,
    measure_comm,
    prediction_error,
    refit_if_drifted,
)
from gradsync.compress.quantize import FP16, QSGD, NoCompression, TernGrad
from gradsync.compress.sign import EFSignSGD, OneBit, SignSGD, SigNUM, majority_vote
from gradsync.compress.sparsify import DGC, RandK, TopK

__all__ = [
    "COMMUNICATORS",
    "COMPRESSORS",
    "DEFAULT_MEMORY",
    "DGC",
    "FP16",
    "MEMORIES",
    "MERGE_MODES",
    "QSGD",
    "CompressionError",
    "Compressor",
    "Context",
    "Cost",
    "DGCMemory",
    "DriftCheck",
    "EFSignSGD",
    "LinearCost",
    "LinearFit",
    "MeasuredCost",
    "Memory",
    "MergeCompSearch",
    "MergeCostModel",
    "MergeError",
    "NoCompression",
    "NoMemory",
    "OneBit",
    "Partition",
    "PipelineTrace",
    "PowerSGD",
    "RandK",
    "ResidualMemory",
    "Samples",
    "SigNUM",
    "SignSGD",
    "TensorInfo",
    "TernGrad",
    "TopK",
    "TwoRoundCompressor",
    "create",
    "create_memory",
    "default_memory",
    "ScaledCost",
    "ShiftedCost",
    "equal_partition",
    "fit_group_overhead",
    "fit_wire_scale",
    "fit_linear",
    "majority_vote",
    "measure_codec",
    "measure_comm",
    "optimal_per_y",
    "pack_bits",
    "pack_payload",
    "pack_uint",
    "packed_nbytes",
    "payload_nbytes",
    "prediction_error",
    "probe_sizes",
    "refit_if_drifted",
    "register_compressor",
    "register_memory",
    "resolve_merge",
    "search_mergecomp",
    "search_mergecomp_trace",
    "search_optimal",
    "simulate_step",
    "unpack_bits",
    "unpack_payload",
    "unpack_uint",
]
