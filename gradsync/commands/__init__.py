"""The ``gradsync`` subcommands, one module per subcommand, named after it (``plan.py`` is ``gradsync plan``).

Each module has ``add_parser(subparsers)``, which adds its subcommand with its handler as ``func`` (the
handler takes the parsed arguments and returns the exit code), and nothing else of the command line.
:mod:`gradsync.cli` builds the parser from its list of their names (importing only the one a command line
names) and runs the handler. What a command
does belongs to its package (``testbed``, ``ps.launch``, ``order``, ``sim``); here are only its arguments,
its printing and the imports that bind packages which may not know each other (``order`` + ``sim``). A
command's heavy imports (torch, ZeroMQ, matplotlib) happen in its handler, so ``gradsync --help`` stays
light. Modules whose name starts with ``_`` are helpers shared by the commands.
"""
