"""MSCCL algorithm files: export a gradsync allreduce schedule, and replay any file to prove it correct.

:func:`export_msccl` / :func:`to_msccl_xml` write the XML the MSCCL executor (built into RCCL, and MSCCL
for NVIDIA GPUs) loads from ``MSCCL_ALGO_DIR``; :func:`check_msccl_xml` executes a file's steps with the
executor's semantics and raises :class:`~gradsync.errors.MscclError` naming the GPU, thread block and step
where it is not an exact allreduce. :func:`export_msccl_sizes` writes the set MSCCL chooses from by message
size: one algorithm per range, the ranges tiling every size.
"""

from gradsync.plan.msccl.export import MAX_AUTO_CHUNKS, MscclExport, Quantization, export_msccl, quantize, to_msccl_xml
from gradsync.plan.msccl.program import (
    STEP_KINDS,
    MscclGpu,
    MscclLimits,
    MscclProgram,
    MscclStep,
    MscclThreadBlock,
    StepKind,
    parse_msccl_xml,
)
from gradsync.plan.msccl.replay import ReplayStats, check_msccl_program, check_msccl_xml, validate_program
from gradsync.plan.msccl.sizes import SizedExport, check_tiling, export_msccl_sizes

__all__ = [
    "MAX_AUTO_CHUNKS",
    "STEP_KINDS",
    "MscclExport",
    "MscclGpu",
    "MscclLimits",
    "MscclProgram",
    "MscclStep",
    "MscclThreadBlock",
    "Quantization",
    "ReplayStats",
    "SizedExport",
    "StepKind",
    "check_msccl_program",
    "check_msccl_xml",
    "check_tiling",
    "export_msccl",
    "export_msccl_sizes",
    "parse_msccl_xml",
    "quantize",
    "to_msccl_xml",
    "validate_program",
]
