"""DistributedGradientTape: tf.GradientTape whose gradients are reduced across ranks."""
import tensorflow as tf

from tf_mpi.basics import Average
from tf_mpi.compression import Compression
from tf_mpi.reducer import GradientReducer


class DistributedGradientTape(tf.GradientTape):
    """Wraps a ``tf.GradientTape``; ``gradient()`` returns gradients averaged over ranks.

    Gradients are grouped by backprop order (see ``tf_mpi.grouping``) so that,
    inside ``tf.function``, communication overlaps the rest of backprop. With
    one TensorFlow inter-op thread pass ``order_backprop=True`` for that
    overlap (see ``tf_mpi.backprop_order``); other arguments are those of
    ``tf_mpi.keras.DistributedOptimizer``.

    Sources registered with ``register_local_source`` (model parallelism, as
    in Horovod) keep their local gradient, divided by size() unless
    ``scale_local_gradients=False``. ``device_dense`` / ``device_sparse``
    place the collectives of dense / IndexedSlices gradients, as in Horovod
    (``tf.device``; '' leaves them where TensorFlow puts them). ``sparse``
    chooses how IndexedSlices gradients travel ("allgather", "dense",
    "dedup", "auto"; see tf_mpi.sparse).

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 name="DistributedGradientTape", local_variables=None, order_backprop=None,
                 scale_local_gradients=True, sparse=None):
        # Take over the recorded tape instead of recording anew.
        self.__dict__.update(gradtape.__dict__)
        self._reducer = GradientReducer(name, op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                                        gradient_predivide_factor=gradient_predivide_factor,
                                        num_groups=num_groups, groups=groups, order_backprop=order_backprop,
                                        scale_local_gradients=scale_local_gradients, device_dense=device_dense,
                                        device_sparse=device_sparse, sparse=sparse)
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

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        """``tf.GradientTape.gradient``, then every gradient reduced across ranks (averaged by default).

        Gradients of sources registered as local are not reduced (see
        ``register_local_source``); None gradients stay None.

        Example: ``grads = tape.gradient(loss, model.trainable_variables)`` (the same on every rank)
        """
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._reducer.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)


class PartialDistributedGradientTape(DistributedGradientTape):
    """A DistributedGradientTape that keeps the gradients of ``local_layers`` local.

    ``local_layers`` is a layer or a list of layers; their trainable weights
    are registered with ``register_local_source``, so their gradients are not
    reduced and, unless ``scale_local_gradients=False``, are divided by size()
    (as in Horovod).

    Example::

        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.get_layer("head")])
    """

    def __init__(self, gradtape, local_layers=None, **kwargs):
        if local_layers is None:
            local_layers = []
        elif not isinstance(local_layers, (list, tuple)):
            local_layers = [local_layers]
        for layer in local_layers:
            if not hasattr(layer, "trainable_weights"):
                raise ValueError(f"tf_mpi: local_layers must be Keras layers, got {type(layer).__name__}")
        local_vars = [v for layer in local_layers for v in layer.trainable_weights]
        super().__init__(gradtape, local_variables=local_vars, **kwargs)
