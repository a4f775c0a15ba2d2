"""Keras callbacks for data-parallel training (Horovod's ``hvd.callbacks``).

Example::

    import tf_mpi.keras as hvd

    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback(),
                               hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(),
                                                                        warmup_epochs=3)])
"""
import os

import keras
import numpy as np
import tensorflow as tf

from tf_mpi import basics
from tf_mpi._unused_arguments import warn_unused_argument
from tf_mpi.functions import broadcast_variables
from tf_mpi.ops import _on_device
from tf_mpi.policy.variable_identity import variable_key

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]

# What tf_mpi does instead of Horovod's momentum correction (Goyal et al.: scale the momentum by
# new_lr / old_lr for the batch after a rate change).
_NO_MOMENTUM_CORRECTION = ("the momentum is not rescaled when the rate changes (a Keras 3 optimizer's "
                           "momentum is a constant of its compiled update step); keep rate changes small or "
                           "per batch (staircase=False) where that matters")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from root_rank's model weights and optimizer state.

    The broadcast runs at the start of training, before the first update, so
    every rank computes its first gradients at the same weights. If the
    optimizer has not created its slots yet, it is built first, so that its
    state (e.g. restored from a checkpoint on the root only) is broadcast too.
    Variables created by the first step (Horovod's reason to broadcast after
    the first batch) are broadcast from root_rank at the end of that batch.

    ``local_variables`` (a variable or a list; Keras weights or tf.Variables)
    and ``register_local_var(var)`` name each rank's own variables: they are
    not broadcast. ``device`` places the broadcast (``tf.device``; '' leaves it
    where TensorFlow puts it). The error-feedback residuals of top-k
    compression are never broadcast (each rank's own).

    Example::

        cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[model.get_layer("expert").kernel])
        model.fit(x, y, callbacks=[cb])
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars = []  # held, so that the ids compared against stay theirs
        self._broadcast = []   # what on_train_begin broadcast (held for the same reason)
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, (tf.Variable, keras.Variable)):
            local_variables = [local_variables]
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var):
        """Marks `var` as this rank's own: the callback does not broadcast it.

        Example::

            cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
            cb.register_local_var(model.get_layer("embedding").embeddings)
        """
        if not isinstance(var, (tf.Variable, keras.Variable)):
            raise ValueError(f"tf_mpi: local variables must be variables (keras.Variable or tf.Variable), "
                             f"got {type(var).__name__}")
        self._local_vars.append(var)

    def _variables(self):
        """Model and optimizer variables to broadcast, in a rank-independent order."""
        model = self.model
        variables = list(model.variables)
        opt = model.optimizer
        if opt is not None:
            # Error-feedback residuals of top-k compression are each rank's own: not broadcast.
            own = {id(v) for v in getattr(opt, "residual_variables", [])}
            variables += [v for v in opt.variables if id(v) not in own]
        local = {variable_key(v) for v in self._local_vars}
        return [v for v in variables if variable_key(v) not in local]

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        if getattr(model, "jit_compile", False):
            raise ValueError("tf_mpi: this model is compiled with jit_compile=True, but tf_mpi's collectives "
                             "cannot run under XLA. Pass jit_compile=False to model.compile().")
        opt = model.optimizer
        if opt is not None and not opt.built and model.trainable_variables:
            opt.build(model.trainable_variables)
        self._broadcast = self._variables()
        with _on_device(self.device):
            broadcast_variables(self._broadcast, self.root_rank)
        self.broadcast_done = True

    def on_train_batch_end(self, batch, logs=None):
        if self._broadcast is None:
            return
        # Whatever the first step created (model or optimizer state) is broadcast once it exists;
        # the same model code on every rank creates the same variables, so all ranks take part.
        done = {id(v) for v in self._broadcast}
        late = [v for v in self._variables() if id(v) not in done]
        self._broadcast = None
        if late:
            with _on_device(self.device):
                broadcast_variables(late, self.root_rank)


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


def _get_lr(model):
    return float(model.optimizer.learning_rate)


def _set_lr(model, lr):
    model.optimizer.learning_rate = lr


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets lr = initial_lr * multiplier(epoch) for the epochs start_epoch <= epoch < end_epoch.

    ``multiplier`` is a function of the epoch, or a number m meaning
    exponential decay, m ** (epoch - start_epoch), as in Horovod. With
    ``staircase`` the rate is set once per epoch (integer epoch); without, every
    batch, at the fractional epoch epoch + batch / steps_per_epoch, where
    ``steps_per_epoch`` defaults to the steps model.fit runs per epoch. Outside
    the epoch range the optimizer's rate is left alone. At each epoch's end the
    rate is logged as ``lr`` (Horovod's name) and ``learning_rate`` (Keras 3's).
    Horovod's ``momentum_correction`` (on by default there) is not done: the
    momentum is not rescaled when the rate changes, because a Keras 3
    optimizer's momentum is a constant of its compiled step.
    ``momentum_correction=True`` warns once; False or leaving it out does not.
    ``verbose`` (tf_mpi's) prints the rate at each scheduled epoch on rank 0.

    Example::

        LearningRateScheduleCallback(initial_lr=0.1 * hvd.size(), multiplier=lambda e: 0.1 ** (e // 30),
                                     start_epoch=5)
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=None, steps_per_epoch=None, verbose=0):
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"tf_mpi: {type(self).__name__} needs initial_lr")
        if momentum_correction:
            warn_unused_argument("LearningRateScheduleCallback", "momentum_correction", _NO_MOMENTUM_CORRECTION)
        self.momentum_correction = momentum_correction
        self.initial_lr = initial_lr
        if callable(multiplier):
            self.multiplier = multiplier
        else:  # a number: exponential decay from start_epoch on
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _steps_from_fit(self):
        """Steps per epoch as model.fit announced them (params['steps'], or samples // batch_size)."""
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"tf_mpi: {type(self).__name__} could not tell the number of steps per epoch "
                         f"(model.fit did not know it, e.g. for a dataset of unknown length): "
                         f"pass steps_per_epoch=...")

    def on_train_begin(self, logs=None):
        # Only a per-batch schedule needs the epoch's length; every rank checks it before training.
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._steps_from_fit()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self._in_range(epoch):
            # Set here (Horovod sets it at the epoch's first batch: the same rate for training) so that
            # later callbacks' on_epoch_begin see this epoch's rate.
            _set_lr(self.model, self.initial_lr * self.multiplier(epoch))
            if self.verbose and basics.rank() == 0:
                print(f"\nEpoch {epoch + 1}: learning rate {_get_lr(self.model):.6g}")

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._in_range(self.current_epoch):
            return
        _set_lr(self.model, self.initial_lr * self.multiplier(self.current_epoch + batch / self.steps_per_epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = logs["learning_rate"] = _get_lr(self.model)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from initial_lr / size to initial_lr over warmup_epochs (Goyal et al.).

    Per batch: lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1),
    with e the fractional epoch epoch + (batch + 1) / steps_per_epoch, so the
    last warm-up batch runs at initial_lr. ``steps_per_epoch`` defaults to the
    steps model.fit runs per epoch. The rate is logged as in
    ``LearningRateScheduleCallback``; ``verbose`` prints on rank 0 when the
    warm-up ends. ``momentum_correction`` as there (not done; True warns once).

    Example::

        LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=3, verbose=1)
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=None, steps_per_epoch=None, verbose=0):
        self.warmup_epochs = warmup_epochs
        if momentum_correction:
            warn_unused_argument("LearningRateWarmupCallback", "momentum_correction", _NO_MOMENTUM_CORRECTION)

        def multiplier(epoch):
            # Shifted by one batch, so that the rate reaches initial_lr at the last warm-up batch.
            epoch += 1.0 / self.steps_per_epoch
            size = basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)  # warned above, under its own name
        self.momentum_correction = momentum_correction

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch  # the rate is set per batch only

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_get_lr(self.model):g}.")


# What Keras 3's ModelCheckpoint accepts as a file name (it checks when given a path).
_MODEL_SUFFIXES, _WEIGHTS_SUFFIX = (".keras", ".h5"), ".weights.h5"


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the best model so far (by ``monitor``), on rank 0 only.

    Horovod's arguments (``monitor`` first); the path is the keyword
    ``filepath``, optional at construction as in Horovod, where the Spark
    estimator sets ``.filepath`` later. It must be set (ending in ``.keras``,
    or ``.weights.h5`` with ``save_weights_only``) when training starts:
    every rank checks it then and raises ValueError otherwise.

    Example::

        BestModelCheckpoint(monitor="val_loss", mode="min", filepath="best.keras")
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 *, filepath=None):
        if isinstance(monitor, os.PathLike) or (isinstance(monitor, str) and monitor.endswith(_MODEL_SUFFIXES)):
            raise TypeError(f"tf_mpi: BestModelCheckpoint takes Horovod's arguments (monitor first); "
                            f"pass the path as filepath={os.fspath(monitor)!r}")
        # Keras checks a given path's suffix now; a missing one is checked when training starts.
        placeholder = "unset" + (_WEIGHTS_SUFFIX if save_weights_only else _MODEL_SUFFIXES[0])
        super().__init__(placeholder if filepath is None else filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def _check_filepath(self):
        if self.filepath is None:
            raise ValueError("tf_mpi: BestModelCheckpoint has no filepath: pass filepath=... or set its "
                             ".filepath before model.fit")
        self.filepath = os.fspath(self.filepath)
        suffixes = (_WEIGHTS_SUFFIX,) if self.save_weights_only else _MODEL_SUFFIXES
        if not self.filepath.endswith(suffixes):
            raise ValueError(f"tf_mpi: BestModelCheckpoint's filepath must end in {' or '.join(suffixes)} "
                             f"(Keras 3), got {self.filepath!r}")

    def on_train_begin(self, logs=None):
        self._check_filepath()  # on every rank, before any training, rather than on rank 0 at the first save
        super().on_train_begin(logs)

    def _save_model(self, *args, **kwargs):
        if basics.rank() == 0:
            self._check_filepath()
            return super()._save_model(*args, **kwargs)
