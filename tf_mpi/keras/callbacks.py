"""Keras callbacks for data-parallel training (Horovod's ``hvd.callbacks``).

Example::

    import tf_mpi.keras as hvd

    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback(),
                               hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(),
                                                                        warmup_epochs=3, steps_per_epoch=100)])
"""
import keras
import numpy as np

from tf_mpi import basics
from tf_mpi._compat import warn_unused_argument
from tf_mpi.functions import broadcast_variables

# What tf_mpi does instead of Horovod's momentum correction (Goyal et al.: scale the momentum by
# new_lr / old_lr for the batch after a rate change).
_NO_MOMENTUM_CORRECTION = ("the momentum is not rescaled when the rate changes (a Keras 3 optimizer's "
                           "momentum is a constant of its compiled update step); keep rate changes small or "
                           "per batch (steps_per_epoch, staircase=False) where that matters")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from root_rank's model weights and optimizer state.

    Runs at the start of training, before the first update is applied. If the
    optimizer has not created its slots yet, it is built first, so that its
    state (e.g. restored from a checkpoint on the root only) is broadcast too.
    ``device`` (Horovod's device for the broadcast) is accepted and warns once:
    the variables are broadcast from where they live.

    Example::

        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank=0, device=""):
        super().__init__()
        if device:
            warn_unused_argument("BroadcastGlobalVariablesCallback", "device",
                                 "the variables are broadcast from the device they live on")
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        if getattr(model, "jit_compile", False):
            raise ValueError("tf_mpi: this model is compiled with jit_compile=True, but tf_mpi's collectives "
                             "cannot run under XLA. Pass jit_compile=False to model.compile().")
        variables = list(model.variables)
        opt = model.optimizer
        if opt is not None:
            if not opt.built:
                opt.build(model.trainable_variables)
            # Error-feedback residuals of top-k compression are each rank's own: not broadcast.
            own = {id(v) for v in getattr(opt, "residual_variables", [])}
            variables += [v for v in opt.variables if id(v) not in own]
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's metrics over ranks before later callbacks see them.

    Put it before callbacks that read metrics (checkpointing, early stopping,
    learning-rate schedules on plateau). Every rank must log the same metric
    names (a mismatch is reported as an error by the engine). ``device``
    (Horovod's device for the allreduce) is accepted and warns once: the
    metrics are Python floats, averaged in host memory.

    Example::

        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                     keras.callbacks.ReduceLROnPlateau()]
    """

    def __init__(self, device=""):
        super().__init__()
        if device:
            warn_unused_argument("MetricAverageCallback", "device",
                                 "the metrics are Python floats, averaged in host memory")

    def on_epoch_end(self, epoch, logs=None):
        if not logs or basics.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        values = np.array([float(logs[k]) for k in keys], np.float64)
        averaged = basics._core.allreduce(values, basics.Average, f"tfmpi.metric_average.{epoch}")
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


def _set_lr(model, lr):
    model.optimizer.learning_rate = lr


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets lr = initial_lr * multiplier(epoch) between start_epoch and end_epoch.

    ``multiplier`` is a number or a function of the (fractional, when not
    ``staircase``) epoch. With ``steps_per_epoch`` the rate is updated every
    batch. Horovod's ``momentum_correction`` (on by default there) is not
    done: the momentum is not rescaled when the rate changes, because a Keras 3
    optimizer's momentum is a constant of its compiled step.
    ``momentum_correction=True`` warns once; False or leaving it out does not.

    Example::

        LearningRateScheduleCallback(initial_lr=0.1 * hvd.size(), multiplier=lambda e: 0.1 ** (e // 30),
                                     start_epoch=5)
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=None, steps_per_epoch=None, verbose=0):
        super().__init__()
        if momentum_correction:
            warn_unused_argument("LearningRateScheduleCallback", "momentum_correction", _NO_MOMENTUM_CORRECTION)
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _active(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _update(self, epoch):
        if self._active(epoch):
            _set_lr(self.model, self.initial_lr * self.multiplier(epoch))

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        self._update(epoch)
        if self.verbose and basics.rank() == 0 and self._active(epoch):
            print(f"\nEpoch {epoch + 1}: learning rate {float(self.model.optimizer.learning_rate):.6g}")

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self.steps_per_epoch:
            return
        self._update(self.current_epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from initial_lr / size to initial_lr over warmup_epochs (Goyal et al.).

    Per batch: lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1),
    with e the fractional epoch (batch + 1) / steps_per_epoch + epoch, so the
    last warm-up batch runs at initial_lr. ``momentum_correction`` as in
    ``LearningRateScheduleCallback`` (not done; True warns once).

    Example::

        LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=3, steps_per_epoch=100)
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=None, steps_per_epoch=None, verbose=0):
        self.warmup_epochs = warmup_epochs
        if momentum_correction:
            warn_unused_argument("LearningRateWarmupCallback", "momentum_correction", _NO_MOMENTUM_CORRECTION)

        def multiplier(epoch):
            size = basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         steps_per_epoch=steps_per_epoch,
                         verbose=verbose)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.steps_per_epoch:
            raise ValueError("tf_mpi: LearningRateWarmupCallback needs steps_per_epoch")
        if self.current_epoch < self.warmup_epochs:
            _set_lr(self.model, self.initial_lr * self.multiplier(self.current_epoch + (batch + 1) / self.steps_per_epoch))

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose and basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(self.model.optimizer.learning_rate):.6g}")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the best model so far (by ``monitor``), on rank 0 only.

    Example::

        BestModelCheckpoint(filepath="best.keras", monitor="val_loss", mode="min")
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch"):
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def _save_model(self, *args, **kwargs):
        if basics.rank() == 0:
            return super()._save_model(*args, **kwargs)
