"""Learning-rate scaling with the number of workers, after Svyatkovskiy, Kates-Harbeck and Tang (2019).

"Training Distributed Deep Recurrent Neural Networks with Mixed Precision on
GPU Clusters" scales the single-worker learning rate ``lr0`` to N synchronous
workers (global batch N times larger) as::

    lr_N = lr0 * N / (1 + N / 100)

linear for small N (``lr_N ~= lr0 * N``), saturating near ``100 * lr0`` for
large N, where linear scaling would diverge. On top of it:

- an optional cap: ``lr_N = min(lr_N, max_lr)``;
- exponential decay per epoch: ``lr(e) = lr_N * decay ** e`` (``e`` the
  epoch index with ``staircase=True``, the fractional epoch otherwise);
- a linear warm-up over the first ``warmup_epochs`` (may be fractional),
  updated per batch: a ramp from ``warmup_start_lr`` (default ``lr0``, the
  single-worker rate) up to ``lr_N``, which caps the decayed rate, so the
  rate rises until it meets the decay curve and follows it from there. The
  last warm-up batch reaches the ramp's top.

So, with ``s = step / steps_per_epoch`` (fractional epoch) and
``p = min(1, (step + 1) / (warmup_epochs * steps_per_epoch))``::

    target = lr_N * decay ** (floor(s) if staircase else s)
    ramp   = start + (lr_N - start) * p
    lr     = min(ramp, target)                     (lr = target without warm-up)

Three ways to use it:

- :func:`worker_scaled_lr`: the pure formula (no TensorFlow op, no MPI needed).
- :class:`WorkerScaledSchedule`: a Keras ``LearningRateSchedule`` to pass as
  the optimizer's ``learning_rate``. It is driven by the optimizer's step
  counter, so it resumes exactly from a checkpoint, and it is serializable
  (registered as ``tf_mpi>WorkerScaledSchedule``; import this module before
  ``load_model``).
- :class:`WorkerScaledLearningRateCallback`: the same rates set by a callback
  on an optimizer with a float learning rate (Horovod-callback style).

Example::

    import keras
    import tf_mpi.keras as hvd
    from tf_mpi.keras.schedules import WorkerScaledSchedule

    hvd.init()
    schedule = WorkerScaledSchedule(lr0=1e-3, num_workers=hvd.size(), steps_per_epoch=len(x) // 32,
                                    decay=0.95, warmup_epochs=1)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(schedule))
"""
import math

import keras

__all__ = ["worker_scaled_lr", "WorkerScaledSchedule", "WorkerScaledLearningRateCallback"]

#: The N at which lr_N is half the linear rate lr0 * N (the paper's 100).
SATURATION_WORKERS = 100.0


def worker_scaled_lr(lr0, num_workers, max_lr=None):
    """The base learning rate for ``num_workers`` synchronous workers.

    ``lr0 * N / (1 + N / 100)``, then capped at ``max_lr`` if given. Pure
    Python: needs neither TensorFlow ops nor ``hvd.init()``.

    Example::

        worker_scaled_lr(1e-3, 1)                # 0.00099 (N=1 is not exactly lr0)
        worker_scaled_lr(1e-3, 8)                # 0.0074
        worker_scaled_lr(1e-3, 1000)             # 0.0909 (-> 0.1 as N grows)
        worker_scaled_lr(1e-3, 64, max_lr=0.02)  # 0.02
    """
    n = float(num_workers)
    if n < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if lr0 <= 0:
        raise ValueError(f"lr0 must be > 0, got {lr0}")
    lr = float(lr0) * n / (1.0 + n / SATURATION_WORKERS)
    if max_lr is not None:
        lr = min(lr, float(max_lr))
    return lr


def _validate(steps_per_epoch, decay, warmup_epochs):
    if steps_per_epoch is not None and steps_per_epoch <= 0:
        raise ValueError(f"steps_per_epoch must be > 0, got {steps_per_epoch}")
    if not 0 < decay <= 1:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    if warmup_epochs < 0:
        raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")


@keras.saving.register_keras_serializable(package="tf_mpi")
class WorkerScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Worker-scaled rate with per-epoch exponential decay and linear warm-up, per optimizer step.

    ``lr(step)``, with ``s = step / steps_per_epoch``::

        lr_N   = min(lr0 * N / (1 + N / 100), max_lr)
        target = lr_N * decay ** (floor(s) if staircase else s)
        p      = min(1, (step + 1) / (warmup_epochs * steps_per_epoch))
        start  = min(warmup_start_lr or lr0, lr_N)
        lr     = min(start + (lr_N - start) * p, target)       # lr = target without warm-up

    Args:
      lr0: the learning rate tuned for one worker.
      num_workers: N, usually ``hvd.size()``. Stored in the config: a model
        resumed on a different number of workers keeps the old N unless you
        set a new schedule.
      steps_per_epoch: optimizer steps per epoch (per-rank batches per epoch).
      decay: per-epoch decay factor in (0, 1]; 1 disables decay.
      warmup_epochs: length of the linear warm-up in epochs (fractional ok); 0 disables it.
      max_lr: optional cap on ``lr_N``.
      staircase: decay once per epoch (True) or continuously (False).
      warmup_start_lr: where the warm-up ramp starts; default ``lr0`` (capped at ``lr_N``).
      name: name of the schedule.

    Example::

        schedule = WorkerScaledSchedule(1e-3, hvd.size(), steps_per_epoch=390, decay=0.9, warmup_epochs=0.5)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(schedule)), ...,
                      jit_compile=False)
        float(schedule(0)), float(schedule(10 * 390))   # first warm-up step, epoch 10
    """

    def __init__(self, lr0, num_workers, steps_per_epoch, decay=1.0, warmup_epochs=0.0, max_lr=None,
                 staircase=True, warmup_start_lr=None, name="WorkerScaledSchedule"):
        super().__init__()
        _validate(steps_per_epoch, decay, warmup_epochs)
        if steps_per_epoch is None:
            raise ValueError("WorkerScaledSchedule needs steps_per_epoch")
        self.lr0 = float(lr0)
        self.num_workers = int(num_workers)
        self.steps_per_epoch = int(steps_per_epoch)
        self.decay = float(decay)
        self.warmup_epochs = float(warmup_epochs)
        self.max_lr = None if max_lr is None else float(max_lr)
        self.staircase = bool(staircase)
        self.warmup_start_lr = None if warmup_start_lr is None else float(warmup_start_lr)
        self.name = name
        self.base_lr = worker_scaled_lr(self.lr0, self.num_workers, self.max_lr)

    @property
    def start_lr(self):
        """Where the warm-up ramp starts (never above the base rate)."""
        start = self.lr0 if self.warmup_start_lr is None else self.warmup_start_lr
        return min(start, self.base_lr)

    def __call__(self, step):
        ops = keras.ops
        step = ops.cast(step, "float32")
        epoch = step / float(self.steps_per_epoch)
        if self.staircase:
            epoch = ops.floor(epoch)
        lr = self.base_lr * ops.power(ops.convert_to_tensor(self.decay, "float32"), epoch)
        if self.warmup_epochs > 0:
            progress = ops.minimum((step + 1.0) / (self.warmup_epochs * self.steps_per_epoch), 1.0)
            lr = ops.minimum(self.start_lr + (self.base_lr - self.start_lr) * progress, lr)
        return lr

    def value(self, epoch, batch=0):
        """The rate (a Python float) at ``batch`` of ``epoch`` (0-based), computed without TensorFlow."""
        step = epoch * self.steps_per_epoch + batch
        s = step / self.steps_per_epoch
        lr = self.base_lr * self.decay ** (math.floor(s) if self.staircase else s)
        if self.warmup_epochs > 0:
            p = min((step + 1.0) / (self.warmup_epochs * self.steps_per_epoch), 1.0)
            lr = min(self.start_lr + (self.base_lr - self.start_lr) * p, lr)
        return lr

    def get_config(self):
        return {"lr0": self.lr0, "num_workers": self.num_workers, "steps_per_epoch": self.steps_per_epoch,
                "decay": self.decay, "warmup_epochs": self.warmup_epochs, "max_lr": self.max_lr,
                "staircase": self.staircase, "warmup_start_lr": self.warmup_start_lr, "name": self.name}


class WorkerScaledLearningRateCallback(keras.callbacks.Callback):
    """Sets the optimizer's (float) learning rate to the WorkerScaledSchedule's value.

    Updates every batch when ``steps_per_epoch`` is given (so a fractional
    warm-up ramps smoothly), otherwise once per epoch (the warm-up then moves
    in whole epochs: ``p = min(1, (epoch + 1) / warmup_epochs)``). Uses the
    epoch index Keras passes, so ``fit(initial_epoch=...)`` resumes the
    schedule where it left off. Prefer :class:`WorkerScaledSchedule` when the
    optimizer state is checkpointed: it needs no callback to resume.

    Args: as :class:`WorkerScaledSchedule`; ``num_workers`` defaults to
    ``hvd.size()`` (read when training starts). ``verbose``: rank 0 prints the
    rate at each epoch start.

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3))
        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   WorkerScaledLearningRateCallback(1e-3, steps_per_epoch=len(x) // 32,
                                                                    decay=0.95, warmup_epochs=1)])
    """

    def __init__(self, lr0, num_workers=None, steps_per_epoch=None, decay=1.0, warmup_epochs=0.0, max_lr=None,
                 staircase=True, warmup_start_lr=None, verbose=0):
        super().__init__()
        _validate(steps_per_epoch, decay, warmup_epochs)
        self.lr0, self.num_workers, self.steps_per_epoch = lr0, num_workers, steps_per_epoch
        self.decay, self.warmup_epochs, self.max_lr = decay, warmup_epochs, max_lr
        self.staircase, self.warmup_start_lr, self.verbose = staircase, warmup_start_lr, verbose
        self.schedule = None
        self.current_epoch = 0

    def _rank(self):
        from tf_mpi import basics
        return basics.rank() if basics.is_initialized() else 0

    def on_train_begin(self, logs=None):
        n = self.num_workers
        if n is None:
            from tf_mpi import basics
            n = basics.size() if basics.is_initialized() else 1
        # Without steps_per_epoch, one "step" of the schedule is one epoch.
        self.schedule = WorkerScaledSchedule(self.lr0, n, self.steps_per_epoch or 1, decay=self.decay,
                                             warmup_epochs=self.warmup_epochs, max_lr=self.max_lr,
                                             staircase=self.staircase, warmup_start_lr=self.warmup_start_lr)

    def _set(self, lr):
        self.model.optimizer.learning_rate = lr

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.steps_per_epoch:
            lr = self.schedule.value(epoch, 0)
        else:
            lr = self.schedule.value(0, epoch)  # steps_per_epoch=1: step == epoch
        self._set(lr)
        if self.verbose and self._rank() == 0:
            print(f"\nEpoch {epoch + 1}: learning rate {lr:.6g}")

    def on_train_batch_begin(self, batch, logs=None):
        if self.steps_per_epoch:
            self._set(self.schedule.value(self.current_epoch, batch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
