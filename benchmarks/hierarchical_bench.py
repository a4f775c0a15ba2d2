"""Flat against hierarchical allreduce, in one run, on pretend nodes.

Run (from the repository root; rank 0 prints)::

    TF_MPI_TOPOLOGY=2x2 python -m tf_mpi.run -np 4 python benchmarks/hierarchical_bench.py
    TF_MPI_TOPOLOGY=2x3 python -m tf_mpi.run -np 6 python benchmarks/hierarchical_bench.py

What it measures: float32 Sum allreduces of numpy arrays through the engine
(``tf_mpi._core.allreduce``, no TensorFlow) of 4 KiB to 16 MiB. A round
initialises the engine with ``TF_MPI_HIERARCHICAL=0``, times every size, shuts
it down, initialises it with ``TF_MPI_HIERARCHICAL=1`` and times every size
again; the order of the two alternates between rounds, so background load hits
both alike. A sample is K back-to-back calls (K calibrated once per size to
~20 ms, the same on every rank) after an engine barrier (a small allreduce),
divided by K; its time is the slowest rank's. Per size it prints the median
time of each path and the median and range over rounds of the ratio
hierarchical / flat (below 1: hierarchical faster), next to the ratio the
alpha-beta model behind ``TF_MPI_HIERARCHICAL=auto`` predicts with its links
(defaults unless ``TF_MPI_INTRA_NODE_LINK`` / ``TF_MPI_INTER_NODE_LINK`` are set).

What it cannot show: pretend nodes on one machine talk through shared memory,
like ranks of one node, so the "inter-node" stage costs what the intra-node one
does. The figures show the scheme's own overhead (three collectives instead of
one) where the network is as fast as memory, not what it gains across a real
network. Results are checked before timing.
"""
import argparse
import os
import platform
import statistics
import time

import numpy as np

from tf_mpi import basics
from tf_mpi.basics import _core

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]


def init(mode):
    if _core.is_initialized():
        _core.shutdown()
    os.environ["TF_MPI_HIERARCHICAL"] = mode
    basics.init()


_count = [0]


def allreduce(x, op=1):
    _count[0] += 1
    return _core.allreduce(x, op, f"bench.{_count[0]}")


def slowest(seconds):
    return float(allreduce(np.array([seconds]), op=3)[0])  # Max over ranks


def sample(x, k):
    allreduce(np.zeros(1, np.float32))  # start together
    t0 = time.perf_counter()
    for _ in range(k):
        allreduce(x)
    return slowest((time.perf_counter() - t0) / k)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    init("1")
    rank, size = _core.rank(), _core.size()
    nodes, per_node = _core.cross_size(), _core.local_size()
    assert _core.hierarchical()["usable"], "set TF_MPI_TOPOLOGY=NODESxRANKS with more than one node and rank per node"
    inputs = {b: np.full(b // 4, rank + 1, np.float32) for b in SIZES}
    want = size * (size + 1) / 2
    ks = {}
    for b, x in inputs.items():  # check, and calibrate K on the hierarchical path
        assert np.all(allreduce(x) == want)
        t = sample(x, 1)
        ks[b] = int(allreduce(np.array([max(1, min(200, int(0.02 / max(t, 1e-6))))], np.int64), op=3)[0])
    init("0")
    for b, x in inputs.items():
        assert np.all(allreduce(x) == want)
    times = {(m, b): [] for m in "01" for b in SIZES}
    for r in range(args.rounds):
        for mode in ("01" if r % 2 == 0 else "10"):
            init(mode)
            for b, x in inputs.items():
                times[(mode, b)].append(sample(x, ks[b]))
    if rank == 0:
        print(f"# hierarchical_bench: {nodes} pretend nodes x {per_node} ranks (TF_MPI_TOPOLOGY="
              f"{os.environ.get('TF_MPI_TOPOLOGY')}), {args.rounds} rounds, {os.cpu_count()} CPUs, "
              f"{platform.machine()}, {time.strftime('%Y-%m-%d')}")
        print(f"{'bytes':>10} {'K':>4} {'flat ms':>9} {'hier ms':>9} {'hier/flat median':>17} "
              f"{'(min-max)':>13} {'model hier/flat':>16}")
        for b in SIZES:
            flat, hier = times[("0", b)], times[("1", b)]
            ratios = sorted(h / f for h, f in zip(hier, flat))
            model = _core.hierarchical_model(b, nodes, per_node)
            print(f"{b:>10} {ks[b]:>4} {statistics.median(flat) * 1e3:>9.3f} {statistics.median(hier) * 1e3:>9.3f} "
                  f"{statistics.median(ratios):>17.2f} {f'({ratios[0]:.2f}-{ratios[-1]:.2f})':>13} "
                  f"{model['hierarchical_s'] / model['flat_s']:>16.2f}")
    _core.shutdown()


if __name__ == "__main__":
    main()
