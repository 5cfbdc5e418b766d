"""gradsync's hooks in a 2-process CPU Lightning fit, through the documented recipe (GradsyncCallback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.dist_launch import ROOT, torchrun
from tests.integrations.trainer_checks import check_replicas

pytest.importorskip("lightning")


def test_plain_fp16_and_powersgd_hooks_run_in_a_two_process_lightning_fit_and_keep_replicas_identical(tmp_path):
    check_replicas(torchrun("tests/workers/trainer_worker.py", ["lightning", str(tmp_path)], 2, tmp_path))


def test_the_callback_checks_its_state_when_built_and_gradsync_imports_no_lightning_until_asked():
    code = (
        "import sys, gradsync, gradsync.integrations, gradsync.integrations.ddp\n"
        "assert 'lightning' not in sys.modules and 'accelerate' not in sys.modules\n"
        "from gradsync.integrations.lightning import GradsyncCallback\n"
        "import lightning.pytorch as L\n"
        "cb = GradsyncCallback()\n"
        "assert isinstance(cb, L.Callback) and cb.hook is gradsync.allreduce_hook and not cb.registered\n"
        "assert GradsyncCallback(gradsync.CompressionHookState('fp16')).hook is gradsync.compression_hook\n"
        "try:\n"
        "    GradsyncCallback(state='powersgd')\n"
        "except TypeError as exc:\n"
        "    assert 'CompressionHookState' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('a string state was accepted')\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
