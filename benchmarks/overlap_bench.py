"""How much an allreduce slows the computation running beside it on the same core, and back.

    python benchmarks/overlap_bench.py                 # driver: one launch, prints a table
    python -m tf_mpi.run -np 2 python benchmarks/overlap_bench.py --worker   # one launch

In data-parallel training a rank reduces gradient groups while its backprop
still computes, usually on the same core(s). Each rank here runs a compute
thread (single-threaded float32 matmuls in numpy, which releases the GIL)
and, at the same time, a loop of allreduces of one size through tf_mpi's
engine. Per size it prints:

- compute: the compute thread's speed beside the allreduces, as a share of
  its speed alone (1.00 = the allreduces cost it nothing);
- allreduce: the time per allreduce beside the compute, and alone, and raw
  ``MPI_Allreduce`` (mpi4py) alone, measured in the same launch.

Open MPI busy-polls inside every call while it waits for the peers; the
figures show what that costs a computation sharing the core. Ranks are bound
one per core, as mpirun does by default with 2 ranks on 2 cores.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

SIZES = [4 << 10, 256 << 10, 1 << 20, 8 << 20]


class ComputeThread:
    """Multiplies 256x256 float32 matrices until stopped; counts them."""

    def __init__(self):
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
        while not self._stop.is_set():
            np.matmul(a, a)
            self.count += 1

    def __enter__(self):
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.rate = self.count / (time.perf_counter() - self.start)


def time_allreduces(fn, seconds, comm):
    """Median seconds per call of the collective fn() over about `seconds`.

    Every rank must make the same number of calls, so rank 0 picks it from
    five trial calls and broadcasts it.
    """
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    calls = comm.bcast(max(5, int(seconds / max(np.median(samples), 1e-6))), root=0)
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples[5:]))


def worker(args):
    from mpi4py import MPI

    from tf_mpi.basics import _core, Sum, init, rank
    init()
    comm = MPI.COMM_WORLD
    comm.Barrier()
    with ComputeThread() as alone:
        time.sleep(args.seconds)
    results = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(x)

        def ours():
            _core.allreduce(x, Sum, f"overlap.{nbytes}")

        def raw():
            comm.Allreduce(x, out, op=MPI.SUM)

        ours()
        comm.Barrier()
        ours_alone = time_allreduces(ours, args.seconds / 2, comm)
        comm.Barrier()
        raw_alone = time_allreduces(raw, args.seconds / 2, comm)
        comm.Barrier()
        with ComputeThread() as beside:
            ours_beside = time_allreduces(ours, args.seconds, comm)
        comm.Barrier()
        results.append({"bytes": nbytes, "compute_share": beside.rate / alone.rate,
                        "allreduce_beside_us": ours_beside * 1e6, "allreduce_alone_us": ours_alone * 1e6,
                        "raw_alone_us": raw_alone * 1e6})
    if rank() == 0:
        print("RESULT " + json.dumps({"config": _core.config(), "results": results}), flush=True)


def driver(args):
    print("| bytes | compute speed beside allreduces | allreduce beside compute | "
          "allreduce alone | raw MPI_Allreduce alone |")
    print("|---|---|---|---|---|")
    cmd = [sys.executable, "-m", "tf_mpi.run", "-np", "2", sys.executable, os.path.abspath(__file__),
           "--worker", "--seconds", str(args.seconds)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"launch failed:\n{out.stdout}\n{out.stderr}")
    for r in json.loads(line[len("RESULT "):])["results"]:
        print(f"| {r['bytes']} | {r['compute_share']:.2f} | {r['allreduce_beside_us']:.0f} us | "
              f"{r['allreduce_alone_us']:.0f} us | {r['raw_alone_us']:.0f} us |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help="one launch (run under mpirun)")
    p.add_argument("--seconds", type=float, default=2.0, help="length of each timed phase")
    args = p.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
