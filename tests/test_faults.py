"""A rank lost in the middle of model.fit at np=3 (tests/workers/fault_worker.py):
SIGKILL, an uncaught exception, sys.exit(1), sys.exit(0). The launch must end
non-zero, the output must name rank 1, and every process of the job (the three
ranks and mpirun) must have exited within LIMIT_S of the fault: measured from
the time rank 1 writes just before the fault to the moment a watcher polling
/proc (every 10 ms) sees the last of them gone. On an idle 2-core machine that
is 0.1-1 s (docs/reliability.md); LIMIT_S leaves room for a loaded CI machine.
The four launches run at the same time (each one is mostly TensorFlow's
start-up).

Beside them, the MPI watchdog on one host (np=2, numpy only,
tests/workers/cluster_fault_worker.py): 64 MiB allreduces against a limit of
1 ms must end the job with the watchdog's error, and an unreadable
TF_MPI_MPI_TIMEOUT_MB_PER_S must fail init() on every rank."""
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from mpi_harness import (LISTENER_RETRY_SLEEP_S, WORKERS, launch_env, listener_failed, mpirun_command,
                         process_alive, run_bounded)

FAULTS = ["kill", "raise", "exit", "exit0"]
LIMIT_S = 5
LAUNCH_TIMEOUT_S = 240
_runs = {}


def _launch(fault):
    _launch_once(fault)
    run = _runs[fault]
    if listener_failed(run["rc"], run["output"], run["timed_out"]):   # Open MPI's launcher did not start
        time.sleep(LISTENER_RETRY_SLEEP_S)
        _launch_once(fault)


def _launch_once(fault):
    out = tempfile.mkdtemp(prefix=f"tfmpi_fault_{fault}_")
    cmd = mpirun_command(3, [sys.executable, os.path.join(WORKERS, "fault_worker.py"), fault])
    run = _runs[fault] = {"out": out, "timed_out": False, "last_exit": None}
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=launch_env({"TF_MPI_TEST_OUT": out}), start_new_session=True)
    watcher = threading.Thread(target=_watch, args=(run, proc, start))
    watcher.start()
    try:
        run["output"], _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        run["timed_out"] = True
        os.killpg(proc.pid, 9)
        run["output"], _ = proc.communicate()
    run["rc"], run["elapsed"] = proc.returncode, time.time() - start
    watcher.join()


def _watch(run, proc, start):
    """Records when the last process of the job (ranks and mpirun) exited after the fault."""
    fault_file = os.path.join(run["out"], "fault")
    while not os.path.exists(fault_file) and proc.poll() is None and time.time() - start < LAUNCH_TIMEOUT_S:
        time.sleep(0.01)
    pids = [int(open(p).read()) for p in (os.path.join(run["out"], f"pid.{r}") for r in range(3))
            if os.path.exists(p)]
    while time.time() - start < LAUNCH_TIMEOUT_S + 5:
        if proc.poll() is not None and not any(process_alive(p) for p in pids):
            run["last_exit"] = time.time()
            return
        time.sleep(0.01)


WATCHDOG_CASES = {
    # 1 ms + 64 MiB at 10^9 MB/s: every batch is over the limit once the check (every 50 ms) sees it
    "fires": {"TF_MPI_MPI_TIMEOUT_SECONDS": "0.001", "TF_MPI_MPI_TIMEOUT_MB_PER_S": "1e9",
              "TF_MPI_TEST_ELEMENTS": str(16 << 20)},
    "bad_rate": {"TF_MPI_MPI_TIMEOUT_MB_PER_S": "0"},
}
_watchdog_runs = {}


def _launch_watchdog(case):
    out = tempfile.mkdtemp(prefix=f"tfmpi_watchdog_{case}_")
    cmd = mpirun_command(2, [sys.executable, os.path.join(WORKERS, "cluster_fault_worker.py")])
    rc, output, elapsed, timed_out = run_bounded(cmd, 120, launch_env({"TF_MPI_TEST_OUT": out,
                                                                      **WATCHDOG_CASES[case]}))
    _watchdog_runs[case] = {"rc": rc, "output": output, "elapsed": elapsed, "timed_out": timed_out}


@pytest.fixture(scope="module")
def runs():
    threads = [threading.Thread(target=_launch, args=(f,)) for f in FAULTS]
    threads += [threading.Thread(target=_launch_watchdog, args=(c,)) for c in WATCHDOG_CASES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _runs


WHO = {"kill": r"process rank 1 with PID \d+ on node \S+ exited on\s+signal 9",
       "raise": r"\[tf_mpi rank 1\] uncaught exception:(.|\n)*RuntimeError: injected failure on rank 1",
       # rank 1 exits normally: its engine tells the others, which fail and abort
       "exit": r"rank 1 called shutdown\(\)",
       "exit0": r"rank 1 called shutdown\(\)"}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_lost_rank_ends_the_whole_job_promptly(runs, fault):
    run = runs[fault]
    describe = f"rc={run['rc']} elapsed={run['elapsed']:.1f}s\n{run['output'][-5000:]}"
    assert not run["timed_out"], describe
    fault_file = os.path.join(run["out"], "fault")
    assert os.path.exists(fault_file), "rank 1 never reached the fault\n" + describe
    with open(fault_file) as f:
        fault_time = float(f.read())
    assert run["last_exit"] is not None, "the watcher never saw every process gone\n" + describe
    after = run["last_exit"] - fault_time
    print(f"{fault}: last process exited {after:.2f} s after the fault, rc={run['rc']}")
    assert run["rc"] != 0, describe
    assert after < LIMIT_S, f"{after:.1f} s after the fault\n" + describe
    pids = [int(open(os.path.join(run["out"], f"pid.{r}")).read()) for r in range(3)]
    assert not [p for p in pids if process_alive(p)], f"processes left: {[p for p in pids if process_alive(p)]}\n" + describe
    assert re.search(WHO[fault], run["output"]), describe
    if fault == "raise":  # tf_mpi's excepthook (TF_MPI_ABORT_ON_EXCEPTION on by default) aborts the job
        assert "[tf_mpi rank 1] aborting the job" in run["output"], describe
        assert "MPI_ABORT was invoked on rank 1" in run["output"], describe
    assert "fit returned" not in run["output"], describe


def test_the_watchdog_ends_a_job_whose_collective_stays_in_mpi_too_long(runs):
    run = _watchdog_runs["fires"]
    describe = f"rc={run['rc']} elapsed={run['elapsed']:.1f}s\n{run['output'][-5000:]}"
    assert not run["timed_out"] and run["rc"] != 0, describe
    # Normally the 64 MiB 'loop' allreduce; on a loaded machine a collective of init (a few bytes,
    # while a peer still starts) may stay in MPI past the 1 ms limit first: the watchdog ends the job
    # all the same.
    m = re.search(r"\[tf_mpi rank \d\] ERROR: collective '[^']+' \(\d+ bytes\) has been inside MPI for "
                  r"([\d.]+) s without completing \(limit ([\d.]+) s", run["output"])
    assert m, describe
    # 1 ms + at most 64 MiB at 10^9 MB/s, printed with 3 significant digits
    assert float(m.group(1)) > float(m.group(2)) == 0.001, describe
    assert "MPI_ABORT was invoked" in run["output"], describe


def test_an_unreadable_watchdog_setting_fails_init_on_every_rank(runs):
    run = _watchdog_runs["bad_rate"]
    describe = f"rc={run['rc']} elapsed={run['elapsed']:.1f}s\n{run['output'][-5000:]}"
    assert not run["timed_out"] and run["rc"] != 0, describe
    assert run["output"].count("TF_MPI_MPI_TIMEOUT_MB_PER_S must be positive") == 2, describe
