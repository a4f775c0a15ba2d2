"""Per-step cost checks, run on every rank by tests/test_step_cost.py.

What a training step asks of the engine: an IndexedSlices gradient reduced the Horovod way
(allgathered) is one collective, its values and indices gathered together; a Keras step of a
model with an Embedding submits one grouped allreduce for the dense gradients and one
allgather for the Embedding's. Every rank builds every rank's inputs from the same seeds, so
it computes the expected results in numpy on its own.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi  # noqa: E402
import tf_mpi.keras as hvd  # noqa: E402
from tf_mpi.basics import _core  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
V, W = 40, 3  # table rows, row width


def rank_rows(rank, index_dtype):
    """Rank `rank`'s IndexedSlices parts: rank r has 2r rows (rank 0 none), duplicate ids included."""
    rng = np.random.default_rng(100 + rank)
    n = 2 * rank
    idx = rng.integers(0, V, n).astype(index_dtype)
    if n >= 2:
        idx[1] = idx[0]  # a duplicate inside the rank
    values = rng.integers(-8, 8, (n, W)).astype(np.float32)
    return idx, values


def requests():
    return int(_core.stats()["requests"])


def check_indexed_slices_allreduce_gathers_values_and_indices_as_one_collective():
    for index_dtype in (np.int32, np.int64):
        idx, values = rank_rows(R, index_dtype)
        slices = tf.IndexedSlices(tf.constant(values.reshape(-1, W)), tf.constant(idx),
                                  tf.constant([V, W], tf.int64))

        @tf.function
        def reduce(s, op):
            out = tf_mpi.allreduce(s, op=op, name=f"stepcost.slices.{np.dtype(index_dtype).name}.{op}")
            assert isinstance(out, tf.IndexedSlices)
            return out.values, out.indices, out.dense_shape

        parts = [rank_rows(r, index_dtype) for r in range(N)]
        want_idx = np.concatenate([p[0] for p in parts])
        want_values = np.concatenate([p[1].reshape(-1, W) for p in parts])
        for op, divisor in ((hvd.Sum, 1), (hvd.Average, N)):
            before = requests()
            values_out, indices_out, shape_out = reduce(slices, op)
            assert requests() - before == 1, f"{requests() - before} collectives for one IndexedSlices"
            assert indices_out.dtype == tf.as_dtype(index_dtype)
            assert np.array_equal(indices_out.numpy(), want_idx)
            # Sum exactly; Average within one float32 rounding (TensorFlow may multiply by 1/N).
            assert np.allclose(values_out.numpy(), want_values / divisor, rtol=2e-7, atol=0)
            assert np.array_equal(shape_out.numpy(), [V, W])


def check_indexed_slices_allreduce_eager_and_unnamed():
    idx, values = rank_rows(R, np.int64)
    out = tf_mpi.allreduce(tf.IndexedSlices(tf.constant(values.reshape(-1, W)), tf.constant(idx),
                                         tf.constant([V, W], tf.int64)), op=hvd.Sum)
    parts = [rank_rows(r, np.int64) for r in range(N)]
    assert np.array_equal(out.indices.numpy(), np.concatenate([p[0] for p in parts]))
    assert np.array_equal(out.values.numpy(), np.concatenate([p[1].reshape(-1, W) for p in parts]))


def check_keras_step_with_embedding_submits_two_collectives():
    """model.fit with DistributedOptimizer's defaults: per step one grouped allreduce (dense
    gradients) and one allgather (the Embedding's rows), and every rank ends with the same weights."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(V, 4),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(R)
    x = rng.integers(0, V, (32, 5)).astype(np.int32)
    y = rng.random((32, 1)).astype(np.float32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # traces, broadcasts
    before = requests()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # 4 steps
    per_step = (requests() - before) / 4
    assert per_step == 2, f"{per_step} collectives per step"
    flat = np.concatenate([w.numpy().ravel() for w in model.weights]).astype(np.float64)
    lo = _core.allreduce(flat, hvd.Min, "stepcost.weights.min")
    hi = _core.allreduce(flat, hvd.Max, "stepcost.weights.max")
    assert np.array_equal(lo, hi), "ranks ended with different weights"


def check_overlap_is_zero_without_probing_where_ranks_share_every_core():
    """The default probe's shortcut: with no GPU and at most one core per rank (this test's
    launches: 2 or 3 ranks on a machine of at most 2 cores, or ranks bound to one core), the
    overlap is 0.0 after one collective (rank 0's answer), instead of ~1 s of probing; elsewhere
    the probe runs as before."""
    from tf_mpi.policy import overlap_probe
    expected = not tf.config.list_physical_devices("GPU") and min(
        len(os.sched_getaffinity(0)), os.cpu_count() / _core.local_size()) <= 1
    assert overlap_probe.shares_cores_with_backprop() == expected
    forced = os.environ.pop("TF_MPI_OVERLAP", None)
    try:
        before = requests()
        overlap = overlap_probe.measure_overlap()
        if expected:
            assert overlap == 0.0 and requests() - before == 1, (overlap, requests() - before)
        else:
            assert 0.0 <= overlap <= 1.0 and requests() - before > 1
    finally:
        if forced is not None:
            os.environ["TF_MPI_OVERLAP"] = forced


if __name__ == "__main__":
    run_checks(globals(), R)
