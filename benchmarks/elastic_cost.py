"""What elastic mode costs a job without failures, and whether this build is slower than another.

Three variants, interleaved round by round in one run (benchmarks/harness.py):

- ``baseline``: another build of tf_mpi (``--baseline PATH``: a directory holding its ``tf_mpi``
  package, e.g. ``pip install --no-deps --target /tmp/tfmpi_base .`` from an older checkout),
  launched as usual (left out without ``--baseline``);
- ``plain``: this build, launched as usual (``python -m tf_mpi.run -np 2``);
- ``elastic``: this build in elastic mode (``python -m tf_mpi.run -np 2 --elastic``: ULFM, the
  heartbeat thread, ob1, TCP on loopback beside shared memory; docs/elastic.md).

Each launch runs two workloads, each timed inside its own launch:

- ``allreduce_bench.py --only sizes``: tf_mpi's allreduce of 1 KiB ... 64 MiB (median per call);
- ``training_bench.py --mode tfmpi --model M`` (default ``mlp_user``): a Keras ``fit`` of a new
  user's MLP at 2 ranks (median step time).

Usage::

    python benchmarks/elastic_cost.py --baseline /tmp/tfmpi_base --rounds 3 [--json out.json]

Prints per variant the median [min, max] over rounds and the ratio to ``plain`` (paired by round).
"""
import argparse
import json
import os
import sys
import tempfile

import harness

HERE = os.path.dirname(os.path.abspath(__file__))


def allreduce_launch(env, elastic):
    """{size in bytes: tf_mpi's median seconds per allreduce} of one launch."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "allreduce.json")
        argv = ["-np", "2"] + (["--elastic"] if elastic else []) + [
            sys.executable, os.path.join(HERE, "allreduce_bench.py"), "--only", "sizes", "--repeats", "8",
            "--json", path]
        rc, out, _, timed_out = harness.run_bounded([sys.executable, "-m", "tf_mpi.run"] + argv, 900, env)
        if rc != 0 or timed_out or not os.path.exists(path):
            raise harness.LaunchError(f"allreduce launch failed (rc {rc}):\n{out[-3000:]}")
        with open(path) as f:
            record = json.load(f)
    return {int(r["bytes"]): r["ours"]["median_s"] for r in record["sizes"]}


def training_launch(env, elastic, model):
    """Median step seconds of one 2-rank model.fit launch."""
    script = os.path.join(HERE, "training_bench.py")
    argv = ["-np", "2"] + (["--elastic"] if elastic else []) + [
        sys.executable, script, "--mode", "tfmpi", "--model", model, "--grouping", "graph", "--sparse", "allgather"]
    rc, out, _, timed_out = harness.run_bounded([sys.executable, "-m", "tf_mpi.run"] + argv, 900, env)
    lines = [line for line in out.splitlines() if line.startswith(harness.RESULT_PREFIX)]
    if rc != 0 or timed_out or not lines:
        raise harness.LaunchError(f"training launch failed (rc {rc}):\n{out[-3000:]}")
    return json.loads(lines[-1][len(harness.RESULT_PREFIX):])["step_ms"] / 1000.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="directory holding another build's tf_mpi package (PYTHONPATH)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="mlp_user", help="training_bench model (default mlp_user)")
    p.add_argument("--json", help="where to write the record (default benchmarks/results/elastic_cost.json)")
    args = p.parse_args()
    record = harness.Record("elastic_cost", path=args.json)

    def env_for(pythonpath):
        env = harness.launch_env({"TF_CPP_MIN_LOG_LEVEL": "3"})
        env["PYTHONPATH"] = os.pathsep.join(x for x in (pythonpath, os.path.join(HERE)) if x)
        return env

    variants = {"plain": (env_for(None), False), "elastic": (env_for(None), True)}
    if args.baseline:
        variants = {"baseline": (env_for(os.path.abspath(args.baseline)), False), **variants}

    def one(name):
        env, elastic = variants[name]
        return {"allreduce": allreduce_launch(env, elastic), "step_s": training_launch(env, elastic, args.model)}

    samples = harness.interleave({name: (lambda n=name: one(n)) for name in variants}, rounds=args.rounds)
    sizes = sorted(samples["plain"][0]["allreduce"])
    tables = {}
    for size in sizes:
        per = {name: [s["allreduce"][size] for s in samples[name]] for name in variants}
        tables[f"allreduce_{size}"] = harness.compare(per, baseline="plain")
    tables["training_step"] = harness.compare({name: [s["step_s"] for s in samples[name]] for name in variants},
                                              baseline="plain")
    print(f"{'measure':<22} " + " | ".join(f"{name:>34}" for name in variants))
    for key, table in tables.items():
        cells = []
        for name in variants:
            unit, scale = ("us", 1e6) if "allreduce" in key else ("ms", 1e3)
            ratio = "" if name == "plain" else f" ({table[name]['ratio']:.2f}x)"
            cells.append(f"{harness.cell(table[name], scale, unit)}{ratio}")
        print(f"{key:<22} " + " | ".join(f"{c:>34}" for c in cells))
    print(f"wrote {record.write(results=tables, rounds=args.rounds, model=args.model, baseline=args.baseline)}")


if __name__ == "__main__":
    main()
