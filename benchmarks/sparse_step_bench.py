"""LSTM training steps with each sparse= mode, interleaved in one launch, against local training.

Under ``python -m tf_mpi.run -np N``, every rank trains the LSTM benchmark model
(benchmarks/bench_models.py: Embedding 20000 x 128, two LSTM(128), Adam, 64
samples per rank and step, one intra-op and one inter-op thread) once per
variant: ``local`` (plain Keras, no tf_mpi: every rank trains on its own, what
training_bench's ``pair`` runs, the ceiling) and ``DistributedOptimizer(Adam,
sparse=mode)`` for each ``--modes`` entry. Every variant has its own model and
optimizer, traced before timing. A round times ``--repeats`` windows of
``--steps`` ``train_on_batch`` steps of every variant, variants in a rotating
order; all ranks run the same variant at the same time. The load of a shared
machine changes within seconds: short windows, interleaved, put every variant
under the same load, and the ratio ``local / mode`` of step times within one
round (the share of the ceiling each mode reaches) is what is compared. The
table gives the median over rounds of each round's median window, per step,
and the ratio's median [quartiles] [lowest-highest round].

    python -m tf_mpi.run -np 2 python benchmarks/sparse_step_bench.py --rounds 40
    python -m tf_mpi.run -np 2 python benchmarks/sparse_step_bench.py --modes dense auto --json out.json
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import numpy as np

BATCH_PER_RANK = 64
LEARNING_RATE = 1e-3
THRESHOLD_ENV = "TF_MPI_SPARSE_DEDUP_THRESHOLD"


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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=["dense", "allgather", "dedup", "auto"],
                   help="sparse= modes; auto@X runs auto with TF_MPI_SPARSE_DEDUP_THRESHOLD=X "
                        "(auto@1e9: always dedup's exchange, dense result; auto@0: the Embedding's own allreduce)")
    p.add_argument("--steps", type=int, default=2, help="training steps per timed window")
    p.add_argument("--repeats", type=int, default=1, help="windows per variant and round")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--json")
    args = p.parse_args()

    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))
    sys.path.insert(0, here)
    import tf_mpi.keras as hvd
    from bench_models import MODELS
    from tf_mpi import sparse
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
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
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

    names = list(variants)
    per_round = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            per_round[name].append(statistics.median(window(variants[name]) for _ in range(args.repeats)))
    costs = sparse.measured_costs()
    report = {"benchmark": "sparse_step_bench", "model": "lstm", "ranks": hvd.size(),
              "batch_per_rank": BATCH_PER_RANK, "steps": args.steps, "repeats": args.repeats,
              "rounds": args.rounds, "auto_dedup_threshold": costs.dedup_threshold if costs else None,
              "step_seconds_per_round": per_round, "share_of_local": {}}
    for name in args.modes:
        ratios = [a / b for a, b in zip(per_round["local"], per_round[name])]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        report["share_of_local"][name] = {"median": statistics.median(ratios), "q1": quartiles[0],
                                          "q3": quartiles[2], "min": min(ratios), "max": max(ratios),
                                          "per_round": ratios}
    if rank == 0:
        print(f"\nLSTM, {hvd.size()} ranks, {BATCH_PER_RANK} samples per rank and step, {args.rounds} rounds; "
              f"auto's threshold {report['auto_dedup_threshold']}")
        print(f"  {'local':9s} {1e3 * statistics.median(per_round['local']):7.1f} ms/step")
        for name in args.modes:
            share = report["share_of_local"][name]
            print(f"  {name:9s} {1e3 * statistics.median(per_round[name]):7.1f} ms/step   local/mode "
                  f"{100 * share['median']:5.1f} % [quartiles {100 * share['q1']:.1f}-{100 * share['q3']:.1f}] "
                  f"[{100 * share['min']:.1f}-{100 * share['max']:.1f}]", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
