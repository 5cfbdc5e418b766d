"""The documentation cannot drift from the code (issue 38, item 7).

* README.md starts with the two set-up commands;
* every python block in README.md and docs/*.md parses, and every ``gradsync`` name it uses exists: imports,
  attribute chains, keyword arguments of gradsync's callables, and methods called on the objects they return;
* README.md's python examples run, in one process (a gloo world of one);
* every ``gradsync ...`` command line in a bash block names a real subcommand and real options;
* relative links and their anchors resolve;
* docs/benchmarks.md is what docs/generate_benchmarks.py makes from benchmarks/results/*.json.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
SETUP = [
    "```bash",
    "make demo   # creates .venv, installs gradsync (+ torch==2.13.0 CPU if none), runs `gradsync demo` (~2 min)",
    "make test   # same install, then runs the whole test suite (pytest)",
    "```",
]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path, lang: str) -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(path.read_text()) if m.group(1) == lang]


def page_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ---- README's start ---------------------------------------------------------------------------------------
def test_readme_starts_with_the_two_setup_commands() -> None:
    lines = README.read_text().splitlines()
    assert lines[0] == "# gradsync" and lines[1] == ""
    assert lines[2:6] == SETUP, "README.md must open with `make demo` and `make test`, exactly as before"
    assert 150 <= len(lines) <= 250, f"README.md has {len(lines)} lines; keep it an overview (details go to docs/)"


# ---- python blocks: names ---------------------------------------------------------------------------------
def _resolve(dotted: str) -> Any:
    """Import the longest importable prefix of ``dotted`` and getattr the rest; AttributeError names what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, name in enumerate(parts[i:], start=i):
            if not hasattr(obj, name):
                raise AttributeError(f"{'.'.join(parts[:j])} has no attribute {name!r}")
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"cannot import any prefix of {dotted}")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _returns(func: Any) -> Any:
    """What calling ``func`` gives, as a type to check attributes on (None: unknown)."""
    if inspect.isclass(func):
        return func
    try:
        hint = typing.get_type_hints(func).get("return")
    except Exception:
        return None
    return hint if inspect.isclass(hint) else None


def _instance_attributes(cls: type) -> set[str]:
    """What an instance of ``cls`` has: class attributes, annotated fields and ``self.x = ...`` in its methods."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
        with contextlib.suppress(OSError, TypeError, SyntaxError):
            tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(klass)))
            names |= {t.attr for t in ast.walk(tree) if isinstance(t, ast.Attribute)
                      and isinstance(t.value, ast.Name) and t.value.id == "self" and isinstance(t.ctx, ast.Store)}
    return names


class _Checker(ast.NodeVisitor):
    """Binds names imported from gradsync (and variables assigned from gradsync calls) and checks their uses."""

    def __init__(self) -> None:
        self.known: dict[str, str] = {}     # local name -> dotted gradsync path
        self.typed: dict[str, Any] = {}     # local variable -> the class of the object it holds
        self.errors: list[str] = []

    def _path(self, node: ast.AST) -> str | None:
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in self.known:
            return self.known[head] + (f".{rest}" if rest else "")
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "gradsync":
                self._check(alias.name)
                if alias.asname:
                    self.known[alias.asname] = alias.name
                else:
                    self.known["gradsync"] = "gradsync"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] == "gradsync":
            for alias in node.names:
                self._check(f"{node.module}.{alias.name}")
                self.known[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        path = self._path(node)
        if path is not None:
            self._check(path)
        elif isinstance(node.value, ast.Name) and node.value.id in self.typed:
            cls = self.typed[node.value.id]
            if node.attr not in _instance_attributes(cls):
                self.errors.append(f"{node.value.id}.{node.attr}: {cls.__qualname__} has no attribute {node.attr!r}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        path = self._path(node.func)
        if path is not None:
            func = self._check(path)
            if func is not None and callable(func):
                self._check_keywords(path, func, node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        if isinstance(node.value, ast.Call) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            path = self._path(node.value.func)
            if path is not None:
                with contextlib.suppress(Exception):
                    cls = _returns(_resolve(path))
                    if cls is not None:
                        self.typed[node.targets[0].id] = cls

    def _check(self, path: str) -> Any:
        try:
            return _resolve(path)
        except (AttributeError, ImportError) as exc:
            self.errors.append(f"{path}: {exc}")
            return None

    def _check_keywords(self, path: str, func: Any, node: ast.Call) -> None:
        try:
            sig = inspect.signature(func)
        except (TypeError, ValueError):
            return
        params = sig.parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        for kw in node.keywords:
            if kw.arg is not None and kw.arg not in params:
                self.errors.append(f"{path}(... {kw.arg}=...): no such parameter; it takes {list(params)}")


PY_BLOCKS = [(page_id(p), i, code) for p in PAGES for i, code in enumerate(blocks(p, "python"))]


@pytest.mark.parametrize(("page", "index", "code"), PY_BLOCKS, ids=[f"{p}#{i}" for p, i, _ in PY_BLOCKS])
def test_python_block_uses_names_that_exist(page: str, index: int, code: str) -> None:
    tree = ast.parse(code, filename=f"{page} python block {index}")
    checker = _Checker()
    checker.visit(tree)
    assert not checker.errors, f"{page} python block {index}:\n" + "\n".join(checker.errors)


def test_readme_has_the_three_examples() -> None:
    code = "\n".join(blocks(README, "python"))
    for name in ("gradsync.allreduce_hook", "gradsync.GradsyncHookState", "gradsync.DistributedOptimizer",
                 "gradsync.kvstore.create("):
        assert name in code, f"README.md's examples no longer show {name}"


# ---- README's examples run ----------------------------------------------------------------------------------
_RUNNER = """
import sys, gradsync
for i, code in enumerate(sys.argv[1:]):
    exec(compile(code, f"README.md python block {i}", "exec"), {"__name__": "__main__"})
    if gradsync.is_initialized():
        gradsync.shutdown()
    print(f"block {i} ran")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_examples_run(tmp_path: Path) -> None:
    """Each README python block as a script of a one-process job, as `gradsync run -n 1` would start it."""
    codes = blocks(README, "python")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "GRADSYNC_CACHE": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("GRADSYNC_TOPOLOGY", None)
    proc = subprocess.run([sys.executable, "-c", _RUNNER, *codes], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, f"README.md's examples failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count(" ran") == len(codes)


# ---- command lines --------------------------------------------------------------------------------------------
def _help(argv: list[str]) -> str:
    from gradsync.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def _commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for code in blocks(page, "bash"):
            for line in code.splitlines():
                for part in line.split("#")[0].split("&&"):
                    part = part.strip()
                    if part.startswith("gradsync "):
                        found.append((page_id(page), part))
    return found


COMMANDS = _commands()


def test_every_page_command_is_checked() -> None:
    assert len(COMMANDS) > 20


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_command_line_exists(page: str, line: str) -> None:
    words = shlex.split(line)[1:]
    if "--" in words:  # the worker command after `--` is not gradsync's
        words = words[: words.index("--")]
    top = _help([])
    assert words and re.search(rf"^\s+{re.escape(words[0])}\s", top, re.M), f"{page}: no subcommand in {line!r}"
    path = [words[0]]
    if words[0] == "bench":  # options after the benchmark's name are the benchmark's own
        return
    sub = _help(path)
    if words[0] == "testbed" and len(words) > 1:
        path.append(words[1])
        sub = _help(path)
        assert "usage: gradsync testbed " + words[1] in sub, f"{page}: no testbed action {words[1]!r} in {line!r}"
    for word in words[len(path):]:
        if word.startswith("-") and word != "-":
            flag = word.split("=")[0]
            assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", sub), f"{page}: {' '.join(path)} has no {flag} ({line!r})"


# ---- links -------------------------------------------------------------------------------------------------------
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for title in re.findall(r"^#+\s+(.*)$", text, re.M):
        out.add("".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_").replace(" ", "-"))
    return out


def test_links_resolve() -> None:
    bad = []
    for page in PAGES:
        for target in _LINK.findall(_FENCE.sub("", page.read_text())):
            if re.match(r"^[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page_id(page)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page_id(page)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_references_have_the_seed_anchors() -> None:
    anchors = _anchors(DOCS / "references.md")
    assert {f"seed-00{i}" for i in range(5)} <= anchors


# ---- generated benchmarks page -----------------------------------------------------------------------------
def test_benchmarks_page_is_generated_from_the_results() -> None:
    spec = importlib.util.spec_from_file_location("generate_benchmarks", DOCS / "generate_benchmarks.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "benchmarks.md").read_text() == gen.render(), (
        "docs/benchmarks.md is stale: run python docs/generate_benchmarks.py")
