"""Runs a worker script under mpirun with a hard time limit and collects each
rank's check results.

A worker (tests/workers/*.py) defines functions named ``check_*``; the worker
harness (tests/workers/_checks.py) runs them all on every rank and writes
``rank<N>.json``. Each pytest test then asserts one check on every rank, so a
single mpirun launch (one TensorFlow import per rank) serves many tests.
"""
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))

def _load_launcher():
    # tf_mpi/run.py is plain Python; load it by path so the pytest process
    # neither imports TensorFlow nor needs the compiled engine.
    import importlib.util
    path = os.path.join(os.path.dirname(HERE), "tf_mpi", "run.py")
    spec = importlib.util.spec_from_file_location("tf_mpi_launcher", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_launcher = _load_launcher()
mpirun_command, mpirun_env = _launcher.mpirun_command, _launcher.mpirun_env

WORKERS = os.path.join(HERE, "workers")


class MpiRun:
    def __init__(self, returncode, output, results, elapsed, timed_out, out_dir=None):
        self.returncode, self.output, self.results = returncode, output, results
        self.elapsed, self.timed_out, self.out_dir = elapsed, timed_out, out_dir
        self.launch = self  # the whole launch (a section's run: the launch it is part of)

    def section(self, name):
        """The part of a sections launch (sections_launch) that ran section `name`: that section's
        check results, and the output from rank 0's marker for it to the next marker (rank 0's own
        lines in order; the other ranks' lines of a section are out before the next marker, the
        ranks meet in between). Exit code, time-out and elapsed time are the whole launch's."""
        results = read_results(os.path.join(self.out_dir, name)) if os.path.isdir(os.path.join(self.out_dir, name)) \
            else {}
        lines, inside = [], False
        for line in self.output.splitlines(keepends=True):
            if line.startswith(SECTION_MARKER):
                inside = line[len(SECTION_MARKER):].strip() == name
            elif inside:
                lines.append(line)
        run = MpiRun(self.returncode, "".join(lines), results, self.elapsed, self.timed_out)
        run.section_name, run.launch = name, self
        return run

    def assert_clean_exit(self):
        """The launch ended on its own (no time-out) with exit code 0 on every rank (a section of a
        sections launch: the launch did, and this section neither raised nor exited non-zero)."""
        assert not self.timed_out and self.returncode == 0, self.describe()
        name = getattr(self, "section_name", None)
        if name is not None:
            assert not re.search(rf"section {re.escape(name)} (raised|exited with)", self.output), self.describe()

    def describe(self):
        tail = self.output[-6000:]
        return f"rc={self.returncode} timed_out={self.timed_out} elapsed={self.elapsed:.1f}s\n--- output tail ---\n{tail}"


# Open MPI's launcher now and then fails to start at all (seen in CI: exit status 213 after 0.1 s,
# nothing launched); run_bounded then starts the same command again, once.
LISTENER_START_FAILURE = "The PMIx server's listener thread failed to start"
LISTENER_RETRY_SLEEP_S = 1.0


def listener_failed(rc, output, timed_out=False):
    """Whether mpirun failed to start with Open MPI's launcher start failure (LISTENER_START_FAILURE:
    it exited non-zero on its own, within a fraction of a second, before any rank ran; `rc` None:
    still running): then a launch may be run again, once."""
    return rc not in (0, None) and not timed_out and LISTENER_START_FAILURE in output


def run_bounded(cmd, timeout, env, cwd=None):
    """Runs cmd (e.g. an mpirun command) in its own process group; kills the
    whole group after `timeout` s. Returns (returncode, output, elapsed, timed_out).

    Where mpirun failed to start (its output says LISTENER_START_FAILURE and it exited non-zero
    on its own), the command runs once more after a short sleep, and that run is returned."""
    rc, output, elapsed, timed_out = _run_bounded_once(cmd, timeout, env, cwd)
    if listener_failed(rc, output, timed_out):
        print(f"mpirun failed to start (rc={rc}: {LISTENER_START_FAILURE}); starting it again, once")
        time.sleep(LISTENER_RETRY_SLEEP_S)
        rc, output, elapsed, timed_out = _run_bounded_once(cmd, timeout, env, cwd)
    return rc, output, elapsed, timed_out


# Open MPI 5.0.11 with ULFM's heartbeat thread now and then crashes a rank inside MPI_Init on a
# loaded machine (docs/elastic.md, "Limits"). Its signal handler then prints a report, each line
# prefixed "[host:pid] ": "Signal: Segmentation fault (11)", a "Signal code" of a real memory fault
# ("Address not mapped (1)"), then a backtrace whose frames run through MPI_Init, or which stops
# at libc's signal frame (seen in CI: "[ 0] .../libc.so.6(+0x3c050)" alone). A crash a test causes
# on purpose differs: a rank that sends itself SIGSEGV once MPI runs gets a report with "Signal
# code:  (0)" (sent by kill) and Python's frames; one killed before MPI starts, or by SIGKILL, gets
# none. A segfault inside tf_mpi or Python names their libraries in its frames.
_MPI_INIT_FRAME = re.compile(r"\b(ompi_mpi_init|ompi_mpi_instance_init|PMPI_Init|PMPI_Init_thread|MPI_Init_thread)\b")
_PROGRAM_FRAME = re.compile(r"libpython|/python3|tfmpi|tf_mpi|_core\.|tensorflow|mpi4py")
_OPEN_MPI_REPORT_LINE = re.compile(r"^\[([^\]\s]+:\d+)\] (.*)$", re.M)


def open_mpi_start_up_crash(output):
    """Where a launch's output shows Open MPI's start-up crash (above), the process that crashed
    ("host:pid", true); None otherwise. The crash: some process's signal report says "Signal:
    Segmentation fault" from a real memory fault (not a signal sent by kill), and its backtrace has
    a frame inside MPI_Init, or no frame beyond the C library."""
    reports = {}
    for who, text in _OPEN_MPI_REPORT_LINE.findall(output):
        reports.setdefault(who, []).append(text)
    for who, lines in reports.items():
        if not any(t.startswith("Signal: Segmentation fault") for t in lines):
            continue
        codes = [t for t in lines if t.startswith("Signal code:")]
        if not codes or any(re.match(r"Signal code:\s*\(0\)", t) for t in codes):
            continue   # sent by kill(): a test's own fault
        frames = [t for t in lines if re.match(r"\[\s*\d+\]", t)]
        if any(_MPI_INIT_FRAME.search(t) for t in frames):
            return who
        if frames and not any(_PROGRAM_FRAME.search(t) or _MPI_INIT_FRAME.search(t) for t in frames) and \
                all("libc.so" in t for t in frames):
            return who
    return None


RETRIED_NOTE = "[tests/mpi_harness] second launch:"


def retry_on_start_up_crash(launch_once, what):
    """Runs ``launch_once()``, which returns an object with ``output`` and ``timed_out`` (and
    ``timeout``, its limit); where that output shows Open MPI's start-up crash
    (open_mpi_start_up_crash), whether or not the launch also timed out, runs it once more. Fails
    when the launch kept (the second one, if any) timed out; returns it otherwise.

    The launch kept after a retry ends its output with one line (RETRIED_NOTE) naming the first
    launch's crash, so that the tail a failing test prints says that this was the second launch
    (a message printed from the launch's background thread would reach no test's report); the
    first launch's output is its ``first_output``."""
    run = launch_once()
    crashed = open_mpi_start_up_crash(run.output)
    if crashed:
        first = run
        _log_event({"retried": what, "time": round(time.time(), 2), "first_timed_out": first.timed_out})
        run = launch_once()
        run.output += (f"\n{RETRIED_NOTE} Open MPI crashed a rank inside MPI_Init in the first one "
                       f"(process {crashed}, timed_out={first.timed_out})\n")
        run.first_output = first.output
    assert not run.timed_out, f"{what}: the launch did not end within {run.timeout} s:\n{run.output[-6000:]}"
    return run


class BoundedRun:
    """One run_bounded launch: returncode, output, elapsed, timed_out, and its time limit."""

    def __init__(self, returncode, output, elapsed, timed_out, timeout):
        self.returncode, self.output, self.elapsed, self.timed_out = returncode, output, elapsed, timed_out
        self.timeout = timeout


def run_bounded_retrying(cmd, timeout, env, what, cwd=None):
    """run_bounded(cmd, timeout, env, cwd), once more where Open MPI crashed a rank inside MPI_Init
    (retry_on_start_up_crash: fails on a time-out otherwise). Returns (returncode, output, elapsed)."""
    run = retry_on_start_up_crash(lambda: BoundedRun(*run_bounded(cmd, timeout, env, cwd), timeout), what)
    return run.returncode, run.output, run.elapsed


def _run_bounded_once(cmd, timeout, env, cwd=None):
    start = time.time()
    cpu_file = None
    if os.environ.get("TF_MPI_TEST_LAUNCH_LOG"):
        cpu_file = tempfile.mktemp(prefix="tfmpi-cpu-")
        cmd = [sys.executable, "-c", _CPU_WRAPPER, cpu_file, *map(str, cmd)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True, text=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    elapsed = time.time() - start
    _log_launch(cmd, start, elapsed, timed_out, cpu_file)
    return proc.returncode, output, elapsed, timed_out


# Measuring the suite: the CPU seconds of a launch and all the processes it waited for.
_CPU_WRAPPER = """import os, resource, signal, subprocess, sys
rc = subprocess.call(sys.argv[2:])
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write(f"{ru.ru_utime + ru.ru_stime:.2f}")
if rc < 0:
    signal.signal(-rc, signal.SIG_DFL); os.kill(os.getpid(), -rc)
sys.exit(rc)
"""


def _log_event(record):
    # Measuring the suite: with TF_MPI_TEST_LAUNCH_LOG set, one JSON line per event (a bounded
    # launch, a start-up crash retried) and the test running when it happened.
    path = os.environ.get("TF_MPI_TEST_LAUNCH_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), **record}) + "\n")


def _log_launch(cmd, start, elapsed, timed_out, cpu_file=None):
    # One line per bounded launch (what ran, when, how long, CPU seconds), to count launches per
    # module and see which ones overlap.
    if os.environ.get("TF_MPI_TEST_LAUNCH_LOG"):
        cpu = None
        if cpu_file:
            try:
                with open(cpu_file) as f:
                    cpu = float(f.read())
                os.remove(cpu_file)
            except (OSError, ValueError):
                pass
        _log_event({"start": round(start, 2), "elapsed": round(elapsed, 2), "cpu": cpu, "timed_out": timed_out,
                    "cmd": " ".join(map(str, cmd))[-300:]})


def process_alive(pid):
    """Whether process `pid` still runs (a zombie has exited: it only waits for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


RANK_SITE = os.path.join(HERE, "rank_site")  # its sitecustomize makes TensorFlow's import and the exit cheaper


def with_rank_site(env):
    """`env` (a dict, changed and returned) with tests/rank_site first on PYTHONPATH: every Python
    process started with it, ranks and launchers alike, imports TensorFlow at the cost the suite is
    sized for. Launches across pretend hosts also forward PYTHONPATH (``-x PYTHONPATH``): the other
    hosts' ranks start from a login's environment."""
    if RANK_SITE not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (RANK_SITE, env.get("PYTHONPATH")) if p)
    return env


def start_up_as_the_ranks_do():
    """Runs tests/rank_site's sitecustomize in this process (loaded by path, once it has started),
    so that its later TensorFlow import costs what a launched rank's does."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("tf_mpi_tests_rank_site", os.path.join(RANK_SITE, "sitecustomize.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def launch_env(extra=None):
    """Environment for launched ranks: Open MPI as root allowed, quiet TensorFlow, unbuffered output,
    tests/rank_site first on PYTHONPATH."""
    env = with_rank_site(mpirun_env())
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def read_results(out_dir):
    """{rank: that rank's check results} from the rank<N>.json files workers write to out_dir."""
    results = {}
    for name in os.listdir(out_dir):
        m = re.match(r"rank(\d+)\.json$", name)
        if m:
            with open(os.path.join(out_dir, name)) as f:
                results[int(m.group(1))] = json.load(f)
    return results


def run_mpi(np, worker, timeout, env=None, args=()):
    """Runs tests/workers/<worker> on np ranks; never waits longer than timeout seconds."""
    out_dir = tempfile.mkdtemp(prefix="tfmpi_test_")
    cmd = mpirun_command(np, [sys.executable, os.path.join(WORKERS, worker), *args])
    rc, output, elapsed, timed_out = run_bounded(cmd, timeout, launch_env({"TF_MPI_TEST_OUT": out_dir, **(env or {})}))
    results = read_results(out_dir)
    if os.environ.get("TF_MPI_TEST_LAUNCH_LOG"):
        checks = dict(results.get(0, {}))
        for name in sorted(os.listdir(out_dir)):  # a sections launch: each section's checks as section/check
            if os.path.isdir(os.path.join(out_dir, name)):
                checks.update({f"{name}/{k}": v for k, v in read_results(os.path.join(out_dir, name)).get(0, {}).items()})
        spent = None  # a sections launch: rank 0's [seconds, CPU seconds] per section, from the end of the one before
        if os.path.exists(os.path.join(out_dir, "sections.rank0.json")):
            with open(os.path.join(out_dir, "sections.rank0.json")) as f:
                spent = json.load(f)
        _log_event({"worker": worker, "np": np, "args": [str(a)[:200] for a in args], "elapsed": round(elapsed, 2),
                    "checks": {k: v.get("seconds") for k, v in checks.items()},   # where a launch's time went
                    "cpu": {k: v.get("cpu_seconds") for k, v in checks.items()}, "sections": spent})
    return MpiRun(rc, output, results, elapsed, timed_out, out_dir)


# ----------------------------------------------------------------------------- several workers in one launch
#
# Each launch pays TensorFlow's import on every rank (~2 s of CPU per rank with tests/rank_site) and mpirun's start
# and exit; workers that need the same world size and settings can share one launch instead:
# tests/workers/_sections.py runs them one after the other, each as if launched alone (its own
# environment, argv and results folder), with the engine shut down and every rank met in between.

SECTIONS_WORKER = "_sections.py"
SECTION_MARKER = "TF_MPI_TEST_SECTION "


def section(name, worker, args=(), env=None):
    """One section of a sections launch: `worker` run with `args` and `env` (None unsets a
    variable) on top of the launch's environment; its results are run.section(name)."""
    return {"name": name, "worker": worker, "args": list(args), "env": dict(env or {})}


def sections_launch(np, sections, timeout=300, env=None, heavy=False, alone=False, start=False, long=True):
    """shared_launch of tests/workers/_sections.py running `sections` (a list of section(...)) on np
    ranks; the whole launch, whose run.section(name) is each section's run. Long by default (long: True
    or the seconds it is expected to take, see release_starts)."""
    return shared_launch(np, SECTIONS_WORKER, timeout=timeout, env=env, args=[json.dumps(sections)], heavy=heavy,
                         alone=alone, start=start, long=long)


# Test modules share such a launch: each module joins it at import with its own section(s), and
# the launch runs the sections of every module collected in the session (a module run alone runs
# only its own). Its key is its full list of sections, complete once collection has ended.
_joint = {}  # (group, np) -> {section name: (last, section, time limit, heavy, expected seconds)}


def joint_launch(group, np, name, worker, args=(), env=None, timeout=300, last=False, heavy=False, expected_s=5):
    """Joins section `name` (section(name, worker, args, env)) to the launch `group` on np ranks;
    returns launch(start=False): that section's run of the launch (start=True: starts the launch).
    Sections run in the order their modules were collected, those with last=True at the end (e.g. a
    check of what happens at process exit); the launch's time limit is its sections' sum (<= 900 s).
    heavy=True (a section that needs several GiB of memory): the launch is heavy (shared_launch).
    expected_s: about how long the section runs on a busy 2-core machine; only the order in which
    the sections launches start depends on it (their sum: the longest first, see release_starts)."""
    entry = _joint.setdefault((group, np), {})
    entry[name] = (last, section(name, worker, args, env), timeout, heavy, expected_s)

    def launch(start=False):
        parts = sorted(entry.values(), key=lambda part: part[0])  # stable: collection order, last ones last
        run = sections_launch(np, [part[1] for part in parts], timeout=min(900, sum(part[2] for part in parts)),
                              heavy=any(part[3] for part in parts), start=start,
                              long=sum(part[4] for part in parts))
        return run if start else run.section(name)
    return launch


class ExampleRun:
    """An example program's run: its output and the JSON of its one `RESULT {...}` line (rank 0)."""

    def __init__(self, returncode, output, elapsed, timed_out):
        self.returncode, self.output, self.elapsed, self.timed_out = returncode, output, elapsed, timed_out
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        self.results = [json.loads(line[len("RESULT "):]) for line in lines]
        self.result = self.results[0] if len(self.results) == 1 else None

    def describe(self):
        return (f"rc={self.returncode} timed_out={self.timed_out} elapsed={self.elapsed:.1f}s\n"
                f"--- output tail ---\n{self.output[-6000:]}")

    def assert_ok(self):
        assert not self.timed_out and self.returncode == 0, self.describe()
        assert self.result is not None, "expected exactly one RESULT line (rank 0 only)\n" + self.describe()


def run_example(script, args, np=2, timeout=300, cwd=None):
    """Runs examples/<script> on np ranks (np=None: one plain process); never waits past timeout.

    tf_mpi comes from the environment (CI: the installed package); run it
    outside the repository root via `cwd`.
    """
    path = os.path.join(os.path.dirname(HERE), "examples", script)
    program = [sys.executable, path, *args]
    cmd = program if np is None else mpirun_command(np, program)
    run = ExampleRun(*run_bounded(cmd, timeout, launch_env(), cwd=cwd))
    print(f"{script} {' '.join(args)}: {run.elapsed:.1f}s, rc={run.returncode}, result={run.result}")
    return run


def cached_launches(worker, env=None, timeout=300):
    """launch(np): runs `worker` on np ranks once (run_mpi) and hands every later caller the same run,
    so all the tests of a module share one mpirun launch per np."""
    runs = {}

    def launch(np):
        if np not in runs:
            runs[np] = run_mpi(np, worker, timeout=timeout, env=env)
        return runs[np]
    return launch


# ----------------------------------------------------------------------------- launches shared and started early
#
# A launch is mostly TensorFlow's import (one thread per rank) and waits (mpirun's start, stall
# timeouts, exits), so a second launch beside it fills the cores it leaves idle. Tests name their
# launches (shared_launch / shared_run); tests/conftest.py starts every launch the selected tests
# need before the first test runs (PARALLEL at a time, in test order), and each test waits only for
# its own. A launch named twice, in one module or in two, runs once.

PARALLEL = max(1, int(os.environ.get("TF_MPI_TEST_PARALLEL", "2")))  # launches in flight besides the test's own
_pool = None
# Launches that mostly wait (detectors' time-outs, sleeping steps, a rank stopped on purpose) use
# little CPU for many seconds: held in a pool slot, they left the machine idle. They run in a lane
# of their own beside the pool instead, one at a time, in the order they were started (waiting=True;
# start_waiting). Their time limits leave room for a machine busy with the pool's launches.
_lane = None
_futures = {}            # key -> Future of the launch's result
_futures_lock = threading.Lock()
_heavy = threading.Lock()  # launches that need several GiB of memory run one at a time
# Launches that assert on timing between threads run alone (alone=True): they wait for the running
# ones to end, and hold back the ones not yet started (writer preference, so they cannot starve).
_gate = threading.Condition()
_gate_state = {"running": 0, "alone_waiting": 0, "alone_running": False}


def _executor():
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="launch")
    return _pool


def _waiting_lane():
    global _lane
    if _lane is None:
        _lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="waiting-launch")
    return _lane


def _key_of(fn, args, kwargs):
    def frozen(v):
        if isinstance(v, dict):
            return tuple(sorted((k, frozen(x)) for k, x in v.items()))
        if isinstance(v, (list, tuple)):
            return tuple(frozen(x) for x in v)
        return v
    # The module too: two test modules may each have a function of the same name.
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)), frozen(args), frozen(kwargs))


def _enter(alone):
    g = _gate_state
    with _gate:
        if alone:
            g["alone_waiting"] += 1
            _gate.wait_for(lambda: g["running"] == 0 and not g["alone_running"])
            g["alone_waiting"] -= 1
            g["alone_running"] = True
        else:
            _gate.wait_for(lambda: not g["alone_running"] and g["alone_waiting"] == 0)
        g["running"] += 1


def _leave(alone):
    g = _gate_state
    with _gate:
        g["running"] -= 1
        if alone:
            g["alone_running"] = False
        _gate.notify_all()


def _run_guarded(fn, args, kwargs, heavy, alone=False):
    _enter(alone)
    try:
        if heavy:
            with _heavy:
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    finally:
        _leave(alone)


class _Job:
    """A launch started ahead of its tests: run once, by a pool thread or by the first test that
    needs it before a pool thread has taken it (so no test waits on a launch still in the queue)."""

    def __init__(self, fn, args, kwargs, heavy, alone):
        self.fn, self.args, self.kwargs, self.heavy, self.alone = fn, args, kwargs, heavy, alone
        self.future, self.taken = Future(), False

    def run(self):
        with _futures_lock:
            if self.taken:
                return
            self.taken = True
        try:
            self.future.set_result(_run_guarded(self.fn, self.args, self.kwargs, self.heavy, self.alone))
        except BaseException as e:  # every caller of this launch sees the same error
            self.future.set_exception(e)


_jobs = {}           # key -> _Job of a launch started ahead
# A launch given while the prefetches are collected (hold_starts), not queued yet: long (False or its
# expected seconds), whether it is a sections launch, the order it was given in, its _Job, and
# whether it goes to the lane of waiting launches.
_Held = collections.namedtuple("_Held", "long sections order job waiting")
_held = None         # while the prefetches are collected: [_Held]


def hold_starts():
    """From now on start_shared queues nothing; release_starts() queues what it was given, long first."""
    global _held
    _held = []


def release_starts():
    """Queues the launches given since hold_starts(): those marked long first (so that the longest
    do not start last and end the session alone), sections launches first among them, the longest
    of those first (long: their expected seconds), the others in the order they were given; the
    waiting ones in the lane, in the order they were given."""
    global _held
    held, _held = _held or [], None
    for h in held:
        if h.waiting:
            _waiting_lane().submit(h.job.run)
    held = [h for h in held if not h.waiting]
    # Among the long ones the sections (joint) launches come first: they are the longest (the np=2
    # one of the Keras, runtime and shared-memory sections takes ~120 s and, queued behind the
    # others, was the last of them to end, ~100 s after the rest).
    order = sorted(held, key=lambda h: (not h.long, not h.sections, -float(h.long) if h.sections else 0, h.order))
    for h in order:
        _executor().submit(h.job.run)


def start_shared(fn, *args, heavy=False, alone=False, long=False, waiting=False, **kwargs):
    """Starts fn(*args, **kwargs) (a launch) in the background unless the same call was started
    already; returns its Future. heavy=True: never at the same time as another heavy launch;
    alone=True: never at the same time as any other launch of this session; long=True: a launch
    known to take long, queued before the others (see hold_starts); waiting=True: a launch that
    spends most of its time waiting (see _lane), queued in the lane beside the pool."""
    key = _key_of(fn, args, kwargs)
    with _futures_lock:
        if key not in _futures:
            job = _jobs[key] = _Job(fn, args, kwargs, heavy, alone)
            _futures[key] = job.future
            if _held is not None:
                sections = fn is run_mpi and len(args) > 1 and args[1] == SECTIONS_WORKER
                _held.append(_Held(long, sections, len(_held), job, waiting))
            else:
                (_waiting_lane() if waiting else _executor()).submit(job.run)
        return _futures[key]


def start_waiting(fn, *args, **kwargs):
    """start_shared(fn, *args, waiting=True, **kwargs): for a launch that spends most of its time
    waiting (steps that sleep, detectors' time-outs, relaunches), so that it holds none of the
    pool's PARALLEL slots for that time (shared_run of the same call takes the result)."""
    return start_shared(fn, *args, waiting=True, **kwargs)


def shared_run(fn, *args, heavy=False, alone=False, long=False, **kwargs):
    """fn(*args, **kwargs) once per session: the result of the call started earlier with the same
    arguments (run now in the caller's thread if no pool thread has taken it yet, else waited for),
    or of this call, run now in the caller's thread and kept."""
    key = _key_of(fn, args, kwargs)
    with _futures_lock:
        job = _jobs.get(key)
        if job is None and key not in _futures:
            job = _jobs[key] = _Job(fn, args, kwargs, heavy, alone)
            _futures[key] = job.future
    if job is not None:
        job.run()  # nothing if it is running or done already
    return _futures[key].result()


def shared_launch(np, worker, timeout=300, env=None, args=(), heavy=False, alone=False, start=False, long=False,
                  waiting=False):
    """run_mpi(np, worker, timeout, env, args), once per session for the same arguments (see
    shared_run); start=True only starts it in the background (waiting=True: in the lane beside the
    pool, see start_shared) and returns its Future."""
    kwargs = dict(timeout=timeout, env=dict(env or {}), args=tuple(args), heavy=heavy, alone=alone, long=long)
    if start:
        return start_shared(run_mpi, np, worker, waiting=waiting, **kwargs)
    return shared_run(run_mpi, np, worker, **kwargs)


def shared_launches(worker, env=None, timeout=300, long=False):
    """launch(np, start=False): shared_launch of `worker` with `env` on np ranks (cached_launches,
    shared across modules and startable ahead of the tests)."""
    def launch(np, start=False):
        return shared_launch(np, worker, timeout=timeout, env=env, start=start, long=long)
    return launch


# The settings of most worker launches: a collective that some ranks never submit fails after
# 30 s instead of hanging the launch, and no start-up overlap probe (the grouping plan is not
# what their checks test).
BOUNDED_STALL_ENV = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "10", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "30",
                     "TF_MPI_OVERLAP": "0"}


def checks_at(worker, np, only_at=None):
    """The checks of `worker` that run at world size np. only_at: {check: world sizes} for checks
    that need a world size the others do not (e.g. a power of two, or memory only one launch has)."""
    only_at = only_at or {}
    names = check_names(worker)
    unknown = sorted(set(only_at) - set(names))
    assert not unknown, f"{worker} has no checks {unknown}"
    return [check for check in names if np in only_at.get(check, (np,))]


def left_out_env(worker, np, only_at=None):
    """The environment that makes a launch of `worker` at world size np leave out the checks that
    checks_at(worker, np, only_at) does not list (TF_MPI_TEST_EXCEPT)."""
    kept = checks_at(worker, np, only_at)  # also refuses an only_at naming no check of the worker
    left_out = [check for check in (only_at or {}) if check not in kept]
    return {"TF_MPI_TEST_EXCEPT": ",".join(left_out)} if left_out else {}


def joint_launches_by_np(name, worker, nps, env=None, only_at=None):
    """launch(np, start=False): section `name` (tests/workers/<worker>) of the joint launch
    "np<N>" for each np in nps (joint_launch), for a module whose tests are parametrized by np.

    only_at: as for checks_at; launch.cases lists the (np, check) pairs that run, for
    pytest.mark.parametrize("np,check", launch.cases)."""
    launches = {np: joint_launch(f"np{np}", np, name, worker, env={**(env or {}), **left_out_env(worker, np, only_at)})
                for np in nps}

    def launch(np, start=False):
        return launches[np](start=start)
    launch.cases = [(np, check) for np in nps for check in checks_at(worker, np, only_at)]
    return launch


def prefetch_by_np(launch):
    """prefetch(items) for a module whose tests are parametrized by np and check launch(np)."""
    def prefetch(items):
        for np in params_of(items, "np"):
            launch(np, start=True)
    return prefetch


def selected_tests(items):
    """The test functions' names (without parameters) among the selected pytest items."""
    return {getattr(item, "originalname", item.name) for item in items}


def stop_background_launches():
    """Drops the launches not started yet (the session is ending); the running ones end by their
    own time limits."""
    global _pool, _lane
    for executor in (_pool, _lane):
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
    _pool = _lane = None


def param(item, name, default=None):
    """The value of parameter `name` of a pytest item (default if it has no such parameter)."""
    return item.callspec.params.get(name, default) if hasattr(item, "callspec") else default


def params_of(items, name):
    """The distinct values of parameter `name` among the selected pytest items, in run order."""
    return list(dict.fromkeys(param(item, name) for item in items if param(item, name) is not None))


def assert_resumed_example(run, workdir, learning_rate, checkpoint_files):
    """Checks an example launch that resumed from `workdir`/ckpt after one saved epoch.

    It must start at the saved epoch and run one more, report identical
    weights and optimizer state on every rank, continue the learning-rate
    schedule (the step count came back with the checkpoint: `learning_rate`
    is the expected rate, not the restarted one), record two epochs in
    state.json next to exactly `checkpoint_files`, and write its plot.
    """
    import pytest
    run.assert_ok()
    r = run.result
    assert r["initial_epoch"] == 1 and r["epochs_run"] == 1, r   # Keras epoch index 1 = the 2nd epoch
    assert "resuming from" in run.output
    assert r["weights_identical"] and r["optimizer_state_identical"], r
    assert r["learning_rate"] == pytest.approx(learning_rate, rel=1e-5), r
    with open(os.path.join(workdir, "ckpt", "state.json")) as f:
        state = json.load(f)
    assert state["epoch"] == 2 and len(state["history"]) == 2, state
    assert sorted(os.listdir(os.path.join(workdir, "ckpt"))) == sorted(checkpoint_files)
    with open(os.path.join(workdir, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def check_names(worker):
    """Names of the check_* functions a worker defines (read without importing it)."""
    with open(os.path.join(WORKERS, worker)) as f:
        return re.findall(r"^def (check_\w+)\(", f.read(), flags=re.M)


def assert_check(run, np, name):
    """Fails unless check `name` passed on all np ranks of a launch that ended cleanly (exit code 0).

    A check that raised SkipCheck on every rank is reported as a pytest skip with its reason.
    """
    import pytest
    assert not run.timed_out, f"mpirun timed out (hang?)\n{run.describe()}"
    assert sorted(run.results) == list(range(np)), f"missing rank results\n{run.describe()}"
    missing = [r for r, res in sorted(run.results.items()) if name not in res]
    assert not missing, f"check {name} was not run on ranks {missing}\n{run.describe()}"
    failures = {r: res[name] for r, res in run.results.items() if not res[name].get("ok")}
    assert not failures, "check failed on ranks " + ", ".join(
        f"{r}: {v.get('error', 'no error text')}" for r, v in sorted(failures.items())) + \
        f"\n(the launch: {run.describe()})"  # the engines' logs of every rank
    # Every check passed, but a rank that then crashed or exited non-zero fails the launch.
    assert run.returncode == 0, f"a rank exited with a non-zero code\n{run.describe()}"
    skipped = {res[name].get("skipped") for res in run.results.values()}
    assert len(skipped) == 1, f"check {name} was skipped on some ranks only: {sorted(map(str, skipped))}"
    if skipped != {None}:
        pytest.skip(skipped.pop())
