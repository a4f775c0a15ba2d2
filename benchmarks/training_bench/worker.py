"""The worker role: trains one configuration in this process and prints ``RESULT {json}``
on the reporting process. TensorFlow is imported only inside these functions, after the
thread counts are fixed; the driver imports this module without it."""
import json
import os
import statistics
import time
from dataclasses import dataclass, field

from training_bench import BATCH_PER_PROCESS, CALL_COST_MODE, LEARNING_RATE, RESULT_PREFIX
from training_bench.stats import summarize_windows


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


# Engine counters (tf_mpi._core.stats()) reported per timed step: what one step asks of the engine.
ENGINE_COUNTERS = ("requests", "negotiation_msgs_sent", "negotiation_msgs_received", "inline_batches",
                   "allreduce_buckets", "shm_allreduces", "payload_bytes_allreduce", "payload_bytes_allgather")


def make_engine_counter(warmup):
    """A Keras callback reading this rank's engine counters after the last warm-up step and at the
    end of training; per_step() gives their increase per timed step (collectives, negotiation
    messages and payload bytes per step, independent of the machine's speed)."""
    import keras
    from tf_mpi.basics import _core

    class EngineCounter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.first = self.last = None
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 == warmup:
                self.first = _core.stats()
            elif batch + 1 > warmup:
                self.steps += 1

        def on_train_end(self, logs=None):
            self.last = _core.stats()

        def per_step(self):
            if self.first is None or self.last is None or not self.steps:
                return None
            return {k: round((self.last[k] - self.first[k]) / self.steps, 3) for k in ENGINE_COUNTERS
                    if k in self.first}

    return EngineCounter()


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
        return {"groups": 1}
    if grouping == "per-tensor":
        return {"groups": [[v] for v in model.trainable_variables]}
    raise ValueError(f"unknown grouping {grouping!r}")


def sparse_mode(args, spec):
    """The --sparse of a worker: given, or the model's default (tf_mpi's own for *_user models, else dense)."""
    return args.sparse or ("default" if spec.user else "dense")


def setup_tfmpi(args, spec, tf, keras):
    """tf_mpi data parallelism: DistributedOptimizer + BroadcastGlobalVariablesCallback(0), one rank per process."""
    import bench_models
    import tf_mpi.keras as hvd
    hvd.init()
    model = spec.build()
    # sparse="dense" by default: Keras 3's Adam densifies an IndexedSlices gradient anyway,
    # and densifying 64x100 rows on each rank before a 10 MiB allreduce is cheaper than
    # densifying the 2x64x100 allgathered rows after it (docs/performance.md);
    # docs/sparse-gradients.md compares it with "dedup" and "auto".
    # The *_user models give DistributedOptimizer only what a new user would (sparse "default":
    # no sparse=; no compression, grouping graph: no arguments at all).
    sparse = sparse_mode(args, spec)
    options = dict(grouping_options(args.grouping, model))
    if sparse != "default":
        options["sparse"] = sparse
    if args.compression != "none":
        options["compression"] = getattr(hvd.Compression, args.compression)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(LEARNING_RATE), **options)
    compile_model(model, spec, optimizer)
    dataset = bench_models.synthetic_dataset(spec, BATCH_PER_PROCESS, seed=args.seed + hvd.rank())

    def plan_facts():
        try:
            from tf_mpi.policy.sparse import measured_costs
        except ImportError:  # a build from before tf_mpi/policy/ (elastic_cost.py --baseline compares builds)
            from tf_mpi.sparse import measured_costs
        plan = optimizer.grouping_plan
        costs = measured_costs()  # measured only where sparse="auto" traced without a forced threshold
        return {"sparse_dedup_threshold": costs.dedup_threshold if costs else None,
                "groups": len(plan.groups) if plan else None,
                "grouping_source": plan.source if plan else None,
                "group_bytes": [g.nbytes for g in plan.groups] if plan else None,
                "overlap": plan.cost_model.overlap if plan and plan.cost_model else None}

    counter = make_engine_counter(args.warmup_steps)

    def after_fit():
        return {**plan_facts(), "engine_per_step": counter.per_step()}

    env_seen = {k: os.environ.get(k) for k in ("TF_MPI_FUSION_THRESHOLD", "TF_MPI_TIMELINE", "TF_MPI_OVERLAP")}
    return Setup(model, dataset, [hvd.callbacks.BroadcastGlobalVariablesCallback(0), counter],
                 processes=hvd.size(),
                 reports=hvd.rank() == 0,
                 extra={"grouping": args.grouping, "sparse": sparse, "compression": args.compression,
                        "env": env_seen},
                 after_fit=after_fit)


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


def run_call_cost(args):
    """Worker role of --mode callcost (under mpirun -np 2): what one 1 KiB float32 allreduce adds to a
    tf.function call. Two tf.functions of the same 256-element input, one returning its allreduce
    (Sum), the other tf.identity of it: TensorFlow's own per-call cost. A third variant calls the
    tf.identity function and then a raw MPI_Allreduce of 1 KiB (mpi4py): what any synchronous
    collective costs in this loop, where each call waits for the slower rank's last call (the
    ranks' per-call jitter), whatever library runs it. Two more price TensorFlow's own dispatch of
    an asynchronous kernel (tf_mpi's ops are asynchronous, as Horovod's and TensorFlow's own
    collectives are): a tf.function returning a FIFOQueue's dequeue (an AsyncOpKernel that
    completes at once: an element waits), and that function followed by the raw MPI_Allreduce,
    the floor of any asynchronous collective op in this loop. Samples rotate through the five
    (each: a barrier, then CALLS back-to-back calls timed on every rank, the slowest rank's time),
    so all see the same machine; the result is the median of each, and the medians of the
    per-round differences, in microseconds per call."""
    import numpy as np
    tf = init_tensorflow_one_thread(args.inter_op_threads)
    import tf_mpi as hvd
    hvd.init()
    calls, samples = 200, max(5, args.repeats or 41)

    @tf.function
    def with_allreduce(x):
        return hvd.allreduce(x, op=hvd.Sum, name="callcost.1kib")

    @tf.function
    def without(x):
        return tf.identity(x)

    x = tf.ones([256], tf.float32)  # 1 KiB
    expected = np.full(256, hvd.size(), np.float32)
    if not np.array_equal(with_allreduce(x).numpy(), expected):
        raise RuntimeError("callcost: the allreduce gave wrong sums")
    from tf_mpi.basics import _core

    queue = tf.queue.FIFOQueue(capacity=calls, dtypes=[tf.float32], shapes=[[256]])
    filler = tf.ones([calls, 256], tf.float32)

    @tf.function
    def async_op(x):
        return queue.dequeue()

    def per_call_us(fn):
        if fn in (async_op, async_op_then_raw_mpi):
            queue.enqueue_many(filler)  # one element waiting for each call: the dequeue completes at once
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        local = np.array([(time.perf_counter() - start) / calls * 1e6])
        return float(_core.allreduce(local, hvd.Max, "callcost.slowest")[0])

    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    raw_in, raw_out = np.ones(256, np.float32), np.empty(256, np.float32)

    def without_then_raw_mpi(x):
        without(x)
        comm.Allreduce(raw_in, raw_out, op=MPI.SUM)

    def async_op_then_raw_mpi(x):
        async_op(x)
        comm.Allreduce(raw_in, raw_out, op=MPI.SUM)

    variants = (with_allreduce, without, without_then_raw_mpi, async_op, async_op_then_raw_mpi)
    for fn in variants:  # warm-up (tracing, caches)
        per_call_us(fn)
    rounds = [tuple(per_call_us(fn) for fn in variants) for _ in range(samples)]
    if not np.array_equal(raw_out, expected):
        raise RuntimeError("callcost: the raw MPI_Allreduce gave wrong sums")
    allreduce, identity, raw, queued, queued_raw = zip(*rounds)  # per variant, its samples

    def minus(xs, ys):
        return [x - y for x, y in zip(xs, ys)]

    cost = minus(allreduce, identity)
    result = {"mode": CALL_COST_MODE, "model": "allreduce_1kib", "precision": "float32", "processes": hvd.size(),
              "calls_per_sample": calls, "samples": samples,
              "allreduce_call_us": statistics.median(allreduce),
              "identity_call_us": statistics.median(identity),
              "cost_us": statistics.median(cost), "cost_us_min": min(cost), "cost_us_max": max(cost),
              # The same call followed by a raw MPI_Allreduce: the floor of any synchronous collective here.
              "raw_mpi_cost_us": statistics.median(minus(raw, identity)),
              "cost_over_raw_mpi_us": statistics.median(minus(allreduce, raw)),
              # TensorFlow's own asynchronous kernel (FIFOQueue dequeue) instead of tf.identity, and
              # with the raw MPI_Allreduce after it: the floor of any asynchronous collective op here.
              "async_op_cost_us": statistics.median(minus(queued, identity)),
              "async_raw_mpi_cost_us": statistics.median(minus(queued_raw, identity)),
              "cost_over_async_raw_mpi_us": statistics.median(minus(allreduce, queued_raw)),
              "engine_stats": {k: v for k, v in _core.stats().items() if k in ("inline_batches", "requests")},
              }
    result["samples_per_sec"] = 1e6 / result["allreduce_call_us"]  # calls/s, so the driver's tables have a rate
    result["samples_per_sec_min"] = result["samples_per_sec_max"] = result["samples_per_sec"]
    result["step_ms"] = result["allreduce_call_us"] / 1e3
    if hvd.rank() == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_adam_cost(args):
    """Worker role of --mode adamcost (one process, no tf_mpi): what Keras 3's Adam costs to update
    the LSTM's 20000x128 Embedding table from an IndexedSlices gradient of one rank's rows (64 x 100
    = 6,400, what one process sees), of two ranks' rows allgathered (12,800, what every rank sees
    with sparse="allgather"), and from a dense gradient (sparse="dense"). Medians of 5 x 20 updates
    inside a tf.function, in CPU milliseconds of the process (time.process_time) and wall ms."""
    import numpy as np
    tf = init_tensorflow_one_thread(args.inter_op_threads)
    import keras
    import bench_models
    rows, width = bench_models.LSTM_VOCAB, bench_models.LSTM_EMBEDDING
    table = keras.Variable(np.zeros((rows, width), np.float32))
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    optimizer.build([table])
    rng = np.random.default_rng(args.seed)
    per_rank = BATCH_PER_PROCESS * bench_models.LSTM_SEQ_LEN

    def slices(n):
        return tf.IndexedSlices(tf.constant(rng.random((n, width), dtype=np.float32)),
                                tf.constant(rng.integers(1, rows, n).astype(np.int32)), tf.constant([rows, width]))

    gradients = {"one_rank_rows": slices(per_rank), "two_ranks_rows": slices(2 * per_rank)}
    gradients["dense"] = tf.convert_to_tensor(gradients["one_rank_rows"])
    updates = {name: tf.function(lambda g: optimizer.apply([g], [table])) for name in gradients}
    for name, g in gradients.items():
        updates[name](g)  # traces
    samples = {name: [] for name in gradients}
    for _ in range(5):
        for name, g in gradients.items():
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(20):
                updates[name](g)
            samples[name].append(((time.process_time() - cpu) / 20 * 1e3, (time.perf_counter() - wall) / 20 * 1e3))
    result = {"mode": "adamcost", "rows_per_rank": per_rank, "table": [rows, width]}
    for name, pairs in samples.items():
        result[name + "_cpu_ms"] = statistics.median(c for c, _ in pairs)
        result[name + "_wall_ms"] = statistics.median(w for _, w in pairs)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(args):
    """Worker role: trains one configuration and prints RESULT {json} on the reporting process."""
    if args.mode == CALL_COST_MODE:
        return run_call_cost(args)
    if args.mode == "adamcost":
        return run_adam_cost(args)
    began = time.time()
    tf = init_tensorflow_one_thread(args.inter_op_threads)
    import keras
    import bench_models
    keras.mixed_precision.set_global_policy(args.precision)
    keras.utils.set_random_seed(args.seed)
    spec = bench_models.MODELS[args.model]
    steps = args.steps or spec.timed_steps
    warmup = args.warmup_steps = args.warmup or spec.warmup or 5
    repeats = args.repeats or spec.repeats or 8
    setup = MODE_SETUPS[args.mode](args, spec, tf, keras)
    clock = make_step_clock()
    total_steps = warmup + steps * repeats
    setup.model.fit(setup.dataset, steps_per_epoch=total_steps, epochs=1, verbose=0, shuffle=False,
                    callbacks=setup.callbacks + [clock])
    seconds = window_seconds(clock.stamps, warmup, steps, repeats)
    global_batch = BATCH_PER_PROCESS * setup.processes
    result = {"model": args.model, "precision": args.precision, "mode": args.mode,
              "grouping": args.grouping if args.mode == "tfmpi" else None,
              "processes": setup.processes, "batch_per_process": BATCH_PER_PROCESS, "global_batch": global_batch,
              "warmup": warmup, "steps": steps, "repeats": repeats,
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
