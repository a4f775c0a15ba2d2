"""Fuzz under real mpirun (np=2): ~300 random calls per rank through the
TensorFlow ops and the numpy binding, about a third of them wrong on purpose
(tests/workers/fuzz_worker.py). Good calls must be right, bad calls must raise
on the ranks concerned within seconds (a call wrong on one rank only: the other
rank's stall error after TF_MPI_STALL_SHUTDOWN_TIME_SECONDS), and no process may crash. A section of
the np=2 launch that other modules' workers join (mpi_harness.joint_launch)."""
import json

from mpi_harness import assert_check, joint_launch

ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "1", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "3"}


launch = joint_launch("np2", 2, "fuzz", "fuzz_worker.py", env=ENV, timeout=240, expected_s=15)


def prefetch(items):
    launch(start=True)


def test_fuzz():
    run = launch()
    assert_check(run, 2, "check_fuzz_good_calls_right_bad_calls_errors_within_seconds_no_crash")
    summaries = [json.loads(line[5:]) for line in run.output.splitlines() if line.startswith("FUZZ ")]
    assert len(summaries) == 2, run.describe()
    for s in summaries:
        print({k: v for k, v in s.items() if k != "by_kind"})
        assert s["max_error_s"] < 5 and s["max_stall_s"] < 7, s
    # Rank 0 (the coordinator) saw each of the three one-rank mistakes as a stall error.
    assert sum(s["stalls"] for s in summaries) == 3, summaries
