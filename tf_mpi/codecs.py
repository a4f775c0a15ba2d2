"""Codecs for tensors on the wire: a compressor turns a tensor into what is sent and back.

The plain ones (none, fp16) need no communication of their own; the collectives (tf_mpi.ops)
take them as ``compression=``. The sparsifying ones, which do communicate, are in
tf_mpi.policy.topk_compression; tf_mpi.policy.compression gathers all of them as ``hvd.Compression``."""
import tensorflow as tf


class Compressor:
    """Turns a tensor into what is sent and back. Subclass and pass as ``compression=``.

    Example::

        class BF16Compressor(Compressor):
            @staticmethod
            def compress(tensor):
                return tf.cast(tensor, tf.bfloat16), tensor.dtype

            @staticmethod
            def decompress(tensor, ctx):
                return tf.cast(tensor, ctx)

        hvd.allreduce(grad, compression=BF16Compressor)
    """

    @staticmethod
    def compress(tensor):
        """Returns ``(tensor_to_send, context)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Inverse of ``compress`` given its context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are (the default).

    Example: ``hvd.allreduce(grad, compression=hvd.Compression.none)``
    """

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating tensors as float16 (half the bytes), casts back after.

    Example::

        hvd.allreduce(grad, compression=hvd.Compression.fp16)
    """

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)
