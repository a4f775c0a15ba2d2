"""Keras 3 training under real mpirun: DistributedOptimizer (equivalence with
single-process training, bit-identical weights, clipping, mixed precision,
accumulation, sparse gradients, XLA), DistributedGradientTape, callbacks,
save/load and SyncBatchNormalization. A section of the second np=2 launch that other
modules' workers join (mpi_harness.joint_launch; the shared-memory and runtime sections)."""
import pytest

from mpi_harness import assert_check, check_names, joint_launch

WORKER = "keras_worker.py"
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "20", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "90"}
launch = joint_launch("np2b", 2, "keras", WORKER, env=ENV, timeout=600, expected_s=70)


def prefetch(items):
    launch(start=True)


def test_launch_exits_cleanly():
    launch().assert_clean_exit()


@pytest.mark.parametrize("check", check_names(WORKER))
def test_keras(check):
    assert_check(launch(), 2, check)
