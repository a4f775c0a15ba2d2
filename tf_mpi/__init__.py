"""tf_mpi: synchronous data-parallel TensorFlow training over MPI.

A Horovod-compatible API: ``import tf_mpi as hvd`` and keep your code.

Example (run with ``mpirun -np 2 python train.py``)::

    import tensorflow as tf
    import tf_mpi as hvd

    hvd.init()
    total = hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum)

The public API (``__all__``, what ``from tf_mpi import *`` binds):

- Horovod's names, as in ``horovod.tensorflow``: the reduce ops ``Average``,
  ``Sum``, ``Min``, ``Max``, ``Product``, ``Adasum``; ``init``, ``shutdown``,
  ``is_initialized``, ``rank``, ``size``, ``local_rank``, ``local_size``,
  ``cross_rank``, ``cross_size``, ``is_homogeneous``,
  ``mpi_threads_supported``, ``mpi_enabled``, ``mpi_built``,
  ``gloo_enabled``, ``gloo_built``, ``nccl_built``, ``ccl_built``,
  ``ddl_built``, ``rocm_built``, ``cuda_built``, ``sycl_built``, ``gpu_available``, ``start_timeline``,
  ``stop_timeline``, ``join``, ``handle_average_backwards_compatibility``,
  ``check_num_rank_power_of_2``; ``Compression``; the collectives
  ``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``,
  ``broadcast``, ``alltoall``, ``reducescatter``, ``grouped_reducescatter``,
  ``rank_op``, ``size_op``, ``local_rank_op``, ``local_size_op``,
  ``process_set_included_op``; ``broadcast_variables``, ``broadcast_``,
  ``broadcast_object``, ``broadcast_object_fn``, ``allgather_object``,
  ``broadcast_global_variables``; ``DistributedGradientTape``,
  ``PartialDistributedGradientTape``, ``DistributedOptimizer``,
  ``SyncBatchNormalization``; ``ProcessSet``, ``global_process_set``,
  ``add_process_set``, ``remove_process_set``; and the module ``elastic``.
  Their parameters are Horovod's (names, order, defaults); every collective
  takes ``process_set`` (tf_mpi.process_sets).
- tf_mpi's additions: ``grouped_broadcast``, ``barrier``,
  ``mpi_built_with_cuda_support``, ``gpu_transport``, and the modules
  ``data`` (sharding input by rank) and ``grouping`` (which gradients are
  reduced together).

The implementation modules (``basics``, ``ops``, ``functions``,
``gradient_tape``, ``_core``) stay importable (``import tf_mpi.ops``,
``tf_mpi.ops``) but are not part of ``__all__``. How gradients are reduced
is in ``tf_mpi.policy`` (``tf_mpi.policy.reducer``, ``tf_mpi.policy.sparse``,
...), the command-line tools in ``tf_mpi.tools``.

The names are loaded on first use (PEP 562), so that tools that do not
need TensorFlow (``python -m tf_mpi.run``, the timeline tools) start without
importing it.
"""
import importlib

__version__ = "0.1.0"

# Public name -> the submodule that defines it.
_API = {
    "basics": (
        "Average", "Sum", "Min", "Max", "Product", "Adasum",
        "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
        "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
        "gloo_enabled", "gloo_built", "nccl_built", "ccl_built", "ddl_built", "rocm_built", "cuda_built",
        "sycl_built", "gpu_available",
        "mpi_built_with_cuda_support", "gpu_transport",
        "start_timeline", "stop_timeline",
        "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    ),
    "policy.compression": ("Compression",),
    "ops": (
        "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
        "grouped_broadcast", "alltoall", "reducescatter", "grouped_reducescatter",
        "rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op", "join",
    ),
    "functions": (
        "broadcast_variables", "broadcast_", "broadcast_object", "broadcast_object_fn",
        "allgather_object", "barrier", "broadcast_global_variables",
    ),
    "gradient_tape": ("DistributedGradientTape", "PartialDistributedGradientTape"),
    "process_sets": ("ProcessSet", "global_process_set", "add_process_set", "remove_process_set"),
    # horovod.tensorflow exports these too (DistributedOptimizer takes Keras optimizers).
    "keras.optimizer": ("DistributedOptimizer",),
    "keras.sync_batch_norm": ("SyncBatchNormalization",),
}
_ORIGIN = {name: module for module, names in _API.items() for name in names}
# Horovod's hvd._executing_eagerly: reachable, not exported.
_ORIGIN["_executing_eagerly"] = "util"

# Modules of the public API (Horovod has ``hvd.elastic``; ``data`` and ``grouping`` are tf_mpi's).
_API_MODULES = ("data", "grouping", "elastic")
# Implementation modules: reachable as attributes (``tf_mpi.ops``, ``tf_mpi.basics._core``), as they
# were when the package imported everything eagerly, but not exported.
_SUBMODULES = (*_API_MODULES, "basics", "functions", "gradient_tape", "ops", "_core",
               "mpi_ops", "util")  # the last two at Horovod's module paths (horovod.tensorflow.mpi_ops, .util)

__all__ = [name for name in _ORIGIN if not name.startswith("_")] + list(_API_MODULES)


def __getattr__(name):
    if name in _ORIGIN:
        value = getattr(importlib.import_module(f"{__name__}.{_ORIGIN[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
