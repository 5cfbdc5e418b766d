"""What a trainer run through gradsync's recipe must show (tests/workers/trainer_worker.py reports it)."""

from __future__ import annotations

#: How far each hook's final parameters may be from the single-process reference (SGD on the mean loss):
#: plain is the exact mean (summation order aside); fp16 rounds each gradient; PowerSGD's rank-1 approximation
#: is a different update, so it is only checked to have trained (``moved``) and to agree across replicas.
TOLERANCE = {"plain": 1e-6, "fp16": 1e-4, "powersgd": None}


def check_replicas(ranks: list[dict | None]) -> None:
    assert all(r is not None for r in ranks), ranks
    first = ranks[0]
    assert first is not None and set(first) == set(TOLERANCE), first
    for name, tol in TOLERANCE.items():
        for r, rep in enumerate(ranks):
            assert rep is not None
            assert rep[name]["buckets"] > 0, (name, r, "the hook never ran")
            assert rep[name]["params"] == first[name]["params"], (name, r, "replicas differ")
            assert rep[name]["moved"] > 1e-3, (name, r, "training did not change the parameters")
            if tol is not None:
                assert rep[name]["vs_reference"] <= tol, (name, r, rep[name]["vs_reference"])
