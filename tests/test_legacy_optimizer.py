"""hvd.DistributedOptimizer with a TF1 optimizer (tf.compat.v1.train.Optimizer), as in Horovod 0.28.1.

tests/workers/legacy_optimizer_worker.py runs every check, as a section of the np=2 launch that other
modules' workers join (mpi_harness.joint_launch): weights after TF1
Session steps against numpy updates from every rank's gradients (Average, Sum, Min, Momentum, a
process set of one rank, IndexedSlices, fp16, predivide, groups, local variables,
backward_passes_per_step), eager execution, and the dispatch / refusals of DistributedOptimizer.
"""
import pytest

from mpi_harness import BOUNDED_STALL_ENV, assert_check, check_names, joint_launch

WORKER = "legacy_optimizer_worker.py"
launch = joint_launch("np2", 2, "legacy_optimizer", WORKER, env=BOUNDED_STALL_ENV)


def prefetch(items):
    launch(start=True)


def test_launch_exits_cleanly():
    launch().assert_clean_exit()


@pytest.mark.parametrize("check", check_names(WORKER))
def test_legacy_optimizer(check):
    assert_check(launch(), 2, check)
