"""The collectives beside the planned executor, each behind the executor's ``run`` or as a plain function.

* :class:`NativeAllreduce`: the backend's own ``torch.distributed.all_reduce`` with the executor's interface,
  for where ``auto`` prices it fastest;
* :func:`run_sharded`: a reduce-scatter or an allgather in torch.distributed's tensor forms, on a planned
  schedule's executor;
* :func:`gather_torch` / :func:`gather_p2p`: every rank's 1-D tensor, sizes allowed to differ, on a process
  group or point to point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradsync.comm.executor import OPS, Executor
from gradsync.comm.transport import Transport
from gradsync.errors import CommError, GradsyncError
from gradsync.plan.schedule import Schedule

__all__ = ["NativeAllreduce", "Tensors", "check_sharded", "dtype_groups", "gather_p2p", "gather_torch", "native_failure",
           "nbytes_of", "run_sharded"]

Tensors = torch.Tensor | Sequence[torch.Tensor]


def nbytes_of(tensors: Tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


class NativeAllreduce:
    """The backend's own ``torch.distributed.all_reduce`` behind the executor's interface (``auto`` picks
    it where the cost model says no planned schedule beats it). A tensor list of one dtype is reduced as
    one flat buffer; in place, like :meth:`Executor.run`. Tensors on another device than the backend's
    (CUDA tensors on gloo) are reduced in a staged copy there and copied back."""

    def __init__(self, transport: Transport, schedule: Schedule) -> None:
        self.transport = transport
        self.schedule = schedule  # the rank-order ring it is priced as
        self.runs = 0

    def run(self, tensors: Tensors, op: str = "sum") -> Tensors:
        import torch.distributed as dist

        if op not in OPS:
            raise GradsyncError(f"op={op!r} is not one of {OPS}")
        single = isinstance(tensors, torch.Tensor)
        tlist = [tensors] if single else list(tensors)
        if op == "avg" and tlist and not (tlist[0].is_floating_point() or tlist[0].is_complex()):
            raise TypeError(f"op='avg' needs a floating-point tensor, got {tlist[0].dtype}; use op='sum' or convert first")
        caps = self.transport.capabilities
        group, device = caps.group, caps.collective_device()
        try:
            for same in dtype_groups(tlist):
                if len(same) == 1 and same[0].is_contiguous() and same[0].device == device:
                    dist.all_reduce(same[0], group=group)
                else:
                    flat = torch.cat([t.reshape(-1) for t in same]).to(device)
                    dist.all_reduce(flat, group=group)
                    parts = [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in same]), same)]
                    copy_all(same, parts)
                if op == "avg":
                    for t in same:
                        t.div_(self.transport.world_size)
        except RuntimeError as exc:
            raise native_failure(exc) from exc
        self.runs += 1
        return tensors if single else tlist


def native_failure(exc: BaseException) -> CommError:
    """The error for a failed ``torch.distributed.all_reduce`` (``exc``, the backend's)."""
    return CommError(f"torch.distributed.all_reduce failed (a peer left or timed out?): {exc}")


def copy_all(dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair: on a GPU one fused multi-tensor launch per few dozen pairs where the loop
    launches one kernel each (PowerSGD's many thin factors), elsewhere the plain loop."""
    if dests and dests[0].device.type == "cuda" and all(d.device == s.device for d, s in zip(dests, sources)):
        torch._foreach_copy_(list(dests), list(sources))
        return
    for d, s in zip(dests, sources):
        d.copy_(s)


def check_sharded(what: str, shard: torch.Tensor, full: torch.Tensor, world: int, *, big: str) -> None:
    """Validate a (shard, full) pair as torch.distributed's tensor collectives do, with messages naming the fix."""
    small = "output" if big == "input" else "input"
    for name, t in ((small, shard), (big, full)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} is a {type(t).__name__}; pass a torch.Tensor")
        if not t.is_contiguous():
            raise TypeError(f"{what}: {name} (shape {tuple(t.shape)}) is not contiguous; pass {name}.contiguous()")
    if shard.dtype != full.dtype or shard.device != full.device:
        raise TypeError(f"{what}: {small} is {shard.dtype} on {shard.device} but {big} is {full.dtype} on {full.device}; "
                        f"use one dtype and device")
    if full.numel() != world * shard.numel():
        raise GradsyncError(f"{what}: {big} has {full.numel()} elements but {small} has {shard.numel()}; {big} must "
                            f"have world_size({world}) x {shard.numel()} = {world * shard.numel()}")


def run_sharded(ex: Executor, shard: torch.Tensor, full: torch.Tensor, op: str | None) -> torch.Tensor:
    """Run a reduce-scatter (``op`` given: ``full`` -> ``shard``) or an allgather (``shard`` -> ``full``).

    The schedule's shards are in *schedule*-rank order and the caller's in process-rank order: schedule rank
    ``r`` runs on process ``proc_of[r]``, so the work buffer holds the caller's slice ``proc_of[r]`` at
    shard ``r`` (the identity without a mapping, when an allgather runs in ``full`` itself).
    """
    proc_of = ex.proc_of
    k = shard.numel()
    flat_full = full.view(-1)
    identity = proc_of == list(range(len(proc_of)))
    if op is not None:  # reduce-scatter: work on a copy, so the input is left as it was
        work = flat_full.clone() if identity else torch.cat([flat_full[p * k:(p + 1) * k] for p in proc_of])
        ex.run(work, op)
        lo, hi = ex.schedule.shard(ex.rank, work.numel())
        shard.view(-1).copy_(work[lo:hi])
        return shard
    if identity:
        work = flat_full
    else:
        work = torch.empty_like(flat_full)
    lo, hi = ex.schedule.shard(ex.rank, work.numel())
    work[lo:hi].copy_(shard.view(-1))
    ex.run(work)
    if not identity:
        for r, p in enumerate(proc_of):
            flat_full[p * k:(p + 1) * k].copy_(work[r * k:(r + 1) * k])
    return full


def dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split by dtype, in order of first appearance: a tensor collective moves one dtype."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def gather_torch(tensor: torch.Tensor, group: Any, world: int, equal_sizes: bool = False,
                 device: torch.device | None = None) -> list[torch.Tensor]:
    """Every rank's 1-D ``tensor`` on a process group, in rank order, on ``tensor``'s device.

    ``device``: where the backend takes its tensors (``Capabilities.collective_device()``: NCCL's GPU, gloo's
    host); a tensor elsewhere is staged there and the results are brought back. The sizes round runs there too
    and is read once on the host (one synchronisation; ``equal_sizes`` skips it).
    """
    import torch.distributed as dist

    home = tensor.device
    device = home if device is None else device
    src = tensor.to(device)
    if equal_sizes:
        out = [torch.empty_like(src) for _ in range(world)]
        if src.numel():
            dist.all_gather(out, src, group=group)
        return [o.to(home) for o in out]
    size = torch.tensor([src.numel()], dtype=torch.int64, device=device)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    dist.all_gather(list(sizes.split(1)), size, group=group)
    counts = [int(c) for c in sizes.tolist()]
    longest = max(counts)
    if longest == 0:
        return [tensor.new_zeros(0) for _ in range(world)]
    padded = src if src.numel() == longest else torch.cat([src, src.new_zeros(longest - src.numel())])
    out = [torch.empty(longest, dtype=src.dtype, device=device) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [o[:c].to(home) for o, c in zip(out, counts)]


def gather_p2p(tensor: torch.Tensor, transport: Transport, timeout_s: float, equal_sizes: bool = False) -> list[torch.Tensor]:
    rank, world = transport.rank, transport.world_size
    peers = [p for p in range(world) if p != rank]
    size = torch.tensor([tensor.numel()], dtype=torch.int64)  # host: metadata; a transport stages what it must
    sizes = {p: size.clone() if equal_sizes else torch.zeros(1, dtype=torch.int64) for p in peers}  # host
    handles = [] if equal_sizes else [transport.isend(size, p, 0) for p in peers] + [transport.irecv(sizes[p], p, 0) for p in peers]
    for h in handles:
        h.wait(timeout_s)
    out: list[torch.Tensor] = [tensor if p == rank else torch.empty(int(sizes[p].item()), dtype=tensor.dtype,
                                                                    device=tensor.device) for p in range(world)]
    handles = [transport.isend(tensor, p, 1) for p in peers if tensor.numel()]
    handles += [transport.irecv(out[p], p, 1) for p in peers if out[p].numel()]
    for h in handles:
        h.wait(timeout_s)
    return [o.clone() if p == rank else o for p, o in enumerate(out)]
