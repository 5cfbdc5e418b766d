"""TicTac: order parameter transfers by the model's critical path, and measure how good an order is.

The flow is TicTac's §5 pipeline, on PyTorch models::

    dag = capture(model, example)                         # tracing: ops, parameter reads, backward order
    dag = dag.with_times(profile_ops(model, example, dag))  # time oracle: min of 5 runs per op
    oracle = time_oracle(dag, LinkModel(bandwidth_GBps=1.0))  # + transfers: α + bytes/β
    prio = tac(dag, oracle)                               # or tic(dag): {param name: priority}, 0 first

or in one call ``priorities(model, example, method="tac")``. The priority list is what the parameter
server's and the runtime's enforcement consume. ``metrics(dag, oracle, makespan)`` gives U, L, E, S;
:func:`gradsync.sim.simulate_iteration` gives the makespan of an order on W workers.
"""

from gradsync.order.capture import CAPTURES, capture, capture_autograd, capture_fx, example_input, grad_ready_order
from gradsync.order.dag import DAG_TYPE, KIND_BACKWARD, KIND_SEND, Dag, DagError, Op, Param, training_dag
from gradsync.order.oracle import LinkModel, TimeOracle, bandwidth_for_ratio, profile_ops, time_oracle
from gradsync.order.priorities import ORDERINGS, check_priorities, order_of, ordering, priorities
from gradsync.order.tictac import (
    Metrics,
    RecvProperties,
    before,
    dependency_matrix,
    efficiency,
    lower_bound,
    metrics,
    properties,
    rank_by,
    speedup,
    straggler_percent,
    tac,
    tac_order,
    tic,
    upper_bound,
)

__all__ = [
    "CAPTURES", "DAG_TYPE", "KIND_BACKWARD", "KIND_SEND", "ORDERINGS",
    "Dag", "DagError", "LinkModel", "Metrics", "Op", "Param", "RecvProperties", "TimeOracle",
    "bandwidth_for_ratio", "before", "capture", "capture_autograd", "capture_fx", "check_priorities",
    "dependency_matrix", "efficiency", "example_input", "grad_ready_order", "lower_bound", "metrics",
    "order_of", "ordering", "priorities", "profile_ops", "properties", "rank_by", "speedup",
    "straggler_percent", "tac", "tac_order", "tic", "time_oracle", "training_dag", "upper_bound",
]
