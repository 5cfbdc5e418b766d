"""Priority lists: the ordering wizard's output (TicTac §5), computed once before training.

A priority list maps every parameter name to an integer, 0 = send first; equal numbers may go in any
order. It is what an enforcement point consumes: the parameter server sends a worker's pulls in
increasing priority (TicTac's per-worker counter: a transfer waits until that many have been handed to
the transport), and the runtime issues gradient transfers the same way.

Orderings are named in :data:`ORDERINGS` (``tac``, ``tic``, ``fifo``, ``random``), so the CLI lists them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from gradsync.order.dag import Dag, DagError
from gradsync.order.oracle import LinkModel, TimeOracle, profile_ops, time_oracle
from gradsync.order.tictac import tac, tic
from gradsync.registry import Registry

__all__ = ["ORDERINGS", "Ordering", "check_priorities", "order_of", "ordering", "priorities"]

#: ``fn(dag, oracle, rng) -> {param: priority}``; ``oracle`` has profiled compute times and link transfer times.
Ordering = Callable[[Dag, TimeOracle, random.Random], dict[str, int]]
ORDERINGS: Registry[Ordering] = Registry("ordering", DagError)


@ORDERINGS.register("tac")
def _tac(dag: Dag, oracle: TimeOracle, rng: random.Random) -> dict[str, int]:
    """Timing-aware (Algorithm 3): needs profiled op times and transfer times."""
    return tac(dag, oracle)


@ORDERINGS.register("tic")
def _tic(dag: Dag, oracle: TimeOracle, rng: random.Random) -> dict[str, int]:
    """Timing-independent (Algorithm 2): DAG structure only; ties share a rank."""
    return tic(dag)


@ORDERINGS.register("fifo")
def _fifo(dag: Dag, oracle: TimeOracle, rng: random.Random) -> dict[str, int]:
    """Parameter registration (forward) order, what a framework that iterates ``parameters()`` sends."""
    return {p.name: i for i, p in enumerate(dag.params)}


@ORDERINGS.register("random")
def _random(dag: Dag, oracle: TimeOracle, rng: random.Random) -> dict[str, int]:
    """A uniformly random order: TicTac's baseline (TensorFlow's arrival order is effectively random)."""
    names = [p.name for p in dag.params]
    rng.shuffle(names)
    return {n: i for i, n in enumerate(names)}


def ordering(dag: Dag, method: str, oracle: TimeOracle | None = None, *, seed: int = 0) -> dict[str, int]:
    """Priorities of ``dag``'s parameters by ``method`` (a name in :data:`ORDERINGS`)."""
    fn = ORDERINGS.get(method)
    return fn(dag, oracle or time_oracle(dag), random.Random(seed))


def check_priorities(dag: Dag, prio: Mapping[str, int]) -> dict[str, int]:
    """Validate a priority list against ``dag``: every parameter once, integers >= 0. Returns a plain dict."""
    names = set(dag.param_index)
    missing, extra = sorted(names - set(prio)), sorted(set(prio) - names)
    if missing or extra:
        raise DagError(f"priority list does not match DAG {dag.name!r}: missing {missing[:5]}, unknown {extra[:5]}; "
                       f"give every parameter exactly one priority")
    for k, v in prio.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise DagError(f"priority of {k!r} is {v!r}; priorities are integers >= 0 (0 = send first)")
    return dict(prio)


def order_of(prio: Mapping[str, int]) -> list[str]:
    """Names sorted by priority (ties in the mapping's own order)."""
    return sorted(prio, key=prio.__getitem__)


def priorities(model: Any, example: Any = None, *, method: str = "tac", link: LinkModel | None = None,
               training: bool = True, runs: int = 5, backward_factor: float = 2.0, seed: int = 0,
               dag: Dag | None = None) -> dict[str, int]:
    """The priority list for ``model`` (an ``nn.Module`` or a registered model name): ``{param name: int}``, 0 first.

    Captures the DAG (or uses ``dag``), profiles its ops (``runs`` runs, minimum; only ``tac`` needs times)
    and orders the parameters by ``method``. Names are ``model.named_parameters()`` names, so a PS or the
    runtime can look them up directly. ``link`` is the transfer model TAC weighs the parameters with.
    """
    from gradsync.order.capture import capture, example_input

    if isinstance(model, str):
        from gradsync.models import create

        name = model
        example = example_input(name) if example is None else example
        model = create(name)
    else:
        name = type(model).__name__.lower()
    if dag is None:
        dag = capture(model, example, training=training, name=name)
    if ORDERINGS.canonical(method) == "tac" and example is not None and all(op.time_s == 0 for op in dag.ops):
        dag = dag.with_times(profile_ops(model, example, dag, runs=runs), backward_factor=backward_factor)
    return ordering(dag, method, time_oracle(dag, link), seed=seed)
