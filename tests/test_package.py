"""The tf_mpi package loads its API lazily: same names as before, no TensorFlow for the launcher."""
import subprocess
import sys

import pytest

# Every public name `import tf_mpi` bound when the package imported its submodules
# eagerly (also what `from tf_mpi import *` exported then).
PREVIOUS_NAMES = {
    "Adasum", "Average", "Compression", "DistributedGradientTape", "Max", "Min",
    "PartialDistributedGradientTape", "Product", "Sum", "allgather", "allgather_object",
    "allreduce", "alltoall", "barrier", "basics", "broadcast", "broadcast_", "broadcast_object",
    "broadcast_object_fn", "broadcast_variables", "ccl_built", "compression", "cross_rank",
    "cross_size", "cuda_built", "data", "ddl_built", "functions", "gloo_built", "gradient_tape",
    "grouped_allgather", "grouped_allreduce", "grouped_broadcast", "grouped_reducescatter",
    "grouping", "init", "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
    "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "ops",
    "rank", "rank_op", "reducer", "reducescatter", "rocm_built", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline",
}
# Added since: for Horovod compatibility (issue 17; horovod.tensorflow has them too),
# and the GPU build queries.
ADDED_NAMES = {"broadcast_global_variables", "DistributedOptimizer", "SyncBatchNormalization", "elastic",
               "mpi_built_with_cuda_support", "gpu_transport"}


def _fresh(code):
    """Runs `code` in a new interpreter (this one may have TensorFlow loaded already)."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_launcher_does_not_import_tensorflow():
    _fresh("import sys, tf_mpi.run\n"
           "assert 'tensorflow' not in sys.modules, 'tf_mpi.run imported tensorflow'")


def test_previous_names_still_importable():
    import tf_mpi
    assert PREVIOUS_NAMES <= set(dir(tf_mpi))
    for name in sorted(PREVIOUS_NAMES):
        assert getattr(tf_mpi, name) is not None, name
    assert tf_mpi.__version__ == "0.1.0"
    assert tf_mpi.allreduce is tf_mpi.ops.allreduce and tf_mpi.Sum == tf_mpi.basics.Sum
    assert tf_mpi.basics._core is tf_mpi._core
    star = {}
    exec("from tf_mpi import *", star)
    assert set(star) - {"__builtins__"} == PREVIOUS_NAMES | ADDED_NAMES
    assert tf_mpi.SyncBatchNormalization is tf_mpi.keras.SyncBatchNormalization
    with pytest.raises(AttributeError):
        tf_mpi.no_such_name


def test_keras_package_reexports_everything():
    import tf_mpi.keras as hvd
    missing = PREVIOUS_NAMES - set(dir(hvd))
    assert not missing
    assert hvd.allreduce is hvd.ops.allreduce and callable(hvd.DistributedOptimizer)
