"""gradsync's benchmarks: measurements that write JSON and plots to ``benchmarks/results`` (never part of the tests).

A package of the source checkout, not of the installed ``gradsync`` (``pyproject.toml`` ships ``gradsync*``
only): the benchmarks read ``benchmarks/topologies``, write ``benchmarks/results`` and some plan against git
worktrees of the checkout. ``gradsync bench NAME`` runs them from a checkout (``gradsync.sim.bench`` marks each
one that needs it and names the fix when there is none); from the repository root each also runs as
``python -m benchmarks.NAME``.

Rules: modules import each other as ``benchmarks.x`` (never by bare name, never by editing ``sys.path``), shared
helpers live in :mod:`benchmarks.common` alone, and no two benchmark modules import each other (a test checks
both). Worker processes are started by file path or with ``-m``, with the checkout root on their ``PYTHONPATH``.
"""
