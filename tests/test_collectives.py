"""allgather, broadcast, alltoall, reducescatter (every dtype, uneven sizes,
empty parts, gradients, errors), object helpers and data sharding, under
real mpirun at np=2 and np=3."""
import pytest

from mpi_harness import assert_check, check_names, run_mpi

WORKER = "collectives_worker.py"
_runs = {}


def launch(np):
    if np not in _runs:
        _runs[np] = run_mpi(np, WORKER, timeout=300, env={"TF_MPI_STALL_CHECK_TIME_SECONDS": "20",
                                                          "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "60"})
    return _runs[np]


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", check_names(WORKER))
def test_collectives(np, check):
    assert_check(launch(np), np, check)
