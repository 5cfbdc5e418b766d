"""Up-front estimates of what planning will cost, so ``gradsync plan`` can refuse or warn before it starts.

Memory is :func:`gradsync.plan.synthesizers.plan_bytes` (a floor). Time is a power law in the rank count,
``t = seconds_at * (n / ranks_at) ** exponent``, fitted to whole ``gradsync plan`` runs on ring topology files
(``gradsync topo export ring:N``) on a 2-core machine shared with other work (issue 42):

====================  ================================  ========
algorithm             measured                          exponent
====================  ================================  ========
lp                    24 s at 500 ranks, 247 s at 1000  3.3 (fit)
ring, multiring       68 s at 2000                      2 (transfers ~ n^2)
ps                    172 s at 500                      2
tree                  98 s at 2000                      2
====================  ================================  ========

These are rough bounds for topologies without symmetry. ``lp`` where :func:`symmetry_of` finds a group (fat
trees, BCubes: a symmetric packing, fattree:24 in seconds) and ``hierarchical``, ``bml`` and ``auto`` have no
time estimate (0).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.plan.symmetry import symmetry_of
from gradsync.plan.synthesizers import SYNTHESIZERS, PlanOptions, plan_bytes
from gradsync.topology.model import Topology

__all__ = ["PlanEstimate", "TimeModel", "TIME_MODELS", "estimate_plan"]


@dataclass(frozen=True)
class TimeModel:
    """``seconds_at * (n / ranks_at) ** exponent`` seconds for ``n`` ranks."""

    seconds_at: float
    ranks_at: int
    exponent: float

    def seconds(self, ranks: int) -> float:
        return self.seconds_at * (ranks / self.ranks_at) ** self.exponent


#: Per synthesizer, from the measurements in the module docstring.
TIME_MODELS: dict[str, TimeModel] = {
    "lp": TimeModel(24.0, 500, 3.3),
    "ring": TimeModel(68.0, 2000, 2.0),
    "multiring": TimeModel(68.0, 2000, 2.0),
    "ps": TimeModel(172.0, 500, 2.0),
    "tree": TimeModel(98.0, 2000, 2.0),
}


@dataclass(frozen=True)
class PlanEstimate:
    """What planning ``algorithm`` on ``ranks`` ranks is expected to take (0: not estimated)."""

    algorithm: str
    ranks: int
    memory_bytes: float
    memory_what: str
    time_s: float


def estimate_plan(algorithm: str, topology: Topology, options: PlanOptions | None = None) -> PlanEstimate:
    """Memory floor and time estimate for planning ``algorithm`` on ``topology`` (module docstring)."""
    opts = options or PlanOptions()
    if algorithm == "auto" or algorithm not in SYNTHESIZERS:
        return PlanEstimate(algorithm, topology.world_size, 0.0, "", 0.0)
    name = SYNTHESIZERS.canonical(algorithm)
    need, what = plan_bytes(name, topology, opts)
    model = TIME_MODELS.get(name)
    if name == "lp" and symmetry_of(topology) is not None:  # the symmetric packing, not column generation
        model = None
    n = topology.world_size
    seconds = model.seconds(n) * opts.pipeline ** (0 if name == "lp" else 1) if model is not None and n > 1 else 0.0
    if name == "multiring":
        seconds *= opts.rings / 2
    return PlanEstimate(name, n, need, what, seconds)
