"""One warm HiGHS instance per column-generation master (SciPy's vendored ``highspy``, a private API).

Why. Column generation re-solves its restricted master after every batch of new columns. New columns
enter at zero, so the previous optimal basis stays primal feasible and primal simplex needs only a few
pivots -- if the same HiGHS object is kept between solves. :func:`scipy.optimize.linprog` builds and checks
a fresh model each time (on a DGX-1's out-tree master that cost more than the solves). SciPy >= 1.15 vendors
highspy; without it, or if its private API changes shape, callers fall back to ``linprog``.
:func:`solve_optimal` is the masters' one re-solve and check that HiGHS ended optimal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from gradsync.errors import PlanError

#: Stands for "import highspy when first needed" where a caller keeps a module-level handle (tests replace it
#: with None to take the ``linprog`` path): importing ``scipy.optimize`` costs every process ~0.5 s, and most
#: processes (every worker of a job) never solve an LP.
LAZY: Any = object()

__all__ = ["LAZY", "highs_module", "linprog", "solve_optimal", "warm_simplex"]


@functools.cache
def _load() -> Any | None:
    try:  # SciPy >= 1.15 vendors highspy; its Highs object keeps the basis between solves.
        from scipy.optimize._highspy import _core
    except ImportError:  # pragma: no cover - older SciPy: solve each master from scratch with linprog
        return None
    return _core


def highs_module(handle: Any = LAZY) -> Any | None:
    """SciPy's vendored highspy core (None where missing), imported at the first call; ``handle``: a caller's
    module-level override (``LAZY`` unless a test set it)."""
    return _load() if handle is LAZY else handle


def linprog(*args: Any, **kwargs: Any) -> Any:
    """:func:`scipy.optimize.linprog`, imported at the first call."""
    from scipy.optimize import linprog as solve

    return solve(*args, **kwargs)


def warm_simplex(highs: Any, build: Callable[[Any], None]) -> Any | None:
    """A quiet ``Highs`` object set for warm primal simplex re-solves, with ``build(h)`` adding the empty
    master (rows, fixed columns, options of its own); None when ``highs`` (the module, normally
    :func:`highs_module`'s) is missing or its private API does not have the shape used here.

    Tolerances 1e-10: HiGHS's default 1e-7 lets a row exceed its bound by that much, and the plan's true
    cost would then sit ~1e-9 (relative) above the master's, more than the certified gap allows.
    """
    if highs is None:
        return None
    try:
        h = highs._Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("presolve", "off")
        h.setOptionValue("simplex_strategy", 4)  # primal: new columns keep the old basis primal feasible
        h.setOptionValue("primal_feasibility_tolerance", 1e-10)
        h.setOptionValue("dual_feasibility_tolerance", 1e-10)
        build(h)
    except (AttributeError, TypeError):  # pragma: no cover - a private API that changed shape
        return None
    return h


def solve_optimal(h: Any, what: str, *, simplex_retry: bool = False) -> Any:
    """Run the master ``h`` (from :func:`warm_simplex`) and return its solution; :class:`PlanError` naming
    ``what`` (the LP) unless HiGHS ends optimal, since the masters are always feasible and bounded.

    ``simplex_retry``: a run that ends short of optimal is run once more with the simplex solver -- HiGHS's
    interior point method can stall on degenerate masters; simplex always ends.
    """
    optimal = _load().HighsModelStatus.kOptimal  # h exists: the module loaded
    h.run()
    status = h.getModelStatus()
    if status != optimal and simplex_retry:
        h.setOptionValue("solver", "simplex")
        h.run()
        status = h.getModelStatus()
    if status != optimal:  # pragma: no cover - always feasible and bounded
        raise PlanError(f"HiGHS failed on the {what}: {h.modelStatusToString(status)}")
    return h.getSolution()
