"""SyncBatchNormalization: batch statistics computed over the global batch of all ranks."""
import keras
import tensorflow as tf

from tf_mpi.basics import Sum
from tf_mpi.ops import grouped_allreduce


@keras.saving.register_keras_serializable(package="tf_mpi")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose training-time mean and variance are those of
    the whole global batch (every rank's samples), not of this rank's slice.

    Statistics are accumulated in float32 (also under mixed precision) as
    sum, sum of squares and count, reduced with one grouped allreduce.

    Takes Keras 3 BatchNormalization's arguments plus those of Horovod's
    layer and Keras 2 that Keras 3 dropped, so existing model code builds:
    ``fused`` must be False (as in Horovod: there is no fused synchronous
    kernel); ``renorm``, ``virtual_batch_size`` and ``adjustment`` are
    accepted at their Keras 2 defaults (False / None / None) and refused
    otherwise (Keras 3 has no implementation of them).

    Example::

        x = hvd.SyncBatchNormalization()(x)
        x = hvd.SyncBatchNormalization(fused=False, momentum=0.9)(x)   # Horovod / Keras 2 style
    """

    def __init__(self, fused=False, renorm=False, renorm_clipping=None, renorm_momentum=0.99,
                 virtual_batch_size=None, adjustment=None, **kwargs):
        if fused in (True, None):
            raise ValueError("tf_mpi: SyncBatchNormalization does not support fused=True (pass fused=False)")
        unsupported = [name for name, value, default in (("renorm", renorm, False),
                                                         ("renorm_clipping", renorm_clipping, None),
                                                         ("virtual_batch_size", virtual_batch_size, None),
                                                         ("adjustment", adjustment, None))
                       if value != default]
        if unsupported:
            raise NotImplementedError(f"tf_mpi: SyncBatchNormalization does not support {', '.join(unsupported)} "
                                      "(Keras 3's BatchNormalization has no implementation of them)")
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        if mask is not None:
            raise NotImplementedError("tf_mpi: SyncBatchNormalization does not support masks yet")
        x = tf.cast(inputs, tf.float32)
        axes = list(self._reduction_axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), tf.float32)
        total, total_sq, n = grouped_allreduce(
            [tf.reduce_sum(x, axes), tf.reduce_sum(tf.square(x), axes), tf.reshape(count, [1])], op=Sum)
        mean = total / n
        variance = tf.maximum(total_sq / n - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
