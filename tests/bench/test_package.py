"""The ``benchmarks`` package and the ``gradsync bench`` registry: every registered benchmark resolves to an
importable module (or, without a checkout, to a clear 'needs a checkout' error), and the benchmark modules import
each other as ``benchmarks.x``, without cycles and without touching ``sys.path``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

import gradsync.sim.bench as registry
from gradsync.errors import GradsyncError
from gradsync.sim.bench import BENCHMARKS, CHECKOUT_PACKAGE

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _benchmark_imports(path: Path) -> set[str]:
    """The benchmark modules ``path`` imports, anywhere in it (inside functions too): ``benchmarks.x``,
    ``from benchmarks import x``, relative imports, and bare names of sibling modules."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y / from . import x
                names = [f"benchmarks.{node.module}"] if node.module else [f"benchmarks.{a.name}" for a in node.names]
            elif node.module == "benchmarks":
                names = [f"benchmarks.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            head, _, rest = name.partition(".")
            if head == "benchmarks" and rest:
                found.add(rest.split(".")[0])
            elif head in MODULES and head not in sys.stdlib_module_names:
                found.add(f"<bare {head}>")
    return found


def test_every_registered_benchmark_resolves_to_a_module_function() -> None:
    before = list(sys.path)
    for name, bench in BENCHMARKS.items():
        module, _, func = bench.target.rpartition(":")
        if bench.checkout:
            assert module.startswith(f"{CHECKOUT_PACKAGE}.") and module.split(".")[1] in MODULES, name
        else:
            assert module.startswith("gradsync."), f"{name}: ships with gradsync, so its module must be gradsync's"
        fn = bench.load()
        assert callable(fn) and fn.__name__ == func and fn.__module__ == module, name
    assert sys.path == before  # loading a benchmark never edits sys.path


def test_every_benchmark_module_imports_and_leaves_sys_path_alone() -> None:
    before = list(sys.path)
    for stem in MODULES:
        module = importlib.import_module(f"benchmarks.{stem}")
        assert Path(module.__file__).resolve() == PACKAGE / f"{stem}.py"
        assert sys.path == before, f"importing benchmarks.{stem} edited sys.path"


def test_no_benchmark_module_touches_sys_path_or_imports_a_sibling_by_bare_name() -> None:
    for stem in ["__init__", *MODULES]:
        path = PACKAGE / f"{stem}.py"
        tree = ast.parse(path.read_text(), str(path))
        touches = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
                   and isinstance(n.value, ast.Name) and n.value.id == "sys"]
        assert not touches, f"benchmarks/{stem}.py uses sys.path (line {touches[0]}); import benchmarks.x instead"
        bare = sorted(i for i in _benchmark_imports(path) if i.startswith("<bare"))
        assert not bare, f"benchmarks/{stem}.py imports {bare}; write benchmarks.x"


def test_benchmark_modules_import_each_other_without_cycles() -> None:
    graph = {stem: _benchmark_imports(PACKAGE / f"{stem}.py") for stem in MODULES}
    assert not graph["common"], f"benchmarks.common is the bottom layer; it imports {sorted(graph['common'])}"
    assert all(dep in graph for deps in graph.values() for dep in deps), graph
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("benchmark modules import each other in a cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for stem in MODULES:
        if stem not in state:
            visit(stem, [stem])


def test_worker_modules_run_with_dash_m_from_the_checkout() -> None:
    workers = [stem for stem in MODULES if stem.endswith("_worker")]
    assert workers
    for stem in workers:
        spec = importlib.util.find_spec(f"benchmarks.{stem}")
        assert spec is not None and Path(spec.origin).resolve() == PACKAGE / f"{stem}.py"


@pytest.fixture
def no_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """gradsync as if installed without its checkout: no ``benchmarks/`` beside it, none imported or on sys.path."""
    monkeypatch.setattr(registry, "_ROOT", tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    for name in [m for m in sys.modules if m == CHECKOUT_PACKAGE or m.startswith(f"{CHECKOUT_PACKAGE}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_without_a_checkout_a_checkout_benchmark_says_so_and_names_the_fix(no_checkout: Path) -> None:
    for name, bench in BENCHMARKS.items():
        if not bench.checkout:
            continue
        module = bench.target.rpartition(":")[0]
        with pytest.raises(GradsyncError) as err:
            bench.load()
        message = str(err.value)
        assert f"benchmark {name!r} needs a gradsync source checkout" in message
        assert "git clone" in message and "pip install -e ." in message and f"python -m {module}" in message
        assert CHECKOUT_PACKAGE not in sys.modules


def test_without_a_checkout_the_shipped_benchmark_still_loads(no_checkout: Path) -> None:
    shipped = [b for _, b in BENCHMARKS.items() if not b.checkout]
    assert [b.name for b in shipped] == ["sim-scaling"]
    assert callable(shipped[0].load())


def test_another_benchmarks_package_is_refused(no_checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``benchmarks`` package imported from elsewhere is not run in the checkout's place."""
    (no_checkout / CHECKOUT_PACKAGE).mkdir()
    (no_checkout / CHECKOUT_PACKAGE / "__init__.py").write_text("")
    other = types.ModuleType(CHECKOUT_PACKAGE)
    other.__path__ = [str(no_checkout / "elsewhere" / CHECKOUT_PACKAGE)]
    monkeypatch.setitem(sys.modules, CHECKOUT_PACKAGE, other)
    with pytest.raises(GradsyncError, match="is not the one of the gradsync checkout"):
        BENCHMARKS.get("plan-scaling").load()
