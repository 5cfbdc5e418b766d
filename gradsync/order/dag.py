"""The worker's computation graph as plain data: TicTac's partitioned graph (§3.1).

A :class:`Dag` holds the model's parameters (each one a *recv* op: the transfer that brings it to the
worker, a root of the graph) and its ops in topological order. An op names the ops it waits for
(``inputs``), the parameters it reads (``reads``: its edges from recv ops) and, in a training graph, the
gradient it pushes (``sends``: a *send* op, a leaf). ``time_s`` is the op's compute time from the time
oracle (0 until profiled; a send's time is a transfer time and comes from the link model instead).

Everything is frozen and checked on construction, so TIC, TAC and the simulators can index without
re-validating. ``save``/``load`` write tagged JSON (never pickle); a bad file fails naming the value.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gradsync.errors import GradsyncError
from gradsync.paths import write_text

__all__ = ["Dag", "DagError", "Op", "Param", "DAG_TYPE", "KIND_BACKWARD", "KIND_SEND", "forward_of", "ops_reading", "training_dag"]

DAG_TYPE = "gradsync.order.dag"
_VERSION = 1
#: ``kind`` of the backward ops :func:`training_dag` adds (``time_s`` = factor x their forward op's).
KIND_BACKWARD = "backward"
#: ``kind`` of a send op: it pushes one gradient (``sends``) over the uplink; its time is a transfer time.
KIND_SEND = "send"
_BWD = "bwd:"
_SEND = "send:"


class DagError(GradsyncError):
    """A DAG is malformed (unknown op or parameter, a cycle, a negative time) or a DAG file is unreadable."""


@dataclass(frozen=True)
class Param:
    """A parameter, i.e. a recv op: ``nbytes`` must cross the network before any op reading it can run."""

    name: str
    nbytes: int
    shape: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DagError(f"parameter name {self.name!r} must be a non-empty string")
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise DagError(f"parameter {self.name!r}: nbytes={self.nbytes!r} must be an integer >= 0")


@dataclass(frozen=True)
class Op:
    """A computation op (or a send op in a training graph). ``inputs`` are op names, ``reads`` parameter names."""

    name: str
    kind: str = "compute"
    time_s: float = 0.0
    inputs: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    sends: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DagError(f"op name {self.name!r} must be a non-empty string")
        t = self.time_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise DagError(f"op {self.name!r}: time_s={t!r} must be a finite number of seconds >= 0")
        object.__setattr__(self, "time_s", float(t))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "reads", tuple(self.reads))
        if (self.kind == KIND_SEND) != (self.sends is not None):
            raise DagError(f"op {self.name!r}: a {KIND_SEND!r} op names the gradient it sends (sends=...), "
                           f"and only a send op does (kind={self.kind!r}, sends={self.sends!r})")


@dataclass(frozen=True)
class Dag:
    """A worker's graph: ``params`` (recv ops, forward order), ``ops`` in topological order.

    ``grad_order`` is the order in which gradients became ready in a real backward pass (empty when not
    captured); ``source`` says how the graph was obtained (``fx``, ``autograd``, ``json``, ``hand``).
    """

    name: str
    params: tuple[Param, ...]
    ops: tuple[Op, ...]
    grad_order: tuple[str, ...] = ()
    source: str = "hand"
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "grad_order", tuple(self.grad_order))
        pnames = [p.name for p in self.params]
        if len(set(pnames)) != len(pnames):
            dup = sorted({n for n in pnames if pnames.count(n) > 1})
            raise DagError(f"DAG {self.name!r}: parameter(s) {dup} listed twice; parameter names must be unique")
        known = set(pnames)
        index: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            if op.name in index:
                raise DagError(f"DAG {self.name!r}: op {op.name!r} listed twice; op names must be unique")
            if op.name in known:
                raise DagError(f"DAG {self.name!r}: op {op.name!r} has a parameter's name; rename one of them")
            for src in op.inputs:
                if src not in index:
                    why = "is unknown" if all(o.name != src for o in self.ops) else "comes later (ops must be in topological order)"
                    raise DagError(f"DAG {self.name!r}: op {op.name!r} waits for op {src!r}, which {why}")
            for p in (*op.reads, *((op.sends,) if op.sends else ())):
                if p not in known:
                    raise DagError(f"DAG {self.name!r}: op {op.name!r} uses parameter {p!r}, which is not in params")
            index[op.name] = i
        if self.grad_order and sorted(self.grad_order) != sorted(set(self.grad_order) & known):
            raise DagError(f"DAG {self.name!r}: grad_order names unknown or repeated parameters; "
                           f"give each parameter name at most once")
        self._index.update(index)

    # ---- lookups --------------------------------------------------------------------------------------
    def op(self, name: str) -> Op:
        try:
            return self.ops[self._index[name]]
        except KeyError:
            raise DagError(f"DAG {self.name!r} has no op {name!r}") from None

    def index(self, name: str) -> int:
        return self._index[name]

    @functools.cached_property
    def param_index(self) -> dict[str, int]:
        return {p.name: i for i, p in enumerate(self.params)}

    @property
    def training(self) -> bool:
        """True when the graph has send ops (a training iteration pushes gradients)."""
        return any(op.sends is not None for op in self.ops)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def summary(self) -> str:
        mode = "training" if self.training else "inference"
        return (f"{self.name}: {len(self.params)} parameters ({self.total_bytes / 2**20:.2f} MiB), "
                f"{len(self.ops)} ops ({mode}, from {self.source})")

    # ---- derived graphs ---------------------------------------------------------------------------------
    def with_times(self, times: Mapping[str, float], *, backward_factor: float = 2.0) -> Dag:
        """A copy with ``time_s`` from ``times`` (op name -> s); backward ops not in ``times`` get
        ``backward_factor`` x their forward op's time (a backward pass costs about two forwards)."""
        if not math.isfinite(backward_factor) or backward_factor < 0:
            raise DagError(f"backward_factor={backward_factor!r} must be a finite number >= 0")
        unknown = sorted(set(times) - set(self._index))
        if unknown:
            raise DagError(f"times name op(s) {unknown[:5]} that DAG {self.name!r} does not have")
        new: dict[str, float] = {}
        ops = []
        for op in self.ops:
            t = times.get(op.name)
            if t is None and op.kind == KIND_BACKWARD and op.name.startswith(_BWD):
                fwd = op.name[len(_BWD):]
                t = backward_factor * new.get(fwd, self.op(fwd).time_s) if fwd in self._index else op.time_s
            new[op.name] = op.time_s if t is None else t
            ops.append(op if t is None else replace(op, time_s=t))
        return replace(self, ops=tuple(ops))

    # ---- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "type": DAG_TYPE, "version": _VERSION, "name": self.name, "source": self.source,
            "params": [{"name": p.name, "nbytes": p.nbytes, "shape": list(p.shape), "dtype": p.dtype} for p in self.params],
            "ops": [{"name": o.name, "kind": o.kind, "time_s": o.time_s, "inputs": list(o.inputs),
                     "reads": list(o.reads), **({"sends": o.sends} if o.sends else {})} for o in self.ops],
            "grad_order": list(self.grad_order),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Dag:
        """Rebuild a DAG from :meth:`to_dict` output; every field is checked and errors name the bad value."""
        if not isinstance(data, Mapping):
            raise DagError(f"a DAG file holds a JSON object, not {type(data).__name__}")
        if data.get("type") != DAG_TYPE:
            raise DagError(f"not a DAG file: type is {data.get('type')!r}, expected {DAG_TYPE!r}")
        if data.get("version") != _VERSION:
            raise DagError(f"DAG file version {data.get('version')!r} is not supported (this gradsync reads {_VERSION})")
        try:
            params = tuple(Param(str(p["name"]), p["nbytes"], tuple(int(s) for s in p.get("shape", ())),
                                 str(p.get("dtype", "float32"))) for p in _list(data, "params"))
            ops = tuple(Op(str(o["name"]), str(o.get("kind", "compute")), o.get("time_s", 0.0),
                           tuple(_strs(o, "inputs")), tuple(_strs(o, "reads")), o.get("sends"))
                        for o in _list(data, "ops"))
        except (KeyError, TypeError) as exc:
            raise DagError(f"DAG file entry is missing or has a wrong-typed field: {exc!r}; "
                           f"params need name and nbytes, ops need name") from None
        return cls(str(data.get("name", "dag")), params, ops, tuple(_strs(data, "grad_order")), str(data.get("source", "json")))

    def save(self, path: str | Path) -> Path:
        return write_text(path, json.dumps(self.to_dict(), indent=1) + "\n", "DAG file", DagError)

    @classmethod
    def load(cls, path: str | Path) -> Dag:
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise DagError(f"DAG file {str(path)!r} does not exist") from None
        except UnicodeDecodeError as exc:
            raise DagError(f"DAG file {str(path)!r} is not a text file (byte {exc.object[exc.start]:#04x} at offset "
                           f"{exc.start} is not UTF-8); give a DAG saved by 'gradsync order --save-dag'") from None
        except OSError as exc:
            raise DagError(f"cannot read DAG file {str(path)!r}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise DagError(f"DAG file {str(path)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def _list(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise DagError(f"DAG file field {key!r} must be a list of objects, got {value!r:.80}")
    return value


def _strs(data: Mapping[str, Any], key: str) -> list[str]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DagError(f"DAG field {key!r} must be a list of names, got {value!r:.80}")
    return value


def training_dag(dag: Dag) -> Dag:
    """Add the backward pass and the gradient pushes to a forward (inference) DAG.

    Backward op ``bwd:f`` waits for ``f`` (its saved activations) and for the backward ops of every
    consumer of ``f``'s output (its incoming gradient); it produces the gradients of the parameters ``f``
    reads. ``send:p`` pushes parameter ``p``'s gradient once every backward op of a reader of ``p`` is done.
    Ops that lead to no parameter gradient get no backward op: autograd skips them too.
    """
    if dag.training:
        raise DagError(f"DAG {dag.name!r} already has send ops; training_dag takes a forward (inference) DAG")
    consumers: dict[str, list[str]] = {op.name: [] for op in dag.ops}
    for op in dag.ops:
        for src in op.inputs:
            consumers[src].append(op.name)
    # An op needs a backward op when it, or something upstream of it, reads a parameter.
    needs: dict[str, bool] = {}
    for op in dag.ops:
        needs[op.name] = bool(op.reads) or any(needs[s] for s in op.inputs)
    bwd_ops: list[Op] = []
    for op in reversed(dag.ops):
        if not needs[op.name]:
            continue
        deps = (op.name, *(_BWD + c for c in consumers[op.name] if needs[c]))
        bwd_ops.append(Op(_BWD + op.name, KIND_BACKWARD, 0.0, deps))
    readers: dict[str, list[str]] = {p.name: [] for p in dag.params}
    for op in dag.ops:
        for p in op.reads:
            readers[p].append(_BWD + op.name)
    # Sends in the order their gradient is complete in this backward order: the last reader decides.
    position = {b.name: i for i, b in enumerate(bwd_ops)}
    sends = sorted((p for p in dag.params if readers[p.name]), key=lambda p: max(position[b] for b in readers[p.name]))
    send_ops = [Op(_SEND + p.name, KIND_SEND, 0.0, tuple(dict.fromkeys(readers[p.name])), (), p.name) for p in sends]
    return replace(dag, ops=(*dag.ops, *bwd_ops, *send_ops))


def forward_of(op: Op) -> str | None:
    """The forward op a backward op differentiates (``bwd:f`` -> ``f``), else ``None``."""
    return op.name[len(_BWD):] if op.kind == KIND_BACKWARD and op.name.startswith(_BWD) else None


def ops_reading(dag: Dag) -> dict[str, list[str]]:
    """Parameter name -> names of the ops that read it (the recv op's out-edges)."""
    out: dict[str, list[str]] = {p.name: [] for p in dag.params}
    for op in dag.ops:
        for p in op.reads:
            out[p].append(op.name)
    return out
