"""Horovod's ``broadcast_parameters`` and ``broadcast_optimizer_state``: every replica starts from rank root's values.

Both run ``torch.distributed.broadcast`` on the default runtime's process group (:func:`gradsync.get_runtime`),
queued on its communication thread like any gradsync collective (so they stay in order with allreduces in
flight). Tensors are broadcast one flat buffer per dtype on the group's device (``collective_device()``: a CUDA
tensor on gloo is staged through a host copy) and copied back in place. Every rank must pass the same tensors
(same count, shapes and dtypes, in the same order): a small check first makes a mismatch an error on every rank
instead of a hang.

The optimizer's state travels as a manifest written by rank root (JSON bytes, no pickle: the hyper-parameters
of each param group, each parameter's state keys with their scalars or tensor shapes), then its tensors; a rank
without some state (a fresh optimizer while root loaded a checkpoint) creates it from the manifest.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from gradsync.comm.runtime import Runtime, get_runtime
from gradsync.errors import GradsyncError

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int = 0, *,
                         runtime: Runtime | None = None) -> None:
    """Copy rank ``root_rank``'s values of ``params`` to every rank, in place.

    ``params``: a ``state_dict()`` (buffers included), ``named_parameters()``, or a list of tensors.
    """
    rt = runtime or get_runtime()
    _check_root(rt, root_rank)
    if isinstance(params, Mapping):
        items = list(params.items())
    else:
        items = [(x if isinstance(x, tuple) else (f"[{i}]", x)) for i, x in enumerate(params)]
    tensors = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise GradsyncError(f"broadcast_parameters: {name} is a {type(t).__name__}, not a tensor; pass a state_dict(), "
                                "named_parameters() or a list of tensors")
        tensors.append(t)
    _broadcast_tensors(rt, tensors, root_rank, "broadcast_parameters")


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0, *, runtime: Runtime | None = None) -> None:
    """Copy rank ``root_rank``'s optimizer state (every state tensor and scalar) and the param groups' hyper-parameters
    (``lr``, ``momentum``...) to every rank. ``optimizer``: a ``torch.optim.Optimizer`` or a ``DistributedOptimizer``."""
    opt = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a DistributedOptimizer, got {type(optimizer).__name__}")
    rt = runtime or get_runtime()
    _check_root(rt, root_rank)
    params = [p for g in opt.param_groups for p in g["params"]]
    shape = [len(g["params"]) for g in opt.param_groups]
    text = json.dumps(_manifest(opt, params)).encode() if rt.rank == root_rank else b""
    manifest = json.loads(_broadcast_bytes(rt, text, root_rank).decode())
    problem = ""
    if manifest["shape"] != shape:
        problem = (f"rank {rt.rank}'s optimizer has param groups of {shape} parameters but rank {root_rank}'s has "
                   f"{manifest['shape']}; build the same optimizer on every rank")
    _agree(rt, problem, "broadcast_optimizer_state")
    tensors: list[torch.Tensor] = []
    for i, key, desc in manifest["state"]:  # (param index, key, description)
        if "tensor" not in desc:
            continue
        dtype, size, cpu = getattr(torch, desc["tensor"]), tuple(desc["shape"]), desc["cpu"]
        state = opt.state[params[i]]
        t = state.get(key)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != size:
            device = torch.device("cpu") if cpu else params[i].device
            t = state[key] = torch.zeros(size, dtype=dtype, device=device)
        tensors.append(t)
    group_tensors = []
    for g, hyper in zip(opt.param_groups, manifest["groups"]):
        for key, desc in hyper.items():
            if "tensor" in desc:
                t = g.get(key)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(desc["shape"]):
                    device = torch.device("cpu") if desc["cpu"] or not g["params"] else g["params"][0].device
                    t = g[key] = torch.zeros(desc["shape"], dtype=getattr(torch, desc["tensor"]), device=device)
                group_tensors.append(t)
    _broadcast_tensors(rt, tensors + group_tensors, root_rank, "broadcast_optimizer_state")
    for i, key, desc in manifest["state"]:
        if "value" in desc:
            opt.state[params[i]][key] = _value(desc["value"], opt.state[params[i]].get(key))
    for g, hyper in zip(opt.param_groups, manifest["groups"]):
        for key, desc in hyper.items():
            if "value" in desc:
                g[key] = _value(desc["value"], g.get(key))


# ---- helpers -------------------------------------------------------------------------------------------------
def _check_root(rt: Runtime, root_rank: int) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < rt.world_size:
        raise GradsyncError(f"root_rank={root_rank!r} must be a rank of the job, 0..{rt.world_size - 1}")
    if not rt.caps.native:
        raise GradsyncError("broadcast needs a torch.distributed process group (gloo or nccl); this runtime's transport "
                            "has none: start the job with torch.distributed (gradsync.init() under torchrun)")


def _describe(key: str, value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "cpu": value.device.type == "cpu"}
    if _plain(value):
        return {"value": value}
    raise GradsyncError(f"broadcast_optimizer_state: {where} {key!r} is a {type(value).__name__}; only tensors, numbers, "
                        "strings, None and tuples of them can be broadcast")


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def _value(value: Any, like: Any) -> Any:
    """A JSON value back as Python: lists become tuples where the local value was one (Adam's ``betas``)."""
    if isinstance(value, list) and not isinstance(like, list):
        return tuple(value)
    return value


def _manifest(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, Any]:
    index = {id(p): i for i, p in enumerate(params)}
    groups = [{k: _describe(k, v, "param group value") for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = []
    for p in params:
        for key, value in opt.state.get(p, {}).items():
            state.append([index[id(p)], key, _describe(key, value, "optimizer state")])
    return {"shape": [len(g["params"]) for g in opt.param_groups], "groups": groups, "state": state}


def _broadcast_bytes(rt: Runtime, data: bytes, root: int) -> bytes:
    """Rank root's ``data`` on every rank (its length first)."""
    size = torch.tensor([len(data)], dtype=torch.int64)  # host: a length; the broadcast stages it
    _broadcast_tensors(rt, [size], root, "broadcast", check=False)
    if rt.rank == root:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.zeros(int(size), dtype=torch.uint8)  # host: the manifest's bytes, read on the host
    _broadcast_tensors(rt, [buf], root, "broadcast", check=False)
    return bytes(buf.tolist()) if rt.rank != root else data


def _agree(rt: Runtime, problem: str, what: str) -> None:
    """Raise on every rank if ``problem`` is set on any (one allreduce of a flag)."""
    flag = torch.tensor([1.0 if problem else 0.0], dtype=torch.float64)  # host: the collective stages it
    rt.allreduce(flag, "sum")
    if int(flag):
        raise GradsyncError(f"{what}: {problem or 'another rank passes different tensors or optimizer (its error says which); pass the same tensors on every rank'}")


def _broadcast_tensors(rt: Runtime, tensors: list[torch.Tensor], root: int, what: str, *, check: bool = True) -> None:
    if check:
        sig = zlib.crc32(repr([(str(t.dtype), tuple(t.shape)) for t in tensors]).encode())
        here = torch.tensor([len(tensors), sum(t.numel() for t in tensors), sig], dtype=torch.int64)  # host: a check
        mine = here.clone()
        _broadcast_tensors(rt, [here], root, what, check=False)
        problem = ""
        if not torch.equal(here, mine):
            problem = (f"rank {rt.rank} passes {int(mine[0])} tensors of {int(mine[1])} elements but rank {root} passes "
                       f"{int(here[0])} of {int(here[1])} (or other shapes or dtypes); pass the same tensors on every rank")
        _agree(rt, problem, what)
    if not tensors:
        return

    def job() -> None:
        import torch.distributed as dist

        group, device = rt.caps.group, rt.device
        src = dist.get_global_rank(group, root) if group is not None and group != dist.group.WORLD else root
        kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            kinds.setdefault((t.dtype, t.device), []).append(t)
        for (dtype, _), same in kinds.items():
            if len(same) == 1 and same[0].is_contiguous() and same[0].device == device and dtype != torch.bool:
                dist.broadcast(same[0].detach(), src=src, group=group)
                continue
            # one buffer per dtype and device, on the backend's device (bool travels as uint8)
            flat = torch.cat([t.detach().reshape(-1) for t in same]).to(device, torch.uint8 if dtype == torch.bool else dtype)
            dist.broadcast(flat, src=src, group=group)
            if rt.rank != root:
                offset = 0
                for t in same:
                    with torch.no_grad():
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    rt.submit(job, what).wait()
