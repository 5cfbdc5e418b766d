"""The self-check of a :class:`gradsync.plan.schedule.Schedule` (:meth:`~gradsync.plan.schedule.Schedule.check`):
its structure, its blocks, read/write hazards, then an exact replay of the chunk movement (msccl-style)
with one bitset of contributing ranks per (rank, chunk). Every failure names the rank and chunk."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from gradsync.errors import ScheduleError
from gradsync.plan.transfers import SHARDED, Transfer, route_error
from gradsync.topology.model import Topology

if TYPE_CHECKING:
    from gradsync.plan.schedule import Schedule

__all__ = ["check_schedule"]


def check_schedule(schedule: Schedule, topology: Topology | None = None) -> None:
    """:meth:`gradsync.plan.schedule.Schedule.check`: raise :class:`ScheduleError` at the first failure."""
    _check_structure(schedule, topology)
    _check_blocks(schedule, topology)
    _check_hazards(schedule)
    _replay(schedule)


def _check_structure(schedule: Schedule, topology: Topology | None) -> None:
    n, c = len(schedule.ranks), len(schedule.chunks)
    if n == 0:
        raise ScheduleError("schedule has no ranks")
    if topology is not None:
        schedule.require_topology(topology)
    pos = 0.0
    for i, ch in enumerate(schedule.chunks):
        if not (ch.size >= 0 and math.isfinite(ch.size)) or abs(ch.offset - pos) > 1e-6:
            raise ScheduleError(f"chunk {i} spans [{ch.offset}, {ch.offset + ch.size}); chunks must tile [0, 1) in order")
        if ch.root is not None and not 0 <= ch.root < n:
            raise ScheduleError(f"chunk {i} has root rank {ch.root}, outside 0..{n - 1}")
        pos += ch.size
    if abs(pos - 1.0) > 1e-6:
        raise ScheduleError(f"chunks cover {pos:.9f} of the buffer; they must cover exactly 1")
    if schedule.collective != "allreduce" and any(ch.root is None for ch in schedule.chunks):
        raise ScheduleError(f"a {schedule.collective} schedule needs a root for every chunk")
    if schedule.collective in SHARDED:
        for i, ch in enumerate(schedule.chunks):
            lo, hi = ch.root / n, (ch.root + 1) / n  # type: ignore[operator]
            if ch.size > 0 and (ch.offset < lo - 1e-9 or ch.offset + ch.size > hi + 1e-9):
                raise ScheduleError(
                    f"{schedule.collective} chunk {i} spans [{ch.offset:.6g}, {ch.offset + ch.size:.6g}) but its root, rank "
                    f"{ch.root}, owns the shard [{lo:.6g}, {hi:.6g}); a chunk must lie in its owner's shard "
                    f"(rank r owns the r-th of {n} equal shards, as in torch.distributed.reduce_scatter_tensor)"
                )
    for i, t in enumerate(schedule.explicit):
        if schedule.collective == "allgather" and t.reduce:
            raise ScheduleError(f"transfer {i} (chunk {t.chunk}, rank {t.src} -> rank {t.dst}) reduces, but an "
                                f"allgather only copies shards; make it a copy (reduce=False)")
        if not 0 <= t.chunk < c:
            raise ScheduleError(f"transfer {i} names chunk {t.chunk}; the schedule has chunks 0..{c - 1}")
        if not (0 <= t.src < n and 0 <= t.dst < n) or t.src == t.dst:
            raise ScheduleError(f"transfer {i} goes from rank {t.src} to rank {t.dst}; need two distinct ranks in 0..{n - 1}")
        if t.step < 0:
            raise ScheduleError(f"transfer {i} has step {t.step}; steps start at 0")
        why = route_error(t.route, t.src, t.dst, schedule.ranks, topology,
                           f"transfer {i} (chunk {t.chunk}, rank {t.src} -> rank {t.dst})")
        if why:
            raise ScheduleError(why)


def _check_blocks(schedule: Schedule, topology: Topology | None) -> None:
    """Each block's structure (its docstring proves the rest), chunks carried once, roots as the blocks say."""
    owner: dict[int, int] = {}
    for k, b in enumerate(schedule.blocks):
        b.verify(schedule, topology)
        for c, root in b.roots(schedule).items():
            if not 0 <= c < len(schedule.chunks):
                raise ScheduleError(f"block {k} ({b.kind}) names chunk {c}; the schedule has chunks 0..{len(schedule.chunks) - 1}")
            if c in owner:
                raise ScheduleError(f"chunk {c} is carried by blocks {owner[c]} and {k}; a chunk belongs to one block")
            owner[c] = k
            if schedule.chunks[c].root not in (None, root):
                raise ScheduleError(f"chunk {c} has root rank {schedule.chunks[c].root}, but block {k} ({b.kind}) "
                                    f"completes its reduction on rank {root}")
    if owner:
        also = sorted({t.chunk for t in schedule.explicit} & owner.keys())
        if also:
            raise ScheduleError(f"chunk {also[0]} is carried by block {owner[also[0]]} and by explicit transfers; "
                                f"a chunk belongs to one block or to the explicit transfers")


def _block_chunks(schedule: Schedule) -> set[int]:
    return {c for b in schedule.blocks for c in b.chunks}


def _check_hazards(schedule: Schedule) -> None:
    if not schedule.explicit:
        return
    a = schedule.explicit_arrays
    c = len(schedule.chunks)
    read_key = (a["step"] * len(schedule.ranks) + a["src"]) * c + a["chunk"]
    write_key = (a["step"] * len(schedule.ranks) + a["dst"]) * c + a["chunk"]
    both = np.intersect1d(read_key, write_key)
    if both.size:
        i = int(np.flatnonzero(np.isin(write_key, both[:1]))[0])
        t = schedule.explicit[i]
        raise ScheduleError(
            f"rank {t.dst} chunk {t.chunk} is both sent and received in step {t.step}; "
            f"move the receive to a later step so the send reads a defined value"
        )
    copies = write_key[~a["reduce"]]
    uniq, counts = np.unique(copies, return_counts=True)
    reduces = write_key[a["reduce"]]
    bad = uniq[(counts > 1) | np.isin(uniq, reduces)]
    if bad.size:
        i = int(np.flatnonzero(write_key == bad[0])[0])
        t = schedule.explicit[i]
        raise ScheduleError(
            f"rank {t.dst} chunk {t.chunk} is overwritten by a copy and written again in step {t.step}; "
            f"the result would depend on arrival order"
        )


def _initial(schedule: Schedule, chunk: int) -> list[int]:
    """Contribution bitsets (Python ints) per rank for one chunk before any transfer."""
    n = len(schedule.ranks)
    if schedule.collective in ("broadcast", "allgather"):
        full = (1 << n) - 1
        root = schedule.chunks[chunk].root
        return [full if r == root else 0 for r in range(n)]
    return [1 << r for r in range(n)]


def _replay(schedule: Schedule) -> None:
    """Exact replay with one bitset of contributing ranks per (rank, chunk)."""
    n = len(schedule.ranks)
    full = (1 << n) - 1
    by_chunk: dict[int, list[Transfer]] = {}
    for t in sorted(schedule.explicit, key=lambda t: (t.chunk, t.step)):
        by_chunk.setdefault(t.chunk, []).append(t)
    in_blocks = _block_chunks(schedule)
    for chunk in range(len(schedule.chunks)):
        if chunk in in_blocks:
            continue
        state = _initial(schedule, chunk)
        ts = by_chunk.get(chunk, [])
        i = 0
        while i < len(ts):
            step = ts[i].step
            j = i
            while j < len(ts) and ts[j].step == step:
                j += 1
            payload = [state[t.src] for t in ts[i:j]]  # everyone in a step reads the pre-step state
            for t, p in zip(ts[i:j], payload):
                if p == 0:
                    raise ScheduleError(
                        f"rank {t.src} sends chunk {chunk} to rank {t.dst} in step {step} before holding any data for it"
                    )
                if t.reduce:
                    twice = state[t.dst] & p
                    if twice:
                        raise ScheduleError(
                            f"rank {t.dst} would count the contribution of rank(s) {_ranks_of(twice)} to chunk "
                            f"{chunk} twice (reduce from rank {t.src} in step {step})"
                        )
                    state[t.dst] |= p
                else:
                    state[t.dst] = p
            i = j
        owners = [schedule.chunks[chunk].root] if schedule.collective in ("reduce", "reduce_scatter") else range(n)
        for r in owners:
            assert r is not None
            if state[r] != full:
                missing = _ranks_of(full & ~state[r])
                what = "full reduction" if schedule.collective != "allgather" else "owner's shard"
                raise ScheduleError(
                    f"rank {r} does not end with the {what} of chunk {chunk}: "
                    f"missing the contribution of rank(s) {missing}"
                )


def _ranks_of(bits: int) -> list[int]:
    return [i for i in range(bits.bit_length()) if bits >> i & 1]
