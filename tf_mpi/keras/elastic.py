"""Elastic state and callbacks for Keras (Horovod's ``horovod.tensorflow.keras.elastic``),
on a fixed set of ranks: see ``tf_mpi.elastic`` for what is and is not supported.

The callbacks keep ``state.epoch`` and ``state.batch`` as Horovod's do. Put
``CommitStateCallback`` last (as Horovod's TF2 elastic example does), so that
each commit saves the counters the other two just updated. Call
``fit`` with ``epochs=total - state.epoch`` and no ``initial_epoch``:
``UpdateEpochStateCallback`` adds the ``state.epoch`` that ``fit`` started
from to Keras's epoch index, which then counts from 0 (Horovod's examples
call ``fit`` this way too).

Example::

    import tf_mpi.keras as hvd

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10)])

    train(state)
"""
import keras

from tf_mpi.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                            TensorFlowKerasState, run)

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """Elastic state of a Keras model and its optimizer (and extra attributes as keyword arguments).

    ``epoch`` and ``batch`` are plain attributes like any other keyword
    argument: ``commit()`` saves them, ``restore()`` goes back to the saved
    values and ``sync()`` gives every rank rank 0's saved values.

    Example::

        state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    """

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class _StateCallback(keras.callbacks.Callback):
    """A callback that works on an elastic ``state``."""

    def __init__(self, state):
        super().__init__()
        self.state = state


class CommitStateCallback(_StateCallback):
    """Commits the state every ``batches_per_commit`` batches and at the end of every epoch.

    The batch count runs across epochs and starts again with each ``fit``
    (each try of an elastic ``run``), so every rank commits at the same batches.

    Example::

        callbacks=[hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__(state)
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        # A retry after a reset must count from the same point on every rank.
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self):
        """Commits ``state`` (override to commit something else, or more)."""
        self.state.commit()


class UpdateBatchStateCallback(_StateCallback):
    """Keeps ``state.batch`` at the index of the last finished batch, and 0 at each epoch's end.

    At the start of each epoch it sets ``params['steps']`` (the epoch length
    the callbacks of this ``fit`` read) to the epoch length minus
    ``state.batch``, as Horovod does, so that after a restart in the middle of
    an epoch the callbacks see the batches left. Keras 3 takes the number of
    batches it runs from ``fit``'s data and ``steps_per_epoch`` instead, so
    that epoch still runs all of its batches.

    Example::

        callbacks=[hvd.elastic.UpdateBatchStateCallback(state)]
    """

    def __init__(self, state):
        super().__init__(state)
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        # The full epoch length is read again from each fit's first epoch.
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        params = self.params or {}
        if params.get("steps"):  # unknown (None) for data of unknown length: nothing to shorten
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_StateCallback):
    """Sets ``state.epoch`` to the number of finished epochs at each epoch's end.

    That is ``state.epoch`` when ``fit`` began, plus Keras's epoch index, plus
    one: a restart after this epoch's end starts with the next epoch. Call
    ``fit`` without ``initial_epoch`` (Keras then counts from 0) and with
    ``epochs=total - state.epoch``.

    Example::

        callbacks=[hvd.elastic.UpdateEpochStateCallback(state)]
    """

    def __init__(self, state):
        super().__init__(state)
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        # After a reset the state may hold a different (restored or synced) epoch.
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
