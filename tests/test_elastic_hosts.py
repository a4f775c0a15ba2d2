"""Losing a whole host in elastic mode, on pretend hosts (tests/cluster.py): Open MPI 5.0 ends
the job when a host's daemon goes, and ``python -m tf_mpi.run`` starts it again on the hosts
left, where it resumes from the last commit (TF_MPI_ELASTIC_CHECKPOINT_DIR, docs/elastic.md).

The real TensorFlow worker (tests/workers/elastic_worker.py, tape mode) trains on 2 hosts x 2
slots; the second host is killed mid-run; the relaunched 2 ranks finish, and rank 0 checks the
weights against a one-process replay of the committed schedule. (Which hosts a relaunch uses
when a discovery script lists the lost host again: tests/test_elastic_launch.py, with a
stand-in mpirun.)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, unavailable_reason  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "elastic_worker.py")
STEPS = 16
KILL_AT = 4            # the committed step after which the second host is killed
LAUNCH_TIMEOUT = 420   # two TensorFlow start-ups on a loaded 2-core machine, and the training


@pytest.fixture(scope="module")
def two_hosts():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with Cluster(hosts=2, slots=2, prefix="rl", net=19) as c:
        yield c


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_MPI_ELASTIC", "OMPI_MCA_btl", "ELASTIC_"))}
    env.update(extra)
    return env


def _train_and_kill_a_host(c, out, *extra):
    """Launches the worker on both hosts, kills the second one once rank 0 committed step
    KILL_AT, and waits for the launcher. Returns (rc, output, times): seconds from the kill to
    the launcher's relaunch line and to the relaunched job's first commit."""
    tag = f"elastic-hosts-{uuid.uuid4().hex}"
    variables = {"ELASTIC_OUT": out, "ELASTIC_MODE": "tape", "ELASTIC_STEPS": str(STEPS),
                 "ELASTIC_STEP_SLEEP": "1.0"}
    cmd = [sys.executable, "-m", "tf_mpi.run", "-np", "4", "--min-np", "2", *extra,
           *[a for name in variables for a in ("-x", name)], sys.executable, WORKER, tag]
    env = c.env(_env(TF_MPI_ELASTIC_EXIT_GRACE_S="10", **variables), clean_remote_env=True)
    proc = subprocess.Popen(c.command(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []   # (arrival time, line)
    reader = threading.Thread(target=lambda: lines.extend((time.time(), x) for x in proc.stdout), daemon=True)
    reader.start()
    progress = os.path.join(out, "progress.json")
    killed_at = resumed_at = None
    try:
        deadline = time.time() + LAUNCH_TIMEOUT
        while time.time() < deadline and proc.poll() is None and resumed_at is None:
            try:
                with open(progress) as f:
                    p = json.load(f)
            except (OSError, ValueError):
                p = {}
            if killed_at is None and p.get("size", 4) != 4:
                break   # a rank was lost before the kill (the start-up crash below): not this test's case
            if killed_at is None and p.get("size") == 4 and p.get("step", 0) >= KILL_AT:
                c.kill_host(c.hosts[1])
                killed_at = time.time()
                os.remove(progress)
            elif killed_at is not None and p:
                resumed_at = time.time()
            time.sleep(0.2)
        rc = proc.wait(max(1, deadline - time.time())) if killed_at is not None else None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            for h in c.hosts:
                c.kill_host(h)
            proc.wait(10)
        reader.join(5)
        time.sleep(0.5)
        left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()
        for pid in left:   # never leave anything behind, even when a check below fails
            subprocess.run(["kill", "-9", pid], capture_output=True)
    output = "".join(x for _, x in lines)
    relaunched = [t for t, x in lines if "relaunch 1 of" in x]
    times = {"killed": killed_at is not None,
             "relaunch_line": relaunched[0] - killed_at if relaunched and killed_at else None,
             "first_commit": resumed_at - killed_at if resumed_at and killed_at else None}
    print(f"killed {c.hosts[1]}; seconds from the kill: {times}")
    assert not left, f"left running: {left}"
    assert killed_at is not None or "Segmentation fault" in output, output[-6000:]
    return rc, output, times


def _result(out):
    with open(os.path.join(out, "result.json")) as f:
        r = json.load(f)
    print(f"sizes {r['sizes']}; max |diff| vs replay {r['max_abs_diff_vs_replay']:.2e}")
    assert r["allclose_vs_replay"] and r["identical_on_every_rank"], r
    assert len(r["sizes"]) == STEPS, r
    return r


def test_lost_host_relaunch_resumes_from_the_last_commit(two_hosts):
    """--host h1:2,h2:2, h2 killed: the launcher relaunches 2 ranks on h1 (the declared hosts less
    the lost one); they resume from the last commit and finish."""
    c = two_hosts
    out = tempfile.mkdtemp(prefix="tfmpi-elastic-hosts-")   # every pretend host sees it
    for attempt in range(2):
        rc, output, times = _train_and_kill_a_host(c, out, "--host", c.host_list())
        # Open MPI 5.0's heartbeat thread now and then crashes a rank inside MPI_Init
        # (docs/elastic.md, "Limits"): the job goes on with 3 ranks and is never killed. Once more.
        if times["killed"] or "Segmentation fault" not in output:
            break
        print(f"start-up failure, launching again:\n{output[-3000:]}")
        shutil.rmtree(out, ignore_errors=True)
        out = tempfile.mkdtemp(prefix="tfmpi-elastic-hosts-")
    assert rc == 0, output[-8000:]
    assert f"tf_mpi.run: lost {c.hosts[1]}: relaunch 1 of 3 with 2 rank(s) on {c.hosts[0]}" in output, output[-8000:]
    r = _result(out)
    sizes = r["sizes"]
    assert r["size"] == 2 and 2 in sizes, r
    first_two = sizes.index(2)
    assert first_two >= KILL_AT and set(sizes[:first_two]) == {4} and set(sizes[first_two:]) == {2}, sizes
    assert first_two % 2 == 0   # resumed at a commit (every 2 steps)
    shutil.rmtree(out, ignore_errors=True)


def test_nothing_of_the_test_bed_is_left(two_hosts):
    """After the launches: no process in the pretend hosts (the namespaces go with the module)."""
    c = two_hosts
    time.sleep(1)
    assert all(not c.pids(h) for h in c.hosts), {h: c.pids(h) for h in c.hosts}
