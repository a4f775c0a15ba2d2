"""Horovod 0.28.1 semantics that `import tf_mpi as hvd` must keep,
run on every rank by tests/test_horovod_compat.py at np=2 and np=3.

Each check states what Horovod documents and implements for one point of the
issue; expected values come from numpy and, where a reduction across ranks is
needed, from mpi4py on MPI_COMM_WORLD (not from tf_mpi). Gradients are checked
eagerly, inside tf.function and in a TF1-style graph run by a Session.
"""
import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402
from _expect import raises  # noqa: E402

import tf_mpi as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()

from mpi4py import MPI  # noqa: E402  (after init: tf_mpi initialised MPI with MPI_THREAD_MULTIPLE)

WORLD = MPI.COMM_WORLD
MODES = ("eager", "function", "graph")


def mpi_mean(a):
    """Average of `a` over ranks, by mpi4py (independent of tf_mpi)."""
    return WORLD.allreduce(np.asarray(a, np.float64), op=MPI.SUM) / N


@contextlib.contextmanager
def tf1_session():
    """A TF1-style graph and a Session on it (graph mode, as Horovod's tests run)."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        yield sess


def gradients(mode, inits, forward):
    """d forward(xs) / d xs as numpy arrays, in one of MODES."""
    if mode == "graph":
        with tf1_session() as sess:
            xs = [tf.constant(v) for v in inits]
            grads = tf.gradients(forward(xs), xs)
            return sess.run(grads)
    xs = [tf.Variable(v) for v in inits]

    def taped():
        with tf.GradientTape() as tape:
            loss = forward(xs)
        return tape.gradient(loss, xs)

    grads = tf.function(taped)() if mode == "function" else taped()
    return [tf.convert_to_tensor(g).numpy() for g in grads]


# ---------------------------------------------------------------- 1. error classes

def check_mismatches_raise_failed_precondition_on_every_rank():
    """Horovod: ranks that disagree on a collective get tf.errors.FailedPreconditionError."""
    F = tf.errors.FailedPreconditionError
    odd = R % 2 == 1
    cases = {
        "allreduce shape": lambda: hvd.allreduce(tf.ones([2 + R]), op=hvd.Sum, name="e.ar.shape"),
        "allreduce dtype": lambda: hvd.allreduce(tf.ones([2], tf.int32 if odd else tf.float32), name="e.ar.dtype"),
        "allreduce op": lambda: hvd.allreduce(tf.ones([2]), op=hvd.Max if odd else hvd.Sum, name="e.ar.op"),
        "grouped allreduce shape": lambda: hvd.grouped_allreduce([tf.ones([2]), tf.ones([1 + R])], name="e.gar"),
        "allgather shape": lambda: hvd.allgather(tf.ones([2, 3 + R]), name="e.ag.shape"),
        "allgather dtype": lambda: hvd.allgather(tf.ones([2], tf.int32 if odd else tf.float32), name="e.ag.dtype"),
        "allgather rank": lambda: hvd.allgather(tf.ones([2] + [1] * R), name="e.ag.rank"),
        "broadcast shape": lambda: hvd.broadcast(tf.ones([2 + R]), root_rank=0, name="e.bc.shape"),
        "broadcast dtype": lambda: hvd.broadcast(tf.ones([2], tf.int32 if odd else tf.float32), 0, name="e.bc.dt"),
        "broadcast root rank": lambda: hvd.broadcast(tf.ones([2]), root_rank=R, name="e.bc.root"),
        "alltoall shape": lambda: hvd.alltoall(tf.ones([2 * N, 10 * (R + 1)]), name="e.a2a.shape"),
        "alltoall dtype": lambda: hvd.alltoall(tf.ones([N], tf.int32 if odd else tf.float32), name="e.a2a.dtype"),
        "reducescatter shape": lambda: hvd.reducescatter(tf.ones([N * (2 + R)]), op=hvd.Sum, name="e.rs.shape"),
        "reducescatter dtype": lambda: hvd.reducescatter(tf.ones([N], tf.int32 if odd else tf.float32),
                                                         op=hvd.Sum, name="e.rs.dtype"),
        "different collectives": lambda: (hvd.allgather(tf.ones([2]), name="e.kind") if odd
                                          else hvd.allreduce(tf.ones([2]), name="e.kind")),
    }
    for what, fn in cases.items():
        try:
            raises(fn, F, "mismatched")
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None

    # The same inside tf.function and in a TF1 Session.
    @tf.function
    def in_function(x):
        return hvd.allreduce(x, op=hvd.Sum, name="e.fn")

    raises(lambda: in_function(tf.ones([1 + R])), F, "mismatched")
    with tf1_session() as sess:
        y = hvd.broadcast(tf.ones([1 + R]), root_rank=0, name="e.graph")
        raises(lambda: sess.run(y), F, "mismatched")
    # A rank's own bad arguments stay InvalidArgumentError, as in Horovod.
    inv = tf.errors.InvalidArgumentError
    raises(lambda: hvd.alltoall(tf.range(N - 1), splits=[1] * N, name="e.a2a.sum"), inv, "sum to")
    raises(lambda: hvd.alltoall(tf.ones([2 * N + 1, 2]), name="e.a2a.div"), inv, "divisible")
    # And the engine keeps working.
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="e.after")) == N


# ---------------------------------------------------------------- 2. 16-bit integers

def ints(rank, shape, dtype):
    """Small rank-dependent integers; negative ones for int16."""
    a = (np.arange(int(np.prod(shape))).reshape(shape) * (rank + 1) + 3 * rank) % 7
    return (a - 3 if dtype == tf.int16 else a + 1).astype(dtype.as_numpy_dtype)


def check_int16_and_uint16_in_every_collective():
    shape = (2 * N, 3)
    for dt in (tf.int16, tf.uint16):
        stack = np.stack([ints(r, shape, dt) for r in range(N)]).astype(np.int64)
        x = tf.constant(ints(R, shape, dt))
        for op, want in ((hvd.Sum, stack.sum(0)), (hvd.Min, stack.min(0)), (hvd.Max, stack.max(0)),
                         (hvd.Product, stack.prod(0)),
                         # Horovod averages integers by scaling the sum by 1/size in double
                         # precision and converting back (truncation toward zero).
                         (hvd.Average, np.trunc(stack.sum(0) * (1.0 / N)))):
            got = hvd.allreduce(x, op=op, name=f"i16.ar.{dt.name}.{op}")
            assert got.dtype == dt and np.array_equal(got.numpy().astype(np.int64), want), (dt.name, op, got)
        a, b, c = hvd.grouped_allreduce([x, tf.constant(ints(R, (4,), dt)), tf.ones([2])], op=hvd.Sum,
                                        name=f"i16.gar.{dt.name}")
        assert np.array_equal(a.numpy().astype(np.int64), stack.sum(0)) and c.numpy().tolist() == [N, N]
        rows = tf.constant(ints(R, (R + 1, 3), dt))
        got = hvd.allgather(rows, name=f"i16.ag.{dt.name}")
        assert got.dtype == dt and np.array_equal(got.numpy(), np.concatenate([ints(r, (r + 1, 3), dt)
                                                                               for r in range(N)]))
        got = hvd.broadcast(x, root_rank=N - 1, name=f"i16.bc.{dt.name}")
        assert np.array_equal(got.numpy(), ints(N - 1, shape, dt))
        got, counts = hvd.alltoall(x, splits=[2] * N, name=f"i16.a2a.{dt.name}")
        assert np.array_equal(got.numpy(), np.concatenate([ints(r, shape, dt)[2 * R:2 * R + 2] for r in range(N)]))
        got = hvd.reducescatter(x, op=hvd.Sum, name=f"i16.rs.{dt.name}")
        assert np.array_equal(got.numpy().astype(np.int64), stack.sum(0)[2 * R:2 * R + 2])
        v = tf.Variable(ints(R, (3,), dt))
        hvd.broadcast_variables([v], root_rank=N - 1)
        assert np.array_equal(v.numpy(), ints(N - 1, (3,), dt))


# ---------------------------------------------------------------- 3. alltoall's return value

def check_alltoall_returns_only_the_tensor_without_splits():
    x = tf.reshape(tf.range(2 * N * 2) + 100 * R, [2 * N, 2])
    want = np.concatenate([(np.arange(4 * N) + 100 * r).reshape(2 * N, 2)[2 * R:2 * R + 2] for r in range(N)])
    out = hvd.alltoall(x, name="a2a.plain")
    assert isinstance(out, tf.Tensor), type(out)
    assert np.array_equal(tf.cast(hvd.alltoall(x, name="a2a.cast"), tf.float64).numpy(), want)
    out, received = hvd.alltoall(x, splits=[2] * N, name="a2a.pair")
    assert np.array_equal(out.numpy(), want) and received.numpy().tolist() == [2] * N

    @tf.function
    def f(t):
        return hvd.alltoall(t) * 2

    assert np.array_equal(f(x).numpy(), 2 * want)
    # Differentiable without splits too: row block j went to rank j and comes back.
    g = gradients("eager", [np.ones([2 * N, 2], np.float32)],
                  lambda xs: tf.reduce_sum(hvd.alltoall(xs[0], name="a2a.grad") * float(R + 1)))[0]
    assert np.allclose(g[:, 0], np.repeat(np.arange(N) + 1.0, 2)), g


# ---------------------------------------------------------------- 4. gradients
# Every rank's loss weights the collective's output by (rank + 1), so the
# gradient arriving on rank q is (q + 1) times the weights; mean_q (q + 1) = (N + 1) / 2.

MEAN_COEF = (N + 1) / 2.0


def check_broadcast_gradient_is_an_average_on_root_and_zero_elsewhere():
    """Horovod: d/dx broadcast(x) = allreduce(Average) of the upstream gradient on root, 0 on the others."""
    root = N - 1
    wa, wb = np.arange(1.0, 4.0), np.arange(1.0, 5.0).reshape(2, 2)
    inits = [np.full([3], R + 1.0, np.float32), np.full([2, 2], R + 1.0, np.float64)]

    def single(xs):
        ya = hvd.broadcast(xs[0], root_rank=root)
        yb = hvd.broadcast(xs[1], root_rank=root)
        return (tf.reduce_sum(tf.cast(ya, tf.float64) * wa) + tf.reduce_sum(yb * wb)) * (R + 1.0)

    def grouped(xs):
        ya, yb = hvd.grouped_broadcast(xs, root_rank=root)
        return (tf.reduce_sum(tf.cast(ya, tf.float64) * wa) + tf.reduce_sum(yb * wb)) * (R + 1.0)

    for mode in MODES:
        for kind, fn in (("single", single), ("grouped", grouped)):
            ga, gb = gradients(mode, inits, fn)
            scale = MEAN_COEF if R == root else 0.0
            assert np.allclose(ga, scale * wa) and np.allclose(gb, scale * wb), (mode, kind, ga, gb)


def check_allgather_gradient_is_my_slice_of_the_averaged_gradient():
    """Horovod: allreduce(Average) of the upstream gradient, then this rank's rows."""
    rows_a = [r + 1 for r in range(N)]
    rows_b = [2 if r % 2 else 1 for r in range(N)]
    wa = np.arange(1.0, sum(rows_a) + 1)[:, None] * np.ones([1, 2])
    wb = -np.arange(1.0, sum(rows_b) + 1)[:, None]
    inits = [np.ones([rows_a[R], 2], np.float32), np.ones([rows_b[R], 1], np.float64)]
    sa, sb = sum(rows_a[:R]), sum(rows_b[:R])

    def single(xs):
        return (tf.reduce_sum(tf.cast(hvd.allgather(xs[0]), tf.float64) * wa)
                + tf.reduce_sum(hvd.allgather(xs[1]) * wb)) * (R + 1.0)

    def grouped(xs):
        ya, yb = hvd.grouped_allgather(xs)
        return (tf.reduce_sum(tf.cast(ya, tf.float64) * wa) + tf.reduce_sum(yb * wb)) * (R + 1.0)

    for mode in MODES:
        for kind, fn in (("single", single), ("grouped", grouped)):
            ga, gb = gradients(mode, inits, fn)
            assert np.allclose(ga, MEAN_COEF * wa[sa:sa + rows_a[R]]), (mode, kind, ga)
            assert np.allclose(gb, MEAN_COEF * wb[sb:sb + rows_b[R]]), (mode, kind, gb)


def check_reducescatter_gradient_is_an_allgather_scaled_per_op():
    """Horovod: allgather of the upstream gradient, times size() for op=Sum, as is for op=Average."""
    inits = [np.ones([2 * N, 2], np.float32), np.ones([N, 3], np.float64)]
    block = np.repeat(np.arange(1.0, N + 1), 2)  # rank j's rows carry gradient (j + 1)

    for op, factor in ((hvd.Sum, N), (hvd.Average, 1)):
        def single(xs):
            return (tf.reduce_sum(tf.cast(hvd.reducescatter(xs[0], op=op), tf.float64))
                    + tf.reduce_sum(hvd.reducescatter(xs[1], op=op))) * (R + 1.0)

        def grouped(xs):
            ya, yb = hvd.grouped_reducescatter(xs, op=op)
            return (tf.reduce_sum(tf.cast(ya, tf.float64)) + tf.reduce_sum(yb)) * (R + 1.0)

        for mode in MODES:
            for kind, fn in (("single", single), ("grouped", grouped)):
                ga, gb = gradients(mode, inits, fn)
                assert np.allclose(ga[:, 0], factor * block), (op, mode, kind, ga)
                assert np.allclose(gb[:, 0], factor * np.arange(1.0, N + 1)), (op, mode, kind, gb)


# ---------------------------------------------------------------- 5. in-place broadcast

INPLACE_DTYPES = [tf.float32, tf.float64, tf.float16, tf.int32, tf.int64, tf.uint8, tf.int8, tf.bool]


def start(rank, dtype):
    a = np.arange(6).reshape(2, 3) + 10 * rank
    return (a % 2 == rank % 2) if dtype == tf.bool else a.astype(dtype.as_numpy_dtype)


def check_inplace_broadcast_returns_root_values_eagerly_and_in_tf_function():
    root = N - 1
    variables = [tf.Variable(start(R, dt)) for dt in INPLACE_DTYPES]
    out = hvd.broadcast_(variables, root_rank=root, name="inplace.eager")
    assert len(out) == len(variables)
    for v, o, dt in zip(variables, out, INPLACE_DTYPES):
        assert isinstance(o, tf.Tensor) and not isinstance(o, tf.Variable), type(o)  # values, as Horovod
        assert o.dtype == dt and np.array_equal(o.numpy(), start(root, dt)), dt.name
        assert np.array_equal(v.numpy(), start(root, dt)), dt.name

    variables = [tf.Variable(start(R + 1, dt)) for dt in INPLACE_DTYPES]

    @tf.function
    def in_function():
        return hvd.broadcast_(variables, root_rank=0)

    for v, o, dt in zip(variables, in_function(), INPLACE_DTYPES):
        assert np.array_equal(o.numpy(), start(1, dt)) and np.array_equal(v.numpy(), start(1, dt)), dt.name


def check_inplace_broadcast_in_graph_mode_with_resource_and_ref_variables():
    root = N - 1
    for use_resource in (True, False):
        with tf1_session() as sess:
            variables = [tf.compat.v1.Variable(start(R, dt), use_resource=use_resource) for dt in INPLACE_DTYPES]
            sess.run(tf.compat.v1.global_variables_initializer())
            out = hvd.broadcast_(variables, root_rank=root)
            returned = sess.run(out)
            after = sess.run([v.read_value() for v in variables])
        for dt, o, a in zip(INPLACE_DTYPES, returned, after):
            want = start(root, dt)
            assert np.array_equal(o, want), (use_resource, dt.name, o)
            assert np.array_equal(a, want), (use_resource, dt.name, a)


# ---------------------------------------------------------------- 6. missing or narrower API

def check_broadcast_global_variables_and_broadcast_variables_in_graph_mode():
    root = N - 1
    with tf1_session() as sess:
        a = tf.compat.v1.Variable(start(R, tf.float32), use_resource=True)
        b = tf.compat.v1.Variable(start(R, tf.int64), use_resource=False)
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_global_variables(root))  # an op to run, as in Horovod
        assert np.array_equal(sess.run(a), start(root, tf.float32)) and np.array_equal(sess.run(b), start(root,
                                                                                                      tf.int64))
        c = tf.compat.v1.Variable(start(R, tf.float64))
        sess.run(c.initializer)
        sess.run(hvd.broadcast_variables([c], root_rank=0))
        assert np.array_equal(sess.run(c), start(0, tf.float64))
    # Eagerly there are no global variables: Horovod raises RuntimeError.
    raises(lambda: hvd.broadcast_global_variables(0), RuntimeError, "broadcast_variables")


def check_grouped_allreduce_accepts_the_deprecated_average_flag():
    xs = [tf.fill([3], float(R + 1)), tf.fill([2], float(2 * R))]
    summed = hvd.grouped_allreduce(xs, average=False, name="dep.sum")
    averaged = hvd.grouped_allreduce(xs, average=True, name="dep.avg")
    want = [sum(r + 1.0 for r in range(N)), sum(2.0 * r for r in range(N))]
    assert np.allclose(summed[0].numpy(), want[0]) and np.allclose(summed[1].numpy(), want[1])
    assert np.allclose(averaged[0].numpy(), want[0] / N) and np.allclose(averaged[1].numpy(), want[1] / N)
    # Both at once is ambiguous: Horovod refuses.
    raises(lambda: hvd.grouped_allreduce(xs, average=True, op=hvd.Sum), ValueError, "op")
    raises(lambda: hvd.allreduce(xs[0], average=True, op=hvd.Sum), ValueError, "op")


def check_indexed_slices_average_of_integers_divides_like_horovod():
    """Horovod allgathers values and indices, then divides the values by size() (true division)."""
    for dt in (tf.int32, tf.int64, tf.int16):
        vals = [np.full([r + 1, 2], 3 * r + 1) for r in range(N)]
        sl = tf.IndexedSlices(tf.constant(vals[R], dt), tf.constant(np.arange(R + 1), tf.int64),
                              dense_shape=tf.constant([10, 2], tf.int64))
        for out in (hvd.allreduce(sl, op=hvd.Average, name=f"is.{dt.name}"),
                    hvd.grouped_allreduce([sl], op=hvd.Average, name=f"is.g.{dt.name}")[0]):
            assert isinstance(out, tf.IndexedSlices)
            want = np.concatenate(vals) / N
            assert out.values.dtype.is_floating and np.allclose(out.values.numpy(), want), (dt.name, out.values)
            assert out.indices.numpy().tolist() == [i for r in range(N) for i in range(r + 1)]


def check_sync_batch_norm_takes_horovod_and_keras2_arguments():
    import keras
    assert hvd.SyncBatchNormalization is not None  # at the top level, as horovod.tensorflow has it
    bn = hvd.SyncBatchNormalization(fused=False, axis=-1, momentum=0.0, epsilon=1e-3, center=True, scale=True,
                                    renorm=False, virtual_batch_size=None, adjustment=None, trainable=True)
    raises(lambda: hvd.SyncBatchNormalization(fused=True), ValueError, "fused")
    x = (np.arange(12.0).reshape(4, 3) + 5 * R).astype(np.float32)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, bn(inputs))
    model(x, training=True)  # a training call updates the moving statistics
    everyone = np.concatenate(WORLD.allgather(x))
    assert np.allclose(bn.moving_mean.numpy(), everyone.mean(0), atol=1e-5), bn.moving_mean.numpy()


def _two_layer_model(seed):
    import keras
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, name="d0")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="d1")(h))
    return model


def _local_and_reduced(model, make_tape):
    x = tf.constant(np.arange(8.0, dtype=np.float32).reshape(2, 4) * (R + 1))
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    local = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    reduced = [g.numpy() for g in make_tape(tape).gradient(loss, model.trainable_variables)]
    return local, reduced


def check_partial_tape_and_register_local_source_with_keras3_variables():
    """Horovod: gradients of local sources are not reduced and, by default, divided by size()."""
    model = _two_layer_model(3)
    variables = model.trainable_variables
    d0 = [i for i, v in enumerate(variables) if v.path.startswith("d0/")]
    cases = [
        ("partial, one layer", lambda t: hvd.PartialDistributedGradientTape(t, local_layers=model.get_layer("d0")),
         d0, 1.0 / N),
        ("partial, unscaled", lambda t: hvd.PartialDistributedGradientTape(
            t, local_layers=[model.get_layer("d0")], scale_local_gradients=False), d0, 1.0),
    ]

    def registered(t):
        tape = hvd.DistributedGradientTape(t)
        tape.register_local_source(variables[-1])  # a Keras 3 variable
        return tape

    cases.append(("register_local_source", registered, [len(variables) - 1], 1.0 / N))
    for what, make, local_idx, scale in cases:
        local, reduced = _local_and_reduced(model, make)
        for i, (lg, g) in enumerate(zip(local, reduced)):
            want = lg * scale if i in local_idx else mpi_mean(lg)
            assert np.allclose(g, want, rtol=1e-5, atol=1e-6), (what, variables[i].path, g, want)


def check_distributed_optimizer_register_local_var():
    import keras
    model = _two_layer_model(4)
    variables = model.trainable_variables
    before = [v.numpy().copy() for v in variables]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.register_local_var(variables[0])
    x = tf.constant(np.arange(8.0, dtype=np.float32).reshape(2, 4) + R)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    grads = tape.gradient(loss, variables)
    local = [g.numpy() for g in grads]
    opt.apply_gradients(zip(grads, variables))
    for i, v in enumerate(variables):
        step = local[i] / N if i == 0 else mpi_mean(local[i])
        assert np.allclose(v.numpy(), before[i] - step, rtol=1e-5, atol=1e-6), (v.path, v.numpy())


def check_elastic_state_commit_restore_sync_and_run():
    import keras
    from tf_mpi import elastic
    assert hvd.elastic is elastic
    model = _two_layer_model(10 + R)  # different weights per rank
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)
    state = elastic.TensorFlowKerasState(model, optimizer=opt, epoch=R + 3, batch=7 * R)
    calls = []

    @elastic.run
    def train(state, tag):
        calls.append(tag)
        # run() synced first: rank 0's weights, optimizer state and attributes everywhere.
        for w in model.weights:
            mine = w.numpy()
            assert np.array_equal(mine, WORLD.bcast(mine, root=0)), w.path
        assert (state.epoch, state.batch) == (3, 0), (state.epoch, state.batch)
        if len(calls) == 1:
            state.epoch = 99  # uncommitted; the retry syncs rank 0's committed state again
            raise elastic.HostsUpdatedInterrupt(skip_sync=False)
        return f"done {tag}"

    assert train(state, "t") == "done t" and calls == ["t", "t"]
    kernel = model.get_layer("d0").kernel
    kernel.assign(tf.fill(kernel.shape, 7.0))
    state.epoch, state.batch = 5, 2
    state.commit()
    kernel.assign(tf.zeros(kernel.shape))
    opt.variables[-1].assign(tf.fill(opt.variables[-1].shape, 123.0))
    state.epoch = 9
    state.restore()
    assert np.all(kernel.numpy() == 7.0) and (state.epoch, state.batch) == (5, 2)
    assert not np.any(opt.variables[-1].numpy() == 123.0)

    v = tf.Variable(tf.fill([3], float(R)))
    tstate = elastic.TensorFlowState(variables=[v], step=R + 1)
    tstate.sync()
    assert np.all(v.numpy() == 0.0) and tstate.step == 1
    v.assign([5.0, 6.0, 7.0])
    tstate.step = 4
    tstate.commit()
    v.assign(tf.zeros([3]))
    tstate.step = 0
    tstate.restore()
    assert v.numpy().tolist() == [5.0, 6.0, 7.0] and tstate.step == 4
    seen = []
    tstate.register_reset_callbacks([lambda: seen.append("reset")])
    tstate.on_reset()
    assert seen == ["reset"]


def check_keras_elastic_state_and_callbacks():
    import keras
    import tf_mpi.keras as khvd
    model = _two_layer_model(20 + R)  # different weights per rank
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    state = khvd.elastic.KerasState(model, batch=0, epoch=0)
    commits = []
    state.commit = lambda orig=state.commit: (commits.append(1), orig())

    @khvd.elastic.run
    def train(state):
        for w in model.weights:  # run() synced rank 0's model first
            assert np.array_equal(w.numpy(), WORLD.bcast(w.numpy(), root=0)), w.path
        model.fit(np.ones([8, 4], np.float32), np.zeros([8, 2], np.float32), batch_size=2, epochs=2, verbose=0,
                  callbacks=[khvd.elastic.UpdateEpochStateCallback(state), khvd.elastic.UpdateBatchStateCallback(state),
                             khvd.elastic.CommitStateCallback(state, batches_per_commit=3)])
        return state.epoch, state.batch

    # Horovod's UpdateEpochStateCallback: epoch = epoch at fit's start + Keras epoch + 1 (the
    # next one to run); the batch is reset at each epoch's end.
    assert train(state) == (2, 0)
    # CommitStateCallback: after the 3rd and the 6th of 8 batches and at both epochs' ends.
    assert len(commits) == 4, commits


def check_elastic_run_restores_and_refuses_rank_membership_changes():
    """Where Horovod's elastic driver would go on with the remaining ranks, tf_mpi says it cannot."""
    from tf_mpi import elastic
    state = elastic.ObjectState(step=1)
    state.commit()

    @elastic.run
    def train(state):
        state.step = 5  # never committed
        if R == N - 1:
            hvd.shutdown()  # this rank leaves the job
            return "left"
        hvd.allreduce(tf.ones([1]), name="elastic.after.leave")
        return "continued"

    try:
        if R == N - 1:
            assert train(state) == "left"
        else:
            text = raises(lambda: train(state), elastic.HorovodInternalError, "fixed set of ranks",
                          "membership changes are not supported")
            # Rank 0 coordinates and always sees rank N-1 leave; another rank's allreduce may reach
            # rank 0 only after rank 0 has shut down as well (below), which is then its reason.
            causes = [f"rank {N - 1} called shutdown()"] + (["rank 0 called shutdown()"] if R else [])
            assert any(c in text for c in causes), (causes, text)
            assert state.step == 1  # restored to the last commit
    finally:  # every rank starts again, also where an assertion above failed: no rank waits alone in init
        if hvd.is_initialized():
            hvd.shutdown()
        hvd.init()
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="elastic.reinit")) == N


if __name__ == "__main__":
    run_checks(globals(), R)
