"""Per-op cost of small allreduces inside one tf.function: a chain and a burst.

    python -m tf_mpi.run -np 2 python benchmarks/chain_latency.py [--length 50] [--repeats 20]

Chain: `length` dependent 1 KiB allreduces, each feeding the next, so the
time per op is one full round trip through TensorFlow's executor and the
engine. Burst: 4 x `length` independent 1 KiB allreduces (one op per tensor,
as a gradient storm of small tensors submits them), so the time per op shows
whether the ops are negotiated together or one round trip after another.
Each is compared with the same graph of tf.identity (TensorFlow's own per-op
cost). Used to choose TF_MPI_SPIN_US / TF_MPI_POLL_US / TF_MPI_INLINE_*
(run it with different values).
"""
import argparse
import time

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

from mpi4py import MPI  # noqa: E402

import tf_mpi as hvd  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    hvd.init()
    x = tf.ones([256])
    scale = 1.0 / hvd.size()

    @tf.function
    def chain(t):
        for i in range(args.length):
            t = hvd.allreduce(t, op=hvd.Sum, postscale_factor=scale, name=f"chain.{i}")
        return t

    @tf.function
    def identity_chain(t):
        for _ in range(args.length):
            t = tf.identity(t) * 1.0
        return t

    burst_inputs = [tf.ones([256]) for _ in range(4 * args.length)]

    @tf.function
    def burst(ts):
        return [hvd.allreduce(t, op=hvd.Sum, postscale_factor=scale, name=f"burst.{i}") for i, t in enumerate(ts)]

    @tf.function
    def identity_burst(ts):
        return [tf.identity(t) * 1.0 for t in ts]

    assert np.allclose(chain(x).numpy(), 1.0)
    assert all(np.allclose(t.numpy(), 1.0) for t in burst(burst_inputs))
    identity_chain(x)
    identity_burst(burst_inputs)
    runs = {"chain": (lambda: chain(x), args.length), "identity chain": (lambda: identity_chain(x), args.length),
            "burst": (lambda: burst(burst_inputs), len(burst_inputs)),
            "identity burst": (lambda: identity_burst(burst_inputs), len(burst_inputs))}
    per_op = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (fn, ops) in runs.items():
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            fn()
            per_op[name].append((time.perf_counter() - t0) / ops)
    us = {name: np.median(v) * 1e6 for name, v in per_op.items()}
    if hvd.rank() == 0:
        print(f"per-op: allreduce chain {us['chain']:.0f} us; identity chain {us['identity chain']:.0f} us")
        print(f"per-op: allreduce burst of {len(burst_inputs)} {us['burst']:.0f} us; identity burst {us['identity burst']:.0f} us")
        print(f"({hvd.basics._core.config()})")


if __name__ == "__main__":
    main()
