"""Top-k / gTop-k compression with error feedback under real mpirun, np=2 and np=3 (gTop-k also at np=5).

tests/workers/compression_worker.py checks, on every rank: results and
residuals bit for bit against a numpy simulation of the algorithm (ties
included), the same result on every rank, the engine's byte counters, Keras
fit through DistributedOptimizer, resuming from model.save / load_model and
from tf.train.Checkpoint exactly as an uninterrupted run, and bad ratios.
At np=2 and np=3 the worker is a section of the launch of that size that other
modules' workers join (mpi_harness.joint_launch). The codecs' numbers depend on the world size and
are checked at every size; the Keras and tape layers above them do not (they hand the codec a
gradient and keep what it returns), so their checks run at np=2 only.
"""
import pytest

from mpi_harness import assert_check, joint_launches_by_np, params_of, selected_tests, shared_launches

WORKER = "compression_worker.py"
# A collective that some ranks never submit fails after 60 s instead of hanging.
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "20", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "60"}
# Keras fit, mixed precision and checkpointing over a codec: the same code at every world size.
LAYER_CHECKS = ["check_keras_fit_leaves_identical_weights", "check_keras_mixed_float16_loss_scale_with_topk",
                "check_keras_residuals_survive_save_and_load_model", "check_tape_residuals_survive_tf_train_checkpoint"]
launch = joint_launches_by_np("compression", WORKER, (2, 3), env=ENV, only_at={c: (2,) for c in LAYER_CHECKS})


# 5 ranks: one past the largest power of two (4) and two rounds inside it; rank 4 gets the
# result's indices from rank 0 and its values from rank 1 (np=3 has one round only).
GTOPK_UNEVEN = ["check_gtopk_matches_numpy_eager", "check_byte_counters_show_the_reduction"]
launch_uneven = shared_launches(WORKER, {**ENV, "TF_MPI_TEST_ONLY": ",".join(GTOPK_UNEVEN)}, timeout=400,
                                long=True)  # 5 ranks on this machine: queued first


def prefetch(items):
    for np in params_of(items, "np"):
        launch(np, start=True)
    if "test_gtopk_five_ranks" in selected_tests(items):
        launch_uneven(5, start=True)


@pytest.mark.parametrize("np,check", launch.cases)
def test_compression(np, check):
    assert_check(launch(np), np, check)


@pytest.mark.parametrize("check", GTOPK_UNEVEN)
def test_gtopk_five_ranks(check):
    assert_check(launch_uneven(5), 5, check)
