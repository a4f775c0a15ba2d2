"""The reduction operations of allreduce and its relatives (Horovod's ``hvd.Sum``, ...).

A module of its own, below everything that reduces: the runtime (basics), the process
sets, the ops and the reduction policy all name these."""
import enum


class ReduceOp(enum.IntEnum):
    """How ``allreduce`` and its relatives combine the ranks' values: ``hvd.Average``
    (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max``, ``hvd.Product``, and ``hvd.Adasum``
    (the scale-invariant pairwise combination of tf_mpi.adasum).

    The members are ints (the engine's values, cpp/core/common/types.h ReduceOp), so
    code that passes or compares them as Horovod's integer constants keeps
    working; the numbers differ from Horovod's: use the names.

    Example::

        hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum)   # 2 ranks: [2.0, 4.0]
        hvd.allreduce(loss)                                  # op=hvd.Average
    """
    Average = 0
    Sum = 1
    Min = 2
    Max = 3
    Product = 4
    Adasum = 5


Average, Sum, Min, Max, Product, Adasum = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max,
                                           ReduceOp.Product, ReduceOp.Adasum)
