"""Checks on the files a command will write, made before any work so a typo costs no planning time, and
bounds on the files it reads (size, nesting depth, YAML alias expansion), so that a hostile or mistaken
input file is refused at once with the limit named instead of running for minutes or ending in a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from gradsync.env import env_number
from gradsync.errors import GradsyncError

__all__ = ["check_output", "write_text", "read_input", "parse_json", "parse_yaml", "MAX_INPUT_BYTES_ENV",
           "MAX_INPUT_DEPTH", "MAX_INPUT_DEPTH_ENV", "MAX_INPUT_VALUES", "MAX_INPUT_VALUES_ENV"]

#: overrides the largest input file read (bytes; each loader has its own default)
MAX_INPUT_BYTES_ENV = "GRADSYNC_MAX_INPUT_BYTES"
#: deepest nesting of lists and mappings in an input file (real topologies and schedules nest 4 or 5 deep)
MAX_INPUT_DEPTH = 64
MAX_INPUT_DEPTH_ENV = "GRADSYNC_MAX_INPUT_DEPTH"
#: most values a YAML document may hold once its aliases are expanded (a "billion laughs" holds 10^9)
MAX_INPUT_VALUES = 2_000_000
MAX_INPUT_VALUES_ENV = "GRADSYNC_MAX_INPUT_VALUES"


def check_output(path: str | os.PathLike[str] | None, option: str) -> None:
    """Refuse ``path`` (given as ``option``) if it is a directory or its directory is missing or read-only."""
    if path is None or str(path) == "":
        return
    p = Path(path)
    if p.is_dir():
        raise GradsyncError(f"{option} {str(p)!r} is a directory; give a file name inside it, e.g. {p / 'out.json'}")
    parent = p.parent
    if not parent.is_dir():
        raise GradsyncError(f"{option} {str(p)!r}: directory {str(parent)!r} does not exist; create it first "
                            f"(mkdir -p {parent}) or write somewhere else")
    if not os.access(parent, os.W_OK):
        raise GradsyncError(f"{option} {str(p)!r}: directory {str(parent)!r} is not writable; write somewhere else")


def write_text(path: str | os.PathLike[str], text: str, what: str, error: type[GradsyncError] = GradsyncError) -> Path:
    """Write ``text`` to ``path``; an OS failure becomes ``error`` naming ``what`` the file is and the fix."""
    p = Path(path)
    try:
        p.write_text(text)
    except OSError as exc:
        raise error(f"cannot write {what} {str(p)!r}: {exc.strerror}; check that its directory exists and is "
                    f"writable") from None
    return p


def _limit(env: str, default: int, error: type[GradsyncError]) -> int:
    """``env`` as a whole number >= 1 (:func:`~gradsync.env.env_number`), else ``default``; ``error``: the loader's."""
    value = env_number(env, default, int, error)
    if value < 1:
        raise error(f"{env}={value} must be >= 1; unset it or set e.g. {env}={default}")
    return value


def read_input(path: str | os.PathLike[str], what: str, error: type[GradsyncError], max_bytes: int) -> bytes:
    """The bytes of input file ``path`` (``what`` it is), refused with ``error`` past ``max_bytes`` (or
    ``GRADSYNC_MAX_INPUT_BYTES``) before any of it is read. ``OSError`` from reading goes to the caller."""
    limit = _limit(MAX_INPUT_BYTES_ENV, max_bytes, error)
    p = Path(path)
    size = p.stat().st_size
    if size > limit:
        raise error(f"{what} {str(p)!r} is {size} bytes, more than the limit of {limit} bytes for an input file; "
                    f"if it is meant to be this large, set {MAX_INPUT_BYTES_ENV}={size}")
    with open(p, "rb") as f:
        data = f.read(limit + 1)  # a file that grew since the stat is cut off, not read without end
    if len(data) > limit:
        raise error(f"{what} {str(p)!r} is more than the limit of {limit} bytes for an input file; if it is meant "
                    f"to be this large, set {MAX_INPUT_BYTES_ENV}=N")
    return data


def _too_deep(what: str, limit: int, error: type[GradsyncError]) -> GradsyncError:
    return error(f"{what} nests lists and mappings more than {limit} deep, the limit for an input file; if it "
                 f"is meant to, set {MAX_INPUT_DEPTH_ENV}=N (N up to a few hundred)")


def _depth(data: Any, limit: int) -> int:
    """How deep ``data`` nests lists and dicts, counted without recursion, stopping past ``limit``."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((c, depth + 1) for c in children)
    return deepest


def parse_json(text: str, what: str, error: type[GradsyncError]) -> Any:
    """``json.loads(text)``, refused with ``error`` past the nesting limit (``json.JSONDecodeError`` for a
    syntax error goes to the caller)."""
    limit = _limit(MAX_INPUT_DEPTH_ENV, MAX_INPUT_DEPTH, error)
    try:
        data = json.loads(text)
    except RecursionError:  # deeper than Python's parser goes: deeper than any limit it can honour
        raise _too_deep(what, limit, error) from None
    if _depth(data, limit) > limit:
        raise _too_deep(what, limit, error)
    return data


class _TooDeep(Exception):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that stops composing past ``max_depth`` nested collections (the composer
    recurses once per level: 100k levels would end in a RecursionError)."""

    max_depth = MAX_INPUT_DEPTH

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                raise _TooDeep
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """How many values the node graph ``root`` holds with every alias expanded (each shared node counted
    once per use), computed once per node; past ``limit`` (or a recursive alias) the answer is ``limit + 1``."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > limit:
                return limit + 1
            continue
        if key in sizes:
            continue
        if key in open_:  # reached from below itself: a recursive alias, infinite once expanded
            return limit + 1
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def parse_yaml(text: str, what: str, error: type[GradsyncError]) -> Any:
    """``yaml.safe_load(text)``, refused with ``error`` past the nesting limit or when its aliases expand to
    more than the value limit (a "billion laughs"); ``yaml.YAMLError`` for a syntax error goes to the caller."""
    depth = _limit(MAX_INPUT_DEPTH_ENV, MAX_INPUT_DEPTH, error)
    values = _limit(MAX_INPUT_VALUES_ENV, MAX_INPUT_VALUES, error)
    loader = _BoundedLoader(text)
    loader.max_depth = depth
    try:
        try:
            node = loader.get_single_node()
        except _TooDeep:
            raise _too_deep(what, depth, error) from None
        if node is None:
            return None
        if _expanded_size(node, values) > values:
            raise error(f"{what} holds more than {values} values once its YAML aliases (*name) are expanded, the "
                        f"limit for an input file (a 'billion laughs'?); if it is meant to, set "
                        f"{MAX_INPUT_VALUES_ENV}=N")
        return loader.construct_document(node)
    finally:
        loader.dispose()
