"""Bytes per step and step time of gradient compression: none / fp16 / topk / gtopk.

Run under mpirun; every mode trains the same model with DistributedGradientTape
and Adam on synthetic data, in interleaved rounds (mode A, B, C, D, then B, C, D,
A, ...: benchmarks/harness.py's rotation) so that a busy machine slows all modes
alike. Per mode it prints the payload bytes each rank handed to MPI per step (the
engine's byte counters), the
median step time with its spread over rounds, and the time the top-k work
itself costs on this machine (residual add and selection, packing, the merge,
the dense result, residual update, with the exchange left out), measured in
the same process.

From those, the alpha-beta cost model gives the network bandwidth below
which top-k pays: per step it saves beta * (W_dense - W_sparse) of wire time
(W: bytes each rank puts on the wire, ring allreduce 2(N-1)/N * 4n, top-k
allgather (N-1) * 8k, gTop-k log2(N) * 8k) and costs C of compute plus
alpha per extra message (fewer messages than a ring allreduce's 2(N-1): a gain), so it pays below
bandwidth = (W_dense - W_sparse) / (C + alpha * extra_messages).

Example::

    python -m tf_mpi.run -np 2 python benchmarks/compression_bench.py --model mlp --rounds 5 \\
        --json benchmarks/results/compression_bench_mlp_np2.json

The JSON (benchmarks/harness.py's record) also holds the machine the run was made on.
"""
import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras  # noqa: E402

import harness  # noqa: E402
from bench_models import MODELS  # noqa: E402

import tf_mpi as hvd  # noqa: E402
from tf_mpi.basics import _core  # noqa: E402
from tf_mpi.policy.topk_compression import (  # noqa: E402
    _intersect, accumulate_and_select, merge_topk, residual_after, select_topk)

MODES = ("none", "fp16", "topk", "gtopk")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--ratio", type=float, default=0.01, help="top-k ratio")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--alpha-us", type=float, default=50.0,
                   help="per-message latency of the network the break-even is computed for (microseconds)")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    return p.parse_args()


def compressor(mode, ratio):
    if mode in ("topk", "gtopk"):
        return getattr(hvd.Compression, mode)(ratio)
    return hvd.Compression.fp16 if mode == "fp16" else hvd.Compression.none


def make_step(model, loss_fn, mode, ratio):
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    compression = compressor(mode, ratio)
    if mode in ("topk", "gtopk"):
        compression.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        # One group: the same collectives per step in every mode; Embedding gradients densified
        # (top-k densifies them anyway), so "none" is the dense allreduce top-k is measured against.
        tape = hvd.DistributedGradientTape(tape, compression=compression, sparse_as_dense=True,
                                           groups=1, name=f"bench.{mode}")
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss
    return step


def local_topk_cost(model, ratio, repeats=20):
    """Seconds per step of gTop-k's own work at 2 ranks on this rank's gradients, without the exchange:
    residual add and selection, packing to bytes and back, the merge with a partner's k pairs, the
    dense result and the residual update (top-k has the same work with a sparse sum for the merge)."""
    variables = model.trainable_variables
    residuals = [tf.Variable(tf.zeros_like(v)) for v in variables]
    grads = [tf.random.normal(v.shape) for v in variables]
    ks = [max(1, math.ceil(ratio * v.shape.num_elements())) for v in variables]
    partner = [select_topk(tf.random.normal(v.shape), k) for v, k in zip(variables, ks)]

    @tf.function
    def work():
        out = []
        for g, r, k, other in zip(grads, residuals, ks, partner):
            n = g.shape.num_elements()
            acc, idx, val = accumulate_and_select(g, r, k)
            payload = tf.concat([tf.reshape(tf.bitcast(idx, tf.uint8), [-1]),
                                 tf.reshape(tf.bitcast(val, tf.uint8), [-1])], 0)
            back_idx = tf.bitcast(tf.reshape(payload[:4 * k], [k, 4]), tf.int32)
            back_val = tf.bitcast(tf.reshape(payload[4 * k:], [k, 4]), tf.float32)
            merged_idx, merged_val = merge_topk((back_idx, back_val), other, k)
            out.append(tf.reshape(tf.scatter_nd(merged_idx[:, None], merged_val, [n]), g.shape))
            r.assign(tf.reshape(residual_after(acc, _intersect(idx, merged_idx)), r.shape))
        return out

    work()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        work()[0].numpy()
        times.append(time.perf_counter() - t)
    # The fastest repeat is the cost on a free core; the median shows what load adds.
    return {"min": min(times), "median": statistics.median(times)}


def wire_bytes(mode, n_elems, ks, n_ranks):
    """Bytes each rank puts on the wire per step under the usual algorithms (float32 gradients)."""
    if mode == "none":
        return 2 * (n_ranks - 1) / n_ranks * 4 * n_elems
    if mode == "fp16":
        return 2 * (n_ranks - 1) / n_ranks * 2 * n_elems
    k = sum(ks)
    if mode == "topk":
        return (n_ranks - 1) * 8 * k
    # gTop-k, the busiest rank: log2(P) rounds of 8k among the largest power of two P <= N; past
    # P, the result goes back as indices from one rank and values from another (4k bytes each,
    # 8k for some ranks once more than P/2 ranks are past P).
    pow2 = 1 << (n_ranks.bit_length() - 1)
    extras = n_ranks - pow2
    back = 0 if extras == 0 else 4 if 2 * extras <= pow2 else 8
    return (8 * int(math.log2(pow2)) + back) * k


def gtopk_messages(n_ranks):
    """Messages the busiest rank sends per step under gTop-k: one per round, one more past a power of two."""
    pow2 = 1 << (n_ranks.bit_length() - 1)
    return int(math.log2(pow2)) + (1 if n_ranks > pow2 else 0)


def main():
    args = parse()
    record = harness.Record("compression_bench", path=args.json)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    spec = MODELS[args.model]
    steps = args.steps or max(4, spec.timed_steps // 4)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(rank)
    x, y = spec.make_inputs(rng, args.batch_size)
    x, y = tf.constant(x), tf.constant(y)
    loss_fn = keras.losses.get(spec.loss)

    models, step_fns = {}, {}
    for mode in MODES:
        keras.utils.set_random_seed(0)
        models[mode] = spec.build()
        step_fns[mode] = make_step(models[mode], loss_fn, mode, args.ratio)
        step_fns[mode](x, y)  # trace, and the first exchange
    n_elems = sum(int(np.prod(v.shape)) for v in models["none"].trainable_variables)
    ks = [max(1, math.ceil(args.ratio * int(np.prod(v.shape)))) for v in models["none"].trainable_variables]

    times = {m: [] for m in MODES}
    payload = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in harness.rotation(MODES, r):
            hvd.allreduce(tf.zeros([1]), name="bench.barrier")  # start together
            before = _core.stats()["payload_bytes_sent"]
            t = time.perf_counter()
            for _ in range(steps):
                loss = step_fns[mode](x, y)
            loss.numpy()
            times[mode].append((time.perf_counter() - t) / steps)
            payload[mode].append((_core.stats()["payload_bytes_sent"] - before) / steps)
    cost = local_topk_cost(models["none"], args.ratio)

    # Rank 0 reports the median over rounds of the slowest rank's step time.
    everyone = hvd.allgather_object({"times": times, "payload": payload, "cost": cost}, name="bench.results")
    if rank != 0:
        return
    result = {"model": args.model, "description": spec.description, "ranks": size, "ratio": args.ratio,
              "batch_size": args.batch_size, "steps": steps, "rounds": args.rounds, "parameters": n_elems,
              "modes": {}, "topk_compute_seconds_per_step": max(e["cost"]["min"] for e in everyone),
              "topk_compute_seconds_per_step_median": max(e["cost"]["median"] for e in everyone),
              "alpha_seconds": args.alpha_us * 1e-6}
    for mode in MODES:
        per_round = [max(e["times"][mode][i] for e in everyone) for i in range(args.rounds)]
        per_rank_bytes = [statistics.median(e["payload"][mode]) for e in everyone]
        result["modes"][mode] = {
            "step_ms_median": 1e3 * statistics.median(per_round),
            "step_ms_min": 1e3 * min(per_round), "step_ms_max": 1e3 * max(per_round),
            "payload_bytes_per_step_per_rank": per_rank_bytes,
            "wire_bytes_per_step_per_rank_model": wire_bytes(mode, n_elems, ks, size)}
    dense = result["modes"]["none"]
    c = result["topk_compute_seconds_per_step"]
    print(f"compression_bench: {args.model} ({n_elems} parameters), {size} ranks, ratio {args.ratio}, "
          f"{steps} steps x {args.rounds} interleaved rounds; step time: median [min, max] over rounds")
    print(f"{'mode':6} {'payload B/step (rank 0)':>24} {'reduction':>9} {'wire B/step (model)':>20} "
          f"{'step ms':>24} {'vs none':>7}")
    for mode in MODES:
        m = result["modes"][mode]
        b = m["payload_bytes_per_step_per_rank"][0]
        red = max(dense["payload_bytes_per_step_per_rank"]) / max(m["payload_bytes_per_step_per_rank"])
        m["payload_reduction_vs_none"] = red
        print(f"{mode:6} {b:>24.0f} {red:>8.1f}x {m['wire_bytes_per_step_per_rank_model']:>20.0f} "
              f"{m['step_ms_median']:>8.2f} [{m['step_ms_min']:.2f}, {m['step_ms_max']:.2f}] "
              f"{m['step_ms_median'] / dense['step_ms_median']:>6.2f}x")
    # Messages per rank and step: ring allreduce 2(N-1), ring allgather N-1, gTop-k one per round.
    rounds = gtopk_messages(size)
    extra_messages = {"topk": (size - 1) - 2 * (size - 1), "gtopk": rounds - 2 * (size - 1)}
    for mode in ("topk", "gtopk"):
        saved = dense["wire_bytes_per_step_per_rank_model"] - result["modes"][mode]["wire_bytes_per_step_per_rank_model"]
        bw = saved / (c + args.alpha_us * 1e-6 * extra_messages[mode])
        result["modes"][mode]["break_even_bytes_per_second"] = bw
        print(f"{mode}: top-k work {1e3 * c:.2f} ms/step (fastest of 20; median "
              f"{1e3 * result['topk_compute_seconds_per_step_median']:.2f}); saves {saved / 1e6:.2f} MB/step of wire per rank; "
              f"pays below {bw * 8 / 1e9:.2f} Gbit/s (alpha {args.alpha_us:g} us, "
              f"{extra_messages[mode]} extra messages)")
    if args.json:
        record.write(**result)


if __name__ == "__main__":
    main()
