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

    Example::

        x = hvd.SyncBatchNormalization()(x)
    """

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
