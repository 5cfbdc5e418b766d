"""MXNET-MPI §5's training algorithms on the KVStore, as optimizer wrappers: call ``step()`` after backward.

==============  ================  ==========================================================================
name            KVStore kind      what one step does (MXNET-MPI Figs. 6–8)
==============  ================  ==========================================================================
``dist-sgd``    dist_sync         push gradients, pull their sum, update locally with ``lr/mini_batch``
``mpi-sgd``     hybrid_sync       the same, gradients first allreduced inside each client
``dist-asgd``   dist_async        push gradients; the server runs SGD; pull the new weights
``mpi-asgd``    hybrid_async      the same from collective clients
``dist-esgd``   dist_async        local SGD; every ``interval`` steps push weights, the server moves the
                                  center by eq. (2), pull it and move towards it by eq. (3)
``mpi-esgd``    hybrid_async      the same, with synchronous SGD inside each client between exchanges
``local-sgd``   collective        local SGD; every ``interval`` steps average the weights (no servers)
``allreduce``   collective        #servers = 0: pushpull is an allreduce of the gradients (pure MPI)
==============  ================  ==========================================================================

Keys are the parameter names; every step moves all of them in one multi-key call, so the parts of every
key travel to all servers at once. Rank 0's initial weights are everyone's (``init`` + ``pull``).

TicTac is one argument: ``priorities=gradsync.order.priorities(model, example, method="tac")``
(or ``create_trainer(..., priorities="tac", example=x)``, computed once here, before training) switches the
store's ordered pulls on and gives every key its rank, so the server sends each worker's pulls in the
model's critical-path order. ``overlap=True`` (dist-sgd and dist-asgd patterns) ends ``step()`` once the
pull has been *started*; forward pre-hooks (:mod:`gradsync.train.ps_overlap`, attached by ``create_trainer`` or
``trainer.attach(model)``) wait for each layer's own parameters, so the next forward overlaps the pulls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.errors import GradsyncError
from gradsync.ps.kvstore import KVStore, PSKVStore, PullHandle, create
from gradsync.registry import Registry

__all__ = ["AlgorithmSpec", "ALGORITHMS", "PSTrainer", "create_trainer"]


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm needs: its KVStore kind and which of the three exchange patterns it runs."""

    kind: str
    pattern: str  # "gradients" (sync sum), "server-sgd", "elastic", "average", "allreduce"
    summary: str


ALGORITHMS: Registry[AlgorithmSpec] = Registry("PS training algorithm", GradsyncError)
for _name, _spec in {
    "dist-sgd": AlgorithmSpec("dist_sync", "gradients", "synchronous SGD, every worker a PS client"),
    "mpi-sgd": AlgorithmSpec("hybrid_sync", "gradients", "synchronous SGD from collective clients"),
    "dist-asgd": AlgorithmSpec("dist_async", "server-sgd", "asynchronous SGD, the server updates"),
    "mpi-asgd": AlgorithmSpec("hybrid_async", "server-sgd", "asynchronous SGD from collective clients"),
    "dist-esgd": AlgorithmSpec("dist_async", "elastic", "elastic averaging SGD, every worker a client"),
    "mpi-esgd": AlgorithmSpec("hybrid_async", "elastic", "elastic averaging from collective clients"),
    "local-sgd": AlgorithmSpec("collective", "average", "local SGD, weights averaged every interval"),
    "allreduce": AlgorithmSpec("collective", "allreduce", "synchronous SGD by allreduce, no servers"),
}.items():
    ALGORITHMS.add(_name, _spec)


class PSTrainer:
    """Runs ``algorithm`` for ``model``'s parameters: ``zero_grad()``, backward, then ``step()``.

    ``lr``: the SGD step. ``interval``/``alpha``: elastic averaging's exchange period and α (MXNET-MPI uses
    64 and an α the user tunes). ``kv``: an existing store (default: created from the environment).
    ``priorities``: ``{param name: int}`` (0 = first), e.g. ``gradsync.order.priorities(model, example)``;
    it turns on ordered pulls (also on a ``kv`` given) so the PS enforces that order. ``overlap``: return
    from ``step()`` with the pull in flight; the parameters are completed by the hooks of
    :meth:`attach` (or :meth:`synchronize`), layer by layer.
    """

    def __init__(self, algorithm: str, params: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float = 0.1,
                 interval: int = 4, alpha: float = 0.5, kv: KVStore | None = None, prefix: str = "",
                 priorities: Mapping[str, int] | None = None, overlap: bool = False, **kv_config: Any) -> None:
        self.name = ALGORITHMS.canonical(algorithm)
        self.spec = ALGORITHMS.get(algorithm)
        if lr <= 0 or interval < 1 or not 0 < alpha <= 1:
            raise GradsyncError(f"lr={lr} must be > 0, interval={interval} >= 1 and alpha={alpha} in (0, 1]")
        self.named = [(n, p) for n, p in params if p.requires_grad]
        if not self.named:
            raise GradsyncError("no trainable parameters")
        self.keys = [prefix + n for n, _ in self.named]
        self.params = [p for _, p in self.named]
        self.lr, self.interval, self.alpha = lr, interval, alpha
        self.priority = self._check_priorities(priorities)
        if overlap and self.spec.pattern not in ("gradients", "server-sgd"):
            raise GradsyncError(f"overlap=True needs a per-step pull (dist-sgd, mpi-sgd, dist-asgd, mpi-asgd); "
                                f"{self.name} exchanges every {interval} steps: drop overlap")
        self.overlap = overlap
        if priorities is not None:
            if self.spec.kind == "collective":
                raise GradsyncError(f"priorities are enforced by the parameter server; {self.name} has none "
                                    f"(use a dist-*/mpi-* algorithm, or the runtime's priorities)")
            kv_config["ordered"] = True
        self.kv = kv or create(self.spec.kind, **kv_config)
        if priorities is not None and isinstance(self.kv, PSKVStore) and not self.kv.config.ordered:
            self.kv.config = dataclasses.replace(self.kv.config, ordered=True)
        self.iteration = 0
        self.exchanges = 0
        self._handle: PullHandle | None = None
        self.waits: Any = None  # the forward pre-hooks of attach(), when create_trainer attached them
        self._finish: dict[str, tuple[torch.nn.Parameter, torch.Tensor | None]] = {}
        self._init()

    def _check_priorities(self, priorities: Mapping[str, int] | None) -> list[int]:
        if priorities is None:
            return [0] * len(self.named)
        if isinstance(priorities, str):
            raise GradsyncError(f"priorities={priorities!r}: PSTrainer takes the list itself; pass "
                                f"gradsync.order.priorities(model, example, method={priorities!r}) or use "
                                f"create_trainer(algorithm, model, priorities={priorities!r}, example=x)")
        names = [n for n, _ in self.named]
        missing = [n for n in names if n not in priorities]
        if missing:
            raise GradsyncError(f"priorities lack {len(missing)} trainable parameter(s), e.g. {missing[:3]}; give "
                                f"every name of model.named_parameters() a priority (0 = first)")
        bad = {n: priorities[n] for n in names if isinstance(priorities[n], bool) or not isinstance(priorities[n], int)
               or priorities[n] < 0}
        if bad:
            raise GradsyncError(f"priorities must be integers >= 0, got {dict(list(bad.items())[:3])}")
        return [int(priorities[n]) for n in names]

    @property
    def client_size(self) -> int:
        kv = self.kv
        if isinstance(kv, PSKVStore) and kv.hybrid:
            return kv.num_workers // kv.config.num_clients
        return 1

    def _init(self) -> None:
        values = [p.detach().clone() for p in self.params]
        self.kv.init(self.keys, values)
        # everyone starts from rank 0's weights
        self.kv.pull(self.keys, [p.data for p in self.params], self.priority)
        pattern = self.spec.pattern
        if pattern == "server-sgd":
            # the server sees one push per client: the sum of client_size gradients, averaged here
            self.kv.set_optimizer("sgd", lr=self.lr, rescale_grad=1.0 / self.client_size)
        elif pattern == "elastic":
            self.kv.set_optimizer("elastic", alpha=self.alpha)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        self.synchronize()
        self.iteration += 1
        getattr(self, f"_step_{self.spec.pattern.replace('-', '_')}")()

    def attach(self, model: torch.nn.Module) -> Any:
        """Forward pre-hooks that complete each layer's parameters before it runs (``overlap=True``);
        returns a :class:`~gradsync.train.ps_overlap.PullWaits` (``remove()`` takes them off)."""
        from gradsync.train.ps_overlap import attach_pull_waits

        ids = {id(p): k for p, k in zip(self.params, self.keys)}
        table = {n: ids[id(p)] for n, p in model.named_parameters() if id(p) in ids}
        return attach_pull_waits(model, lambda: self._handle, table, on_ready=self._complete)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Complete every parameter whose pull is still in flight (``overlap``); a no-op otherwise."""
        if self._handle is not None:
            for k in self.keys:
                self._complete(k)
            self._handle = None

    @torch.no_grad()
    def _complete(self, key: str) -> None:
        if self._handle is None or key not in self._finish:
            return
        self._handle.wait(key)
        p, g = self._finish.pop(key)
        if g is not None:
            p.add_(g, alpha=-self.lr / self._pushed_workers(key))

    def _pushed_workers(self, key: str) -> int:
        """The workers whose gradients the pulled sum of ``key`` holds: all of them, unless an elastic
        server completed the round without a silent one (then the mean is over those who pushed)."""
        pushed = self.kv.round_pushers(key) if isinstance(self.kv, PSKVStore) else 0
        return pushed * self.client_size if pushed else self.kv.num_workers

    def _local_sgd(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.add_(g, alpha=-self.lr)

    def _step_gradients(self) -> None:  # dist-sgd / mpi-sgd: Fig. 6
        grads = self._grads()
        out = [torch.empty_like(g) for g in grads]
        # one PUSHPULL exchange per part (the push, then the round's value); zero_grad replaces the
        # gradients rather than writing into them, so they stay as sent until their keys arrive
        if self.overlap:
            self._handle = self.kv.pushpull_async(self.keys, grads, out, self.priority)
            self._finish = {k: (p, g) for k, p, g in zip(self.keys, self.params, out)}
        else:
            self.kv.pushpull(self.keys, grads, out, self.priority)
            for k, p, g in zip(self.keys, self.params, out):
                p.add_(g, alpha=-self.lr / self._pushed_workers(k))
        self.exchanges += 1

    def _step_allreduce(self) -> None:
        self._step_gradients()

    def _step_server_sgd(self) -> None:  # dist-asgd / mpi-asgd: Fig. 7
        if self.overlap:  # a key is written only until its wait returns, i.e. before its layer runs
            self._handle = self.kv.pushpull_async(self.keys, self._grads(), [p.data for p in self.params],
                                                  self.priority)
            self._finish = {k: (p, None) for k, p in zip(self.keys, self.params)}
        else:
            self.kv.pushpull(self.keys, self._grads(), [p.data for p in self.params], self.priority)
        self.exchanges += 1

    def _client_mean(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        kv = self.kv
        if isinstance(kv, PSKVStore) and kv.hybrid and self.client_size > 1:
            import torch.distributed as dist

            grads = [g.clone() for g in grads]
            for g in grads:
                dist.all_reduce(g, group=kv.group)
                g.div_(self.client_size)
        return grads

    def _step_elastic(self) -> None:  # dist-esgd / mpi-esgd: Fig. 8
        self._local_sgd(self._client_mean(self._grads()))
        if self.iteration % self.interval:
            return
        kv = self.kv
        assert isinstance(kv, PSKVStore)
        centers = [torch.empty_like(p) for p in self.params]
        # weights are equal inside a client: its master pushes them as they are (eq. 2 on the server)
        kv.push_master(self.keys, [p.detach() for p in self.params])
        kv.pull(self.keys, centers, self.priority)
        for p, c in zip(self.params, centers):  # eq. (3)
            p.sub_(p - c, alpha=self.alpha)
        self.exchanges += 1

    def _step_average(self) -> None:  # local SGD
        self._local_sgd(self._grads())
        if self.iteration % self.interval:
            return
        out = [torch.empty_like(p) for p in self.params]
        self.kv.pushpull(self.keys, [p.detach().clone() for p in self.params], out, self.priority)
        for p, o in zip(self.params, out):
            p.copy_(o / self.kv.num_workers)
        self.exchanges += 1

    def close(self) -> None:
        self.synchronize()
        self.kv.close()


def create_trainer(algorithm: str, model: torch.nn.Module, *, priorities: str | Mapping[str, int] | None = None,
                   example: Any = None, **options: Any) -> PSTrainer:
    """A :class:`PSTrainer` over ``model.named_parameters()``.

    ``priorities`` may name an ordering (``"tac"``, ``"tic"``, ``"fifo"``, ``"random"``): the list is then
    computed here, once, by :func:`gradsync.order.priorities` on ``model`` and ``example`` (an input
    batch; ``tac`` profiles the ops on it). With ``overlap=True`` the forward pre-hooks are attached.
    """
    if isinstance(priorities, str):
        from gradsync.order import priorities as order_priorities

        if example is None:
            raise GradsyncError(f"priorities={priorities!r} captures the model's DAG: pass example=<an input batch>")
        priorities = order_priorities(model, example, method=priorities)
    trainer = PSTrainer(algorithm, model.named_parameters(), priorities=priorities, **options)
    if trainer.overlap:
        trainer.waits = trainer.attach(model)
    return trainer
