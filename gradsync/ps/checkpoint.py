"""A parameter server's checkpoint file: every slot (value, version, optimizer state), the update rule, the
job and the authenticated sessions, written atomically (tmp file, fsync, rename) and read back.

The file is an ``.npz`` of raw bytes plus a JSON index (``meta``), read with ``allow_pickle=False``: nothing in
it can run code. :class:`gradsync.ps.server.Server` decides when to write one and what to do with one it reads.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gradsync.errors import GradsyncError
from gradsync.ps.slot import Slot
from gradsync.ps.updaters import Updater, create_updater, describe
from gradsync.ps.wire import DTYPES, Key

__all__ = ["Restored", "read_checkpoint", "write_checkpoint"]

_CODES = {dt: c for c, dt in DTYPES.items()}


@dataclass
class Restored:
    """What a checkpoint holds: the job it served (0: none yet), its sessions' last seq, rule and slots."""

    job: int
    sessions: dict[int, int]
    updater: Updater | None
    slots: dict[tuple[Key, int], Slot]


def write_checkpoint(path: Path, slots: dict[tuple[Key, int], Slot], *, server_id: int, updater: Updater | None,
                     job: int, sessions: dict[int, int]) -> None:
    """Write ``slots`` and the rest to ``path`` atomically: tmp file, fsync, rename, fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    index = []
    for i, ((key, part), s) in enumerate(slots.items()):
        arrays[f"v{i}"] = _raw(s.value)
        for name, t in s.state.items():
            arrays[f"s{i}_{name}"] = _raw(t)
        index.append({"key": key, "int_key": isinstance(key, int), "part": part, "parts": s.parts,
                      "offset": s.offset, "shape": list(s.shape), "dtype": _CODES[s.value.dtype],
                      "numel": s.value.numel(), "sync": s.sync, "pushers": s.pushers, "version": s.version,
                      "elastic": s.elastic, "members": sorted(s.members), "last_pushed": s.last_pushed,
                      "last_seq": {str(k): v for k, v in s.last_seq.items()},
                      "state": {n: [_CODES[t.dtype], list(t.shape)] for n, t in s.state.items()}})
    meta = {"format": "gradsync-ps-checkpoint", "version": 1, "server": server_id,
            "updater": describe(updater) if updater else None, "slots": index, "job": job,
            "sessions": {str(k): v for k, v in sessions.items()}}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk, an interrupt: the last complete checkpoint stays, alone
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_checkpoint(path: Path, server_id: int, job: int = 0) -> Restored | None:
    """The checkpoint at ``path`` (None when there is none), after removing a predecessor's partial writes.
    ``job``: the job the server was told to serve; when 0, the checkpoint's job is restored."""
    # a predecessor killed mid-write (SIGKILL, power) left its partial file; the renamed one is whole
    for stale in path.parent.glob(f"{path.stem}.tmp*"):
        stale.unlink(missing_ok=True)
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if not isinstance(meta, dict) or meta.get("format") != "gradsync-ps-checkpoint":
                raise ValueError("its index does not name the gradsync-ps-checkpoint format")
            if not job:  # a job restarted by `gradsync launch` has a new id and keeps it
                job = int(meta.get("job", 0))
            sessions = {int(k): int(v) for k, v in meta.get("sessions", {}).items()}
            up = meta.get("updater")
            updater = create_updater(up.pop("name"), **up) if up else None
            slots: dict[tuple[Key, int], Slot] = {}
            for i, e in enumerate(meta["slots"]):
                key: Key = int(e["key"]) if e["int_key"] else str(e["key"])
                value = _unraw(z[f"v{i}"], e["dtype"], [e["numel"]])
                state = {n: _unraw(z[f"s{i}_{n}"], code, shape) for n, (code, shape) in e["state"].items()}
                slots[(key, int(e["part"]))] = Slot(
                    value=value, shape=tuple(e["shape"]), offset=int(e["offset"]), parts=int(e["parts"]),
                    sync=bool(e["sync"]), pushers=int(e["pushers"]), version=int(e["version"]),
                    elastic=bool(e.get("elastic", False)), members={int(m) for m in e.get("members", [])},
                    last_pushed=int(e.get("last_pushed", 0)),
                    last_seq={int(k): int(v) for k, v in e["last_seq"].items()}, state=state)
    except GradsyncError:
        raise
    # an empty, truncated or foreign file: numpy and zipfile raise any of these (EOFError for an empty one,
    # BadZipFile for a cut one, IndexError/AttributeError for a plain .npy array in place of the archive)
    except (OSError, EOFError, zipfile.BadZipFile, KeyError, IndexError, ValueError, TypeError, AttributeError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise GradsyncError(f"cannot restore server {server_id} from {path}: {why} (not a whole gradsync "
                            f"checkpoint); move the file away to start empty") from None
    return Restored(job, sessions, updater, slots)


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def _unraw(a: np.ndarray, code: int, shape: list[int]) -> torch.Tensor:
    dtype = DTYPES[int(code)]
    flat = torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint8).copy())
    if flat.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return flat.view(dtype).reshape(shape).clone()
