"""Allreduce benchmark: tf_mpi's TensorFlow op against raw MPI_Allreduce (mpi4py).

Run (from the repository root; rank 0 prints, every rank measures)::

    python -m tf_mpi.run -np 2 python benchmarks/allreduce_bench.py [--repeats N] [--json out.json] \
        [--only sizes|storm|chain|overlap]

``--only chain`` and ``--only overlap`` are the two parts not run by default, (c) and (d)
below. Timing, rounds and the JSON record come from benchmarks/harness.py.

What it measures (float32, op=Sum, all times are per allreduce):

  (a) Single tensors of 1 KiB, 64 KiB, 1 MiB, 16 MiB and 64 MiB: one
      ``hvd.allreduce`` inside a ``tf.function`` against
      ``MPI.COMM_WORLD.Allreduce`` on numpy buffers of the same size.
      For reference it also times the same tf.function with ``tf.identity``
      in place of the allreduce ("tf floor": TensorFlow's own per-call cost).
  (b) "Gradient storm": one ``tf.function`` with one ``hvd.allreduce`` per
      trainable variable of Keras ResNet50 (214 tensors, 25,583,592 floats,
      shapes from benchmarks/data/resnet50_grad_shapes.json) against one raw
      Allreduce of a flat buffer of the same total size, and against raw
      Allreduce of that flat buffer cut into 1 MiB pieces. "tf floor" here is
      one elementwise op per tensor (t * 2) in one ``tf.function``, on every
      rank at once: what TensorFlow itself takes to read every input and
      write a fresh output, which an allreduce of tensors that stay alive
      must also do (it beats that only by writing around the cache).

Method: every input is created once, before timing. Each sample starts with
``MPI.COMM_WORLD.Barrier()`` and times a Python loop of K back-to-back calls,
divided by K. K is calibrated per size so that a sample lasts ~20 ms (K=1 for
big tensors) and agreed across ranks. TensorFlow runs eagerly and
synchronously (checked), so a call returns only once its allreduce ops have
run; after each sample, outside the timed region, the last call's outputs are
read back with ``.numpy()`` and checked, so no skipped work goes unnoticed.
(``.numpy()`` copies the buffer in TF 2.x, ~20 ms for 64 MiB here, which is
why it is kept out of the timed region.) Samples of ours and raw are
interleaved so that background load hits both alike. A sample's time is the
slowest rank's. We report the median, the
inter-quartile range and min/max over samples, and the ratio of medians
ours/raw.

Before timing, results are checked (inputs of ones must reduce to size*ones,
inputs of rank+1 to size*(size+1)/2); the run aborts if they are wrong.

Shared-memory allreduce (TF_MPI_SHM, on by default when every rank shares
the node): every tf_mpi measurement is taken twice in the same run, samples
interleaved: "ours" (the engine as configured, so over shared memory) and
"ours mpi" (the same calls with the shared-memory path paused through the
_core.set_shm_paused hook, i.e. the MPI path, which is what TF_MPI_SHM=0
runs). With TF_MPI_SHM=0 in the environment both columns are the MPI path.

Memory bound: for each size, every rank at once times numpy adding 1/size of
the data (np.add into a third array) and copying the other (size-1)/size
(np.copyto): the memory traffic of an allreduce in which each rank reduces
its share in place and copies the others' results. Results are also shown as
multiples of it ("x bound").

The closing target lines (PASS/FAIL) are informational; the exit code is 0
whenever the results were correct.

(c) ``--only chain [--length 50]``: the per-op cost of small allreduces inside one
    tf.function. Chain: `length` dependent 1 KiB allreduces, each feeding the next, so the
    time per op is one full round trip through TensorFlow's executor and the engine. Burst:
    4 x `length` independent 1 KiB allreduces (one op per tensor, as a gradient storm of
    small tensors submits them): whether the ops are negotiated together or one round trip
    after another. Each is compared with the same graph of tf.identity (TensorFlow's own
    per-op cost), samples interleaved; `--repeats` samples (default 20). Used to choose
    TF_MPI_SPIN_US / TF_MPI_POLL_US / TF_MPI_INLINE_* (run it with different values).

(d) ``--only overlap [--seconds 2]``: how much an allreduce slows the computation running
    beside it on the same core, and back. Each rank runs a compute thread (single-threaded
    float32 256x256 matmuls in numpy, which releases the GIL) and, at the same time, a loop
    of allreduces of one size (4 KiB - 8 MiB) through the engine (numpy, no TensorFlow).
    Per size it prints, as a Markdown table: the compute thread's speed beside the
    allreduces as a share of its speed alone (1.00 = the allreduces cost it nothing); the
    time per allreduce beside the compute, alone, and raw ``MPI_Allreduce`` alone, in the
    same launch. Open MPI busy-polls inside every call while it waits for the peers; the
    figures show what that costs a computation sharing the core. Ranks are bound one per
    core, as mpirun does by default with 2 ranks on 2 cores.
"""
import argparse
import json
import os
import sys
import threading
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # (d): a single-threaded compute thread
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

# Must run before TensorFlow executes anything.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

from mpi4py import MPI  # noqa: E402  (initialises MPI with MPI_THREAD_MULTIPLE)

import tf_mpi as hvd  # noqa: E402
from tf_mpi import basics  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
CHAIN = 50                        # ops per tf.function call for the per-op latency of small tensors
CHUNK_BYTES = 1 * MiB             # piece size of the chunked raw baseline
TARGET_SAMPLE_S = 0.02            # aim for samples of about this long
MAX_CALLS_PER_SAMPLE = 200
SHAPES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "resnet50_grad_shapes.json")

comm = MPI.COMM_WORLD


def default_repeats(nbytes):
    """Fewer samples for big tensors (each one is already long)."""
    if nbytes <= 1 * MiB:
        return 40
    if nbytes <= 16 * MiB:
        return 25
    return 15


def log(*args):
    if comm.rank == 0:
        print(*args, flush=True)


def fail(message):
    """Stops every rank with a clear message (called collectively)."""
    log(f"\nBENCHMARK ABORTED: {message}")
    sys.exit(2)


# ---------------------------------------------------------------- timing


def calls_per_sample(fn):
    """K such that K calls of fn take ~TARGET_SAMPLE_S, the same on every rank (harness.calls_per_sample)."""
    return harness.calls_per_sample(fn, comm, TARGET_SAMPLE_S, MAX_CALLS_PER_SAMPLE)


def slowest_rank(seconds):
    return comm.allreduce(seconds, op=MPI.MAX)


def time_interleaved(fns, repeats, k, label):
    """Times each entry of `fns` for `repeats` samples of `k` calls each.

    `fns` maps name -> (fn, expected): fn() returns its outputs (a list of
    tensors or arrays), every element of which must equal `expected`; the
    last call's outputs are checked after each sample, outside the timer.
    Samples of the different fns are interleaved. Returns name -> stats dict
    (seconds per call; a sample counts as the slowest rank's time).
    """
    samples = {name: [] for name in fns}
    wrong = []
    for i in range(repeats):
        for name in harness.rotation(fns, i):
            fn, expected = fns[name]
            outputs = []

            def call(fn=fn):
                outputs[:] = fn()
            samples[name].append(harness.timed_sample(call, k, comm.Barrier, slowest_rank))
            if expected is not None and not all(np.allclose(np.asarray(o), expected, rtol=1e-6, atol=0)
                                                for o in outputs):
                wrong.append(f"rank {comm.rank}: {name}, sample {i}: result is not all {expected}")
    if not comm.allreduce(not wrong, op=MPI.LAND):
        for line in (w for per_rank in comm.gather(wrong, root=0) or [] for w in per_rank):
            log("  " + line)
        fail(f"{label}: wrong results while timing (details above)")
    out = {}
    for name, s in samples.items():
        st = harness.summarize(s)
        out[name] = dict(median_s=st["median"], p25_s=st["p25"], p75_s=st["p75"], min_s=st["min"],
                         max_s=st["max"], repeats=repeats, calls_per_sample=k)
    return out


# ---------------------------------------------------------------- building blocks


def make_ours(tensors, name):
    """A tf.function doing one hvd.allreduce(op=Sum) per tensor in the list."""
    @tf.function
    def reduce_all(ts):
        return [hvd.allreduce(t, op=hvd.Sum, name=f"{name}.{i}") for i, t in enumerate(ts)]
    return lambda: reduce_all(tensors)


def mpi_path(fn):
    """fn with the shared-memory path paused (the MPI path), as TF_MPI_SHM=0 would run it.

    Safe between synchronous calls: a collective executes only after every
    rank has submitted it, so every rank has switched before it runs.
    """
    def run():
        basics._core.set_shm_paused(True)
        try:
            return fn()
        finally:
            basics._core.set_shm_paused(False)
    return run


def make_bound(nbytes):
    """numpy: add 1/size of `nbytes` of float32, copy the remaining (size-1)/size (the memory bound)."""
    n = nbytes // 4
    share = max(1, n // comm.size)
    a, b, c = np.ones(share, np.float32), np.ones(share, np.float32), np.empty(share, np.float32)
    rest = n - share
    src, dst = np.ones(max(rest, 1), np.float32), np.empty(max(rest, 1), np.float32)

    def run():
        np.add(a, b, out=c)
        if rest:
            np.copyto(dst, src)
        return []
    return run


def make_tf_pass(tensors):
    """A tf.function computing t * 2 for every tensor: TensorFlow's own cost of one pass over them.

    Each op reads its input and writes a freshly allocated output of the same
    size, as an allreduce whose inputs stay alive must too (its outputs cannot
    share the inputs' memory).
    """
    @tf.function
    def double_all(ts):
        return [t * 2.0 for t in ts]
    return lambda: double_all(tensors)


def make_chain(tensor, length):
    """A tf.function running `length` dependent allreduces (each feeds the next).

    Dividing its time by `length` gives the per-op latency without
    TensorFlow's per-call cost of a tf.function (~0.8 ms here). Sum with
    postscale 1/size keeps values at 1, and would not if a reduction were skipped.
    """
    scale = 1.0 / comm.size

    @tf.function
    def chain(t):
        for i in range(length):
            t = hvd.allreduce(t, op=hvd.Sum, postscale_factor=scale, name=f"chain.{length}.{i}")
        return [t]
    return lambda: chain(tensor)


def make_raw(src, dst, chunk_elems=None):
    """Raw MPI_Allreduce(SUM) of src into dst, whole or in pieces of chunk_elems."""
    step = src.size if chunk_elems is None else chunk_elems
    pieces = [(src[i:i + step], dst[i:i + step]) for i in range(0, src.size, step)]

    def run():
        for s, d in pieces:
            comm.Allreduce(s, d, op=MPI.SUM)
        return [dst]
    return run


def check_correct(shapes, name, label):
    """Checks ours (and raw) against exact expected sums on every rank; aborts if wrong."""
    size, rank = comm.size, comm.rank
    problems = []
    for fill, expected in ((1.0, float(size)), (float(rank + 1), size * (size + 1) / 2.0)):
        tensors = [tf.fill(s, fill) for s in shapes]
        outs = make_ours(tensors, f"{name}.check")()
        for i, (s, o) in enumerate(zip(shapes, outs)):
            got = o.numpy()
            if tuple(got.shape) != tuple(s) or not np.all(got == expected):
                bad = got[got != expected] if got.shape == tuple(s) else got.ravel()
                problems.append(f"rank {rank}: tensor {i} shape {list(s)} filled with {fill}: expected all "
                                f"{expected}, got shape {list(got.shape)}, {bad.size} wrong values, e.g. "
                                f"{bad.ravel()[:4].tolist()}")
        n = int(sum(np.prod(s) for s in shapes))
        src = np.full(n, fill, np.float32)
        dst = np.empty_like(src)
        make_raw(src, dst)()
        if not np.all(dst == expected):
            problems.append(f"rank {rank}: raw mpi4py Allreduce of {n} floats filled with {fill} is wrong")
    all_problems = comm.gather(problems, root=0)
    ok = comm.allreduce(not problems, op=MPI.LAND)
    if not ok:
        if rank == 0:
            for p in (p for per_rank in all_problems for p in per_rank):
                print("  " + p, flush=True)
        fail(f"{label}: tf_mpi allreduce(op=Sum) returned wrong results (details above); "
             "timing a wrong result is meaningless")


# ---------------------------------------------------------------- formatting


def human_bytes(n):
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def unit_for(nbytes):
    """Microseconds for small tensors, milliseconds from 1 MiB up."""
    return (1e6, "us") if nbytes < MiB else (1e3, "ms")


def num(x):
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def signed(x):
    return ("+" if x >= 0 else "-") + num(abs(x))


def fmt(stats, scale):
    """'median [p25-p75]' in the given scale."""
    return f"{num(stats['median_s'] * scale)} [{num(stats['p25_s'] * scale)}-{num(stats['p75_s'] * scale)}]"


# ---------------------------------------------------------------- benchmark parts


def bench_sizes(repeats_override):
    log("\n(a) single float32 tensor, op=Sum: median [IQR p25-p75] per allreduce")
    log("  ours = the engine as configured (shared memory when active); ours mpi = the same calls on the MPI path;")
    log("  bound = numpy add of 1/size + copy of the rest on every rank at once (memory bound);")
    log("  tf floor = the same tf.function with tf.identity instead of the allreduce (TF's per-call cost)")
    log(f"{'size':>8} {'KxN':>7} | {'ours':>24} | {'ours mpi':>24} | {'raw MPI_Allreduce':>24} | "
        f"{'bound':>8} | {'ours/raw':>8} {'ours/mpi':>8} {'x bound':>7} {'mpi x bound':>11} | {'tf floor':>9}")
    results = []
    for nbytes in SIZES:
        n = nbytes // 4
        check_correct([[n]], f"bench{nbytes}", f"{human_bytes(nbytes)} tensor")
        ours_input = tf.ones([n], tf.float32)
        ours = make_ours([ours_input], f"bench{nbytes}")
        src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
        floor = tf.function(tf.identity)
        fns = {"ours": (ours, comm.size), "ours_mpi": (mpi_path(ours), comm.size),
               "raw": (make_raw(src, dst), comm.size), "bound": (make_bound(nbytes), None),
               "tf_floor": (lambda: [floor(ours_input)], 1.0)}
        if nbytes < MiB:
            chain = make_chain(ours_input, CHAIN)
            fns["ours_chain"] = (chain, 1.0)
            fns["ours_mpi_chain"] = (mpi_path(chain), 1.0)
            chain()
        k = calls_per_sample(fns["ours"][0])
        for name in fns:
            fns[name][0]()
        repeats = repeats_override or default_repeats(nbytes)
        r = time_interleaved(fns, repeats, k, f"{human_bytes(nbytes)} tensor")
        for name in ("ours_chain", "ours_mpi_chain"):
            if name in r:
                for key in ("median_s", "p25_s", "p75_s", "min_s", "max_s"):
                    r[name][key] /= CHAIN
        med = {name: v["median_s"] for name, v in r.items()}
        ratio = med["ours"] / med["raw"]
        delta = med["ours"] - med["raw"]
        scale, unit = unit_for(nbytes)
        log(f"{human_bytes(nbytes):>8} {f'{k}x{repeats}':>7} | {fmt(r['ours'], scale) + ' ' + unit:>24} | "
            f"{fmt(r['ours_mpi'], scale) + ' ' + unit:>24} | {fmt(r['raw'], scale) + ' ' + unit:>24} | "
            f"{num(med['bound'] * scale) + ' ' + unit:>8} | {ratio:7.2f}x {med['ours'] / med['ours_mpi']:7.2f}x "
            f"{med['ours'] / med['bound']:6.1f}x {med['ours_mpi'] / med['bound']:10.1f}x | "
            f"{num(med['tf_floor'] * scale):>6} {unit}")
        results.append(dict(bytes=nbytes, elements=n, ours=r["ours"], ours_mpi=r["ours_mpi"], raw=r["raw"],
                            memory_bound=r["bound"], tf_function_floor=r["tf_floor"], ratio_median=ratio,
                            ratio_vs_mpi_path=med["ours"] / med["ours_mpi"],
                            ratio_vs_bound=med["ours"] / med["bound"],
                            mpi_path_ratio_vs_bound=med["ours_mpi"] / med["bound"], overhead_median_s=delta))
        if nbytes < MiB:
            engine = bench_engine_only(n)
            log(f"{'':>8} {'':>7} | {num(engine * scale) + ' ' + unit:>24}   per op, numpy through the engine "
                f"(no TensorFlow): ours-raw {signed((engine - med['raw']) * scale)} {unit}")
            results[-1]["engine_only_median_s"] = engine
        if "ours_chain" in r:
            c, cm = r["ours_chain"], r["ours_mpi_chain"]
            log(f"{'':>8} {'':>7} | {fmt(c, scale) + ' ' + unit:>24} | {fmt(cm, scale) + ' ' + unit:>24}   per op, "
                f"in a chain of {CHAIN} ops in one tf.function: ours-raw {signed((c['median_s'] - med['raw']) * scale)}"
                f" {unit}, ours mpi-raw {signed((cm['median_s'] - med['raw']) * scale)} {unit}")
            results[-1].update(ours_per_op_in_chain=c, ours_mpi_per_op_in_chain=cm, chain_length=CHAIN,
                               chain_overhead_median_s=c["median_s"] - med["raw"],
                               mpi_chain_overhead_median_s=cm["median_s"] - med["raw"])
    return results


def bench_engine_only(n, calls=2000):
    """Median per-call time of tf_mpi._core.allreduce on a numpy array (engine + binding, no TensorFlow)."""
    x = np.ones(n, np.float32)
    for _ in range(50):
        basics._core.allreduce(x, hvd.Sum, "engine_only")
    samples = []
    for _ in range(5):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls // 5):
            basics._core.allreduce(x, hvd.Sum, "engine_only")
        samples.append((time.perf_counter() - t0) / (calls // 5))
    return float(comm.allreduce(float(np.median(samples)), op=MPI.MAX))


def bench_storm(repeats_override):
    with open(SHAPES_FILE) as f:
        spec = json.load(f)
    shapes = [list(s) for s in spec["shapes"]]
    n = int(sum(np.prod(s) for s in shapes))
    if len(shapes) != spec["num_tensors"] or n != spec["num_params"]:
        fail(f"{SHAPES_FILE} is inconsistent: {len(shapes)} shapes / {n} values vs "
             f"num_tensors={spec['num_tensors']} num_params={spec['num_params']}")
    log(f"\n(b) gradient storm: {len(shapes)} allreduce ops in one tf.function "
        f"({n:,} float32 = {n * 4 / MiB:.1f} MiB; {spec['source']})")
    check_correct(shapes, "storm", "gradient storm")
    inputs = [tf.ones(s, tf.float32) for s in shapes]
    ours = make_ours(inputs, "storm")
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    fns = {"ours": (ours, comm.size),
           "ours_mpi": (mpi_path(ours), comm.size),
           "raw_flat": (make_raw(src, dst), comm.size),
           "raw_chunked": (make_raw(src, dst, CHUNK_BYTES // 4), comm.size),
           "bound": (make_bound(n * 4), None),
           "tf_pass": (make_tf_pass(inputs), 2.0)}
    k = calls_per_sample(fns["ours"][0])
    for name in fns:
        fns[name][0]()
    # How the engine cut one call into buckets (negotiation batches decide it, so it varies).
    before = basics._core.stats()
    ours()
    after = basics._core.stats()
    counters = ("allreduce_buckets", "shm_allreduces", "shm_fused_buckets", "shm_fused_pieces")
    buckets = {key: after.get(key, 0) - before.get(key, 0) for key in counters}
    log(f"  one call: {buckets['allreduce_buckets']} buckets, {buckets['shm_allreduces']} over shared memory, "
        f"{buckets['shm_fused_buckets']} of them fused from {buckets['shm_fused_pieces']} tensors")
    repeats = repeats_override or default_repeats(n * 4)
    r = time_interleaved(fns, repeats, k, "gradient storm")
    labels = {"ours": f"tf_mpi, {len(shapes)} ops",
              "ours_mpi": f"tf_mpi mpi path, {len(shapes)} ops",
              "raw_flat": "raw, 1 flat Allreduce",
              "raw_chunked": f"raw, {-(-n // (CHUNK_BYTES // 4))} x 1 MiB Allreduce",
              "bound": "memory bound (numpy)",
              "tf_pass": f"tf floor, {len(shapes)} x (t * 2)"}
    bound = r["bound"]["median_s"]
    for name, label in labels.items():
        log(f"  {label:<32} {fmt(r[name], 1e3) + ' ms':>22}   min {num(r[name]['min_s'] * 1e3)} "
            f"max {num(r[name]['max_s'] * 1e3)} ms  ({k}x{repeats})  {r[name]['median_s'] / bound:5.2f}x bound")
    ratio_flat = r["ours"]["median_s"] / r["raw_flat"]["median_s"]
    ratio_chunked = r["ours"]["median_s"] / r["raw_chunked"]["median_s"]
    ratio_mpi_path = r["ours"]["median_s"] / r["ours_mpi"]["median_s"]
    log(f"  ours / raw flat    = {ratio_flat:.2f}x")
    log(f"  ours / raw chunked = {ratio_chunked:.2f}x   (mpi path / raw chunked = "
        f"{r['ours_mpi']['median_s'] / r['raw_chunked']['median_s']:.2f}x)")
    log(f"  ours / mpi path    = {ratio_mpi_path:.2f}x")
    log(f"  ours / tf floor    = {r['ours']['median_s'] / r['tf_pass']['median_s']:.2f}x   (raw chunked / tf floor = "
        f"{r['raw_chunked']['median_s'] / r['tf_pass']['median_s']:.2f}x)")
    return dict(num_tensors=len(shapes), elements=n, bytes=n * 4, chunk_bytes=CHUNK_BYTES, one_call=buckets, **r,
                ratio_vs_flat=ratio_flat, ratio_vs_chunked=ratio_chunked, ratio_vs_mpi_path=ratio_mpi_path,
                ratio_vs_tf_floor=r["ours"]["median_s"] / r["tf_pass"]["median_s"])


def target_checks(sizes, storm):
    big = [s for s in sizes if s["bytes"] >= 16 * MiB]
    small = next(s for s in sizes if s["bytes"] == 1 * KiB)
    worst_big = max(s["ratio_median"] for s in big)
    checks = [
        dict(name="tensors >= 16 MiB within 1.10x of raw", passed=worst_big <= 1.10,
             measured=f"worst {worst_big:.2f}x"),
        dict(name="gradient storm within 1.25x of single flat raw allreduce",
             passed=storm["ratio_vs_flat"] <= 1.25, measured=f"{storm['ratio_vs_flat']:.2f}x"),
        dict(name="1 KiB latency within raw + 100 us (per op, chained)",
             passed=small["chain_overhead_median_s"] <= 100e-6,
             measured=f"raw {small['raw']['median_s'] * 1e6:.1f} us + {small['chain_overhead_median_s'] * 1e6:.1f} us"),
    ]
    shm_on = basics._core.stats()["shm_allreduces"] > 0
    big = next(s for s in sizes if s["bytes"] == 64 * MiB)
    checks += [
        dict(name="64 MiB within 1.3x of the memory bound", passed=big["ratio_vs_bound"] <= 1.3,
             measured=f"{big['ratio_vs_bound']:.2f}x (mpi path {big['mpi_path_ratio_vs_bound']:.2f}x)"),
        dict(name="64 MiB within 0.5x of raw", passed=big["ratio_median"] <= 0.5,
             measured=f"{big['ratio_median']:.2f}x"),
        dict(name="gradient storm within 0.7x of raw over 1 MiB pieces", passed=storm["ratio_vs_chunked"] <= 0.7,
             measured=f"{storm['ratio_vs_chunked']:.2f}x; 0.7x raw = "
                      f"{0.7 * storm['raw_chunked']['median_s'] * 1e3:.1f} ms, tf floor "
                      f"{storm['tf_pass']['median_s'] * 1e3:.1f} ms"),
        dict(name="1 KiB per op (chained) no slower than the mpi path",
             passed=small["ours_per_op_in_chain"]["median_s"] <= small["ours_mpi_per_op_in_chain"]["median_s"],
             measured=f"{small['ours_per_op_in_chain']['median_s'] * 1e6:.1f} us vs "
                      f"{small['ours_mpi_per_op_in_chain']['median_s'] * 1e6:.1f} us"),
        dict(name="no size and not the storm slower than the mpi path",
             passed=all(s["ratio_vs_mpi_path"] <= 1.0 for s in sizes) and storm["ratio_vs_mpi_path"] <= 1.0,
             measured="worst " + f"{max([s['ratio_vs_mpi_path'] for s in sizes] + [storm['ratio_vs_mpi_path']]):.2f}x"),
    ]
    log(f"\ntargets (medians; informational; shared memory {'ran' if shm_on else 'did NOT run'}):")
    for c in checks:
        log(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']:<58} ({c['measured']})")
    return checks


def bench_chain(length, repeats):
    """(c): per-op time of a chain and a burst of 1 KiB allreduces in one tf.function, against tf.identity."""
    x = tf.ones([256])
    scale = 1.0 / comm.size

    @tf.function
    def chain(t):
        for i in range(length):
            t = hvd.allreduce(t, op=hvd.Sum, postscale_factor=scale, name=f"chain.{i}")
        return t

    @tf.function
    def identity_chain(t):
        for _ in range(length):
            t = tf.identity(t) * 1.0
        return t

    burst_inputs = [tf.ones([256]) for _ in range(4 * length)]

    @tf.function
    def burst(ts):
        return [hvd.allreduce(t, op=hvd.Sum, postscale_factor=scale, name=f"burst.{i}") for i, t in enumerate(ts)]

    @tf.function
    def identity_burst(ts):
        return [tf.identity(t) * 1.0 for t in ts]

    if not (np.allclose(chain(x).numpy(), 1.0) and all(np.allclose(t.numpy(), 1.0) for t in burst(burst_inputs))):
        fail("chain/burst: wrong allreduce results")
    identity_chain(x)
    identity_burst(burst_inputs)
    ops = {"chain": length, "identity chain": length, "burst": len(burst_inputs),
           "identity burst": len(burst_inputs)}
    runs = {"chain": lambda: chain(x), "identity chain": lambda: identity_chain(x),
            "burst": lambda: burst(burst_inputs), "identity burst": lambda: identity_burst(burst_inputs)}
    samples = harness.interleave(
        {name: (lambda name=name: harness.timed_sample(runs[name], 1, comm.Barrier, slowest_rank) / ops[name])
         for name in runs}, repeats)
    stats = {name: harness.summarize(v) for name, v in samples.items()}
    log(f"\n(c) per-op time of 1 KiB allreduces in one tf.function, median [min-max] over {repeats} samples")
    log(f"per-op: allreduce chain {stats['chain']['median'] * 1e6:.0f} us; identity chain "
        f"{stats['identity chain']['median'] * 1e6:.0f} us   (chain {harness.cell(stats['chain'], 1e6, 'us')})")
    log(f"per-op: allreduce burst of {len(burst_inputs)} {stats['burst']['median'] * 1e6:.0f} us; identity burst "
        f"{stats['identity burst']['median'] * 1e6:.0f} us   (burst {harness.cell(stats['burst'], 1e6, 'us')})")
    log(f"({basics._core.config()})")
    return dict(length=length, burst_ops=len(burst_inputs), per_op_s=stats)


OVERLAP_SIZES = [4 << 10, 256 << 10, 1 << 20, 8 << 20]


class ComputeThread:
    """(d): multiplies 256x256 float32 matrices until stopped; counts them."""

    def __init__(self):
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
        while not self._stop.is_set():
            np.matmul(a, a)
            self.count += 1

    def __enter__(self):
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.rate = self.count / (time.perf_counter() - self.start)


def time_calls(fn, seconds):
    """Median seconds per call of the collective fn() over about `seconds`; rank 0 picks the number
    of calls from five trial calls (every rank must make the same number)."""
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    calls = comm.bcast(max(5, int(seconds / max(np.median(samples), 1e-6))), root=0)
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples[5:]))


def bench_overlap(seconds):
    """(d): the compute thread's speed beside allreduces, and the allreduces' beside it (Markdown table)."""
    comm.Barrier()
    with ComputeThread() as alone:
        time.sleep(seconds)
    log("\n(d) allreduce beside computation on the same core")
    log("| bytes | compute speed beside allreduces | allreduce beside compute | "
        "allreduce alone | raw MPI_Allreduce alone |")
    log("|---|---|---|---|---|")
    results = []
    for nbytes in OVERLAP_SIZES:
        x = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(x)

        def ours():
            basics._core.allreduce(x, hvd.Sum, f"overlap.{nbytes}")

        def raw():
            comm.Allreduce(x, out, op=MPI.SUM)

        ours()
        comm.Barrier()
        ours_alone = time_calls(ours, seconds / 2)
        comm.Barrier()
        raw_alone = time_calls(raw, seconds / 2)
        comm.Barrier()
        with ComputeThread() as beside:
            ours_beside = time_calls(ours, seconds)
        comm.Barrier()
        r = {"bytes": nbytes, "compute_share": beside.rate / alone.rate,
             "allreduce_beside_us": ours_beside * 1e6, "allreduce_alone_us": ours_alone * 1e6,
             "raw_alone_us": raw_alone * 1e6}
        results.append(r)
        log(f"| {r['bytes']} | {r['compute_share']:.2f} | {r['allreduce_beside_us']:.0f} us | "
            f"{r['allreduce_alone_us']:.0f} us | {r['raw_alone_us']:.0f} us |")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=None,
                        help="samples per measurement (default: adaptive, 40 for <=1 MiB down to 15 for >16 MiB)")
    parser.add_argument("--json", default=None, help="write all measured numbers to this file (rank 0)")
    parser.add_argument("--only", choices=("sizes", "storm", "chain", "overlap"), default=None,
                        help="run only part (a) or (b) (the target lines need both), or part (c) or (d), "
                             "which run only when asked for")
    parser.add_argument("--length", type=int, default=50, help="(c) chain length; the burst is 4x as many ops")
    parser.add_argument("--seconds", type=float, default=2.0, help="(d) length of each timed phase")
    args = parser.parse_args()
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")

    if not tf.config.experimental.get_synchronous_execution():
        fail("TensorFlow eager execution is asynchronous; timings would not include the work")
    record = harness.Record("allreduce_bench", path=args.json) if comm.rank == 0 else None
    hvd.init()
    if hvd.size() != comm.size:
        fail(f"tf_mpi has {hvd.size()} ranks but MPI_COMM_WORLD has {comm.size}")
    info = dict(ranks=hvd.size(), mpi_library=MPI.Get_library_version().replace("\x00", "").strip(),
                engine_config=basics._core.config(), intra_op_threads=1, inter_op_threads=2)
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TF_MPI_")}
    log("tf_mpi allreduce benchmark")
    if record:
        log(f"  command        : {record.info['command']}")
        log(f"  ranks          : {info['ranks']}   (TF {record.info['tensorflow']}, mpi4py {record.info['mpi4py']}; "
            f"{record.info['cores']} cores, load average {record.info['load_avg'][0]:.2f})")
    log(f"  MPI            : {info['mpi_library'].splitlines()[0]}")
    log(f"  engine config  : {info['engine_config']}")
    log(f"  TF_MPI_* env   : {env or '(none set)'}")
    log("  TF threads     : intra-op 1, inter-op 2")

    parts = {}
    if args.only in (None, "sizes"):
        parts["sizes"] = bench_sizes(args.repeats)
    if args.only in (None, "storm"):
        parts["gradient_storm"] = bench_storm(args.repeats)
    if args.only is None:
        parts["targets"] = target_checks(parts["sizes"], parts["gradient_storm"])
    if args.only == "chain":
        parts["chain"] = bench_chain(args.length, args.repeats or 20)
    if args.only == "overlap":
        parts["overlap"] = bench_overlap(args.seconds)
    if record:
        log(f"\nbenchmark time: {time.time() - record.began:.1f} s")
        if args.json:
            log(f"wrote {record.write(run=info, **parts)}")


if __name__ == "__main__":
    main()
