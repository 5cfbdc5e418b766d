"""gradsync: plan, simulate and run gradient synchronisation on one schedule representation.

Topology --plan--> Schedule --simulate/run--> time; ordering (TicTac) and compression (MergeComp) act on
the schedule's transfers. See ARCHITECTURE in the README for the package map.
"""

from gradsync.errors import GradsyncError, PlanError, ScheduleError, TopologyError

__version__ = "0.1.0"

__all__ = ["GradsyncError", "PlanError", "ScheduleError", "TopologyError", "__version__"]
