"""Horovod 0.28.1's API as `import tf_mpi as hvd` offers it: join as an int32 op
that waits each time it runs (eager, tf.function, TF1 Session), the signatures of
horovod.tensorflow (names, order, defaults) and calls in Horovod's positional
order, int32 alltoall received splits, the root's own object from
broadcast_object, Horovod's `session` argument, gradients of Min / Max / Product
allreduces, process-set parameters and ops (global set only), and is_homogeneous,
gloo_enabled, nccl_built, check_num_rank_power_of_2,
handle_average_backwards_compatibility, the timeline's ValueError before init().

One launch per world size runs every check of tests/workers/api_compat_worker.py.
"""
import pytest

from mpi_harness import assert_check, cached_launches, check_names

WORKER = "api_compat_worker.py"
# A collective that some ranks never submit fails after 30 s instead of hanging the launch.
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30",
       "TF_MPI_OVERLAP": "0"}
launch = cached_launches(WORKER, ENV)


@pytest.mark.parametrize("np", [2, 3])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_api_compat(np, check):
    assert_check(launch(np), np, check)
