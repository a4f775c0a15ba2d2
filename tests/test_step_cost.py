"""What one training step costs the engine: an IndexedSlices gradient allgathered as one
collective (values and indices together), and a Keras step of a model with an Embedding
submitting one grouped allreduce and one allgather, with the numbers checked against numpy
and the same weights on every rank. One launch per world size runs every check of
tests/workers/step_cost_worker.py, as a section of the launch of that size that other modules'
workers join (mpi_harness.joint_launch).
"""
import pytest

from mpi_harness import assert_check, check_names, joint_launch, prefetch_by_np

WORKER = "step_cost_worker.py"
# A collective that some ranks never submit fails after 30 s instead of hanging the launch;
# no start-up overlap probe (the grouping plan is not what is tested here).
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30", "TF_MPI_OVERLAP": "0"}
LAUNCHES = {np: joint_launch(f"np{np}", np, "step_cost", WORKER, env=ENV) for np in (2, 3)}


def launch(np, start=False):
    return LAUNCHES[np](start=start)


prefetch = prefetch_by_np(launch)


@pytest.mark.parametrize("np", [2, 3])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_step_cost(np, check):
    assert_check(launch(np), np, check)
