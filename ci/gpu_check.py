"""The GPU path's check, run by ci/gpu_check.sh under mpirun on a machine with
an NVIDIA GPU, CuPy and no TensorFlow: CUDA arrays go through tf_mpi._core
(the engine, its CUDA part and the chosen GPU transport) and every result is
compared with a reference computed on the host with numpy.

Each check prints "PASS name" or "FAIL name: why" on every rank; the script
exits non-zero if any check failed on this rank. `--bench` instead times the
engine's device-to-device allreduce against the naive route (device -> numpy
-> MPI -> device, per tensor: what TensorFlow's host copies amount to).

Not runnable in CI (no GPU there): see docs/gpus.md for what is and is not
verified where.
"""
import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cupy as cp  # noqa: E402

# The pybind module alone: tf_mpi/__init__.py imports TensorFlow, which this
# machine need not have. A bare package object lets `tf_mpi._core` load.
import types  # noqa: E402
_pkg = types.ModuleType("tf_mpi")
_pkg.__path__ = [os.path.join(ROOT, "tf_mpi")]
sys.modules.setdefault("tf_mpi", _pkg)
from tf_mpi import _core  # noqa: E402

SUM, AVERAGE, MIN, MAX, PRODUCT = 1, 0, 2, 3, 4
FAILED = []


def check(fn):
    name = fn.__name__
    try:
        fn()
        print(f"PASS {name} (rank {RANK})", flush=True)
    except Exception as e:  # report every failure, keep going
        FAILED.append(name)
        print(f"FAIL {name} (rank {RANK}): {e!r}\n{traceback.format_exc()}", flush=True)
    return fn


def host(a):
    return cp.asnumpy(cp.asarray(a))


def rank_data(rank, shape, dtype, salt=0):
    """Deterministic per-rank data every rank can recompute for the reference."""
    rng = np.random.default_rng(1000 * rank + salt)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        lo, hi = max(info.min // 8, -100), min(info.max // 8, 100)
        return rng.integers(lo, hi, size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(dtype)


def reference_reduce(shape, dtype, op, salt=0, pre=1.0, post=1.0):
    parts = [rank_data(r, shape, dtype, salt) for r in range(SIZE)]
    if np.issubdtype(np.dtype(dtype), np.floating):
        # The engine scales in float (16/32-bit) or double, reduces in the
        # element type; compare with a tolerance.
        acc = np.float64
        parts = [p.astype(acc) * pre for p in parts]
    else:
        parts = [(p.astype(np.float64) * pre).astype(dtype) if pre != 1.0 else p for p in parts]
    if op in (SUM, AVERAGE):
        out = parts[0].copy()
        for p in parts[1:]:
            out = out + p
        if op == AVERAGE:
            post = post / SIZE
    elif op == MIN:
        out = np.minimum.reduce(parts)
    elif op == MAX:
        out = np.maximum.reduce(parts)
    else:
        out = parts[0].copy()
        for p in parts[1:]:
            out = out * p
    if np.issubdtype(np.dtype(dtype), np.floating):
        return (out * post).astype(dtype)
    if post != 1.0:
        return (out.astype(np.float64) * post).astype(dtype)
    return out.astype(dtype)


def assert_close(got, want, dtype, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if np.issubdtype(np.dtype(dtype), np.floating):
        tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[np.dtype(dtype).type]
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol * 4)
        assert ok, f"{what}: max abs diff {np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))}"
    else:
        assert np.array_equal(got, want), f"{what}: {np.count_nonzero(got != want)} elements differ"


def same_on_all_ranks(arr, what):
    """Results must be identical (bitwise) on every rank."""
    digest = np.frombuffer(np.ascontiguousarray(arr).tobytes(), np.uint8).astype(np.int64).sum()
    gathered = _core.allgather(np.array([digest], np.int64), name=f"digest.{what}")
    assert len(set(gathered.tolist())) == 1, f"{what}: results differ between ranks {gathered.tolist()}"


REDUCE_DTYPES = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64, np.float16, np.float32, np.float64]
MOVE_DTYPES = REDUCE_DTYPES + [np.bool_]


def run_checks(transport_expected, chunk_bytes):
    @check
    def transport_is_the_expected_one():
        t = _core.gpu_transport()
        print(f"rank {RANK}: gpu_transport = {json.dumps(t)}", flush=True)
        assert _core.cuda_built(), "libtfmpi_cuda.so is missing"
        assert t["transport"] == transport_expected, t

    @check
    def allreduce_every_dtype_and_op_unfused():
        for dtype in REDUCE_DTYPES:
            for op in (SUM, AVERAGE, MIN, MAX, PRODUCT):
                if op == PRODUCT and np.dtype(dtype).itemsize < 4 and np.issubdtype(dtype, np.integer):
                    continue  # products of 2-4 ranks of +-100 overflow small ints: compare where defined
                shape = (37, 3)
                x = cp.asarray(rank_data(RANK, shape, dtype, salt=op))
                out = _core.allreduce(x, op, f"ar.{np.dtype(dtype).name}.{op}")
                assert isinstance(out, _core.DeviceArray), type(out)
                got = host(out)
                assert_close(got, reference_reduce(shape, dtype, op, salt=op), dtype,
                              f"allreduce {np.dtype(dtype).name} op {op}")
                same_on_all_ranks(got, f"ar.{np.dtype(dtype).name}.{op}")

    @check
    def grouped_allreduce_is_fused_on_the_device_with_scaling():
        before = _core.stats()
        shapes = [(5,), (1000, 3), (7, 7, 2), (1,), (3 << 20,)]  # the last: 12 MiB of float32, > one chunk
        for dtype in (np.float32, np.float16, np.int32, np.float64):
            xs = [cp.asarray(rank_data(RANK, s, dtype, salt=i)) for i, s in enumerate(shapes)]
            pre, post = (0.5, 3.0) if np.issubdtype(dtype, np.floating) else (1.0, 1.0)
            outs = _core.grouped_allreduce(xs, AVERAGE, f"group.{np.dtype(dtype).name}", pre, post)
            for i, (s, o) in enumerate(zip(shapes, outs)):
                want = reference_reduce(s, dtype, AVERAGE, salt=i, pre=pre, post=post)
                assert_close(host(o), want, dtype, f"grouped {np.dtype(dtype).name} tensor {i}")
        after = _core.stats()
        buckets = after["allreduce_buckets"] - before["allreduce_buckets"]
        # 4 groups of 5 tensors, each group below the 64 MiB threshold: one bucket per group.
        assert buckets == 4, f"expected 4 fused buckets, got {buckets}"

    @check
    def large_tensor_crosses_many_pipeline_chunks():
        n = (64 << 20) // 4 + 12345  # 64 MiB of float32 plus an uneven tail
        x = cp.asarray(rank_data(RANK, (n,), np.float32, salt=7))
        before = _core.stats()
        out = host(_core.allreduce(x, SUM, "big"))
        assert_close(out, reference_reduce((n,), np.float32, SUM, salt=7), np.float32, "64 MiB allreduce")
        moved = _core.stats()["gpu_staged_bytes"] - before["gpu_staged_bytes"]
        if transport_expected == "staged":
            assert moved == 2 * n * 4, f"staged bytes {moved} != {2 * n * 4}"
            assert n * 4 > 4 * chunk_bytes

    @check
    def int_sums_are_bit_identical_to_the_host_path():
        x = rank_data(RANK, (4099,), np.int64, salt=11)
        on_gpu = host(_core.allreduce(cp.asarray(x), SUM, "exact.gpu"))
        on_host = _core.allreduce(x, SUM, "exact.host")
        assert np.array_equal(on_gpu, on_host)

    @check
    def producer_stream_is_honoured():
        # The input is written by a long kernel chain on a non-default stream;
        # the engine must wait for it (ready event), not read stale memory.
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            x = cp.zeros((1 << 22,), cp.float32)
            for _ in range(50):
                x += 1.0
            x *= (RANK + 1)
            out = _core.allreduce(x, SUM, "stream")
        got = host(out)
        want = 50.0 * sum(r + 1 for r in range(SIZE))
        assert np.all(got == want), f"min {got.min()} max {got.max()} want {want}"

    @check
    def broadcast_every_dtype():
        for dtype in MOVE_DTYPES:
            for root in sorted({0, SIZE - 1}):
                shape = (33, 5)
                x = cp.asarray(rank_data(RANK, shape, dtype, salt=root))
                got = host(_core.broadcast(x, root, f"bc.{np.dtype(dtype).name}.{root}"))
                assert_close(got, rank_data(root, shape, dtype, salt=root), dtype,
                              f"broadcast {np.dtype(dtype).name} root {root}")

    @check
    def allgather_every_dtype_uneven_rows():
        for dtype in MOVE_DTYPES:
            rows = RANK + 2
            x = cp.asarray(rank_data(RANK, (rows, 3), dtype, salt=5))
            got = host(_core.allgather(x, f"ag.{np.dtype(dtype).name}"))
            want = np.concatenate([rank_data(r, (r + 2, 3), dtype, salt=5) for r in range(SIZE)])
            assert_close(got, want, dtype, f"allgather {np.dtype(dtype).name}")

    @check
    def reducescatter_with_scaling_uneven_rows():
        for dtype in (np.float32, np.int32, np.float16):
            rows = 2 * SIZE + 1
            pre, post = (2.0, 0.25) if np.issubdtype(dtype, np.floating) else (1.0, 1.0)
            x = cp.asarray(rank_data(RANK, (rows, 4), dtype, salt=9))
            got = host(_core.reducescatter(x, SUM, f"rs.{np.dtype(dtype).name}", pre, post))
            full = reference_reduce((rows, 4), dtype, SUM, salt=9, pre=pre, post=post)
            q, rem = divmod(rows, SIZE)
            start = RANK * q + min(RANK, rem)
            assert_close(got, full[start:start + q + (RANK < rem)], dtype, f"reducescatter {np.dtype(dtype).name}")

    @check
    def cpu_and_gpu_disagreement_is_an_error_on_every_rank():
        x = np.ones(8, np.float32)
        arg = cp.asarray(x) if RANK == 0 else x
        try:
            _core.allreduce(arg, SUM, "mixed.devices")
        except Exception as e:
            assert "device" in str(e), str(e)
        else:
            raise AssertionError("no error although rank 0 used a GPU tensor and the others host tensors")

    @check
    def host_path_still_works_beside_the_gpu_path():
        x = rank_data(RANK, (1000,), np.float32, salt=3)
        assert_close(_core.allreduce(x, SUM, "host.after.gpu"), reference_reduce((1000,), np.float32, SUM, salt=3),
                     np.float32, "host allreduce")


def bench(reps, naive_with_mpi4py):
    """Device-to-device allreduce: the engine (fusion and scaling on the GPU,
    one staged or direct round trip per bucket) against the naive route, per
    tensor: device -> numpy (pageable, synchronous) -> MPI -> device. The naive
    route's MPI step is tf_mpi's own host allreduce (what TensorFlow's host
    copies around our CPU kernel amount to) or, with --mpi4py, a raw
    MPI_Allreduce by hand."""
    with open(os.path.join(ROOT, "benchmarks", "data", "resnet50_grad_shapes.json")) as f:
        shapes = [tuple(s) for s in json.load(f)["shapes"]]
    cases = {"64 MiB": [((64 << 20) // 4,)], f"ResNet-50 storm ({len(shapes)} tensors)": shapes}
    if naive_with_mpi4py:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD

        def host_allreduce(h, name):
            comm.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM)
            return h
    else:
        def host_allreduce(h, name):
            return _core.allreduce(h, SUM, name)

    def barrier():
        _core.allreduce(np.zeros(1, np.float32), SUM, "bench.barrier")

    if RANK == 0:
        print(f"transport {json.dumps(_core.gpu_transport())}; naive MPI step: "
              f"{'mpi4py MPI_Allreduce' if naive_with_mpi4py else 'tf_mpi host allreduce'}", flush=True)
    results = {}
    for label, case in cases.items():
        xs = [cp.asarray(rank_data(RANK, s, np.float32, salt=i)) for i, s in enumerate(case)]
        nbytes = sum(x.nbytes for x in xs)

        def engine():
            if len(xs) == 1:
                return [_core.allreduce(xs[0], SUM, "bench.one")]
            return _core.grouped_allreduce(xs, SUM, "bench.group")

        def naive():
            outs = []
            for i, x in enumerate(xs):
                h = cp.asnumpy(x)
                outs.append(cp.asarray(host_allreduce(h, f"bench.naive.{i}")))
            cp.cuda.get_current_stream().synchronize()
            return outs

        # Same answers first, then interleaved timing rounds.
        for a, b in zip(engine(), naive()):
            np.testing.assert_allclose(host(a), host(b), rtol=1e-5, atol=1e-4)
        times = {"engine": [], "naive": []}
        for _ in range(reps):
            for name, fn in (("engine", engine), ("naive", naive)):
                barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) for k, v in times.items()}
        spread = {k: (float(np.min(v)), float(np.max(v))) for k, v in times.items()}
        results[label] = {"bytes": nbytes, "median_s": med, "min_max_s": spread, "ratio": med["engine"] / med["naive"]}
        if RANK == 0:
            print(f"BENCH {label}: {nbytes / 2**20:.1f} MiB, np={SIZE}, engine {med['engine'] * 1e3:.2f} ms "
                  f"[{spread['engine'][0] * 1e3:.2f}-{spread['engine'][1] * 1e3:.2f}], naive {med['naive'] * 1e3:.2f} ms "
                  f"[{spread['naive'][0] * 1e3:.2f}-{spread['naive'][1] * 1e3:.2f}], ratio {med['engine'] / med['naive']:.3f} "
                  f"(target <= 0.7), median of {reps} interleaved rounds", flush=True)
    if RANK == 0 and os.environ.get("OUT"):
        tag = "mpi4py" if naive_with_mpi4py else "engine"
        with open(os.path.join(os.environ["OUT"], f"gpu_bench_np{SIZE}_{tag}.json"), "w") as f:
            json.dump({"np": SIZE, "naive_mpi": tag, "transport": _core.gpu_transport(), "results": results}, f, indent=1)


def main():
    global RANK, SIZE
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="staged")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--mpi4py", action="store_true", help="naive route's MPI step through mpi4py (--bench)")
    p.add_argument("--managed", action="store_true",
                   help="CuPy allocates managed memory: lets an MPI without CUDA support run the direct transport")
    args = p.parse_args()
    if args.managed:
        cp.cuda.set_allocator(cp.cuda.MemoryPool(cp.cuda.malloc_managed).malloc)
    if args.mpi4py:
        from mpi4py import MPI  # noqa: F401  (MPI started by mpi4py; the engine adopts it)
    _core.init()
    RANK, SIZE = _core.rank(), _core.size()
    # One GPU shared by every rank here; on a real cluster: local_rank().
    cp.cuda.Device(0).use()
    if args.bench:
        bench(args.reps, args.mpi4py)
    else:
        run_checks(args.transport, int(os.environ.get("TF_MPI_GPU_CHUNK_BYTES", 4 << 20)))
        print(f"rank {RANK}: stats {json.dumps(_core.stats())}", flush=True)
    _core.shutdown()
    if FAILED:
        print(f"rank {RANK}: {len(FAILED)} check(s) failed: {FAILED}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    RANK, SIZE = 0, 1
    main()
