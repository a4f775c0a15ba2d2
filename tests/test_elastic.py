"""Elastic training on real ranks: lose ranks (killed, stopped, rank 0, during recovery), fall
below --min-np, grow through the discovery script; weights checked against a one-process replay
of the committed schedule (tests/workers/elastic_worker.py).

Every launch goes through `python -m tf_mpi.run --min-np ... --max-np ...` (what users run) and
is bounded in time; afterwards no worker of the launch may be left running.
"""
import json
import os
import socket
import stat
import subprocess
import sys
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpi_harness  # noqa: E402
from mpi_harness import run_bounded  # noqa: E402

pytestmark = pytest.mark.elastic

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "elastic_worker.py")
LAUNCH_TIMEOUT = 240
# Recovery from a lost rank, in two parts (docs/elastic.md). From a SIGKILL to the reset callbacks
# on the ranks that remain: the failure seen, the communicator shrunk, the engine restarted
# (0.15 s with the machine's 2 cores busy); a kill found only by the heartbeats would take their
# timeout (3 s), and fails this.
RESET_BOUND_S = 2.0
# A stopped rank is declared dead by Open MPI's heartbeat detector after its timeout (3 s as
# python -m tf_mpi.run sets it), give or take one period; then as above.
STOPPED_RESET_BOUND_S = 3.0 + 0.5 + RESET_BOUND_S
# From the reset callbacks to the first step completed: rank 0's state broadcast, and in model.fit
# Keras retracing its training step for the new size, which is CPU work: 0.5 s with the machine's
# 2 cores busy; 2.7 s from the kill to the first step was seen while the suite's launches shared them.
RESUME_BOUND_S = 6.0

# The stopped rank keeps mpirun running after rank 0 has finished: the launcher ends it this long
# after the final group's marks (not the default 20 s, which would leave the machine idle).
STOPPED_EXIT_GRACE_S = 5

# The start-up time limit of the scenario whose lost rank leaves the other inside MPI_Init.
START_TIMEOUT_S = 20

GROW_DISCOVERY = """#!/bin/sh
if [ -e {out}/grow ]; then echo {host}:3; else echo {host}:2; fi
"""

# test name -> the scenario it checks: launch(name, np, min_np, max_np, env, discovery)
SCENARIOS = {
    "test_tape_loop_survives_a_killed_rank": (
        "tape-kill", 3, 2, None, {"ELASTIC_MODE": "tape", "ELASTIC_FAULTS": "1@5", "ELASTIC_STEPS": "12"}, None),
    "test_keras_fit_survives_a_killed_rank_then_a_stopped_rank": (
        "fit-kill-stop", 3, 1, None, {"ELASTIC_MODE": "fit", "ELASTIC_FAULTS": "1@5,2@8:STOP",
                                      "ELASTIC_STEPS": "10", "TF_MPI_ELASTIC_EXIT_GRACE_S": str(STOPPED_EXIT_GRACE_S)},
        None),
    "test_rank0_lost_then_another_rank_lost_during_recovery": (
        "rank0-then-reset", 3, 1, None, {"ELASTIC_MODE": "tape", "ELASTIC_FAULTS": "0@3,2@reset",
                                         "ELASTIC_STEPS": "8"}, None),
    "test_below_min_np_ends_the_job_with_a_clear_message": (
        "below-min", 2, 2, None, {"ELASTIC_MODE": "tape", "ELASTIC_FAULTS": "1@3", "ELASTIC_STEPS": "8"}, None),
    "test_grows_when_discovery_lists_more_slots": (
        "grow", 2, 2, 3, {"ELASTIC_MODE": "tape", "ELASTIC_GROW_AT": "3", "ELASTIC_STEPS": "8"}, GROW_DISCOVERY),
    # A rank crashing (SIGSEGV) while the job starts, as Open MPI's start-up crash does.
    "test_rank_lost_at_start_the_others_carry_on": (
        "start-carry-on", 3, 2, None, {"ELASTIC_MODE": "tape", "ELASTIC_START_CRASH": "1@mpi-init",
                                       "ELASTIC_STEPS": "6"}, None),
    "test_rank_lost_in_the_engines_start_below_min_np_ends_the_job": (
        "start-below-min", 2, 2, None, {"ELASTIC_MODE": "tape", "ELASTIC_START_CRASH": "1@engine-init",
                                        "ELASTIC_STEPS": "6"}, None),
    "test_rank_lost_before_mpi_init_ends_the_start_in_bounded_time_and_the_job_starts_again": (
        "start-before-mpi", 2, 2, None, {"ELASTIC_MODE": "tape", "ELASTIC_START_CRASH": "1@before-init",
                                         "ELASTIC_STEPS": "6", "TF_MPI_ELASTIC_START_TIMEOUT_SECONDS": str(START_TIMEOUT_S)},
        None),
}


# Launcher options of a scenario beyond the sizes: the start that fails ends the job (no relaunch).
LAUNCHER_ARGS = {"start-below-min": ["--max-restarts", "0"]}


# Scenarios that mostly wait (here: rank 0 inside MPI_Init until the start-up time limit), using
# next to no CPU meanwhile: they run in the lane of waiting launches beside the pool instead of
# holding one of its slots (mpi_harness.start_waiting), so that the machine is not left idle.
WAITING = {"test_rank_lost_before_mpi_init_ends_the_start_in_bounded_time_and_the_job_starts_again"}


def prefetch(items):
    """Starts the selected scenarios' launches in the background (tests/conftest.py)."""
    for name in mpi_harness.selected_tests(items):
        if name in WAITING:
            mpi_harness.start_waiting(_scenario, name)
        elif name in SCENARIOS:
            mpi_harness.start_shared(_scenario, name, long=True)


def _scenario(test_name):
    name, np, min_np, max_np, env, discovery = SCENARIOS[test_name]
    return launch(name, np, min_np, max_np, env=dict(env), discovery=discovery)


def scenario(test_name):
    """The launch of a test's scenario: started in the background by prefetch, or run now."""
    return mpi_harness.shared_run(_scenario, test_name, long=True)


def _leftovers(tag):
    out = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()
    return [p for p in out if p != str(os.getpid())]


class _Launch:
    def __init__(self, rc, output, out, left, timed_out):
        self.rc, self.output, self.out, self.left, self.timed_out = rc, output, out, left, timed_out
        self.timeout = LAUNCH_TIMEOUT


def launch(name, np, min_np, max_np=None, env=None, discovery=None):
    """Runs one scenario; returns (rc, output, out_dir, leftovers). Open MPI 5.0.11 with ULFM's
    heartbeat thread now and then crashes a rank inside MPI_Init on a loaded machine
    (docs/elastic.md, Limits); tf_mpi then starts on the ranks left, which changes the schedule a
    scenario checks: such a launch is run again, once (mpi_harness.retry_on_start_up_crash, which
    tells it from the crashes the scenarios cause on purpose)."""
    run = mpi_harness.retry_on_start_up_crash(lambda: _launch_once(name, np, min_np, max_np, env, discovery), name)
    return run.rc, run.output, run.out, run.left


def _launch_once(name, np, min_np, max_np, env, discovery):
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tfmpi-elastic-{name}-{uuid.uuid4().hex[:8]}")
    os.makedirs(out)
    tag = f"elastic-tag-{uuid.uuid4().hex}"
    cmd = [sys.executable, "-m", "tf_mpi.run", "-np", str(np), "--min-np", str(min_np)]
    if max_np is not None:
        cmd += ["--max-np", str(max_np)]
    cmd += LAUNCHER_ARGS.get(name, [])
    if discovery is not None:
        script = os.path.join(out, "discover.sh")
        with open(script, "w") as f:
            f.write(discovery.format(out=out, host=socket.gethostname()))
        os.chmod(script, os.stat(script).st_mode | stat.S_IEXEC)
        cmd += ["--host-discovery-script", script]
    cmd += [sys.executable, WORKER, tag]
    full_env = mpi_harness.with_rank_site(dict(os.environ, ELASTIC_OUT=out, **(env or {})))
    rc, output, _, timed_out = run_bounded(cmd, LAUNCH_TIMEOUT, full_env)
    time.sleep(0.5)
    left = _leftovers(tag)
    for pid in left:  # never leave anything behind, even when the check below fails
        subprocess.run(["kill", "-9", pid], capture_output=True)
    return _Launch(rc, output, out, left, timed_out)


def result(out, output):
    path = os.path.join(out, "result.json")
    assert os.path.exists(path), f"rank 0 wrote no result:\n{output[-6000:]}"
    with open(path) as f:
        return json.load(f)


def fault_time(out, rank):
    with open(os.path.join(out, f"fault{rank}.json")) as f:
        return json.load(f)["time"]


def recovery(r, out, k, rank):
    """(fault -> reset callbacks, reset callbacks -> first step) in seconds, for the k-th reset
    (rank 0's clock; the fault's time is the one `rank` wrote just before it)."""
    fault, (reset, _), first = fault_time(out, rank), r["events"]["resets"][k], r["events"]["first_step_after_reset"][k]
    return reset - fault, first - reset


def assert_trained_like_replay(r):
    assert r["identical_on_every_rank"], r
    assert r["allclose_vs_replay"], (r["sizes"], r)
    assert r["reshard_covers_rest_once"], r


def test_tape_loop_survives_a_killed_rank():
    rc, output, out, left = scenario("test_tape_loop_survives_a_killed_rank")
    assert rc == 0, output[-6000:]
    assert left == [], left
    r = result(out, output)
    assert_trained_like_replay(r)
    assert r["size"] == 2
    # Step 4 was committed at size 3; step 5's attempt was lost and redone at size 2 from step 4.
    assert r["sizes"] == [3] * 4 + [2] * 8, r["sizes"]
    to_reset, to_step = recovery(r, out, 0, 1)
    print(f"tape loop: {to_reset + to_step:.2f} s from the SIGKILL to the first step at size 2 "
          f"({to_reset:.2f} s to the reset)")
    assert 0 < to_reset < RESET_BOUND_S and 0 < to_step < RESUME_BOUND_S, (to_reset, to_step)


def test_keras_fit_survives_a_killed_rank_then_a_stopped_rank():
    """model.fit with the elastic callbacks, np=3: rank 1 SIGKILLed mid-epoch, later rank 2
    SIGSTOPped (hung, not dead); training finishes on rank 0 alone (--min-np 1)."""
    rc, output, out, left = scenario("test_keras_fit_survives_a_killed_rank_then_a_stopped_rank")
    assert rc == 0, output[-6000:]
    assert left == [], left
    r = result(out, output)
    assert_trained_like_replay(r)
    assert r["size"] == 1, r
    # Rank 1 dies after step 5 inside fit: steps 5-6 are redone at size 2 from the commit at 4;
    # rank 2 stops after step 8, whose commit rank 0 saved before its collective part failed:
    # steps 9-10 at size 1.
    assert r["sizes"] == [3] * 4 + [2] * 4 + [1] * 2, r["sizes"]
    killed, stopped = recovery(r, out, 0, 1), recovery(r, out, 1, 2)
    print(f"model.fit: {sum(killed):.2f} s from the SIGKILL to the first step at size 2 "
          f"({killed[0]:.2f} s to the reset), {sum(stopped):.2f} s from the SIGSTOP to the first step at "
          f"size 1 ({stopped[0]:.2f} s to the reset)")
    assert 0 < killed[0] < RESET_BOUND_S and 0 < killed[1] < RESUME_BOUND_S, killed
    assert 0 < stopped[0] < STOPPED_RESET_BOUND_S and 0 < stopped[1] < RESUME_BOUND_S, stopped


def test_rank0_lost_then_another_rank_lost_during_recovery():
    rc, output, out, left = scenario("test_rank0_lost_then_another_rank_lost_during_recovery")
    assert rc == 0, output[-6000:]
    assert left == [], left
    r = result(out, output)
    assert_trained_like_replay(r)
    assert r["size"] == 1, r
    # Step 2 committed at size 3; the lost attempt at step 3 and everything after at size 1.
    assert r["sizes"] == [3] * 2 + [1] * 6, r["sizes"]


def test_below_min_np_ends_the_job_with_a_clear_message():
    rc, output, out, left = scenario("test_below_min_np_ends_the_job_with_a_clear_message")
    assert rc != 0, output[-6000:]
    assert left == [], left
    assert "fewer than the minimum of 2" in output, output[-6000:]
    assert not os.path.exists(os.path.join(out, "result.json"))


def test_grows_when_discovery_lists_more_slots():
    rc, output, out, left = scenario("test_grows_when_discovery_lists_more_slots")
    assert rc == 0, output[-6000:]
    assert left == [], left
    r = result(out, output)
    assert_trained_like_replay(r)
    assert r["size"] == 3
    # Rank 0 finds the new slot while at step 3; every rank learns of it at the commit after
    # step 4 (no rollback), and steps 4.. run on 3 ranks.
    assert r["sizes"] == [2] * 4 + [3] * 4, r["sizes"]


def _start_crash(out):
    with open(os.path.join(out, "start_crash.json")) as f:
        return json.load(f)


def test_rank_lost_at_start_the_others_carry_on():
    """np=3, --min-np 2: rank 1 crashes (SIGSEGV) right after MPI_Init, while the others duplicate
    MPI_COMM_WORLD for elastic mode (a collective that then fails on some ranks only): the two
    left agree on it, start on their own and train the whole schedule at size 2."""
    rc, output, out, left = scenario("test_rank_lost_at_start_the_others_carry_on")
    assert rc == 0, output[-6000:]
    assert left == [], left
    assert _start_crash(out)["where"] == "mpi-init"
    r = result(out, output)
    assert_trained_like_replay(r)
    assert r["size"] == 2 and r["sizes"] == [2] * 6, r["sizes"]
    assert "elastic job: 2 rank(s) finished (min-np 2)" in output, output[-6000:]


def test_rank_lost_in_the_engines_start_below_min_np_ends_the_job():
    """np=2, --min-np 2, --max-restarts 0: rank 1 crashes while rank 0 is inside the engine's
    start-up collectives: rank 0 ends with MembershipError (not an error about its settings, not a
    hang), exit status 1, and the launcher, allowed no restart, does not start the job again."""
    rc, output, out, left = scenario("test_rank_lost_in_the_engines_start_below_min_np_ends_the_job")
    assert rc == 1, output[-6000:]
    assert left == [], left
    assert _start_crash(out)["where"] == "engine-init"
    assert "MembershipError" in output and "fewer than the minimum of 2 (--min-np)" in output, output[-6000:]
    assert "TF_MPI_TOPOLOGY" not in output, output[-6000:]
    assert "1 rank(s) marked a failure" in output, output[-6000:]
    assert "the job did not start: relaunch" not in output, output[-6000:]
    assert not os.path.exists(os.path.join(out, "result.json"))


def test_rank_lost_before_mpi_init_ends_the_start_in_bounded_time_and_the_job_starts_again():
    """np=2: rank 1 crashes before MPI_Init (once); Open MPI keeps rank 0 inside MPI_Init waiting
    for it forever. Rank 0 ends after the start-up time limit, saying why, and marks a failed
    start; the launcher starts the job again, which trains the whole schedule on 2 ranks."""
    rc, output, out, left = scenario(
        "test_rank_lost_before_mpi_init_ends_the_start_in_bounded_time_and_the_job_starts_again")
    assert left == [], left
    assert _start_crash(out)["where"] == "before-init"
    assert f"the job did not start within {START_TIMEOUT_S} s (TF_MPI_ELASTIC_START_TIMEOUT_SECONDS)" in output, \
        output[-6000:]
    assert "1 rank(s) marked a failure" in output, output[-6000:]
    assert "tf_mpi.run: the job did not start: relaunch 1 of 3 (once for a failed start)" in output, output[-6000:]
    assert rc == 0, output[-6000:]
    r = result(out, output)
    assert_trained_like_replay(r)
    assert r["size"] == 2 and r["sizes"] == [2] * 6, r["sizes"]
