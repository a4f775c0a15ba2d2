"""Adasum (op=hvd.Adasum) against a numpy reference of Horovod's recursion, run on every rank by
tests/test_horovod_api_compat.py at np=2, 3 and 4.

Horovod 0.28.1 (horovod/common/ops/adasum/adasum.h, horovod/tensorflow/__init__.py): ranks combine
pairwise in a binary tree, (0,1), (2,3), ... then the pairs' results; a pair (a, b) becomes
(1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b, dot products and norms in double, a coefficient of 1
where a squared norm is below sqrt(DBL_MIN); each tensor of a group has its own coefficients;
CPU tensors need a power-of-two number of ranks (NotImplementedError otherwise); IndexedSlices
are refused (NotImplementedError); the gradient of an Adasum allreduce is the Adasum of the
gradient. Every rank's inputs come from mpi4py's allgather, not from tf_mpi.
"""
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import SkipCheck, run_checks  # noqa: E402
from _expect import raises  # noqa: E402

import tensorflow as tf  # noqa: E402

import tf_mpi as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()

from mpi4py import MPI  # noqa: E402

WORLD = MPI.COMM_WORLD
POWER_OF_TWO = N & (N - 1) == 0
TINY = np.sqrt(np.finfo(np.float64).tiny)


def reference_pair(a, b):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dot, an, bn = float((a64 * b64).sum()), float((a64 * a64).sum()), float((b64 * b64).sum())
    ca = 1.0 - dot / an * 0.5 if an >= TINY else 1.0
    cb = 1.0 - dot / bn * 0.5 if bn >= TINY else 1.0
    return (ca * a64 + cb * b64).astype(a.dtype)   # a buffer of the tensor's dtype between levels


def reference(per_rank):
    level = list(per_rank)
    while len(level) > 1:
        level = [reference_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def everyone(a):
    """Every rank's array, in rank order (mpi4py)."""
    return [np.asarray(x) for x in WORLD.allgather(np.asarray(a))]


def data(shape, seed, dtype=np.float32, kind="mixed"):
    """This rank's values: random ('mixed'), or built so that pairs are parallel / orthogonal / zero."""
    rng = np.random.default_rng(seed * 100 + R)
    if kind == "parallel":
        base = np.random.default_rng(seed).standard_normal(shape)
        return (base * (R + 1)).astype(dtype)
    if kind == "orthogonal":
        x = np.zeros(shape)
        x.flat[R % x.size] = R + 1.0
        return x.astype(dtype)
    if kind == "zero_on_rank_0":
        return (np.zeros(shape) if R == 0 else rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def need_power_of_two():
    if not POWER_OF_TWO:
        raise SkipCheck(f"Adasum needs a power-of-two world (np={N}): the refusal is checked instead")


TOLERANCE = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3, ml_dtypes.bfloat16: 2e-2}


def close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = TOLERANCE[dtype]
    return np.allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def check_allreduce_matches_the_reference_for_every_float_dtype():
    need_power_of_two()
    for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        for i, kind in enumerate(("mixed", "parallel", "orthogonal", "zero_on_rank_0")):
            x = data((5, 3), 10 + i, dtype, kind)
            got = hvd.allreduce(tf.constant(x), op=hvd.Adasum, name=f"adasum.{np.dtype(dtype).name}.{kind}")
            assert got.dtype == tf.as_dtype(dtype), got.dtype
            want = reference(everyone(x))
            assert close(got.numpy(), want, dtype), (np.dtype(dtype).name, kind, got.numpy(), want)
    # Equal gradients average, orthogonal ones add (the rule's two ends).
    same = np.arange(4, dtype=np.float32) + 1
    assert np.allclose(hvd.allreduce(tf.constant(same), op=hvd.Adasum, name="adasum.same").numpy(), same)
    ortho = data((2 * N,), 0, np.float32, "orthogonal")
    assert np.allclose(hvd.allreduce(tf.constant(ortho), op=hvd.Adasum, name="adasum.ortho").numpy(),
                       np.sum(everyone(ortho), axis=0))


def check_grouped_allreduce_gives_each_tensor_its_own_coefficients():
    need_power_of_two()
    xs = [data((4,), 20), data((2, 3), 21, kind="parallel"), data((3,), 22, np.float64)]
    got = hvd.grouped_allreduce([tf.constant(x) for x in xs], op=hvd.Adasum, name="adasum.group")
    for g, x in zip(got, xs):
        want = reference(everyone(x))
        assert close(g.numpy(), want, x.dtype.type), (g.numpy(), want)
    # Not the Adasum of the concatenation (that would share one set of coefficients).
    flat = reference(everyone(np.concatenate([xs[0].ravel(), xs[1].ravel()])))
    assert not np.allclose(np.concatenate([got[0].numpy().ravel(), got[1].numpy().ravel()]), flat, rtol=1e-4)


def check_scale_factors_and_fp16_compression():
    need_power_of_two()
    x = data((6,), 30)
    got = hvd.allreduce(tf.constant(x), op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0,
                        name="adasum.scaled")
    assert close(got.numpy(), 3.0 * reference(everyone(0.5 * x)), np.float32), got.numpy()
    got = hvd.allreduce(tf.constant(x), op=hvd.Adasum, compression=hvd.Compression.fp16, name="adasum.fp16c")
    assert got.dtype == tf.float32
    want = reference(everyone(x.astype(np.float16)))   # the combination runs on the fp16 values
    assert close(got.numpy(), want, np.float16), (got.numpy(), want)


def check_inside_tf_function_and_the_gradient_is_adasum_of_the_gradient():
    need_power_of_two()
    x, upstream = data((4,), 40), data((4,), 41)

    @tf.function
    def step(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            y = hvd.allreduce(v, op=hvd.Adasum, name="adasum.fn")
        return y, tape.gradient(y, v, output_gradients=tf.constant(upstream))

    y, dy = step(tf.constant(x))
    assert close(y.numpy(), reference(everyone(x)), np.float32)
    assert close(dy.numpy(), reference(everyone(upstream)), np.float32), dy.numpy()


def check_tape_reduces_gradients_with_adasum():
    need_power_of_two()
    c1, c2 = data((3,), 50), data((2, 2), 51)
    w1, w2 = tf.Variable(np.ones(3, np.float32)), tf.Variable(np.ones((2, 2), np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w1 * c1) + tf.reduce_sum(w2 * c2)   # gradients c1, c2
    g1, g2 = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [w1, w2])
    assert close(g1.numpy(), reference(everyone(c1)), np.float32), g1.numpy()
    assert close(g2.numpy(), reference(everyone(c2)), np.float32), g2.numpy()


def check_refusals_as_horovod():
    if POWER_OF_TWO:
        raises(lambda: hvd.allreduce(tf.constant([1, 2]), op=hvd.Adasum), ValueError, "Adasum")
        slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
        raises(lambda: hvd.allreduce(slices, op=hvd.Adasum), NotImplementedError, "sparse_as_dense=True")
    else:
        raises(lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum), NotImplementedError, "non-power of 2")
        raises(lambda: hvd.grouped_allreduce([tf.ones([2])], op=hvd.Adasum), NotImplementedError, "non-power of 2")
    assert hvd.check_num_rank_power_of_2(N) == POWER_OF_TWO
    # Horovod 0.28.1: a Keras optimizer takes no Adasum, through either entry point, checked before any
    # communication: horovod.tensorflow's DistributedOptimizer names Adasum, the Keras module's refuses
    # every op but Average and Sum.
    import keras
    import tf_mpi.keras as hvd_keras
    for make, words in ((hvd.DistributedOptimizer, "op == Adasum is not supported yet with Keras"),
                        (hvd_keras.DistributedOptimizer, "op=Average or op=Sum")):
        raises(lambda: make(keras.optimizers.SGD(0.1), op=hvd.Adasum), ValueError, words)


if __name__ == "__main__":
    run_checks(globals(), R)
