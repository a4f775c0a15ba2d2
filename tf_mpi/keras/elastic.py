"""Elastic state and callbacks for Keras (Horovod's ``horovod.tensorflow.keras.elastic``),
on a fixed set of ranks: see ``tf_mpi.elastic`` for what is and is not supported.

Example::

    import tf_mpi.keras as hvd

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, initial_epoch=state.epoch, epochs=epochs, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10)])

    train(state)
"""
import keras

from tf_mpi.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                            TensorFlowKerasState, run)


class KerasState(TensorFlowKerasState):
    """Elastic state of a Keras model and its optimizer (and extra attributes as keyword arguments).

    Example::

        state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    """

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits the state every ``batches_per_commit`` batches.

    Example::

        callbacks=[hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class _StateCallback(keras.callbacks.Callback):
    """A callback that keeps a field of an elastic ``state`` up to date."""

    def __init__(self, state):
        super().__init__()
        self.state = state


class UpdateBatchStateCallback(_StateCallback):
    """Keeps ``state.batch`` at the last finished batch (0 at each epoch's end).

    Example::

        callbacks=[hvd.elastic.UpdateBatchStateCallback(state)]
    """

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_StateCallback):
    """Keeps ``state.epoch`` at the last finished epoch.

    Example::

        callbacks=[hvd.elastic.UpdateEpochStateCallback(state)]
    """

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch
