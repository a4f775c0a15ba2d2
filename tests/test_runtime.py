"""Runtime behaviour under real mpirun: mpi4py coexistence in both orders,
sub-communicators, shutdown/re-init, stall detection, and a rank's uncaught
exception with the abort turned off (TF_MPI_ABORT_ON_EXCEPTION=0). The abort
itself, on by default, is checked by tests/test_faults.py (fault "raise")."""
import json
import os
import sys

import pytest

from mpi_harness import assert_check, joint_launch, run_bounded, shared_launch, with_rank_site

WORKER = "runtime_worker.py"
STALL = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "1", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "4"}
AUTOTUNE = {shm: {"TF_MPI_AUTOTUNE": "1", "TF_MPI_AUTOTUNE_STEPS": "1", "TF_MPI_SHM": shm} for shm in ("0", "1")}
MERGE = {"TF_MPI_AUTOTUNE": "plan", "TF_MPI_AUTOTUNE_STEPS": "2"}
NO_ABORT = {"TF_MPI_ABORT_ON_EXCEPTION": "0"}
# The np=2 scenarios that end cleanly are sections of the second np=2 launch that other modules'
# workers join (mpi_harness.joint_launch), each with its own settings (the engine restarts in
# between and reads them at init). tf_mpi_first comes last: it checks that the process exits
# without shutdown() being called.
SECTIONS = {name: joint_launch("np2b", 2, f"runtime.{name}", WORKER, [scenario], env, timeout=120,
                               last=name == "tf_mpi_first")
            for name, scenario, env in [("stall", "stall", STALL), ("autotune0", "autotune", AUTOTUNE["0"]),
                                        ("autotune1", "autotune", AUTOTUNE["1"]), ("merge", "merge", MERGE),
                                        ("tf_mpi_first", "tf_mpi_first", None)]}


# Scenarios that mostly wait for a rank to be ended: in the lane of waiting launches (mpi_harness.start_shared).
WAITING = {"abort"}


def launch(scenario, np=2, env=None, timeout=180, start=False):
    """One launch per scenario and environment, shared by the tests that check it."""
    return shared_launch(np, WORKER, timeout=timeout, env=env, args=[scenario], start=start,
                         waiting=scenario in WAITING)


def start_clean_launch():
    """Starts the launch of the np=2 scenarios that end cleanly in the background."""
    SECTIONS["stall"](start=True)


# test -> the launches it checks (scenario, np, env, timeout); None: the sections launch
LAUNCHES = {
    "test_mpi4py_initialises_first": [("mpi4py_first", 3, None, 180)],
    "test_tf_mpi_initialises_first": [None],
    "test_stall_is_reported_by_name_and_then_fails": [None],
    "test_autotune_switches_settings_on_every_rank_at_once": [None],
    "test_autotuned_plan_holds_allreduces_back_and_results_stay_exact": [None],
    "test_uncaught_exception_without_abort_still_ends_the_job": [("abort", 2, NO_ABORT, 120)],
}


def prefetch(items):
    for name in dict.fromkeys(item.originalname for item in items):
        for spec in LAUNCHES.get(name, []):
            if spec is None:
                start_clean_launch()
            else:
                launch(*spec, start=True)


def clean(run, whole=None):
    """The launch (whole: the sections launch `run` is a section of) ended cleanly: rc 0, no MPI complaint."""
    whole = whole or run
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert "exited improperly" not in whole.output and "MPI_ABORT" not in whole.output, whole.describe()
    if whole is not run:
        run.assert_clean_exit()


def clean_section(name):
    run = SECTIONS[name]()
    clean(run, run.launch)
    return run


@pytest.mark.parametrize("check", ["check_init_with_a_list_of_ranks", "check_init_with_an_mpi4py_communicator"])
def test_mpi4py_initialises_first(check):
    run = launch("mpi4py_first", np=3)
    clean(run)  # mpi4py finalises MPI; tf_mpi must not do it again
    assert_check(run, 3, check)


@pytest.mark.parametrize("check", ["check_mpi4py_after_tf_mpi", "check_shutdown_and_init_again",
                                   "check_one_rank_shutting_down_fails_the_others_promptly"])
def test_tf_mpi_initialises_first(check):
    run = clean_section("tf_mpi_first")  # tf_mpi finalises MPI exactly once at exit, without shutdown() called
    assert_check(run, 2, check)


def test_stall_is_reported_by_name_and_then_fails():
    run = clean_section("stall")
    assert_check(run, 2, "check_stalled_collective_fails_instead_of_hanging")
    # Rank 0's stall inspector names the tensor and the missing rank before failing it.
    assert "[tf_mpi rank 0] WARNING: stalled collectives" in run.output, run.describe()
    assert "'only.rank0.submits.this' (allreduce): ready on rank 0, waiting on rank 1" in run.output, run.describe()


def tuned_run(name, check):
    """A clean autotuned section whose `check` passed on both ranks and whose rank 0 logged its choice."""
    run = clean_section(name)
    assert_check(run, 2, check)
    assert "[tf_mpi rank 0] INFO: autotune finished" in run.output, run.describe()
    return run


@pytest.mark.parametrize("shm", ["0", "1"])
def test_autotune_switches_settings_on_every_rank_at_once(shm):
    run = tuned_run(f"autotune{shm}", "check_autotune_changes_settings_identically_and_results_stay_exact")
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
    run = tuned_run("merge", "check_held_back_allreduces_stay_exact_and_the_tuner_chooses_a_plan")
    # Three allreduces per step: 4 ways to merge neighbours, each timed, then the choice.
    timed = [line for line in run.output.splitlines() if line.startswith("  groups ") and ": median step " in line]
    assert len(timed) == 4 and "chosen: " in run.output, run.describe()
    assert "waited longer" not in run.output and "not tuned" not in run.output, run.describe()


def test_uncaught_exception_without_abort_still_ends_the_job():
    # Opt-out: rank 1 exits normally; its exit shuts its engine down, which
    # fails rank 0's pending collective instead of leaving it waiting.
    run = launch("abort", env=NO_ABORT, timeout=120)
    assert not run.timed_out, run.describe()
    assert run.returncode != 0 and run.elapsed < 60, run.describe()
    assert "boom on rank 1" in run.output and "rank 1 called shutdown()" in run.output, run.describe()


SINGLETON = """
import json, os
import numpy as np
from tf_mpi import basics, _core
basics.init()
y = _core.allreduce(np.arange(3, dtype=np.float32), basics.Sum, "singleton")
with open("/proc/self/maps") as f:
    mapped = sorted({line.split()[-1] for line in f if "/dev/shm/sm_segment" in line})
print("RESULT", json.dumps({"size": basics.size(), "y": y.tolist(), "btl": os.environ.get("OMPI_MCA_btl"),
                            "mapped": mapped}))
basics.shutdown()
"""


@pytest.mark.parametrize("btl", [None, "self,tcp"])
def test_a_process_started_without_a_launcher_maps_no_shared_memory_segment(btl):
    """A plain `python train.py` is an MPI singleton: Open MPI would map a 16 MiB segment from
    /dev/shm for its shared-memory transport and leave the file behind at exit (no launcher daemon
    cleans up). tf_mpi starts a world of one with the self transport only, unless OMPI_MCA_btl is
    set, and leaves the variable as it was (what the process launches later keeps Open MPI's
    defaults)."""
    env = with_rank_site({k: v for k, v in os.environ.items() if k != "OMPI_MCA_btl"})
    if btl is not None:
        env["OMPI_MCA_btl"] = btl
    rc, output, _, timed_out = run_bounded([sys.executable, "-c", SINGLETON], 60, env)
    assert rc == 0 and not timed_out, output
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["size"] == 1 and r["y"] == [0.0, 1.0, 2.0], r
    assert r["btl"] == btl, r
    if btl is None:
        assert r["mapped"] == [], r
