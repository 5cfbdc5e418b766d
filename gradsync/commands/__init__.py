"""Subcommands of the ``gradsync`` command that bind several packages together (each has ``add_parser``).

They sit at the top with :mod:`gradsync.cli`: ``gradsync order`` captures a model (``order``), orders its
transfers and simulates the iteration (``sim``), and neither of those packages may know the other's
command line.
"""
