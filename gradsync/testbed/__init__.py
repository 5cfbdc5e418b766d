"""An emulated cluster on one machine: network namespaces as servers, veth pairs as cables, Linux bridges
as switches and ``tc`` as link rates, so gradient synchronisation runs over real TCP between processes.

``up(topology, rate)`` builds it (needs root and iproute2), ``run(cmd)`` starts one torchrun-style worker
per server, ``probe()`` measures the links, ``down()`` removes everything named ``gs-`` (also after a
crash). The plan (:func:`build_plan`) is plain data and needs no root. See :mod:`gradsync.testbed.build`
for the address plan and routing.
"""

from gradsync.testbed.build import (
    ADDRESS_PREFIX,
    Bridge,
    Nic,
    Route,
    Server,
    TestbedPlan,
    Trunk,
    build_plan,
    parse_delay,
    parse_rate,
    sample_pairs,
)
from gradsync.testbed.control import DEFAULT_STATE_PATH, STATE_ENV, down, load_state, resolve_state_path, status, up
from gradsync.testbed.errors import TestbedError
from gradsync.testbed.netns import PREFIX, available, counters, leftovers
from gradsync.testbed.probe import probe
from gradsync.testbed.runner import run

__all__ = [
    "ADDRESS_PREFIX",
    "DEFAULT_STATE_PATH",
    "PREFIX",
    "STATE_ENV",
    "Bridge",
    "Nic",
    "Route",
    "Server",
    "TestbedError",
    "TestbedPlan",
    "Trunk",
    "available",
    "build_plan",
    "counters",
    "down",
    "leftovers",
    "load_state",
    "parse_delay",
    "parse_rate",
    "probe",
    "resolve_state_path",
    "run",
    "sample_pairs",
    "status",
    "up",
]
