r"""TIC and TAC (TicTac §4) and the scheduling metrics U, L, E, S (§3.2), as pure functions of a DAG.

Notation (TicTac §4.1). ``R`` is the set of outstanding recv ops (parameters not yet transferred),
``op.dep`` the recv ops an op depends on directly or transitively, ``Time`` the time oracle:

* ``op.M  = Σ_{r ∈ op.dep ∩ R} Time(r)`` -- the communication still blocking the op (a recv's own ``M`` is
  ``Time(r)``);
* ``r.P   = Σ Time(op)`` over ops with ``op.dep ∩ R = {r}`` -- the compute that completing ``r`` alone unlocks;
* ``r.M⁺ = min op.M`` over ops with ``|op.dep ∩ R| > 1`` and ``r ∈ op.dep`` -- the cheapest communication that
  unlocks an op needing ``r`` and something else (``+∞`` if none).

TIC (Algorithm 2) runs Algorithm 1 once with ``Time_General`` (1 per recv, 0 per op) and ranks recvs by ``M⁺``;
equal ``M⁺`` share a rank, which is the number of recvs strictly ahead (the enforcement counter's meaning).
TAC (Algorithm 3) repeatedly recomputes the properties for the current ``R``, takes the minimum recv under

    A ≺ B  ⇔  min(P_B, M_A) < min(P_A, M_B),   ties broken by  M⁺_A < M⁺_B            (Eq. 6)

and removes it from ``R``. Eq. 6 follows from ``Makespan(A→B) = M_A + max(P_A, M_B) + P_B``: A goes first iff
it overlaps more communication with compute. (Algorithm 3's pseudocode prints the two minima swapped; we
follow Eq. 6's derivation, which is also what the authors' released code compares.)

Speed: ``op.dep`` is a boolean ops x recvs matrix. Ops with the same dependency set behave identically in
Algorithm 1 (same ``M``; their times add up in ``P``), so rows are merged first: a ResNet-152 training DAG of
~1,500 ops collapses to ~470 rows, every pass of Algorithm 1 is a few numpy reductions over rows x recvs,
and rows whose outstanding set became empty are dropped for good (``R`` only shrinks). TAC on ResNet-152
takes well under a second.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gradsync.order.dag import KIND_SEND, Dag, DagError, Op
from gradsync.order.oracle import TimeOracle

__all__ = [
    "Metrics", "RecvProperties", "before", "dependency_matrix", "efficiency", "lower_bound", "metrics",
    "properties", "rank_by", "speedup", "straggler_percent", "tac", "tac_order", "tic", "upper_bound",
]


@dataclass(frozen=True)
class RecvProperties:
    """Algorithm 1's properties of one outstanding recv: ``M`` (= Time(r)), ``P`` and ``M_plus``."""

    M: float
    P: float
    M_plus: float


def dependency_matrix(dag: Dag) -> np.ndarray:
    """``D[i, j]`` is True iff op ``i`` depends (directly or transitively) on recv ``j``: ``op.dep`` as bits.

    One pass in topological order (``D[i] = OR of D[inputs] | reads``), TicTac's post-fix traversal.
    """
    col = dag.param_index
    deps = np.zeros((len(dag.ops), len(dag.params)), dtype=bool)
    for i, op in enumerate(dag.ops):
        row = deps[i]
        for src in op.inputs:
            row |= deps[dag.index(src)]
        for p in op.reads:
            row[col[p]] = True
    return deps


class _Algorithm1:
    """Algorithm 1 over merged dependency rows; ``update(outstanding)`` -> (M, P, M⁺) per recv."""

    def __init__(self, dag: Dag, oracle: TimeOracle) -> None:
        deps = dependency_matrix(dag)
        op_time = np.array([oracle.op(op) for op in dag.ops], dtype=np.float64)
        self.recv_time = np.array([oracle.recv(p.name) for p in dag.params], dtype=np.float64)
        if (op_time < 0).any() or (self.recv_time < 0).any() or not np.isfinite(op_time).all() or not np.isfinite(self.recv_time).all():
            raise DagError("the time oracle gave a negative or non-finite time; every Time(op) must be >= 0")
        has_dep = deps.any(axis=1)
        if has_dep.any():
            rows, inverse = np.unique(deps[has_dep], axis=0, return_inverse=True)
            weight = np.bincount(inverse.ravel(), weights=op_time[has_dep], minlength=rows.shape[0])
        else:
            rows, weight = np.zeros((0, deps.shape[1]), dtype=bool), np.zeros(0)
        self.rows, self.weight = rows, weight
        self.n = deps.shape[1]

    def update(self, outstanding: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        live = self.rows & outstanding  # op.dep ∩ R, per merged row
        count = live.sum(axis=1)
        if (count == 0).any():  # R only shrinks: these rows never matter again
            keep = count > 0
            self.rows, self.weight, live, count = self.rows[keep], self.weight[keep], live[keep], count[keep]
        comm = live @ self.recv_time  # op.M
        single = count == 1
        p = np.bincount(np.argmax(live[single], axis=1), weights=self.weight[single], minlength=self.n) \
            if single.any() else np.zeros(self.n)
        multi = count > 1
        m_plus = np.where(live[multi], comm[multi, None], np.inf).min(axis=0) if multi.any() else np.full(self.n, np.inf)
        return self.recv_time, p, m_plus


def properties(dag: Dag, oracle: TimeOracle, outstanding: Sequence[str] | None = None) -> dict[str, RecvProperties]:
    """Algorithm 1 (UpdateProperties) for the outstanding recvs (default: all), as ``name -> (M, P, M⁺)``."""
    mask = _mask(dag, outstanding)
    m, p, m_plus = _Algorithm1(dag, oracle).update(mask)
    return {dag.params[j].name: RecvProperties(float(m[j]), float(p[j]), float(m_plus[j])) for j in np.flatnonzero(mask)}


def _mask(dag: Dag, names: Sequence[str] | None) -> np.ndarray:
    mask = np.zeros(len(dag.params), dtype=bool)
    if names is None:
        mask[:] = True
        return mask
    for name in names:
        if name not in dag.param_index:
            raise DagError(f"outstanding recv {name!r} is not a parameter of DAG {dag.name!r}")
        mask[dag.param_index[name]] = True
    return mask


def before(a: RecvProperties, b: RecvProperties) -> bool:
    """TAC's comparator, Eq. 6: ``A ≺ B`` iff ``min(P_B, M_A) < min(P_A, M_B)``; on a tie, ``M⁺_A < M⁺_B``."""
    x, y = min(b.P, a.M), min(a.P, b.M)
    if x != y:
        return x < y
    return a.M_plus < b.M_plus


def rank_by(values: Mapping[str, float]) -> dict[str, int]:
    """Competition ranks, ascending: equal values share a rank, which counts the names strictly ahead."""
    ordered = sorted(values.items(), key=lambda kv: kv[1])
    ranks: dict[str, int] = {}
    last_value, last_rank = None, 0
    for i, (name, value) in enumerate(ordered):
        if i == 0 or value != last_value:
            last_value, last_rank = value, i
        ranks[name] = last_rank
    return ranks


def tic(dag: Dag) -> dict[str, int]:
    """TIC (Algorithm 2): ``priority(r) = r.M⁺`` under ``Time_General``; returns ``param -> rank`` (0 first, ties share).

    A recv no multi-recv op depends on (``M⁺ = +∞``) need not be ordered; it ranks last.
    """
    _, _, m_plus = _Algorithm1(dag, TimeOracle.general()).update(np.ones(len(dag.params), dtype=bool))
    return rank_by({p.name: float(m_plus[j]) for j, p in enumerate(dag.params)})


def tac_order(dag: Dag, oracle: TimeOracle) -> list[str]:
    """TAC (Algorithm 3): the recvs in the order they are taken out of ``R``."""
    alg = _Algorithm1(dag, oracle)
    outstanding = np.ones(len(dag.params), dtype=bool)
    remaining = list(range(len(dag.params)))
    order: list[str] = []
    while remaining:
        m, p, m_plus = (v.tolist() for v in alg.update(outstanding))
        best = remaining[0]
        for c in remaining[1:]:  # "find the minimum op from R wrt Comparator" (ties: the earlier parameter)
            x, y = min(p[best], m[c]), min(p[c], m[best])
            if x < y or (x == y and m_plus[c] < m_plus[best]):
                best = c
        order.append(dag.params[best].name)
        outstanding[best] = False
        remaining.remove(best)
    return order


def tac(dag: Dag, oracle: TimeOracle) -> dict[str, int]:
    """TAC priorities: ``param -> 0..n-1`` (``count`` of Algorithm 3), all distinct."""
    return {name: i for i, name in enumerate(tac_order(dag, oracle))}


# ---- metrics (§3.2) --------------------------------------------------------------------------------------
def default_resource(op: Op) -> str:
    """Resource of an op on one worker: compute, or the uplink for a send (recvs use the ``downlink``)."""
    return "uplink" if op.kind == KIND_SEND else "compute"


def upper_bound(dag: Dag, oracle: TimeOracle) -> float:
    """Eq. 1: ``U = Σ_{op ∈ G} Time(op)`` (recvs included): everything runs one after another."""
    return sum(oracle.recv(p.name) for p in dag.params) + sum(oracle.op(op) for op in dag.ops)


def lower_bound(dag: Dag, oracle: TimeOracle, resource: Callable[[Op], str] = default_resource) -> float:
    """Eq. 2: ``L = max_{d ∈ D} Σ_{op ∈ G_d} Time(op)``: every resource always busy, dependencies ignored."""
    load: dict[str, float] = {"downlink": sum(oracle.recv(p.name) for p in dag.params)}
    for op in dag.ops:
        d = resource(op)
        load[d] = load.get(d, 0.0) + oracle.op(op)
    return max(load.values())


def efficiency(upper: float, lower: float, makespan: float) -> float:
    """Eq. 3: ``E = (U - m) / (U - L)``; 1 is a perfect order, 0 the worst. ``nan`` when ``U == L``."""
    span = upper - lower
    return (upper - makespan) / span if span > 0 else math.nan


def speedup(upper: float, lower: float) -> float:
    """Eq. 4: ``S = (U - L) / L``, the most any order can gain over the worst (S = 1: double throughput)."""
    return (upper - lower) / lower if lower > 0 else math.nan


def straggler_percent(finish_s: Sequence[float]) -> float:
    """TicTac §6.3: the longest any worker waits for the slowest, in percent of the iteration:
    ``100 · max_w (T - f_w) / T`` with ``T = max_w f_w``."""
    if not finish_s:
        raise DagError("straggler_percent needs the finish time of at least one worker")
    end = max(finish_s)
    return 100.0 * (end - min(finish_s)) / end if end > 0 else 0.0


@dataclass(frozen=True)
class Metrics:
    """U, L (Eqs. 1-2), the makespan m, E (Eq. 3) and S (Eq. 4) of one iteration on one worker."""

    upper_s: float
    lower_s: float
    makespan_s: float
    efficiency: float
    speedup: float

    def to_dict(self) -> dict[str, float]:
        return {"U_s": self.upper_s, "L_s": self.lower_s, "makespan_s": self.makespan_s, "E": self.efficiency, "S": self.speedup}


def metrics(dag: Dag, oracle: TimeOracle, makespan_s: float, resource: Callable[[Op], str] = default_resource) -> Metrics:
    """U, L, E and S for an iteration of ``dag`` that took ``makespan_s`` (simulated or measured)."""
    u, lo = upper_bound(dag, oracle), lower_bound(dag, oracle, resource)
    return Metrics(u, lo, makespan_s, efficiency(u, lo, makespan_s), speedup(u, lo))
