"""Sparse-gradient checks (tf_mpi.policy.sparse), run on every rank by tests/test_sparse.py.

Every rank builds every rank's IndexedSlices from the same seeds, so it can
compute the exact reduction in numpy on its own. Values are small integers:
their sums are exact in float32/float16/bfloat16 whatever the order of the
additions, so Sum (and Average over 2 ranks, a division by a power of two)
must match exactly; Average over 3 ranks divides at a different point in
the dense and the deduplicated paths and is compared within one rounding.
"""
import contextlib
import hashlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402
from _expect import raises  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi.keras as hvd  # noqa: E402
from tf_mpi.policy import sparse  # noqa: E402
from tf_mpi.basics import _core  # noqa: E402
from tf_mpi.policy.reducer import GradientReducer  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
V, W = 50, 3  # table rows, row width
DTYPES = {"float32": (tf.float32, 0.0), "float16": (tf.float16, 1e-3), "bfloat16": (tf.bfloat16, 1e-2)}
THRESHOLD_ENV = "TF_MPI_SPARSE_DEDUP_THRESHOLD"


@contextlib.contextmanager
def threshold_restored():
    """Puts TF_MPI_SPARSE_DEDUP_THRESHOLD back as it was, whatever the block sets it to."""
    previous = os.environ.get(THRESHOLD_ENV)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(THRESHOLD_ENV, None)
        else:
            os.environ[THRESHOLD_ENV] = previous


def rank_slices(case, rank):
    """(indices, values) of `rank` in one test case: numpy, integer-valued values."""
    rng = np.random.default_rng(100 * rank + len(case))
    if case == "duplicates":  # repeats inside the rank and rows shared with the other ranks
        idx = np.concatenate([rng.integers(0, 12, 9), [3, 3, 3, 7]])
    elif case == "one_rank_empty":  # the last rank looked up nothing this step
        idx = np.zeros([0], np.int64) if rank == N - 1 else rng.integers(0, V, 6)
    elif case == "all_rows":  # every row, twice, on every rank
        idx = np.concatenate([np.arange(V), rng.permutation(V)])
    elif case == "rank_dependent_density":  # rank 0 touches almost everything, the others a few rows
        idx = rng.integers(0, V, 4 * V) if rank == 0 else rng.integers(0, V, 3)
    else:
        raise ValueError(case)
    values = rng.integers(-3, 4, (len(idx), W)).astype(np.float32)
    return idx.astype(np.int64), values


def expected(case, op):
    total = np.zeros([V, W], np.float64)
    for r in range(N):
        idx, values = rank_slices(case, r)
        np.add.at(total, idx, values)
    return total / N if op == hvd.Average else total


def digest_identical(array, what):
    h = np.frombuffer(hashlib.sha256(np.ascontiguousarray(array).tobytes()).digest(), np.uint8).copy()
    digests = _core.allgather(h[None, :], f"digest.{what}")
    assert all(np.array_equal(digests[0], d) for d in digests), f"{what}: results differ across ranks"


_variable = tf.Variable(tf.zeros([V, W]))


def reduce_raw(mode, case, dtype, op, in_function=True):
    """This rank's IndexedSlices of `case`, reduced by a GradientReducer with sparse=mode: what it returns
    (numpy arrays: (indices, values) for an IndexedSlices, else the dense tensor)."""
    idx, values = rank_slices(case, R)
    reducer = GradientReducer(f"sp.{mode}.{case}.{dtype.name}.{op}.{in_function}", op=op, sparse=mode)

    def run(i, v):
        out = reducer.reduce([tf.IndexedSlices(v, i, tf.constant([V, W], tf.int64))], [_variable])[0]
        return (out.indices, out.values) if isinstance(out, tf.IndexedSlices) else out

    fn = tf.function(run) if in_function else run
    out = fn(tf.constant(idx), tf.constant(values, dtype))
    return tuple(t.numpy() for t in out) if isinstance(out, tuple) else out.numpy()


def reduce_once(mode, case, dtype, op, in_function=True):
    """reduce_raw's result as a dense table: (float64 copy, raw array); "dedup"'s IndexedSlices are
    checked first (each touched row once, in the canonical order) and then densified in numpy."""
    out = reduce_raw(mode, case, dtype, op, in_function)
    if mode == "dedup":
        indices, rows = out
        assert indices.dtype == np.int64 and rows.dtype == dtype.as_numpy_dtype, (indices.dtype, rows.dtype)
        assert np.array_equal(indices, touched_rows_in_rank_order(case)), (indices, touched_rows_in_rank_order(case))
        assert rows.shape == (len(indices), W), rows.shape
        digest_identical(indices, f"indices {mode} {case} {dtype.name} {op} {in_function}")
        dense = np.zeros([V, W], rows.dtype)
        dense[indices] = rows
        return dense.astype(np.float64), dense
    assert out.dtype == dtype.as_numpy_dtype and out.shape == (V, W), (out.dtype, out.shape)
    return out.astype(np.float64), out


def touched_rows_in_rank_order(case):
    """Every touched row once, in the order it first occurs in rank 0's ids, then rank 1's, ..."""
    order = []
    for r in range(N):
        for i in rank_slices(case, r)[0]:
            if i not in order:
                order.append(int(i))
    return np.array(order, np.int64)


def assert_matches(got, want, op, tolerance, what):
    exact = op == hvd.Sum or N == 2
    if exact:
        assert np.array_equal(got, want), f"{what}: max diff {np.max(np.abs(got - want))}"
    else:
        assert np.allclose(got, want, rtol=max(tolerance, 1e-6), atol=max(tolerance, 1e-6)), \
            f"{what}: max diff {np.max(np.abs(got - want))}"


def check_dedup_equals_dense_reduction_and_is_bit_identical_everywhere():
    for case in ("duplicates", "one_rank_empty", "all_rows"):
        for name, (dtype, tolerance) in DTYPES.items():
            for op in (hvd.Sum, hvd.Average):
                what = f"{case} {name} op={op}"
                want = expected(case, op)
                traced = dtype == tf.float32  # the 16-bit types eagerly: a trace per call costs seconds
                dense, _ = reduce_once("dense", case, dtype, op, in_function=traced)
                dedup, raw = reduce_once("dedup", case, dtype, op, in_function=traced)
                assert_matches(dense, want, op, tolerance, what + " dense")
                assert_matches(dedup, want, op, tolerance, what + " dedup")
                digest_identical(raw, what)
    assert np.any(expected("duplicates", hvd.Sum) != 0)


def check_dedup_returns_each_touched_row_once():
    # reduce_once checks the indices against touched_rows_in_rank_order; here, that this is a real
    # deduplication: fewer rows than allgather's, and no index twice.
    indices, rows = reduce_raw("dedup", "duplicates", tf.float32, hvd.Sum)
    assert len(np.unique(indices)) == len(indices), indices
    assert len(indices) < sum(len(rank_slices("duplicates", r)[0]) for r in range(N))
    want = expected("duplicates", hvd.Sum)
    assert np.array_equal(rows.astype(np.float64), want[indices])
    assert np.all(want[np.setdiff1d(np.arange(V), indices)] == 0)


def check_dedup_in_eager_mode():
    got, raw = reduce_once("dedup", "duplicates", tf.float32, hvd.Sum, in_function=False)
    assert np.array_equal(got, expected("duplicates", hvd.Sum))
    digest_identical(raw, "eager")


def allreduce_buckets():
    return _core.stats()["allreduce_buckets"]


def check_auto_takes_the_same_branch_everywhere_and_both_are_exact():
    # The threshold is forced (rank 0's value is broadcast): dedup while the gathered
    # touched rows T < threshold * V. In rank_dependent_density rank 0 touches ~0.98 V rows
    # and the others 3 each: at 0.9 a choice from each rank's own count would split the
    # ranks (rank 0 dense, the others dedup); T/V > 1 is the same everywhere: dense.
    with threshold_restored():
        for threshold, case, branch in (("1e9", "rank_dependent_density", "dedup"),
                                        ("0.9", "rank_dependent_density", "dense"),
                                        ("1.0", "all_rows", "dense"),
                                        ("1.0", "duplicates", "dedup"),
                                        ("0", "duplicates", "dense")):
            os.environ[THRESHOLD_ENV] = threshold if R == 0 else "7"  # only rank 0's value counts
            before = allreduce_buckets()
            got, raw = reduce_once("auto", case, tf.float32, hvd.Sum)
            dense_allreduces = allreduce_buckets() - before
            assert np.array_equal(got, expected(case, hvd.Sum)), f"auto {case} threshold {threshold}"
            digest_identical(raw, f"auto {case} {threshold}")
            assert dense_allreduces == (1 if branch == "dense" else 0), \
                f"{case} threshold {threshold}: wanted the {branch} branch, {dense_allreduces} dense allreduces ran"
            taken = _core.allgather(np.array([dense_allreduces], np.int64), f"branch.{case}.{threshold}")
            assert len(set(taken.tolist())) == 1, f"ranks took different branches: {taken}"


def check_measured_cost_model_is_rank_0s_everywhere():
    costs = sparse.measure_costs()
    assert sparse.measured_costs() is costs
    table = sparse.measure_costs(rows=100, width=W, table_rows=400)  # a table's own size, cached apart
    assert sparse.measured_costs() is table and table is not costs
    assert sparse.measure_costs() is costs and sparse.measured_costs() is costs
    values = np.array([costs.allreduce_beta, costs.allgather_beta, costs.scatter_gamma, costs.dedup_threshold])
    assert np.all(values > 0) and np.all(np.isfinite(values)), values
    gathered = _core.allgather(values[None, :], "costs")
    assert all(np.array_equal(gathered[0], g) for g in gathered), gathered


def embedding_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(V, 4, name="emb")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(x)))


def embedding_data(steps, batch):
    rng = np.random.default_rng(7)
    # A skewed vocabulary: frequent ids repeat inside each rank's batch and across ranks.
    x = np.minimum(rng.geometric(0.15, size=(steps * N * batch, 5)) - 1, V - 1).astype(np.int32)
    y = rng.normal(size=(steps * N * batch, 1)).astype(np.float32)
    return x, y


def shard(a, batch):
    steps = len(a) // (N * batch)
    return np.concatenate([a[s * N * batch + R * batch: s * N * batch + (R + 1) * batch] for s in range(steps)])


def weights_digest_identical(model, what):
    digest_identical(np.concatenate([w.ravel() for w in model.get_weights()]), what)


def densified(optimizer):
    """`optimizer` (the one-rank reference) applying an IndexedSlices gradient as its dense sum.

    Keras 3's Adam squares an IndexedSlices gradient row by row, so an id that occurs twice
    contributes g1^2 + g2^2 to the second moment instead of (g1 + g2)^2; the distributed
    result of sparse="dedup" (each touched row once) and "auto" (dense) equals one-rank
    training on the dense gradient."""
    class Densified(type(optimizer)):
        def apply(self, grads, trainable_variables=None):
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
            return super().apply(grads, trainable_variables)
    return Densified.from_config(optimizer.get_config())


def check_fit_with_embedding_matches_one_rank_on_the_global_batch():
    steps, batch = 4, 6
    x, y = embedding_data(steps, batch)
    for mode, make_opt in (("dedup", lambda: keras.optimizers.Adam(0.01)),
                           ("dedup", lambda: keras.optimizers.SGD(0.5)),  # applies the touched rows only
                           ("auto", lambda: keras.optimizers.SGD(0.2, momentum=0.9))):
        model = embedding_model(1)
        model.compile(optimizer=hvd.DistributedOptimizer(make_opt(), sparse=mode), loss="mse", jit_compile=False)
        model.fit(shard(x, batch), shard(y, batch), batch_size=batch, epochs=1, shuffle=False, verbose=0)
        ref = embedding_model(1)
        # eagerly: the same arithmetic as a traced step, without the tracing
        ref.compile(optimizer=densified(make_opt()), loss="mse", jit_compile=False, run_eagerly=True)
        ref.fit(x, y, batch_size=N * batch, epochs=1, shuffle=False, verbose=0)
        for a, b in zip(model.get_weights(), ref.get_weights()):
            assert np.allclose(a, b, rtol=1e-4, atol=1e-5), f"fit sparse={mode}: max diff {np.max(np.abs(a - b))}"
        assert not np.allclose(model.get_weights()[0], embedding_model(1).get_weights()[0]), "nothing trained"
        weights_digest_identical(model, f"fit.{mode}")


def check_tape_with_embedding_matches_one_rank_on_the_global_batch():
    steps, batch = 3, 6
    x, y = embedding_data(steps, batch)
    xs, ys = shard(x, batch), shard(y, batch)
    loss_fn = keras.losses.MeanSquaredError()
    for mode in ("dedup", "auto"):
        model, ref = embedding_model(2), embedding_model(2)
        opt, ref_opt = keras.optimizers.Adam(0.01), densified(keras.optimizers.Adam(0.01))

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            tape = hvd.DistributedGradientTape(tape, sparse=mode, name=f"tape.{mode}")
            grads = tape.gradient(loss, model.trainable_variables)
            # dedup hands the optimizer each touched row once; auto a dense table
            assert isinstance(grads[0], tf.IndexedSlices) == (mode == "dedup"), type(grads[0])
            opt.apply_gradients(zip(grads, model.trainable_variables))

        def ref_step(xb, yb):  # eagerly: the reference needs no graph
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, ref(xb, training=True))
            ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))

        for s in range(steps):
            step(xs[s * batch:(s + 1) * batch], ys[s * batch:(s + 1) * batch])
            ref_step(x[s * N * batch:(s + 1) * N * batch], y[s * N * batch:(s + 1) * N * batch])
            weights_digest_identical(model, f"tape.{mode}.{s}")
        for a, b in zip(model.get_weights(), ref.get_weights()):
            assert np.allclose(a, b, rtol=1e-4, atol=1e-5), f"tape sparse={mode}: max diff {np.max(np.abs(a - b))}"


def check_bad_sparse_arguments_fail_clearly():
    for bad in ("sparse", "Dedup", 1, True):
        raises(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse=bad), ValueError,
               "sparse= must be one of", "'auto'")
    raises(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=True, sparse="dedup"),
           ValueError, "sparse_as_dense=True", "sparse='dedup'")
    with tf.GradientTape() as tape:
        pass
    raises(lambda: hvd.DistributedGradientTape(tape, sparse="fast"), ValueError, "sparse= must be one of")
    ints = tf.IndexedSlices(tf.ones([2, W], tf.int32), tf.constant([0, 1]), tf.constant([V, W]))
    raises(lambda: GradientReducer("ints", sparse="dedup").reduce([ints], [_variable]), TypeError,
           "float gradients", "int32")
    with threshold_restored():
        os.environ[THRESHOLD_ENV] = "often"
        raises(lambda: reduce_once("auto", "duplicates", tf.float32, hvd.Sum), ValueError,
               "TF_MPI_SPARSE_DEDUP_THRESHOLD must be a number", "'often'")


def check_horovod_defaults_are_kept():
    assert sparse.resolve_mode(None, False) == sparse.DEFAULT_MODE
    assert sparse.resolve_mode(None, True) == "dense"
    assert sparse.resolve_mode("dense", True) == "dense"
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=True)
    assert opt._tfmpi_reducer.sparse == "dense" and opt._tfmpi_reducer.sparse_as_dense
    # sparse="allgather" (Horovod's default) keeps an IndexedSlices with every rank's rows.
    idx, values = rank_slices("duplicates", R)
    out = GradientReducer("hvd.allgather", op=hvd.Sum, sparse="allgather").reduce(
        [tf.IndexedSlices(tf.constant(values), tf.constant(idx), tf.constant([V, W], tf.int64))], [_variable])[0]
    assert isinstance(out, tf.IndexedSlices)
    assert out.indices.shape[0] == sum(len(rank_slices("duplicates", r)[0]) for r in range(N))
    assert np.array_equal(tf.convert_to_tensor(out).numpy(), expected("duplicates", hvd.Sum))


if __name__ == "__main__":
    run_checks(globals(), R)
