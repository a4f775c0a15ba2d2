"""DistributedOptimizer for Keras 3: reduces gradients across ranks inside apply().

Where the reduction sits in Keras 3's ``apply()`` matters (each point below
has a test in tests/workers/keras_worker.py):

- Plain optimizers: gradients are reduced in ``_clip_gradients``, the first
  thing Keras does with them after filtering empty gradients and unscaling:
  so before clipping (``clipnorm``, ``global_clipnorm``), and, with Keras'
  own ``gradient_accumulation_steps``, inside the update branch, i.e. once
  per accumulation cycle on the accumulated gradients.
- ``LossScaleOptimizer`` (``mixed_float16``): gradients are reduced at the
  start of its ``apply()``, before the finiteness check, so every rank takes
  the same skip/apply branch and loss-scale update. ``DistributedOptimizer``
  returns such an optimizer when given one, or when the global policy is
  ``mixed_float16`` (what ``model.compile`` would wrap it in anyway).
- ``backward_passes_per_step=k``: gradients are accumulated locally and
  reduced and applied every k-th step (communication once per k steps).
- ``Compression.topk`` / ``gtopk``: the error-feedback residuals are optimizer
  variables ("tfmpi_residual", created in ``build``), so ``model.save`` and
  ``tf.train.Checkpoint`` keep them (with a LossScaleOptimizer the compressor
  keeps them instead, in unscaled units: the gradients are unscaled before
  the sparsified reduction and scaled back after it, and a step that
  overflows leaves them unchanged).
"""
import keras
import tensorflow as tf

from tf_mpi.basics import Average
from tf_mpi.compression import Compression
from tf_mpi.reducer import GradientReducer, map_gradient

LossScaleOptimizer = keras.optimizers.LossScaleOptimizer

# GradientReducer options for optimizers Keras rebuilds inside load_model(),
# which builds them (and so creates any residual variables) before returning.
_options_while_loading = {}


class _DistributedMixin:
    """Mixed into a copy of the wrapped optimizer's class (so isinstance and
    serialization keep working)."""

    _tfmpi_reducer = None
    _tfmpi_passes = 1
    _tfmpi_average_aggregated = False

    def _tfmpi_configure(self, reducer, backward_passes_per_step, average_aggregated_gradients):
        self._tfmpi_reducer = reducer
        self._tfmpi_passes = int(backward_passes_per_step)
        self._tfmpi_average_aggregated = average_aggregated_gradients
        if self._tfmpi_passes < 1:
            raise ValueError("tf_mpi: backward_passes_per_step must be >= 1")

    def _tfmpi_get_reducer(self):
        if self._tfmpi_reducer is None:  # e.g. created by from_config / load_model
            self._tfmpi_reducer = GradientReducer(f"Distributed{type(self).__name__}", **_options_while_loading)
        return self._tfmpi_reducer

    @property
    def grouping_plan(self):
        """The grouping plan of the last traced step (tf_mpi.grouping.Plan), or None."""
        return self._tfmpi_get_reducer().plan

    @property
    def residual_variables(self):
        """The error-feedback residuals of Compression.topk / gtopk (optimizer variables; [] otherwise).

        They are each rank's own state: they differ between ranks, are not
        broadcast by BroadcastGlobalVariablesCallback, and an exact resume
        needs each rank's own checkpoint.

        Example::

            synced = [v for v in opt.variables if all(v is not r for r in opt.residual_variables)]
        """
        return list(getattr(self, "_tfmpi_residuals", None) or [])

    def _tfmpi_reduce(self, grads, variables, residuals=None):
        return self._tfmpi_get_reducer().reduce(grads, variables, residuals)

    def register_local_var(self, var):
        """Keeps `var`'s gradient local: it is not reduced across ranks (Horovod's model-parallel hook).

        The local gradient is divided by size() unless the optimizer was made
        with ``scale_local_gradients=False``.

        Example::

            opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3))
            opt.register_local_var(model.get_layer("expert").kernel)
        """
        self._tfmpi_get_reducer().register_local(var)


class _DistributedPlain(_DistributedMixin):
    def _clip_gradients(self, grads):
        # Called by Keras with the filtered gradients of self._tfmpi_vars.
        residuals = None
        if getattr(self, "_tfmpi_residuals", None):
            residuals = [self._tfmpi_residuals[self._get_variable_index(v)] for v in self._tfmpi_vars]
        grads = self._tfmpi_reduce(grads, self._tfmpi_vars, residuals)
        return super()._clip_gradients(grads)

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Bypass Keras' attribute tracking: a tracked list of variables would
        # become part of the optimizer's state (and break saving).
        object.__setattr__(self, "_tfmpi_vars", tuple(trainable_variables))
        return super()._backend_apply_gradients(grads, trainable_variables)

    def apply(self, grads, trainable_variables=None):
        if self._tfmpi_passes == 1:
            return super().apply(grads, trainable_variables)
        return self._tfmpi_apply_every_k(list(grads), trainable_variables)

    def build(self, variables):
        if not self.built and self._tfmpi_passes > 1:
            # Local gradient sums between reductions (backward_passes_per_step).
            self._tfmpi_accumulators = [
                self.add_variable_from_reference(v, name="tfmpi_accumulator") for v in variables]
            self._tfmpi_counter = self.add_variable((), name="tfmpi_passes", dtype="int64")
        if not self.built and getattr(self._tfmpi_get_reducer().compression, "sparsifies", False):
            # Error feedback of top-k compression: what this rank has not yet had reduced.
            self._tfmpi_residuals = [self.add_variable_from_reference(v, name="tfmpi_residual") for v in variables]
        super().build(variables)

    def _tfmpi_apply_every_k(self, grads, trainable_variables):
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if not self.built:
            self.build(variables)
        position = {id(v): i for i, v in enumerate(self._trainable_variables)}
        acc = [self._tfmpi_accumulators[position[id(v)]] for v in variables]
        for a, g in zip(acc, grads):
            if g is not None:
                a.assign_add(tf.convert_to_tensor(g))
        self._tfmpi_counter.assign_add(1)
        k = self._tfmpi_passes

        def apply_accumulated():
            scale = 1.0 / k if self._tfmpi_average_aggregated else 1.0
            summed = [None if g is None else a.value * scale for a, g in zip(acc, grads)]
            super(_DistributedPlain, self).apply(summed, variables)
            for a in acc:
                a.assign(tf.zeros_like(a))
            return tf.constant(True)

        return tf.cond(self._tfmpi_counter % k == 0, apply_accumulated, lambda: tf.constant(False))


def _times(grad, factor):
    return map_gradient(grad, lambda v: v * tf.cast(factor, v.dtype))


class _DistributedLossScale(_DistributedMixin):
    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        grads = list(grads)
        if getattr(self._tfmpi_get_reducer().compression, "sparsifies", False):
            # Top-k's error feedback carries what a rank did not send into later
            # steps, whose loss scale may differ: it works on unscaled gradients.
            # The scale is a power of two, so both multiplications are exact.
            if not self.built:
                self.build(variables)  # creates dynamic_scale
            scale = self.dynamic_scale
            grads = self._tfmpi_reduce([_times(g, 1.0 / scale) for g in grads], variables)
            grads = [_times(g, scale) for g in grads]
        else:
            grads = self._tfmpi_reduce(grads, variables)
        return super().apply(grads, trainable_variables)


_class_cache = {}


def _distributed_class(base):
    """A subclass of `base` with the reduction mixed in, cached per base."""
    if base not in _class_cache:
        mixin = _DistributedLossScale if issubclass(base, LossScaleOptimizer) else _DistributedPlain
        cls = type(base.__name__, (mixin, base), {"__module__": base.__module__, "__doc__": base.__doc__})
        _class_cache[base] = cls
    return _class_cache[base]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1, average_aggregated_gradients=False,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         order_backprop=None, scale_local_gradients=True, sparse=None):
    """Wraps a Keras 3 optimizer so that gradients are averaged across ranks before they are applied.

    Returns a new optimizer of a subclass of ``type(optimizer)`` with the same
    configuration: use it wherever the original was (``model.compile``,
    ``get_config``/``from_config``, ``optimizer.learning_rate``, saving).

    Args:
      optimizer: any Keras 3 optimizer (SGD, Adam, AdamW, RMSprop, ...) or a LossScaleOptimizer.
      name: prefix of the collectives' names; default "Distributed<Class>".
      device_dense / device_sparse: where the collectives of dense / IndexedSlices gradients run
        (``tf.device``, as in Horovod, e.g. "/cpu:0"); '' leaves them where TensorFlow puts them.
      compression: Compression.none, Compression.fp16, or Compression.topk(ratio) /
        Compression.gtopk(ratio) (sparsified with error feedback; docs/compression.md).
      sparse_as_dense: densify IndexedSlices gradients (e.g. of Embedding) and allreduce them, instead
        of allgathering their rows. Worth it when the optimizer densifies the gradient anyway (Keras 3's
        Adam, AdamW, RMSprop and SGD with momentum do) and the rows of all ranks together are a sizeable
        part of the table: each rank then densifies its own rows instead of everyone's. The LSTM
        benchmark (20000x128 table, 6400 rows per rank) trains 7-13 % faster with it on 2 ranks.
        The same as ``sparse="dense"``.
      backward_passes_per_step: reduce and apply once every this many steps, accumulating in between.
      average_aggregated_gradients: with backward_passes_per_step > 1, average instead of sum the passes.
      op: Average (default) or Sum.
      gradient_predivide_factor: split the averaging into a division before and after the sum.
      num_groups: if > 0, reduce gradients in this many groups of about equal bytes.
      groups: explicit list of lists of variables to reduce together.
      order_backprop: make backprop produce each group's gradients before it starts on the layers
        below, so that early groups reach the engine early even when TensorFlow has one inter-op
        thread (its queue would otherwise hold them back to the end of backprop). Default: the
        TF_MPI_ORDER_BACKPROP environment variable, off unless "1".
      scale_local_gradients: divide the gradients of variables registered with
        ``register_local_var`` by size() (Horovod's default), or leave them as they are.
      sparse: how IndexedSlices gradients travel: "allgather" (every rank's rows, Horovod's
        default), "dense" (= ``sparse_as_dense=True``), "dedup" (each rank sums its duplicate rows,
        the ranks exchange only the touched rows, the optimizer gets each touched row once as
        IndexedSlices) or "auto" (per tensor and step, dedup's exchange or a dense allreduce by
        measured cost; the optimizer gets a dense gradient). None: "dense" with
        ``sparse_as_dense=True``, else "allgather". See tf_mpi.sparse and docs/sparse-gradients.md.

    Example::

        import keras, tf_mpi.keras as hvd
        hvd.init()
        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("tf_mpi: this optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"tf_mpi: DistributedOptimizer needs a Keras 3 optimizer, got {type(optimizer)}")
    if (not isinstance(optimizer, LossScaleOptimizer)
            and keras.mixed_precision.dtype_policy().name == "mixed_float16"):
        # model.compile would wrap us in a LossScaleOptimizer, whose finiteness
        # check would then see unreduced gradients: wrap first, reduce first.
        optimizer = LossScaleOptimizer(optimizer)
    if isinstance(optimizer, LossScaleOptimizer) and backward_passes_per_step > 1:
        raise NotImplementedError("tf_mpi: backward_passes_per_step > 1 with a LossScaleOptimizer is not "
                                  "supported yet; use the optimizer's gradient_accumulation_steps instead")
    cls = _distributed_class(type(optimizer))
    wrapped = cls.from_config(optimizer.get_config())
    reducer = GradientReducer(name or f"Distributed{type(optimizer).__name__}", op=op, compression=compression,
                              sparse_as_dense=sparse_as_dense,
                              gradient_predivide_factor=gradient_predivide_factor,
                              num_groups=num_groups, groups=groups, order_backprop=order_backprop,
                              scale_local_gradients=scale_local_gradients, device_dense=device_dense,
                              device_sparse=device_sparse, sparse=sparse)
    wrapped._tfmpi_configure(reducer, backward_passes_per_step, average_aggregated_gradients)
    return wrapped


def distributed_custom_objects():
    """custom_objects that load every Keras optimizer class as its distributed version."""
    objects = {}
    for attr in dir(keras.optimizers):
        base = getattr(keras.optimizers, attr)
        if isinstance(base, type) and issubclass(base, keras.optimizers.Optimizer) \
                and base is not keras.optimizers.Optimizer:
            objects[base.__name__] = _distributed_class(base)
    return objects


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, sparse=None,
               **kwargs):
    """``keras.models.load_model`` whose optimizer comes back as a DistributedOptimizer.

    The DistributedOptimizer options are not stored in the file: pass them
    again (``backward_passes_per_step`` cannot be restored this way; wrap a
    fresh optimizer instead). Other keyword arguments go to keras.models.load_model.

    Example::

        model = hvd.load_model("checkpoint.keras", compression=hvd.Compression.fp16)
    """
    objects = distributed_custom_objects()
    for cls in custom_optimizers or []:
        objects[cls.__name__] = _distributed_class(cls)
    objects.update(custom_objects or {})
    options = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                   gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, sparse=sparse)
    _options_while_loading.update(options)
    try:
        model = keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    finally:
        _options_while_loading.clear()
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, _DistributedMixin):
        opt._tfmpi_configure(GradientReducer(f"Distributed{type(opt).__name__}", **options), 1, False)
    return model
