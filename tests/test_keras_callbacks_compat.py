"""Horovod compatibility of the Keras callbacks: LearningRateScheduleCallback's number
multiplier (exponential decay), steps_per_epoch taken from model.fit, the rate logged as
'lr' and 'learning_rate', BroadcastGlobalVariablesCallback's local variables, device and
variables created by the first step, and BestModelCheckpoint's Horovod signature.

One launch per world size runs every check of tests/workers/keras_callbacks_compat_worker.py.
"""
import pytest

from mpi_harness import assert_check, cached_launches, check_names

WORKER = "keras_callbacks_compat_worker.py"
# A collective that some ranks never submit fails after 30 s instead of hanging the launch.
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30"}
launch = cached_launches(WORKER, ENV, timeout=420)


@pytest.mark.parametrize("np", [2, 3])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_keras_callbacks_compat(np, check):
    assert_check(launch(np), np, check)
