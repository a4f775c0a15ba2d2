"""hvd.DistributedOptimizer with a TF1 optimizer (tf.compat.v1.train.Optimizer), as Horovod 0.28.1's
_DistributedOptimizer defines it (horovod/tensorflow/__init__.py, gradient_aggregation.py), run on
every rank by tests/test_legacy_optimizer.py at np=2.

Each rank's loss has a rank-dependent gradient; the expected weights are computed here with numpy
from every rank's inputs (gathered with mpi4py, never tf_mpi): Average / Sum / Min, a process set of
one rank (ranks outside it keep their own gradient), IndexedSlices (tf.gather), sparse_as_dense,
fp16 compression and gradient_predivide_factor, groups, register_local_var,
backward_passes_per_step with and without average_aggregated_gradients, eager execution, and the
dispatch / refusals of hvd.DistributedOptimizer.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402
from _expect import raises  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi as hvd  # noqa: E402
import tf_mpi.keras  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
from mpi4py import MPI  # noqa: E402

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
R = WORLD.Get_rank()
SOLO = hvd.ProcessSet([0])   # a set of one rank
hvd.init(process_sets=[SOLO])

V1 = tf.compat.v1
W0 = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
LR = 0.25


def coeffs(seed, rank=R, shape=(4,)):
    """Rank `rank`'s coefficients for `seed`: small integers, exact in float16 and float32."""
    return np.random.default_rng(1000 * seed + rank).integers(-4, 5, size=shape).astype(np.float32)


def all_ranks(seed, shape=(4,)):
    """Every rank's coeffs(seed), gathered with mpi4py (an independent check of what each computed)."""
    mine = coeffs(seed, shape=shape)
    gathered = np.array(WORLD.allgather(mine))
    for r in range(N):
        assert np.array_equal(gathered[r], coeffs(seed, r, shape)), "ranks disagree on the inputs"
    return gathered


def graph_step(make_opt, seed, steps=1, use_minimize=True, global_step=False, resource=True):
    """Runs `steps` steps of make_opt() on loss = sum(c * w**2) / 2 (gradient c * w, c per rank) in a TF1
    graph; returns (weights after each step, global_step values, the optimizer)."""
    c = coeffs(seed)
    graph = tf.Graph()
    with graph.as_default():
        w = V1.get_variable(f"w{seed}", initializer=W0.copy(), use_resource=resource)
        loss = tf.reduce_sum(c * w * w) / 2.0
        gs = V1.train.get_or_create_global_step() if global_step else None
        opt = make_opt()
        if use_minimize:
            train = opt.minimize(loss, var_list=[w], global_step=gs)
        else:
            train = opt.apply_gradients(opt.compute_gradients(loss, var_list=[w]), global_step=gs)
        init = [V1.global_variables_initializer(), V1.local_variables_initializer()]
        weights, steps_seen = [], []
        with V1.Session(graph=graph) as sess:
            sess.run(init)
            for _ in range(steps):
                sess.run(train)
                weights.append(sess.run(w))
                if gs is not None:
                    steps_seen.append(int(sess.run(gs)))
    return weights, steps_seen, opt


def check_average_sum_min_in_a_graph():
    """Average (minimize, two steps), Sum (compute_gradients + apply_gradients) and Min of c * w."""
    c = all_ranks(1)
    got, _, opt = graph_step(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR)), 1, steps=2)
    assert isinstance(opt, V1.train.Optimizer) and opt.get_name() == "DistributedGradientDescentOptimizer"
    w1 = W0 - LR * (c * W0).mean(0)
    w2 = w1 - LR * (c * w1).mean(0)
    np.testing.assert_allclose(got[0], w1, rtol=1e-6)
    np.testing.assert_allclose(got[1], w2, rtol=1e-6)
    got, _, _ = graph_step(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), op=hvd.Sum),
                           1, use_minimize=False)
    np.testing.assert_allclose(got[0], W0 - LR * (c * W0).sum(0), rtol=1e-6)
    got, _, _ = graph_step(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), op=hvd.Min),
                           1, resource=False)
    np.testing.assert_allclose(got[0], W0 - LR * (c * W0).min(0), rtol=1e-6)
    assert not np.allclose((c * W0).mean(0), c[R] * W0), "the ranks' gradients must differ"


def check_momentum_slots_delegate():
    """Momentum through the wrapper: the slots are the wrapped optimizer's; two steps match numpy."""
    c = all_ranks(2)
    inner = V1.train.MomentumOptimizer(LR, momentum=0.5)
    got, _, opt = graph_step(lambda: hvd.DistributedOptimizer(inner), 2, steps=2)
    g1 = (c * W0).mean(0)
    acc = g1
    w1 = W0 - LR * acc
    acc = 0.5 * acc + (c * w1).mean(0)
    w2 = w1 - LR * acc
    np.testing.assert_allclose(got[1], w2, rtol=1e-5)
    assert opt.get_slot_names() == inner.get_slot_names() == ["momentum"]
    assert opt.variables() == inner.variables()


def check_process_set_of_one_rank():
    """process_set={0}: rank 0 applies its own gradient (the set's average); rank 1, outside it, its own
    too (Horovod's ranks outside the set keep their gradient). Horovod's own test's optimizer shape:
    a custom TF1 optimizer over a ref variable."""
    got, _, _ = graph_step(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR),
                                                            process_set=SOLO), 3)
    c = all_ranks(3)
    np.testing.assert_allclose(got[0], W0 - LR * c[R] * W0, rtol=1e-6)
    # with op=Sum the global result would differ, so the set really limits the reduction
    assert not np.allclose(c[R] * W0, (c * W0).sum(0))

    class AddGrad(V1.train.Optimizer):
        def __init__(self):
            super().__init__(name="add", use_locking=False)
            self.variable = V1.get_variable("dummy", initializer=[0.0], use_resource=False)

        def compute_gradients(self, *args, **kwargs):
            return [(tf.constant([float(R + 1)]), self.variable)]

        def _apply_dense(self, grad, var):
            return var.assign_add(grad)

    graph = tf.Graph()
    with graph.as_default():
        opt = hvd.DistributedOptimizer(AddGrad(), process_set=SOLO)
        update = opt.apply_gradients(opt.compute_gradients())
        with V1.Session(graph=graph) as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(update)
            assert sess.run(opt._optimizer.variable)[0] == float(R + 1)


def check_indexed_slices():
    """tf.gather of a variable: the IndexedSlices gradients of every rank are summed row by row
    (allgather), averaged; sparse_as_dense gives the same weights."""
    table0 = np.arange(24, dtype=np.float32).reshape(6, 4) / 8.0
    idx = [np.array([r % 6, (2 * r + 1) % 6, 5], np.int32) for r in range(N)]
    scales = all_ranks(4, shape=(3, 4))
    expected_grad = np.zeros_like(table0)
    for r in range(N):
        np.add.at(expected_grad, idx[r], scales[r])
    expected = table0 - LR * expected_grad / N
    for sparse_as_dense in (False, True):
        graph = tf.Graph()
        with graph.as_default():
            table = V1.get_variable("table", initializer=table0.copy(), use_resource=True)
            loss = tf.reduce_sum(tf.gather(table, idx[R]) * scales[R])
            opt = hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), sparse_as_dense=sparse_as_dense)
            pairs = opt.compute_gradients(loss, var_list=[table])
            assert isinstance(pairs[0][0], tf.IndexedSlices) != sparse_as_dense
            train = opt.apply_gradients(pairs)
            with V1.Session(graph=graph) as sess:
                sess.run(V1.global_variables_initializer())
                sess.run(train)
                np.testing.assert_allclose(sess.run(table), expected, rtol=1e-6)


def check_compression_predivide_groups_local():
    """fp16 compression (exact for these values), gradient_predivide_factor=2, groups as lists and as
    a number give the averaged update; register_local_var keeps a gradient local, divided by size."""
    c = all_ranks(5)
    expected = W0 - LR * (c * W0).mean(0)
    for kwargs in ({"compression": hvd.Compression.fp16}, {"gradient_predivide_factor": 2.0}, {"groups": 1},
                   {"num_groups": 1}):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            got, _, _ = graph_step(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR),
                                                                    **kwargs), 5)
        np.testing.assert_allclose(got[0], expected, rtol=1e-6, err_msg=str(kwargs))
    graph = tf.Graph()
    with graph.as_default():
        a = V1.get_variable("a", initializer=W0.copy())
        b = V1.get_variable("b", initializer=W0.copy())
        loss = tf.reduce_sum(c[R] * (a * a + b * b)) / 2.0
        opt = hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), groups=[[a, b]])
        local = hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), name="local")
        local.register_local_var(b)
        train = opt.minimize(loss, var_list=[a, b])
        with V1.Session(graph=graph) as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(train)
            np.testing.assert_allclose(sess.run(a), expected, rtol=1e-6)
            np.testing.assert_allclose(sess.run(b), expected, rtol=1e-6)
            train_local = local.minimize(loss, var_list=[a, b])
            sess.run(train_local)
            np.testing.assert_allclose(sess.run(a), expected - LR * (c * expected).mean(0), rtol=1e-6)
            np.testing.assert_allclose(sess.run(b), expected - LR * c[R] * expected / N, rtol=1e-6)


def check_backward_passes_per_step():
    """k=3: the weights change only every third run, by the reduced sum of the three passes' gradients
    (divided by 3 with average_aggregated_gradients); global_step advances every run."""
    c = all_ranks(6)
    for average in (False, True):
        got, steps, _ = graph_step(
            lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), backward_passes_per_step=3,
                                             average_aggregated_gradients=average), 6, steps=6, global_step=True)
        w, expected = W0.copy(), []
        for run in range(6):
            if run % 3 == 2:   # the gradient c * w is taken at the same w for the 3 passes of a cycle
                w = w - LR * 3 * (c * w).mean(0) / (3 if average else 1)
            expected.append(w.copy())
        for run in range(6):
            np.testing.assert_allclose(got[run], expected[run], rtol=1e-5, err_msg=f"average={average} run {run}")
        assert steps == [1, 2, 3, 4, 5, 6], steps


def check_eager_execution():
    """Eagerly (Horovod 0.28.1 wraps a TF1 optimizer there too): compute_gradients of a callable loss
    returns reduced gradients and apply_gradients applies them; backward_passes_per_step > 1 is
    Horovod's ValueError."""
    c = all_ranks(7)
    w = tf.Variable(W0.copy())
    opt = hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR))
    pairs = opt.compute_gradients(lambda: tf.reduce_sum(c[R] * w * w) / 2.0, var_list=[w])
    np.testing.assert_allclose(pairs[0][0].numpy(), (c * W0).mean(0), rtol=1e-6)
    opt.apply_gradients(pairs)
    np.testing.assert_allclose(w.numpy(), W0 - LR * (c * W0).mean(0), rtol=1e-6)
    raises(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), backward_passes_per_step=2), ValueError)


def check_dispatch_and_refusals():
    """Keras optimizers keep the Keras path; tf_mpi.keras.DistributedOptimizer stays Keras-only; the
    TF1 path refuses Adasum (not supported), predivide with op != Average (ValueError, as Horovod),
    Adasum with average_aggregated_gradients (ValueError) and IndexedSlices accumulation without
    sparse_as_dense (ValueError)."""
    keras_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(keras_opt, keras.optimizers.Optimizer) and not isinstance(keras_opt, V1.train.Optimizer)
    raises(lambda: tf_mpi.keras.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR)), TypeError)
    raises(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), op=hvd.Adasum), NotImplementedError)
    raises(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), op=hvd.Sum, gradient_predivide_factor=2.0), ValueError)
    raises(lambda: hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), op=hvd.Adasum, average_aggregated_gradients=True), ValueError)
    graph = tf.Graph()
    with graph.as_default():
        table = V1.get_variable("t", initializer=np.ones((3, 2), np.float32))
        opt = hvd.DistributedOptimizer(V1.train.GradientDescentOptimizer(LR), backward_passes_per_step=2)
        raises(lambda: opt.compute_gradients(tf.reduce_sum(tf.gather(table, [0, 2])), var_list=[table]), ValueError)


if __name__ == "__main__":
    run_checks(globals(), R)
