"""How much of an allreduce hides behind computation on this machine: the
overlap term of the grouping plan's cost model.

The alpha-beta model prices a message but does not say whether a group sent
while backprop still runs is free. That depends on the machine. With a GPU
computing, or a network card moving the bytes, the transfer runs beside the
computation. With every core computing and the ranks talking through shared
memory, the transfer is CPU work on a core that backprop needs: a group sent
early slows backprop by about what it saves, and sending it as a message of
its own only adds a start-up (docs/performance.md, "Communication beside
computation on a shared core"). Which case holds is measured, not guessed:
on every rank at once, a compute kernel alone (``t_c``), a 16 MiB allreduce
alone (``t_m``) and both together (``t_b``)::

    overlap = (t_c + t_m - t_b) / min(t_c, t_m), clipped to [0, 1]

1: each runs as if the other were not there; 0: together they take as long as
one after the other, or longer. The compute kernel is TensorFlow matmuls on
the default device with the process's own thread pools, i.e. what backprop
gets. ``TF_MPI_OVERLAP`` (a number in [0, 1]) skips the probe.

Where the answer is known without measuring, the default probe is skipped: on a
CPU-only node with at most one core per rank (``cores_per_rank``), backprop
keeps every core busy and the engine's communication is CPU work on those same
cores, so the overlap is 0. The measurement agrees on a quiet machine (0.00 with
2 ranks on 2 cores), but on one busy with other work its fastest-of-5 rounds of
three noisy timings read well above 0 in some launches, and the plan then cut
the benchmark MLP's one gradient group into three (three negotiations and
hand-offs per step instead of one, for no overlap) or the LSTM's into two, a
different plan from launch to launch. Rank 0's node decides for every rank.

Not measured here: a GPU (none on the development machine). There the kernel
runs on the GPU and the probe's allreduce moves host memory, so the figure
says how much the CPU side of communication disturbs GPU compute, not how a
CUDA-aware transfer of device memory overlaps it.

Example::

    import tf_mpi as hvd
    from tf_mpi.policy.overlap_probe import measure_overlap
    hvd.init()
    print(measure_overlap())   # e.g. 0.0 with 2 ranks on 2 busy cores
"""
import os
import statistics
import threading
import time

import numpy as np

# Large enough that thread start-up and wake-ups (~0.1-1 ms) are small beside it.
PROBE_BYTES = 16 << 20
# The compute kernel runs at least this many times as long as the allreduce, so
# the allreduce can hide completely if the machine allows it.
COMPUTE_TO_COMM = 3


def numpy_matmul_kernel(n=256):
    """A compute kernel for the probe: `k` n x n float32 matmuls in numpy, on the CPU."""
    a = np.random.default_rng(12).random((n, n), dtype=np.float32)

    def compute(k):
        for _ in range(k):
            a @ a
    return compute


def tf_matmul_kernel(n=256):
    """A compute kernel for the probe: `k` eager n x n matmuls on the default device.

    Where no eager context exists to run them in (a TF1-style graph built for
    ``Session.run``, with eager execution disabled or under ``Graph.as_default``
    at the outermost level), the kernel is numpy's (CPU) instead: the probe then
    adds nothing to the user's graph and needs no session.
    """
    import tensorflow as tf
    with tf.init_scope():
        if not tf.executing_eagerly():
            return numpy_matmul_kernel(n)
        a = tf.random.stateless_uniform([n, n], seed=[1, 2])

    def compute(k):
        with tf.init_scope():  # run eagerly even when called while a tf.function traces
            for _ in range(k):
                y = tf.matmul(a, a)
            y.numpy()  # waits for an asynchronous device
    return compute


def cores_per_rank():
    """CPU cores this rank can count on: those it may run on (its affinity), at most the node's
    cores shared out among the node's ranks. Example: 1 with 2 ranks on a 2-core machine."""
    from tf_mpi.basics import _core
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = os.cpu_count() or 1
    return min(mine, (os.cpu_count() or 1) / max(_core.local_size(), 1))


def shares_cores_with_backprop():
    """Whether computation here is CPU work with no core to spare for communication: no GPU
    visible to TensorFlow and at most one core per rank (cores_per_rank)."""
    import tensorflow as tf
    return not tf.config.list_physical_devices("GPU") and cores_per_rank() <= 1


def _median_time(fn, sync, repeats):
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_overlap(compute=None, nbytes=PROBE_BYTES, rounds=5):
    """Share of an allreduce's time that hides behind computation (collective).

    Args:
      compute: `compute(k)` runs k units of work; default tf_matmul_kernel().
      nbytes: size of the probe allreduce.
      rounds: interleaved measurements of compute alone, allreduce alone and both
        together; each one's fastest round is used.

    Returns rank 0's value in [0, 1] on every rank (1.0 on one rank, or
    TF_MPI_OVERLAP when set; 0.0 without measuring when `compute` is the default and rank 0's
    node has no core to spare, shares_cores_with_backprop).

    Example::

        overlap = measure_overlap(lambda k: time.sleep(0.001 * k))   # close to 1
    """
    forced = os.environ.get("TF_MPI_OVERLAP")
    if forced:
        return min(max(float(forced), 0.0), 1.0)
    from tf_mpi.basics import _core, Sum
    if _core.size() == 1:
        return 1.0
    if compute is None:
        # The default kernel is backprop's own: where it keeps every core busy, nothing overlaps.
        # Rank 0's answer for every rank (one small collective), so all ranks probe or none.
        shared = np.array([1.0 if shares_cores_with_backprop() else 0.0], np.float64)
        if _core.broadcast(shared, 0, "tfmpi.overlap.shared_cores")[0] == 1.0:
            return 0.0
    compute = compute or tf_matmul_kernel()
    x = np.ones(nbytes // 4, np.float32)
    one = np.zeros(1, np.float32)

    def sync():
        _core.allreduce(one, Sum, "tfmpi.overlap.sync")

    def comm():
        _core.allreduce(x, Sum, "tfmpi.overlap.comm")

    comm()
    compute(1)  # warm-up: first-call costs are not computation
    t_comm = _median_time(comm, sync, 3)
    # Double the work until it takes COMPUTE_TO_COMM allreduces. Rank 0's times
    # decide, so every rank runs the same loop and the same work.
    k = 1
    while k < 4096:
        measured = np.array([_median_time(lambda: compute(k), sync, 2), t_comm], np.float64)
        t_k, t_m = _core.broadcast(measured, 0, "tfmpi.overlap.calibrate")
        if t_k >= COMPUTE_TO_COMM * t_m:
            break
        k *= 2

    def together():
        errors = []

        def comm_thread():
            try:
                comm()
            except Exception as e:  # re-raised in the caller below
                errors.append(e)
        thread = threading.Thread(target=comm_thread)
        thread.start()
        compute(k)
        thread.join()
        if errors:
            raise errors[0]

    # Interleaved rounds: this kind of machine drifts by tens of percent within seconds.
    # Fastest, not median: the question is what the machine allows. With the median,
    # 1 of 8 probes of a free-core kernel read 0.27 instead of ~0.92: 3 of its 5 runs
    # of `together` were ~3 ms slow, which is most of a ~4 ms allreduce.
    samples = [[_median_time(fn, sync, 1) for fn in (lambda: compute(k), comm, together)]
               for _ in range(rounds)]
    t_c, t_m, t_b = (min(column) for column in zip(*samples))
    overlap = min(max((t_c + t_m - t_b) / min(t_c, t_m), 0.0), 1.0)
    return float(_core.broadcast(np.array([overlap], np.float64), 0, "tfmpi.overlap.share")[0])
