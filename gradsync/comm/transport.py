"""Point-to-point transports the executor runs schedules on.

A transport does one thing: start a send or a receive of a contiguous tensor to or from a peer process,
and return a handle to wait on. The executor never asks a transport to reduce or to collect, so one
executor drives every engine (``torch.distributed`` with gloo or NCCL, MPI through ``mpi4py``, and an
in-process fabric for tests) and runs every schedule the planner writes.

Tags: a message is matched by ``(peer, tag)``. The executor numbers the transfers of each ordered pair
of ranks, so tags stay small (MPI guarantees only 32767) and never collide inside one collective.
Backends that ignore tags and match by posting order (NCCL) set ``ordered = True``; the executor then
posts each pair's messages in tag order.

Capabilities: beyond ``isend``/``irecv``, a transport declares what else it offers in one frozen
:class:`Capabilities` record (a process group for native collectives, the user's group, job-wide decisions,
a failure board, the device its collectives reduce on). The runtime reads it once; nothing probes for
attributes.

Failures: ``wait`` raises :class:`~gradsync.errors.PeerError` naming the peer when it closed its
connection or sent nothing within the timeout, so survivors report who is gone instead of hanging.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from gradsync.comm import lifetime
from gradsync.errors import CommError, GradsyncError, PeerError
from gradsync.registry import Registry

__all__ = ["Capabilities", "FailureBoard", "Handle", "Transport", "TorchTransport", "TRANSPORTS", "TransportEntry", "create_transport"]


@runtime_checkable
class Handle(Protocol):
    """A started send or receive."""

    def wait(self, timeout_s: float) -> None:
        """Block until done; raise :class:`PeerError` if the peer is gone or silent for ``timeout_s``."""


class FailureBoard:
    """Where ranks post which peer they lost, so every survivor can name the rank that actually failed.

    Gloo waits cannot be interrupted, so a survivor stuck behind another survivor only sees a timeout or
    a closed connection from that survivor; reading the board turns it into "rank 2 crashed". Transports
    without a shared store use this no-op version.
    """

    def post(self, reporter: int, peer: int, message: str) -> None:
        return None

    def read(self) -> dict[int, tuple[int, str]]:
        """reporter -> (failed peer, message)."""
        return {}

    def share(self, rank: int, text: str) -> None:
        """Post ``rank``'s ledger of collectives (:mod:`gradsync.comm.ledger`): on a failure or at shutdown only."""
        return None

    def shared(self) -> dict[int, str]:
        """rank -> the ledger it posted (only ranks that did)."""
        return {}


#: ``decide(key, compute, timeout_s)``: ``compute()`` once for the job, the same bytes on every rank.
Decide = Callable[[str, Callable[[], bytes], float], bytes]


@dataclass(frozen=True)
class Capabilities:
    """What a transport offers beyond point-to-point messages, declared once (the runtime never probes).

    The defaults describe a transport with point-to-point messages only (MPI, in-process): no native
    collectives, every rank decides for itself, failures are not shared.
    """

    #: The torch.distributed process group gradsync's own collectives run on (``native`` allreduce, allgather,
    #: calibration's timings); None: point to point only.
    group: Any = None
    #: The group the user's own collectives run on (DDP's, a logged loss): collectives gradsync issues on the
    #: caller's thread go there, in program order with the user's. None: as :attr:`group`.
    user_group: Any = None
    #: The process group's backend (``"gloo"``, ``"nccl"``); ``""`` without one.
    backend: str = ""
    #: Job-wide decisions by rank 0 (:data:`Decide`); None: every rank computes its own (deterministic) answer.
    decide: Decide | None = None
    #: Where ranks post the peer they lost, so survivors name the rank that failed first.
    failures: FailureBoard = field(default_factory=lambda: FailureBoard())

    @property
    def native(self) -> bool:
        """Whether the backend's own collectives (``torch.distributed.all_reduce``...) can run."""
        return self.group is not None

    @property
    def native_group(self) -> Any:
        """The group for native collectives on the caller's thread (:attr:`user_group`, else :attr:`group`)."""
        return self.user_group if self.user_group is not None else self.group

    def collective_device(self) -> torch.device:
        """Where the backend's collectives take their tensors: NCCL's on this process's GPU, others' on the CPU.
        A tensor elsewhere (a CUDA tensor on gloo) is staged through a copy there and back."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


@runtime_checkable
class Transport(Protocol):
    """Non-blocking point-to-point messages between the processes of one group (ranks 0..world_size-1)."""

    name: str
    rank: int
    world_size: int
    #: True when the backend matches messages by posting order instead of by tag (NCCL).
    ordered: bool
    #: What else it offers (:class:`Capabilities`).
    capabilities: Capabilities

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...


class _StoreBoard(FailureBoard):
    """A board on torch.distributed's key-value store (the rendezvous store every rank already has)."""

    def __init__(self, store: Any, world_size: int, prefix: str) -> None:
        self._store, self._n, self._prefix = store, world_size, prefix

    def post(self, reporter: int, peer: int, message: str) -> None:
        try:
            self._store.set(f"{self._prefix}/{reporter}", f"{peer}|{message}")
        except Exception:  # noqa: BLE001 - the store may have died with rank 0; the local error still stands
            pass

    def read(self) -> dict[int, tuple[int, str]]:
        out: dict[int, tuple[int, str]] = {}
        try:
            for r in range(self._n):
                key = f"{self._prefix}/{r}"
                if self._store.check([key]):
                    peer, _, msg = self._store.get(key).decode().partition("|")
                    out[r] = (int(peer), msg)
        except Exception:  # noqa: BLE001
            pass
        return out

    def share(self, rank: int, text: str) -> None:
        try:
            self._store.set(f"{self._prefix}/ledger/{rank}", text)
        except Exception:  # noqa: BLE001 - the store may have died with rank 0; the local error still stands
            pass

    def shared(self) -> dict[int, str]:
        out: dict[int, str] = {}
        try:
            for r in range(self._n):
                key = f"{self._prefix}/ledger/{r}"
                if self._store.check([key]):
                    out[r] = self._store.get(key).decode()
        except Exception:  # noqa: BLE001
            pass
        return out


def _classify(exc: BaseException, peer: int, what: str, timeout_s: float) -> PeerError:
    """Turn a backend's exception text into an error that names the peer and says what likely happened."""
    text = str(exc)
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        why = f"rank {peer} sent nothing for {timeout_s:g} s (stalled, or waiting on a failed rank)"
    elif "closed" in low or "reset" in low or "broken pipe" in low or "crash" in low:
        why = f"rank {peer} closed its connection (the process exited or crashed)"
    else:
        why = f"the {what} with rank {peer} failed"
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return PeerError(f"{why}: {first_line}", peer)


class _TorchHandle:
    """A started send or receive; ``staged``: the copy on the backend's device that travels instead of the
    caller's tensor (kept alive until done), and for a receive, the caller's tensor it is copied into."""

    __slots__ = ("_work", "_peer", "_what", "_staged", "_into")

    def __init__(self, work: Any, peer: int, what: str, staged: torch.Tensor | None = None,
                 into: torch.Tensor | None = None) -> None:
        self._work, self._peer, self._what, self._staged, self._into = work, peer, what, staged, into

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise _classify(exc, self._peer, self._what, timeout_s) from exc
        if self._into is not None:
            self._into.copy_(self._staged)
            self._into = None
        self._staged = None


def staging_buffer(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty tensor shaped as ``like`` on ``device``: page-locked when it is the host and CUDA is up, so the
    copies to and from the GPU run at the bus's speed."""
    pin = device.type == "cpu" and like.device.type == "cuda"
    return torch.empty(like.shape, dtype=like.dtype, device=device, pin_memory=pin)


class TorchTransport:
    """``torch.distributed`` p2p on one process group (gloo on CPU, NCCL on GPU).

    Owns a dedicated group by default so gradsync's tags never meet the user's own p2p traffic.
    """

    def __init__(self, group: Any = None, *, dedicated: bool = True, timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise GradsyncError(
                "torch.distributed is not initialised; call gradsync.init() (it reads RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT as torchrun sets them) or dist.init_process_group() first"
            )
        base = group if group is not None else dist.group.WORLD
        if dedicated:
            ranks = dist.get_process_group_ranks(base)
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=dist.get_backend(base))
            lifetime.own(group)
        else:
            group = base
        self._dist = dist
        self.group = group
        #: The group the transport was built over (the user's; WORLD by default). Collectives gradsync issues on
        #: the caller's thread in program order, as ``torch``'s DDP hooks do, go here: a job that also runs
        #: its own collectives on this group (DDP, a logged loss) then never switches gloo contexts between
        #: them, which costs time on every step (measured: ``gradsync bench hooks``).
        self.user_group = base
        self.backend = str(dist.get_backend(group))
        self.name = f"torch-{self.backend}"
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ordered = self.backend == "nccl"
        self._global = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.failures: FailureBoard = FailureBoard()
        self._store: Any = None
        self._group_name = getattr(group, "group_name", "world")
        try:  # the rendezvous store is not public API; without it errors still name the direct peer
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
            self.failures = _StoreBoard(self._store, self.world_size, f"gradsync/failed/{self._group_name}")
        except Exception:  # noqa: BLE001
            pass
        self.capabilities = Capabilities(group=self.group, user_group=self.user_group, backend=self.backend,
                                         decide=self.decide, failures=self.failures)
        self._device = self.capabilities.collective_device()

    def decide(self, key: str, compute: Callable[[], bytes], timeout_s: float) -> bytes:
        """``compute()`` on rank 0, the same bytes on every rank (through the rendezvous store).

        Plans priced by simulation cost seconds of CPU; one rank pays instead of every rank, and every rank
        is certain to run the same choice (the executor's wait order must be identical everywhere). Each
        ``key`` must be decided once per group, by every rank. Without the store every rank computes.
        """
        if self._store is None:
            return compute()
        full = f"gradsync/decide/{self._group_name}/{key}"
        if self.rank == 0:
            value = compute()
            self._store.set(full, value)
            return value
        try:
            self._store.wait([full], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise PeerError(f"rank 0 did not publish {key!r} within {timeout_s:g} s (it plans for every rank; "
                            f"is it alive?): {exc}", self._global[0]) from exc
        return bytes(self._store.get(full))

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        staged = None
        if tensor.device != self._device:  # gloo sends from host memory, NCCL from its GPU: stage a copy there
            staged = staging_buffer(tensor, self._device).copy_(tensor)
            tensor = staged
        return _TorchHandle(self._start(self._dist.isend, tensor, peer, tag, "send"), peer, "send", staged)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        if tensor.device == self._device:
            return _TorchHandle(self._start(self._dist.irecv, tensor, peer, tag, "receive"), peer, "receive")
        staged = staging_buffer(tensor, self._device)  # received there, copied into ``tensor`` by wait()
        return _TorchHandle(self._start(self._dist.irecv, staged, peer, tag, "receive"), peer, "receive", staged, tensor)

    def _start(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        """``op`` (isend or irecv) with ``peer``: gloo raises at once where the peer's connection is already closed
        (a rank that died between two calls), and that names the peer as a failed wait does."""
        try:
            return op(tensor, self._global[peer], group=self.group, tag=tag)
        except RuntimeError as exc:
            raise _classify(exc, peer, what, 0.0) from exc


@dataclass(frozen=True)
class TransportEntry:
    name: str
    factory: Callable[..., Transport]
    summary: str


#: The default transport is registered here; the others register themselves when their module is imported
#: (``gradsync.comm`` imports ``gradsync.comm.mpi``), so this module never imports a transport module back.
TRANSPORTS: Registry[TransportEntry] = Registry("transport", GradsyncError)
TRANSPORTS.add("torch", TransportEntry("torch", TorchTransport, "torch.distributed p2p (gloo on CPU, NCCL on GPU)"),
               aliases=("gloo", "nccl"))


def create_transport(name: str, **kwargs: Any) -> Transport:
    """Build a registered transport; ``CommError`` if its engine cannot start."""
    entry = TRANSPORTS.get(name)
    try:
        return entry.factory(**kwargs)
    except ImportError as exc:
        raise CommError(f"transport {entry.name!r} needs a package that is not installed: {exc}") from exc
