"""The backprop scheduling hint on a real traced step (single process: it only
adds control edges to the graph; its effect on when groups reach the engine is
measured in docs/performance.md)."""
import numpy as np
import tensorflow as tf

import keras
from tf_mpi.policy.backprop_order import _ancestors, order_backprop


def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((12,))
    x = keras.layers.Dense(16, activation="tanh", name="low")(inputs)
    x = keras.layers.Dense(16, activation="tanh", name="mid")(x)
    outputs = keras.layers.Dense(1, name="top")(x)
    return keras.Model(inputs, outputs)


def _step(model, ordered, record):
    variables = model.trainable_variables  # low k/b, mid k/b, top k/b

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        g = tape.gradient(loss, variables)
        groups = [g[4:6], g[2:4], g[0:2]]  # the order backprop produces them
        if ordered:
            record["edges"] = order_backprop(groups)
            record["groups"] = groups
        return g

    return step


def test_the_hint_orders_backprop_and_leaves_the_gradients_unchanged():
    model = _model()
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 12)), tf.float32)
    plain = _step(model, False, {})(x)
    record = {}
    ordered = _step(model, True, record)(x)
    # Same numbers, bit for bit: only the order of independent kernels changed.
    for a, b in zip(plain, ordered):
        assert np.array_equal(a.numpy(), b.numpy())
    assert record["edges"] > 0
    # Every op that only a later group needs now runs after the earlier group's
    # gradients exist: each one has them among its ancestors.
    groups = record["groups"]
    done = _ancestors([t.op for t in groups[0]])
    for k in (1, 2):
        later = _ancestors([t.op for t in groups[k]]) - done
        earlier_grads = {t.op for t in groups[k - 1]}
        computing = [op for op in later if op.inputs and op not in earlier_grads]
        assert computing
        for op in computing:
            assert earlier_grads <= _ancestors([op]), op.name
        done |= later


def test_the_hint_does_nothing_eagerly_or_for_one_group():
    assert order_backprop([[tf.constant(1.0)], [tf.constant(2.0)]]) == 0
    assert order_backprop([[tf.constant(1.0)]]) == 0
