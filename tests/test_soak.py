"""Soak under real mpirun (np=3): thousands of collectives from 4 threads per
rank in rank-dependent orders, random sizes (fused, direct, chunked), a response
cache of 4 entries (most names negotiate in full; cached ones change shape in
place) and join() at random points. See tests/workers/soak_worker.py, which is
also the benchmark (longer --rounds)."""
from mpi_harness import assert_check, shared_launch

ENV = {"TF_MPI_CACHE_CAPACITY": "4", "TF_MPI_FUSION_THRESHOLD": "65536", "TF_MPI_FUSION_DIRECT_BYTES": "16384",
       "TF_MPI_CHUNK_BYTES": "32768",
       # A collective that some rank never submits fails after 30 s instead of waiting forever.
       "TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30"}
ROUNDS = 150  # ~5,000 collectives; about 10 s on 2 busy cores


def launch(start=False):
    return shared_launch(3, "soak_worker.py", timeout=120, env=ENV, args=["--rounds", str(ROUNDS)], start=start)


def prefetch(items):
    launch(start=True)


def test_soak():
    run = launch()
    assert_check(run, 3, "check_soak_results_are_exact_and_identical_on_every_rank")
    assert "soak: " in run.output and "stalled" not in run.output, run.describe()
    print([line for line in run.output.splitlines() if line.startswith("soak: ")][0])
