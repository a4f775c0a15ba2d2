"""The engine's failure handling on GPU memory (run after ci/gpu_check.sh, which builds
the module; needs an NVIDIA GPU and CuPy, no TensorFlow):

    TF_MPI_CHUNK_BYTES=65536 mpirun -np 2 python ci/gpu_hardening_check.py
    TF_MPI_CHUNK_BYTES=65536 TF_MPI_CUDA_AWARE=1 mpirun -np 2 python ci/gpu_hardening_check.py --managed

  - reducescatter cut into MPI_Reduce calls of at most TF_MPI_CHUNK_BYTES
    (small here, so every block takes several) on device arrays, through the
    transport in use (staged, or direct on managed memory);
  - an allgather past MPI's int counts (a 2 GiB row of device memory) fails on
    every rank before any MPI call, and the GPU path goes on;
  - GPU requests from several threads at once, with completions run outside the
    engine's locks (stats: callbacks_under_lock stays 0).
Prints PASS/FAIL per check; exits non-zero if one failed on this rank.
"""
import argparse
import os
import sys
import threading
import traceback
import types

import numpy as np
import cupy as cp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_pkg = types.ModuleType("tf_mpi")
_pkg.__path__ = [os.path.join(ROOT, "tf_mpi")]
sys.modules.setdefault("tf_mpi", _pkg)
from tf_mpi import _core  # noqa: E402

SUM, AVERAGE = 1, 0
parser = argparse.ArgumentParser()
parser.add_argument("--managed", action="store_true", help="CUDA managed memory (for the forced direct transport)")
ARGS = parser.parse_args()
if ARGS.managed:
    cp.cuda.set_allocator(cp.cuda.MemoryPool(cp.cuda.malloc_managed).malloc)
_core.init()
RANK, SIZE = _core.rank(), _core.size()
cp.cuda.Device(_core.local_rank() % cp.cuda.runtime.getDeviceCount()).use()
FAILED = []


def check(fn):
    try:
        fn()
        print(f"PASS {fn.__name__} (rank {RANK}, {_core.gpu_transport()['transport']})", flush=True)
    except Exception as e:
        FAILED.append(fn.__name__)
        print(f"FAIL {fn.__name__} (rank {RANK}): {e!r}\n{traceback.format_exc()}", flush=True)
    return fn


def data(rank, shape, dtype):
    rng = np.random.default_rng(rank + 7)
    return rng.integers(-50, 50, size=shape).astype(dtype)


@check
def reducescatter_in_chunks_on_device_memory():
    chunk = int(os.environ.get("TF_MPI_CHUNK_BYTES", 1 << 20))
    for dtype in (np.float32, np.int32, np.float16, np.float64):
        rows, cols = 1001, 257
        assert rows * cols * np.dtype(dtype).itemsize // SIZE > 2 * chunk, "blocks must take several MPI calls"
        x = cp.asarray(data(RANK, (rows, cols), dtype))
        got = cp.asnumpy(cp.asarray(_core.reducescatter(x, SUM, f"rs.chunks.{np.dtype(dtype).name}")))
        full = sum(data(r, (rows, cols), dtype).astype(np.float64) for r in range(SIZE))
        counts = [rows // SIZE + (1 if q < rows % SIZE else 0) for q in range(SIZE)]
        start = sum(counts[:RANK])
        want = full[start:start + counts[RANK]]
        tol = 0.5 if dtype == np.float16 else 0
        assert got.shape == want.shape and np.allclose(got.astype(np.float64), want, atol=tol, rtol=0), dtype


@check
def allgather_past_int_counts_fails_everywhere_and_the_gpu_path_goes_on():
    big = cp.zeros((1, 2**31 + 1), cp.int8)  # one 2 GiB row
    try:
        _core.allgather(big, "ag.too.long")
        raise AssertionError("no error")
    except ValueError as e:
        assert "2^31-1 bytes" in str(e), str(e)
    del big
    y = cp.asnumpy(cp.asarray(_core.allgather(cp.full((2, 3), RANK, cp.float32), "ag.after")))
    assert y.shape == (2 * SIZE, 3) and np.all(y[::2, 0] == np.arange(SIZE)), y


@check
def gpu_requests_from_threads_complete_outside_engine_locks():
    errors = []

    def loop(t):
        try:
            for i in range(100):
                x = cp.full(1000 * (t + 1), RANK + 1, cp.float32)
                y = cp.asnumpy(cp.asarray(_core.allreduce(x, SUM, f"thr.{t}.{i}")))
                assert np.all(y == SIZE * (SIZE + 1) / 2), (t, i)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    s = _core.stats()
    assert s["callbacks_under_lock"] == 0 and s["gpu_requests"] >= 300, s


_core.shutdown()
sys.exit(1 if FAILED else 0)
