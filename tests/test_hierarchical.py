"""Hierarchical allreduce (TF_MPI_HIERARCHICAL) on pretend nodes (TF_MPI_TOPOLOGY) under real mpirun.

Two launches: np=4 as 2 nodes x 2 ranks, with the TensorFlow ops and a Keras
training step; np=6 as 2x3 and then 3x2 (the worker re-initialises the engine
in between), with the array API only so that six ranks on a small machine stay
quick. Each launch runs every collective through the hierarchical path and the
flat path and compares them, and checks the topology queries, the choice of
TF_MPI_HIERARCHICAL=auto and the errors for invalid settings. The np=4 launch
is a section of the np=4 launch that other modules' workers join
(mpi_harness.joint_launch).
"""
import pytest

from mpi_harness import assert_check, check_names, joint_launch, prefetch_by_np, shared_launch

WORKER = "hierarchical_worker.py"
# A collective that some ranks never submit fails after 60 s instead of hanging.
STALL = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "20", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "60"}
LAUNCHES = {
    4: {**STALL, "TF_MPI_TEST_TOPOLOGIES": "2x2", "TF_MPI_TEST_TF": "1"},
    6: {**STALL, "TF_MPI_TEST_TOPOLOGIES": "2x3,3x2"},
}


JOINT4 = joint_launch("np4", 4, "hierarchical", WORKER, env=LAUNCHES[4], timeout=240)


def launch(np, start=False):
    if np == 4:
        return JOINT4(start=start)
    return shared_launch(np, WORKER, timeout=240, env=LAUNCHES[np], start=start)


prefetch = prefetch_by_np(launch)


# The checks that need TensorFlow run only in the launch that imports it.
TF_CHECKS = {"check_tf_ops_match_flat", "check_keras_training_through_the_hierarchical_path"}
CASES = [(np, check) for np in sorted(LAUNCHES) for check in check_names(WORKER)
         if check not in TF_CHECKS or LAUNCHES[np].get("TF_MPI_TEST_TF") == "1"]


@pytest.mark.parametrize("np,check", CASES)
def test_hierarchical(np, check):
    assert_check(launch(np), np, check)


@pytest.mark.parametrize("np", sorted(LAUNCHES))
def test_forced_on_without_several_nodes_is_logged(np):
    """TF_MPI_HIERARCHICAL=1 on one node (or one rank per node) warns once, on rank 0, and runs flat."""
    run = launch(np)
    warnings = [line for line in run.output.splitlines()
                if "WARNING: TF_MPI_HIERARCHICAL=1: not used: it needs more than one node" in line]
    assert len(warnings) == 2 and all(line.startswith("[tf_mpi rank 0]") for line in warnings), run.describe()
