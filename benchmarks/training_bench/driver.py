"""The driver role: runs every selected launch --rounds times (each launch its own processes:
one, two independent ones, an MPI job or an MWMS cluster), then reports, saves and plots.
It imports neither TensorFlow nor tf_mpi (except tf_mpi.run and tf_mpi.timeline_analysis)."""
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from training_bench import (BATCH_PER_PROCESS, CALL_COST_MODE, DISTRIBUTED_PROCESSES, GROUPING_NAMES, MODES,
                            PRECISIONS, REPO_ROOT, RESULT_PREFIX, SCRIPT, SPARSE_GRADIENT_MODELS, USER_MODELS)
from training_bench.plot import plot_efficiency
from training_bench.report import format_table, progress_line
from training_bench.stats import add_efficiencies, summarize_rounds

from example_utils import write_json_atomic  # noqa: E402  (examples/ is on sys.path once training_bench is imported)


@dataclass(frozen=True)
class Variant:
    """One launch configuration of a model: a mode and, for tfmpi, a grouping and how
    sparse gradients travel (only models in SPARSE_GRADIENT_MODELS have any)."""
    mode: str
    grouping: str = None
    timeline: bool = False  # writes a tf_mpi timeline: for the overlap analysis, not for throughput
    sparse: str = "dense"
    shm_off: bool = False  # TF_MPI_SHM=0: the engine's MPI path instead of shared memory

    @property
    def label(self):
        """'single', 'tfmpi graph', ..., 'mwms', 'tfmpi graph allgather', 'tfmpi graph shm=0 +timeline'."""
        words = [self.mode, self.grouping, None if self.sparse in ("dense", "default") else self.sparse,
                 "shm=0" if self.shm_off else None, "+timeline" if self.timeline else None]
        return " ".join(w for w in words if w)


# Environment a tfmpi grouping's launch needs: per-tensor also turns off the
# engine's fusion, so that each tensor really is one MPI allreduce.
GROUPING_ENV = {"graph": {}, "one": {}, "per-tensor": {"TF_MPI_FUSION_THRESHOLD": "0"}}


def sparse_modes(sparse):
    """The --sparse list with 'both' spelled out (dense, allgather), without repeats, in order."""
    modes = []
    for name in sparse:
        for mode in (["dense", "allgather"] if name == "both" else [name]):
            if mode not in modes:
                modes.append(mode)
    return modes


def selected_variants(modes, groupings, sparse, model, shm_off=False):
    """The variants to run for `model`, baseline first (efficiencies need it). Every
    tfmpi grouping reduces sparse gradients the first --sparse way (none given: dense, or
    tf_mpi's default for the *_user models); models that have one also run
    `tfmpi graph <mode>` for every other --sparse mode; shm_off adds `tfmpi graph shm=0`."""
    sparse = sparse_modes(sparse or ["default" if model in USER_MODELS else "dense"])
    has_sparse = model in SPARSE_GRADIENT_MODELS
    no_sparse = "default" if model in USER_MODELS else "dense"  # what a model without sparse gradients passes
    variants = []
    for mode in MODES:
        if mode not in modes:
            continue
        if mode == "tfmpi":
            variants += [Variant("tfmpi", g, sparse=sparse[0] if has_sparse else no_sparse)
                         for g in GROUPING_NAMES if g in groupings]
            if has_sparse:
                variants += [Variant("tfmpi", "graph", sparse=m) for m in sparse[1:]]
            if shm_off:
                variants.append(Variant("tfmpi", "graph", sparse=sparse[0] if has_sparse else no_sparse,
                                        shm_off=True))
        else:
            variants.append(Variant(mode))
    return variants


def worker_args(variant, model, precision, args):
    """Command-line arguments of this script's worker role for one launch."""
    if variant.mode == CALL_COST_MODE:  # no model: one tf.function with or without a 1 KiB allreduce
        return [SCRIPT, "--mode", variant.mode, "--inter-op-threads", str(args.inter_op_threads)] + (
            ["--repeats", str(max(args.repeats, 5))] if args.repeats else [])
    argv = [SCRIPT, "--mode", variant.mode, "--model", model, "--precision", precision, "--seed", str(args.seed),
            "--inter-op-threads", str(args.inter_op_threads)]
    if args.warmup:
        argv += ["--warmup", str(args.warmup)]
    if args.repeats:
        argv += ["--repeats", str(args.repeats)]
    if args.steps:
        argv += ["--steps", str(args.steps)]
    if variant.grouping:
        argv += ["--grouping", variant.grouping]
    if args.no_mwms_workaround:
        argv.append("--no-mwms-workaround")
    if variant.mode == "tfmpi":
        argv += ["--sparse", variant.sparse]
    return argv


def base_env():
    """The driver's environment, with the repository importable and TensorFlow's C++ logging quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def free_ports(n):
    """n TCP ports free right now on localhost (the OS picks them; they are released before use)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def timeline_path(prefix, model, precision, shm_off=False):
    """Per-launch timeline file: trace.json -> trace.<model>.<precision>[.shm0].json."""
    root, ext = os.path.splitext(prefix)
    return f"{root}.{model}.{precision}{'.shm0' if shm_off else ''}{ext or '.json'}"


def tf_mpi_launcher():
    """tf_mpi.run: what ``python -m tf_mpi.run -np N`` runs (it imports no TensorFlow,
    so the driver stays light)."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    from tf_mpi import run
    return run


def launch_commands(variant, model, precision, args):
    """[(argv, env)] of the processes of one launch, and the timeline file it writes (or None)."""
    script = worker_args(variant, model, precision, args)
    env = base_env()
    if variant.mode == "single":
        return [([sys.executable] + script, env)], None
    if variant.mode == "pair":
        return [([sys.executable] + script, env)] * DISTRIBUTED_PROCESSES, None
    if variant.mode == CALL_COST_MODE:
        launcher = tf_mpi_launcher()
        return [(launcher.mpirun_command(DISTRIBUTED_PROCESSES, [sys.executable] + script), launcher.mpirun_env(env))], None
    if variant.mode == "tfmpi":
        env.update(GROUPING_ENV[variant.grouping])
        if variant.shm_off:
            env["TF_MPI_SHM"] = "0"
        trace = None
        if variant.timeline:
            trace = timeline_path(args.timeline, model, precision, variant.shm_off)
            env["TF_MPI_TIMELINE"] = trace
        launcher = tf_mpi_launcher()
        argv = launcher.mpirun_command(DISTRIBUTED_PROCESSES, [sys.executable] + script)
        return [(argv, launcher.mpirun_env(env))], trace
    # mwms: one process per worker, each told its place in the cluster.
    cluster = {"worker": [f"localhost:{p}" for p in free_ports(DISTRIBUTED_PROCESSES)]}
    commands = []
    for index in range(DISTRIBUTED_PROCESSES):
        worker_env = dict(env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        commands.append(([sys.executable] + script, worker_env))
    return commands, None


def stop(process):
    """Ends a process this driver started, with everything it started (its own session)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def run_processes(commands, timeout):
    """Runs the processes of one launch together; returns (exit codes, combined output).

    If one process fails the others are stopped (an MWMS worker or MPI rank
    whose peer died would otherwise wait until the timeout).
    """
    logs = [tempfile.TemporaryFile(mode="w+") for _ in commands]
    processes = [subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                  start_new_session=True)
                 for (argv, env), log in zip(commands, logs)]
    deadline = time.time() + timeout
    timed_out = False
    while any(p.poll() is None for p in processes):
        timed_out = time.time() > deadline
        if timed_out or any(p.poll() not in (None, 0) for p in processes):
            if not timed_out:
                time.sleep(5)  # let the others print their own error first
            for p in processes:
                stop(p)
            break
        time.sleep(0.2)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [p.returncode for p in processes]
    if timed_out:
        outputs.append(f"(launch timed out after {timeout} s)")
    return codes, "\n".join(outputs)


def parse_result(output, expected=1):
    """The JSON of the RESULT line in a launch's output, or None.

    A `pair` launch has one RESULT per process (``expected``); they are
    combined into one: throughputs add up, step times are averaged.
    """
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in output.splitlines()
               if line.startswith(RESULT_PREFIX)]
    if len(results) != expected:
        return None
    if expected == 1:
        return results[0]
    combined = dict(results[0], processes=len(results), global_batch=BATCH_PER_PROCESS * len(results))
    for key in ("samples_per_sec", "samples_per_sec_min", "samples_per_sec_max"):
        combined[key] = sum(r[key] for r in results)
    combined["step_ms"] = statistics.mean(r["step_ms"] for r in results)
    return combined


def error_summary(output):
    """(last error line, last lines) of a failed launch's output, for the report."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line.strip() for line in lines if re.match(r"^\s*[\w.]*(Error|Exception)\b", line)
              or "timed out" in line]
    if not errors:
        return (lines[-1].strip() if lines else "no output"), lines[-12:]
    error = errors[-1]
    # A message that prints a tensor spans many lines; its last line says what went wrong.
    if lines[-1].strip() != error and not lines[-1].startswith(" "):
        error += " ... " + lines[-1].strip()
    return error, lines[-12:]


def analyze_timeline(path):
    """tf_mpi.timeline_analysis.analyze(path) if that module is there, else why not.

    This is the benchmark's single call site of the timeline analysis.
    """
    if not os.path.exists(path):
        return {"unavailable": f"no timeline file at {path}"}
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    try:
        from tf_mpi.timeline_analysis import analyze
    except ImportError as e:
        return {"unavailable": f"tf_mpi.timeline_analysis is not importable ({e})"}
    try:
        return analyze(path)
    except Exception as e:  # a report, not a reason to lose the benchmark's numbers
        return {"error": f"{type(e).__name__}: {e}"}


def cpu_ticks():
    """(steal, total) CPU ticks of the whole machine since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(before, after):
    """Share of CPU time the hypervisor gave to other guests between two cpu_ticks() readings.

    On a shared VM this is the main source of launch-to-launch noise: a
    synchronous 2-process job waits for its slower rank every step, so a
    stolen core slows it far more than it slows independent processes.
    """
    if not before or not after or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def run_launch(variant, model, precision, args):
    """Runs one launch; returns its result entry (status ok, or unavailable with the error)."""
    commands, trace = launch_commands(variant, model, precision, args)
    began, ticks = time.time(), cpu_ticks()
    codes, output = run_processes(commands, args.launch_timeout)
    result = parse_result(output, expected=len(commands) if variant.mode == "pair" else 1)
    entry = {"model": model, "precision": precision, "mode": variant.mode, "grouping": variant.grouping,
             "label": variant.label, "launch_seconds": round(time.time() - began, 1), "exit_codes": codes,
             "cpu_steal_share": steal_share(ticks, cpu_ticks())}
    if result is None or any(codes):
        error, tail = error_summary(output)
        entry.update(status="unavailable", error=error, output_tail=tail)
        return entry
    entry.update(result, status="ok", label=variant.label)
    if trace:
        entry["timeline"] = trace
        entry["timeline_analysis"] = analyze_timeline(trace)
    return entry


def apply_quick(args):
    """--quick: tiny windows, 1 repeat, short warm-up, so the whole driver is a smoke test."""
    args.steps = args.steps or 3
    args.repeats = 1
    args.rounds = 1
    args.warmup = 2
    args.launch_timeout = min(args.launch_timeout, 300)


def rotated(items, k):
    """items rotated left by k: each round starts with a different variant, so
    none of them is always the first launch after a model change."""
    k %= len(items)
    return items[k:] + items[:k]


def run_driver(args):
    """Driver role: runs every selected launch --rounds times, then prints, saves and plots the results."""
    if args.quick:
        apply_quick(args)
    precisions = PRECISIONS if args.precision == "both" else [args.precision]
    launches = [(r, p, m, v) for r in range(args.rounds) for p in precisions for m in args.models
                for v in rotated(selected_variants(args.modes, args.groupings, args.sparse, m, args.shm_off), r)]
    if args.call_cost:
        # One launch per round, after the round's training launches.
        launches = [x for r in range(args.rounds) for x in [l for l in launches if l[0] == r]
                    + [(r, "float32", "allreduce_1kib", Variant(CALL_COST_MODE))]]
    if args.timeline:
        # Writing the trace costs rank 0 time, so it is a launch of its own
        # (once per model), kept out of the throughput comparison.
        launches += [(0, p, m, Variant("tfmpi", "graph", timeline=True, shm_off=off)) for p in precisions
                     for m in args.models for off in ([False, True] if args.shm_off else [False])]
    began = time.time()
    results = []
    for k, (round_index, precision, model, variant) in enumerate(launches, 1):
        results.append(dict(run_launch(variant, model, precision, args), round=round_index))
        print(progress_line(k, len(launches), results[-1]), flush=True)
    add_efficiencies(results)
    summary = summarize_rounds(results)
    report = {"benchmark": "training_bench", "batch_per_process": BATCH_PER_PROCESS,
              "distributed_processes": DISTRIBUTED_PROCESSES, "warmup": args.warmup, "repeats": args.repeats,
              "rounds": args.rounds, "steps": args.steps or "per model (bench_models.MODELS)", "quick": args.quick,
              "cpu_count": os.cpu_count(), "driver_seconds": round(time.time() - began, 1),
              "summary": summary, "results": results}
    print(format_table(summary), flush=True)
    print(f"driver: {len(launches)} launches in {report['driver_seconds']:.0f} s", flush=True)
    if args.json:
        write_json_atomic(args.json, report, indent=1)
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        plot_efficiency(report, args.plot)
        print(f"wrote {args.plot}", flush=True)
