"""Gradient compression on the wire (Horovod's ``hvd.Compression``)."""
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


class Compression:
    """The available compressors: ``none``, ``fp16``, ``topk(ratio)`` and ``gtopk(ratio)``.

    Pass one as ``compression=`` to ``DistributedOptimizer`` or
    ``DistributedGradientTape`` (``none`` and ``fp16`` also to ``allreduce``).
    fp16 halves the bytes of floating-point gradients on the wire (reduced in
    float16, cast back after). ``topk(ratio)`` and ``gtopk(ratio)`` send only
    the ceil(ratio * n) largest-magnitude entries of each gradient, as
    (index, value) pairs, and keep the rest in a residual added to the next
    step's gradient (error feedback): fewer bytes for some accuracy (see
    docs/compression.md).

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(), compression=hvd.Compression.fp16)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.topk(0.01))
    """
    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def topk(ratio):
        """Each rank sends its ceil(ratio * n) largest-magnitude entries per gradient; they are summed.

        Returns a new compressor (it holds the residuals of the gradients it
        reduces through DistributedGradientTape: use one per model).

        Example: ``hvd.DistributedOptimizer(opt, compression=hvd.Compression.topk(0.01))``
        """
        from tf_mpi.topk_compression import TopKCompressor
        return TopKCompressor(ratio, name="topk_compression")

    @staticmethod
    def gtopk(ratio):
        """Global top-k: every rank applies the same ceil(ratio * n) entries of the summed sparse gradients.

        Merged pairwise in log2(size()) rounds; see tf_mpi.topk_compression.

        Example: ``hvd.DistributedGradientTape(tape, compression=hvd.Compression.gtopk(0.01))``
        """
        from tf_mpi.topk_compression import GTopKCompressor
        return GTopKCompressor(ratio, name="gtopk_compression")
