"""The engine's hazards, each provoked on purpose under real mpirun:
what a caller's thread executes inline, where completion callbacks run,
messages left at shutdown, counts beyond MPI's ints, a garbled protocol
message, and the MPI thread level. numpy-only workers (tests/workers/hardening_worker.py)."""
import pytest

from mpi_harness import assert_check, param, shared_launch

WORKER = "hardening_worker.py"
SCENARIOS = {"engine": 3, "big": 1, "corrupt": 3, "stale": 2, "serialized": 2, "settings": 3}
# 64 MiB chunks: the > 2^31 reducescatter moves 2 GiB, in fewer calls than the default 1 MiB.
ENV = {"big": {"TF_MPI_CHUNK_BYTES": str(64 << 20)},
       "stale": {"TF_MPI_STALL_CHECK_TIME_SECONDS": "2", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "10"}}
# Tests that check a launch's log or exit (relay: that alone), not one check_* result.
OWN_TESTS = {"test_a_relay_that_cannot_read_its_child_aborts_the_job": "relay",
             "test_undelivered_messages_are_reported_with_their_peer": "engine",
             "test_rank0_logs_why_it_stopped_coordinating": "corrupt"}


def launch(scenario, start=False):
    # The big scenario's reducescatter moves 2 GiB: never beside another launch that needs as much.
    # The others use little CPU (numpy only; peer time-outs and stall checks they wait for): they
    # run in the lane of waiting launches (mpi_harness.start_shared).
    np = 4 if scenario == "relay" else SCENARIOS[scenario]
    return shared_launch(np, WORKER, timeout=120 if scenario == "relay" else 180, env=ENV.get(scenario),
                         args=[scenario], heavy=scenario == "big", start=start, waiting=scenario != "big")


def prefetch(items):
    # numpy-only launches of a few seconds each.
    for scenario in dict.fromkeys(param(item, "scenario", OWN_TESTS.get(item.originalname)) for item in items):
        if scenario is not None:
            launch(scenario, start=True)


def checks_of(scenario):
    """The check_* names defined under the worker's `if/elif SCENARIO == "<scenario>":` branches."""
    import os
    import re
    from mpi_harness import WORKERS
    names, inside = [], False
    for line in open(os.path.join(WORKERS, WORKER)):
        if line and not line[0].isspace() and line.strip():
            inside = re.match(rf'(el)?if SCENARIO == "{scenario}":', line) is not None
        elif inside and (m := re.match(r"    def (check_\w+)\(", line)):
            names.append(m.group(1))
    assert names, f"scenario {scenario} defines no checks"
    return names


CASES = [(s, c) for s in SCENARIOS for c in checks_of(s)]


@pytest.mark.parametrize("scenario,check", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_hardening(scenario, check):
    assert_check(launch(scenario), SCENARIOS[scenario], check)


def test_undelivered_messages_are_reported_with_their_peer():
    run = launch("engine")
    assert_check(run, 3, "check_shutdown_sends_nothing_to_a_departed_rank_and_cancels_what_is_left")
    assert "[tf_mpi rank 2] WARNING: at shutdown 1 protocol message(s)" in run.output, run.describe()
    assert "to rank 0 were never received" in run.output, run.describe()
    assert "[tf_mpi rank 0] WARNING: at shutdown" not in run.output, run.describe()


def test_rank0_logs_why_it_stopped_coordinating():
    run = launch("corrupt")
    assert_check(run, 3, "check_a_garbled_announcement_stops_the_engine_cleanly_everywhere")
    assert ("[tf_mpi rank 0] ERROR: tf_mpi: rank 0 stopped coordinating after an internal error: "
            "tf_mpi: truncated negotiation message") in run.output, run.describe()
    assert "terminate called" not in run.output, run.describe()


def test_a_relay_that_cannot_read_its_child_aborts_the_job():
    # np=4: rank 2 relays rank 3's announcements to rank 0 in the negotiation tree.
    run = launch("relay")
    assert not run.timed_out and run.returncode != 0, run.describe()
    assert ("[tf_mpi rank 2] ERROR: internal error in the negotiation with rank 0: tf_mpi: truncated negotiation "
            "message") in run.output, run.describe()
    assert "aborting the job" in run.output and "went on" not in run.output, run.describe()
    assert "terminate called" not in run.output, run.describe()
    assert run.elapsed < 60, run.describe()
