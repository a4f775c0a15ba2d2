"""DistributedOptimizer for TF1 optimizers (``tf.compat.v1.train.Optimizer``).

``tf_mpi.DistributedOptimizer`` returns this wrapper when given a TF1
optimizer such as ``tf.compat.v1.train.GradientDescentOptimizer(0.1)``, as
``horovod.tensorflow.DistributedOptimizer`` does:

- ``compute_gradients(...)`` calls the wrapped optimizer's and reduces the
  gradients across ranks (``op`` Average by default, or Sum, Min, Max,
  Product; ``compression``, ``sparse_as_dense``, ``gradient_predivide_factor``,
  ``groups``, ``process_set`` as for the other entry points; IndexedSlices
  gradients are allgathered unless ``sparse_as_dense``).
- ``apply_gradients``, ``get_slot``, ``get_slot_names`` and ``variables``
  are the wrapped optimizer's; ``minimize`` runs both steps, so it applies the
  reduced gradients.
- ``backward_passes_per_step=k > 1`` (TF1 graphs only; ``ValueError`` when
  executing eagerly): each run adds the gradients to local accumulators; every
  k-th run reduces the sums (divided by k with ``average_aggregated_gradients``)
  and ``apply_gradients`` applies them; on the other runs ``apply_gradients``
  changes no weight and only advances ``global_step``. The accumulators are
  local variables (``tf.compat.v1.local_variables_initializer()``).
- Ranks outside ``process_set`` keep their own gradients.
- ``register_local_var(v)``: ``v``'s gradient is not reduced (divided by the
  set's size unless ``scale_local_gradients=False``).

Works in a TF1 graph run by a ``Session`` and eagerly (pass a callable loss to
``compute_gradients`` / ``minimize`` there, as TensorFlow requires).

Example::

    import tensorflow as tf, tf_mpi as hvd
    tf.compat.v1.disable_eager_execution()
    hvd.init()
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.01 * hvd.size()))
    train_op = opt.minimize(loss)
"""
import tensorflow as tf

from tf_mpi import process_sets
from tf_mpi.basics import Adasum, Average
from tf_mpi.policy.compression import Compression
from tf_mpi.policy.variable_identity import variable_key
from tf_mpi.policy.reducer import GradientReducer

LegacyOptimizer = tf.compat.v1.train.Optimizer


def is_legacy_optimizer(optimizer):
    """Whether `optimizer` is a TF1 ``tf.compat.v1.train.Optimizer``."""
    return isinstance(optimizer, LegacyOptimizer)


class _DistributedLegacyOptimizer(LegacyOptimizer):
    """A TF1 optimizer whose ``compute_gradients`` returns gradients reduced across ranks."""

    def __init__(self, optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                 compression=Compression.none, sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                 backward_passes_per_step=1, average_aggregated_gradients=False, groups=None, process_set=None,
                 scale_local_gradients=True, sparse=None, order_backprop=None):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self.process_set = process_sets.global_process_set if process_set is None else process_set
        self.scale_local_gradients = scale_local_gradients
        self._reducer = GradientReducer(name, op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                                        gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                                        order_backprop=order_backprop, scale_local_gradients=scale_local_gradients,
                                        device_dense=device_dense, device_sparse=device_sparse, sparse=sparse,
                                        process_set=process_set)
        self._passes = int(backward_passes_per_step)
        self._average_aggregated = average_aggregated_gradients
        self._counter = None
        if self._passes > 1 and tf.executing_eagerly():
            raise ValueError("tf_mpi: backward_passes_per_step > 1 with a TF1 optimizer works in TF1 graphs only, "
                             "not with eager execution (as in Horovod)")

    @property
    def grouping_plan(self):
        """The grouping plan of the last reduction (tf_mpi.grouping.Plan), or None."""
        return self._reducer.plan

    def register_local_var(self, var):
        """Keeps `var`'s gradient local: it is not reduced across ranks (Horovod's model-parallel hook)."""
        self._reducer.register_local(var)

    def _reduce(self, grads, variables):
        """The reduced gradients; on a rank outside the process set, its own (local ones still scaled)."""
        if process_sets.included(self._reducer.set_id) != 1:
            return [self._reducer._scale_local(g) if variable_key(v) in self._reducer._local else g
                    for g, v in zip(grads, variables)]
        return self._reducer.reduce(grads, variables)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``compute_gradients``, each gradient reduced across ranks.

        Returns a list of ``(gradient, variable)`` pairs in the wrapped optimizer's order; None
        gradients stay None.

        Example: ``grads_and_vars = opt.compute_gradients(loss)``
        """
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._passes > 1:
            reduced = self._accumulate(grads, variables)
        else:
            reduced = self._reduce(grads, variables)
        return list(zip(reduced, variables))

    # ----------------------------------------------------------------- backward_passes_per_step > 1
    def _dense_for_accumulation(self, grad):
        if isinstance(grad, tf.IndexedSlices):
            if not self._reducer.sparse_as_dense:
                raise ValueError("tf_mpi: IndexedSlices gradients with backward_passes_per_step > 1 need "
                                 "sparse_as_dense=True (as in Horovod)")
            return tf.convert_to_tensor(grad)
        return grad

    def _accumulate(self, grads, variables):
        grads = [None if g is None else self._dense_for_accumulation(g) for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        with tf.compat.v1.name_scope(f"{self._name}_accumulation"):
            self._counter = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False, name="counter",
                                                  collections=local, use_resource=True)
            sums = [tf.compat.v1.Variable(tf.zeros(grads[i].shape, grads[i].dtype), trainable=False,
                                          name=f"sum_{i}", collections=local, use_resource=True)
                    for i in present]
        counter, k = self._counter, self._passes

        def clear():
            return tf.group(*[s.assign(tf.zeros_like(s)) for s in sums])

        cleared = tf.cond(tf.equal(counter, 0), clear, tf.no_op)
        with tf.control_dependencies([cleared]):
            added = [s.assign_add(grads[i]) for s, i in zip(sums, present)]
        with tf.control_dependencies(added):
            counted = counter.assign_add(1)

        def reduce_sums():
            totals = [s.read_value() for s in sums]
            reduced = self._reduce(totals, [variables[i] for i in present])
            with tf.control_dependencies([r.op for r in reduced]):
                reset = counter.assign(0)
            divisor = k if self._average_aggregated else 1
            with tf.control_dependencies([reset]):
                return [tf.identity(r / tf.cast(divisor, r.dtype)) for r in reduced]

        def pass_through():
            return [tf.identity(grads[i]) for i in present]

        with tf.control_dependencies([counted]):
            out = tf.cond(tf.equal(counter.read_value(), k), reduce_sums, pass_through)
        if not isinstance(out, (list, tuple)):
            out = [out]
        result = [None] * len(grads)
        for i, r in zip(present, out):
            result[i] = r
        return result

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's ``apply_gradients`` (with ``backward_passes_per_step > 1``: only on
        the runs that reduced; the others advance ``global_step`` alone)."""
        if self._passes <= 1 or self._counter is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)
        counter = self._counter
        ready = [g for g, _ in grads_and_vars if g is not None]
        with tf.control_dependencies(ready):
            applied = tf.cond(
                tf.equal(counter.read_value(), 0),
                lambda: tf.group(self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                                 name=name)),
                tf.no_op)

        def advance_step():
            if global_step is None:
                return tf.no_op()
            return tf.group(global_step.assign_add(tf.constant(1, global_step.dtype.base_dtype)))

        with tf.control_dependencies([applied]):
            return tf.cond(tf.equal(counter.read_value(), 0), tf.no_op, advance_step)

    def get_slot(self, *args, **kwargs):
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


def distributed_legacy_optimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                                 compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                                 op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                                 groups=None, process_set=None, scale_local_gradients=True, sparse=None,
                                 order_backprop=None):
    """The wrapper ``tf_mpi.DistributedOptimizer`` returns for a TF1 optimizer (its arguments already
    checked there; ``groups`` as ``tf_mpi.policy.reducer.check_groups`` returns it).

    Example: ``distributed_legacy_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Sum)``
    """
    if op == Adasum:
        if average_aggregated_gradients:
            raise ValueError("tf_mpi: op=Adasum does not take average_aggregated_gradients=True (as in Horovod)")
        if process_sets.resolve(process_set, "DistributedOptimizer") != 0:
            raise NotImplementedError("tf_mpi: Adasum does not support process sets (as in Horovod)")
        raise NotImplementedError(
            "tf_mpi: op=hvd.Adasum with a TF1 optimizer (Adasum of the weight deltas) is not supported; "
            "use op=hvd.Average, or a tf.GradientTape wrapped in hvd.DistributedGradientTape(tape, op=hvd.Adasum)")
    return _DistributedLegacyOptimizer(optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
                                       device_sparse=device_sparse, compression=compression,
                                       sparse_as_dense=sparse_as_dense, op=op,
                                       gradient_predivide_factor=gradient_predivide_factor,
                                       backward_passes_per_step=backward_passes_per_step,
                                       average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                                       process_set=process_set, scale_local_gradients=scale_local_gradients,
                                       sparse=sparse, order_backprop=order_backprop)
