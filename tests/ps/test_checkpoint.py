"""Checkpoint files that cannot be read (gradsync.ps.checkpoint): an empty, truncated, bare-header or foreign
file is one clear error naming it, and the server's command line exits 2 with that one line (issue 42)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gradsync.errors import GradsyncError
from gradsync.ps.checkpoint import read_checkpoint, write_checkpoint
from gradsync.ps.slot import Slot

ROOT = Path(__file__).resolve().parents[2]


def _whole() -> bytes:
    buf = io.BytesIO()
    slots = {("w", 0): Slot(value=torch.arange(1000, dtype=torch.float32), shape=(1000,), offset=0, parts=1,
                            sync=True, pushers=1, version=3)}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gradsync-ckpt-{os.getpid()}" / "server-0.npz"
    write_checkpoint(path, slots, server_id=0, updater=None, job=1, sessions={})
    buf.write(path.read_bytes())
    path.unlink()
    path.parent.rmdir()
    return buf.getvalue()


def _bare_header() -> bytes:
    """A zip whose only entry is announced by its local header, with no central directory."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("meta.npy", b"")
    return buf.getvalue()[:30]


def _npy() -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.arange(4))
    return buf.getvalue()


def _json_list_meta() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(b"[1, 2]", dtype=np.uint8))
    return buf.getvalue()


BAD = {"empty": lambda: b"", "truncated": lambda: _whole()[:len(_whole()) // 2], "bare header": _bare_header,
       "one npy array": _npy, "meta not an object": _json_list_meta, "text": lambda: b"not a checkpoint\n"}


def test_a_whole_checkpoint_reads_back(tmp_path: Path) -> None:
    (tmp_path / "server-0.npz").write_bytes(_whole())
    restored = read_checkpoint(tmp_path / "server-0.npz", 0)
    assert restored is not None and restored.job == 1
    assert torch.equal(restored.slots[("w", 0)].value, torch.arange(1000, dtype=torch.float32))


@pytest.mark.parametrize("kind", sorted(BAD))
def test_unreadable_checkpoint_is_one_clear_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "server-0.npz"
    path.write_bytes(BAD[kind]())
    with pytest.raises(GradsyncError) as e:
        read_checkpoint(path, 0)
    message = str(e.value)
    assert message.startswith(f"cannot restore server 0 from {path}: ") and "move the file away" in message
    assert "\n" not in message, message


def test_server_with_an_unreadable_checkpoint_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "server-0.npz").write_bytes(BAD["truncated"]())
    p = subprocess.run([sys.executable, "-m", "gradsync.ps.server", "--checkpoint-dir", str(tmp_path)],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("gradsync-ps: cannot restore server 0 from "), p.stderr
    assert "Traceback" not in p.stderr and "listening" not in p.stdout
