"""Per-op latency of a chain of dependent 1 KiB allreduces inside one tf.function.

    python -m tf_mpi.run -np 2 python benchmarks/chain_latency.py [--length 50] [--repeats 20]

Each op feeds the next, so the time per op is one full round trip through
TensorFlow's executor and the engine. Compare with the identity chain (the
same graph with tf.identity: TensorFlow's own per-op cost). Used to choose
TF_MPI_SPIN_US / TF_MPI_POLL_US (run it with different values).
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

    assert np.allclose(chain(x).numpy(), 1.0)
    identity_chain(x)
    ours, floor = [], []
    for _ in range(args.repeats):
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        chain(x)
        ours.append((time.perf_counter() - t0) / args.length)
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        identity_chain(x)
        floor.append((time.perf_counter() - t0) / args.length)
    if hvd.rank() == 0:
        print(f"per-op: allreduce chain {np.median(ours) * 1e6:.0f} us; identity chain {np.median(floor) * 1e6:.0f} us "
              f"({hvd.basics._core.config()})")


if __name__ == "__main__":
    main()
