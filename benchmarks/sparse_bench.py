"""Reduction of one Embedding-like IndexedSlices gradient: sparse="dense" / "allgather" / "dedup" / "auto".

Per rank, ``--rows`` looked-up ids drawn uniformly from a ``--vocab`` x ``--width``
float32 table (the LSTM benchmark's Embedding: 64 x 100 ids of 20000 x 128), for
each ``--rows`` value given. Each mode is one tf.function that reduces the
gradient with tf_mpi.policy.reducer.GradientReducer (what DistributedOptimizer runs) and
then densifies the result (``--optimizer none``) or applies it to the table with
Keras' Adam or plain SGD (``--optimizer adam|sgd``: what the training step does
next; ``local`` applies this rank's own gradient, what one process does), timed
``--repeats`` times per round, modes interleaved, ``--rounds`` rounds; the table
gives the median over rounds of each round's median and [lowest-highest round],
the bytes each rank receives per step by the formulas of docs/sparse-gradients.md,
and which branch "auto" took (from the engine's count of allreduces).

    python -m tf_mpi.run -np 2 python benchmarks/sparse_bench.py --rows 640 6400 64000
    python -m tf_mpi.run -np 2 python benchmarks/sparse_bench.py --json out.json
    python -m tf_mpi.run -np 2 python benchmarks/sparse_bench.py --rows 6400 --optimizer adam \
        --modes local dense allgather dedup dedup-densified auto

``--train``: whole LSTM training steps with each sparse= mode, interleaved in one launch,
against local training. Every rank trains the LSTM benchmark model (benchmarks/bench_models.py:
Embedding 20000 x 128, two LSTM(128), Adam, 64 samples per rank and step, one intra-op and one
inter-op thread) once per variant: ``local`` (plain Keras, no tf_mpi: every rank trains on its
own, what training_bench's ``pair`` runs, the ceiling) and ``DistributedOptimizer(Adam,
sparse=mode)`` for each ``--modes`` entry (``auto@X``: auto with
TF_MPI_SPARSE_DEDUP_THRESHOLD=X; auto@1e9 forces its dedup branch, auto@0 its dense one). Every
variant has its own model and optimizer, traced before timing. A round times ``--repeats``
(default 1) windows of ``--steps`` (default 2) ``train_on_batch`` steps of every variant,
variants in a rotating order; all ranks run the same variant at the same time. The ratio
``local / mode`` of step times within one round (the share of the ceiling each mode reaches)
is what is compared: the median over ``--rounds`` (default 30) rounds, [quartiles] and
[lowest-highest round].

    python -m tf_mpi.run -np 2 python benchmarks/sparse_bench.py --train --rounds 30 \
        --modes dense allgather dedup auto auto@1e9 auto@0

Rounds, statistics and the ``--json`` record (with the machine): benchmarks/harness.py.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

BATCH_PER_RANK = 64  # --train
THRESHOLD_ENV = "TF_MPI_SPARSE_DEDUP_THRESHOLD"


def make_step(mode, name, table, args, tf, keras, GradientReducer):
    """(ids, values) -> a scalar: one mode's reduction of the gradient, then the --optimizer's use of it."""
    shape = tf.constant([args.vocab, args.width], tf.int64)
    reducer = None if mode == "local" else GradientReducer(name, sparse=mode.replace("-densified", ""))
    optimizer = {"none": None, "adam": keras.optimizers.Adam(1e-3), "sgd": keras.optimizers.SGD(1e-3)}[args.optimizer]
    if optimizer is not None:
        optimizer.build([table])

    def step(i, v):
        grad = tf.IndexedSlices(v, i, shape)
        if reducer is not None:
            grad = reducer.reduce([grad], [table])[0]
        if mode == "dedup-densified":
            grad = tf.scatter_nd(tf.cast(grad.indices, tf.int64)[:, None], grad.values, shape)
        if optimizer is None:
            return tf.convert_to_tensor(grad)[0, 0]
        optimizer.apply([grad], [table])
        return table[0, 0]
    return step


@contextlib.contextmanager
def forced_threshold(value):
    """TF_MPI_SPARSE_DEDUP_THRESHOLD=value inside the block ('' leaves it as it is)."""
    previous = os.environ.get(THRESHOLD_ENV)
    if value:
        os.environ[THRESHOLD_ENV] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(THRESHOLD_ENV, None)
        else:
            os.environ[THRESHOLD_ENV] = previous


def train_steps(args, record):
    """--train: LSTM training steps per sparse= mode against local training, interleaved."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    sys.path.insert(0, os.path.dirname(HERE))
    import tf_mpi.keras as hvd
    from bench_models import MODELS
    from tf_mpi.policy import sparse
    hvd.init()
    rank = hvd.rank()
    spec = MODELS["lstm"]
    x, y = spec.make_inputs(np.random.default_rng(rank), BATCH_PER_RANK * args.steps)
    batches = [(x[i * BATCH_PER_RANK:(i + 1) * BATCH_PER_RANK], y[i * BATCH_PER_RANK:(i + 1) * BATCH_PER_RANK])
               for i in range(args.steps)]

    variants = {}
    for name in ["local"] + args.modes:
        keras.utils.set_random_seed(0)
        model = spec.build()
        optimizer = keras.optimizers.Adam(1e-3)
        mode, _, threshold = name.partition("@")
        if name != "local":
            optimizer = hvd.DistributedOptimizer(optimizer, sparse=mode, name=f"step_bench.{name}")
        model.compile(optimizer=optimizer, loss=spec.loss, jit_compile=False)
        with forced_threshold(threshold):  # read while train_step is traced
            for xb, yb in batches[:2]:  # trace (and, for auto, measure the costs)
                model.train_on_batch(xb, yb)
        variants[name] = model

    def window(model):
        hvd.allreduce(tf.zeros([1]), name="step_bench.sync")  # start together
        start = time.perf_counter()
        for xb, yb in batches:
            model.train_on_batch(xb, yb)
        return (time.perf_counter() - start) / len(batches)

    per_round = harness.interleave(
        {name: (lambda model=model: statistics.median(window(model) for _ in range(args.repeats)))
         for name, model in variants.items()}, args.rounds)
    table = harness.compare(per_round, baseline="local")
    costs = sparse.measured_costs()
    report = {"model": "lstm", "ranks": hvd.size(), "batch_per_rank": BATCH_PER_RANK, "steps": args.steps,
              "repeats": args.repeats, "rounds": args.rounds,
              "auto_dedup_threshold": costs.dedup_threshold if costs else None,
              "step_seconds_per_round": per_round, "share_of_local": {}}
    for name in args.modes:
        # local / mode per round: 1 / (mode / local).
        ratios = [a / b for a, b in zip(per_round["local"], per_round[name])]
        report["share_of_local"][name] = dict(harness.summarize(ratios), per_round=ratios)
    if rank == 0:
        print(f"\nLSTM, {hvd.size()} ranks, {BATCH_PER_RANK} samples per rank and step, {args.rounds} rounds; "
              f"auto's threshold {report['auto_dedup_threshold']}")
        print(f"  {'local':9s} {1e3 * table['local']['median']:7.1f} ms/step")
        for name in args.modes:
            share = report["share_of_local"][name]
            print(f"  {name:9s} {1e3 * table[name]['median']:7.1f} ms/step   local/mode "
                  f"{100 * share['median']:5.1f} % [quartiles {100 * share['p25']:.1f}-{100 * share['p75']:.1f}] "
                  f"[{100 * share['min']:.1f}-{100 * share['max']:.1f}]", flush=True)
        if args.json:
            record.write(**report)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=20000)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--rows", type=int, nargs="+", default=[640, 6400, 25600], help="looked-up ids per rank")
    p.add_argument("--modes", nargs="+", default=["dense", "allgather", "dedup", "auto"],
                   help="sparse= modes, plus 'local' (no exchange: this rank's own gradient, what one "
                        "process does) and 'dedup-densified' (dedup's IndexedSlices written into a dense table); "
                        "with --train: sparse= modes and auto@X (auto with TF_MPI_SPARSE_DEDUP_THRESHOLD=X)")
    p.add_argument("--optimizer", choices=["none", "adam", "sgd"], default="none",
                   help="what follows the reduction: densify the result (none), or a Keras Adam / plain SGD "
                        "update of the table (what a training step does with it)")
    p.add_argument("--repeats", type=int, default=None, help="calls (--train: windows) per mode and round "
                   "(default 10; --train: 1)")
    p.add_argument("--rounds", type=int, default=None, help="default 5; --train: 30")
    p.add_argument("--train", action="store_true", help="time LSTM training steps per mode against local "
                   "training instead (modes: sparse= modes and auto@THRESHOLD)")
    p.add_argument("--steps", type=int, default=2, help="--train: training steps per timed window")
    p.add_argument("--json")
    args = p.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.train else 10
    if args.rounds is None:
        args.rounds = 30 if args.train else 5
    record = harness.Record("sparse_bench", path=args.json)
    if args.train:
        return train_steps(args, record)

    import keras
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tf_mpi as hvd
    from tf_mpi.policy import sparse
    from tf_mpi.basics import _core
    from tf_mpi.policy.reducer import GradientReducer
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    table = keras.Variable(np.zeros([args.vocab, args.width], np.float32), name="table")
    row_bytes, index_bytes = args.width * 4, 8
    report = {"ranks": size, "optimizer": args.optimizer,
              "vocab": args.vocab, "width": args.width,
              "repeats": args.repeats, "rounds": args.rounds, "cases": []}
    for n in args.rows:
        rng = np.random.default_rng(rank)
        ids = tf.constant(rng.integers(0, args.vocab, n), tf.int64)
        values = tf.constant(rng.standard_normal((n, args.width)), tf.float32)
        unique = len(np.unique(ids.numpy()))
        uniques = _core.allgather(np.array([unique], np.int64), f"bench.unique.{n}")
        total = int(uniques.sum())
        steps = {}
        for mode in args.modes:
            steps[mode] = tf.function(make_step(mode, f"bench.{mode}.{n}", table, args, tf, keras,
                                                GradientReducer))
            steps[mode](ids, values)  # trace (and, for auto, measure the costs)
        samples = {mode: [] for mode in args.modes}
        branch = None
        for r in range(args.rounds):
            for mode in harness.rotation(args.modes, r):
                before = _core.stats()["allreduce_buckets"]
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    steps[mode](ids, values).numpy()
                    times.append(time.perf_counter() - start)
                if mode == "auto":
                    branch = "dense" if _core.stats()["allreduce_buckets"] > before else "dedup"
                samples[mode].append(statistics.median(times))
        others = (size - 1) / size
        received = {"local": 0, "dedup-densified": (total - unique) * (row_bytes + index_bytes),
                    "dense": 2 * others * args.vocab * row_bytes,  # ring allreduce: reduce-scatter + allgather
                    "allgather": (size - 1) * n * (row_bytes + index_bytes),
                    "dedup": (total - unique) * (row_bytes + index_bytes)}
        received["auto"] = received[branch] if branch else None
        costs = sparse.measured_costs()
        case = {"rows_per_rank": n, "unique_rows_this_rank": unique, "gathered_unique_rows": total,
                "touched_share": total / args.vocab, "auto_branch": branch,
                "dedup_threshold": costs.dedup_threshold if costs else None, "modes": {}}
        for mode in args.modes:
            ms = [1e3 * s for s in samples[mode]]
            case["modes"][mode] = {"ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                                   "received_bytes_per_rank": received.get(mode)}
        report["cases"].append(case)
        if rank == 0:
            print(f"\n{n} ids per rank, {unique} unique on rank 0, T = {total} gathered unique rows "
                  f"(T/V = {total / args.vocab:.2f}); auto threshold {case['dedup_threshold']}, took {branch}")
            for mode in args.modes:
                m = case["modes"][mode]
                mib = m["received_bytes_per_rank"]
                mib = "?" if mib is None else f"{mib / 2**20:.2f}"
                print(f"  {mode:9s} {m['ms']:7.2f} ms [{m['ms_min']:.2f}-{m['ms_max']:.2f}]  "
                      f"received per rank {mib} MiB", flush=True)
    if rank == 0 and args.json:
        record.write(**report)


if __name__ == "__main__":
    main()
