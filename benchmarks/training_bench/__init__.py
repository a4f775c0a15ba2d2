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
             one         groups=1 (all dense gradients in one fused allreduce),
             per-tensor  one group per variable and TF_MPI_FUSION_THRESHOLD=0
                         (the engine fuses nothing: one MPI allreduce per tensor),
           and an Embedding's sparse gradient densified before its allreduce
           (sparse="dense"; --sparse both adds `tfmpi graph allgather`,
           where it is allgathered as tf.IndexedSlices instead; --sparse dense
           dedup auto adds `tfmpi graph dedup` and `tfmpi graph auto`, see
           docs/sparse-gradients.md). --shm-off adds `tfmpi graph shm=0`, the
           same launch with TF_MPI_SHM=0 (the engine's MPI path instead of
           the shared-memory allreduce), and a timeline launch for it.
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

    # Shared memory on (the default) against TF_MPI_SHM=0 in the same run, with both exposed tails:
    python benchmarks/training_bench.py --driver --modes single pair tfmpi --groupings graph --shm-off \
        --rounds 5 --timeline /tmp/trace.json

    # A new user's defaults (lstm_user, mlp_user: every DistributedOptimizer default, the
    # Embedding gradient allgathered) and the 1 KiB allreduce's cost per tf.function call
    # (a `callcost` launch per round; ~6 minutes on a quiet machine):
    python benchmarks/training_bench.py --driver --models lstm_user mlp_user --modes single tfmpi \
        --groupings graph --call-cost --rounds 3 --json user.json

    # Plot a saved result file again, or print it as the Markdown table of docs/performance.md:
    python benchmarks/training_bench.py --plot train.png --results train.json
    python benchmarks/training_bench.py --markdown --results train.json

One launch by hand (what the driver runs; the reporting process prints ``RESULT {json}``;
``--mode adamcost`` is one process timing Keras' Adam update of the LSTM's Embedding from one
rank's rows, two ranks' allgathered rows and a dense gradient)::

    python benchmarks/training_bench.py --mode single --model mlp
    python -m tf_mpi.run -np 2 python benchmarks/training_bench.py --mode tfmpi --grouping one --model mlp
    TF_MPI_FUSION_THRESHOLD=0 python -m tf_mpi.run -np 2 python benchmarks/training_bench.py \\
        --mode tfmpi --grouping per-tensor --model mlp
    python -m tf_mpi.run -np 2 python benchmarks/training_bench.py --mode tfmpi --model lstm --compression fp16
    python -m tf_mpi.run -np 2 python benchmarks/training_bench.py --mode callcost
    python benchmarks/training_bench.py --mode adamcost
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

The code is the package benchmarks/training_bench/; ``benchmarks/training_bench.py`` is its
command line (``python -m training_bench`` from benchmarks/ is the same):

  __main__.py  the command line of the three roles (driver, worker, --results)
  worker.py    the worker role: one configuration trained in this process, RESULT {json}
  driver.py    the driver role: launches (processes, environments, timeouts), rounds, the JSON file
  stats.py     windows, efficiencies, medians and spreads over rounds
  report.py    the text and Markdown tables, progress lines
  plot.py      the efficiency figure
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
REPO_ROOT = os.path.dirname(BENCHMARKS)
# example_utils (write_json_atomic) is shared with the examples; it imports no TensorFlow.
EXAMPLES = os.path.join(REPO_ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.append(EXAMPLES)
# What every launch runs (the worker role): the same command line as by hand.
SCRIPT = os.path.join(BENCHMARKS, "training_bench.py")

BATCH_PER_PROCESS = 64
DISTRIBUTED_PROCESSES = 2
LEARNING_RATE = 1e-3
PRECISIONS = ["float32", "mixed_float16"]
MODES = ["single", "pair", "tfmpi", "mwms"]
# Not a training mode: the 1 KiB allreduce's cost per tf.function call (driver: --call-cost).
CALL_COST_MODE = "callcost"
GROUPING_NAMES = ["graph", "one", "per-tensor"]
MODEL_NAMES = ["lstm", "mlp", "cnn", "tiny", "lstm_user", "mlp_user"]  # = bench_models.MODELS; kept here so the
# driver need not import TF. The *_user models are trained with every tf_mpi default (ModelSpec.user).
USER_MODELS = ["lstm_user", "mlp_user"]
# Models with an IndexedSlices gradient (an Embedding's), for which tf_mpi can
# densify it before an allreduce (the default here) or allgather it.
SPARSE_GRADIENT_MODELS = ["lstm", "lstm_user"]
# How an IndexedSlices gradient travels: DistributedOptimizer(sparse=...) (tf_mpi.policy.sparse);
# "default" passes no sparse= (tf_mpi.policy.sparse.DEFAULT_MODE), what the *_user models get.
SPARSE_NAMES = ["dense", "allgather", "dedup", "auto", "default"]
RESULT_PREFIX = "RESULT "
