"""Runtime behaviour under real mpirun: mpi4py coexistence in both orders,
sub-communicators, shutdown/re-init, stall detection and job abort."""
import pytest

from mpi_harness import assert_check, run_mpi

WORKER = "runtime_worker.py"
_runs = {}


def launch(scenario, np=2, env=None, timeout=180):
    """One launch per scenario and environment, shared by the tests that check it."""
    key = (scenario, tuple(sorted((env or {}).items())))
    if key not in _runs:
        _runs[key] = run_mpi(np, WORKER, timeout=timeout, env=env, args=[scenario])
    return _runs[key]


def clean(run):
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert "exited improperly" not in run.output and "MPI_ABORT" not in run.output, run.describe()


@pytest.mark.parametrize("check", ["check_init_with_a_list_of_ranks", "check_init_with_an_mpi4py_communicator"])
def test_mpi4py_initialises_first(check):
    run = launch("mpi4py_first", np=3)
    clean(run)  # mpi4py finalises MPI; tf_mpi must not do it again
    assert_check(run, 3, check)


@pytest.mark.parametrize("check", ["check_mpi4py_after_tf_mpi", "check_shutdown_and_init_again",
                                   "check_one_rank_shutting_down_fails_the_others_promptly"])
def test_tf_mpi_initialises_first(check):
    run = launch("tf_mpi_first")
    clean(run)  # tf_mpi finalises MPI exactly once at exit, without shutdown() being called
    assert_check(run, 2, check)


def test_stall_is_reported_by_name_and_then_fails():
    run = launch("stall", env={"TF_MPI_STALL_CHECK_TIME_SECONDS": "1", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "4"})
    clean(run)
    assert_check(run, 2, "check_stalled_collective_fails_instead_of_hanging")
    # Rank 0's stall inspector names the tensor and the missing rank before failing it.
    assert "[tf_mpi rank 0] WARNING: stalled collectives" in run.output, run.describe()
    assert "'only.rank0.submits.this' (allreduce): ready on rank 0, waiting on rank 1" in run.output, run.describe()


def tuned_run(scenario, env, check):
    """A clean autotuned launch whose `check` passed on both ranks and whose rank 0 logged its choice."""
    run = launch(scenario, env=env)
    clean(run)
    assert_check(run, 2, check)
    assert "[tf_mpi rank 0] INFO: autotune finished" in run.output, run.describe()
    return run


@pytest.mark.parametrize("shm", ["0", "1"])
def test_autotune_switches_settings_on_every_rank_at_once(shm):
    run = tuned_run("autotune", {"TF_MPI_AUTOTUNE": "1", "TF_MPI_AUTOTUNE_STEPS": "1", "TF_MPI_SHM": shm},
                    "check_autotune_changes_settings_identically_and_results_stay_exact")
    # Rank 0 logs every candidate's step time and its choice: 5 direct_bytes
    # values, 4 fusion thresholds, 3 MPI chunk sizes. Over shared memory no
    # tensor can skip a fusion buffer, so direct_bytes is left alone.
    skipped = "direct_bytes: not tuned (every host allreduce goes over shared memory"
    timed = run.output.count(": median step ")
    if shm == "0":
        assert timed >= 12 and skipped not in run.output, run.describe()
    else:
        assert timed == 7 and skipped in run.output, run.describe()
    assert "chosen: fusion_threshold=" in run.output, run.describe()
    # Each step's second allreduce is submitted only after the first returned
    # (eager), so holding the first back for the second cannot work: the
    # holdback gives up after its time limit instead of hanging.
    assert "held-back allreduce waited longer than the step-time limit" in run.output, run.describe()
    assert "groups: not tuned (a held allreduce waited too long" in run.output, run.describe()


def test_autotuned_plan_holds_allreduces_back_and_results_stay_exact():
    run = tuned_run("merge", {"TF_MPI_AUTOTUNE": "plan", "TF_MPI_AUTOTUNE_STEPS": "2"},
                    "check_held_back_allreduces_stay_exact_and_the_tuner_chooses_a_plan")
    # Three allreduces per step: 4 ways to merge neighbours, each timed, then the choice.
    timed = [line for line in run.output.splitlines() if line.startswith("  groups ") and ": median step " in line]
    assert len(timed) == 4 and "chosen: " in run.output, run.describe()
    assert "waited longer" not in run.output and "not tuned" not in run.output, run.describe()


def test_uncaught_exception_aborts_the_job():
    run = launch("abort", timeout=120)
    assert not run.timed_out, run.describe()
    assert run.returncode != 0 and run.elapsed < 60, run.describe()
    assert "[tf_mpi rank 1] uncaught exception" in run.output and "boom on rank 1" in run.output, run.describe()
    assert "aborting the job" in run.output, run.describe()


def test_uncaught_exception_without_abort_still_ends_the_job():
    # Opt-out: rank 1 exits normally; its exit shuts its engine down, which
    # fails rank 0's pending collective instead of leaving it waiting.
    run = run_mpi(2, WORKER, timeout=120, env={"TF_MPI_ABORT_ON_EXCEPTION": "0"}, args=["abort"])
    assert not run.timed_out, run.describe()
    assert run.returncode != 0 and run.elapsed < 60, run.describe()
    assert "boom on rank 1" in run.output and "rank 1 called shutdown()" in run.output, run.describe()

