"""MSCCL algorithm files: export a gradsync allreduce schedule, and replay any file to prove it correct.

:func:`export_msccl` / :func:`to_msccl_xml` write the XML the MSCCL executor (built into RCCL, and MSCCL
for NVIDIA GPUs) loads from ``MSCCL_ALGO_DIR``; :func:`check_msccl_xml` executes a file's steps with the
executor's semantics and raises :class:`~gradsync.errors.MscclError` naming the GPU, thread block and step
where it is not an exact allreduce.
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
    "StepKind",
    "check_msccl_program",
    "check_msccl_xml",
    "export_msccl",
    "parse_msccl_xml",
    "quantize",
    "to_msccl_xml",
    "validate_program",
]
