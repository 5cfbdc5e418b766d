"""One warm HiGHS instance per column-generation master (SciPy's vendored ``highspy``, a private API).

Why. Column generation re-solves its restricted master after every batch of new columns. New columns
enter at zero, so the previous optimal basis stays primal feasible and primal simplex needs only a few
pivots -- if the same HiGHS object is kept between solves. :func:`scipy.optimize.linprog` builds and checks
a fresh model each time (on a DGX-1's out-tree master that cost more than the solves). SciPy >= 1.15 vendors
highspy; without it, or if its private API changes shape, callers fall back to ``linprog``.
:func:`solve_optimal` is the masters' one re-solve and check that HiGHS ended optimal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradsync.errors import PlanError

try:  # SciPy >= 1.15 vendors highspy; its Highs object keeps the basis between solves.
    from scipy.optimize._highspy import _core as HIGHS
except ImportError:  # pragma: no cover - older SciPy: solve each master from scratch with linprog
    HIGHS = None

__all__ = ["HIGHS", "solve_optimal", "warm_simplex"]


def warm_simplex(highs: Any, build: Callable[[Any], None]) -> Any | None:
    """A quiet ``Highs`` object set for warm primal simplex re-solves, with ``build(h)`` adding the empty
    master (rows, fixed columns, options of its own); None when ``highs`` (the module, normally
    :data:`HIGHS`) is missing or its private API does not have the shape used here.

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
    optimal = HIGHS.HighsModelStatus.kOptimal
    h.run()
    status = h.getModelStatus()
    if status != optimal and simplex_retry:
        h.setOptionValue("solver", "simplex")
        h.run()
        status = h.getModelStatus()
    if status != optimal:  # pragma: no cover - always feasible and bounded
        raise PlanError(f"HiGHS failed on the {what}: {h.modelStatusToString(status)}")
    return h.getSolution()
