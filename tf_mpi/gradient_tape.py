"""DistributedGradientTape: tf.GradientTape whose gradients are reduced across ranks."""
import tensorflow as tf

from tf_mpi.basics import Average
from tf_mpi.policy.compression import Compression
from tf_mpi.basics import _check_process_set
from tf_mpi.policy.variable_identity import variable_key
from tf_mpi.policy.reducer import GradientReducer, check_groups, mark_reduced


def _new_object(grad):
    """The same gradient value in a new Python object (None stays None)."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values, grad.indices, grad.dense_shape)
    return tf.identity(grad)


class DistributedGradientTape(tf.GradientTape):
    """Wraps a ``tf.GradientTape``; ``gradient()`` returns gradients averaged over ranks.

    The positional parameters are Horovod's, in its order (``process_set``:
    gradients are reduced among that set's ranks only); the others are
    keyword-only. ``op`` is any reduction (Average, Sum, Min, Max, Product,
    Adasum: see tf_mpi.adasum), as in Horovod; ``gradient_predivide_factor`` needs op=Average
    (ValueError otherwise); ``num_groups`` is deprecated in favour of
    ``groups`` (an integer > 0 or lists of variables; DeprecationWarning /
    ValueError as in Horovod).

    Gradients are grouped by backprop order (see ``tf_mpi.grouping``) so that,
    inside ``tf.function``, communication overlaps the rest of backprop. With
    one TensorFlow inter-op thread pass ``order_backprop=True`` for that
    overlap (see ``tf_mpi.policy.backprop_order``). ``name`` prefixes the
    collectives' names; ``local_variables`` are registered with
    ``register_local_source``; ``sparse`` chooses how IndexedSlices gradients
    travel ("allgather", "dense", "dedup", "auto"; see tf_mpi.policy.sparse).

    Sources registered with ``register_local_source`` (model parallelism, as
    in Horovod) keep their local gradient, divided by size() unless
    ``scale_local_gradients=False``. ``device_dense`` / ``device_sparse``
    place the collectives of dense / IndexedSlices gradients, as in Horovod
    (``tf.device``; '' leaves them where TensorFlow puts them).

    The gradients it returns are marked as reduced: a ``DistributedOptimizer``
    given them unchanged applies them without reducing them again (as
    Horovod's, which reduces only in ``compute_gradients``). Gradients
    computed from them (clipped, scaled) are reduced again by such an optimizer.

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=None, scale_local_gradients=True, *, name="DistributedGradientTape",
                 local_variables=None, order_backprop=None, sparse=None):
        _check_process_set(process_set, "DistributedGradientTape")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("tf_mpi: gradient_predivide_factor needs op=Average (as in Horovod)")
        groups = check_groups(num_groups, groups)
        # Take over the recorded tape instead of recording anew.
        self.__dict__.update(gradtape.__dict__)
        self._reducer = GradientReducer(name, op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                                        gradient_predivide_factor=gradient_predivide_factor,
                                        groups=groups, order_backprop=order_backprop,
                                        scale_local_gradients=scale_local_gradients, device_dense=device_dense,
                                        device_sparse=device_sparse, sparse=sparse, process_set=process_set)
        for v in local_variables or []:
            self._reducer.register_local(v)

    @property
    def grouping_plan(self):
        """The last grouping plan used (a tf_mpi.grouping.Plan), or None."""
        return self._reducer.plan

    def register_local_source(self, source):
        """Keeps `source`'s gradient local: it is not reduced across ranks (Horovod's model-parallel hook).

        The local gradient is divided by size() unless the tape was made with
        ``scale_local_gradients=False``. Takes tf.Variables and Keras 3 variables.

        Example::

            tape = hvd.DistributedGradientTape(tape)
            tape.register_local_source(model.get_layer("expert").kernel)
        """
        self._reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, *,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """``tf.GradientTape.gradient``, then every gradient reduced across ranks (averaged by default).

        Gradients of sources registered as local are not reduced (see
        ``register_local_source``); None gradients stay None.
        ``use_generic_names`` is accepted for Horovod's signature: Horovod
        names the collectives ``grad_<i>`` with it so that the names agree
        across ranks; tf_mpi's names (the tape's ``name`` and the grouping
        plan) always agree.

        Example: ``grads = tape.gradient(loss, model.trainable_variables)`` (the same on every rank)
        """
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._reducer.reduce(flat_grads, flat_sources)
        # A gradient passed through unchanged (one rank, a local source kept as it is) is first copied:
        # the mark must not land on a tensor TensorFlow may hand out again (its cached zeros).
        marked = [mark_reduced(_new_object(r) if r is g else r) for r, g in zip(reduced, flat_grads)]
        return tf.nest.pack_sequence_as(grads, marked)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``gradient()``, split as Horovod does: ``(local, global)``, lists of ``(source, gradient)``
        pairs for the sources registered as local and for the others, in the order of `sources`.

        Example::

            local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, model.trainable_variables)
        """
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads, expand_composites=False)):
            (local if variable_key(s) in self._reducer._local else shared).append((s, g))
        return local, shared


class PartialDistributedGradientTape(DistributedGradientTape):
    """A DistributedGradientTape that keeps the gradients of ``local_layers`` local.

    Takes Horovod's parameters in Horovod's order (``local_layers`` comes
    after ``process_set``; tf_mpi's extras are keyword-only, as in
    DistributedGradientTape). ``local_layers`` is a layer or a list of
    layers; their trainable weights are registered with
    ``register_local_source``, so their gradients are not reduced and, unless
    ``scale_local_gradients=False``, are divided by size() (as in Horovod).

    Example::

        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.get_layer("head")])
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=None, local_layers=None, scale_local_gradients=True, *,
                 name="DistributedGradientTape", local_variables=None, order_backprop=None, sparse=None):
        if local_layers is None:
            local_layers = []
        elif not isinstance(local_layers, (list, tuple)):
            local_layers = [local_layers]
        for layer in local_layers:
            if not hasattr(layer, "trainable_weights"):
                raise ValueError(f"tf_mpi: local_layers must be Keras layers, got {type(layer).__name__}")
        local_vars = [v for layer in local_layers for v in layer.trainable_weights]
        groups = check_groups(num_groups, groups)  # here, so that a warning points at the caller
        super().__init__(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                         gradient_predivide_factor, 0, groups, process_set, scale_local_gradients, name=name,
                         local_variables=local_vars + list(local_variables or []), order_backprop=order_backprop,
                         sparse=sparse)
