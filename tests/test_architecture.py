"""The package layers hold (``[tool.importlinter]`` in pyproject.toml), the contract bites, and ``import gradsync`` stays light.

``lint-imports`` runs in a subprocess on the real tree, and on a temporary copy with a throwaway module that
imports upward, which must fail the contract (the copy, never the real tree, gets the bad module).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
#: What ``import gradsync`` must not load: each is loaded where a name that needs it is first used.
HEAVY = ("torch", "zmq", "mpi4py", "matplotlib", "scipy")


def _run(code: str, *args: str, root: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return _run(LINT_IMPORTS, "--no-cache", "--config", str(root / "pyproject.toml"), root=root)


def test_layer_contracts_hold():
    p = _lint_imports(ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout


UPWARD = {
    # an algorithm package importing the training layer at module level
    "module-level": ("topology", "from gradsync.train import optimizer  # noqa: F401\n", "gradsync.train"),
    # an engine importing training code inside a function: counted all the same
    "function-local": ("ps", "def f():\n    from gradsync.train import hooks\n\n    return hooks\n", "gradsync.train"),
    # an algorithm reaching into an engine only for type checking: counted all the same
    "type-checking": ("compress",
                      "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from gradsync.comm.runtime import Runtime\n",
                      "gradsync.comm"),
}


@pytest.mark.parametrize("case", list(UPWARD))
def test_an_upward_import_breaks_the_contract(tmp_path, case):
    package, source, target = UPWARD[case]
    shutil.copytree(ROOT / "gradsync", tmp_path / "gradsync", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "gradsync" / package / "_upward_probe.py").write_text(source)
    p = _lint_imports(tmp_path)
    assert p.returncode != 0, p.stdout[-4000:]
    assert "BROKEN" in p.stdout
    assert f"gradsync.{package}._upward_probe -> {target}" in p.stdout, p.stdout[-4000:]


def test_import_gradsync_loads_no_heavy_package():
    code = ("import json, sys; import gradsync; "
            f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))")
    p = _run(code)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_runtime_names_load_on_first_use():
    """``gradsync.DistributedOptimizer`` brings torch but not the parameter server's ZeroMQ;
    ``gradsync.kvstore.create`` works with no second import."""
    code = ("import json, sys; import gradsync; opt = gradsync.DistributedOptimizer; hook = gradsync.allreduce_hook; "
            "before = 'zmq' in sys.modules; create = gradsync.kvstore.create; "
            "print(json.dumps([opt.__module__, hook.__module__, create.__module__, 'torch' in sys.modules, before]))")
    p = _run(code)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == ["gradsync.train.optimizer", "gradsync.train.hooks", "gradsync.ps.kvstore", True, False]


def test_train_names_are_not_hidden_by_its_modules():
    """A submodule named like an exported function would replace it once imported (``compression_hook``)."""
    import importlib
    import pkgutil
    import types

    import gradsync.train as train

    for info in pkgutil.iter_modules(train.__path__):
        importlib.import_module(f"gradsync.train.{info.name}")
    for name in train.__all__:
        assert not isinstance(getattr(train, name), types.ModuleType), name
