"""allgather, broadcast, alltoall, reducescatter (every dtype, uneven sizes,
empty parts, gradients, errors), object helpers and data sharding, under
real mpirun at np=2 and np=3."""
import json
import os
import tempfile

import pytest

from mpi_harness import assert_check, check_names, prefetch_by_np, selected_tests, shared_launch

WORKER = "collectives_worker.py"
TRACE = os.path.join(tempfile.mkdtemp(), "whole_run.json")


def launch(np, start=False):
    env = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "20", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "60"}
    if np == 2:
        env["TF_MPI_TIMELINE"] = TRACE  # the whole run, from init() to exit
    return shared_launch(np, WORKER, timeout=300, env=env, start=start)


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
