"""Keras 3 training under real mpirun: DistributedOptimizer (equivalence with
single-process training, bit-identical weights, clipping, mixed precision,
accumulation, sparse gradients, XLA), DistributedGradientTape, callbacks,
save/load and SyncBatchNormalization."""
import pytest

from mpi_harness import assert_check, check_names, run_mpi

WORKER = "keras_worker.py"
_runs = {}


def launch():
    if "run" not in _runs:
        _runs["run"] = run_mpi(2, WORKER, timeout=600, env={"TF_MPI_STALL_CHECK_TIME_SECONDS": "20",
                                                           "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "90"})
    return _runs["run"]


def test_launch_exits_cleanly():
    launch().assert_clean_exit()


@pytest.mark.parametrize("check", check_names(WORKER))
def test_keras(check):
    assert_check(launch(), 2, check)
