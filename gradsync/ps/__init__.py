"""Parameter server and KVStore (MXNET-MPI): ZeroMQ servers, PS / collective clients, SGD variants.

``wire``: the frame format (header + raw tensor bytes, a MAC (AES-GMAC, or HMAC-SHA256) over a job id, session and sequence number;
no pickle). ``server``: one server process. ``client``: placement of keys on servers and the request/retry
loop. ``kvstore``: the MXNet-style API (``create(kind)``). ``updaters``: the server-side update rules. ``launch``: servers + workers on this
machine. The training loops on a KVStore (dist/mpi SGD, ASGD, ESGD) and the pull/forward overlap are in
:mod:`gradsync.train` (``ps_trainer``, ``ps_overlap``): this engine knows nothing of training.
"""

from typing import Any

# Loaded on first use: `gradsync launch` imports gradsync.ps.launch without paying for torch and ZeroMQ.
_EXPORTS = {
    "KVSTORES": "kvstore", "CollectiveKVStore": "kvstore", "KVStore": "kvstore", "KVStoreConfig": "kvstore",
    "LocalKVStore": "kvstore", "PSKVStore": "kvstore", "create": "kvstore", "Server": "server",
    "ServerConfig": "server", "UPDATERS": "updaters", "create_updater": "updaters", "Message": "wire", "Op": "wire",
    "WireError": "wire", "decode": "wire", "encode": "wire",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"gradsync.ps.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'gradsync.ps' has no attribute {name!r}")
