"""Horovod 0.28.1 semantics of the Keras callbacks (tf_mpi.keras.callbacks), run on every rank
by tests/test_horovod_api_compat.py at np=2 (the callbacks run the same code at every world size;
the broadcasts under them are checked at np=2 and np=3 by tests/test_collectives.py).

Learning rates are compared with the formulas of Horovod's _keras/callbacks.py, written out
here (a number as multiplier decays as m ** (epoch - start_epoch); per batch the epoch is
epoch + batch / steps_per_epoch, and the warm-up adds 1 / steps_per_epoch). Broadcast results
are compared with root's values sent by mpi4py on MPI_COMM_WORLD (not by tf_mpi).
"""
import contextlib
import io
import os
import sys
import tempfile
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402
from _expect import raises  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi.keras as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()

from mpi4py import MPI  # noqa: E402  (after init: tf_mpi initialised MPI)

WORLD = MPI.COMM_WORLD
B = 4
ROOT = N - 1  # not rank 0, so that "root" is really the argument's rank


def make_model(seed, frozen=False):
    """Different weights on every rank when seed depends on the rank; 'frozen' is never trained."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(3, activation="tanh", name="a")(inputs)
    if frozen:
        x = keras.layers.Dense(2, name="frozen", trainable=False)(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(x))


def compiled(seed, opt, frozen=False):
    model = make_model(seed, frozen)
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss="mse", jit_compile=False)
    return model


def data(steps, seed=0):
    """This rank's shard: steps batches of B."""
    rng = np.random.default_rng(seed + R)
    return rng.normal(size=(steps * B, 4)).astype("float32"), rng.normal(size=(steps * B, 1)).astype("float32")


class RecordRates(keras.callbacks.Callback):
    """The learning rate every batch trains with (put after the schedule callbacks)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate))


def fit_rates(model, callbacks, steps, epochs, x=None):
    record = RecordRates()
    xs, ys = data(steps) if x is None else x
    history = model.fit(xs, ys, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[*callbacks, record])
    return np.array(record.rates), history.history


def horovod_schedule_rates(initial_lr, multiplier, start, end, staircase, steps, epochs, optimizer_lr):
    """Per-batch rates by Horovod's LearningRateScheduleCallbackImpl (constant multiplier)."""
    rates, lr = [], optimizer_lr
    for epoch in range(epochs):
        for batch in range(steps):
            if epoch >= start and (end is None or epoch < end):
                e = epoch if staircase else epoch + batch / steps
                lr = initial_lr * multiplier ** (e - start)
            rates.append(lr)
    return np.array(rates)


def assert_logged_rates(history, rates, steps, epochs):
    """history has Horovod's 'lr' and Keras 3's 'learning_rate': the rate at each epoch's end."""
    at_end = rates[steps - 1::steps]
    for key in ("lr", "learning_rate"):
        assert key in history, sorted(history)
        assert np.allclose(history[key], at_end, rtol=1e-6), (key, history[key], at_end)
    assert len(history["lr"]) == epochs


# ---------------------------------------------------------------- 1. a number as multiplier

def check_number_multiplier_decays_exponentially_per_epoch():
    steps, epochs = 2, 5
    model = compiled(1, keras.optimizers.SGD(1.0))
    cb = hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1, end_epoch=4)
    rates, history = fit_rates(model, [cb], steps, epochs)
    expected = horovod_schedule_rates(0.1, 0.5, 1, 4, True, steps, epochs, optimizer_lr=1.0)
    # Epoch 0 keeps the optimizer's rate; then 0.1, 0.05, 0.025; after end_epoch the last one stays.
    assert np.allclose(expected[::steps], [1.0, 0.1, 0.05, 0.025, 0.025])
    assert np.allclose(rates, expected, rtol=1e-6), (rates, expected)
    assert_logged_rates(history, rates, steps, epochs)


# ---------------------------------------------------------------- 2. steps_per_epoch from model.fit

def check_per_batch_schedule_detects_steps_per_epoch():
    steps, epochs = 3, 3
    model = compiled(1, keras.optimizers.SGD(1.0))
    cb = hvd.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1, staircase=False)
    rates, history = fit_rates(model, [cb], steps, epochs)
    assert cb.steps_per_epoch == steps, cb.steps_per_epoch
    expected = horovod_schedule_rates(0.2, 0.5, 1, None, False, steps, epochs, optimizer_lr=1.0)
    assert len(set(np.round(expected[steps:2 * steps], 9))) == steps  # really changes every batch
    assert np.allclose(rates, expected, rtol=1e-6), (rates, expected)
    assert_logged_rates(history, rates, steps, epochs)


def check_warmup_detects_steps_per_epoch_logs_and_reports():
    steps, epochs, warmup, lr0 = 3, 3, 2, 0.3
    model = compiled(1, keras.optimizers.SGD(lr0))
    cb = hvd.callbacks.LearningRateWarmupCallback(lr0, warmup_epochs=warmup, verbose=1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rates, history = fit_rates(model, [cb], steps, epochs)
    assert cb.steps_per_epoch == steps, cb.steps_per_epoch
    expected = []
    for epoch in range(epochs):
        for batch in range(steps):
            if epoch < warmup:  # Horovod: multiplier(epoch + batch / steps), shifted by 1 / steps
                e = epoch + batch / steps + 1 / steps
                expected.append(lr0 / N * (e * (N - 1) / warmup + 1))
            else:
                expected.append(expected[-1])
    assert np.allclose(rates, expected, rtol=1e-6), (rates, expected)
    assert abs(rates[0] - lr0 / N * (1 / steps * (N - 1) / warmup + 1)) < 1e-7
    assert abs(rates[warmup * steps - 1] - lr0) < 1e-7
    assert_logged_rates(history, rates, steps, epochs)
    final = float(model.optimizer.learning_rate)
    wanted = "\nEpoch %d: finished gradual learning rate warmup to %g.\n" % (warmup, final) if R == 0 else ""
    assert out.getvalue() == wanted, (out.getvalue(), wanted)


def check_per_batch_schedules_of_unknown_length_raise_before_training():
    xs, ys = data(3)
    # filter() makes the length unknown: model.fit announces params['steps'] = None.
    ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(B).filter(lambda a, b: tf.constant(True))
    for make in (lambda: hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2),
                 lambda: hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, staircase=False)):
        model = compiled(1, keras.optimizers.SGD(0.5))
        before = model.get_weights()
        cb = make()
        raises(lambda: model.fit(ds, epochs=1, verbose=0, callbacks=[cb]), ValueError,
               type(cb).__name__, "steps_per_epoch")
        assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))  # nothing trained
    # Given explicitly, or once per epoch (staircase), it is not needed.
    model = compiled(1, keras.optimizers.SGD(0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: "ran out of data" at the end of each epoch of unknown length
        model.fit(ds, epochs=2, verbose=0, callbacks=[
            hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=0),
            hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1, steps_per_epoch=3)])


def check_initial_lr_is_required():
    raises(lambda: hvd.callbacks.LearningRateScheduleCallback(None, 0.5), ValueError, "initial_lr")
    raises(lambda: hvd.callbacks.LearningRateWarmupCallback(None), ValueError, "initial_lr")


# ---------------------------------------------------------------- 4. BroadcastGlobalVariablesCallback

def snapshot(variables):
    return [np.array(v) for v in variables]


def check_broadcast_before_first_step_keeps_local_variables():
    model = compiled(100 + R, keras.optimizers.SGD(0.05, momentum=0.9), frozen=True)
    opt = model.optimizer
    opt.build(model.trainable_variables)
    for v in opt.variables:  # optimizer state differs per rank, as if restored from different checkpoints
        if "momentum" in v.path:
            v.assign(tf.fill(v.shape, 0.01 * (R + 1)))
    frozen = model.get_layer("frozen")
    frozen.bias.assign(tf.fill(frozen.bias.shape, float(R + 1)))  # zeros everywhere otherwise
    local_paths = {frozen.kernel.path, frozen.bias.path}
    own = {v.path: np.array(v) for v in model.variables + opt.variables}
    root = WORLD.bcast(own, root=ROOT)
    assert R == ROOT or not np.allclose(own["a/kernel"], root["a/kernel"])  # ranks really start apart

    seen = {}

    class AtFirstStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and not seen:
                seen.update({v.path: np.array(v) for v in model.variables + opt.variables})

    # A single variable (a Keras weight) as local_variables, one more (its tf.Variable) registered later.
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(ROOT, local_variables=frozen.kernel)
    cb.register_local_var(frozen.bias.value)
    xs, ys = data(3)
    model.fit(xs, ys, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[cb, AtFirstStep()])

    assert sorted(seen) == sorted(root)
    for path, value in seen.items():
        if path in local_paths:
            assert np.array_equal(value, own[path]), f"{path}: a local variable was overwritten"
        else:
            assert np.array_equal(value, root[path]), f"{path}: not root's value before the first step"
    assert any("momentum" in p for p in seen)
    # After training: the trained weights agree across ranks, the local ones are still each rank's own.
    final = {v.path: np.array(v) for v in model.variables}
    root_final = WORLD.bcast(final, root=ROOT)
    for path, value in final.items():
        if path in local_paths:
            assert np.array_equal(value, own[path]), path
            assert R == ROOT or not np.array_equal(value, root_final[path]), path
        else:
            assert np.array_equal(value, root_final[path]), f"{path} differs from root's after training"


def check_variables_created_by_the_first_step_are_broadcast_after_it():
    model = compiled(100 + R, keras.optimizers.SGD(0.05))
    created, after_first, after_second = [], {}, {}

    class CreateLate(keras.callbacks.Callback):
        """Optimizer state that appears during the first step (as Keras 2 slots did); rank-own values."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                v = model.optimizer.add_variable((3,), initializer="zeros", name="late_state")
                v.assign(tf.fill((3,), float(R + 1)))
                created.append(v)
            elif batch == 1:
                created[0].assign(tf.fill((3,), float(10 * (R + 1))))

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            (after_first if batch == 0 else after_second).setdefault("v", np.array(created[0]))
            (after_first if batch == 0 else after_second).setdefault(
                "w", snapshot(model.trainable_variables))

    xs, ys = data(3)
    model.fit(xs, ys, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[CreateLate(), hvd.callbacks.BroadcastGlobalVariablesCallback(ROOT), Read()])
    assert np.array_equal(after_first["v"], np.full(3, ROOT + 1.0)), after_first["v"]
    root_w = WORLD.bcast(after_first["w"], root=ROOT)
    assert all(np.array_equal(a, b) for a, b in zip(after_first["w"], root_w))
    # Only once: what each rank writes later is its own.
    assert np.array_equal(after_second["v"], np.full(3, 10.0 * (R + 1))), after_second["v"]


def check_broadcast_device_is_used_without_warning_and_local_variables_are_checked():
    model = compiled(100 + R, keras.optimizers.SGD(0.05))
    root = WORLD.bcast(snapshot(model.variables), root=ROOT)
    xs, ys = data(1)
    seen = []

    class AtFirstStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(snapshot(model.variables))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb = hvd.callbacks.BroadcastGlobalVariablesCallback(ROOT, device="/cpu:0")
        model.fit(xs, ys, batch_size=B, epochs=1, verbose=0, callbacks=[cb, AtFirstStep()])
    assert cb.device == "/cpu:0"
    assert not [w for w in caught if "device" in str(w.message)], [str(w.message) for w in caught]
    assert all(np.array_equal(a, b) for a, b in zip(seen[0], root))
    # The device really scopes the broadcast: TensorFlow rejects a malformed one, on every rank.
    raises(lambda: model.fit(xs, ys, batch_size=B, epochs=1, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(ROOT, device="nonsense")]), ValueError, "nonsense")
    raises(lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.zeros(2)]),
           ValueError, "local variables must be variables", "ndarray")
    raises(lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0).register_local_var(tf.zeros(2)),
           ValueError, "local variables must be variables")


# ---------------------------------------------------------------- 5. BestModelCheckpoint

def check_best_model_checkpoint_takes_horovods_arguments():
    cb = hvd.callbacks.BestModelCheckpoint("loss", 0, False, "min", "epoch")  # Horovod's positional order
    assert (cb.monitor, cb.verbose, cb.save_weights_only, cb.mode, cb.save_freq) == ("loss", 0, False, "min", "epoch")
    assert cb.save_best_only is True and cb.filepath is None
    weights_only = hvd.callbacks.BestModelCheckpoint(monitor="val_loss", save_weights_only=True)
    assert weights_only.filepath is None and weights_only.monitor == "val_loss"
    default = hvd.callbacks.BestModelCheckpoint()
    assert (default.monitor, default.mode, default.save_freq) == ("val_loss", "auto", "epoch")
    # tf_mpi's old positional path is refused with a pointer to the keyword.
    raises(lambda: hvd.callbacks.BestModelCheckpoint("best.keras"), TypeError, "filepath='best.keras'")

    xs, ys = data(2)
    model = compiled(1, keras.optimizers.SGD(0.05))
    before = model.get_weights()
    # No path when training starts: every rank raises before any step.
    raises(lambda: model.fit(xs, ys, batch_size=B, epochs=1, verbose=0, callbacks=[cb]), ValueError, "filepath")
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    cb.filepath = os.path.join(tempfile.mkdtemp(), "best.txt")
    raises(lambda: model.fit(xs, ys, batch_size=B, epochs=1, verbose=0, callbacks=[cb]), ValueError, ".keras")

    # Set afterwards (as Horovod's Spark estimator does), or as the filepath keyword: rank 0 saves.
    for make in (lambda path: _with_path(hvd.callbacks.BestModelCheckpoint(monitor="loss", mode="min"), path),
                 lambda path: hvd.callbacks.BestModelCheckpoint(monitor="loss", mode="min", filepath=path)):
        path = os.path.join(tempfile.mkdtemp(), "best.keras")  # a different directory on each rank
        epochs = []
        record = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: epochs.append((logs["loss"], model.get_weights())))
        model.fit(xs, ys, batch_size=B, epochs=3, verbose=0,
                  callbacks=[hvd.callbacks.MetricAverageCallback(), make(path), record])
        assert os.path.exists(path) == (R == 0), f"rank {R}: saved={os.path.exists(path)}"
        if R == 0:  # the weights of the epoch with the lowest (averaged) loss
            best = min(epochs, key=lambda e: e[0])[1]
            saved = keras.models.load_model(path)
            assert all(np.array_equal(a, b) for a, b in zip(saved.get_weights(), best))


def _with_path(cb, path):
    cb.filepath = path
    return cb


if __name__ == "__main__":
    results = run_checks(globals(), R)
    hvd.shutdown()
    sys.exit(0)
