"""Gradient compression and training across pretend hosts (tests/cluster.py), over a rate-limited link.

A thin driver: it brings up 2 pretend hosts (1 rank each), launches the project's own benchmark
workers on them through ``python -m tf_mpi.run --host ...`` and tears the hosts down. Run as root
from the repository root::

    # compression: benchmarks/compression_bench.py (none/fp16/topk/gtopk interleaved inside each
    # launch) on 2 hosts x 1 rank, launches alternating between the rates; then the quality of
    # none/fp16/topk/gtopk after a fixed number of steps (held-out accuracy, same seeds)
    python benchmarks/cluster_training_bench.py compression --model wide_mlp --rates 1gbit,unlimited \\
        --launches 2 --rounds 5 --quality-steps 300
    # training: training_bench's workers, `single` on one pretend host against `tfmpi` on 2 hosts,
    # per round and rate (scaling efficiency = tfmpi / (2 x single of the same round))
    python benchmarks/cluster_training_bench.py training --models lstm cnn --rates unlimited,1gbit --rounds 2

Results: benchmarks/results/cluster_compression_<model>.json, cluster_training.json.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)
COMPRESSION_BENCH = os.path.join(HERE, "compression_bench.py")
TRAINING_BENCH = os.path.join(HERE, "training_bench.py")
MODES = ("none", "fp16", "topk", "gtopk")


# -- worker: quality after a fixed number of steps (runs on the ranks) ------------------------
def worker_quality(model_name, steps, batch, ratio, train_per_rank, test_samples):
    """Each mode trains a fresh model (same seed) for `steps` steps on this rank's own synthetic
    samples with compression_bench's step (DistributedGradientTape, Adam 1e-3), then rank 0
    reports loss and accuracy on held-out samples nobody trained on."""
    import numpy as np
    import tensorflow as tf
    import keras
    import tf_mpi as hvd
    from bench_models import MODELS
    from compression_bench import make_step
    hvd.init()
    spec = MODELS[model_name]
    x, y = spec.make_inputs(np.random.default_rng(100 + hvd.rank()), train_per_rank)
    xt, yt = spec.make_inputs(np.random.default_rng(999), test_samples)
    loss_fn = keras.losses.get(spec.loss)
    out = {}
    for mode in MODES:
        keras.utils.set_random_seed(0)
        model = spec.build()
        step = make_step(model, loss_fn, mode, ratio)
        t = time.perf_counter()
        for s in range(steps):
            i = (s * batch) % (train_per_rank - batch + 1)
            loss = step(tf.constant(x[i:i + batch]), tf.constant(y[i:i + batch]))
        loss.numpy()
        pred = model.predict(xt, batch_size=1000, verbose=0)
        same = hvd.allgather_object(float(sum(float(tf.reduce_sum(v)) for v in model.trainable_variables)),
                                    name=f"q.{mode}")
        out[mode] = {"test_loss": float(np.mean(keras.losses.get(spec.loss)(yt, pred))),
                     "test_accuracy": float(np.mean(np.argmax(pred, 1) == yt)),
                     "last_train_loss": float(np.mean(loss)), "train_seconds": time.perf_counter() - t,
                     "weights_identical": len(set(same)) == 1}
    if hvd.rank() == 0:
        print("QUALITY " + json.dumps({"steps": steps, "batch_per_rank": batch, "ranks": hvd.size(),
                                       "modes": out}), flush=True)


# -- driver -------------------------------------------------------------------------------------
def run(cluster, argv, env_extra=None, host=None, timeout=900):
    from mpi_harness import launch_env, run_bounded
    cmd = cluster.command(argv, host=host)
    rc, output, elapsed, timed_out = run_bounded(cmd, timeout, cluster.env(launch_env(env_extra)))
    if rc != 0 or timed_out:
        raise RuntimeError(f"launch failed (rc={rc}, timed_out={timed_out}): {' '.join(argv)}\n{output[-4000:]}")
    return output, elapsed


def mpi(cluster, program, np_=2):
    return [sys.executable, "-m", "tf_mpi.run", "-np", str(np_), "--host", cluster.host_list(),
            "--map-by", "node", sys.executable] + program


def set_rate(cluster, rate):
    cluster.set_rate(None if rate == "unlimited" else rate)


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def compression(a, cluster):
    rates = a.rates.split(",")
    launches = {r: [] for r in rates}
    for i in range(a.launches):
        for rate in (rates if i % 2 == 0 else rates[::-1]):
            set_rate(cluster, rate)
            path = f"/tmp/cmp_{a.model}_{rate}_{i}.json"
            program = [COMPRESSION_BENCH, "--model", a.model, "--rounds", str(a.rounds), "--json", path,
                       "--batch-size", str(a.batch_size)] + (["--steps", str(a.steps)] if a.steps else [])
            out, elapsed = run(cluster, mpi(cluster, program))
            with open(path) as f:
                rec = json.load(f)
            rec["launch_seconds"], rec["load_avg_after"] = elapsed, os.getloadavg()
            launches[rate].append(rec)
            print(f"[{rate}] launch {i + 1}: " + ", ".join(
                f"{m} {rec['modes'][m]['step_ms_median']:.1f} ms" for m in MODES), flush=True)
    report = {"command": "python benchmarks/cluster_training_bench.py " + " ".join(sys.argv[1:]),
              "machine": f"{os.cpu_count()}-core VM, 2 pretend hosts x 1 rank (1 core each)",
              "host": socket.gethostname(), "model": a.model, "rates": {}}
    for rate in rates:
        recs = launches[rate]
        batch, size = recs[0]["batch_size"], recs[0]["ranks"]
        # Per round ratios: none's step time over the mode's step time in the same round (slowest rank).
        summary = {}
        for m in MODES:
            steps_ms = [r["modes"][m]["step_ms_median"] for r in recs]
            ratio = [r["modes"]["none"]["step_ms_median"] / r["modes"][m]["step_ms_median"] for r in recs]
            summary[m] = {"step_ms": spread(steps_ms),
                          "samples_per_s": spread([1e3 * batch * size / s for s in steps_ms]),
                          "speedup_vs_none_per_launch": ratio,
                          "speedup_vs_none": spread(ratio),
                          "payload_bytes_per_step_rank0": recs[0]["modes"][m]["payload_bytes_per_step_per_rank"][0]}
        report["rates"][rate] = {"summary": summary, "launches": recs,
                                 "topk_compute_ms": spread([1e3 * r["topk_compute_seconds_per_step"] for r in recs])}
        print(f"== {a.model} at {rate}: per-launch medians over {a.rounds} interleaved rounds; "
              f"median [min, max] over {len(recs)} launches")
        for m in MODES:
            s = summary[m]
            print(f"   {m:6} {s['samples_per_s']['median']:8.0f} samples/s "
                  f"[{s['samples_per_s']['min']:.0f}, {s['samples_per_s']['max']:.0f}]  "
                  f"x{s['speedup_vs_none']['median']:.2f} vs none "
                  f"[{s['speedup_vs_none']['min']:.2f}, {s['speedup_vs_none']['max']:.2f}]", flush=True)
    if a.timeline:
        set_rate(cluster, "1gbit")
        for m in ("none", "gtopk"):
            path = f"{a.timeline}.{m}.json"
            run(cluster, mpi(cluster, [os.path.abspath(__file__), "timeline-worker", "--model", a.model,
                                       "--mode", m, "--batch-size", str(a.batch_size)]),
                env_extra={"TF_MPI_TIMELINE": path})
            ana = subprocess.run([sys.executable, "-m", "tf_mpi.timeline_analysis", path],
                                 capture_output=True, text=True, cwd=ROOT)
            report.setdefault("timeline_1gbit", {})[m] = {"file": path, "analysis": ana.stdout + ana.stderr}
            print(f"== timeline {m} at 1gbit ({path}):\n{ana.stdout}{ana.stderr}", flush=True)
    if a.quality_steps:
        set_rate(cluster, "unlimited")  # the weights do not depend on the rate
        out, _ = run(cluster, mpi(cluster, [os.path.abspath(__file__), "quality-worker", "--model", a.model,
                                            "--quality-steps", str(a.quality_steps),
                                            "--batch-size", str(a.batch_size)]))
        q = next(json.loads(line[8:]) for line in out.splitlines() if line.startswith("QUALITY "))
        report["quality"] = q
        print(f"== quality after {q['steps']} steps x {q['batch_per_rank']} samples x {q['ranks']} ranks "
              f"(held-out, same seeds):")
        for m in MODES:
            r = q["modes"][m]
            print(f"   {m:6} test accuracy {r['test_accuracy']:.4f}  test loss {r['test_loss']:.4f}  "
                  f"identical weights {r['weights_identical']}", flush=True)
    report["load_avg_at_end"] = os.getloadavg()
    path = os.path.join(a.out, f"cluster_compression_{a.model}{a.suffix}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


def timeline_worker(a):
    """A few steps of one mode (compression_bench's step), for a tf_mpi timeline."""
    import numpy as np
    import tensorflow as tf
    import keras
    import tf_mpi as hvd
    from bench_models import MODELS
    from compression_bench import make_step
    hvd.init()
    spec = MODELS[a.model]
    x, y = (tf.constant(v) for v in spec.make_inputs(np.random.default_rng(hvd.rank()), a.batch_size))
    keras.utils.set_random_seed(0)
    step = make_step(spec.build(), keras.losses.get(spec.loss), a.mode, 0.01)
    for _ in range(10):
        loss = step(x, y)
    loss.numpy()


def training(a, cluster):
    rates = a.rates.split(",")
    rows = []
    for i in range(a.rounds):
        for model in a.models:
            common = ["--model", model, "--repeats", str(a.repeats), "--warmup", "3"]
            order = ["single"] + (rates if i % 2 == 0 else rates[::-1])
            if i % 2:
                order = order[::-1]
            for what in order:
                if what == "single":
                    argv, label = [sys.executable, TRAINING_BENCH, "--mode", "single"] + common, "single (1 host)"
                else:
                    set_rate(cluster, what)
                    argv, label = mpi(cluster, [TRAINING_BENCH, "--mode", "tfmpi"] + common), f"tfmpi 2x1 {what}"
                out, elapsed = run(cluster, argv)
                res = next(json.loads(line[len("RESULT "):]) for line in out.splitlines()
                           if line.startswith("RESULT "))
                rows.append({"round": i, "model": model, "label": label, "rate": what,
                             "samples_per_sec": res["samples_per_sec"], "launch_seconds": elapsed,
                             "load_avg": os.getloadavg(), "result": res})
                print(f"round {i + 1} {model} {label}: {res['samples_per_sec']:.1f} samples/s", flush=True)
    summary = {}
    for model in a.models:
        single = {r["round"]: r["samples_per_sec"] for r in rows if r["model"] == model and r["rate"] == "single"}
        summary[model] = {"single (1 host)": spread(list(single.values()))}
        for rate in rates:
            sel = [r for r in rows if r["model"] == model and r["rate"] == rate]
            summary[model][f"tfmpi 2x1 {rate}"] = {
                "samples_per_s": spread([r["samples_per_sec"] for r in sel]),
                "efficiency": spread([r["samples_per_sec"] / (2 * single[r["round"]]) for r in sel])}
    print("== training across 2 pretend hosts x 1 rank: median [min, max] over rounds; "
          "efficiency = 2-host samples/s / (2 x single of the same round)")
    for model, s in summary.items():
        b = s["single (1 host)"]
        print(f"   {model}: single {b['median']:.1f} [{b['min']:.1f}, {b['max']:.1f}]")
        for rate in rates:
            t = s[f"tfmpi 2x1 {rate}"]
            print(f"   {model}: 2x1 {rate:9} {t['samples_per_s']['median']:.1f} "
                  f"[{t['samples_per_s']['min']:.1f}, {t['samples_per_s']['max']:.1f}]  efficiency "
                  f"{t['efficiency']['median']:.2f} [{t['efficiency']['min']:.2f}, {t['efficiency']['max']:.2f}]")
    report = {"command": "python benchmarks/cluster_training_bench.py " + " ".join(sys.argv[1:]),
              "machine": f"{os.cpu_count()}-core VM, pretend hosts with 1 core each",
              "summary": summary, "rows": rows, "load_avg_at_end": os.getloadavg()}
    path = os.path.join(a.out, f"cluster_training{a.suffix}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["compression", "training", "quality-worker", "timeline-worker"])
    p.add_argument("--model", default="wide_mlp")
    p.add_argument("--models", nargs="+", default=["lstm", "cnn"])
    p.add_argument("--mode", default="gtopk")
    p.add_argument("--rates", default="1gbit,unlimited")
    p.add_argument("--launches", type=int, default=2, help="compression: launches per rate (alternating)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--quality-steps", type=int, default=0)
    p.add_argument("--timeline", default=None, help="compression: also a timeline of none and gtopk at 1gbit")
    p.add_argument("--suffix", default="")
    p.add_argument("--prefix", default="cmp")
    p.add_argument("--net", type=int, default=13)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args()
    if a.what == "quality-worker":
        return worker_quality(a.model, a.quality_steps, a.batch_size, 0.01, 4096, 2000)
    if a.what == "timeline-worker":
        return timeline_worker(a)
    from cluster import Cluster
    with Cluster(hosts=2, slots=1, rate=None, prefix=a.prefix, net=a.net) as c:
        (compression if a.what == "compression" else training)(a, c)


if __name__ == "__main__":
    main()
