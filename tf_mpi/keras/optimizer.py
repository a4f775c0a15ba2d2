"""DistributedOptimizer for Keras 3: reduces gradients across ranks inside apply().

Two entry points share the wrapping below, each with its Horovod
counterpart's parameters in that counterpart's order:
``DistributedOptimizer`` here is ``tf_mpi.DistributedOptimizer``
(``horovod.tensorflow.DistributedOptimizer``: ``use_locking`` third,
``backward_passes_per_step`` before ``op``), and ``tf_mpi.keras``
defines ``tf_mpi.keras.DistributedOptimizer``
(``horovod.tensorflow.keras.DistributedOptimizer``).

Where the reduction sits in Keras 3's ``apply()`` matters (each point below
has a test in tests/workers/keras_worker.py or optimizer_compat_worker.py):

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
  ``iterations`` still counts every pass, as Horovod's does, so learning-rate
  schedules and Adam's bias correction see the pass count.
- Gradients returned by ``DistributedGradientTape`` (marked by it, see
  ``tf_mpi.policy.reducer.mark_reduced``) are applied without a second reduction:
  Horovod's optimizer reduces only in ``compute_gradients``, so a tape's
  gradients given to its ``apply_gradients`` are reduced once.
- ``Compression.topk`` / ``gtopk``: the error-feedback residuals are optimizer
  variables ("tfmpi_residual", created in ``build``), so ``model.save`` and
  ``tf.train.Checkpoint`` keep them (with a LossScaleOptimizer the compressor
  keeps them instead, in unscaled units: the gradients are unscaled before
  the sparsified reduction and scaled back after it, and a step that
  overflows leaves them unchanged).
"""
import keras
import tensorflow as tf

from tf_mpi.basics import Adasum, Average, Sum
from tf_mpi.policy.compression import Compression
from tf_mpi.basics import _check_process_set
from tf_mpi.policy.variable_identity import variable_key
from tf_mpi.policy.reducer import GradientReducer, check_groups, is_reduced, map_gradient

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
    # variable_key of the variables whose gradients in the current apply() came reduced from a tape.
    _tfmpi_skip = frozenset()

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
        """The reducer's reduction, leaving out the gradients DistributedGradientTape already reduced."""
        reducer = self._tfmpi_get_reducer()
        if not self._tfmpi_skip:
            return reducer.reduce(grads, variables, residuals)
        todo = [i for i, v in enumerate(variables) if variable_key(v) not in self._tfmpi_skip]
        out = list(grads)
        reduced = reducer.reduce([grads[i] for i in todo], [variables[i] for i in todo],
                                 None if residuals is None else [residuals[i] for i in todo])
        for i, g in zip(todo, reduced):
            out[i] = g
        return out

    def _tfmpi_applying(self, grads, trainable_variables, apply_fn):
        """apply_fn() with _tfmpi_skip naming the variables whose gradient in `grads` a
        DistributedGradientTape returned (checked here, before Keras computes anything from them)."""
        variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
        skip = frozenset(variable_key(v) for g, v in zip(grads, variables) if is_reduced(g))
        object.__setattr__(self, "_tfmpi_skip", skip)  # not tracked as optimizer state
        try:
            return apply_fn()
        finally:
            object.__setattr__(self, "_tfmpi_skip", frozenset())

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
        grads = list(grads)
        if self._tfmpi_passes == 1:
            return self._tfmpi_applying(grads, trainable_variables,
                                        lambda: super(_DistributedPlain, self).apply(grads, trainable_variables))
        return self._tfmpi_applying(grads, trainable_variables,
                                    lambda: self._tfmpi_apply_every_k(grads, trainable_variables))

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
            return tf.constant(True)  # super().apply() counted this pass in iterations

        def count_pass():
            # Horovod adds 1 to iterations on the passes it does not apply, so iterations counts passes.
            self._iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(self._tfmpi_counter % k == 0, apply_accumulated, count_pass)


def _times(grad, factor):
    return map_gradient(grad, lambda v: v * tf.cast(factor, v.dtype))


class _DistributedLossScale(_DistributedMixin):
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        return self._tfmpi_applying(grads, trainable_variables,
                                    lambda: self._tfmpi_reduce_and_apply(grads, trainable_variables))

    def _tfmpi_reduce_and_apply(self, grads, trainable_variables):
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
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


def _distributed_optimizer(optimizer, name=None, device_dense="", device_sparse="",
                           compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                           op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                           groups=None, scale_local_gradients=True, order_backprop=None, sparse=None,
                           process_set=None):
    """The distributed copy of `optimizer` behind both DistributedOptimizer entry points (arguments
    already checked by them; ``groups`` as returned by ``tf_mpi.policy.reducer.check_groups``).

    Example: ``_distributed_optimizer(keras.optimizers.SGD(0.1), op=hvd.Sum)``
    """
    if op == Adasum:   # Horovod's words for it (horovod/tensorflow/__init__.py, DistributedOptimizer)
        raise ValueError("op == Adasum is not supported yet with Keras")
    if op not in (Average, Sum):
        # Horovod's Keras optimizer takes only these two (ValueError, Adasum included).
        raise ValueError(f"tf_mpi: DistributedOptimizer reduces with op=Average or op=Sum; got {op!r}")
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
                              groups=groups, order_backprop=order_backprop,
                              scale_local_gradients=scale_local_gradients, device_dense=device_dense,
                              device_sparse=device_sparse, sparse=sparse, process_set=process_set)
    wrapped._tfmpi_configure(reducer, backward_passes_per_step, average_aggregated_gradients)
    return wrapped


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=None, scale_local_gradients=True, *,
                         order_backprop=None, sparse=None):
    """``tf_mpi.DistributedOptimizer``: ``tf_mpi.keras.DistributedOptimizer`` with the parameters of
    ``horovod.tensorflow.DistributedOptimizer``, in its order. Given a TF1
    optimizer (``tf.compat.v1.train.Optimizer``) it returns Horovod's TF1
    wrapper instead (``tf_mpi.compat.legacy_optimizer``: ``compute_gradients``
    returns reduced gradients).

    That order differs from the Keras one: ``use_locking`` third, then
    ``backward_passes_per_step`` before ``op`` and ``gradient_predivide_factor``.
    ``use_locking`` is accepted and, as Horovod does for Keras optimizers,
    not used; ``gradient_predivide_factor`` with an op other than Average is
    a ValueError here (the Keras entry point ignores it, as Horovod's does).
    ``process_set``: gradients are reduced among that set's ranks only.
    Everything else is as in ``tf_mpi.keras.DistributedOptimizer``, which
    documents each argument; ``op`` and ``groups`` are honoured (Horovod's
    top level drops them when it hands a Keras optimizer to its Keras wrapper).

    Example::

        import keras, tf_mpi as hvd
        hvd.init()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()), backward_passes_per_step=2)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
    """
    _check_process_set(process_set, "DistributedOptimizer")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("tf_mpi: gradient_predivide_factor needs op=Average (as in Horovod)")
    groups = check_groups(num_groups, groups)
    from tf_mpi.compat import legacy_optimizer  # a TF1 optimizer: Horovod's TF1 wrapper (tf_mpi.compat.legacy_optimizer)
    if legacy_optimizer.is_legacy_optimizer(optimizer):
        return legacy_optimizer.distributed_legacy_optimizer(
            optimizer, name, use_locking, device_dense, device_sparse, compression, sparse_as_dense,
            backward_passes_per_step, op, gradient_predivide_factor, average_aggregated_gradients, groups,
            process_set, scale_local_gradients, sparse, order_backprop)
    del use_locking  # a TF1 optimizer setting; Keras optimizers have none
    return _distributed_optimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                  gradient_predivide_factor, op, backward_passes_per_step,
                                  average_aggregated_gradients, groups, scale_local_gradients, order_backprop, sparse,
                                  process_set)


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
               legacy_opts=False, *, sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
               num_groups=0, groups=None, sparse=None, **kwargs):
    """``keras.models.load_model`` whose optimizer comes back as a DistributedOptimizer.

    The positional parameters are Horovod's. ``legacy_opts=True`` (Horovod:
    load ``keras.optimizers.legacy`` optimizers) raises ValueError: Keras 3
    has no legacy optimizers. The DistributedOptimizer options are not
    stored in the file: pass them again (``backward_passes_per_step`` cannot
    be restored this way; wrap a fresh optimizer instead). Other keyword
    arguments go to keras.models.load_model.

    Example::

        model = hvd.load_model("checkpoint.keras", compression=hvd.Compression.fp16)
    """
    if op not in (Average, Sum):
        raise ValueError(f"tf_mpi: DistributedOptimizer reduces with op=Average or op=Sum; got {op!r}")
    if legacy_opts:
        raise ValueError("tf_mpi: legacy_opts=True asks for keras.optimizers.legacy optimizers, which Keras 3 "
                         "does not have")
    objects = distributed_custom_objects()
    for cls in custom_optimizers or []:
        objects[cls.__name__] = _distributed_class(cls)
    objects.update(custom_objects or {})
    options = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                   gradient_predivide_factor=gradient_predivide_factor, sparse=sparse,
                   groups=check_groups(num_groups, groups))
    _options_while_loading.update(options)
    try:
        model = keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    finally:
        _options_while_loading.clear()
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, _DistributedMixin):
        opt._tfmpi_configure(GradientReducer(f"Distributed{type(opt).__name__}", **options), 1, False)
    return model
