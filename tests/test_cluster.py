"""tf_mpi across pretend hosts: separate network stacks joined by a bridge (tests/cluster.py),
launched as on a real cluster with ``python -m tf_mpi.run -np N --host ... / --hostfile ...``
and an ssh stand-in that starts remote processes with a login's environment (what a rank on
another host needs travels with ``-x``; tf_mpi.run forwards every TF_MPI_* variable itself).

Launches (prefix "xh", addresses 10.231.7.0/24; one cluster of 4 hosts for the module, most
launches on the first 2):

  A. 2 hosts x 2 ranks, --hostfile, with TensorFlow: every check of tests/workers/cluster_worker.py
     (node detection, every collective and dtype, hierarchical vs flat, negotiation messages,
     model.fit against one model on all the data with identical optimizer state, a timeline with every
     host's ranks).
  B. 2 hosts x 3 ranks, --host, array API only: the node, collective, hierarchical and
     negotiation checks at a size where the tree is not the star and node shards are uneven.
  C. 2 + 1 ranks (hosts of unequal size), --host, array API only: is_homogeneous() False,
     TF_MPI_HIERARCHICAL=1 falls back to the flat path with the same bits.
  D. 4 hosts x 1 rank, --host, array API only: every message crosses hosts; no hierarchical path.

Needs root (network namespaces); skipped with the reason otherwise.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

import cluster
from mpi_harness import (WORKERS, MpiRun, assert_check, check_names, launch_env, read_results,
                         run_bounded)

pytestmark = pytest.mark.hosts  # pretend hosts (tests/cluster.py): -m "not hosts" leaves them out

PREFIX, NET = "xh", 7
WORKER = "cluster_worker.py"
CHECKS = check_names(WORKER)
ARRAY_CHECKS = [c for c in CHECKS if not c.startswith("check_tf_")]
# A collective some ranks never reach fails after 120 s rather than hanging until the launch's limit.
# The stall check's quarter (15 s) is when the negotiation tree sends a partial report on: long
# enough that a rank descheduled on this busy machine adds no message to the counted steps.
ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "60", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "120",
       "TF_MPI_OVERLAP": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
# Not TF_MPI_*: what the ranks on the other host need besides, passed as a user would (-x);
# PYTHONPATH carries tests/rank_site (mpi_harness.with_rank_site).
FORWARD = ("TF_CPP_MIN_LOG_LEVEL", "PYTHONUNBUFFERED", "PYTHONPATH")

@pytest.fixture(scope="module")
def bed():
    reason = cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with cluster.Cluster(hosts=4, slots=3, prefix=PREFIX, net=NET) as c:
        yield c


def tf_mpi_run(c, np, where, program, env, timeout, cwd):
    """``python -m tf_mpi.run -np N <where> -x ... program`` started on the first host, bounded."""
    forward = [a for name in FORWARD for a in ("-x", name)]
    argv = [sys.executable, "-m", "tf_mpi.run", "-np", str(np), *where, *forward, "--", *program]
    return run_bounded(c.command(argv), timeout, c.env(launch_env(env), clean_remote_env=True), cwd=cwd)


def launch_worker(c, np, where, with_tf, hosts, only=None, timeout=240):
    """cluster_worker.py on np ranks; hosts: the ``h1:S,h2:S`` layout the worker expects."""
    out = tempfile.mkdtemp(prefix="tfmpi_cluster_")
    env = {**ENV, "TF_MPI_TEST_OUT": out, "TF_MPI_TEST_TF": "1" if with_tf else "0", "TF_MPI_TEST_HOSTS": hosts}
    if only:
        env["TF_MPI_TEST_ONLY"] = ",".join(only)
    rc, output, elapsed, timed_out = tf_mpi_run(c, np, where, [sys.executable, os.path.join(WORKERS, WORKER)],
                                                env, timeout, cwd=out)
    return MpiRun(rc, output, read_results(out), elapsed, timed_out)


# Worker launches: name -> (ranks per host, in host order; how the hosts are given; with TensorFlow).
LAUNCHES = {
    "2x2 hostfile": ((2, 2), "--hostfile", True),
    "2x3 host": ((3, 3), "--host", False),
    "2+1 host": ((2, 1), "--host", False),
    "4x1 host": ((1, 1, 1, 1), "--host", False),
}
_runs = {}


def run(c, key):
    """Each worker launch of LAUNCHES once per module."""
    if key in _runs:
        return _runs[key]
    slots, how, with_tf = LAUNCHES[key]
    hosts = ",".join(f"{h}:{n}" for h, n in zip(c.hosts, slots))
    if how == "--hostfile":
        where = os.path.join(tempfile.mkdtemp(prefix="tfmpi_cluster_"), "hosts")
        with open(where, "w") as f:
            f.writelines(f"{h} slots={n}\n" for h, n in zip(c.hosts, slots))
    else:
        where = hosts
    _runs[key] = launch_worker(c, sum(slots), [how, where], with_tf, hosts,
                               None if with_tf else ARRAY_CHECKS)
    print(f"launch {key}: {_runs[key].elapsed:.1f}s")   # shown with -s, and with a failing test
    return _runs[key]


def checks_of(key):
    return CHECKS if LAUNCHES[key][2] else ARRAY_CHECKS


@pytest.mark.parametrize("key", list(LAUNCHES))
def test_launch_exits_cleanly(bed, key):
    run(bed, key).assert_clean_exit()


@pytest.mark.parametrize("key,check", [(k, c) for k in LAUNCHES for c in checks_of(k)])
def test_across_hosts(bed, key, check):
    assert_check(run(bed, key), sum(LAUNCHES[key][0]), check)


# -- the test bed itself ---------------------------------------------------------
def root_links():
    r = subprocess.run(["ip", "-o", "link", "show"], stdout=subprocess.PIPE, text=True, check=True)
    return sorted(line.split(":")[1].strip() for line in r.stdout.splitlines())


CLI = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster.py")]


def test_rerun_after_a_crash_and_down_leave_nothing(bed):
    """A cluster left up by a process that is gone, with a process still running on one of its
    hosts, is replaced by the next up() of its prefix; down() then leaves no namespace, link,
    hosts file, state or lock file, or process, and the cluster of another prefix (the module's)
    is untouched."""
    links = root_links()
    prefix, net = PREFIX + "c", NET + 1
    rc, out, _, _ = run_bounded([*CLI, "up", "--hosts", "2", "--slots", "1", "--prefix", prefix, "--net", str(net)],
                                60, dict(os.environ))
    assert rc == 0, out
    sleeper = subprocess.Popen([*CLI, "run", "--prefix", prefix, "--host", f"{prefix}-h2", "--", "sleep", "300"],
                               start_new_session=True)
    again = cluster.Cluster(hosts=3, slots=1, prefix=prefix, net=net)
    # What a killed host's ranks leave in the machine's /dev/shm; another host's file stays.
    segments = [os.path.join(cluster.SHARED_MEMORY_DIR, f"sm_segment.{h}.0.{net:x}0001.0")
                for h in (f"{prefix}-h2", f"{prefix}x-h2")]
    for path in segments:
        open(path, "w").close()
    try:
        deadline = time.time() + 20
        while not again.pids(f"{prefix}-h2") and time.time() < deadline:
            time.sleep(0.1)
        left = again.pids(f"{prefix}-h2")
        assert left, "the process never appeared on the host"
        again.up()   # the rerun, with another number of hosts
        assert sleeper.wait(timeout=20) != 0
        assert not [p for p in left if os.path.exists(f"/proc/{p}")], left
        mine = sorted(ns for ns in cluster._namespaces() if ns.startswith(prefix + "-"))
        assert mine == sorted(again.hosts + [again.switch]), mine
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        again.down()
    assert not [ns for ns in cluster._namespaces() if ns.startswith(prefix + "-")]
    assert not [n for n in os.listdir("/etc/netns") if n.startswith(prefix + "-")]
    assert not os.path.exists(again._state_file) and not os.path.exists(again._lock_path)
    assert root_links() == links   # nothing was ever added to the machine's own network
    assert set(bed.hosts) | {bed.switch} <= set(cluster._namespaces())
    assert [os.path.exists(path) for path in segments] == [False, True], segments
    os.unlink(segments[1])


def test_a_prefix_in_use_is_not_torn_down_by_another_process(bed):
    """Another process's up() or down() of the module's prefix waits, then refuses naming this
    process, and leaves the hosts as they were."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import cluster\n"
            f"c = cluster.Cluster(hosts=1, prefix={PREFIX!r}, net={NET})\n"
            "for act in (c.up, c.down):\n"
            "    try:\n        act(wait=1)\n        print('RESULT done')\n"
            "    except cluster.ClusterUnavailable as e:\n        print('RESULT', e)\n")
    before = {h: bed.address(h) for h in bed.hosts}
    rc, output, _, timed_out = run_bounded([sys.executable, "-c", code], 60, dict(os.environ))
    lines = [line for line in output.splitlines() if line.startswith("RESULT")]
    assert rc == 0 and not timed_out and len(lines) == 2, output
    assert all(f"in use by process {os.getpid()}" in line for line in lines), lines
    assert set(bed.hosts) | {bed.switch} <= set(cluster._namespaces())
    r = subprocess.run(["ip", "-n", bed.hosts[1], "-o", "addr", "show", "dev", "eth0"], stdout=subprocess.PIPE,
                       text=True)
    assert before[bed.hosts[1]] + "/24" in r.stdout, r.stdout


REFUSAL = """
import json, sys
sys.path.insert(0, {tests!r})
import cluster
reason = cluster.unavailable_reason()
try:
    cluster.Cluster(prefix="{prefix}", net={net}).up()
    raised = None
except cluster.ClusterUnavailable as e:
    raised = str(e)
print("RESULT " + json.dumps([reason, raised]))
"""


@pytest.mark.parametrize("how,wrapper,env,words", [
    ("not root", ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], {}, "need root"),
    ("no CAP_SYS_ADMIN", ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"], {}, "CAP_SYS_ADMIN"),
    ("no ip on PATH", [], {"PATH": "/nonexistent"}, "need ip"),
])
def test_refuses_clearly(bed, how, wrapper, env, words):
    """Where pretend hosts cannot be made, unavailable_reason() says why and up() raises that text
    (and creates nothing)."""
    if wrapper and shutil.which(wrapper[0]) is None:
        pytest.skip(f"{wrapper[0]} (util-linux) is not installed")
    # An unprivileged user may not be able to read the checkout (a clone in a private folder): the
    # check runs a copy of tests/cluster.py from a folder everyone can read.
    copy = tempfile.mkdtemp(prefix="tfmpi_refusal_")
    os.chmod(copy, 0o755)
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster.py"), copy)
    os.chmod(os.path.join(copy, "cluster.py"), 0o644)
    code = REFUSAL.format(tests=copy, prefix=PREFIX + "r", net=NET + 2)
    rc, output, _, timed_out = run_bounded([*wrapper, sys.executable, "-c", code], 60, {**os.environ, **env},
                                           cwd=copy)
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and not timed_out and len(lines) == 1, output
    reason, raised = json.loads(lines[0][len("RESULT "):])
    assert reason and words in reason and raised == reason, (how, reason, raised)
    assert not [ns for ns in cluster._namespaces() if ns.startswith(PREFIX + "r-")]
