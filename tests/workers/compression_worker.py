"""Top-k / gTop-k compression checks, run on every rank by tests/test_compression.py.

Every rank's gradients are a known function of its rank, so each rank
computes the whole expected result (which entries every rank selects, the
merges, the sums, the residuals) with numpy and compares it bit for bit with
what the engine returned. Runs at np=2 and np=3 (3 exercises gTop-k's extra
rounds for a size that is not a power of two).
"""
import math
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402

import keras  # noqa: E402

import tf_mpi as hvd  # noqa: E402
import tf_mpi.keras as hvdk  # noqa: E402
from tf_mpi.basics import _core  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
SHAPES = [(1000,), (30, 7)]
RATIO = 0.05


# Gradients in one group: no cost-model probe (seconds on a busy machine) needed.

# ---- numpy reference

def np_select(acc, k):
    """k largest |acc|, ties to the lower index."""
    order = np.lexsort((np.arange(acc.size), -np.abs(acc)))
    idx = order[:k]
    return idx, acc[idx]


def np_merge(a, b, k):
    idx = np.concatenate([a[0], b[0]])
    val = np.concatenate([a[1], b[1]])
    union = np.unique(idx)
    summed = np.zeros(union.size, np.float32)
    np.add.at(summed, np.searchsorted(union, idx), val)
    pos, _ = np_select(summed, k)
    return union[pos], summed[pos]


def np_topk(accs, k):
    """(sum of every rank's sent entries, residual per rank)."""
    n = accs[0].size
    out = np.zeros(n, np.float32)
    residuals = []
    for acc in accs:
        idx, val = np_select(acc, k)
        out[idx] += val
        res = acc.copy()
        res[idx] = 0
        residuals.append(res)
    return out, residuals


def np_gtopk(accs, k):
    """The recursive-doubling merge of tf_mpi.policy.topk_compression, simulated for all ranks."""
    n_ranks, n = len(accs), accs[0].size
    pow2 = 1 << (n_ranks.bit_length() - 1)
    local = [np_select(acc, k) for acc in accs]
    sets = list(local)
    path = [set(range(n)) for _ in accs]
    for e in range(pow2, n_ranks):
        p = e - pow2
        sets[p] = np_merge(sets[p], sets[e], k)
        path[p] &= set(sets[p][0].tolist())
    for j in range(pow2.bit_length() - 1):
        new = list(sets)
        for r in range(pow2):
            new[r] = np_merge(sets[r], sets[r ^ (1 << j)], k)
            path[r] &= set(new[r][0].tolist())
        sets = new
    for e in range(pow2, n_ranks):
        sets[e] = sets[e - pow2]
        path[e] = set(sets[e][0].tolist()) & path[e - pow2]
    for r in range(1, n_ranks):
        assert np.array_equal(sets[r][0], sets[0][0]) and np.array_equal(sets[r][1], sets[0][1])
    out = np.zeros(n, np.float32)
    out[sets[0][0]] = sets[0][1]
    residuals = []
    for r, acc in enumerate(accs):
        res = acc.copy()
        kept = sorted(set(local[r][0].tolist()) & path[r])
        res[kept] = 0
        residuals.append(res)
    return out, residuals


def grads_of(rank, step):
    """Quarter-integer gradients: many exact ties in magnitude, some zeros."""
    rng = np.random.default_rng(1000 * step + rank)
    return [(rng.integers(-4, 5, size=s) * 0.25).astype(np.float32) for s in SHAPES]


def same_on_every_rank(x, name):
    """True if `x` is bitwise the same on every rank."""
    flat = tf.bitcast(tf.reshape(tf.convert_to_tensor(x, tf.float32), [1, -1]), tf.int32)
    everyone = hvd.allgather(flat, name=name).numpy()
    return all(np.array_equal(everyone[0], row) for row in everyone)


def _check_against_reference(kind, simulate, use_function):
    compression = getattr(hvd.Compression, kind)(RATIO)
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    residuals = [compression.residual_for(v) for v in variables]
    expected_res = [[np.zeros(int(np.prod(s)), np.float32) for s in SHAPES] for _ in range(N)]
    for step, op in enumerate([hvd.Sum, hvd.Average]):  # step 1 adds step 0's residuals
        grads = [tf.constant(g) for g in grads_of(R, step)]
        name = f"{kind}.{use_function}.{step}"
        if use_function:
            got = tf.function(lambda: compression.reduce(grads, residuals, op=op, name=name))()
        else:
            got = compression.reduce(grads, residuals, op=op, name=name)
        for t, shape in enumerate(SHAPES):
            n = int(np.prod(shape))
            k = max(1, math.ceil(RATIO * n))
            accs = [grads_of(r, step)[t].reshape(-1) + expected_res[r][t] for r in range(N)]
            want, res = simulate(accs, k)
            if op == hvd.Average:
                want = want * np.float32(1.0 / N)
            for r in range(N):
                expected_res[r][t] = res[r]
            got_t = got[t].numpy().reshape(-1)
            np.testing.assert_array_equal(got_t, want, err_msg=f"{kind} step {step} tensor {t}")
            np.testing.assert_array_equal(residuals[t].numpy().reshape(-1), expected_res[R][t],
                                          err_msg=f"{kind} residual step {step} tensor {t}")
            assert got[t].shape == shape
            assert same_on_every_rank(got[t], f"{name}.same.{t}")
            if kind == "gtopk":
                assert np.count_nonzero(want) <= k
    assert any(np.count_nonzero(r) for r in expected_res[R]), "the residual was never used"


def check_topk_matches_numpy_eager():
    _check_against_reference("topk", np_topk, False)


def check_topk_matches_numpy_in_function():
    _check_against_reference("topk", np_topk, True)


def check_gtopk_matches_numpy_eager():
    _check_against_reference("gtopk", np_gtopk, False)


def check_gtopk_matches_numpy_in_function():
    _check_against_reference("gtopk", np_gtopk, True)


def check_ties_go_to_lower_index():
    """All magnitudes equal: every rank must send its first k entries."""
    compression = hvd.Compression.topk(0.1)
    v = tf.Variable(tf.zeros([40]))
    sign = np.where(np.arange(40) % 2 == 0, 1.0, -1.0).astype(np.float32)
    got = compression.reduce([tf.constant(sign * (R + 1))], [compression.residual_for(v)], op=hvd.Sum,
                             name="ties")[0].numpy()
    want = np.zeros(40, np.float32)
    want[:4] = sign[:4] * sum(r + 1 for r in range(N))
    np.testing.assert_array_equal(got, want)


def check_bad_ratio_is_a_clear_error():
    for bad in (0, -0.5, 1.5, float("nan"), "0.1", None, True):
        for kind in ("topk", "gtopk"):
            try:
                getattr(hvd.Compression, kind)(bad)
            except ValueError as e:
                assert "ratio" in str(e), e
            else:
                raise AssertionError(f"Compression.{kind}({bad!r}) was accepted")
    try:
        hvd.DistributedGradientTape(tf.GradientTape(), compression=hvd.Compression.topk)
    except ValueError as e:
        assert "ratio" in str(e), e
    else:
        raise AssertionError("an uncalled Compression.topk was accepted")
    try:
        hvd.allreduce(tf.ones([4]), compression=hvd.Compression.topk(0.5))
    except ValueError as e:
        assert "DistributedOptimizer" in str(e), e
    else:
        raise AssertionError("allreduce(compression=topk) was accepted")


def check_byte_counters_show_the_reduction():
    """Payload bytes handed to MPI for one tape step: dense vs top-k / gTop-k at ratio 0.01."""
    variables = [tf.Variable(tf.zeros([20000])), tf.Variable(tf.zeros([100, 10]))]
    data = [tf.fill([20000], float(R + 1)) * tf.range(20000, dtype=tf.float32) / 20000,
            tf.fill([100, 10], 0.5 * (R + 1))]

    def step(compression, tag):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                loss = sum(tf.reduce_sum(v * d) for v, d in zip(variables, data))
            tape = hvd.DistributedGradientTape(tape, compression=compression, name=f"bytes.{tag}", groups=1)
            return tape.gradient(loss, variables)
        run()  # the first call also checks the grouping plan across ranks
        before = _core.stats()
        run()
        after = _core.stats()
        return {k: after[k] - before[k] for k in after if k.startswith("payload_bytes")}

    dense = step(hvd.Compression.none, "none")
    assert dense["payload_bytes_sent"] == dense["payload_bytes_allreduce"] == 4 * 21000, dense
    topk = step(hvd.Compression.topk(0.01), "topk")
    assert topk["payload_bytes_sent"] == topk["payload_bytes_allgather"] == 8 * (200 + 10), topk
    gtopk = step(hvd.Compression.gtopk(0.01), "gtopk")
    assert gtopk["payload_bytes_sent"] == gtopk["payload_bytes_alltoall"], gtopk
    sent = [d["payload_bytes_sent"] for d in (dense, topk, gtopk)]
    totals = hvd.allreduce(tf.constant(sent, tf.int64), op=hvd.Sum, name="bytes.totals").numpy()
    # Bytes per rank for gTop-k, k pairs of 8 bytes: log2(P) rounds for the P = largest power of
    # two <= N ranks; each rank past P hands its pairs to rank - P and gets the result back as
    # indices from rank - P and values from rank (rank - P + N - P) mod P (4k bytes each).
    k = 200 + 10
    pow2 = 1 << (N.bit_length() - 1)
    extras = N - pow2
    if R >= pow2:
        expected = 8 * k
    else:
        expected = 8 * k * int(math.log2(pow2))
        expected += 4 * k * (R < extras)                        # indices for rank R + P
        expected += 4 * k * ((R - extras) % pow2 < extras)      # values for another rank past P
    assert sent[2] == expected, (sent, expected)
    if N <= 3:  # at least 30x fewer bytes than dense on every rank and in all, for both
        # (gTop-k's payload shrinks 50 / log2(P) x: 25x from 4 ranks on)
        assert sent[0] / sent[1] >= 30 and sent[0] / sent[2] >= 30, sent
        assert totals[0] / totals[1] >= 30 and totals[0] / totals[2] >= 30, totals


def _dense_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1)])


def _batches(steps):
    rng = np.random.default_rng(100 + R)
    x = rng.normal(size=(steps, 16, 20)).astype(np.float32)
    return x, (x[..., :1] * 0.5 + rng.normal(size=(steps, 16, 1)) * 0.1).astype(np.float32)


def check_keras_fit_leaves_identical_weights():
    for kind in ("topk",):  # gtopk through Keras: the save/load check below
        model = _dense_model(R)  # different initial weights: the callback broadcasts rank 0's
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                       compression=getattr(hvd.Compression, kind)(0.01), name=f"fit.{kind}",
                                       groups=1)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        x, y = _batches(6)
        model.fit(x.reshape(-1, 20), y.reshape(-1, 1), batch_size=16, epochs=2, verbose=0, shuffle=False,
                  callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
        for i, w in enumerate(model.weights):
            assert same_on_every_rank(w, f"fit.{kind}.w{i}"), f"{kind}: weight {w.path} differs between ranks"
        residuals = opt._tfmpi_residuals
        assert len(residuals) == len(model.trainable_weights)
        assert np.count_nonzero(residuals[0].numpy()) > 0, "error feedback left nothing"
        assert not same_on_every_rank(residuals[0], f"fit.{kind}.res"), "residuals are per-rank state"
        assert np.isfinite(model.evaluate(x.reshape(-1, 20), y.reshape(-1, 1), verbose=0))


def check_keras_mixed_float16_loss_scale_with_topk():
    """LossScaleOptimizer + topk: overflowing steps are skipped on every rank without poisoning the
    residuals, which stay in unscaled units while the loss scale changes."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _dense_model(0)
        compression = hvd.Compression.topk(0.05)
        # 2^20 overflows float16 gradients: the first steps are skipped and the scale halves.
        lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0 ** 20)
        opt = hvd.DistributedOptimizer(lso, compression=compression, name="fit.lso", groups=1)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        before = [w.numpy().copy() for w in model.trainable_weights]
        x, y = _batches(6)
        model.fit(x.reshape(-1, 20), y.reshape(-1, 1), batch_size=16, epochs=3, verbose=0, shuffle=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    scale = float(opt.dynamic_scale.numpy())
    assert 2.0 ** 4 <= scale < 2.0 ** 20, f"the loss scale never dropped from 2^20 ({scale})"
    for i, w in enumerate(model.weights):
        assert np.all(np.isfinite(w.numpy())), f"weight {w.path} is not finite"
        assert same_on_every_rank(w, f"fit.lso.w{i}"), f"weight {w.path} differs between ranks"
    assert any(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights)), \
        "no step was applied after the overflows"
    residuals = [r.numpy() for r in compression.residuals]
    assert residuals and all(np.all(np.isfinite(r)) for r in residuals), "an overflow reached the residuals"
    assert any(np.count_nonzero(r) for r in residuals), "error feedback left nothing"
    # Unscaled units: this model's gradients are O(1); scaled by the loss scale they would be >= 2^4 x larger.
    biggest = max(float(np.abs(r).max()) for r in residuals)
    assert biggest < scale / 4, (biggest, scale)


def _train_keras(model, x, y, steps):
    for s in steps:
        model.train_on_batch(x[s], y[s])


def check_keras_residuals_survive_save_and_load_model():
    """model.save + hvd.load_model on every rank resumes exactly as an uninterrupted run."""
    x, y = _batches(4)
    runs = {}
    for mode in ("uninterrupted", "resumed"):
        model = _dense_model(0)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                       compression=hvd.Compression.gtopk(0.05), name="resume.keras",
                                       groups=1)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        if mode == "uninterrupted":
            _train_keras(model, x, y, range(4))
        else:
            _train_keras(model, x, y, range(2))
            saved = [r.numpy() for r in opt._tfmpi_residuals]
            assert any(np.count_nonzero(r) for r in saved)
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, f"rank{R}.keras")  # residuals are per rank: one file each
                model.save(path)
                model = hvdk.load_model(path, compression=hvd.Compression.gtopk(0.05), groups=1)
            restored = model.optimizer._tfmpi_residuals
            for a, b in zip(saved, restored):
                np.testing.assert_array_equal(a, b.numpy())
            _train_keras(model, x, y, range(2, 4))
        runs[mode] = [w.numpy() for w in model.weights]
    for a, b in zip(runs["uninterrupted"], runs["resumed"]):
        np.testing.assert_array_equal(a, b)


def _tape_setup(seed):
    """A model, Adam, a top-k compressor (all built) and a tape train step over them."""
    model = _dense_model(seed)
    opt = keras.optimizers.Adam(0.01)
    compression = hvd.Compression.topk(0.05)
    opt.build(model.trainable_variables)
    compression.build(model.trainable_variables)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=compression, name="resume.tape", groups=1)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt, compression=compression)
    return model, compression, train_step, checkpoint


def check_tape_residuals_survive_tf_train_checkpoint():
    """tf.train.Checkpoint tracking the compressor: a resumed tape loop matches an uninterrupted one."""
    x, y = _batches(4)
    model, _, train_step, _ = _tape_setup(0)
    for s in range(4):
        train_step(x[s], y[s])
    uninterrupted = [w.numpy() for w in model.weights]

    model, compression, train_step, checkpoint = _tape_setup(0)
    for s in range(2):
        train_step(x[s], y[s])
    saved = [r.numpy() for r in compression.residuals]
    assert any(np.count_nonzero(r) for r in saved)
    with tempfile.TemporaryDirectory() as d:
        path = checkpoint.write(os.path.join(d, f"rank{R}"))  # residuals are per rank: one file each
        model, compression, train_step, checkpoint = _tape_setup(7)  # fresh objects, other weights
        checkpoint.read(path).assert_consumed()
    for a, b in zip(saved, compression.residuals):
        np.testing.assert_array_equal(a, b.numpy())
    for s in range(2, 4):
        train_step(x[s], y[s])
    for a, b in zip(uninterrupted, [w.numpy() for w in model.weights]):
        np.testing.assert_array_equal(a, b)


if __name__ == "__main__":
    run_checks(globals(), R)
