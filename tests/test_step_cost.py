"""What one training step costs the engine: an IndexedSlices gradient allgathered as one
collective (values and indices together), and a Keras step of a model with an Embedding
submitting one grouped allreduce and one allgather, with the numbers checked against numpy
and the same weights on every rank. One launch per world size runs every check of
tests/workers/step_cost_worker.py, as a section of the launch of that size that other modules'
workers join (mpi_harness.joint_launch).
"""
import pytest

from mpi_harness import BOUNDED_STALL_ENV, assert_check, check_names, joint_launches_by_np, prefetch_by_np

WORKER = "step_cost_worker.py"
launch = joint_launches_by_np("step_cost", WORKER, (2, 3), env=BOUNDED_STALL_ENV)

prefetch = prefetch_by_np(launch)


@pytest.mark.parametrize("np", [2, 3])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_step_cost(np, check):
    assert_check(launch(np), np, check)
