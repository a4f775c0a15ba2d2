"""Horovod compatibility: the semantics `import tf_mpi as hvd` keeps
from Horovod 0.28.1 -- error classes, 16-bit integers, alltoall's return value,
gradients of broadcast / allgather / reducescatter (eager, tf.function and
TF1 graph mode, grouped and not), in-place broadcast, and the API a Horovod
script expects (broadcast_global_variables, average=, IndexedSlices of
integers, SyncBatchNormalization's arguments, local gradients, elastic state).

One launch per world size runs every check of tests/workers/horovod_compat_worker.py, as a section
of the launch of that size that other modules' workers join (mpi_harness.joint_launch).
"""
import pytest

from mpi_harness import BOUNDED_STALL_ENV, assert_check, check_names, joint_launches_by_np, prefetch_by_np

WORKER = "horovod_compat_worker.py"
launch = joint_launches_by_np("horovod_compat", WORKER, (2, 3), env=BOUNDED_STALL_ENV)

prefetch = prefetch_by_np(launch)


@pytest.mark.parametrize("np", [2, 3])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_horovod_compat(np, check):
    assert_check(launch(np), np, check)
