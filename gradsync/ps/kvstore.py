"""The KVStore API in MXNet's shape (MXNET-MPI §4): ``create(kind)``, ``init``, ``push``, ``pull``, ``pushpull``.

Kinds (a registry; ``gradsync.kvstore.create("dist_sync")``):

=================  ==========================================================================================
``local``          one process; pushes of a list (one tensor per local device) are summed, then the rule runs
``dist_sync``      every worker is a PS client; synchronous rounds on the servers
``dist_async``     every worker is a PS client; each push applied when it arrives
``hybrid_sync``    workers grouped into C clients (torch.distributed subgroups): push = allreduce in the
                   client, then its rank 0 pushes; pull = rank 0 pulls, then broadcasts (MXNET-MPI Figs. 4–5)
``hybrid_async``   the same with asynchronous servers (mpi-ASGD, mpi-ESGD)
``collective``     no servers (#servers = 0): pushpull is an allreduce on a schedule gradsync planned
=================  ==========================================================================================

Keys are ints or strings; values are tensors or lists of tensors (summed before they leave the worker);
``out`` may be a tensor or a list, each receiving the value. ``priority`` orders transfers: with
``ordered=True`` a multi-key pull is answered in priority order, enforced at the server (TicTac).

``pull_async(keys, outs, priority)`` starts a multi-key pull and returns a :class:`PullHandle` at once;
``handle.wait(key)`` returns as soon as that key's parts are in its ``out`` tensors (the others may still be
travelling), ``handle.wait_all()`` when all are. With ordered pulls and the priorities of the model's
critical path (``gradsync.order.priorities``), a worker starts its forward pass on the first layers while the
server is still sending the last ones: the overlap TicTac's ordering exists for (TicTac §4). It is
single-threaded: the sockets are pumped inside ``wait`` (ZeroMQ's I/O thread receives in the meantime).

Workers read their place from the environment ``gradsync launch`` sets: ``RANK``, ``WORLD_SIZE``,
``GRADSYNC_PS_SERVERS`` (comma-separated ZeroMQ endpoints), ``GRADSYNC_PS_CLIENTS`` (C),
``GRADSYNC_PS_SECRET`` (shared secret; ``gradsync launch`` makes one per job), ``GRADSYNC_PS_TIMEOUT``
(seconds), ``GRADSYNC_PS_JOB`` (the job id; when it is unset, one derived from torchrun's ``MASTER_ADDR``,
``MASTER_PORT`` and ``TORCHELASTIC_RUN_ID``, so every worker of one job agrees and a second job pointed at
the same servers is refused at ``create`` instead of sharing their rounds).
:class:`KVStoreConfig` and :func:`job_from_env`, which read them, are :mod:`gradsync.ps.kvstore_config`
(re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.comm import lifetime
from gradsync.errors import GradsyncError
from gradsync.ps.client import Heartbeat, PSClient, Request, flat_view, place
from gradsync.ps.env import SERVERS_ENV
from gradsync.ps.kvstore_config import KVStoreConfig, job_from_env
from gradsync.ps.updaters import Updater, create_updater, default_updater
from gradsync.ps.wire import Flag, Key, Message, Op, key_name
from gradsync.registry import Registry

__all__ = ["KVStore", "LocalKVStore", "PSKVStore", "CollectiveKVStore", "KVSTORES", "KVStoreConfig", "PullHandle",
           "create", "job_from_env"]


Value = torch.Tensor | Sequence[torch.Tensor]


def _as_list(keys: Key | Sequence[Key], values: Any, what: str) -> tuple[list[Key], list[Any]]:
    if isinstance(keys, (int, str)):
        return [keys], [values]
    keys = list(keys)
    if isinstance(values, torch.Tensor) or len(values) != len(keys):
        raise GradsyncError(f"{what}: {len(keys)} keys need {len(keys)} values (one tensor or list per key)")
    for k in keys:
        if isinstance(k, bool) or not isinstance(k, (int, str)):
            raise TypeError(f"{what}: keys are int or str, got {type(k).__name__} {k!r}")
    return keys, list(values)


def _reduce(value: Value, what: str) -> torch.Tensor:
    """A worker's contribution: the tensor, or the sum of its per-device list (MXNet's local reduce)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    vs = list(value)
    if not vs or not all(isinstance(v, torch.Tensor) for v in vs):
        raise TypeError(f"{what}: a value is a tensor or a non-empty list of tensors, got {type(value).__name__}")
    total = vs[0].detach().clone()
    for v in vs[1:]:
        if v.shape != total.shape or v.dtype != total.dtype:
            raise GradsyncError(f"{what}: device values differ: {tuple(v.shape)} {v.dtype} vs "
                                f"{tuple(total.shape)} {total.dtype}")
        total += v.detach().to(total.device)
    return total


def _outs(out: Value, what: str) -> list[torch.Tensor]:
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"{what}: out is a tensor or a non-empty list of tensors")
    return outs


class PullHandle:
    """A multi-key pull in flight (:meth:`KVStore.pull_async`).

    ``wait(key)`` returns once ``key``'s value is in every ``out`` tensor given for it; until then those
    tensors hold garbage or old values (do not read them). ``wait_all()`` waits for every key, in the
    order they were given. A failure (server error, timeout) is raised by the wait that meets it, and by
    every later one. Kinds without servers complete the pull at once and return a finished handle.
    """

    def __init__(self, keys: Sequence[Key], wait_key: Callable[[Key], None] | None = None,
                 ready: Callable[[Key], bool] | None = None) -> None:
        self.keys = list(keys)
        self._wait_key = wait_key
        self._ready = ready
        self._finished: set[Key] = set() if wait_key is not None else set(self.keys)

    def wait(self, key: Key) -> None:
        """Block until ``key``'s value has arrived (pumping the sockets meanwhile)."""
        if key in self._finished:
            return
        if key not in self.keys:
            raise GradsyncError(f"wait: key {key_name(key)} is not part of this pull (its keys: "
                                f"{[key_name(k) for k in self.keys[:8]]}{' ...' if len(self.keys) > 8 else ''})")
        assert self._wait_key is not None
        self._wait_key(key)
        self._finished.add(key)

    def wait_all(self) -> None:
        """Block until every key's value has arrived."""
        for k in self.keys:
            self.wait(k)

    def ready(self, key: Key) -> bool:
        """Whether ``key``'s value is in already (from replies handled so far; never blocks)."""
        return key in self._finished or (self._ready is not None and self._ready(key))

    @property
    def done(self) -> bool:
        """Every key has been waited for."""
        return len(self._finished) == len(set(self.keys))


class KVStore:
    """The API every kind shares. Subclasses implement ``_init``, ``_push``, ``_pull`` for lists of keys."""

    kind = "base"

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self._shapes: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    def _known(self, key: Key, t: torch.Tensor, what: str) -> None:
        spec = self._shapes.get(key)
        if spec is None:
            raise GradsyncError(f"{what}: key {key_name(key)} is not initialised; call init({key!r}, value) first")
        if (tuple(t.shape), t.dtype) != spec:
            raise GradsyncError(f"{what}: key {key_name(key)} holds {spec[1]} {spec[0]}, got {t.dtype} {tuple(t.shape)}")

    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        """Store the initial value of each key (rank 0's value counts), then wait for every worker."""
        keys, values = _as_list(key, value, "init")
        tensors = [_reduce(v, "init") if isinstance(v, torch.Tensor) else _reduce(v[0], "init") for v in values]
        for k, t in zip(keys, tensors):
            if k in self._shapes:
                raise GradsyncError(f"init: key {key_name(k)} is already initialised")
            self._shapes[k] = (tuple(t.shape), t.dtype)
        self._init_keys(keys, tensors)

    def _init_keys(self, keys: list[Key], tensors: list[torch.Tensor]) -> None:
        self._init(keys, tensors)
        self.barrier()
        self._after_init(keys, tensors)

    def push(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0) -> None:
        keys, values = _as_list(key, value, "push")
        tensors = [_reduce(v, "push") for v in values]
        for k, t in zip(keys, tensors):
            self._known(k, t, "push")
        self._push(keys, tensors, self._priorities(priority, len(keys)))

    def pull(self, key: Key | Sequence[Key], out: Any, priority: int | Sequence[int] = 0) -> None:
        keys, outs = _as_list(key, out, "pull")
        out_lists = [_outs(o, "pull") for o in outs]
        for k, o in zip(keys, out_lists):
            for t in o:
                self._known(k, t, "pull")
        self._pull(keys, out_lists, self._priorities(priority, len(keys)))

    def pull_async(self, key: Key | Sequence[Key], out: Any, priority: int | Sequence[int] = 0) -> PullHandle:
        """Start pulling ``key`` into ``out`` and return at once; see :class:`PullHandle`."""
        keys, outs = _as_list(key, out, "pull_async")
        out_lists = [_outs(o, "pull_async") for o in outs]
        for k, o in zip(keys, out_lists):
            for t in o:
                self._known(k, t, "pull_async")
        return self._pull_async(keys, out_lists, self._priorities(priority, len(keys)))

    def _pull_async(self, keys: list[Key], outs: list[list[torch.Tensor]], priorities: list[int]) -> PullHandle:
        self._pull(keys, outs, priorities)  # no servers: the values are here already
        return PullHandle(keys)

    def pushpull(self, key: Key | Sequence[Key], value: Any, out: Any = None, priority: int | Sequence[int] = 0) -> None:
        """Push then pull in one call (``out`` defaults to ``value``: the tensors are updated in place).

        PS kinds send one ``PUSHPULL`` request per part and get the round's value as its only reply: one
        exchange per round instead of a push and a pull (MXNet's ``kv.pushpull``)."""
        self.pushpull_async(key, value, out, priority).wait_all()

    def pushpull_async(self, key: Key | Sequence[Key], value: Any, out: Any = None,
                       priority: int | Sequence[int] = 0) -> PullHandle:
        """:meth:`pushpull` that returns once the requests are sent; the values arrive as with
        :meth:`pull_async`. ``value``'s tensors are sent from their own memory: leave them unchanged until
        their key's ``wait`` returns."""
        keys, values = _as_list(key, value, "pushpull")
        tensors = [_reduce(v, "pushpull") for v in values]
        _, outs = _as_list(key, value if out is None else out, "pushpull")
        out_lists = [_outs(o, "pushpull") for o in outs]
        for k, t, o in zip(keys, tensors, out_lists):
            self._known(k, t, "pushpull")
            for t_out in o:
                self._known(k, t_out, "pushpull")
        return self._pushpull_async(keys, tensors, out_lists, self._priorities(priority, len(keys)))

    def _pushpull_async(self, keys: list[Key], values: list[torch.Tensor], outs: list[list[torch.Tensor]],
                        priorities: list[int]) -> PullHandle:
        self._push(keys, values, priorities)
        return self._pull_async(keys, outs, priorities)

    def broadcast(self, key: Key | Sequence[Key], value: Any, out: Any, priority: int | Sequence[int] = 0) -> None:
        """Initialise ``key`` with rank 0's ``value`` and pull it into every worker's ``out``."""
        self.init(key, value)
        self.pull(key, out, priority)

    def set_optimizer(self, name: str, **hyperparameters: Any) -> None:
        """Run the update rule ``name`` where values are stored (see :mod:`gradsync.ps.updaters`)."""
        create_updater(name, **hyperparameters)  # validate here, on every worker, before anything is sent
        self._set_optimizer(name, hyperparameters)
        self.barrier()

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release sockets; the servers keep the values."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def _priorities(priority: int | Sequence[int], n: int) -> list[int]:
        ps = [int(priority)] * n if isinstance(priority, int) else [int(p) for p in priority]
        if len(ps) != n:
            raise GradsyncError(f"{len(ps)} priorities for {n} keys; give one int or one per key")
        return ps

    def _init(self, keys: list[Key], values: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _after_init(self, keys: list[Key], values: list[torch.Tensor]) -> None:
        """After the barrier that ends ``init`` (PS stores learn each key's current round here)."""

    def _push(self, keys: list[Key], values: list[torch.Tensor], priorities: list[int]) -> None:
        raise NotImplementedError

    def _pull(self, keys: list[Key], outs: list[list[torch.Tensor]], priorities: list[int]) -> None:
        raise NotImplementedError

    def _set_optimizer(self, name: str, hyperparameters: dict[str, Any]) -> None:
        raise NotImplementedError


class LocalKVStore(KVStore):
    """One process: a push (the sum of its device list) goes through the rule at once, as a sync round of 1."""

    kind = "local"

    def __init__(self, config: KVStoreConfig) -> None:
        super().__init__(config)
        self.values: dict[Key, torch.Tensor] = {}
        self.states: dict[Key, dict[str, torch.Tensor]] = {}
        self.updater: Updater = default_updater(sync=True)

    def barrier(self) -> None:
        pass

    def _init(self, keys: list[Key], values: list[torch.Tensor]) -> None:
        for k, v in zip(keys, values):
            self.values[k] = v.clone()
            self.states[k] = {}

    def _reduced(self, keys: list[Key], values: list[torch.Tensor]) -> list[torch.Tensor]:
        return values

    def _push(self, keys: list[Key], values: list[torch.Tensor], priorities: list[int]) -> None:
        for k, v in zip(keys, self._reduced(keys, values)):
            self.updater.apply(self.values[k], v, 1, self.states[k])

    def _pull(self, keys: list[Key], outs: list[list[torch.Tensor]], priorities: list[int]) -> None:
        for k, o in zip(keys, outs):
            for t in o:
                t.copy_(self.values[k])

    def _set_optimizer(self, name: str, hyperparameters: dict[str, Any]) -> None:
        self.updater = create_updater(name, **hyperparameters)


class CollectiveKVStore(LocalKVStore):
    """No servers (MXNET-MPI: #servers = 0): a push is an allreduce on gradsync's planned schedule, and the
    rule runs on every worker's copy, identically; init broadcasts rank 0's value."""

    kind = "collective"

    def __init__(self, config: KVStoreConfig, runtime: Any = None) -> None:
        super().__init__(config)
        import gradsync.comm as comm

        if runtime is None:
            if not comm.is_initialized():
                comm.init(timeout_s=config.timeout_s)
            runtime = comm.get_runtime()
        self.runtime = runtime

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def _init(self, keys: list[Key], values: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        super()._init(keys, values)  # the store's own copies, then rank 0's values into them
        for k in keys:
            dist.broadcast(self.values[k], src=0)

    def _reduced(self, keys: list[Key], values: list[torch.Tensor]) -> list[torch.Tensor]:
        from gradsync.comm.collectives import dtype_groups

        summed = [v.clone() for v in values]
        for group in dtype_groups(summed):  # one tensor-list collective per dtype (MXNET-MPI §6.3)
            self.runtime.allreduce(group, op="sum")
        return summed


class PSKVStore(KVStore):
    """Workers as PS clients (dist_*) or grouped into collective clients (hybrid_*), MXNET-MPI Figs. 4–5."""

    kind = "dist"

    def __init__(self, config: KVStoreConfig, *, sync: bool, hybrid: bool) -> None:
        super().__init__(config)
        if not config.servers:
            raise GradsyncError(f"{SERVERS_ENV} is empty: start servers with `gradsync launch --servers S ...` "
                                f"or use kind 'collective' for #servers = 0")
        if not hybrid and config.num_clients != config.num_workers:
            raise GradsyncError(f"dist kinds make every worker a client, but clients={config.clients} of "
                                f"{config.num_workers} workers; use hybrid_sync/hybrid_async for client groups")
        self.sync = sync
        self.hybrid = hybrid
        self.client = PSClient(config.servers, sender=config.client if config.is_master else config.rank,
                               secret=config.secret, timeout_s=config.timeout_s, retry_s=config.retry_s, job=config.job)
        self.client.connect()
        self.heartbeat: Heartbeat | None = None
        if config.elastic:
            if hybrid:
                raise GradsyncError("elastic=True is for dist_sync and dist_async: a hybrid client is a group of "
                                    "workers in collectives, which cannot lose a member and go on")
            self.heartbeat = Heartbeat(config.servers, self.client.sender, interval_s=config.elastic_timeout_s / 4,
                                       secret=config.secret, job=config.job)
        self.pushes: dict[Key, int] = {}
        #: sync keys: how many pushes the round of the value last pulled summed (see round_pushers)
        self._round_pushers: dict[Key, int] = {}
        self._barriers = 0
        self.group = self._client_group() if hybrid else None
        self.pushed_bytes = 0
        self.pulled_bytes = 0
        self._ordered_handle: PullHandle | None = None

    # client groups: torch.distributed subgroups of consecutive ranks (every rank creates every group)
    def _client_group(self) -> Any:
        import torch.distributed as dist

        if not dist.is_initialized():
            lifetime.init_process_group("gloo", self.config.timeout_s, rank=self.rank, world_size=self.num_workers)
        size = self.num_workers // self.config.num_clients
        mine = None
        for c in range(self.config.num_clients):
            g = dist.new_group(list(range(c * size, (c + 1) * size)))
            lifetime.own(g)
            if c == self.config.client:
                mine = g
        self._master_rank = self.config.client * size
        return mine

    def _parts(self, key: Key, t: torch.Tensor) -> list[Any]:
        return place(key, t.numel(), t.element_size(), self.client.num_servers, self.config.slice_bytes,
                     self.config.part_bytes)

    def barrier(self) -> None:
        """Wait until every worker (not client) reaches its next barrier; server 0 counts them. Elastic:
        every worker that has not been silent for ``elastic_timeout_s`` (a dead one is not waited for, and
        a restarted one meets the others at their next barrier)."""
        self._barriers += 1
        self.client.call([self.client.request(0, Op.BARRIER, what=f"barrier {self._barriers}", sender=self.rank,
                                              version=self._barriers, count=self.num_workers,
                                              flags=Flag.ELASTIC if self.config.elastic else Flag.NONE)])

    def _init(self, keys: list[Key], values: list[torch.Tensor]) -> None:
        if self.rank == 0:
            self._send_init(keys, values)

    def _init_keys(self, keys: list[Key], tensors: list[torch.Tensor]) -> None:
        """Elastic: no barrier (a worker may be gone, or be a restarted one that the others passed long
        ago). Rank 0 creates the keys; every other worker joins them, its INIT waiting at the server until
        the key exists, and learns each key's current round (a restarted worker rejoins there)."""
        if not self.config.elastic:
            super()._init_keys(keys, tensors)
        else:
            self._send_init(keys, tensors, join=self.rank != 0)

    def _after_init(self, keys: list[Key], values: list[torch.Tensor]) -> None:
        # The other masters init too, after rank 0 (so its value is the one stored): the server checks that
        # their shape and dtype match and tells them the key's current round. A key that already exists
        # (another store on the same servers, a restarted worker) then continues from where it is instead
        # of having this store's first pushes taken for repeats of rounds long done.
        if self.config.is_master and self.rank != 0:
            self._send_init(keys, values)

    def _send_init(self, keys: list[Key], values: list[torch.Tensor], join: bool = False) -> None:
        flags = Flag.SYNC if self.sync else Flag.NONE
        if self.config.elastic:
            flags |= Flag.ELASTIC
        if join:
            flags |= Flag.JOIN
        reqs = []
        for k, v in zip(keys, values):
            flat = flat_view(v.contiguous())
            for p in self._parts(k, v):
                reqs.append(self.client.request(
                    p.server, Op.INIT, what=f"init of key {key_name(k)}", key=k, tensor=flat[p.offset:p.offset + p.numel],
                    shape=tuple(v.shape), part=p.part, parts=p.parts, offset=p.offset, count=self.config.num_clients,
                    flags=flags, on_reply=self._round_of(k)))
        self.client.call(reqs)

    def _round_of(self, key: Key) -> Callable[[Message], None]:
        def on_reply(msg: Message) -> None:
            self.pushes[key] = max(self.pushes.get(key, 0), msg.version)

        return on_reply

    def push_master(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0) -> None:
        """Push from each client's master only, without the client allreduce: for values that are already
        equal inside a client (elastic averaging pushes the client's weights, MXNET-MPI Fig. 8)."""
        keys, values = _as_list(key, value, "push_master")
        tensors = [_reduce(v, "push_master") for v in values]
        for k, t in zip(keys, tensors):
            self._known(k, t, "push_master")
        self._push(keys, tensors, self._priorities(priority, len(keys)), client_reduce=False)

    def _push(self, keys: list[Key], values: list[torch.Tensor], priorities: list[int], *,
              client_reduce: bool = True) -> None:
        if self.hybrid and client_reduce:
            import torch.distributed as dist

            values = [v.clone() for v in values]
            for v in values:  # the client's tensor allreduce (MXNET-MPI Fig. 4)
                dist.all_reduce(v, group=self.group)
        if not self.config.is_master:
            return
        reqs: list[tuple[Request, int]] = []
        for k, v, prio in zip(keys, values, priorities):
            self.pushes[k] = self.pushes.get(k, 0) + 1
            flat = flat_view(v.contiguous())  # sent from this memory; client.retain copies it for sync rounds
            for p in self._parts(k, v):
                r = self.client.request(p.server, Op.PUSH, what=f"push of key {key_name(k)}", key=k,
                                        tensor=flat[p.offset:p.offset + p.numel], shape=tuple(v.shape), part=p.part,
                                        parts=p.parts, offset=p.offset, version=self.pushes[k], priority=prio)
                reqs.append((r, self.pushes[k]))
            self.pushed_bytes += v.numel() * v.element_size()
        if self.sync:
            for r, round_ in reqs:
                self.client.retain(r, round_)
        self.client.call([r for r, _ in reqs])

    def _pull(self, keys: list[Key], outs: list[list[torch.Tensor]], priorities: list[int]) -> None:
        self._pull_async(keys, outs, priorities).wait_all()

    def _pushpull_async(self, keys: list[Key], values: list[torch.Tensor], outs: list[list[torch.Tensor]],
                        priorities: list[int]) -> PullHandle:
        if self.hybrid:
            import torch.distributed as dist

            values = [v.clone() for v in values]
            for v in values:  # the client's tensor allreduce (MXNET-MPI Fig. 4), then its master's PUSHPULL
                dist.all_reduce(v, group=self.group)
        return self._pull_async(keys, outs, priorities, pushed=values)

    def _pull_async(self, keys: list[Key], outs: list[list[torch.Tensor]], priorities: list[int],
                    pushed: list[torch.Tensor] | None = None) -> PullHandle:
        """Send the pull requests now; the handle pumps the sockets (and, in hybrid kinds, broadcasts each
        key inside the client) when waited on. The master ranks each server's parts by (priority, position):
        with ``ordered`` those ranks are the server's release order (TicTac §5's counter).

        With ``pushed`` (one tensor per key) every request is a ``PUSHPULL`` carrying that part of the push:
        sync rounds need no retained copy, since the request stays in flight (and is sent again to a
        restarted server) until the round's value has arrived."""
        if self._ordered_handle is not None and self.config.ordered:
            # the server keeps one counter per sender: one ordered pull in flight at a time
            previous, self._ordered_handle = self._ordered_handle, None
            previous.wait_all()
        remaining = [0] * len(keys)
        batch = None
        if self.config.is_master:
            reqs = []
            flats: list[torch.Tensor] = []
            if pushed is not None:
                for k, v in zip(keys, pushed):
                    self.pushes[k] = self.pushes.get(k, 0) + 1
                    flats.append(flat_view(v.contiguous()))  # sent from this memory
                    self.pushed_bytes += v.numel() * v.element_size()
            order: dict[int, list[tuple[int, int, Any]]] = {}
            for i, (k, o) in enumerate(zip(keys, outs)):
                for p in self._parts(k, o[0]):
                    order.setdefault(p.server, []).append((priorities[i], i, p))
                    remaining[i] += 1
            for server, items in order.items():
                items.sort(key=lambda x: (x[0], x[1]))
                for rank_on_server, (_, i, p) in enumerate(items):
                    k, o = keys[i], outs[i]
                    flags = Flag.ORDERED if self.config.ordered else Flag.NONE
                    if pushed is None:
                        op, what = Op.PULL, f"pull of key {key_name(k)}"
                        fields: dict[str, Any] = {"version": self.pushes.get(k, 0) if self.sync else 0}
                    else:
                        op, what = Op.PUSHPULL, f"pushpull of key {key_name(k)}"
                        fields = {"version": self.pushes[k], "tensor": flats[i][p.offset:p.offset + p.numel],
                                  "shape": tuple(o[0].shape), "offset": p.offset}
                    reqs.append(self.client.request(
                        server, op, what=what, key=k, part=p.part, parts=p.parts, flags=flags,
                        priority=rank_on_server if self.config.ordered else priorities[i],
                        count=len(items) if self.config.ordered else 0,
                        on_reply=self._copy_into(k, p, o, remaining, i), **fields))
            batch = self.client.start(reqs)
        where: dict[Key, list[int]] = {}
        for i, k in enumerate(keys):
            where.setdefault(k, []).append(i)

        def arrived(key: Key) -> bool:
            return all(remaining[i] == 0 for i in where[key])

        def wait_key(key: Key) -> None:
            if batch is not None:
                self.client.wait(batch, until=lambda: arrived(key))
            if self.hybrid:
                import torch.distributed as dist

                for i in where[key]:  # the client's broadcast (MXNET-MPI Fig. 5), key by key
                    o = outs[i]
                    dist.broadcast(o[0], src=self._master_rank, group=self.group)
                    for t in o[1:]:
                        t.copy_(o[0])

        handle = PullHandle(keys, wait_key, arrived if batch is not None else None)
        if self.config.ordered:
            self._ordered_handle = handle
        return handle

    def _copy_into(self, key: Key, part: Any, outs: list[torch.Tensor], remaining: list[int] | None = None,
                   index: int = 0) -> Callable[[Message], None]:
        def on_reply(msg: Message) -> None:
            if msg.op != Op.VALUE or msg.numel != part.numel or msg.dtype != outs[0].dtype:
                raise GradsyncError(f"pull of key {key_name(key)}: the server sent {msg.op.name} {msg.dtype} "
                                    f"[{msg.numel}] for a part of {part.numel} {outs[0].dtype}")
            src = msg.tensor()
            for t in outs:
                flat_view(t)[part.offset:part.offset + part.numel].copy_(src)
            if msg.pushed:
                self._round_pushers[key] = msg.pushed
            self.pulled_bytes += src.numel() * src.element_size()
            self.client.release(part.server, key, part.part, msg.version)
            if remaining is not None:
                remaining[index] -= 1

        return on_reply

    def round_pushers(self, key: Key) -> int:
        """How many clients' pushes the round behind ``key``'s last pulled value summed (0: not known, an
        async key, or nothing pulled yet). The key's pushers, unless an elastic server dropped a silent
        client; divide by it to average over the pushes there were. (A key in parts reports its last
        part's; the parts agree unless servers dropped a client at different rounds.)"""
        return self._round_pushers.get(key, 0)

    def _set_optimizer(self, name: str, hyperparameters: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        spec = {"name": name, "hyperparameters": hyperparameters}
        self.client.call([self.client.request(s, Op.SET_OPTIMIZER, what=f"set_optimizer({name!r})", json_payload=spec)
                          for s in range(self.client.num_servers)])

    def status(self, key: Key | None = None) -> list[Any]:
        """What each server reports (for a key: version and the round's missing pushes)."""
        out: list[Any] = []
        reqs = [self.client.request(s, Op.STATUS, what="status", key=key, on_reply=lambda m: out.append(m.json()))
                for s in range(self.client.num_servers)]
        self.client.call(reqs)
        return out

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.close()
        self.client.close()


@dataclass(frozen=True)
class _Kind:
    factory: Callable[[KVStoreConfig], KVStore]
    summary: str


KVSTORES: Registry[_Kind] = Registry("KVStore kind", GradsyncError)
KVSTORES.add("local", _Kind(LocalKVStore, "one process; per-device values summed, rule applied locally"))
KVSTORES.add("dist_sync", _Kind(lambda c: PSKVStore(c, sync=True, hybrid=False),
                                "every worker a PS client, synchronous rounds (dist-SGD)"))
KVSTORES.add("dist_async", _Kind(lambda c: PSKVStore(c, sync=False, hybrid=False),
                                 "every worker a PS client, pushes applied on arrival (dist-ASGD, dist-ESGD)"))
KVSTORES.add("hybrid_sync", _Kind(lambda c: PSKVStore(c, sync=True, hybrid=True),
                                  "collective clients of workers, synchronous servers (mpi-SGD)"))
KVSTORES.add("hybrid_async", _Kind(lambda c: PSKVStore(c, sync=False, hybrid=True),
                                   "collective clients of workers, asynchronous servers (mpi-ASGD, mpi-ESGD)"))
KVSTORES.add("collective", _Kind(CollectiveKVStore, "no servers: allreduce on a planned schedule"))


def create(kind: str = "local", **config: Any) -> KVStore:
    """A KVStore of ``kind``; ``config`` overrides :class:`KVStoreConfig` fields read from the environment.

    ``elastic=True`` (``dist_sync``, ``dist_async``): the servers drop a worker that stops answering from
    the sync rounds after ``GRADSYNC_PS_ELASTIC_TIMEOUT`` seconds, the others go on with the pushes a
    round has, and a restarted worker rejoins by creating its store and calling ``init`` again (its
    first pull returns the current value). See :mod:`gradsync.ps.server`."""
    spec = KVSTORES.get(kind)
    if config.get("elastic") and kind not in ("dist_sync", "dist_async"):
        raise GradsyncError(f"elastic=True is for dist_sync and dist_async, not {kind!r}: only PS rounds can go on "
                            f"without a worker")
    return spec.factory(KVStoreConfig.from_env(**config))
