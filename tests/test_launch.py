"""``python -m tf_mpi.run``: its argument syntax, single-host jobs kept off the network, and
multi-host jobs on the pretend hosts of tests/cluster.py talking at the speed of their link.

The launches run tests/workers/launch_worker.py (mpi4py and tf_mpi's engine, no TensorFlow),
through the installed ``tf_mpi.run`` as a user would start them.
"""
import json
import os
import sys
import time

import pytest

from cluster import Cluster, unavailable_reason
from mpi_harness import _launcher, launch_env, run_bounded

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "launch_worker.py")
RUN = [sys.executable, "-m", "tf_mpi.run"]


def reports(output):
    """Rank -> the JSON of its ``LAUNCH {...}`` line."""
    lines = [json.loads(line[len("LAUNCH "):]) for line in output.splitlines() if line.startswith("LAUNCH ")]
    return {r["rank"]: r for r in lines}


# -- argument syntax (no launch) ---------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["-np", "2", "python", "x.py"], (2, [], ["python", "x.py"])),
    (["-n", "3", "python", "x.py", "-np", "9"], (3, [], ["python", "x.py", "-np", "9"])),
    (["-np", "4", "--host", "a:2,b:2", "--mca", "btl", "tcp,self", "--map-by", "node", "--oversubscribe",
      "-x", "TF_MPI_HIERARCHICAL", "python", "t.py"],
     (4, ["--host", "a:2,b:2", "--mca", "btl", "tcp,self", "--map-by", "node", "--oversubscribe",
          "-x", "TF_MPI_HIERARCHICAL"], ["python", "t.py"])),
    (["--hostfile", "hf", "-np", "8", "--bind-to=core", "--some-flag", "--", "prog", "--x"],
     (8, ["--hostfile", "hf", "--bind-to=core", "--some-flag"], ["prog", "--x"])),
])
def test_split_args(argv, expected):
    assert _launcher.split_args(argv) == expected


def test_split_args_refuses_a_missing_count_or_program():
    for argv in (["python", "x.py"], ["-np", "2"], ["-np", "2", "--mca", "btl"]):
        with pytest.raises(ValueError):
            _launcher.split_args(argv)


def test_which_jobs_are_single_host(tmp_path):
    single = _launcher.is_single_host
    assert single([], env={})
    assert single(["--host", "localhost:2"], env={})
    assert not single(["--host", "h1:2,h2:2"], env={})
    assert not single([], env={"SLURM_JOB_NUM_NODES": "2"})
    assert single([], env={"SLURM_JOB_NUM_NODES": "1"})
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnodeA slots=2\n\nnodeB slots=2\n")
    assert _launcher.named_hosts(["--hostfile", str(hostfile)]) == ["nodeA", "nodeB"]
    assert not single(["--hostfile", str(hostfile)], env={})


def test_launch_settings_per_kind_of_job():
    argv, env = _launcher.launch(2, [], ["python", "x.py"], env={})
    assert argv[1:] == ["-np", "2", sys.executable, "x.py"]          # -np 2 python x.py: as before
    assert env["OMPI_MCA_btl"] == "self,sm"
    _, env = _launcher.launch(2, ["--mca", "btl", "tcp,self"], ["x"], env={})
    assert "OMPI_MCA_btl" not in env                                  # the user's choice wins
    argv, env = _launcher.launch(4, ["--host", "h1:2,h2:2"], ["x"], env={"TF_MPI_HIERARCHICAL": "1"})
    assert "OMPI_MCA_btl" not in env and "--oversubscribe" not in argv
    assert argv[argv.index("-x") + 1] == "TF_MPI_HIERARCHICAL"
    assert argv[argv.index("btl_tcp_links") - 1:argv.index("btl_tcp_links") + 2] == ["--mca", "btl_tcp_links", "2"]
    argv, _ = _launcher.launch(4, ["--host", "h1:2,h2:2", "--mca", "btl_tcp_links", "4"], ["x"], env={})
    assert argv.count("btl_tcp_links") == 1 and argv[argv.index("btl_tcp_links") + 1] == "4"   # the user's wins
    argv, _ = _launcher.launch(4, ["--host", "h1:2,h2:2"], ["x"], env={"OMPI_MCA_btl_tcp_links": "1"})
    assert "btl_tcp_links" not in argv


# -- single host: off the network ----------------------------------------------
def _listeners(extra_env):
    rc, output, elapsed, timed_out = run_bounded(RUN + ["-np", "2", "python", WORKER, "listeners"], 120,
                                                 launch_env(extra_env))
    assert rc == 0 and not timed_out, output[-4000:]
    got = reports(output)
    assert sorted(got) == [0, 1], output[-4000:]
    assert all(r["engine_sum_ok"] for r in got.values()), got
    return got


def test_a_launcher_that_waits_after_reporting_a_failure_is_ended(capfd):
    # A stand-in for Open MPI's launcher after a rank aborted: it reports the failure, then waits
    # (for a host it cannot reach). tf_mpi.run ends it after the grace and exits 1, saying why.
    stand_in = [sys.executable, "-c", "import sys, time; sys.stderr.write('MPI_ABORT was invoked on rank 1\\n'); "
                                      "sys.stderr.flush(); time.sleep(120)"]
    start = time.time()
    rc = _launcher.run_reporting_lost_hosts(stand_in, dict(os.environ), grace_s=0.5)
    took = time.time() - start
    err = capfd.readouterr().err
    assert rc == 1 and took < 10, (rc, took, err)
    assert "mpirun was still waiting" in err, err
    # One that ends by itself after the report keeps its own status, and no note is added.
    quick = [sys.executable, "-c", "import sys; sys.stderr.write('MPI_ABORT was invoked on rank 1\\n'); sys.exit(3)"]
    assert _launcher.run_reporting_lost_hosts(quick, dict(os.environ), grace_s=0.5) == 3
    assert "still waiting" not in capfd.readouterr().err


def test_single_host_job_listens_on_loopback_only():
    got = _listeners({})
    assert [r["non_loopback"] for r in got.values()] == [[], []], got


def test_listener_check_sees_a_tcp_transport():
    # The same job with Open MPI's TCP transport allowed back: each rank's listener on the
    # wildcard address must show up, or the check above proves nothing.
    got = _listeners({"OMPI_MCA_btl": "self,sm,tcp"})
    assert all(r["non_loopback"] for r in got.values()), got


# -- several hosts: as fast as the link ----------------------------------------
@pytest.mark.hosts
@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_cross_host_pingpong_two_ranks_per_host_near_tcp():
    with Cluster(hosts=2, slots=2, prefix="lan", net=3) as c:
        cmd = c.command(RUN + ["-np", "4", "--host", c.host_list(), "--map-by", "node",
                               "python", WORKER, "pingpong"])
        rc, output, elapsed, timed_out = run_bounded(cmd, 180, c.env(launch_env()))
    assert rc == 0 and not timed_out, output[-4000:]
    got = reports(output)
    assert sorted(got) == [0, 1, 2, 3], output[-4000:]
    r0 = got[0]
    assert r0["hosts"] == [c.hosts[0], c.hosts[1]] * 2 and r0["peer"] == 1, r0
    ratio = r0["mpi_us"] / r0["tcp_us"]
    print(f"4 KiB round trip, 2 ranks per host: MPI {r0['mpi_us']:.1f} us, TCP {r0['tcp_us']:.1f} us, "
          f"ratio {ratio:.2f}")
    assert ratio < 10, r0
