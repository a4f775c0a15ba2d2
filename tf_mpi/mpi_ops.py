"""Horovod's module path ``horovod.tensorflow.mpi_ops``: tf_mpi's collectives and ``_basics``.

Horovod scripts and tests reach the process-set table through
``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()``; here ``_basics`` is
tf_mpi.basics, which has that function. The collectives are tf_mpi.ops'.

Example::

    import tf_mpi as hvd
    hvd.init()
    hvd.mpi_ops._basics._get_process_set_ids_and_ranks()   # {0: [0, 1]} on 2 ranks
"""
import tf_mpi as _package
from tf_mpi import basics as _basics  # noqa: F401
from tf_mpi import ops as _ops

# The names Horovod's mpi_ops has that tf_mpi defines: the TF collectives and ops, and the
# basics and process-set names it re-exports.
_NAMES = (*_package._API["ops"], *_package._API["basics"], *_package._API["process_sets"])
globals().update({name: getattr(_package, name) for name in _NAMES})
_allreduce = _ops._allreduce

__all__ = list(_NAMES)
