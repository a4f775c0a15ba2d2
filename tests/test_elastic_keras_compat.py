"""Horovod compatibility of tf_mpi.keras.elastic's callbacks: commits, state.epoch,
state.batch and params['steps'] during fit and across an elastic restart, against
the rules of Horovod 0.28.1's horovod/_keras/elastic.py.

One launch at np=2 runs every check of tests/workers/elastic_keras_compat_worker.py.
"""
import pytest

from mpi_harness import assert_check, cached_launches, check_names

WORKER = "elastic_keras_compat_worker.py"
# A collective that some ranks never submit fails after 30 s instead of hanging the launch.
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30"}
launch = cached_launches(WORKER, ENV)


@pytest.mark.parametrize("np", [2])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np", [2])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_elastic_keras_compat(np, check):
    assert_check(launch(np), np, check)
