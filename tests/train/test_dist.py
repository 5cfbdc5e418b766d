"""Multi-process runs of the training layer (2 gloo ranks, also 4 for compression="auto";
tests/workers/train_worker.py): gradient accumulation with DistributedOptimizer against single-process training,
broadcast_parameters / broadcast_optimizer_state, identical replicas with compression="auto", and the compressed
DDP hook's step-wide rollback of a non-finite iteration."""

from __future__ import annotations

import pytest

from tests.dist_launch import launch

WORKER = "tests/workers/train_worker.py"
WORLD = 2


def test_accumulated_micro_batches_equal_single_process_training_on_all_of_them(tmp_path):
    reports = launch(WORKER, ["accumulate", str(tmp_path)], WORLD, tmp_path, timeout_s=180)
    for rank, rep in enumerate(reports):
        for variant, r in rep.items():
            assert r["moved"] > 1e-3, (rank, variant, r)  # the reference trained: the comparison means something
            assert r["across_ranks"] == 0.0, (rank, variant, r)
            tol = 2e-3 if variant.startswith("fp16") else 1e-12  # fp16 rounds the exchanged gradients
            assert r["vs_reference"] < tol, (rank, variant, r)


def test_a_pass_beyond_backward_passes_per_step_raises_naming_the_fix(tmp_path):
    reports = launch(WORKER, ["too_many_passes", str(tmp_path)], WORLD, tmp_path, timeout_s=120)
    for rank, rep in enumerate(reports):
        for path, r in rep.items():
            assert r["passes_at_error"] == 3, (rank, path, r)
            assert "backward pass 3" in r["error"] and "backward_passes_per_step=3" in r["error"], (rank, path, r)
            assert "no_sync" in r["error"], (rank, path, r)


def test_broadcast_makes_every_parameter_and_optimizer_state_rank_0s(tmp_path):
    reports = launch(WORKER, ["broadcast", str(tmp_path)], WORLD, tmp_path, timeout_s=120)
    for rank, rep in enumerate(reports):
        assert rep["vs_root"] == 0.0 and rep["after_step_vs_root"] == 0.0, (rank, rep)
        assert rep["state_tensors"] == 3 * 4, (rank, rep)  # Adam: step, exp_avg, exp_avg_sq per parameter (4)
        assert rep["hyper"] == reports[0]["hyper"] and rep["hyper"][0]["lr"] == 0.01, (rank, rep)
        assert rep["mismatch_error"] and "pass the same tensors on every rank" in rep["mismatch_error"], (rank, rep)


@pytest.mark.parametrize("world", [WORLD, 4])
def test_auto_compression_keeps_replicas_bit_identical_through_the_optimizer_and_the_hook(tmp_path, world):
    """Issue 40: on 2 and 4 ranks, every rank ends with the same bits through both paths, the codecs were decided
    once for the job, and a real codec ran on the way (a choice dropped after its trial ran too), so the
    comparison is not that of plain allreduce."""
    reports = launch(WORKER, ["auto", str(tmp_path)], world, tmp_path, timeout_s=240)
    assert len(reports) == world and all(rep is not None for rep in reports)
    for path in ("optimizer", "hook"):
        got = [rep[path] for rep in reports]
        assert all(g["settled"] for g in got), got
        assert got[0]["codecs"] and all(g["codecs"] == got[0]["codecs"] for g in got), got  # decided once for the job
        assert all(g["tried"] == got[0]["tried"] for g in got) and set(got[0]["tried"]) - {"none"}, got
        assert all(g["hash"] == got[0]["hash"] for g in got), [g["report"] for g in got]
        assert got[0]["moved"] > 1e-3, got[0]  # it trained: identical parameters are not just the initial ones
        # "none" on a DDP bucket, or on one of the optimizer's groups, is the backend's own allreduce of the
        # bucket or the group's buffer (the probing launches, at least)
        assert all(g["native"] > 0 for g in got), got
        assert all(g["record_timeouts"] == 0 for g in got), got  # no decision stalled on another group's exchange


def test_a_merged_group_settled_on_a_codec_gets_its_gradients_handed_over_and_replicas_stay_identical(tmp_path):
    """A merged group settled on a codec the backend does not sum: its later launches hand the gradients themselves
    to the codec, not the group's buffer (AutoCompression.needs_flat), on every rank alike, and the replicas end
    bit-identical."""
    reports = launch(WORKER, ["auto_handed", str(tmp_path)], WORLD, tmp_path, timeout_s=240)
    assert len(reports) == WORLD and all(rep is not None for rep in reports)
    first = reports[0]
    assert all(rep["settled"] for rep in reports), [rep["report"] for rep in reports]
    (merged,) = first["merged"]
    assert first["codecs"][merged] not in ("none", "fp16", "bf16"), first["report"]
    assert first["handed"] and set(first["handed"]) == {merged}, first
    assert all(rep["handed"] == first["handed"] and rep["codecs"] == first["codecs"] for rep in reports)
    assert all(rep["hash"] == first["hash"] for rep in reports), [rep["report"] for rep in reports]


def test_auto_none_on_a_ddp_bucket_is_ddps_allreduce_and_counts_a_bad_iteration_while_choosing(tmp_path):
    """Issue 40: "none" on a bucket is the backend's own allreduce of the bucket (as DDP without a hook). While
    auto chooses, its sum's finiteness joins the iteration's verdict: a NaN or inf on one rank counts once on
    every rank. Once settled, every bucket is a plain allreduce (``settled_launch``): the NaN reaches every rank's
    gradient by the sum, and there is no state to roll back and no count."""
    reports = launch(WORKER, ["auto_native_nonfinite", str(tmp_path)], WORLD, tmp_path, timeout_s=180)
    for rank, rep in enumerate(reports):
        for bad, r in rep.items():
            launches, buckets = r["native"]
            assert buckets >= 8 and launches == buckets, (rank, bad, r["diff"], r["report"], r["native"])  # natively
            per_iteration = (buckets - 1) // 7  # one bucket at iteration 0, DDP rebuilds them after it
            assert r["settled"][:3] == [0, 0, 0] and r["settled"][4:] == [per_iteration] * 4, (rank, bad, r)
            assert r["bad_nonfinite"] == [True, True] and r["later_equal"] and r["counts"] == [1, 0], (rank, bad, r)


def test_one_bad_gradient_in_one_ddp_bucket_leaves_every_bucket_as_if_the_iteration_never_happened(tmp_path):
    """Issue 42 through the compressed DDP hook (2 gloo ranks, several buckets, seven compressors, NaN and inf): the
    iteration is the transaction -- closed at the last bucket -- and it counts once on every rank."""
    reports = launch(WORKER, ["nonfinite_hook", str(tmp_path)], WORLD, tmp_path, timeout_s=180)
    assert reports[0] is not None and len(reports[0]) == 7
    for rank, rep in enumerate(reports):
        for case, r in rep.items():
            assert r["buckets"] >= 2, (rank, case, r)  # several buckets: the others' states are what is tested
            assert r == {"buckets": r["buckets"], "bad_nonfinite": True, "later_equal": True, "later_finite": True,
                         "counts": [1, 1, 0]}, (rank, case, r)
