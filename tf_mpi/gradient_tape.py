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

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 name="DistributedGradientTape", local_variables=None, order_backprop=None):
        # Take over the recorded tape instead of recording anew.
        self.__dict__.update(gradtape.__dict__)
        self._reducer = GradientReducer(name, op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                                        gradient_predivide_factor=gradient_predivide_factor,
                                        num_groups=num_groups, groups=groups, order_backprop=order_backprop)
        self._local_ids = {id(v) for v in (local_variables or [])}

    @property
    def grouping_plan(self):
        """The last grouping plan used (a tf_mpi.grouping.Plan), or None."""
        return self._reducer.plan

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        shared = [i for i, v in enumerate(flat_sources) if id(v) not in self._local_ids]
        reduced = self._reducer.reduce([flat_grads[i] for i in shared], [flat_sources[i] for i in shared])
        for i, r in zip(shared, reduced):
            flat_grads[i] = r
        return tf.nest.pack_sequence_as(grads, flat_grads)


class PartialDistributedGradientTape(DistributedGradientTape):
    """A DistributedGradientTape that leaves the gradients of ``local_layers`` unreduced.

    Example::

        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.get_layer("head")])
    """

    def __init__(self, gradtape, local_layers=None, **kwargs):
        local_vars = [v for layer in (local_layers or []) for v in layer.trainable_weights]
        super().__init__(gradtape, local_variables=local_vars, **kwargs)
