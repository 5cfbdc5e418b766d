"""MPITransport on real processes under the MPI launcher: dtypes and sizes, timeouts, the executor, dead peers.

Each test starts ``tests/workers/mpi_worker.py`` with :func:`gradsync.comm.mpi.mpirun_command` (the shared launcher
recipe) and checks that every rank reported ``OK``; a failing rank aborts the job and its traceback is shown.
Skipped with :func:`mpi_available`'s reason where mpi4py or a launcher is missing.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync.comm import mpi as gmpi
from gradsync.errors import GradsyncError

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests/workers/mpi_worker.py"
REASON = gmpi.mpi_available()
needs_mpi = pytest.mark.skipif(REASON is not None, reason=f"MPI unavailable: {REASON}")


def _mpirun(case: str, n: int, timeout_s: float = 150) -> tuple[subprocess.CompletedProcess, float]:
    """Run the worker's ``case`` on ``n`` ranks; kill the whole launch if it outlives ``timeout_s``."""
    cmd = gmpi.mpirun_command(n, [sys.executable, WORKER, case, str(n)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher forwards it to its ranks
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session started above for this launch only
        out, err = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` hung for {timeout_s:g} s\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - t0


#: Cases that share one launch per world size (each rank starting Python and torch is most of the cost).
SHARED = {2: "p2p,timeout", 3: "p2p,executor"}


@functools.cache
def _shared_launch(n: int) -> subprocess.CompletedProcess:
    return _mpirun(SHARED[n], n)[0]


def _run_case(case: str, n: int) -> None:
    """Assert that ``case`` passed on all ``n`` ranks of the shared launch for ``n``."""
    assert case in SHARED[n].split(",")
    res = _shared_launch(n)
    if res.returncode != 0 and f"OK {case} rank" in res.stdout:  # this case passed; a later one failed
        missing = [r for r in range(n) if f"OK {case} rank {r}" not in res.stdout]
        assert not missing, f"ranks {missing} did not finish {case}:\n{res.stderr[-6000:]}"
        return
    _assert_ok(res, case, n)


def _assert_ok(res: subprocess.CompletedProcess, case: str, n: int) -> None:
    missing = [r for r in range(n) if f"OK {case} rank {r}" not in res.stdout]
    if res.returncode != 0 or missing:
        raise AssertionError(
            f"`{' '.join(res.args)}` exited {res.returncode}; ranks without OK: {missing}\n"
            f"--- stdout ---\n{res.stdout[-4000:]}\n--- stderr ---\n{res.stderr[-6000:]}"
        )


# ---- no processes needed -------------------------------------------------------------------------------
def test_mpi_available_names_missing_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    reason = gmpi.mpi_available()
    assert reason is not None and "mpi4py" in reason


@needs_mpi
def test_launcher_recipe():
    prefix = gmpi.find_mpirun()
    assert Path(prefix[0]).is_file() and os.access(prefix[0], os.X_OK), prefix
    out = subprocess.run([prefix[0], "--version"], capture_output=True, text=True, timeout=30)
    if "open mpi" in (out.stdout + out.stderr).lower() and not os.environ.get("GRADSYNC_MPIRUN"):
        assert "--oversubscribe" in prefix
        assert ("--allow-run-as-root" in prefix) == (os.geteuid() == 0)
    cmd = gmpi.mpirun_command(3, ["python", "x.py"])
    assert cmd[: len(prefix)] == prefix and cmd[len(prefix):] == ["-n", "3", "python", "x.py"]
    with pytest.raises(GradsyncError, match="n=0"):
        gmpi.mpirun_command(0, ["python"])


# ---- under mpirun ----------------------------------------------------------------------------------------
@needs_mpi
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 3])
def test_messages_of_every_dtype_and_size_arrive_intact(n):
    """float32/64, bfloat16, float16, int32/64, uint8, bool x 0/1/7/100003 elements, reverse-order posting."""
    _run_case("p2p", n)


@needs_mpi
@pytest.mark.timeout(200)
def test_silent_peer_raises_peer_error_after_timeout():
    """Receive and rendezvous send with a 1 s timeout raise PeerError naming the peer in 1-3 s, not a hang."""
    _run_case("timeout", 2)


@needs_mpi
@pytest.mark.timeout(200)
def test_executor_runs_ring_ps_tree_on_mpi():
    """Executor + MPITransport on 3 processes: exact allreduce sums for ring, ps and tree on switch:3."""
    _run_case("executor", 3)


@needs_mpi
@pytest.mark.timeout(200)
def test_dead_peer_never_hangs_the_job():
    """A rank exits mid-run: the launch ends non-zero (Open MPI kills the job; with ULFM survivors name it)."""
    res, _ = _mpirun("dead", 2, timeout_s=120)
    text = res.stdout + res.stderr
    assert res.returncode != 0, text[-4000:]
    assert "Traceback" not in res.stderr, res.stderr[-6000:]
    assert "PeerError peer=1" in res.stdout or "exit" in text.lower(), text[-4000:]


def test_mpi_transport_without_mpi4py_says_what_is_missing(monkeypatch):
    from gradsync.comm.transport import TRANSPORTS, create_transport
    from gradsync.errors import CommError

    assert "mpi" in TRANSPORTS  # registered by gradsync.comm importing gradsync.comm.mpi, with no mpi4py loaded
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(CommError, match="transport 'mpi' needs a package that is not installed.*mpi4py"):
        create_transport("mpi")
