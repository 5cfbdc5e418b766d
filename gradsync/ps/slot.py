"""One stored slice of a key on a parameter server: its value, version, round being summed and the rest of
its state (:mod:`gradsync.ps.server` serves it, :mod:`gradsync.ps.checkpoint` saves and restores it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Slot"]


@dataclass
class Slot:
    """One stored slice: elements ``[offset, offset + value.numel())`` of a tensor of ``shape``."""

    value: torch.Tensor
    shape: tuple[int, ...]
    offset: int
    parts: int
    sync: bool
    pushers: int
    version: int = 0
    pending: torch.Tensor | None = None
    pending_from: set[int] = field(default_factory=set)
    future: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # sync: round -> sender -> push
    last_seq: dict[int, int] = field(default_factory=dict)  # async: sender -> last applied push
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    elastic: bool = False
    #: the clients a sync round waits for (all ``pushers`` unless elastic ones were dropped)
    members: set[int] = field(default_factory=set)
    #: how many pushes the last completed round summed (its VALUE replies say so)
    last_pushed: int = 0
    #: when the round being summed got its first push (monotonic seconds): an elastic key waits for its
    #: missing members from then (a member never heard from counts as silent since then)
    round_started: float = 0.0
    #: zmq trackers of replies sent from ``value``'s memory, not all known to be sent yet
    sending: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            self.members = set(range(self.pushers))

    def missing(self) -> list[int]:
        return sorted(self.members - self.pending_from)

    def writable(self) -> torch.Tensor:
        """``value``, safe to change in place: first replaced by a copy if a reply may still be sending from
        its memory (the old tensor lives on, referenced by ZeroMQ, until that reply has gone)."""
        if self.sending:
            if not all(t.done for t in self.sending):
                self.value = self.value.clone()
            self.sending.clear()
        return self.value
