"""Allreduce family under real mpirun: every dtype x op, fused and unfused,
eager and tf.function, gradients, ordering, edge cases and errors.

np=2 runs with the default fusion settings (and the >2^31-element case);
np=3 runs with fusion off and 4 KiB MPI chunks, so both code paths and a
non-power-of-two world are covered; each is a section of the launch of that
size that other modules' workers join (mpi_harness.joint_launch).
"""
import pytest

from mpi_harness import assert_check, checks_at, joint_launch, left_out_env, prefetch_by_np

WORKER = "allreduce_worker.py"
# A collective that some ranks never submit fails after 60 s instead of hanging.
STALL = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "20", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "60"}
CONFIGS = {
    2: {**STALL, "TF_MPI_TEST_BIG": "1"},
    3: {**STALL, "TF_MPI_FUSION_THRESHOLD": "0", "TF_MPI_CHUNK_BYTES": "4096"},
}
ONLY_AT = {"check_count_above_int_max": (2,)}  # 2 x 4 GiB: the np=2 launch only


# np=2 allocates 2 x 4 GiB (TF_MPI_TEST_BIG): its launch never runs beside another one that needs as much.
LAUNCHES = {2: joint_launch("np2", 2, "allreduce", WORKER, env=CONFIGS[2], timeout=420, heavy=True, expected_s=25),
            3: joint_launch("np3", 3, "allreduce", WORKER, env={**CONFIGS[3], **left_out_env(WORKER, 3, ONLY_AT)},
                            timeout=240)}


def launch(np, start=False):
    return LAUNCHES[np](start=start)


prefetch = prefetch_by_np(launch)


@pytest.mark.parametrize("np", sorted(CONFIGS))
def test_launch_exits_cleanly(np):
    """Workers exit without calling shutdown(): the job must still end with rc 0 and no MPI complaints."""
    run = launch(np)
    run.assert_clean_exit()
    whole = run.launch  # the joint launch, whose last section exits without shutdown()
    assert "exited improperly" not in whole.output and "MPI_ABORT" not in whole.output, whole.describe()


@pytest.mark.parametrize("np,check", [(np, check) for np in sorted(CONFIGS)
                                      for check in checks_at(WORKER, np, ONLY_AT)])
def test_allreduce(np, check):
    assert_check(launch(np), np, check)
