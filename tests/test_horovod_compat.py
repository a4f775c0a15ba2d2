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

from mpi_harness import assert_check, check_names, joint_launch, prefetch_by_np

WORKER = "horovod_compat_worker.py"
# A collective that some ranks never submit fails after 30 s instead of hanging the launch.
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30",
       "TF_MPI_OVERLAP": "0"}  # no start-up overlap probe for the gradient tapes (not what is tested here)
LAUNCHES = {np: joint_launch(f"np{np}", np, "horovod_compat", WORKER, env=ENV) for np in (2, 3)}


def launch(np, start=False):
    return LAUNCHES[np](start=start)


prefetch = prefetch_by_np(launch)


@pytest.mark.parametrize("np", [2, 3])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_horovod_compat(np, check):
    assert_check(launch(np), np, check)
