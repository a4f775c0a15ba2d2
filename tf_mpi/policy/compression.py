"""Gradient compression on the wire (Horovod's ``hvd.Compression``): the plain codecs of
tf_mpi.codecs and the sparsifying compressors of tf_mpi.policy.topk_compression under one name."""
from tf_mpi.codecs import Compressor, FP16Compressor, NoneCompressor  # noqa: F401  (Horovod's module has them)
from tf_mpi.policy.topk_compression import GTopKCompressor, TopKCompressor


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
        return TopKCompressor(ratio, name="topk_compression")

    @staticmethod
    def gtopk(ratio):
        """Global top-k: every rank applies the same ceil(ratio * n) entries of the summed sparse gradients.

        Merged pairwise in log2(size()) rounds; see tf_mpi.policy.topk_compression.

        Example: ``hvd.DistributedGradientTape(tape, compression=hvd.Compression.gtopk(0.01))``
        """
        return GTopKCompressor(ratio, name="gtopk_compression")
