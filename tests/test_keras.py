"""Keras 3 training under real mpirun: DistributedOptimizer (equivalence with
single-process training, bit-identical weights, clipping, mixed precision,
accumulation, sparse gradients, XLA), DistributedGradientTape, callbacks,
save/load and SyncBatchNormalization."""
import pytest

from mpi_harness import assert_check, check_names, shared_launch

WORKER = "keras_worker.py"
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "20", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "90"}


def launch(start=False):
    return shared_launch(2, WORKER, timeout=600, env=ENV, start=start, long=True)  # queued first


def prefetch(items):
    launch(start=True)


def test_launch_exits_cleanly():
    launch().assert_clean_exit()


@pytest.mark.parametrize("check", check_names(WORKER))
def test_keras(check):
    assert_check(launch(), 2, check)
