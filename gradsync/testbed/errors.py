"""The one error the testbed raises, so the CLI prints it as a one-line ``gradsync: error: ...``."""

from __future__ import annotations

from gradsync.errors import GradsyncError

__all__ = ["TestbedError"]


class TestbedError(GradsyncError):
    """The emulated cluster cannot be built, run or removed; the message says why and what to do."""

    __test__ = False  # not a pytest test class, despite the name
