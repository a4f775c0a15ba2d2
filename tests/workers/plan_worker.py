"""A Keras model trained with TF_MPI_AUTOTUNE=plan, run by tests/test_effective_plan.py: the
grouping plan's groups, as describe() names them, are what rank 0's tuner reports as the
effective plan (the same collectives, merged or not, in order)."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi.keras as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R = hvd.rank()
STEPS, BATCH = 80, 8


def check_plan_is_described_with_its_collectives_and_the_holdback():
    assert os.environ.get("TF_MPI_AUTOTUNE") == "plan"
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh", name="d0"),
                              keras.layers.Dense(8, activation="tanh", name="d1"), keras.layers.Dense(1, name="out")])
    # Three groups, one per layer (the last one: the layers in no list).
    groups = [model.get_layer("out").trainable_weights, model.get_layer("d1").trainable_weights]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), name="plan", groups=groups)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(R)
    x = rng.normal(size=(STEPS * BATCH, 6)).astype(np.float32)
    y = x.sum(1, keepdims=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    plan = opt.grouping_plan
    text = plan.describe()
    assert len(plan.groups) == 3, text
    for k in range(3):
        assert f"  group {k} (plan.group{k}): " in text, text
    assert "rank 0's holdback may send consecutive groups as one message" in text, text
    if R == 0:
        print("PLAN_COLLECTIVES " + json.dumps([plan.collective_name(k) for k in range(3)]), flush=True)
        print(text, flush=True)


run_checks(globals(), R)
