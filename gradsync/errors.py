"""Errors gradsync raises for bad input.

Every error says which value was wrong and how to fix it. They subclass ``ValueError`` so callers that
already catch ``ValueError`` keep working; the CLI turns them into a one-line message and exit code 2.
"""

from __future__ import annotations

__all__ = ["GradsyncError", "TopologyError", "ScheduleError", "MscclError", "PlanError", "SimulationError", "CommError", "PeerError"]


class GradsyncError(ValueError):
    """Base class: bad input to gradsync (a name, a file, a size, a schedule)."""


class TopologyError(GradsyncError):
    """A topology is malformed: unknown device, bad bandwidth, disconnected ranks, bad file."""


class ScheduleError(GradsyncError):
    """A schedule fails its self-check: a rank misses a contribution, counts one twice, or a route is broken."""


class MscclError(ScheduleError):
    """An MSCCL algorithm file is malformed, exceeds an executor limit, or fails its replay.

    ``gpu``, ``tb`` and ``step`` name where (each ``None`` when the fault is not local to one).
    """

    def __init__(self, message: str, gpu: int | None = None, tb: int | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.gpu, self.tb, self.step = gpu, tb, step


class PlanError(GradsyncError):
    """A synthesizer cannot plan for this topology, or an option is out of range."""


class SimulationError(GradsyncError):
    """A simulation cannot run: bad sizes or options, or a schedule the simulator cannot order."""


class CommError(RuntimeError):
    """A collective failed while running (not bad input): a transport error, a timeout, a lost peer."""


class PeerError(CommError):
    """A specific peer failed: it closed its connection (crashed) or sent nothing within the timeout.

    ``peer`` is the process rank of that peer, so a survivor can report exactly who is gone.
    """

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer
