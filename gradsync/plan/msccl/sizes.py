"""One MSCCL algorithm per range of message sizes, the set MSCCL loads from one directory.

MSCCL picks, for each call, the algorithm whose ``[minBytes, maxBytes)`` holds the message (``maxBytes="0"``:
no upper limit). One schedule is rarely best at every size: the latency of its steps decides for small
messages and its bandwidth cost for large ones. So every applicable synthesizer is exported once, priced per
size class by the planner's model (the exported, quantized cost times the size over the unit link, plus each
step's latency: OMS §2), and neighbouring classes with the same winner become one range. The ranges tile
``[0, inf)``; every file is replayed before it is returned (:func:`~gradsync.plan.msccl.export_msccl`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradsync.errors import MscclError, PlanError
from gradsync.plan.msccl.export import MscclExport, export_msccl
from gradsync.plan.report import latency_term
from gradsync.plan.synthesizers import SYNTHESIZERS, PlanOptions, synthesize
from gradsync.topology.model import Topology

__all__ = ["DEFAULT_STEP_LATENCY_S", "SMALLEST_CLASS", "SizedExport", "check_tiling", "export_msccl_sizes"]

#: The first size class's upper end: messages up to this size share one algorithm.
SMALLEST_CLASS = 4096
#: Latency per hop and step where the topology gives none (every link's ``latency_s`` is 0): the order of a GPU
#: collective's step (NCCL's base latencies are a few microseconds). Without one, the bandwidth term alone
#: decides and one algorithm takes every size.
DEFAULT_STEP_LATENCY_S = 5e-6


@dataclass(frozen=True)
class SizedExport:
    """An algorithm for messages of ``min_bytes`` up to ``max_bytes`` (exclusive; 0: no limit)."""

    algorithm: str
    min_bytes: int
    max_bytes: int
    export: MscclExport
    #: the planner's time at the range's largest size class (seconds)
    predicted_s: float

    @property
    def filename(self) -> str:
        top = "inf" if self.max_bytes == 0 else str(self.max_bytes)
        return f"{self.export.program.name}-{self.min_bytes}-{top}.xml"


def check_tiling(ranges: Sequence[tuple[int, int]]) -> None:
    """Raise :class:`MscclError` unless ``[(min, max), ...]`` tile ``[0, inf)`` in order, without gaps or overlaps
    (``max`` 0 meaning no limit, only last)."""
    expect = 0
    for i, (lo, hi) in enumerate(ranges):
        last = i == len(ranges) - 1
        if lo != expect or (hi == 0) != last or (hi != 0 and hi <= lo):
            raise MscclError(f"size ranges {list(ranges)} do not tile [0, inf): range {i} is [{lo}, {hi or 'inf'}), "
                             f"expected it to start at {expect}" + ("" if last else " and end above its start"))
        expect = hi


def export_msccl_sizes(topology: Topology, *, algorithms: Sequence[str] | None = None, largest: int = 1 << 30,
                       latency_s: float | None = None, proto: str = "Simple") -> list[SizedExport]:
    """The fastest exported algorithm per size class from :data:`SMALLEST_CLASS` to ``largest`` (powers of two),
    and past it the one of least bandwidth cost (the limit of large messages), merged into ranges that tile
    ``[0, inf)``.

    ``algorithms``: the candidates (default: every synthesizer that applies to ``topology``); one that cannot
    be planned or exported here is skipped. ``latency_s`` overrides the links' latency per hop (default: the
    links', or :data:`DEFAULT_STEP_LATENCY_S` where they have none).
    """
    if not isinstance(largest, int) or largest < SMALLEST_CLASS:
        raise MscclError(f"largest={largest!r} must be an integer >= {SMALLEST_CLASS} (the smallest size class)")
    names = list(algorithms) if algorithms is not None else [
        n for n, e in SYNTHESIZERS.items() if not e.applicable(topology)]
    unit = float(topology.unit_bandwidth_GBps or 1.0) * 1e9
    if latency_s is None and not any(link.latency_s for link in topology.links):
        latency_s = DEFAULT_STEP_LATENCY_S
    priced: dict[str, tuple[float, float]] = {}  # name -> (quantized cost, latency term)
    refused: dict[str, str] = {}
    for name in names:
        try:
            schedule = synthesize(name, topology, PlanOptions())
            plain = export_msccl(schedule, topology, proto=proto)
        except (PlanError, MscclError) as exc:
            refused[name] = str(exc)
            continue
        priced[name] = (plain.quantization.quantized_cost, latency_term(schedule, topology, latency_s))
    if not priced:
        raise MscclError(f"no algorithm exports to MSCCL for {topology.name!r}: "
                         + "; ".join(f"{n}: {why}" for n, why in refused.items()))

    def time_s(name: str, size: int) -> float:
        cost, lat = priced[name]
        return cost * size / unit + lat

    classes = []
    size = SMALLEST_CLASS
    while size <= largest:
        classes.append(size)
        size *= 2
    best = [min(priced, key=lambda n, s=s: (time_s(n, s), n)) for s in classes]  # ties: the name, deterministic
    # past the largest class only bandwidth counts: the unbounded range runs the lowest cost
    classes.append(2 * classes[-1])
    best.append(min(priced, key=lambda n: (priced[n][0], priced[n][1], n)))
    runs: list[tuple[str, int, int]] = []  # (algorithm, first class index, last class index)
    for i, name in enumerate(best):
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], i)
        else:
            runs.append((name, i, i))
    out = []
    for j, (name, first, last) in enumerate(runs):
        # class c holds the messages in (c/2, c]: the range of classes first..last is [c_first/2 + 1, c_last + 1)
        lo = 0 if first == 0 else classes[first - 1] + 1
        hi = 0 if j == len(runs) - 1 else classes[last] + 1
        schedule = synthesize(name, topology, PlanOptions())
        export = export_msccl(schedule, topology, name=f"{topology.name}-{name}".replace(":", "_").replace(",", "_"),
                              proto=proto, min_bytes=lo, max_bytes=hi)
        out.append(SizedExport(name, lo, hi, export, time_s(name, classes[last])))
    check_tiling([(e.min_bytes, e.max_bytes) for e in out])
    return out
