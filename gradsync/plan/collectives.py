"""Reduce-scatter and allgather as the two halves of an allreduce on equal rank-order shards.

Ring (Baidu/Horovod), multi-ring, the co-located parameter server, BML and the hierarchical walk all
allreduce by a reduce-scatter whose chunk ``c`` completes at ``root(c)`` followed by an allgather that copies it
back out from there, and every rank roots exactly ``1/N`` of the buffer. Their reduce-scatter is the reducing
transfers alone and their allgather the copying ones, once the chunks are laid out so that rank ``r``'s
chunks tile its shard ``[r/N, (r+1)/N)`` (:mod:`gradsync.plan.schedule`): the link loads split exactly,
so each half costs what that phase of the allreduce costs.
"""

from __future__ import annotations

from gradsync.errors import PlanError
from gradsync.plan.schedule import SHARDED, Chunk, Schedule, Transfer

__all__ = ["allreduce_half", "join_halves", "shard_layout"]


def shard_layout(schedule: Schedule) -> tuple[tuple[Chunk, ...], list[int]]:
    """Chunks reordered so that rank ``r``'s tile its shard, and ``new_id[old_id]``.

    Needs every chunk rooted and every rank rooting ``1/N`` of the buffer (within 1e-9).
    """
    n = schedule.world_size
    owned = [0.0] * n
    for i, ch in enumerate(schedule.chunks):
        if ch.root is None:
            raise PlanError(f"{schedule.algorithm}: chunk {i} has no root, so its allreduce has no reduce-scatter half")
        owned[ch.root] += ch.size
    bad = [r for r in range(n) if abs(owned[r] - 1.0 / n) > 1e-9]
    if bad:
        raise PlanError(f"{schedule.algorithm}: rank {bad[0]} roots {owned[bad[0]]:.6g} of the buffer, not 1/{n}; "
                        f"its allreduce does not split into equal shards")
    new_id = [0] * len(schedule.chunks)
    chunks: list[Chunk] = []
    for r in range(n):
        mine = [i for i, ch in enumerate(schedule.chunks) if ch.root == r]
        offset = r / n
        for j, i in enumerate(mine):
            size = (r + 1) / n - offset if j == len(mine) - 1 else schedule.chunks[i].size
            new_id[i] = len(chunks)
            chunks.append(Chunk(offset, size, r))
            offset += size
    return tuple(chunks), new_id


def allreduce_half(schedule: Schedule, collective: str) -> Schedule:
    """The ``reduce_scatter`` (reducing transfers) or ``allgather`` (copying transfers, steps from 0) half.

    Every reducing transfer of a chunk must come before its copies (step order), which is what makes the
    allreduce a reduce-scatter followed by an allgather; :meth:`Schedule.check` then proves the half.
    """
    if collective not in SHARDED:
        raise PlanError(f"collective {collective!r} is not a half of an allreduce; use one of {SHARDED}")
    if schedule.collective != "allreduce":
        raise PlanError(f"{schedule.algorithm}: a {schedule.collective!r} schedule has no {collective} half")
    last_reduce: dict[int, int] = {}
    first_copy: dict[int, int] = {}
    for t in schedule.transfers:
        if t.reduce:
            last_reduce[t.chunk] = max(last_reduce.get(t.chunk, -1), t.step)
        else:
            first_copy[t.chunk] = min(first_copy.get(t.chunk, t.step), t.step)
    mixed = [c for c in last_reduce if c in first_copy and last_reduce[c] >= first_copy[c]]
    if mixed:
        raise PlanError(f"{schedule.algorithm}: chunk {mixed[0]} is copied before its reduction ends; "
                        f"its allreduce is not a reduce-scatter followed by an allgather")
    chunks, new_id = shard_layout(schedule)
    want_reduce = collective == "reduce_scatter"
    mine = [t for t in schedule.transfers if t.reduce == want_reduce]
    base = min((t.step for t in mine), default=0)
    transfers = tuple(Transfer(new_id[t.chunk], t.src, t.dst, t.route, t.reduce, t.step - base, t.priority) for t in mine)
    return Schedule(schedule.algorithm, schedule.topology, schedule.ranks, chunks, transfers, collective=collective,
                    meta=dict(schedule.meta))


def join_halves(reduce_scatter: Schedule, allgather: Schedule, algorithm: str | None = None) -> Schedule:
    """The allreduce that runs ``reduce_scatter`` then ``allgather`` (ForestColl's composition), the inverse of
    :func:`allreduce_half`.

    The halves may cut the shards into different chunks (a forest packed on the reversed links weighs its
    trees otherwise), so the joined chunks are the common refinement of both: every transfer of a half's
    chunk moves each refined piece of it. The allgather's steps follow the reduce-scatter's, and steps order
    transfers per chunk only, so each piece is copied out as soon as its own sum is complete while other
    pieces are still being reduced.
    """
    for half, want in ((reduce_scatter, "reduce_scatter"), (allgather, "allgather")):
        if half.collective != want:
            raise PlanError(f"{half.algorithm}: a {half.collective!r} schedule cannot be an allreduce's {want} half")
    if reduce_scatter.ranks != allgather.ranks:
        raise PlanError(f"the halves are planned on different ranks ({reduce_scatter.topology!r} and "
                        f"{allgather.topology!r}); plan both on one topology")
    cuts = sorted({round(c.offset, 12) for h in (reduce_scatter, allgather) for c in h.chunks} | {0.0})
    cuts = [x for i, x in enumerate(cuts) if i == 0 or x - cuts[i - 1] > 1e-12]
    n = reduce_scatter.world_size
    chunks = tuple(Chunk(lo, (cuts[i + 1] if i + 1 < len(cuts) else 1.0) - lo, min(int(lo * n + 1e-9), n - 1))
                   for i, lo in enumerate(cuts))

    def pieces(half: Schedule) -> list[list[int]]:
        out = []
        for c in half.chunks:
            lo, hi = round(c.offset, 12), round(c.offset + c.size, 12)
            out.append([k for k, piece in enumerate(chunks) if lo - 1e-12 <= piece.offset < hi - 1e-12])
        return out

    rs_pieces, ag_pieces = pieces(reduce_scatter), pieces(allgather)
    after = reduce_scatter.num_steps
    transfers = [Transfer(k, t.src, t.dst, t.route, True, t.step, t.priority)
                 for t in reduce_scatter.transfers for k in rs_pieces[t.chunk]]
    transfers += [Transfer(k, t.src, t.dst, t.route, False, after + t.step, t.priority)
                  for t in allgather.transfers for k in ag_pieces[t.chunk]]
    meta = {**reduce_scatter.meta, **{f"allgather_{k}": v for k, v in allgather.meta.items()}}
    return Schedule(algorithm or reduce_scatter.algorithm, reduce_scatter.topology, reduce_scatter.ranks, chunks,
                    tuple(transfers), trees=reduce_scatter.trees + allgather.trees, meta=meta)
