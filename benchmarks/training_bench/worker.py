"""The worker role: trains one configuration in this process and prints ``RESULT {json}``
on the reporting process. TensorFlow is imported only inside these functions, after the
thread counts are fixed; the driver imports this module without it."""
import json
import os
import statistics
import time
from dataclasses import dataclass, field

from training_bench import BATCH_PER_PROCESS, LEARNING_RATE, RESULT_PREFIX
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
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(LEARNING_RATE), sparse=args.sparse,
                                         compression=getattr(hvd.Compression, args.compression),
                                         **grouping_options(args.grouping, model))
    compile_model(model, spec, optimizer)
    dataset = bench_models.synthetic_dataset(spec, BATCH_PER_PROCESS, seed=args.seed + hvd.rank())

    def plan_facts():
        from tf_mpi.sparse import measured_costs
        plan = optimizer.grouping_plan
        costs = measured_costs()  # measured only where sparse="auto" traced without a forced threshold
        return {"sparse_dedup_threshold": costs.dedup_threshold if costs else None,
                "groups": len(plan.groups) if plan else None,
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
