"""Reduction of one Embedding-like IndexedSlices gradient: sparse="dense" / "allgather" / "dedup" / "auto".

Per rank, ``--rows`` looked-up ids drawn uniformly from a ``--vocab`` x ``--width``
float32 table (the LSTM benchmark's Embedding: 64 x 100 ids of 20000 x 128), for
each ``--rows`` value given. Each mode is one tf.function that reduces the
gradient with tf_mpi.reducer.GradientReducer (what DistributedOptimizer runs) and
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
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=20000)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--rows", type=int, nargs="+", default=[640, 6400, 25600], help="looked-up ids per rank")
    p.add_argument("--modes", nargs="+", default=["dense", "allgather", "dedup", "auto"],
                   help="sparse= modes, plus 'local' (no exchange: this rank's own gradient, what one "
                        "process does) and 'dedup-densified' (dedup's IndexedSlices written into a dense table)")
    p.add_argument("--optimizer", choices=["none", "adam", "sgd"], default="none",
                   help="what follows the reduction: densify the result (none), or a Keras Adam / plain SGD "
                        "update of the table (what a training step does with it)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()

    import keras
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tf_mpi as hvd
    from tf_mpi import sparse
    from tf_mpi.basics import _core
    from tf_mpi.reducer import GradientReducer
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    table = keras.Variable(np.zeros([args.vocab, args.width], np.float32), name="table")
    row_bytes, index_bytes = args.width * 4, 8
    report = {"benchmark": "sparse_bench", "ranks": size, "optimizer": args.optimizer,
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
            for mode in args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]:
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
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
