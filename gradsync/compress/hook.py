"""The compressed DDP hook's documented import path; the hook itself lives in :mod:`gradsync.train.compressed_hook`.

``from gradsync.compress.hook import CompressionHookState, compression_hook`` keeps working for users. This
is the one import from the algorithms up into the training layer, and the layer contract in pyproject.toml
names it; nothing in gradsync imports this module.
"""

from gradsync.train.compressed_hook import HOOK_MERGE_MODES, CompressionHookState, compression_hook

__all__ = ["HOOK_MERGE_MODES", "CompressionHookState", "compression_hook"]
