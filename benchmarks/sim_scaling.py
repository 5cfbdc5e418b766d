"""How long the flow-level simulator takes on large schedules: a thin wrapper over ``gradsync bench sim-scaling``.

The cases, the goal (~250k transfers with ~60k active flows in < 30 s on 2 cores) and the output files
(``sim_scaling.json`` and ``sim_scaling.png`` under ``--out``, default ``benchmarks/results``) are documented
in :mod:`gradsync.sim.bench`. Run from the repository root::

    .venv/bin/python -m benchmarks.sim_scaling            # default cases
    .venv/bin/python -m benchmarks.sim_scaling --quick    # seconds
    .venv/bin/python -m benchmarks.sim_scaling --large    # adds BML on BCube(32, 2), 4.2M transfers
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gradsync.sim.bench import sim_scaling_main


def main(argv: Sequence[str] | None = None) -> int:
    return sim_scaling_main(argv)


if __name__ == "__main__":
    sys.exit(main())
