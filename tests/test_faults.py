"""A rank lost in the middle of model.fit at np=3 (tests/workers/fault_worker.py):
SIGKILL, an uncaught exception, sys.exit(1). Every process of the job must
have exited within 30 s of the fault, the launch must end non-zero, and the
output must name rank 1. The three launches run at the same time (each one is
mostly TensorFlow's start-up)."""
import os
import re
import sys
import tempfile
import threading
import time

import pytest

from mpi_harness import WORKERS, launch_env, mpirun_command, run_bounded

FAULTS = ["kill", "raise", "exit"]
LIMIT_S = 30
_runs = {}


def _launch(fault):
    out = tempfile.mkdtemp(prefix=f"tfmpi_fault_{fault}_")
    cmd = mpirun_command(3, [sys.executable, os.path.join(WORKERS, "fault_worker.py"), fault])
    rc, output, elapsed, timed_out = run_bounded(cmd, 240, launch_env({"TF_MPI_TEST_OUT": out}))
    _runs[fault] = {"rc": rc, "output": output, "elapsed": elapsed, "timed_out": timed_out, "ended": time.time(),
                    "out": out}


@pytest.fixture(scope="module")
def runs():
    threads = [threading.Thread(target=_launch, args=(f,)) for f in FAULTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _runs


def alive(pid):
    """Whether `pid` still runs (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


WHO = {"kill": r"process rank 1 with PID \d+ on node \S+ exited on\s+signal 9",
       "raise": r"MPI_ABORT was invoked on rank 1 in communicator",
       # rank 1 exits normally (code 1): its engine tells the others, which fail and abort
       "exit": r"rank 1 called shutdown\(\)"}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_lost_rank_ends_the_whole_job_promptly(runs, fault):
    run = runs[fault]
    describe = f"rc={run['rc']} elapsed={run['elapsed']:.1f}s\n{run['output'][-5000:]}"
    assert not run["timed_out"], describe
    fault_file = os.path.join(run["out"], "fault")
    assert os.path.exists(fault_file), "rank 1 never reached the fault\n" + describe
    with open(fault_file) as f:
        after = run["ended"] - float(f.read())
    print(f"{fault}: job ended {after:.1f} s after the fault, rc={run['rc']}")
    assert run["rc"] != 0, describe
    assert after < LIMIT_S, f"{after:.1f} s after the fault\n" + describe
    pids = [int(open(os.path.join(run["out"], f"pid.{r}")).read()) for r in range(3)]
    assert not [p for p in pids if alive(p)], f"processes left: {[p for p in pids if alive(p)]}\n" + describe
    assert re.search(WHO[fault], run["output"]), describe
    assert "fit returned" not in run["output"], describe
