"""Synthetic throughput benchmark of a stacked-LSTM text classifier, data-parallel over MPI with tf_mpi.

The model is the text classifier of examples/imdb_lstm.py at benchmark size:
Embedding(20000 x 128) -> LSTM(128) -> LSTM(128) -> Dense(1, sigmoid),
sequences of 100 tokens, 64 sequences per rank and step, Adam, trained with
``model.fit`` and tf_mpi.keras.DistributedOptimizer on random tokens (the
numbers, not the accuracy, are the point). Model, data and step timing are
those of the training benchmark (benchmarks/bench_models.py,
benchmarks/training_bench/), which this script imports from the checkout. For each combination of
--precision and --compression it runs --warmup steps (tracing, first
broadcast; not timed), then --steps timed steps, and reports samples per
second per rank and over all ranks.

Run (from the repository root; ``python -m tf_mpi.run -np N`` is ``mpirun -np N``
with the right mpirun and flags):

    # One combination (float32, no compression):
    python -m tf_mpi.run -np 2 python examples/benchmark_lstm.py

    # All four combinations (float32 / mixed_float16 x none / fp16) in one launch:
    python -m tf_mpi.run -np 2 python examples/benchmark_lstm.py --all --json np2.json

    # Scaling efficiency: a 1-rank baseline, then N ranks against it
    # (efficiency = total_N / (N * total_1), per combination):
    python -m tf_mpi.run -np 1 python examples/benchmark_lstm.py --all --json np1.json
    python -m tf_mpi.run -np 2 python examples/benchmark_lstm.py --all --json np2.json --baseline np1.json

    # Throughput against the number of ranks, from result files (no training):
    python examples/benchmark_lstm.py --plot scaling.png --results np1.json np2.json

Output: a table on rank 0, and one line ``RESULT {...json...}`` (the same
object --json writes). Throughput on CPUs shared with other work is only
indicative; the ranks time the same steps (each step waits for all ranks'
gradients), so the per-rank numbers differ only by clock skew.
"""
import time

START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
from example_utils import import_tensorflow_quietly  # noqa: E402

tf = import_tensorflow_quietly()

# One compute thread per rank: with N ranks on a machine, N threads keep the
# cores busy; more would compete for them. (Set BENCHMARK_LSTM_THREADS when a
# rank has several cores to itself.)
THREADS = int(os.environ.get("BENCHMARK_LSTM_THREADS", "1"))
tf.config.threading.set_intra_op_parallelism_threads(THREADS)

import keras  # noqa: E402

import tf_mpi.keras as hvd  # noqa: E402
from tf_mpi.functions import allgather_object  # noqa: E402

from example_utils import lstm_text_classifier, new_figure, rank_logger, save_figure, write_json_atomic  # noqa: E402

# The training benchmark's data and step clock (benchmarks/ of this checkout).
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_models import lstm_inputs  # noqa: E402
from training_bench.worker import make_step_clock, window_seconds  # noqa: E402

PRECISIONS = ["float32", "mixed_float16"]
COMPRESSIONS = ["none", "fp16"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--precision", choices=PRECISIONS, default="float32")
    p.add_argument("--compression", choices=COMPRESSIONS, default="none", help="gradient compression on the wire")
    p.add_argument("--all", action="store_true",
                   help="run all four precision x compression combinations (ignores --precision, --compression)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per combination")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones (tracing etc.)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step, per rank")
    p.add_argument("--seq-len", type=int, default=100, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=20000, help="embedding rows")
    p.add_argument("--embedding-dim", type=int, default=128)
    p.add_argument("--units", type=int, default=128, help="units of each of the two LSTM layers")
    p.add_argument("--sparse-as-dense", action="store_true",
                   help="reduce the embedding gradient densely (allreduce) instead of allgathering its rows")
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    p.add_argument("--baseline", default=None,
                   help="--json file of a 1-rank run of this script: adds the scaling efficiency")
    p.add_argument("--plot", default=None,
                   help="rank 0 writes a PNG of throughput against the number of ranks: of the --results files "
                        "if given (then nothing is run), else of this run (and --baseline)")
    p.add_argument("--results", nargs="+", default=None, metavar="JSON",
                   help="--json files of runs on different numbers of ranks, for --plot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="every rank prints (default: rank 0 only)")
    args = p.parse_args()
    if args.results and not args.plot:
        p.error("--results needs --plot")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


# ----------------------------------------------------------------------------- model

def build_model(args, compression, name):
    model = lstm_text_classifier(args.seq_len, args.vocab, args.embedding_dim, args.units, name="benchmark_lstm")
    # Under mixed_float16 this is a LossScaleOptimizer that reduces before its finiteness check.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3), compression=compression,
                                   sparse_as_dense=args.sparse_as_dense, name=name)
    # jit_compile=False: tf_mpi's collectives cannot run inside XLA.
    model.compile(optimizer=opt, loss="binary_crossentropy", jit_compile=False)
    return model


def run_combination(args, precision, compression):
    """Trains warmup + steps steps; returns this rank's {samples_per_sec, step_ms, seconds}."""
    began = time.time()
    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(args.seed + hvd.rank())
    comp = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
    # A name per combination: each gets its own collectives.
    model = build_model(args, comp, name=f"benchmark_lstm.{precision}.{compression}")
    total = args.warmup + args.steps
    rng = np.random.default_rng(args.seed * 1000003 + hvd.rank())
    x, y = lstm_inputs(rng, total * args.batch_size, vocab=args.vocab, seq_len=args.seq_len)
    clock = make_step_clock()
    model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), clock])
    # From the end of the last warm-up step (or the start of training) to the end of the last step.
    (seconds,) = window_seconds(clock.stamps, args.warmup, args.steps, repeats=1)
    keras.mixed_precision.set_global_policy("float32")
    return {"samples_per_sec": args.steps * args.batch_size / seconds, "step_ms": 1000 * seconds / args.steps,
            "seconds": time.time() - began}


# ----------------------------------------------------------------------------- reporting

def load_json(path):
    with open(path) as f:
        return json.load(f)


def key_of(entry):
    return entry["precision"], entry["compression"]


def add_efficiency(report, baseline):
    """efficiency = total_N / (N * total_1) for the combinations the 1-rank baseline has."""
    if baseline.get("ranks") != 1:
        print(f"benchmark_lstm: warning: the baseline ran on {baseline.get('ranks')} ranks, not 1", flush=True)
    for k in ("batch_size", "seq_len", "vocab", "embedding_dim", "units", "sparse_as_dense"):
        if baseline.get(k) != report.get(k):
            print(f"benchmark_lstm: warning: the baseline has {k}={baseline.get(k)}, this run {report.get(k)}",
                  flush=True)
    base = {key_of(e): e["samples_per_sec_total"] for e in baseline["results"]}
    for entry in report["results"]:
        b = base.get(key_of(entry))
        entry["efficiency"] = None if b is None else entry["samples_per_sec_total"] / (report["ranks"] * b)


def format_table(report):
    lines = [f"benchmark_lstm: {report['ranks']} ranks, batch {report['batch_size']} per rank, "
             f"sequence length {report['seq_len']}, {report['steps']} timed steps after {report['warmup']} warm-up",
             f"{'precision':<15}{'compression':<13}{'samples/s/rank':>15}{'samples/s total':>17}"
             f"{'step ms':>10}{'efficiency':>12}"]
    for e in report["results"]:
        eff = e.get("efficiency")
        lines.append(f"{e['precision']:<15}{e['compression']:<13}{e['samples_per_sec_per_rank']:>15.1f}"
                     f"{e['samples_per_sec_total']:>17.1f}{e['step_ms']:>10.1f}"
                     f"{'' if eff is None else format(eff, '.1%'):>12}")
    return "\n".join(lines)


def plot_scaling(reports, path):
    """Total throughput (left) and scaling efficiency (right) against ranks, one line per combination."""
    series = {}
    for report in reports:
        for e in report["results"]:
            series.setdefault(key_of(e), {})[report["ranks"]] = e["samples_per_sec_total"]
    fig, axes = new_figure(2, (11, 4))
    for (precision, compression), points in sorted(series.items()):
        ranks = sorted(points)
        totals = [points[n] for n in ranks]
        line, = axes[0].plot(ranks, totals, "o-", label=f"{precision}, {compression}")
        # Ideal: linear from the fewest ranks measured.
        n0, t0 = ranks[0], totals[0]
        axes[0].plot(ranks, [t0 * n / n0 for n in ranks], ":", color=line.get_color(), alpha=0.6)
        axes[1].plot(ranks, [t / (n * t0 / n0) for n, t in zip(ranks, totals)], "o-", color=line.get_color(),
                     label=f"{precision}, {compression}")
    axes[0].set_ylabel("samples/s, all ranks (dotted: linear)")
    axes[1].set_ylabel("efficiency vs. fewest ranks")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    save_figure(fig, axes, path, "LSTM text classifier throughput (synthetic data)", "ranks", legend_fontsize=8)


# ----------------------------------------------------------------------------- main

def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    log = rank_logger(rank, args.verbose)

    if args.results:  # plot only
        if rank == 0:
            plot_scaling([load_json(p) for p in args.results], args.plot)
            log(f"wrote {args.plot}")
        return

    combos = ([(p, c) for p in PRECISIONS for c in COMPRESSIONS] if args.all
              else [(args.precision, args.compression)])
    results = []
    for precision, compression in combos:
        mine = run_combination(args, precision, compression)
        per_rank = allgather_object(mine, name=f"benchmark_lstm.gather.{precision}.{compression}")
        rates = [r["samples_per_sec"] for r in per_rank]
        entry = {"precision": precision, "compression": compression,
                 "samples_per_sec_per_rank": float(np.mean(rates)), "samples_per_sec_total": float(np.sum(rates)),
                 "per_rank": [round(r, 2) for r in rates],
                 "step_ms": float(np.mean([r["step_ms"] for r in per_rank])),
                 "seconds": round(max(r["seconds"] for r in per_rank), 1)}
        results.append(entry)
        if args.verbose:
            log(f"{precision}/{compression}: {mine['samples_per_sec']:.1f} samples/s on this rank")
        log(f"{precision}/{compression}: {entry['samples_per_sec_total']:.1f} samples/s in all "
            f"({entry['samples_per_sec_per_rank']:.1f} per rank, {entry['step_ms']:.0f} ms per step, "
            f"{entry['seconds']:.0f} s with warm-up)")

    if rank == 0:
        report = {"example": "benchmark_lstm", "ranks": size, "batch_size": args.batch_size,
                  "seq_len": args.seq_len, "vocab": args.vocab, "embedding_dim": args.embedding_dim,
                  "units": args.units, "steps": args.steps, "warmup": args.warmup, "threads_per_rank": THREADS,
                  "sparse_as_dense": args.sparse_as_dense, "results": results,
                  "seconds": round(time.time() - START, 1)}
        baseline = load_json(args.baseline) if args.baseline else None
        if baseline:
            add_efficiency(report, baseline)
        print(format_table(report), flush=True)
        if args.json:
            write_json_atomic(args.json, report, indent=1)
            log(f"wrote {args.json}")
        if args.plot:
            plot_scaling(([baseline] if baseline and baseline["ranks"] != size else []) + [report], args.plot)
            log(f"wrote {args.plot}")
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
