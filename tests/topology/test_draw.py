"""gradsync.topology.draw leaves matplotlib's backend to the user (a notebook's stays) and still writes a PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_and_drawing_keep_the_users_backend(tmp_path):
    code = (
        "import sys, matplotlib\n"
        "matplotlib.use('svg')\n"  # the user's choice, made before gradsync is imported
        "import gradsync.topology.draw as d\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
        "from gradsync.topology import get_topology\n"
        f"out = d.draw(get_topology('p3.8xlarge'), {str(tmp_path / 'p3.png')!r})\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
        "assert out.read_bytes()[:4] == b'\\x89PNG'\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
