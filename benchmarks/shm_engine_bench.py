"""Shared-memory allreduce against the MPI path, numpy arrays through the engine (no TensorFlow ops).

Run (from the repository root; rank 0 prints)::

    mpirun -np 3 python benchmarks/shm_engine_bench.py [--rounds N]

For each size (float32, op=Sum) every round times, interleaved: the engine
over shared memory, the engine on the MPI path (the shared-memory path paused
with the _core.set_shm_paused hook, as TF_MPI_SHM=0 runs), one raw
MPI_Allreduce (mpi4py), and the memory bound (numpy add of 1/size of the data
plus a copy of the rest, on every rank at once). A sample is the slowest
rank's time; the table shows medians, [min-max] over rounds and ratios of
medians. Results are checked after every call.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import tf_mpi  # noqa: F401  (loads the engine)
from tf_mpi.basics import _core

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
comm = MPI.COMM_WORLD


def timed(fn, calls):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return comm.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    _core.init()
    n = comm.size
    if comm.rank == 0:
        print(f"ranks {n}; engine config: {_core.config()}", flush=True)
        print(f"{'size':>7} | {'shm':>20} | {'mpi path':>20} | {'raw':>20} | {'bound':>8} | "
              f"{'shm/mpi':>7} {'shm/raw':>7} {'shm x bound':>11}", flush=True)
    for nbytes in SIZES:
        count = nbytes // 4
        x = np.full(count, comm.rank + 1, np.float32)
        want = n * (n + 1) / 2
        raw_out = np.empty_like(x)
        share = max(1, count // n)
        a, b, c = np.ones(share, np.float32), np.ones(share, np.float32), np.empty(share, np.float32)
        src, dst = np.ones(max(1, count - share), np.float32), np.empty(max(1, count - share), np.float32)
        calls = max(1, int(2e6 // max(nbytes, 1)))  # ~2 MB moved per sample

        def engine():
            out = _core.allreduce(x, 1, f"bench.{nbytes}")  # 1 = Sum
            assert out[0] == want and out[-1] == want

        def engine_mpi():
            _core.set_shm_paused(True)
            try:
                engine()
            finally:
                _core.set_shm_paused(False)

        def raw():
            comm.Allreduce(x, raw_out, op=MPI.SUM)

        def bound():
            np.add(a, b, out=c)
            np.copyto(dst, src)

        fns = {"shm": engine, "mpi": engine_mpi, "raw": raw, "bound": bound}
        for fn in fns.values():
            fn()
        samples = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                samples[k].append(timed(fn, calls))
        med = {k: float(np.median(v)) for k, v in samples.items()}
        unit, scale = ("us", 1e6) if nbytes < MiB else ("ms", 1e3)

        def cell(k):
            return f"{med[k] * scale:.3g} [{min(samples[k]) * scale:.3g}-{max(samples[k]) * scale:.3g}] {unit}"
        if comm.rank == 0:
            label = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
            print(f"{label:>7} | {cell('shm'):>20} | {cell('mpi'):>20} | {cell('raw'):>20} | "
                  f"{med['bound'] * scale:.3g} {unit} | {med['shm'] / med['mpi']:6.2f}x {med['shm'] / med['raw']:6.2f}x "
                  f"{med['shm'] / med['bound']:10.1f}x", flush=True)
    if comm.rank == 0:
        print(f"shared-memory buckets on rank 0: {_core.stats()['shm_allreduces']}", flush=True)


if __name__ == "__main__":
    main()
