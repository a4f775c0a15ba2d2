"""Checks tf_mpi.predict against what one machine can measure, in one run.

    python benchmarks/scaling_check.py [--nps 2 3 4] [--json out.json]

1. Measures, for each number of ranks in --nps (one mpirun launch each, real ranks):
   the grouping plan's probe (tf_mpi.grouping.measure_cost_model: alpha, beta, overlap),
   single allreduces of 4 KiB - 16 MiB through the engine (numpy, no TensorFlow), and the
   ResNet-50 gradient storm (214 ``hvd.allreduce`` ops in one tf.function, as in
   benchmarks/allreduce_bench.py, whose helpers this script uses).
2. Measures the LSTM training step (benchmarks/training_bench.py's lstm model: the
   examples' Embedding-LSTM-LSTM-Dense classifier, 64 samples per rank, densified
   embedding gradient): one process alone, then ``tfmpi`` at every np.
3. Predicts all of it with tf_mpi.predict from the probe of the smallest np only (its
   alpha and beta become the link; its overlap the plan's) and the single-process step
   time, and prints prediction, measurement and relative error per case.

Two predictions per case: "free cores" (every rank has a core of its own) and "shared
cores" (``Cluster.cores_per_node`` = this machine's cores: with more ranks than cores,
computation and the CPU work of communication are slowed by ranks / cores). Only the
second is meant for np > cores; where the two agree, the machine has a core per rank.

Every launch runs --rounds times, round by round, each round starting at another np. A
launch's figure is the median over its samples of the slowest rank (allreduces) or over its
timed windows (training); the table gives the median of the rounds' figures with the
[lowest-highest] round, and the fastest sample of any round. The link comes from the median
of the rounds' probes. On a machine shared with other work every figure moves with the load:
run it on a quiet machine for the model's own error.
"""
import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
for path in (REPO_ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import harness  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
LAUNCH_TIMEOUT_S = 900


# ----------------------------------------------------------------------------- worker (every rank)


def worker(args):
    """Under mpirun: the probe, the allreduce sizes and the gradient storm; rank 0 prints RESULT {json}."""
    import allreduce_bench as bench  # fixes TF's thread counts, imports mpi4py and tf_mpi
    import numpy as np
    import tensorflow as tf
    from tf_mpi import grouping
    from tf_mpi.basics import _core

    hvd = bench.hvd
    hvd.init()
    size = float(hvd.size())
    cost_model = grouping.measure_cost_model()
    result = {"ranks": hvd.size(), "probe": dict(alpha=cost_model.alpha, beta=cost_model.beta,
                                                  overlap=cost_model.overlap), "sizes": {}}
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        name = f"scaling_check.{nbytes}"

        def call(x=x, name=name):
            return [_core.allreduce(x, hvd.Sum, name)]
        k = bench.calls_per_sample(call)
        timed = bench.time_interleaved({"engine": (call, size)}, args.repeats, k, f"{nbytes} B allreduce")
        result["sizes"][str(nbytes)] = timed["engine"]
    with open(bench.SHAPES_FILE) as f:
        shapes = [list(s) for s in json.load(f)["shapes"]]
    storm = bench.make_ours([tf.ones(s, tf.float32) for s in shapes], "scaling_check.storm")
    k = bench.calls_per_sample(storm)
    result["storm"] = bench.time_interleaved({"storm": (storm, size)}, max(5, args.repeats // 2), k,
                                             "gradient storm")["storm"]
    if hvd.rank() == 0:
        harness.emit(result)


# ----------------------------------------------------------------------------- driver


def run_launch(np_, program, label):
    """Runs one launch (its own processes): on np_ ranks through harness.launch, or one plain
    process when np_ is None; returns the JSON of its one RESULT line."""
    began = time.time()
    if np_ is not None:
        try:
            result = harness.launch(np_, program, timeout=LAUNCH_TIMEOUT_S)[0]
        except harness.LaunchError as e:
            raise SystemExit(f"{label}: {e}")
    else:
        rc, output, _, timed_out = harness.run_bounded([sys.executable] + program, LAUNCH_TIMEOUT_S,
                                                       harness.launch_env())
        lines = [line for line in output.splitlines() if line.startswith(harness.RESULT_PREFIX)]
        if rc != 0 or timed_out or len(lines) != 1:
            sys.stderr.write(output[-3000:])
            raise SystemExit(f"{label}: launch failed (exit {rc}, {len(lines)} RESULT lines)")
        result = json.loads(lines[0][len(harness.RESULT_PREFIX):])
    print(f"  {label}: {time.time() - began:.0f} s", flush=True)
    return result


def lstm_args(mode, args):
    return [os.path.join(HERE, "training_bench.py"), "--mode", mode, "--model", "lstm", "--warmup",
            str(args.lstm_warmup), "--steps", str(args.lstm_steps), "--repeats", str(args.lstm_repeats)]


def spread(stats, scale):
    return f"{stats['median_s'] * scale:.3g} [{stats['p25_s'] * scale:.3g}-{stats['p75_s'] * scale:.3g}]"


def relative_error(predicted, measured):
    return (predicted - measured) / measured


def predictions(measured, lstm, args):
    """[(case, np, predicted free cores, predicted shared cores, measured stats, unit)] and the link."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tf_mpi import grouping, predict
    from training_bench.worker import init_tensorflow_one_thread
    init_tensorflow_one_thread(1)
    import bench_models

    base = min(args.nps)
    probe = measured[base]["probe"]
    cost_model = grouping.CostModel(probe["alpha"], probe["beta"], probe["overlap"])
    link = predict.link_from_probe(cost_model, base)
    storm_sizes = predict.Workload.from_json(os.path.join(HERE, "data", "resnet50_grad_shapes.json"), step_s=1.0).sizes
    work = predict.Workload.from_keras_model(bench_models.build_lstm(), step_s=lstm["single"]["median_s"])
    cores = os.cpu_count() or 1
    rows = []
    for p in args.nps:
        free = predict.Cluster(1, p, link, link)
        shared = predict.Cluster(1, p, link, link, cores_per_node=cores)
        for nbytes in SIZES:
            rows.append((f"allreduce {nbytes // KiB} KiB" if nbytes < MiB else f"allreduce {nbytes // MiB} MiB", p,
                         predict.group_time([nbytes], free, False), predict.group_time([nbytes], shared, False),
                         measured[p]["sizes"][str(nbytes)], "ms"))
        rows.append(("ResNet-50 storm", p, predict.group_time(storm_sizes, free, False),
                     predict.group_time(storm_sizes, shared, False), measured[p]["storm"], "ms"))
        steps = [predict.predict_step(work, c, False, overlap=probe["overlap"]).step_s for c in (free, shared)]
        rows.append(("LSTM training step", p, steps[0], steps[1], lstm[p], "ms"))
    return rows, link, work


def step_stats(result):
    """Per-step stats (seconds) of a training_bench RESULT: median, quartiles and extremes over its windows."""
    import numpy as np
    per_step = [s / result["steps"] for s in result["window_seconds"]]
    p25, p50, p75 = (float(x) for x in np.percentile(per_step, [25, 50, 75]))
    return dict(median_s=p50, p25_s=p25, p75_s=p75, min_s=min(per_step), max_s=max(per_step))


def across_rounds(stats):
    """One stats dict from one per round: the median of the rounds' medians, [p25-p75] becomes the
    [lowest-highest] round median, min the fastest sample of any round."""
    import statistics
    medians = [s["median_s"] for s in stats]
    return dict(median_s=statistics.median(medians), p25_s=min(medians), p75_s=max(medians),
                min_s=min(s["min_s"] for s in stats), max_s=max(s["max_s"] for s in stats), rounds=len(stats))


def combine_rounds(rounds, nps):
    """(measured, lstm) over all rounds: probes by their median alpha, beta and overlap."""
    import statistics
    measured = {}
    for p in nps:
        runs = [r["measured"][p] for r in rounds]
        measured[p] = dict(
            probe={k: statistics.median(run["probe"][k] for run in runs) for k in ("alpha", "beta", "overlap")},
            sizes={n: across_rounds([run["sizes"][n] for run in runs]) for n in runs[0]["sizes"]},
            storm=across_rounds([run["storm"] for run in runs]))
    lstm = {key: across_rounds([step_stats(r["lstm"][key]) for r in rounds]) for key in ["single", *nps]}
    return measured, lstm


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help="(internal) the per-rank role")
    parser.add_argument("--nps", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rounds", type=int, default=2,
                        help="every launch this many times, round by round, each round starting at another np")
    parser.add_argument("--repeats", type=int, default=10, help="samples per allreduce size (storm: half)")
    parser.add_argument("--lstm-warmup", type=int, default=2)
    parser.add_argument("--lstm-steps", type=int, default=3)
    parser.add_argument("--lstm-repeats", type=int, default=4)
    parser.add_argument("--json", default=None, help="write measurements and predictions to this file")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if min(args.nps) < 2:
        parser.error("--nps: the probe needs 2 or more ranks")

    record = harness.Record("scaling_check", path=args.json)
    began = time.time()
    print(f"tf_mpi.predict against measurements: {platform.node()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f} at start", flush=True)
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}", flush=True)
    rounds = []
    for r in range(args.rounds):
        order = harness.rotation(args.nps, r)  # each round starts elsewhere
        measured = {p: run_launch(p, [os.path.abspath(__file__), "--worker", "--repeats", str(args.repeats)],
                                  f"round {r + 1}: np={p} probe + allreduces + storm") for p in order}
        lstm = {"single": run_launch(None, lstm_args("single", args), f"round {r + 1}: LSTM single process")}
        for p in order:
            lstm[p] = run_launch(p, lstm_args("tfmpi", args), f"round {r + 1}: LSTM tfmpi np={p}")
        rounds.append(dict(measured=measured, lstm=lstm))
    measured, lstm = combine_rounds(rounds, args.nps)
    load_end = os.getloadavg()[0]
    rows, link, work = predictions(measured, lstm, args)

    print(f"\nprobe (tf_mpi.grouping.measure_cost_model) per np: allreduce alpha + beta * bytes, overlap")
    for p in args.nps:
        probe = measured[p]["probe"]
        print(f"  np={p}: alpha {probe['alpha'] * 1e6:8.1f} us   beta {probe['beta'] * 1e9:.3f} ns/B "
              f"({1 / probe['beta'] / 1e9:.2f} GB/s)   overlap {probe['overlap']:.2f}")
    print(f"link for the model (from np={min(args.nps)}'s probe): {link}")
    print(f"LSTM: {len(work.sizes)} gradients, {work.total_bytes / MiB:.2f} MiB; single-process step "
          f"{spread(lstm['single'], 1e3)} ms (measured, the model's input)")
    print("\nmeasured: median of the rounds' medians [lowest-highest round], and the fastest sample of any round.\n"
          "error = (predicted - measured) / measured, against the median and, since the probe keeps its fastest\n"
          "samples, against the fastest")
    print(f"\n{'case':<20} {'np':>3} | {'pred. free cores':>16} {'error':>7} | {'pred. shared cores':>18} "
          f"{'error':>7} {'vs min':>7} | {'measured median [rounds]':>27} {'min':>9}")
    for case, p, free, shared, stats, unit in rows:
        meas, fastest = stats["median_s"], stats["min_s"]
        print(f"{case:<20} {p:>3} | {free * 1e3:>13.3g} ms {relative_error(free, meas):>+7.0%} | "
              f"{shared * 1e3:>15.3g} ms {relative_error(shared, meas):>+7.0%} "
              f"{relative_error(shared, fastest):>+7.0%} | {spread(stats, 1e3) + ' ms':>27} "
              f"{fastest * 1e3:>6.3g} ms")
    print(f"\nload average {load_end:.2f} at the end; {time.time() - began:.0f} s in all. The machine may be "
          "shared with other work: figures move with it.")
    if args.json:
        record.write(rounds=[dict(measured={str(k): v for k, v in r["measured"].items()},
                                  lstm={str(k): v for k, v in r["lstm"].items()}) for r in rounds],
                     link=str(link),
                     rows=[dict(case=c, np=p, predicted_free_s=fr, predicted_shared_s=sh, measured=st)
                           for c, p, fr, sh, st, _ in rows])
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
