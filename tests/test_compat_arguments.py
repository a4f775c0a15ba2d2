"""Horovod parameters that tf_mpi accepts but has no use for: each warns once, saying what tf_mpi
does instead, and only when a call asks for something tf_mpi does not do (single process, no MPI).
device_dense / device_sparse are not among them: they place the collectives (tf.device), checked
at 2 ranks in tests/workers/keras_worker.py."""
import warnings

import pytest


@pytest.fixture
def fresh_warnings():
    from tf_mpi import _unused_arguments
    _unused_arguments._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    _unused_arguments._warned.clear()


def _messages(caught):
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _model():
    import keras
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    return model


def test_callback_devices_warn_once_each(fresh_warnings):
    import tf_mpi.keras as hvd
    hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    hvd.callbacks.MetricAverageCallback()
    assert _messages(fresh_warnings) == []  # the defaults ask for nothing
    for _ in range(3):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, device="/cpu:0")
        hvd.callbacks.MetricAverageCallback(device="/gpu:0")
    messages = _messages(fresh_warnings)
    # The broadcast's device is used as its device scope (as Horovod does): nothing to warn about.
    assert len(messages) == 1, messages
    assert "MetricAverageCallback(device=...)" in messages[0] and "host memory" in messages[0]


def test_momentum_correction_warns_when_asked_for(fresh_warnings):
    import tf_mpi.keras as hvd
    hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5)
    hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, momentum_correction=False)
    hvd.callbacks.LearningRateWarmupCallback(0.1, steps_per_epoch=10, momentum_correction=False)
    assert _messages(fresh_warnings) == []  # no correction asked for: none done, nothing to say
    for _ in range(2):
        hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, momentum_correction=True)
        hvd.callbacks.LearningRateWarmupCallback(0.1, steps_per_epoch=10, momentum_correction=True)
    messages = _messages(fresh_warnings)
    assert len(messages) == 2, messages
    assert messages[0].startswith("tf_mpi: LearningRateScheduleCallback(momentum_correction=...)")
    assert messages[1].startswith("tf_mpi: LearningRateWarmupCallback(momentum_correction=...)")
    assert all("momentum is not rescaled" in m for m in messages)
    # The warning points at the caller's line, not into tf_mpi.
    assert all(w.filename == __file__ for w in fresh_warnings if issubclass(w.category, UserWarning))


def test_elastic_keras_state_backend_warns(fresh_warnings):
    import keras
    import tf_mpi.keras as hvd
    model = _model()
    hvd.elastic.KerasState(model, epoch=0)
    assert _messages(fresh_warnings) == []
    hvd.elastic.KerasState(model, backend=keras.backend, epoch=0)
    hvd.elastic.TensorFlowKerasState(model, backend=keras.backend)
    messages = _messages(fresh_warnings)
    assert len(messages) == 1 and "TensorFlowKerasState(backend=...)" in messages[0], messages


def test_keras_state_warns_when_it_holds_another_optimizer_than_the_compiled_one(fresh_warnings):
    import keras
    import tf_mpi.keras as hvd
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    inner = keras.optimizers.Adam(0.1)
    model.compile(optimizer=hvd.DistributedOptimizer(inner), loss="mse", jit_compile=False)
    hvd.elastic.KerasState(model, epoch=0)                   # takes model.optimizer
    hvd.elastic.KerasState(model, model.optimizer, epoch=0)
    assert _messages(fresh_warnings) == []
    state = hvd.elastic.KerasState(model, inner, epoch=0)    # DistributedOptimizer(inner) is another optimizer
    messages = _messages(fresh_warnings)
    assert len(messages) == 1 and "different optimizer than the one the model is compiled with" in messages[0]
    assert state.optimizer is inner                         # as given (Horovod's semantics), with the warning


def test_timeline_mark_cycles_warns(fresh_warnings, tmp_path):
    import tf_mpi as hvd
    for _ in range(2):
        try:
            hvd.start_timeline(str(tmp_path / "trace.json"), mark_cycles=True)
        except Exception:  # no init() in this process: the warning comes first
            pass
    messages = _messages(fresh_warnings)
    assert len(messages) == 1 and "start_timeline(mark_cycles=...)" in messages[0], messages
    assert "no fixed cycle" in messages[0]
