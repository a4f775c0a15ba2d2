"""A host lost in the middle of a job, on pretend hosts (tests/cluster.py).

Two jobs run at the same time on one test-bed cluster of six hosts (prefix
"flt", its own subnet), each on three hosts with one rank per host, running
tests/workers/cluster_fault_worker.py (allreduces in a loop, numpy only); a
third one follows the first on its hosts:

- kill: every process of the third host is SIGKILLed (Cluster.kill_host). The
  launch must end within KILL_LIMIT_S, name the lost host, and leave no process
  on any of its hosts.
- link: the third host's cable is pulled (Cluster.set_link). The two ranks on
  the connected side are blocked inside MPI; tf_mpi's MPI watchdog
  (TF_MPI_MPI_TIMEOUT_SECONDS=2 here) must end them within LINK_LIMIT_S, with
  its error in the log (the first rank whose watchdog fires aborts the job, so
  the other may be ended by that abort before it logs its own). Should the
  cut come while rank 0 still waits for the cut-off rank's announcement, no
  one is inside MPI: the peer liveness check (TF_MPI_PEER_TIMEOUT_SECONDS=2
  here) ends the job instead, as in the next job. The link is then restored: within
  RELINK_LIMIT_S nothing of the job may be left on any host (the cut-off
  host's daemon and rank included), and the launch must have ended non-zero.
  Before the link is restored, the launch itself must be over: Open MPI's
  launcher would wait for the cut-off host's daemon until the link returns;
  tf_mpi.run ends it EXIT_GRACE_S after it reported the job failed.
- negotiation: the third host's rank stops submitting (TF_MPI_TEST_QUIET_RANK)
  and the other two wait in negotiation for its announcement, inside no MPI
  call; then its cable is pulled. Rank 0 must declare rank 2 unreachable (no
  heartbeat for TF_MPI_PEER_TIMEOUT_SECONDS), the connected ranks' collectives
  fail naming it, and they are gone within LINK_LIMIT_S, without
  TF_MPI_STALL_SHUTDOWN_TIME_SECONDS (a slow rank is still waited for forever);
  after the link is restored, nothing is left, as above.

Times are taken by polling /proc and the namespaces' process lists every 20 ms.
"""
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import cluster
from mpi_harness import LISTENER_RETRY_SLEEP_S, WORKERS, launch_env, listener_failed, process_alive

pytestmark = pytest.mark.hosts  # pretend hosts (tests/cluster.py): -m "not hosts" leaves them out

KILL_LIMIT_S = 10
WATCHDOG_S = 2
PEER_S = 2                  # a cut while rank 0 still waits for the cut-off rank's announcement
LINK_LIMIT_S = 8            # watchdog (or peer timeout) 2 s + one check period + the abort's 2 s grace, margin
RELINK_LIMIT_S = 30
EXIT_GRACE_S = 2            # TF_MPI_RUN_EXIT_GRACE_SECONDS: mpirun's time to end after it reported the failure
LAUNCH_LIMIT_S = LINK_LIMIT_S + EXIT_GRACE_S + 3   # + the launcher's last second of reading mpirun's pipes, margin
START_TIMEOUT_S = 90
_runs = {}


def _wait(predicate, limit):
    end = time.time() + limit
    while time.time() < end:
        if predicate():
            return time.time()
        time.sleep(0.02)
    return None


def _job(c, scenario, hosts):
    out = tempfile.mkdtemp(prefix=f"tfmpi_flt_{scenario}_")
    run = _runs[scenario] = {"out": out, "hosts": hosts, "victim": hosts[2]}
    # As a user launches across hosts (tf_mpi.run forwards the TF_MPI_* settings itself).
    cmd = [sys.executable, "-m", "tf_mpi.run", "-np", "3", "--host", ",".join(f"{h}:1" for h in hosts),
           "--map-by", "node", sys.executable, os.path.join(WORKERS, "cluster_fault_worker.py")]
    quiet = {"TF_MPI_TEST_QUIET_RANK": "2"} if scenario == "negotiation" else {}
    env = c.env(launch_env({"TF_MPI_TEST_OUT": out, "TF_MPI_MPI_TIMEOUT_SECONDS": str(WATCHDOG_S),
                            "TF_MPI_PEER_TIMEOUT_SECONDS": str(PEER_S),
                            "TF_MPI_RUN_EXIT_GRACE_SECONDS": str(EXIT_GRACE_S), **quiet}))
    log_path = os.path.join(out, "log")
    for attempt in range(2):
        with open(log_path, "w") as log:
            proc = subprocess.Popen(c.command(cmd, host=hosts[0]), env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        going = _wait(lambda: all(os.path.exists(os.path.join(out, f"going.{r}")) for r in range(3))
                      or proc.poll() is not None, START_TIMEOUT_S)
        with open(log_path) as f:
            if attempt == 0 and proc.poll() is not None and listener_failed(proc.returncode, f.read()):
                time.sleep(LISTENER_RETRY_SLEEP_S)   # Open MPI's launcher did not start: once more
                continue
        break
    try:
        if going and quiet:
            # Rank 2 has stopped submitting; the others are in their next collective's negotiation.
            going = _wait(lambda: os.path.exists(os.path.join(out, "quiet.2")) or proc.poll() is not None, 10)
            time.sleep(0.5)
        run["started"] = going is not None and proc.poll() is None
        if not run["started"]:
            return
        ranks = {}
        for r in range(3):
            pid, host = open(os.path.join(out, f"pid.{r}")).read().split()
            ranks[r] = (int(pid), host)
        run["ranks"] = ranks
        survivors = [pid for pid, host in ranks.values() if host != run["victim"]]
        everything_gone = lambda: proc.poll() is not None and not any(c.pids(h) for h in hosts)  # noqa: E731
        fault = time.time()
        if scenario == "kill":
            c.kill_host(run["victim"])
            run["gone_after"] = _t(_wait(everything_gone, KILL_LIMIT_S + 20), fault)
        else:
            c.set_link(run["victim"], False)
            run["survivors_after"] = _t(_wait(lambda: not any(process_alive(p) for p in survivors), LINK_LIMIT_S + 20), fault)
            # The job is over for the connected side; the launch must end with the cable still out.
            run["launch_after"] = _t(_wait(lambda: proc.poll() is not None, LAUNCH_LIMIT_S + 10), fault)
            relink = time.time()
            c.set_link(run["victim"], True)
            run["gone_after_relink"] = _t(_wait(everything_gone, RELINK_LIMIT_S + 20), relink)
        run["left"] = {h: c.pids(h) for h in hosts}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        run["rc"] = proc.wait()
        with open(log_path) as f:
            run["output"] = f.read()


def _t(when, since):
    return None if when is None else when - since


@pytest.fixture(scope="module")
def runs():
    reason = cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    c = cluster.Cluster(hosts=6, slots=1, prefix="flt", net=5)
    try:
        c.up()
        def kill_then_negotiation():
            _job(c, "kill", c.hosts[:3])
            _job(c, "negotiation", c.hosts[:3])   # the killed host's namespace is still there

        threads = [threading.Thread(target=kill_then_negotiation),
                   threading.Thread(target=_job, args=(c, "link", c.hosts[3:]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        yield _runs
    finally:
        c.down()


def _describe(run):
    figures = {k: v for k, v in run.items() if k not in ("output",)}
    return f"{figures}\n--- output tail ---\n{run.get('output', '')[-5000:]}"


def test_a_killed_host_ends_the_job_and_leaves_nothing(runs):
    run = runs["kill"]
    assert run["started"], _describe(run)
    print(f"kill: every process on every host gone {run['gone_after']} s after the host was killed, rc={run['rc']}")
    assert run["gone_after"] is not None and run["gone_after"] < KILL_LIMIT_S, _describe(run)
    assert not any(run["left"].values()), _describe(run)
    assert run["victim"] in run["output"], "the launcher's message names the lost host\n" + _describe(run)


def test_a_killed_host_makes_the_launch_fail(runs):
    # Open MPI 5.0.11's launcher itself exits 0 here ("PRTE has lost communication with a remote
    # daemon"); tf_mpi.run turns the reported loss into exit status 1.
    run = runs["kill"]
    assert run["started"], _describe(run)
    assert run["rc"] != 0, _describe(run)
    assert "tf_mpi.run: mpirun lost a host" in run["output"], _describe(run)


def test_a_cut_link_is_an_error_on_every_connected_rank(runs):
    run = runs["link"]
    assert run["started"], _describe(run)
    after = run["survivors_after"]
    print(f"link: connected ranks gone {after} s after the cut (watchdog {WATCHDOG_S} s)")
    # The watchdog fires no sooner than WATCHDOG_S after the cut. When the peer liveness check ended
    # the job instead (see below), its timeout ran from the last heartbeat, which may have come just
    # before the cut: no sooner than PEER_S - 1 then, as in the negotiation job (seen: 1.75 s).
    by_peer_check = "[tf_mpi rank 0] ERROR: rank 2 is unreachable" in run["output"]
    earliest = PEER_S - 1 if by_peer_check else WATCHDOG_S
    assert after is not None and earliest <= after < LINK_LIMIT_S, _describe(run)
    # Whichever connected rank's watchdog fires first aborts the job; the other one may be ended by
    # that abort (or by MPI seeing its peer's socket close) before its own watchdog fires. A cut that
    # comes while rank 0 still waits for the cut-off rank's announcement is the peer liveness
    # check's (nobody is inside MPI yet): its error instead.
    reported = [r for r, (_, host) in run["ranks"].items() if host != run["victim"] and re.search(
        rf"\[tf_mpi rank {r}\] ERROR: collective 'loop' \(4096 bytes\) has been inside MPI for [\d.]+ s",
        run["output"])]
    unreachable = "[tf_mpi rank 0] ERROR: rank 2 is unreachable" in run["output"]
    print(f"link: watchdog error logged by connected rank(s) {reported}; rank 2 declared unreachable: {unreachable}")
    assert reported or unreachable, _describe(run)


def test_a_cut_link_during_negotiation_is_an_error_naming_the_lost_rank(runs):
    run = runs["negotiation"]
    assert run["started"], _describe(run)
    after = run["survivors_after"]
    print(f"negotiation: connected ranks gone {after} s after the cut (peer timeout {PEER_S} s)")
    # Declared between the timeout and the timeout + 2 heartbeat intervals (1/3 s) after the last
    # heartbeat, which may have come up to 2 intervals before the cut.
    assert after is not None and PEER_S - 1 <= after < LINK_LIMIT_S, _describe(run)
    assert "[tf_mpi rank 0] ERROR: rank 2 is unreachable (no heartbeat for 2 s" in run["output"], _describe(run)
    # The connected ranks' collective failed with that reason (their uncaught error aborted the job).
    assert re.search(r"collective 'loop' cannot complete: rank 2 is unreachable", run["output"]), _describe(run)
    assert "has been inside MPI" not in run["output"], "nobody was inside MPI\n" + _describe(run)


@pytest.mark.parametrize("scenario", ["link", "negotiation"])
def test_a_cut_link_ends_the_launch_before_the_link_returns(runs, scenario):
    run = runs[scenario]
    assert run["started"], _describe(run)
    print(f"{scenario}: launch ended {run['launch_after']} s after the cut, rc={run['rc']}")
    assert run["launch_after"] is not None and run["launch_after"] < LAUNCH_LIMIT_S, _describe(run)
    assert run["rc"] == 1, _describe(run)
    if "mpirun was still waiting" not in run["output"]:
        print(f"{scenario}: mpirun ended by itself")


@pytest.mark.parametrize("scenario", ["link", "negotiation"])
def test_after_the_link_returns_nothing_is_left(runs, scenario):
    run = runs[scenario]
    assert run["started"], _describe(run)
    print(f"{scenario}: every process on every host gone {run['gone_after_relink']} s after the link came back, "
          f"rc={run['rc']}")
    assert run["gone_after_relink"] is not None and run["gone_after_relink"] < RELINK_LIMIT_S, _describe(run)
    assert not any(run["left"].values()), _describe(run)
    assert run["rc"] != 0, _describe(run)
