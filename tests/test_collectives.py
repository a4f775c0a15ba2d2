"""allgather, broadcast, alltoall, reducescatter (every dtype, uneven sizes,
empty parts, gradients, errors), object helpers and data sharding, under
real mpirun at np=2 and np=3, each a section of the launch of that size that
other modules' workers join (mpi_harness.joint_launch); at np=2 it is the last
section, so the timeline it records runs to the process's exit."""
import json
import os
import tempfile

import pytest

from mpi_harness import assert_check, check_names, joint_launch, prefetch_by_np, selected_tests

WORKER = "collectives_worker.py"
TRACE = os.path.join(tempfile.mkdtemp(), "whole_run.json")


ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "20", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "60"}
LAUNCHES = {2: joint_launch("np2", 2, "collectives", WORKER, env={**ENV, "TF_MPI_TIMELINE": TRACE}, last=True),
            3: joint_launch("np3", 3, "collectives", WORKER, env=ENV)}  # np=2: the whole run, from init() to exit


def launch(np, start=False):
    return LAUNCHES[np](start=start)


def prefetch(items):
    if "test_timeline_from_environment_is_valid_json_after_exit" in selected_tests(items):
        launch(2, start=True)
    prefetch_by_np(launch)(items)


def test_timeline_from_environment_is_valid_json_after_exit():
    run = launch(2)
    assert run.returncode == 0, run.describe()
    with open(TRACE) as f:
        events = json.load(f)["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"ag.float32", "rs.sum", "a2a.splits"} <= names
    assert any(e["name"] == "MPI_ALLTOALL" for e in events)


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_collectives(np, check):
    assert_check(launch(np), np, check)
