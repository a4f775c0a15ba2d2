"""hvd.DistributedOptimizer with a TF1 optimizer (tf.compat.v1.train.Optimizer), as in Horovod 0.28.1.

tests/workers/legacy_optimizer_worker.py runs every check, as a section of the np=2 launch that other
modules' workers join (mpi_harness.joint_launch): weights after TF1
Session steps against numpy updates from every rank's gradients (Average, Sum, Min, Momentum, a
process set of one rank, IndexedSlices, fp16, predivide, groups, local variables,
backward_passes_per_step), eager execution, and the dispatch / refusals of DistributedOptimizer.
"""
import pytest

from mpi_harness import assert_check, check_names, joint_launch

WORKER = "legacy_optimizer_worker.py"
# A collective some rank never submits fails after 30 s instead of hanging; no overlap probe.
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30", "TF_MPI_OVERLAP": "0"}
launch = joint_launch("np2", 2, "legacy_optimizer", WORKER, env=ENV)


def prefetch(items):
    launch(start=True)


def test_launch_exits_cleanly():
    launch().assert_clean_exit()


@pytest.mark.parametrize("check", check_names(WORKER))
def test_legacy_optimizer(check):
    assert_check(launch(), 2, check)
