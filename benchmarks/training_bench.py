"""End-to-end training benchmark: tf_mpi against one process and MultiWorkerMirroredStrategy.

Three models (benchmarks/bench_models.py) on synthetic data, 64 samples per
process and step, Adam, ``model.fit`` with jit_compile=False, float32 or
mixed_float16. Each measurement is its own launch:

  single   1 process, plain Keras, no tf_mpi at all: the baseline.
  pair     2 `single` processes at the same time, not communicating: the
           ceiling. Their summed throughput is what 2 processes reach on this
           machine when communication costs nothing (they share memory
           bandwidth, caches and, on 2 cores, the OS's time with each other).
  tfmpi    ``python -m tf_mpi.run -np 2`` (the driver calls tf_mpi/run.py's
           mpirun_command directly), hvd.DistributedOptimizer and
           BroadcastGlobalVariablesCallback(0), with gradient grouping
             graph       the default plan (backprop order, cut when bandwidth-bound, byte bound),
             one         num_groups=1 (all dense gradients in one fused allreduce),
             per-tensor  one group per variable and TF_MPI_FUSION_THRESHOLD=0
                         (the engine fuses nothing: one MPI allreduce per tensor),
           and an Embedding's sparse gradient densified before its allreduce
           (sparse_as_dense=True; --sparse both adds `tfmpi graph allgather`,
           where it is allgathered as tf.IndexedSlices instead).
  mwms     tf.distribute.MultiWorkerMirroredStrategy, 2 worker processes on
           localhost (TF_CONFIG, free ports), RING collectives, global batch 128.

Every process runs 1 intra-op thread and 1 inter-op thread (--inter-op-threads):
with TensorFlow's default inter-op pool a single process runs independent ops
on both cores of a 2-core machine (the LSTM step takes 150 ms instead of
248 ms), so it would not be a one-worker baseline. Timing:
--warmup untimed steps (tracing, broadcast, collective set-up), then
--repeats windows of --steps steps inside the same ``fit`` call, timed with
on_train_batch_end timestamps; a launch's figure is the median samples/s over
its windows (all processes together). The driver runs every launch --rounds
times (default 3), round by round, each round starting with a different
variant, and reports per variant the median over rounds and [lowest-highest
round]: launch-to-launch variation on a shared 2-core VM is larger than the
variation inside one launch. Scaling efficiency = samples/s at 2 processes /
(2 x samples/s of `single` in the same round); "of pair" = samples/s /
samples/s of `pair` in the same round (the share of the ceiling).

Run from the repository root (the driver spawns every launch itself)::

    # Everything, float32 (3 rounds x 3 models x 6 launches, about 30 minutes on 2 cores):
    python benchmarks/training_bench.py --driver --json train.json --plot train.png

    # Smoke test (tiny windows, 1 repeat, 1 round, about 3 minutes):
    python benchmarks/training_bench.py --driver --quick

    # mixed_float16 (or --precision both), a subset of models and modes:
    python benchmarks/training_bench.py --driver --precision mixed_float16 --models mlp cnn --modes single tfmpi

    # Plus one `tfmpi graph` launch per model that writes a tf_mpi timeline (trace.json ->
    # trace.<model>.<precision>.json), analysed with tf_mpi.timeline_analysis (overlap, tail);
    # it is reported as "tfmpi graph +timeline" and not used for throughput (tracing costs rank 0 time):
    python benchmarks/training_bench.py --driver --modes single tfmpi --groupings graph --timeline /tmp/trace.json

    # Plot a saved result file again, or print it as the Markdown table of docs/performance.md:
    python benchmarks/training_bench.py --plot train.png --results train.json
    python benchmarks/training_bench.py --markdown --results train.json

One launch by hand (what the driver runs; the reporting process prints ``RESULT {json}``)::

    python benchmarks/training_bench.py --mode single --model mlp
    python -m tf_mpi.run -np 2 python benchmarks/training_bench.py --mode tfmpi --grouping one --model mlp
    TF_MPI_FUSION_THRESHOLD=0 python -m tf_mpi.run -np 2 python benchmarks/training_bench.py \\
        --mode tfmpi --grouping per-tensor --model mlp
    python -m tf_mpi.run -np 2 python benchmarks/training_bench.py --mode tfmpi --model lstm --compression fp16
    TF_CONFIG='{"cluster": {"worker": ["localhost:PORT0", "localhost:PORT1"]}, "task": {"type": "worker", "index": I}}' \\
        python benchmarks/training_bench.py --mode mwms --model mlp     # twice, I = 0 and 1

MWMS with Keras 3 (3.15) needs two workarounds, applied by --mode mwms unless
--no-mwms-workaround is given (then the launch fails and is reported as
unavailable, with Keras' error). Keras reduces a whole (x, y) batch with
``strategy.reduce`` to build the model symbolically, and reduces scalar losses
with ``axis=0``; with more than one worker both raise (keras-team/keras#20585).
See ``patch_keras_for_multi_worker``; neither touches the gradient path.

On a machine with as many cores as processes, the numbers are only indicative
(the OS, MPI progress and TF's inter-op threads share the same cores).
"""
import argparse
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
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)

BATCH_PER_PROCESS = 64
DISTRIBUTED_PROCESSES = 2
LEARNING_RATE = 1e-3
PRECISIONS = ["float32", "mixed_float16"]
MODES = ["single", "pair", "tfmpi", "mwms"]
GROUPING_NAMES = ["graph", "one", "per-tensor"]
MODEL_NAMES = ["lstm", "mlp", "cnn", "tiny"]  # = bench_models.MODELS; kept here so the driver need not import TF
# Models with an IndexedSlices gradient (an Embedding's), for which tf_mpi can
# densify it before an allreduce (the default here) or allgather it.
SPARSE_GRADIENT_MODELS = ["lstm"]
SPARSE_NAMES = ["dense", "allgather"]
RESULT_PREFIX = "RESULT "


# ============================================================================= worker role
# Everything below up to the driver role runs inside the launched processes.
# TensorFlow is imported only here, after the thread count is fixed.

def init_tensorflow_one_thread(inter_op_threads):
    """Imports TensorFlow with 1 intra-op thread and `inter_op_threads` (before any op creates the runtime)."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    return tf


def make_step_clock():
    """A Keras callback recording time.perf_counter() at train begin and after every batch."""
    import keras

    class StepClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.stamps = []

        def on_train_begin(self, logs=None):
            self.stamps = [time.perf_counter()]

        # Defining on_train_batch_end also keeps Keras from dispatching batch
        # callbacks asynchronously, so a stamp is taken when its step is done.
        def on_train_batch_end(self, batch, logs=None):
            self.stamps.append(time.perf_counter())

    return StepClock()


def window_seconds(stamps, warmup, steps, repeats):
    """Durations of `repeats` consecutive windows of `steps` steps after `warmup` steps.

    stamps[0] is train begin and stamps[k] the end of step k, so a window of
    steps a+1..a+steps lasts stamps[a+steps] - stamps[a].
    """
    expected = 1 + warmup + steps * repeats
    if len(stamps) != expected:
        raise RuntimeError(f"expected {expected} timestamps, got {len(stamps)}")
    starts = [warmup + r * steps for r in range(repeats)]
    return [stamps[a + steps] - stamps[a] for a in starts]


@dataclass
class Setup:
    """What a mode's set-up hands to the common training loop."""
    model: object
    dataset: object
    callbacks: list
    processes: int
    reports: bool  # whether this process prints the RESULT line
    extra: dict = field(default_factory=dict)  # mode-specific facts for the result
    after_fit: object = None  # () -> dict of more facts, read once training is over


def compile_model(model, spec, optimizer):
    """model.compile as every mode does it; jit_compile=False because tf_mpi's collectives cannot run under XLA."""
    model.compile(optimizer=optimizer, loss=spec.loss, jit_compile=False)


def setup_single(args, spec, tf, keras):
    """Plain Keras in one process: the baseline. Does not import tf_mpi."""
    import bench_models
    model = spec.build()
    compile_model(model, spec, keras.optimizers.Adam(LEARNING_RATE))
    dataset = bench_models.synthetic_dataset(spec, BATCH_PER_PROCESS, seed=args.seed)
    return Setup(model, dataset, [], processes=1, reports=True)


def grouping_options(grouping, model):
    """hvd.DistributedOptimizer keyword arguments of a --grouping (the model must be built for per-tensor)."""
    if grouping == "graph":
        return {}
    if grouping == "one":
        return {"num_groups": 1}
    if grouping == "per-tensor":
        return {"groups": [[v] for v in model.trainable_variables]}
    raise ValueError(f"unknown grouping {grouping!r}")


def setup_tfmpi(args, spec, tf, keras):
    """tf_mpi data parallelism: DistributedOptimizer + BroadcastGlobalVariablesCallback(0), one rank per process."""
    import bench_models
    import tf_mpi.keras as hvd
    hvd.init()
    model = spec.build()
    # sparse_as_dense: Keras 3's Adam densifies an IndexedSlices gradient anyway, and
    # densifying 64x100 rows on each rank before a 10 MiB allreduce is cheaper than
    # densifying the 2x64x100 allgathered rows after it (docs/performance.md).
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(LEARNING_RATE),
                                         sparse_as_dense=args.sparse == "dense",
                                         compression=getattr(hvd.Compression, args.compression),
                                         **grouping_options(args.grouping, model))
    compile_model(model, spec, optimizer)
    dataset = bench_models.synthetic_dataset(spec, BATCH_PER_PROCESS, seed=args.seed + hvd.rank())

    def plan_facts():
        plan = optimizer.grouping_plan
        return {"groups": len(plan.groups) if plan else None,
                "grouping_source": plan.source if plan else None,
                "group_bytes": [g.nbytes for g in plan.groups] if plan else None,
                "overlap": plan.cost_model.overlap if plan and plan.cost_model else None}

    env_seen = {k: os.environ.get(k) for k in ("TF_MPI_FUSION_THRESHOLD", "TF_MPI_TIMELINE", "TF_MPI_OVERLAP")}
    return Setup(model, dataset, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)], processes=hvd.size(),
                 reports=hvd.rank() == 0,
                 extra={"grouping": args.grouping, "sparse": args.sparse, "compression": args.compression,
                        "env": env_seen},
                 after_fit=plan_facts)


def patch_keras_for_multi_worker(model, strategy):
    """Works around two Keras 3 bugs that stop model.fit under MultiWorkerMirroredStrategy with > 1 worker.

    1. fit() builds the model symbolically from one batch, which it first
       averages over replicas with ``strategy.reduce("MEAN", (x, y), axis=None)``;
       with several workers the strategy cannot reduce a nested structure
       ("Attempt to convert a value (PerReplica...) with an unsupported type
       ... to a Tensor"). Only the batch's shapes and dtypes are needed, so
       this takes the local replica's batch instead (no communication).
    2. The train step averages its logs with ``strategy.reduce("MEAN", v,
       axis=0)`` in multi-worker mode, which fails on the scalar loss
       ("Invalid reduction dimension 0 for input with 0 dimensions"). Scalars
       are averaged with axis=None instead (still one collective per step, as
       Keras intends).

    Neither patch changes how gradients are reduced. See keras-team/keras#20585.
    """
    import types
    from keras.src.backend.tensorflow import trainer as tf_trainer
    import tensorflow as tf

    def local_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None:
            for _, _, distributed_iterator in iterator:
                batch = next(distributed_iterator)
                data_batch = tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], batch)
                break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    model._maybe_symbolic_build = types.MethodType(local_symbolic_build, model)

    keras_reduce_per_replica = tf_trainer.reduce_per_replica
    if getattr(keras_reduce_per_replica, "patched_for_multi_worker", False):
        return

    def reduce_per_replica(values, strategy_, reduction):
        if reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(strategy_):
            return tf.nest.map_structure(
                lambda v: strategy_.reduce("MEAN", v, axis=None if v.shape.rank == 0 else 0), values)
        return keras_reduce_per_replica(values, strategy_, reduction)

    reduce_per_replica.patched_for_multi_worker = True
    tf_trainer.reduce_per_replica = reduce_per_replica


def setup_mwms(args, spec, tf, keras):
    """MultiWorkerMirroredStrategy (TF_CONFIG from the environment), RING collectives, global batch 128."""
    import bench_models
    ring = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=ring))
    workers = strategy.num_replicas_in_sync  # one CPU replica per worker
    task_index = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    with strategy.scope():
        model = spec.build()
        compile_model(model, spec, keras.optimizers.Adam(LEARNING_RATE))
    if not args.no_mwms_workaround:
        patch_keras_for_multi_worker(model, strategy)
    # The dataset yields global batches; the strategy splits each into one
    # per-worker batch of 64. Sharding is OFF: the data are random, so which
    # worker gets which samples does not matter, and file-based sharding
    # would fail on an in-memory dataset.
    dataset = bench_models.synthetic_dataset(spec, BATCH_PER_PROCESS * workers, seed=args.seed + task_index)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return Setup(model, dataset.with_options(options), [], processes=workers, reports=task_index == 0,
                 extra={"communication": "RING", "keras_workaround": not args.no_mwms_workaround})


MODE_SETUPS = {"single": setup_single, "pair": setup_single, "tfmpi": setup_tfmpi, "mwms": setup_mwms}


def summarize_windows(seconds, samples_per_window):
    """samples/s median, min, max and the raw window times."""
    rates = [samples_per_window / s for s in seconds]
    return {"samples_per_sec": statistics.median(rates), "samples_per_sec_min": min(rates),
            "samples_per_sec_max": max(rates), "window_seconds": [round(s, 4) for s in seconds]}


def run_worker(args):
    """Worker role: trains one configuration and prints RESULT {json} on the reporting process."""
    began = time.time()
    tf = init_tensorflow_one_thread(args.inter_op_threads)
    import keras
    import bench_models
    keras.mixed_precision.set_global_policy(args.precision)
    keras.utils.set_random_seed(args.seed)
    spec = bench_models.MODELS[args.model]
    steps = args.steps or spec.timed_steps
    setup = MODE_SETUPS[args.mode](args, spec, tf, keras)
    clock = make_step_clock()
    total_steps = args.warmup + steps * args.repeats
    setup.model.fit(setup.dataset, steps_per_epoch=total_steps, epochs=1, verbose=0, shuffle=False,
                    callbacks=setup.callbacks + [clock])
    seconds = window_seconds(clock.stamps, args.warmup, steps, args.repeats)
    global_batch = BATCH_PER_PROCESS * setup.processes
    result = {"model": args.model, "precision": args.precision, "mode": args.mode,
              "grouping": args.grouping if args.mode == "tfmpi" else None,
              "processes": setup.processes, "batch_per_process": BATCH_PER_PROCESS, "global_batch": global_batch,
              "warmup": args.warmup, "steps": steps, "repeats": args.repeats,
              "parameters": bench_models.count_parameters(setup.model),
              **summarize_windows(seconds, steps * global_batch),
              "step_ms": 1000 * statistics.median(seconds) / steps,
              "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
              "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
              "tensorflow": tf.__version__, "keras": keras.__version__,
              **setup.extra, **(setup.after_fit() if setup.after_fit else {}),
              "worker_seconds": round(time.time() - began, 1)}
    if setup.reports:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


# ============================================================================= driver role
# The driver imports neither TensorFlow nor tf_mpi (except tf_mpi.timeline_analysis).

@dataclass(frozen=True)
class Variant:
    """One launch configuration of a model: a mode and, for tfmpi, a grouping and how
    sparse gradients travel (only models in SPARSE_GRADIENT_MODELS have any)."""
    mode: str
    grouping: str = None
    timeline: bool = False  # writes a tf_mpi timeline: for the overlap analysis, not for throughput
    sparse: str = "dense"

    @property
    def label(self):
        """'single', 'tfmpi graph', ..., 'mwms', 'tfmpi graph allgather', 'tfmpi graph +timeline'."""
        words = [self.mode, self.grouping, None if self.sparse == "dense" else self.sparse,
                 "+timeline" if self.timeline else None]
        return " ".join(w for w in words if w)


# Environment a tfmpi grouping's launch needs: per-tensor also turns off the
# engine's fusion, so that each tensor really is one MPI allreduce.
GROUPING_ENV = {"graph": {}, "one": {}, "per-tensor": {"TF_MPI_FUSION_THRESHOLD": "0"}}


def selected_variants(modes, groupings, sparse, model):
    """The variants to run for `model`, baseline first (efficiencies need it). Every
    tfmpi grouping densifies sparse gradients; with `sparse` == "both", models that
    have one also run `tfmpi graph allgather`."""
    variants = []
    for mode in MODES:
        if mode not in modes:
            continue
        if mode == "tfmpi":
            variants += [Variant("tfmpi", g) for g in GROUPING_NAMES if g in groupings]
            if sparse == "both" and model in SPARSE_GRADIENT_MODELS:
                variants.append(Variant("tfmpi", "graph", sparse="allgather"))
        else:
            variants.append(Variant(mode))
    return variants


def worker_args(variant, model, precision, args):
    """Command-line arguments of this script's worker role for one launch."""
    argv = [os.path.abspath(__file__), "--mode", variant.mode, "--model", model, "--precision", precision,
            "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--seed", str(args.seed),
            "--inter-op-threads", str(args.inter_op_threads)]
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


def timeline_path(prefix, model, precision):
    """Per-launch timeline file: trace.json -> trace.<model>.<precision>.json."""
    root, ext = os.path.splitext(prefix)
    return f"{root}.{model}.{precision}{ext or '.json'}"


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
    if variant.mode == "tfmpi":
        env.update(GROUPING_ENV[variant.grouping])
        trace = None
        if variant.timeline:
            trace = timeline_path(args.timeline, model, precision)
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


def add_efficiencies(results):
    """Per launch, against the same round's launches of the same model and precision:
    efficiency = samples/s at N processes / (N x samples/s of `single`), and
    of_pair = samples/s / samples/s of `pair` (the share of the no-communication ceiling)."""
    def rates(mode):
        return {(e.get("round", 0), e["model"], e["precision"]): e["samples_per_sec"]
                for e in results if e["mode"] == mode and e["status"] == "ok"}
    single, pair = rates("single"), rates("pair")
    for e in results:
        key = (e.get("round", 0), e["model"], e["precision"])
        if e["status"] != "ok" or e["mode"] == "single":
            continue
        if key in single:
            e["efficiency"] = e["samples_per_sec"] / (e["processes"] * single[key])
        if key in pair and e["mode"] != "pair":
            e["of_pair"] = e["samples_per_sec"] / pair[key]


def spread(values):
    """{median, min, max} of a non-empty list."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_rounds(results):
    """One entry per (precision, model, variant): medians over the rounds and their spread.

    With one round, the min/max of samples/s are those of the timed windows
    inside the launch; with several rounds they are the lowest and highest
    round medians (launch-to-launch spread, the larger and more honest one).
    """
    keys = []
    for e in results:
        key = (e["precision"], e["model"], e["label"])
        if key not in keys:
            keys.append(key)
    summary = []
    for key in keys:
        runs = [e for e in results if (e["precision"], e["model"], e["label"]) == key]
        ok = [e for e in runs if e["status"] == "ok"]
        if not ok:
            summary.append(dict(runs[-1], rounds=len(runs), rounds_ok=0))
            continue
        entry = dict(ok[-1], rounds=len(runs), rounds_ok=len(ok))
        rates = spread([e["samples_per_sec"] for e in ok])
        entry["samples_per_sec"] = rates["median"]
        if len(ok) > 1:
            entry["samples_per_sec_min"], entry["samples_per_sec_max"] = rates["min"], rates["max"]
        entry["step_ms"] = statistics.median(e["step_ms"] for e in ok)
        steals = [e["cpu_steal_share"] for e in ok if e.get("cpu_steal_share") is not None]
        if steals:
            entry["cpu_steal_share"] = spread(steals)
        for metric in ("efficiency", "of_pair"):
            values = [e[metric] for e in ok if metric in e]
            if values:
                entry[metric] = statistics.median(values)
                entry[metric + "_spread"] = spread(values)
        tails = [e["timeline_analysis"] for e in ok if "tail_ms" in e.get("timeline_analysis", {})]
        if tails:
            entry["timeline_analysis"] = {k: statistics.median(t[k] for t in tails)
                                          for k in ("step_ms", "comm_ms", "overlap_share", "tail_ms", "tail_share")
                                          if all(k in t for t in tails)}
        summary.append(entry)
    return summary


def progress_line(k, total, entry):
    """One line per finished launch, so a long driver run shows where it is."""
    what = f"[{k}/{total}] round {entry.get('round', 0) + 1}: {entry['model']} {entry['precision']} {entry['label']}"
    steal = entry.get("cpu_steal_share")
    took = f"[{entry['launch_seconds']:.0f} s" + (f", CPU steal {steal:.0%}]" if steal is not None else "]")
    if entry["status"] != "ok":
        return f"{what}: UNAVAILABLE ({entry['error']}) {took}"
    return f"{what}: {entry['samples_per_sec']:.1f} samples/s {took}"


def format_table(summary):
    """The summary (see summarize_rounds) as a fixed-width text table."""
    header = (f"{'model':<6}{'precision':<15}{'mode':<18}{'samples/s median [min-max]':>30}"
              f"{'step ms':>9}{'efficiency [min-max]':>24}{'of pair':>9}  notes")
    lines = [header, "-" * len(header)]
    for e in summary:
        if e["status"] != "ok":
            lines.append(f"{e['model']:<6}{e['precision']:<15}{e['label']:<18}{'unavailable':>30}{'':>9}{'':>24}"
                         f"{'':>9}  {e['error'][:100]}")
            continue
        rate = f"{e['samples_per_sec']:.1f} [{e['samples_per_sec_min']:.1f}-{e['samples_per_sec_max']:.1f}]"
        efficiency = "-"
        if "efficiency" in e:
            s = e["efficiency_spread"]
            efficiency = f"{e['efficiency']:.1%} [{s['min']:.0%}-{s['max']:.0%}]"
        of_pair = f"{e['of_pair']:.0%}" if "of_pair" in e else "-"
        notes = [] if e["rounds_ok"] == e["rounds"] else [f"{e['rounds_ok']}/{e['rounds']} rounds ok"]
        steal = e.get("cpu_steal_share")
        if isinstance(steal, dict) and steal["max"] >= 0.02:
            notes.append(f"CPU steal up to {steal['max']:.0%}")
        groups = e.get("groups")
        if groups is not None:
            notes.append(f"{groups} group{'' if groups == 1 else 's'}")
        analysis = e.get("timeline_analysis") or {}
        if "overlap_share" in analysis:
            notes.append(f"overlap {analysis['overlap_share']:.0%}, tail {analysis['tail_ms']:.1f} ms "
                         f"({analysis['tail_share']:.1%})")
        lines.append(f"{e['model']:<6}{e['precision']:<15}{e['label']:<18}{rate:>30}{e['step_ms']:>9.1f}"
                     f"{efficiency:>24}{of_pair:>9}  {', '.join(notes)}")
    return "\n".join(lines)


def format_markdown(summary):
    """The summary as a Markdown table, one row per model and precision, one column per variant:
    samples/s median [lowest-highest round], and the efficiency (median over rounds)."""
    labels = []
    for e in summary:
        if e["label"] not in labels:
            labels.append(e["label"])
    rows = []
    for key in dict.fromkeys((e["model"], e["precision"]) for e in summary):
        cells = []
        for label in labels:
            e = next((e for e in summary if (e["model"], e["precision"]) == key and e["label"] == label), None)
            if e is None:
                cells.append("")
            elif e["status"] != "ok":
                cells.append("unavailable")
            else:
                cell = f"{e['samples_per_sec']:.0f} [{e['samples_per_sec_min']:.0f}-{e['samples_per_sec_max']:.0f}]"
                if "efficiency" in e:
                    s = e["efficiency_spread"]
                    cell += f"<br>**{e['efficiency']:.0%}** [{s['min']:.0%}-{s['max']:.0%}]"
                cells.append(cell)
        rows.append(f"| {key[0]} {key[1]} | " + " | ".join(cells) + " |")
    header = "| model | " + " | ".join(labels) + " |"
    return "\n".join([header, "|" + "---|" * (len(labels) + 1)] + rows)


def plot_efficiency(report, path):
    """Grouped bars of scaling efficiency per model (one panel per precision), with a line at 1.0."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    results = report.get("summary") or report["results"]  # files from before --rounds have no summary
    # Variants in the order they were run (round 1 is not rotated); timeline launches are not throughput.
    labels = list(dict.fromkeys(e["label"] for e in results if e["mode"] != "single" and not e.get("timeline")))
    precisions = [p for p in PRECISIONS if any(e["precision"] == p for e in results)]
    models = [m for m in MODEL_NAMES if any(e["model"] == m for e in results)]
    fig, axes = plt.subplots(1, len(precisions), figsize=(4.5 + 2.5 * len(models), 4.5) if len(precisions) == 1
                             else (11, 4.5), squeeze=False)
    width = 0.8 / len(labels)
    for ax, precision in zip(axes[0], precisions):
        by_key = {(e["model"], e["label"]): e for e in results if e["precision"] == precision}
        for k, label in enumerate(labels):
            xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(models))]
            entries = [by_key.get((m, label)) for m in models]
            heights = [e.get("efficiency", 0.0) if e else 0.0 for e in entries]
            # Error bars: the lowest and highest round's efficiency (none with one round).
            spreads = [(e or {}).get("efficiency_spread") for e in entries]
            errors = [[h - s["min"] if s else 0.0 for h, s in zip(heights, spreads)],
                      [s["max"] - h if s else 0.0 for h, s in zip(heights, spreads)]]
            ax.bar(xs, heights, width, label=label, yerr=errors, capsize=2)
            for x, e in zip(xs, entries):
                if e is not None and "efficiency" not in e:  # ran but failed, or no baseline
                    ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel("scaling efficiency at 2 processes")
        ax.set_title(precision)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Training throughput at 2 processes / (2 x one process)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(report, path):
    """Writes the report atomically (a reader never sees half a file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


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
                for v in rotated(selected_variants(args.modes, args.groupings, args.sparse, m), r)]
    if args.timeline:
        # Writing the trace costs rank 0 time, so it is a launch of its own
        # (once per model), kept out of the throughput comparison.
        launches += [(0, p, m, Variant("tfmpi", "graph", timeline=True)) for p in precisions for m in args.models]
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
        write_json(report, args.json)
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        plot_efficiency(report, args.plot)
        print(f"wrote {args.plot}", flush=True)


# ============================================================================= command line

def parse_args():
    """The command line of all three roles (driver, worker, plot-only)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    role = p.add_argument_group("role")
    role.add_argument("--driver", action="store_true", help="run all selected launches and report")
    role.add_argument("--mode", choices=MODES, help="worker role: train one configuration (what a launch runs)")
    sel = p.add_argument_group("what to run")
    sel.add_argument("--model", choices=MODEL_NAMES, default="mlp", help="worker: the model")
    sel.add_argument("--models", nargs="+", choices=MODEL_NAMES, default=MODEL_NAMES[:3],
                     help="driver: the models (tiny: per-step overhead, only when named)")
    sel.add_argument("--modes", nargs="+", choices=MODES, default=MODES, help="driver: the modes")
    sel.add_argument("--grouping", choices=GROUPING_NAMES, default="graph", help="worker, tfmpi: gradient grouping")
    sel.add_argument("--groupings", nargs="+", choices=GROUPING_NAMES, default=GROUPING_NAMES,
                     help="driver: the tfmpi groupings")
    sel.add_argument("--compression", choices=["none", "fp16"], default="none",
                     help="worker, tfmpi: gradients on the wire (fp16 halves the bytes; not bit-equal to float32)")
    sel.add_argument("--sparse", choices=SPARSE_NAMES + ["both"], default="dense",
                     help="tfmpi: how an Embedding's IndexedSlices gradient travels: densified and allreduced "
                          "(sparse_as_dense=True) or allgathered; 'both' (driver): also `tfmpi graph allgather`")
    sel.add_argument("--precision", choices=PRECISIONS + ["both"], default="float32",
                     help="Keras dtype policy ('both': driver only)")
    timing = p.add_argument_group("timing")
    timing.add_argument("--warmup", type=int, default=5, help="untimed steps first (tracing, broadcast)")
    timing.add_argument("--steps", type=int, default=None,
                        help="timed steps per repeat (default: per model, see bench_models.MODELS)")
    timing.add_argument("--repeats", type=int, default=8, help="timed windows; median and min/max over them")
    timing.add_argument("--inter-op-threads", type=int, default=1,
                        help="TensorFlow inter-op threads per process (0: TensorFlow's default)")
    timing.add_argument("--rounds", type=int, default=3,
                        help="driver: run every launch this many times (interleaved); report medians over rounds")
    timing.add_argument("--quick", action="store_true", help="driver smoke test: 3-step windows, 1 repeat")
    timing.add_argument("--launch-timeout", type=float, default=900, help="seconds before a launch is stopped")
    out = p.add_argument_group("output")
    out.add_argument("--json", help="driver: write all results here")
    out.add_argument("--plot", help="PNG of scaling efficiency (driver, or with --results)")
    out.add_argument("--results", help="without --driver: a saved --json file to --plot and/or print as --markdown")
    out.add_argument("--markdown", action="store_true", help="with --results: print the summary as a Markdown table")
    out.add_argument("--timeline", metavar="PATH",
                     help="driver: TF_MPI_TIMELINE for `tfmpi graph` launches (PATH.<model>.<precision>.json)")
    p.add_argument("--no-mwms-workaround", action="store_true",
                   help="run MWMS without patch_keras_for_multi_worker (shows Keras' own error)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if sum([args.driver, args.mode is not None, bool(args.results)]) != 1:
        p.error("give exactly one of --driver, --mode or --results (with --plot and/or --markdown)")
    if args.mode and args.sparse == "both":
        p.error("--sparse both is a driver option; a worker takes dense or allgather")
    if args.results and not (args.plot or args.markdown):
        p.error("--results needs --plot and/or --markdown")
    if args.warmup < 1 or args.repeats < 1 or (args.steps is not None and args.steps < 1):
        p.error("--warmup, --repeats and --steps must be >= 1")  # warm-up >= 1: the first step traces
    return args


def main():
    args = parse_args()
    if args.mode:
        run_worker(args)
    elif args.driver:
        run_driver(args)
    else:
        with open(args.results) as f:
            report = json.load(f)
        if args.markdown:
            print(format_markdown(report["summary"]))
        if args.plot:
            plot_efficiency(report, args.plot)
            print(f"wrote {args.plot}", flush=True)


if __name__ == "__main__":
    main()
