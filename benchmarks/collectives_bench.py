"""Broadcast and allgather: tf_mpi's TensorFlow ops against raw MPI and a memory copy.

Run (from the repository root; rank 0 prints)::

    python -m tf_mpi.run -np 2 python benchmarks/collectives_bench.py [--repeats 15] [--json out.json]

For each size (float32 rows of 1 KiB; the size is what each rank contributes)
every round times, interleaved: ``hvd.broadcast`` (root 0) and
``hvd.allgather`` inside a ``tf.function``; ``MPI.COMM_WORLD.Bcast`` and
``Allgather`` (mpi4py) on numpy buffers of the same sizes; and a numpy copy of
the same number of bytes on every rank at once (the memory bound of one copy).
A sample is K back-to-back calls (K calibrated to ~20 ms, the same on every
rank) after a barrier, divided by K; its time is the slowest rank's. Results
are checked before timing. It prints medians with [min-max] over rounds, the
ratios ours / raw, and raw against the memory bound: one copy for a
broadcast, `size` copies for an allgather (each rank writes `size` blocks, at
least one copy each). A raw MPI time near its bound leaves nothing for a
broadcast or allgather through shared memory to gain on this machine.
Rounds, samples and the JSON record: benchmarks/harness.py.
"""
import argparse
import os
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

from mpi4py import MPI  # noqa: E402

import tf_mpi as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
ROW = 256  # float32 per row: 1 KiB
comm = MPI.COMM_WORLD


def slowest_rank(seconds):
    return comm.allreduce(seconds, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None, help="write the medians and spreads to this file (rank 0)")
    args = parser.parse_args()
    record = harness.Record("collectives_bench", path=args.json) if comm.rank == 0 else None
    table = []
    hvd.init()
    size, rank = comm.size, comm.rank
    if rank == 0:
        print(f"collectives benchmark: {size} ranks, float32, op times per call (median [min-max] over "
              f"{args.repeats} rounds)")
        print(f"{'bytes/rank':>10} | {'broadcast':>22} {'raw Bcast':>22} | {'allgather':>22} {'raw Allgather':>22} | "
              f"{'copy':>9} | bcast/raw ag/raw | raw bcast/bound raw ag/bound")
    for nbytes in SIZES:
        rows = nbytes // (ROW * 4)
        mine = tf.fill([rows, ROW], float(rank + 1))

        @tf.function
        def broadcast(x, nbytes=nbytes):
            return hvd.broadcast(x, 0, name=f"bench.bcast.{nbytes}")

        @tf.function
        def allgather(x, nbytes=nbytes):
            return hvd.allgather(x, name=f"bench.allgather.{nbytes}")

        src = np.full(rows * ROW, rank + 1, np.float32)
        gathered = np.empty(rows * ROW * size, np.float32)
        copy_from, copy_to = np.ones(rows * ROW, np.float32), np.empty(rows * ROW, np.float32)
        fns = {"bcast": lambda: broadcast(mine), "raw_bcast": lambda: comm.Bcast(src, root=0),
               "allgather": lambda: allgather(mine), "raw_allgather": lambda: comm.Allgather(src, gathered),
               "copy": lambda: np.copyto(copy_to, copy_from)}
        # Correct before timed: every rank holds rank 0's rows, and every rank's rows in rank order.
        ok = np.all(broadcast(mine).numpy() == 1.0)
        got = allgather(mine).numpy()
        ok = ok and all(np.all(got[r * rows:(r + 1) * rows] == r + 1) for r in range(size))
        if not comm.allreduce(bool(ok), op=MPI.LAND):
            if rank == 0:
                print("BENCHMARK ABORTED: wrong broadcast or allgather result")
            raise SystemExit(2)
        k = {name: harness.calls_per_sample(fn, comm, trials=1) for name, fn in fns.items()}
        samples = harness.interleave(
            {name: (lambda name=name: harness.timed_sample(fns[name], k[name], comm.Barrier, slowest_rank))
             for name in fns}, args.repeats)
        stats = {name: harness.summarize(s) for name, s in samples.items()}
        table.append(dict(bytes_per_rank=nbytes, calls_per_sample=k, seconds=stats))
        if rank == 0:
            def cell(name):
                med, lo, hi = (stats[name][key] * 1e3 for key in ("median", "min", "max"))
                return f"{med:.3f} [{lo:.3f}-{hi:.3f}] ms"
            m = {name: v["median"] for name, v in stats.items()}
            print(f"{nbytes // KiB:>7} KiB | {cell('bcast'):>22} {cell('raw_bcast'):>22} | {cell('allgather'):>22} "
                  f"{cell('raw_allgather'):>22} | {m['copy'] * 1e3:6.3f} ms | {m['bcast'] / m['raw_bcast']:9.2f} "
                  f"{m['allgather'] / m['raw_allgather']:6.2f} | {m['raw_bcast'] / m['copy']:15.2f} "
                  f"{m['raw_allgather'] / (size * m['copy']):12.2f}")
    if record and args.json:
        print(f"wrote {record.write(ranks=size, repeats=args.repeats, rows=table)}")


if __name__ == "__main__":
    main()
