"""Horovod compatibility of the optimizer / tape / Keras-module API: iterations
with backward_passes_per_step, the Keras module's collectives, the positional
order of DistributedOptimizer (both entry points), DistributedGradientTape,
PartialDistributedGradientTape, gradient() and load_model, the groups /
num_groups rules, any op through the tape, and a tape's gradients reduced once
by a DistributedOptimizer.

One launch per world size runs every check of tests/workers/optimizer_compat_worker.py.
"""
import pytest

from mpi_harness import assert_check, cached_launches, check_names

WORKER = "optimizer_compat_worker.py"
# A collective that some ranks never submit fails after 30 s instead of hanging the launch.
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30",
       "TF_MPI_OVERLAP": "0"}  # no start-up overlap probe for the gradient tapes (not what is tested here)
launch = cached_launches(WORKER, ENV, timeout=400)


@pytest.mark.parametrize("np", [2])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np", [2])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_optimizer_compat(np, check):
    assert_check(launch(np), np, check)
