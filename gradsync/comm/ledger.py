"""What each rank asked the runtime for, so a failed collective can say which rank differed and how.

Ranks whose collectives do not match (one sends 1000 float32 where its peer sends 2000, one makes one call
fewer) end in a timeout or a closed connection, which on its own names only the peer that went quiet. Each rank
keeps a :class:`Ledger` on the host -- a count per kind of collective and the last call's size and dtype, a few
integer updates per call -- and shares it through the transport's board (the rendezvous store) when a collective
fails, when the runtime shuts down, and the first time a rank uses a new (kind, size, dtype): gloo aborts a
process that receives more bytes than it expects (C++ ``std::terminate``, nothing to catch), so the survivor must
find the signatures the dead rank used already on the board. New signatures are few (a job's bucket sizes): one
store write each, none on the steady path. The failing rank reads its peers' ledgers for a few seconds and
:func:`describe_mismatch` turns them into "rank 1 called allreduce 4 times, rank 0 5 times".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Ledger", "describe_mismatch"]

#: Collectives whose size every rank must match (an allgather of uneven sizes may differ by design).
_SIZED = ("allreduce", "reduce_scatter", "all_gather_into_tensor")


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _dtypes(tensors: Sequence[torch.Tensor]) -> str:
    names: list[str] = []
    for t in tensors:
        name = _dtype_name(t.dtype)
        if name not in names:
            names.append(name)
    return "+".join(names)


@dataclass
class Ledger:
    """One rank's collectives so far: how many of each kind, and the last one's kind, number, size and dtype."""

    counts: dict[str, int] = field(default_factory=dict)
    last: tuple[str, int, int | None, str] | None = None
    #: every (kind, size, dtype) this rank has used, in first-use order (capped: a job has few)
    seen: dict[tuple[str, int | None, str], None] = field(default_factory=dict)

    MAX_SEEN = 256

    def record(self, kind: str, tensors: torch.Tensor | Sequence[torch.Tensor], *, sized: bool = True) -> bool:
        """Count one ``kind`` call on ``tensors`` (``sized``: whether every rank must pass as many elements);
        True when this (kind, size, dtype) is new to this rank (then worth posting before it runs)."""
        n = self.counts.get(kind, 0) + 1
        self.counts[kind] = n
        if isinstance(tensors, torch.Tensor):  # one tensor (a DDP bucket on the native path): per call, kept short
            numel = tensors.numel() if sized else None
            dtypes = _dtype_name(tensors.dtype)
        else:
            tlist = list(tensors)
            numel = sum(t.numel() for t in tlist) if sized else None
            dtypes = _dtypes(tlist)
        self.last = (kind, n, numel, dtypes)
        signature = (kind, numel, dtypes)
        if signature in self.seen or len(self.seen) >= self.MAX_SEEN:
            return False
        self.seen[signature] = None
        return True

    def encode(self, status: str) -> str:
        """JSON text for the board; ``status``: ``failed`` (inside the last call), ``finished`` (shut down) or
        ``running`` (posted at a new signature: its counts may be stale, its signatures are complete)."""
        return json.dumps({"counts": self.counts, "last": self.last, "status": status, "seen": list(self.seen)})


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def describe_mismatch(me: int, mine: str, peers: Mapping[int, str], world: int) -> str | None:
    """What differs between the ranks' ledgers (encoded), or None when nothing does (or nothing was read).

    Counts come first (one rank made a call fewer: every later call pairs with the wrong one), then the last
    call's kind, size and dtype. Ranks that did not report are named too.
    """
    docs: dict[int, dict] = {}
    for rank, text in {**peers, me: mine}.items():
        try:
            docs[rank] = json.loads(text)
        except (TypeError, ValueError):
            continue
    if len(docs) < 2:
        return None
    missing = [r for r in range(world) if r not in docs]
    tail = f" ({_ranks(missing)} did not report: still inside a collective, or gone)" if missing else ""
    mine_last = docs[me]["last"]
    # a rank that posted when it began a new signature and then went silent (gloo aborts a rank that receives
    # more than it expects): its post is current if it was for this very call, else only its signatures count
    current = {r: d for r, d in docs.items() if d["status"] != "running" or (mine_last and d["last"]
               and d["last"][:2] == mine_last[:2])}
    stale = sorted(r for r in docs if r not in current)
    if stale and mine_last and mine_last[2] is not None:
        kind, number, numel, dtype = mine_last
        strangers = [r for r in stale if [kind, numel, dtype] not in docs[r]["seen"]]
        if strangers:
            used = {r: ", ".join(f"{n} {d}" for k, n, d in docs[r]["seen"] if k == kind and n is not None) or "nothing"
                    for r in strangers}
            return (f"{kind} #{number} differs between ranks: rank {me} sent {numel} {dtype}, which "
                    + "; ".join(f"rank {r} never sent in an {kind} (it sent {used[r]}, then stopped answering)"
                                for r in strangers))
    docs = current
    if len(docs) < 2:
        return None
    kinds = sorted({k for d in docs.values() for k in d["counts"]})
    for kind in kinds:
        by: dict[int, list[int]] = {}
        for rank in sorted(docs):
            by.setdefault(docs[rank]["counts"].get(kind, 0), []).append(rank)
        if len(by) > 1:
            order = sorted(by.items(), key=lambda item: item[0])
            parts = [f"{_ranks(rs)} called {kind} {_times(n)}" if i == 0 else f"{_ranks(rs)} {_times(n)}"
                     for i, (n, rs) in enumerate(order)]
            finished = [r for r in sorted(docs) if docs[r]["status"] == "finished"]
            done = f"; {_ranks(finished)} had already shut down" if finished else ""
            return "ranks made different collective calls: " + ", ".join(parts) + done + tail
    lasts = {rank: tuple(d["last"]) if d["last"] else None for rank, d in docs.items()}
    if len(set(lasts.values())) <= 1:
        return None
    kinds_now = {rank: last[0] if last else None for rank, last in lasts.items()}
    if len(set(kinds_now.values())) > 1:
        groups: dict[str | None, list[int]] = {}
        for rank in sorted(lasts):
            groups.setdefault(kinds_now[rank], []).append(rank)
        return "ranks are in different collectives: " + ", ".join(
            f"{_ranks(rs)} in {k or 'none'}" for k, rs in groups.items()) + tail
    kind, number = next(iter(lasts.values()))[:2]  # type: ignore[index]
    sizes: dict[tuple[int | None, str], list[int]] = {}
    for rank in sorted(lasts):
        _, _, numel, dtype = lasts[rank]  # type: ignore[misc]
        sizes.setdefault((numel, dtype), []).append(rank)
    same_dtype = len({d for _, d in sizes}) == 1
    parts = []
    for i, ((numel, dtype), rs) in enumerate(sizes.items()):
        what = f"{numel} {dtype}" if numel is not None else dtype
        if i and same_dtype and numel is not None:
            what = str(numel)
        parts.append(f"{_ranks(rs)} sent {what}" if i == 0 else f"{_ranks(rs)} {what}")
    return f"{kind} #{number} differs between ranks: " + ", ".join(parts) + tail
