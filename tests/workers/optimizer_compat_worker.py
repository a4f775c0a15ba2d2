"""Horovod 0.28.1 semantics of the optimizer / tape / Keras-module API that
`import tf_mpi as hvd` and `import tf_mpi.keras as hvd` must keep, run on
every rank by tests/test_horovod_api_compat.py.

Each check states Horovod's rule (from its source: horovod/tensorflow/__init__.py,
horovod/tensorflow/keras/__init__.py, horovod/_keras/__init__.py,
horovod/tensorflow/gradient_aggregation*.py) and compares tf_mpi with values
computed independently: numpy, and mpi4py on MPI_COMM_WORLD for whatever
crosses ranks. Gradients are made exact where possible (loss = sum(w * c), so
the gradient is c).
"""
import inspect
import os
import sys
import tempfile
import types
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402
from _expect import raises  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi as hvd  # noqa: E402
import tf_mpi.keras as hvdk  # noqa: E402
from tf_mpi.keras.optimizer import _DistributedMixin  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()

from mpi4py import MPI  # noqa: E402  (after init: tf_mpi initialised MPI)

WORLD = MPI.COMM_WORLD
GLOBAL_SET = types.SimpleNamespace(process_set_id=0)  # what Horovod's global_process_set looks like
THIS_FILE = os.path.abspath(__file__)

# Horovod 0.28.1's parameters, in order, copied from its signatures.
HOROVOD_PARAMS = {
    "tf.DistributedOptimizer": ["optimizer", "name", "use_locking", "device_dense", "device_sparse", "compression",
                                "sparse_as_dense", "backward_passes_per_step", "op", "gradient_predivide_factor",
                                "average_aggregated_gradients", "num_groups", "groups", "process_set",
                                "scale_local_gradients"],
    "keras.DistributedOptimizer": ["optimizer", "name", "device_dense", "device_sparse", "compression",
                                   "sparse_as_dense", "gradient_predivide_factor", "op", "backward_passes_per_step",
                                   "average_aggregated_gradients", "num_groups", "groups", "process_set",
                                   "scale_local_gradients"],
    "DistributedGradientTape": ["gradtape", "device_dense", "device_sparse", "compression", "sparse_as_dense", "op",
                                "gradient_predivide_factor", "num_groups", "groups", "process_set",
                                "scale_local_gradients"],
    "PartialDistributedGradientTape": ["gradtape", "device_dense", "device_sparse", "compression",
                                       "sparse_as_dense", "op", "gradient_predivide_factor", "num_groups", "groups",
                                       "process_set", "local_layers", "scale_local_gradients"],
    "gradient": ["target", "sources", "output_gradients", "use_generic_names"],
    "load_model": ["filepath", "custom_optimizers", "custom_objects", "compression", "legacy_opts"],
    "keras.PartialDistributedOptimizer": ["optimizer", "name", "device_dense", "device_sparse", "compression",
                                          "sparse_as_dense", "gradient_predivide_factor", "op", "groups",
                                          "process_set", "local_layers", "scale_local_gradients"],
    "keras.allreduce": ["value", "name", "average", "prescale_factor", "postscale_factor", "op", "compression"],
    "keras.allgather": ["value", "name"],
    "keras.broadcast": ["value", "root_rank", "name"],
    "keras.reducescatter": ["value", "name", "op"],
}


def positional_params(fn, skip_self=False):
    """(positional parameter names, keyword-only names) of fn."""
    params = list(inspect.signature(fn).parameters.values())
    if skip_self:
        params = params[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds], [p.name for p in params if p.kind == p.KEYWORD_ONLY]


def gathered(a):
    """Every rank's `a` stacked along a new first axis, by mpi4py."""
    return np.stack(WORLD.allgather(np.asarray(a)))


def rank_constants(shape, seed):
    """This rank's float32 constants (different on every rank), exactly representable."""
    rng = np.random.default_rng(1000 * seed + R)
    return (rng.integers(-8, 9, size=shape) / 4.0 + (R + 1) * 0.5).astype(np.float32)


def linear_grads(variables, constants):
    """A tf.GradientTape whose loss sum(v * c) has gradient c for each variable."""
    tape = tf.GradientTape(persistent=True)
    with tape:
        loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, constants)])
    return tape, loss


def new_variables(shapes, value=1.0):
    return [keras.Variable(np.full(s, value, np.float32), name=f"v{i}") for i, s in enumerate(shapes)]


# ------------------------------------------------- 1. iterations with backward_passes_per_step

SCHEDULE_VALUES = [2.0 ** -s for s in range(9)]  # exact in float32


def schedule():
    """lr(step) = SCHEDULE_VALUES[step] for integer steps (PiecewiseConstantDecay: step <= b_i -> v_i)."""
    return keras.optimizers.schedules.PiecewiseConstantDecay(list(range(len(SCHEDULE_VALUES) - 1)),
                                                             SCHEDULE_VALUES)


def horovod_bpps_reference(w0, pass_grads, k, lr, average_aggregated=False):
    """Horovod's rule (gradient_aggregation_eager.py): gradients summed locally over k passes, averaged
    over ranks on the k-th, applied with the rate of the current `iterations`; `iterations` grows by 1
    on every pass, applied or not. pass_grads[p][r]: rank r's gradient list on pass p. Returns
    (weights, iterations)."""
    w = [np.asarray(x, np.float64) for x in w0]
    acc = [np.zeros_like(x) for x in w]
    iterations = 0
    for p, per_rank in enumerate(pass_grads):
        acc = [a + np.mean([np.asarray(g[i], np.float64) for g in per_rank], 0) for i, a in enumerate(acc)]
        if (p + 1) % k == 0:
            scale = 1.0 / k if average_aggregated else 1.0
            w = [x - lr(iterations) * scale * a for x, a in zip(w, acc)]
            acc = [np.zeros_like(x) for x in w]
        iterations += 1
    return w, iterations


def check_iterations_count_every_pass_in_a_custom_loop():
    """Horovod: with backward_passes_per_step=2, iterations counts all 4 passes (tf_mpi used to count 2);
    the applied updates (SGD, constant rate) are the locally summed, rank-averaged gradients."""
    for mode in ("eager", "function"):
        for average_aggregated in (False, True):
            variables = new_variables([(3,), (2, 2)])
            w0 = [v.numpy() for v in variables]
            opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.5), name=f"it.{mode}.{average_aggregated}",
                                            backward_passes_per_step=2,
                                            average_aggregated_gradients=average_aggregated)

            def step(cs):
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, cs)])
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

            run = tf.function(step) if mode == "function" else step
            grads, seen = [], []
            for p in range(4):
                cs = [rank_constants(v.shape, 10 * p + i) for i, v in enumerate(variables)]
                run([tf.constant(c) for c in cs])
                grads.append([[gathered(c)[r] for c in cs] for r in range(N)])
                seen.append(int(opt.iterations.numpy()))
            want, want_iterations = horovod_bpps_reference(w0, grads, 2, lambda s: 0.5, average_aggregated)
            assert seen == [1, 2, 3, 4] and want_iterations == 4, (mode, seen)
            for v, x in zip(variables, want):
                assert np.allclose(v.numpy(), x, rtol=1e-6, atol=1e-6), (mode, average_aggregated, v.numpy(), x)


def check_learning_rate_schedule_sees_the_pass_count_in_fit():
    """Horovod: a schedule keyed on iterations is evaluated at the pass count (k*m - 1 for the m-th
    update), in model.fit too; iterations ends at the number of batches."""
    k, batches, B = 2, 4, 4
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N * batches * B, 3)).astype(np.float32)
    y = rng.normal(size=(N * batches * B, 1)).astype(np.float32)
    mine = np.concatenate([np.arange(s * N * B + R * B, s * N * B + (R + 1) * B) for s in range(batches)])
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(0.25),
                               bias_initializer=keras.initializers.Constant(-0.5))
    model = keras.Model(inputs, dense(inputs))
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(schedule()), name="fit.sched", backward_passes_per_step=k)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x[mine], y[mine], batch_size=B, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == batches, int(opt.iterations.numpy())

    # numpy: MSE gradients of the linear layer on each rank's batch, Horovod's rule for the rest.
    w, b = np.full((3, 1), 0.25), np.full((1,), -0.5)
    acc_w, acc_b = np.zeros_like(w), np.zeros_like(b)
    for p in range(batches):
        gw, gb = [], []
        for r in range(N):
            xb = x[p * N * B + r * B: p * N * B + (r + 1) * B].astype(np.float64)
            err = xb @ w + b - y[p * N * B + r * B: p * N * B + (r + 1) * B]
            gw.append(2.0 / B * xb.T @ err)
            gb.append(2.0 / B * err.sum(0))
        acc_w, acc_b = acc_w + np.mean(gw, 0), acc_b + np.mean(gb, 0)
        if (p + 1) % k == 0:
            lr = SCHEDULE_VALUES[p]  # iterations == p when the pass p+1 applies
            w, b = w - lr * acc_w, b - lr * acc_b
            acc_w, acc_b = np.zeros_like(w), np.zeros_like(b)
    assert np.allclose(dense.kernel.numpy(), w, rtol=1e-5, atol=1e-6), (dense.kernel.numpy(), w)
    assert np.allclose(dense.bias.numpy(), b, rtol=1e-5, atol=1e-6), (dense.bias.numpy(), b)


# ------------------------------------------------- 2. the Keras module's collectives

def check_keras_module_collectives_take_horovods_keras_arguments():
    """horovod.tensorflow.keras: allreduce(value, name, average, prescale, postscale, op, compression),
    allgather(value, name), broadcast(value, root_rank, name), reducescatter(value, name, op); the value
    is tensor-like (numpy, list, number) and the result a tf.Tensor of tf.constant(value)'s dtype."""
    for what, fn in (("keras.allreduce", hvdk.allreduce), ("keras.allgather", hvdk.allgather),
                     ("keras.broadcast", hvdk.broadcast), ("keras.reducescatter", hvdk.reducescatter)):
        assert positional_params(fn)[0] == HOROVOD_PARAMS[what], (what, positional_params(fn))
    assert hvdk.allreduce is not hvd.allreduce  # tf_mpi's own (op second) stays at the top level

    value = np.arange(4.0) * (R + 1)  # float64
    everyone = gathered(value)
    out = hvdk.allreduce(value, "k.ar.name")  # Horovod's second parameter is the name
    assert isinstance(out, tf.Tensor) and out.dtype == tf.float64, (type(out), out.dtype)
    assert np.allclose(out.numpy(), everyone.mean(0)), out.numpy()
    out = hvdk.allreduce(value.tolist(), "k.ar.pos", None, 2.0, 0.5, hvd.Sum)  # scale factors, op positionally
    assert np.allclose(out.numpy(), everyone.sum(0)), out.numpy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = hvdk.allreduce(value, "k.ar.avg", False)  # deprecated average=False: Sum
    assert np.allclose(out.numpy(), everyone.sum(0)) and any(w.category is DeprecationWarning for w in caught)
    raises(lambda: hvdk.allreduce(value, "k.ar.both", True, op=hvd.Sum), ValueError)
    out = hvdk.allreduce(R + 1, "k.ar.int")  # a Python int: int32, integer average
    assert out.dtype == tf.int32 and int(out) == int(np.trunc(np.mean(np.arange(1, N + 1)))), out
    out = hvdk.allreduce(value, "k.ar.fp16", compression=hvd.Compression.fp16)
    assert out.dtype == tf.float64 and np.allclose(out.numpy(), everyone.mean(0), rtol=1e-3), out

    rows = np.full((R + 1, 2), R, np.int64)
    out = hvdk.allgather(rows, "k.ag")
    assert isinstance(out, tf.Tensor) and out.dtype == tf.int64
    assert np.array_equal(out.numpy(), np.concatenate(WORLD.allgather(rows))), out.numpy()

    out = hvdk.broadcast(np.full([3], R + 7, np.float32), N - 1, "k.bc")
    assert isinstance(out, tf.Tensor) and out.dtype == tf.float32 and np.all(out.numpy() == N + 6), out

    block = (np.arange(2 * N * 3, dtype=np.float32).reshape(2 * N, 3) + R)
    every_block = gathered(block)
    out = hvdk.reducescatter(block, "k.rs", hvd.Sum)
    assert isinstance(out, tf.Tensor) and np.allclose(out.numpy(), every_block.sum(0)[2 * R:2 * R + 2]), out
    out = hvdk.reducescatter(block, "k.rs.avg")  # Average by default
    assert np.allclose(out.numpy(), every_block.mean(0)[2 * R:2 * R + 2]), out


# ------------------------------------------------- 3. DistributedOptimizer's parameters

def apply_twice(opt, variables, seed):
    """Two apply_gradients of this rank's exact gradients; returns (weights after 1, after 2, grads)."""
    after, grads = [], []
    for p in range(2):
        cs = [rank_constants(v.shape, seed + 10 * p + i) for i, v in enumerate(variables)]
        opt.apply_gradients(zip([tf.constant(c) for c in cs], variables))
        after.append([v.numpy().copy() for v in variables])
        grads.append([gathered(c) for c in cs])
    return after[0], after[1], grads


def check_distributed_optimizer_takes_horovods_positional_order():
    """horovod.tensorflow.DistributedOptimizer has use_locking third and backward_passes_per_step before op;
    horovod.tensorflow.keras.DistributedOptimizer has gradient_predivide_factor, op, backward_passes_per_step
    after sparse_as_dense. tf_mpi's extras are keyword-only after them."""
    for what, fn in (("tf.DistributedOptimizer", hvd.DistributedOptimizer),
                     ("keras.DistributedOptimizer", hvdk.DistributedOptimizer)):
        positional, keyword_only = positional_params(fn)
        assert positional == HOROVOD_PARAMS[what], (what, positional)
        assert set(keyword_only) == {"order_backprop", "sparse"}, (what, keyword_only)
    none = hvd.Compression.none
    cases = {
        # top level: (optimizer, name, use_locking, device_dense, device_sparse, compression, sparse_as_dense,
        #             backward_passes_per_step, op)
        "tf": lambda o: hvd.DistributedOptimizer(o, "pos.tf", True, "", "", none, False, 2, hvd.Sum),
        # Keras: (optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        #         gradient_predivide_factor, op, backward_passes_per_step)
        "keras": lambda o: hvdk.DistributedOptimizer(o, "pos.k", "", "", none, False, 1.0, hvd.Sum, 2),
        # Horovod's Keras optimizer ignores gradient_predivide_factor with op=Sum.
        "keras, predivide ignored by Sum": lambda o: hvdk.DistributedOptimizer(o, "pos.k2", "", "", none, False,
                                                                                 4.0, hvd.Sum, 2),
    }
    for what, make in cases.items():
        variables = new_variables([(3,), (2,)])
        opt = make(keras.optimizers.SGD(1.0))
        first, second, grads = apply_twice(opt, variables, 3)
        assert all(np.array_equal(a, np.ones_like(a)) for a in first), (what, "applied on pass 1 of 2")
        for v, g1, g2 in zip(second, grads[0], grads[1]):
            want = 1.0 - (g1.sum(0) + g2.sum(0))  # op=Sum over ranks, summed over the 2 passes
            assert np.allclose(v, want, rtol=1e-6, atol=1e-6), (what, v, want)
        assert int(opt.iterations.numpy()) == 2, (what, int(opt.iterations.numpy()))

    # Keras order: gradient_predivide_factor (7th) with Average splits the average: same mean.
    variables = new_variables([(4,)])
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(1.0), "pos.k3", "", "", none, False, 2.0)
    c = rank_constants((4,), 5)
    opt.apply_gradients([(tf.constant(c), variables[0])])
    assert np.allclose(variables[0].numpy(), 1.0 - gathered(c).mean(0), rtol=1e-6), variables[0].numpy()

    sgd = keras.optimizers.SGD
    raises(lambda: hvd.DistributedOptimizer(sgd(1.0), op=hvd.Sum, gradient_predivide_factor=2.0), ValueError,
           "gradient_predivide_factor")
    for fn in (hvd.DistributedOptimizer, hvdk.DistributedOptimizer):
        for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):  # Horovod's Keras optimizer: Average and Sum
            # horovod.tensorflow's entry names Adasum with its own words; the Keras module's refuses
            # every other op with the same ValueError.
            words = "Adasum is not supported yet with Keras" if (fn, op) == (hvd.DistributedOptimizer, hvd.Adasum) \
                else "op=Average or op=Sum"
            raises(lambda: fn(sgd(1.0), op=op), ValueError, words)
        raises(lambda: fn(sgd(1.0), process_set=object()), ValueError, "not registered")
        fn(sgd(1.0), process_set=GLOBAL_SET)  # Horovod's global_process_set: accepted


def check_groups_zero_raises_and_num_groups_warns():
    """Horovod: groups must be a list or an integer > 0 (ValueError otherwise); num_groups != 0 warns
    (DeprecationWarning) and stands for groups. An integer groups is that many gradient groups."""
    sgd = keras.optimizers.SGD
    entry_points = {
        "tf.DistributedOptimizer": lambda **kw: hvd.DistributedOptimizer(sgd(1.0), **kw),
        "keras.DistributedOptimizer": lambda **kw: hvdk.DistributedOptimizer(sgd(1.0), **kw),
        "DistributedGradientTape": lambda **kw: hvd.DistributedGradientTape(tf.GradientTape(), **kw),
        "PartialDistributedGradientTape": lambda **kw: hvd.PartialDistributedGradientTape(tf.GradientTape(), **kw),
    }
    for what, make in entry_points.items():
        for bad in (0, -1):
            raises(lambda: make(groups=bad), ValueError, "groups")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make(num_groups=2)
            raises(lambda: make(num_groups=-1), ValueError, "groups")  # warns, then num_groups -> groups
        deprecations = [w for w in caught if w.category is DeprecationWarning]
        assert len(deprecations) == 2, (what, [str(w.message) for w in caught])
        assert all(os.path.abspath(w.filename) == THIS_FILE for w in deprecations), \
            (what, [w.filename for w in deprecations])  # the warning points at the caller's line
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make(groups=2)
        assert not [w for w in caught if w.category is DeprecationWarning], what

    # groups=2 and num_groups=2 both reduce in 2 groups, with the reduced values unchanged.
    for kwargs in ({"groups": 2}, {"num_groups": 2}):
        variables = new_variables([(3,), (4,), (5,)])
        cs = [rank_constants(v.shape, 20 + i) for i, v in enumerate(variables)]
        tape, loss = linear_grads(variables, cs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            dtape = hvd.DistributedGradientTape(tape, name=f"groups.{list(kwargs)[0]}", **kwargs)
        grads = dtape.gradient(loss, variables)
        assert len(dtape.grouping_plan.groups) == 2, dtape.grouping_plan.describe()
        for g, c in zip(grads, cs):
            assert np.allclose(g.numpy(), gathered(c).mean(0), rtol=1e-6), (kwargs, g.numpy())


def check_load_model_takes_horovods_positional_order():
    """horovod.tensorflow.keras.load_model(filepath, custom_optimizers, custom_objects, compression,
    legacy_opts): compression fourth, legacy_opts fifth (Keras 3 has no legacy optimizers: ValueError);
    tf_mpi's extras are keyword-only."""
    positional, keyword_only = positional_params(hvdk.load_model)
    assert positional == HOROVOD_PARAMS["load_model"], positional
    assert {"sparse_as_dense", "op", "gradient_predivide_factor", "num_groups", "sparse"} <= set(keyword_only)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse", jit_compile=False)
    model.train_on_batch(np.ones((2, 3), np.float32), np.zeros((2, 2), np.float32))
    path = os.path.join(tempfile.mkdtemp(), f"m{R}.keras")
    model.save(path)
    loaded = hvdk.load_model(path, None, None, hvd.Compression.fp16)
    opt = loaded.optimizer
    assert isinstance(opt, _DistributedMixin) and isinstance(opt, keras.optimizers.Adam), type(opt)
    assert opt._tfmpi_get_reducer().compression is hvd.Compression.fp16
    assert int(opt.iterations.numpy()) == 1
    loaded = hvdk.load_model(path, None, None, hvd.Compression.none, False, sparse_as_dense=True)
    assert loaded.optimizer._tfmpi_get_reducer().sparse == "dense"
    raises(lambda: hvdk.load_model(path, None, None, hvd.Compression.none, True), ValueError, "legacy")


# ------------------------------------------------- 4. the tape's signatures

def check_tape_takes_horovods_positional_order_and_use_generic_names():
    """Horovod: DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
    gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients), the partial tape with
    local_layers after process_set, and gradient(target, sources, output_gradients, use_generic_names)."""
    for what, fn, skip in (("DistributedGradientTape", hvd.DistributedGradientTape.__init__, True),
                           ("PartialDistributedGradientTape", hvd.PartialDistributedGradientTape.__init__, True),
                           ("gradient", hvd.DistributedGradientTape.gradient, True)):
        positional, _ = positional_params(fn, skip_self=skip)
        assert positional == HOROVOD_PARAMS[what], (what, positional)
    none = hvd.Compression.none
    variables = new_variables([(3,), (2, 2)])
    cs = [rank_constants(v.shape, 30 + i) for i, v in enumerate(variables)]
    everyone = [gathered(c) for c in cs]

    tape, loss = linear_grads(variables, cs)
    grads = hvd.DistributedGradientTape(tape, "", "", none, False, hvd.Sum, name="tape.pos").gradient(
        loss, variables, None, True)
    for g, e in zip(grads, everyone):
        assert np.allclose(g.numpy(), e.sum(0), rtol=1e-6), g.numpy()
    # output_gradients positionally (third): d(sum(v * c)) scaled by 2.
    tape, loss = linear_grads(variables, cs)
    grads = hvd.DistributedGradientTape(tape, name="tape.outgrad").gradient(loss, variables, tf.constant(2.0))
    for g, e in zip(grads, everyone):
        assert np.allclose(g.numpy(), 2.0 * e.mean(0), rtol=1e-6), g.numpy()

    # scale_local_gradients (11th) positionally: False keeps a local source's gradient as it is.
    tape, loss = linear_grads(variables, cs)
    dtape = hvd.DistributedGradientTape(tape, "", "", none, False, hvd.Average, 1.0, 0, None, None, False,
                                        name="tape.local")
    dtape.register_local_source(variables[0])
    local, shared = dtape.get_local_and_global_gradients(loss, variables)
    assert [s is variables[0] for s, _ in local] == [True] and [s is variables[1] for s, _ in shared] == [True]
    assert np.array_equal(local[0][1].numpy(), cs[0]) and np.allclose(shared[0][1].numpy(), everyone[1].mean(0))

    # the partial tape: local_layers is the 11th parameter, scale_local_gradients the 12th.
    inputs = keras.Input((3,))
    layer = keras.layers.Dense(2, name="local")
    model = keras.Model(inputs, keras.layers.Dense(1, name="shared")(layer(inputs)))
    x = tf.constant(rank_constants((4, 3), 40))
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    plain = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    grads = hvd.PartialDistributedGradientTape(tape, "", "", none, False, hvd.Average, 1.0, 0, None, None,
                                               [layer], True, name="tape.partial").gradient(
        loss, model.trainable_variables)
    for v, g, p in zip(model.trainable_variables, grads, plain):
        want = p / N if v.path.startswith("local/") else gathered(p).mean(0)
        assert np.allclose(g.numpy(), want, rtol=1e-5, atol=1e-6), (v.path, g.numpy(), want)

    raises(lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0),
           ValueError, "gradient_predivide_factor")
    raises(lambda: hvd.DistributedGradientTape(tf.GradientTape(), process_set=object()), ValueError,
           "not registered")
    hvd.DistributedGradientTape(tf.GradientTape(), process_set=GLOBAL_SET)


# ------------------------------------------------- 5. any op through the tape

def check_tape_reduces_with_min_max_product():
    """Horovod's DistributedGradientTape takes any op: the gradients are allreduced with it (grouped or not,
    eagerly and in tf.function); a local source is divided by size() whatever the op."""
    ops = {hvd.Min: lambda a: a.min(0), hvd.Max: lambda a: a.max(0), hvd.Product: lambda a: a.prod(0),
           hvd.Sum: lambda a: a.sum(0)}
    for mode in ("eager", "function"):
        for op, expect in ops.items():
            for groups in (None, 1):
                variables = new_variables([(3,), (2, 2), (5,)])
                cs = [rank_constants(v.shape, 50 + i) for i, v in enumerate(variables)]
                name = f"tape.{op}.{mode}.{groups}"

                def grads_of():
                    tape, loss = linear_grads(variables, [tf.constant(c) for c in cs])
                    dtape = hvd.DistributedGradientTape(tape, op=op, groups=groups, name=name)
                    dtape.register_local_source(variables[2])
                    return dtape.gradient(loss, variables)

                grads = tf.function(grads_of)() if mode == "function" else grads_of()
                for i, (g, c) in enumerate(zip(grads, cs)):
                    want = c / N if i == 2 else expect(gathered(c))
                    assert np.allclose(g.numpy(), want, rtol=1e-6), (mode, op, groups, i, g.numpy(), want)


# ------------------------------------------------- 6. a tape's gradients are reduced once

def check_tape_gradients_are_not_reduced_again_by_the_optimizer():
    """Horovod's optimizer reduces in compute_gradients only: apply_gradients of a DistributedGradientTape's
    gradients applies them as they are (tf_mpi used to reduce them again: op=Sum gave size() x the sum).
    A gradient computed from them is a new gradient and is reduced."""
    for mode in ("eager", "function"):
        for passes in (1, 2):
            variables = new_variables([(3,), (2,)])
            opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum,
                                            backward_passes_per_step=passes, name=f"once.{mode}.{passes}")
            cs = [rank_constants(v.shape, 60 + i) for i, v in enumerate(variables)]

            def step(scale_local_copy):
                tape, loss = linear_grads(variables, [tf.constant(c) for c in cs])
                grads = hvd.DistributedGradientTape(tape, op=hvd.Sum, name=f"once.tape.{mode}.{passes}").gradient(
                    loss, variables)
                if scale_local_copy:
                    grads = [grads[0] * 1.0, grads[1]]  # a new tensor: the optimizer reduces it
                opt.apply_gradients(zip(grads, variables))

            run = tf.function(step) if mode == "function" else step
            for _ in range(passes):
                run(False)
            for v, c in zip(variables, cs):
                want = 1.0 - passes * gathered(c).sum(0)
                assert np.allclose(v.numpy(), want, rtol=1e-6), (mode, passes, v.numpy(), want)
            if passes == 1:
                before = [v.numpy().copy() for v in variables]
                run(True)
                twice = before[0] - N * gathered(cs[0]).sum(0)  # Sum of an already summed gradient
                once = before[1] - gathered(cs[1]).sum(0)
                assert np.allclose(variables[0].numpy(), twice, rtol=1e-6), (mode, variables[0].numpy(), twice)
                assert np.allclose(variables[1].numpy(), once, rtol=1e-6), (mode, variables[1].numpy(), once)

    # A local source kept as it is (scale_local_gradients=False) is applied as this rank's own gradient.
    variables = new_variables([(3,), (2,)])
    cs = [rank_constants(v.shape, 70 + i) for i, v in enumerate(variables)]
    tape, loss = linear_grads(variables, cs)
    dtape = hvd.DistributedGradientTape(tape, op=hvd.Sum, scale_local_gradients=False, name="once.local")
    dtape.register_local_source(variables[0])
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum, name="once.local")
    opt.apply_gradients(zip(dtape.gradient(loss, variables), variables))
    assert np.allclose(variables[0].numpy(), 1.0 - cs[0], rtol=1e-6), variables[0].numpy()
    assert np.allclose(variables[1].numpy(), 1.0 - gathered(cs[1]).sum(0), rtol=1e-6), variables[1].numpy()



def check_partial_distributed_optimizer_keeps_local_layers_local():
    """horovod.keras.PartialDistributedOptimizer (Horovod's order): the trainable weights of local_layers
    are registered as local: their gradients are not reduced and, with scale_local_gradients=True,
    are divided by size(); the other layers' gradients are averaged. A non-layer is a ValueError."""
    positional, keyword_only = positional_params(hvdk.PartialDistributedOptimizer)
    assert positional == HOROVOD_PARAMS["keras.PartialDistributedOptimizer"] and not keyword_only, positional
    for scale in (True, False):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="shared"),
                                  keras.layers.Dense(2, name="head")])
        local = model.get_layer("head")
        opt = hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), f"partial{int(scale)}",
                                               local_layers=local, scale_local_gradients=scale)
        before = [v.numpy().copy() for v in model.trainable_weights]
        cs = [rank_constants(v.shape, 40 + i) for i, v in enumerate(model.trainable_weights)]
        opt.apply_gradients(zip([tf.constant(c) for c in cs], model.trainable_weights))
        local_ids = {id(v) for v in local.trainable_weights}
        for v, w0, c in zip(model.trainable_weights, before, cs):
            if id(v) in local_ids:
                want = w0 - (c / N if scale else c)        # this rank's own gradient only
            else:
                want = w0 - gathered(c).mean(0)
            assert np.allclose(v.numpy(), want, rtol=1e-6, atol=1e-6), (v.path, scale, v.numpy(), want)
    raises(lambda: hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[object()]),
           ValueError, "keras.layers.Layer")



def check_tape_in_a_tf1_graph_with_session_run():
    """Horovod's suite runs its tests in a TF1-style graph too: DistributedGradientTape.gradient builds
    the reduction in a tf.Graph and Session.run computes it. The grouping plan's start-up probes run
    there without an eager context (measured again here: the cached cost model is dropped first)."""
    import tf_mpi.policy.grouping
    tf_mpi.policy.grouping._cost_model = None
    forced_overlap = os.environ.pop("TF_MPI_OVERLAP", None)   # the launch skips the overlap probe
    try:
        _tape_in_a_tf1_graph()
    finally:
        if forced_overlap is not None:
            os.environ["TF_MPI_OVERLAP"] = forced_overlap


def _tape_in_a_tf1_graph():
    import tf_mpi.policy.grouping
    c1, c2 = rank_constants((4,), 60), rank_constants((3, 2), 61)
    with tf.Graph().as_default():
        w1, w2 = tf.Variable(np.ones(4, np.float32)), tf.Variable(np.ones((3, 2), np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w1 * c1) + tf.reduce_sum(w2 * c2)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, [w1, w2])
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            g1, g2 = session.run(grads)
    assert tf_mpi.policy.grouping._cost_model is not None   # the probe ran, in graph mode
    assert np.allclose(g1, gathered(c1).mean(0), rtol=1e-6) and np.allclose(g2, gathered(c2).mean(0), rtol=1e-6)


if __name__ == "__main__":
    run_checks(globals(), R)
