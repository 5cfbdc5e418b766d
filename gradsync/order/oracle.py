"""The time oracle (TicTac §3.1 and §5): ``Time(op)`` for every op of a worker's DAG.

Compute ops are profiled on this machine: each op runs ``runs`` times (5, as TicTac) and the oracle keeps
the **minimum**, the run least disturbed by everything else on the machine. Transfers come from a link
model, ``Time(recv p) = α + bytes(p) / β`` with β in GB/s (gradsync's unit everywhere), or from measured
times per parameter. TIC uses :meth:`TimeOracle.general` instead: 1 per recv, 0 per everything else (Eq. 5).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gradsync.order.dag import KIND_SEND, Dag, DagError, Op

__all__ = ["LinkModel", "TimeOracle", "bandwidth_for_ratio", "profile_ops", "time_oracle"]


@dataclass(frozen=True)
class LinkModel:
    """α–β link: a transfer of ``n`` bytes takes ``alpha_s + n / (bandwidth_GBps * 1e9)`` seconds."""

    bandwidth_GBps: float = 1.0
    alpha_s: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth_GBps, (int, float)) and math.isfinite(self.bandwidth_GBps) and self.bandwidth_GBps > 0):
            raise DagError(f"bandwidth_GBps={self.bandwidth_GBps!r} must be a positive number of GB/s")
        if not (isinstance(self.alpha_s, (int, float)) and math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise DagError(f"alpha_s={self.alpha_s!r} must be a latency in seconds >= 0")

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / (self.bandwidth_GBps * 1e9)


@dataclass(frozen=True)
class TimeOracle:
    """``compute_s``: op name -> seconds; ``transfer_s``: parameter name -> seconds (its recv, and its send).

    Ops missing from ``compute_s`` fall back to the DAG's own ``time_s``; a send op costs its gradient's
    transfer time.
    """

    compute_s: Mapping[str, float] = field(default_factory=dict)
    transfer_s: Mapping[str, float] = field(default_factory=dict)
    #: TIC's general oracle (Eq. 5): every compute op 0, every transfer 1.
    unit: bool = False

    def op(self, op: Op) -> float:
        if op.kind == KIND_SEND:
            return self.recv(op.sends or "")
        if self.unit:
            return 0.0
        return float(self.compute_s.get(op.name, op.time_s))

    def recv(self, param: str) -> float:
        if self.unit:
            return 1.0
        try:
            return float(self.transfer_s[param])
        except KeyError:
            raise DagError(f"the time oracle has no transfer time for parameter {param!r}; "
                           f"build it with time_oracle(dag, link=...) or pass measured times for every parameter") from None

    @classmethod
    def general(cls) -> TimeOracle:
        """Eq. 5: ``Time_General(op) = 1`` if op is a recv, else 0 (what TIC schedules with)."""
        return cls(unit=True)


def time_oracle(dag: Dag, link: LinkModel | None = None, *, measured: Mapping[str, float] | None = None,
                compute: Mapping[str, float] | None = None) -> TimeOracle:
    """The oracle for ``dag``: compute times from ``compute`` (else the DAG's ``time_s``), transfer times
    from ``measured`` (parameter -> s) where given, else from ``link`` (default 1 GB/s, no latency)."""
    link = link or LinkModel()
    measured = dict(measured or {})
    unknown = sorted(set(measured) - set(dag.param_index))
    if unknown:
        raise DagError(f"measured transfer times name parameter(s) {unknown[:5]} that DAG {dag.name!r} does not have")
    for k, v in measured.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise DagError(f"measured transfer time of {k!r} is {v!r}; give seconds >= 0")
    transfer = {p.name: float(measured[p.name]) if p.name in measured else link.time(p.nbytes) for p in dag.params}
    comp = {op.name: op.time_s for op in dag.ops if op.kind != KIND_SEND}
    if compute:
        comp.update({k: float(v) for k, v in compute.items()})
    return TimeOracle(comp, transfer)


def bandwidth_for_ratio(dag: Dag, ratio: float = 1.0, *, alpha_s: float = 0.0) -> float:
    """The link bandwidth (GB/s) at which pulling every parameter takes ``ratio`` x the DAG's compute time.

    ``ratio`` is the communication/computation ratio of TicTac §6.1; near 1 is where ordering matters most.
    """
    if not (math.isfinite(ratio) and ratio > 0):
        raise DagError(f"ratio={ratio!r} must be a positive communication/computation ratio")
    compute = sum(op.time_s for op in dag.ops if op.kind != KIND_SEND)
    budget = ratio * compute - alpha_s * len(dag.params)
    if compute <= 0 or budget <= 0:
        raise DagError(f"DAG {dag.name!r} has compute time {compute:g} s (profile it first) or alpha_s={alpha_s:g} "
                       f"leaves no time for bytes at ratio {ratio:g}")
    return dag.total_bytes / budget / 1e9


def profile_ops(model: Any, example: Any, dag: Dag, *, runs: int = 5, warmup: int = 1) -> dict[str, float]:
    """Forward compute time of every op of ``dag`` (captured from ``model``): the minimum of ``runs`` runs.

    fx-captured DAGs are timed node by node with an :class:`torch.fx.Interpreter`. For autograd-captured
    DAGs (no replayable graph) each leaf module is timed with forward hooks and its time goes to the first
    op that reads the module's parameters; parameter-free ops (adds, views) get 0.
    """
    import torch

    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise DagError(f"runs={runs!r} must be a positive integer (the seed uses 5)")
    args = example if isinstance(example, tuple) else (example,)
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, math.inf), seconds)

    from gradsync.order.capture import _restored  # profiling in train mode must not move batch-norm statistics

    if dag.source == "fx":
        import torch.fx

        class _Timed(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                sync()
                t0 = time.perf_counter()
                out = super().run_node(n)
                sync()
                keep(n.name, time.perf_counter() - t0)
                return out

        gm = torch.fx.symbolic_trace(model)
        with torch.no_grad(), _restored(model):
            for i in range(warmup + runs):
                if i == warmup:
                    best.clear()
                _Timed(gm).run(*args)
    else:
        owner: dict[str, str] = {}
        for op in dag.ops:
            for p in op.reads:
                owner.setdefault(p.rpartition(".")[0], op.name)
        starts: dict[str, float] = {}
        handles = []
        for mname, mod in model.named_modules():
            if mname in owner:
                def pre(_m: Any, _a: Any, mname: str = mname) -> None:
                    sync()
                    starts[mname] = time.perf_counter()

                def post(_m: Any, _a: Any, _o: Any, mname: str = mname) -> None:
                    sync()
                    keep(owner[mname], time.perf_counter() - starts[mname])
                handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        try:
            with torch.no_grad(), _restored(model):
                for i in range(warmup + runs):
                    if i == warmup:
                        best.clear()
                    model(*args)
        finally:
            for h in handles:
                h.remove()
    return {op.name: best.get(op.name, 0.0) for op in dag.ops if op.kind != KIND_SEND and not op.name.startswith("bwd:")}
