"""The training benchmark's command line: ``python benchmarks/training_bench.py ...`` (or
``python -m training_bench ...`` from benchmarks/); see the package docstring for its use."""
import argparse
import json

import training_bench
from training_bench import CALL_COST_MODE, GROUPING_NAMES, MODEL_NAMES, MODES, PRECISIONS, SPARSE_NAMES
from training_bench.driver import run_driver
from training_bench.plot import plot_efficiency
from training_bench.report import format_markdown
from training_bench.worker import run_worker


def parse_args():
    """The command line of all three roles (driver, worker, plot-only)."""
    p = argparse.ArgumentParser(description=training_bench.__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    role = p.add_argument_group("role")
    role.add_argument("--driver", action="store_true", help="run all selected launches and report")
    role.add_argument("--mode", choices=MODES + [CALL_COST_MODE, "adamcost"],
                      help="worker role: train one configuration (what a launch runs); callcost: the 1 KiB "
                           "allreduce's cost per tf.function call (under mpirun -np 2); adamcost: Keras' Adam "
                           "update of the LSTM's Embedding from one rank's rows, two ranks' rows, or dense")
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
    sel.add_argument("--sparse", nargs="+", choices=SPARSE_NAMES + ["both"], default=None,
                     help="tfmpi: how an Embedding's IndexedSlices gradient travels (DistributedOptimizer(sparse=)): "
                          "densified and allreduced, allgathered, deduplicated, chosen by cost, or tf_mpi's default "
                          "(no sparse=). A worker takes one; the driver runs the groupings with the first and adds "
                          "a `tfmpi graph <mode>` launch for each other one ('both' = dense allgather). Default: "
                          "dense, except for the *_user models (default)")
    sel.add_argument("--call-cost", action="store_true",
                     help="driver: also one `callcost` launch per round: a tf.function with one 1 KiB float32 "
                          "allreduce against the same tf.function with tf.identity in its place, at np=2")
    sel.add_argument("--shm-off", action="store_true",
                     help="driver: also run every model's `tfmpi graph` launch (and --timeline launch) with "
                          "TF_MPI_SHM=0, so shared memory on (the default) and off are compared in the same run")
    sel.add_argument("--precision", choices=PRECISIONS + ["both"], default="float32",
                     help="Keras dtype policy ('both': driver only)")
    timing = p.add_argument_group("timing")
    timing.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first (tracing, broadcast); default: per model, else 5")
    timing.add_argument("--steps", type=int, default=None,
                        help="timed steps per repeat (default: per model, see bench_models.MODELS)")
    timing.add_argument("--repeats", type=int, default=None,
                        help="timed windows; median and min/max over them; default: per model, else 8")
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
    if args.mode:
        args.sparse = args.sparse or [None]  # None: the model's own default (worker.sparse_mode)
        if len(args.sparse) != 1 or args.sparse[0] == "both":
            p.error("a worker takes one --sparse mode (" + ", ".join(SPARSE_NAMES) + ")")
        args.sparse = args.sparse[0]
    if args.results and not (args.plot or args.markdown):
        p.error("--results needs --plot and/or --markdown")
    if any(v is not None and v < 1 for v in (args.warmup, args.repeats, args.steps)):
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
