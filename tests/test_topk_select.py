"""The top-k kernels of cpp/tf/topk_select.cc against numpy (single process; the compressors built on
them are checked under mpirun in compression_worker.py).

The contract: the k largest magnitudes, ties to the lower index, NaN above every magnitude (infinity
included), -0 and +0 equal, winners in ascending index order; the merge sums two sparse sets and
keeps the k largest of the sum by the same rule."""
import numpy as np
import pytest
import tensorflow as tf

from tf_mpi.policy.topk_compression import accumulate_and_select, merge_topk, residual_after, select_topk

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]


def np_select(x, k):
    """Reference: order by (NaN first, larger |x| first, lower index first), winners ascending."""
    x = np.asarray(x, np.float64)
    nan = np.isnan(x)
    order = np.lexsort((np.arange(x.size), -np.where(nan, 0.0, np.abs(x)), ~nan))
    return np.sort(order[:min(k, x.size)])


def as_f64(t):
    return tf.cast(t, tf.float64).numpy()


def cases():
    rng = np.random.default_rng(7)
    ties = (rng.integers(-4, 5, 5000) * 0.25).astype(np.float32)  # many exact ties and zeros, both signs
    special = rng.standard_normal(3000).astype(np.float32)
    special[[3, 500, 2999]] = np.nan
    special[[10, 11]] = [np.inf, -np.inf]
    special[20:30] = -0.0
    big = rng.standard_normal(300_000).astype(np.float32)  # past the size where the threshold is sampled
    big_ties = (rng.integers(-2, 3, 200_000) * 0.5).astype(np.float32)  # sampled threshold, heavy ties
    constant = np.full(100_000, -1.5, np.float32)  # every entry ties: the first k
    sparse = np.zeros(200_000, np.float32)  # a densified embedding gradient: mostly zeros, some -0
    sparse[rng.choice(200_000, 2000, replace=False)] = rng.standard_normal(2000).astype(np.float32)
    sparse[1::97] *= -1.0
    return [
        ("ties", ties, [1, 7, 250, 4999, 5000, 6000]),
        ("nan_inf_zero", special, [1, 2, 3, 5, 6, 100, 3000]),
        ("gaussian_300k", big, [1, 3000, 75_000, 200_000]),
        ("ties_200k", big_ties, [1, 2000, 50_000]),
        ("constant", constant, [1, 1000]),
        ("mostly_zeros", sparse, [1, 1999, 2000, 2001, 10_000, 150_000]),
        ("all_zeros", np.zeros(50_000, np.float32), [1, 7, 12_000]),
        ("single", np.array([-2.0], np.float32), [1, 3]),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_select_matches_numpy(dtype):
    for name, x, ks in cases():
        t = tf.cast(tf.constant(x), dtype)
        xv = as_f64(t)  # the values after rounding to dtype: ties are the rounded ones
        for k in ks:
            idx, val = select_topk(t, k)
            want = np_select(xv, k)
            np.testing.assert_array_equal(idx.numpy(), want, err_msg=f"{name} {dtype.name} k={k}")
            np.testing.assert_array_equal(as_f64(val), xv[want], err_msg=f"{name} {dtype.name} k={k}")
            assert idx.shape == [min(k, x.size)] and val.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_accumulate_is_the_sum_and_its_selection(dtype):
    rng = np.random.default_rng(3)
    for n, k in [(40_000 * 9, 3600), (1000, 10), (17, 17)]:
        g = tf.cast(tf.constant(rng.standard_normal(n).astype(np.float32).reshape(-1, 9 if n % 9 == 0 else 1)), dtype)
        r = tf.cast(tf.constant(rng.standard_normal(n).astype(np.float32).reshape(g.shape) * 0.1), dtype)
        acc, idx, val = accumulate_and_select(g, r, k)
        np.testing.assert_array_equal(as_f64(acc), as_f64(tf.reshape(g + r, [-1])))
        np.testing.assert_array_equal(idx.numpy(), np_select(as_f64(acc), k))
        np.testing.assert_array_equal(as_f64(val), as_f64(acc)[idx.numpy()])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_merge_sums_and_keeps_the_k_largest(dtype):
    rng = np.random.default_rng(5)
    n, k = 10_000, 400
    for trial in range(3):
        sets = []
        for _ in range(2):
            i = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
            v = (rng.integers(-8, 9, k) * 0.25).astype(np.float32)  # ties after summing too
            sets.append((i, v))
        if trial == 1:
            sets[1] = (sets[0][0].copy(), sets[1][1])  # every index in both sets
        a = (tf.constant(sets[0][0]), tf.cast(tf.constant(sets[0][1]), dtype))
        b = (tf.constant(sets[1][0]), tf.cast(tf.constant(sets[1][1]), dtype))
        union = np.union1d(sets[0][0], sets[1][0])
        summed = np.zeros(union.size, np.float64)
        for i, v in (a, b):
            np.add.at(summed, np.searchsorted(union, i.numpy()), as_f64(v))
        summed = as_f64(tf.cast(summed, dtype))  # quarter-integers: exact in every dtype
        want = np_select(summed, k)
        for x, y in ((a, b), (b, a)):  # both partners get the same pairs
            idx, val = merge_topk(x, y, k)
            np.testing.assert_array_equal(idx.numpy(), union[want])
            np.testing.assert_array_equal(as_f64(val), summed[want])
    # Sets not in index order are sorted first.
    idx, val = merge_topk((tf.constant([5, 1], tf.int32), tf.constant([1.0, -3.0], dtype)),
                          (tf.constant([1], tf.int32), tf.constant([1.0], dtype)), 1)
    assert idx.numpy().tolist() == [1] and as_f64(val).tolist() == [-2.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_residual_zeroes_the_sent_and_the_non_finite(dtype):
    x = np.array([1.0, -2.0, np.nan, np.inf, -np.inf, 3.0, -0.5], np.float32)
    got = residual_after(tf.cast(tf.constant(x), dtype), tf.constant([1, 5], tf.int32))
    np.testing.assert_array_equal(as_f64(got), [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5])
    with pytest.raises(tf.errors.InvalidArgumentError):
        residual_after(tf.cast(tf.constant(x), dtype), tf.constant([7], tf.int32))


def test_select_when_the_sampled_threshold_lets_too_few_through():
    """The kernel estimates its threshold from 4096 sampled entries (one per stride, at an offset
    from a fixed LCG); making exactly those entries the largest makes the estimate too high, and
    the kernel must lower it until k entries pass."""
    n, samples = 4096 * 64, 4096
    stride = n // samples
    h, positions = 0x9E3779B9, []
    for j in range(samples):
        h = (h * 1664525 + 1013904223) % (1 << 32)
        positions.append(j * stride + h % stride)
    x = np.random.default_rng(2).uniform(-1, 1, n).astype(np.float32)
    x[positions] = 2.0
    for k in (5000, 20_000, 65_536):
        idx, _ = select_topk(tf.constant(x), k)
        np.testing.assert_array_equal(idx.numpy(), np_select(x, k))


def test_select_in_a_function_has_a_static_shape():
    @tf.function
    def f(x):
        idx, val = select_topk(x, 30)
        return idx, val

    cf = f.get_concrete_function(tf.TensorSpec([100, 10], tf.float32))
    assert cf.structured_outputs[0].shape == [30]
    idx, _ = f(tf.reshape(tf.range(1000, dtype=tf.float32), [100, 10]))
    assert idx.numpy().tolist() == list(range(970, 1000))
