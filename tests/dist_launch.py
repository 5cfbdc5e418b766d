"""Launch a worker script once per rank with torchrun's environment and collect what each rank reports.

Built on gradsync.launch's environment (no ``torch.testing._internal``), but each rank's output goes to
its own log file so a failure message can show the failing rank's stderr, and each rank's JSON report is
collected for the test to assert on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradsync.launch import free_port, torchrun_env
from tests import zygote

ROOT = Path(__file__).resolve().parent.parent


def launch(script: str, args: list[str], world: int, out_dir: Path, timeout_s: float = 240,
           allow_exit: dict[int, int] | None = None) -> list[dict | None]:
    """Run ``python script *args`` on ``world`` ranks; return each rank's ``rank{r}.json`` (None if absent).

    Each rank is forked from a zygote that has imported torch and gradsync already (tests/zygote.py), or started
    as a fresh interpreter where the zygotes are off.

    ``allow_exit`` maps ranks to the exit code they are expected to end with (a killed rank); every other
    rank must exit 0.
    """
    port = free_port()
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    logs = []
    envs = [torchrun_env(r, world, "127.0.0.1", port, base) for r in range(world)]
    argv = [str(ROOT / script), *args]
    deadline = time.monotonic() + timeout_s
    try:  # the ranks started so far end with the launch, whatever stops it (a zygote that fails to fork included)
        zygote.prepare(envs)
        for r, env in enumerate(envs):
            log = open(out_dir / f"rank{r}.log", "w+")
            logs.append(log)
            proc = zygote.spawn(r, argv, env, ROOT, out_dir / f"rank{r}.log")
            procs.append(proc or subprocess.Popen([sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  cwd=ROOT))
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    expected = allow_exit or {}
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != expected.get(r, 0)]
    if bad:
        text = []
        for r, code in bad:
            logs[r].seek(0)
            text.append(f"--- rank {r} exited {code} ---\n{logs[r].read()[-3000:]}")
        raise AssertionError("worker ranks failed:\n" + "\n".join(text))
    for log in logs:
        log.close()
    out = []
    for r in range(world):
        f = out_dir / f"rank{r}.json"
        out.append(json.loads(f.read_text()) if f.exists() else None)
    return out


def torchrun(script: str, args: list[str], world: int, out_dir: Path, timeout_s: float = 240) -> list[dict | None]:
    """Run ``script`` on ``world`` ranks under torch's own launcher (``python -m torch.distributed.run --standalone``,
    what ``torchrun`` is), as a user launches a trainer; return each rank's ``rank{r}.json`` (None if absent)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / script), *args]
    with open(out_dir / "torchrun.log", "w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # torchrun and its workers: the group this test started
            proc.wait()
            code = None
        if code != 0:
            log.seek(0)
            raise AssertionError(f"torchrun {script} {args} exited {code}:\n{log.read()[-4000:]}")
    out = []
    for r in range(world):
        f = out_dir / f"rank{r}.json"
        out.append(json.loads(f.read_text()) if f.exists() else None)
    return out


# ---- worker side ----------------------------------------------------------------------------------------------
def counting_native(rt: Any) -> tuple[Callable[..., Any], list[bool]]:
    """A stand-in for ``rt.native_allreduce_async`` that calls it and records whether each call took the native
    path, and that record; the caller installs it (``rt.native_allreduce_async = counting``)."""
    native = rt.native_allreduce_async
    taken: list[bool] = []

    def counting(tensor: Any, algorithm: str | None = None, *, always: bool = False) -> Any:
        fut = native(tensor, algorithm, always=always)
        taken.append(fut is not None)
        return fut

    return counting, taken


def run_scenario(scenarios: dict[str, Callable[..., Any]], rank: int) -> None:
    """A worker's entry point: ``argv = NAME OUT_DIR ARGS...`` runs ``scenarios[NAME](*ARGS)`` with one intra-op
    thread and writes its JSON result to ``OUT_DIR/rank<rank>.json``, then leaves without gloo's teardown (a dead
    peer can make ``destroy_process_group`` hang)."""
    import torch

    torch.set_num_threads(1)
    name, out_dir, *rest = sys.argv[1:]
    result = scenarios[name](*rest)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)


def run_outside_a_launcher(script: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -c script args`` in a fresh interpreter with none of torchrun's variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): what a script sees before a trainer has made its process group."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s, cwd=str(ROOT))
