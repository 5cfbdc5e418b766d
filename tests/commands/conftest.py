"""Shared helpers for the subcommands' end-to-end tests."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync", *args], capture_output=True, text=True, cwd=cwd, timeout=120)
