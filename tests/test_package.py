"""The tf_mpi package: its public API (``__all__``, docstrings), internals that stay importable,
and the lazy loading that keeps TensorFlow out of the launcher."""
import importlib
import inspect
import subprocess
import sys
import types

import pytest

# The public API, as the tf_mpi package docstring lists it: what horovod.tensorflow offers
# and tf_mpi implements (docs/horovod_compatibility.md), then tf_mpi's additions.
HOROVOD_NAMES = {
    "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ccl_built", "ddl_built", "rocm_built", "cuda_built", "sycl_built",
    "gpu_available", "start_timeline", "stop_timeline", "join", "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    "Compression",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "alltoall", "reducescatter", "grouped_reducescatter", "rank_op", "size_op", "local_rank_op",
    "local_size_op", "process_set_included_op",
    "broadcast_variables", "broadcast_", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "broadcast_global_variables",
    "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
    "SyncBatchNormalization", "elastic",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
}
TF_MPI_ADDITIONS = {"grouped_broadcast", "barrier", "mpi_built_with_cuda_support", "gpu_transport", "data",
                    "grouping"}
PUBLIC_API = HOROVOD_NAMES | TF_MPI_ADDITIONS
# Implementation modules: importable, reachable as attributes, never exported.
INTERNALS = {"basics", "functions", "gradient_tape", "ops", "_core"}
# Modules of the public API whose public functions and classes are documented with an example too.
API_MODULES = ["tf_mpi.data", "tf_mpi.policy.grouping", "tf_mpi.elastic", "tf_mpi.keras.callbacks",
               "tf_mpi.keras.elastic", "tf_mpi.keras.schedules"]


def _fresh(code):
    """Runs `code` in a new interpreter (this one may have TensorFlow loaded already)."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _has_example(obj):
    doc = inspect.getdoc(obj) or ""
    return "Example" in doc


def test_launcher_does_not_import_tensorflow():
    _fresh("import sys, tf_mpi.run\n"
           "assert 'tensorflow' not in sys.modules, 'tf_mpi.run imported tensorflow'")


def test_all_is_exactly_the_documented_public_api():
    import tf_mpi
    assert len(tf_mpi.__all__) == len(set(tf_mpi.__all__)) == len(PUBLIC_API)
    assert set(tf_mpi.__all__) == PUBLIC_API
    assert not INTERNALS & set(tf_mpi.__all__)
    # The package docstring lists every name of the API.
    listed = {name for name in PUBLIC_API if f"``{name}``" in tf_mpi.__doc__}
    assert listed == PUBLIC_API, sorted(PUBLIC_API - listed)
    star = {}
    exec("from tf_mpi import *", star)
    assert set(star) - {"__builtins__"} == PUBLIC_API


def test_every_public_name_has_a_docstring_with_an_example():
    import tf_mpi
    missing = [name for name in tf_mpi.__all__ if not _has_example(getattr(tf_mpi, name))]
    assert not missing, missing
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module_name:
                assert _has_example(obj), f"{module_name}.{name}"


def test_reduce_ops_are_documented_ints():
    import tf_mpi
    from tf_mpi.basics import ReduceOp
    for name in ("Average", "Sum", "Min", "Max", "Product", "Adasum"):
        op = getattr(tf_mpi, name)
        assert isinstance(op, int) and op is ReduceOp[name] and inspect.getdoc(op) == inspect.getdoc(ReduceOp)
    assert (tf_mpi.Average, tf_mpi.Sum) == (0, 1)


def test_built_queries_answer_for_this_build():
    import tf_mpi
    assert tf_mpi.mpi_built() is True and tf_mpi.mpi_enabled() is True
    for query in ("gloo_built", "ccl_built", "ddl_built", "rocm_built", "sycl_built"):
        assert getattr(tf_mpi, query)() is False, query
    assert type(tf_mpi.nccl_built()) is int and tf_mpi.nccl_built() == 0  # Horovod: NCCL's version code or 0
    assert isinstance(tf_mpi.cuda_built(), bool)


def test_internals_stay_importable():
    import tf_mpi
    for name in INTERNALS:
        assert isinstance(getattr(tf_mpi, name), types.ModuleType), name
        assert name in dir(tf_mpi)
    assert tf_mpi.__version__ == "0.1.0"
    assert tf_mpi.allreduce is tf_mpi.ops.allreduce and tf_mpi.Sum == tf_mpi.basics.Sum
    assert tf_mpi.basics._core is tf_mpi._core
    assert tf_mpi.gradient_tape.DistributedGradientTape is tf_mpi.DistributedGradientTape
    assert tf_mpi.Compression is importlib.import_module("tf_mpi.policy.compression").Compression
    assert tf_mpi.SyncBatchNormalization is tf_mpi.keras.SyncBatchNormalization
    with pytest.raises(AttributeError):
        tf_mpi.no_such_name


# Public module paths whose code lives in a subpackage (tf_mpi/README.md), and the tools run as
# ``python -m tf_mpi.<tool>``.
PUBLIC_PATHS = {"tf_mpi.grouping": "tf_mpi.policy.grouping", "tf_mpi.predict": "tf_mpi.tools.predict",
                "tf_mpi.timeline_analysis": "tf_mpi.tools.timeline_analysis",
                "tf_mpi.timeline_plot": "tf_mpi.tools.timeline_plot"}


def test_public_paths_are_the_modules_where_the_code_lives():
    import tf_mpi
    for path, home in PUBLIC_PATHS.items():
        assert importlib.import_module(path) is importlib.import_module(home), path
    assert tf_mpi.grouping is importlib.import_module("tf_mpi.policy.grouping")
    from tf_mpi.grouping import make_plan
    assert make_plan is tf_mpi.grouping.make_plan
    for tool, args, rc in (("predict", ["--help"], 0), ("timeline_plot", ["--help"], 0), ("timeline_analysis", [], 2),
                             ("timeline_analysis", ["--help"], 0)):
        run = subprocess.run([sys.executable, "-m", f"tf_mpi.{tool}", *args], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == rc and f"usage: python -m tf_mpi.{tool}" in run.stdout + run.stderr, (tool, run)


def test_keras_package_exports_the_api_and_its_keras_names():
    import tf_mpi
    import tf_mpi.keras as hvd
    assert set(hvd.__all__) == PUBLIC_API | {"callbacks", "load_model", "PartialDistributedOptimizer"}
    star = {}
    exec("from tf_mpi.keras import *", star)
    assert set(star) - {"__builtins__"} == set(hvd.__all__)
    # Horovod's Keras module has its own allreduce (name second, values in, tensor out).
    assert hvd.allreduce is not tf_mpi.allreduce and hvd.grouped_allreduce is tf_mpi.grouped_allreduce
    assert callable(hvd.DistributedOptimizer)
    assert hvd.elastic is importlib.import_module("tf_mpi.keras.elastic")  # not tf_mpi.elastic
    assert hvd.grouping is tf_mpi.grouping and hvd.data is tf_mpi.data
    assert _has_example(hvd) and _has_example(hvd.callbacks) and _has_example(hvd.load_model)


def test_autograph_calls_tf_mpi_code_as_it_is_and_still_converts_the_users():
    """Inside a user's tf.function, AutoGraph leaves tf_mpi's functions and methods alone (as
    TensorFlow's and Keras' own: no parsing and rewriting of the reducer, the codecs and the
    sparse handling at each trace) and still converts the user's code."""
    import tensorflow as tf
    import tf_mpi
    from tensorflow.python.autograph.impl import conversion  # what AutoGraph itself consults
    from tf_mpi.keras.optimizer import DistributedOptimizer as KerasDistributedOptimizer
    from tf_mpi.policy import reducer, sparse, topk_compression
    for entity in (tf_mpi.allreduce, tf_mpi.grouped_allreduce, tf_mpi.allgather, tf_mpi.broadcast,
                   tf_mpi.alltoall, tf_mpi.reducescatter, tf_mpi.broadcast_variables,
                   tf_mpi.DistributedGradientTape.gradient, reducer.GradientReducer,
                   tf_mpi.Compression.fp16.compress, KerasDistributedOptimizer,
                   *[f for m in (reducer, sparse, topk_compression) for f in vars(m).values()
                     if inspect.isfunction(f) and f.__module__ == m.__name__]):
        assert conversion.is_allowlisted(entity), entity

    def users_own(x):  # a Python `if` on a tensor: only runs inside tf.function if AutoGraph converts it
        if tf.reduce_sum(x) > 0:
            return x * 2.0
        return -x

    assert not conversion.is_allowlisted(users_own)
    assert tf.function(users_own)(tf.constant([1.0, 2.0])).numpy().tolist() == [2.0, 4.0]
    assert tf.function(users_own)(tf.constant([-1.0])).numpy().tolist() == [1.0]
