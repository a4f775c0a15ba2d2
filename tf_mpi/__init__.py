"""tf_mpi: synchronous data-parallel TensorFlow training over MPI.

A Horovod-compatible API: ``import tf_mpi as hvd`` and keep your code.

Example (run with ``mpirun -np 2 python train.py``)::

    import tensorflow as tf
    import tf_mpi as hvd

    hvd.init()
    total = hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum)
"""
from tf_mpi.basics import (  # noqa: F401
    Average, Sum, Min, Max, Product, Adasum,
    init, shutdown, is_initialized, rank, size, local_rank, local_size, cross_rank, cross_size,
    mpi_threads_supported, mpi_enabled, mpi_built, gloo_built, nccl_built, ccl_built, ddl_built,
    rocm_built, cuda_built, start_timeline, stop_timeline, join,
)
from tf_mpi.compression import Compression
from tf_mpi.ops import (
    allreduce, grouped_allreduce, allgather, grouped_allgather, broadcast, grouped_broadcast,
    alltoall, reducescatter, grouped_reducescatter,
    rank_op, size_op, local_rank_op, local_size_op,
)
from tf_mpi.functions import (
    broadcast_variables, broadcast_, broadcast_object, broadcast_object_fn, allgather_object, barrier,
)
from tf_mpi import data
from tf_mpi.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from tf_mpi import grouping

__version__ = "0.1.0"
