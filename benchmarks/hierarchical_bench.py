"""Flat against hierarchical allreduce, in one run, on pretend nodes.

Run (from the repository root; rank 0 prints)::

    TF_MPI_TOPOLOGY=2x2 python -m tf_mpi.run -np 4 python benchmarks/hierarchical_bench.py
    TF_MPI_TOPOLOGY=2x3 python -m tf_mpi.run -np 6 python benchmarks/hierarchical_bench.py

Across real (or pretend, tests/cluster.py) hosts no TF_MPI_TOPOLOGY is needed;
benchmarks/hierarchical_cluster_bench.py runs it on pretend hosts at several
link rates.

What it measures: float32 Sum allreduces of numpy arrays through the engine
(``tf_mpi._core.allreduce``, no TensorFlow) of 4 KiB to 16 MiB. A round
initialises the engine with ``TF_MPI_HIERARCHICAL=0``, times every size, shuts
it down, and does the same with ``TF_MPI_HIERARCHICAL=1`` and ``auto``; the
order of the three rotates between rounds, so background load hits all alike. A sample is K back-to-back calls (K calibrated once per size to
~150 ms, the same on every rank) after an engine barrier (a small allreduce),
divided by K; its time is the slowest rank's. Per size it prints the median
time of each path and the median and range over rounds of the ratio
hierarchical / flat (below 1: hierarchical faster), next to the times and ratio
the alpha-beta model behind ``TF_MPI_HIERARCHICAL=auto`` predicts with the
engine's links (``tf_mpi._core.hierarchical()``: TF_MPI_INTRA_NODE_LINK /
TF_MPI_INTER_NODE_LINK, else the start-up probe's or the defaults; the median
over the auto rounds, each of which probed anew across hosts), and auto's
median over the better of flat and hierarchical (target: at most 1.1).
Across real hosts each auto round also records ``tf_mpi.predict.measure_engine_seconds()``:
with the round's start-up timings, what ``python -m tf_mpi.predict --measure`` calibrates on.
``--json PATH`` writes all samples (with the machine, through benchmarks/harness.py, whose
rotation of rounds and timed samples this script uses).

What it cannot show with TF_MPI_TOPOLOGY: pretend nodes on one machine talk through shared memory,
like ranks of one node, so the "inter-node" stage costs what the intra-node one
does. The figures show the scheme's own overhead (three collectives instead of
one) where the network is as fast as memory, not what it gains across a real
network. Results are checked before timing.
"""
import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

from tf_mpi import basics, predict
from tf_mpi.basics import _core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
MODES = ("0", "1", "auto")  # flat, hierarchical, the model's choice
SAMPLE_S = 0.15  # a sample's K calls take about this long (one call where a call takes longer)


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
    """Seconds per call of k allreduces of x after an engine barrier (a small allreduce), the slowest rank's."""
    return harness.timed_sample(lambda: allreduce(x), k, lambda: allreduce(np.zeros(1, np.float32)), slowest)


def model_row(b, nodes, per_node, links):
    """Flat and hierarchical seconds for b bytes with the engine's links: the engine's model
    (what auto decides by) and tf_mpi.predict's (engine chunks, its algorithms)."""
    # Nodes pretended by TF_MPI_TOPOLOGY are one host to MPI: its flat allreduce knows no nodes there.
    flat = "single-level" if os.environ.get("TF_MPI_TOPOLOGY") else "node-aware"
    row = _core.hierarchical_model(b, nodes, per_node, links["intra_alpha_s"], links["intra_beta_s"],
                                   links["inter_alpha_s"], links["inter_beta_s"], flat=flat)
    cluster = predict.Cluster(nodes, per_node, predict.Link(links["intra_alpha_s"], links["intra_beta_s"]),
                              predict.Link(links["inter_alpha_s"], links["inter_beta_s"]), flat=flat)
    row["predict_flat_s"] = predict.group_time([b], cluster, hierarchical=False)
    row["predict_hierarchical_s"] = predict.group_time([b], cluster, hierarchical=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="rank 0 writes the samples and summary here")
    args = parser.parse_args()
    record = harness.Record("hierarchical_bench", path=args.json)
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
        ks[b] = int(allreduce(np.array([max(1, min(200, int(SAMPLE_S / max(t, 1e-6))))], np.int64), op=3)[0])
    init("0")
    for b, x in inputs.items():
        assert np.all(allreduce(x) == want)
    times = {(m, b): [] for m in MODES for b in SIZES}
    autos = []  # hierarchical() of each auto round: across hosts, each init measured the link anew
    for r in range(args.rounds):
        for mode in harness.rotation(MODES, r):
            init(mode)
            if mode == "auto":
                autos.append(_core.hierarchical())
                if nodes > 1 and not os.environ.get("TF_MPI_TOPOLOGY"):
                    # With "timed", what `python -m tf_mpi.predict --measure` calibrates on in this job.
                    autos[-1]["engine_s"] = predict.measure_engine_seconds()
            for b, x in inputs.items():
                times[(mode, b)].append(sample(x, ks[b]))
    # The medians of the rounds' links against the medians of the rounds' times.
    auto = dict(autos[-1], **{k: statistics.median(a[k] for a in autos)
                              for k in ("inter_alpha_s", "inter_beta_s", "intra_alpha_s", "intra_beta_s")})
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"# hierarchical_bench: {nodes} nodes x {per_node} ranks (TF_MPI_TOPOLOGY="
              f"{os.environ.get('TF_MPI_TOPOLOGY')}), {args.rounds} rounds, {os.cpu_count()} CPUs, "
              f"{platform.machine()}, {time.strftime('%Y-%m-%d')}")
        print(f"# auto (last round): {auto['summary']}")
        print(f"# links (median of {len(autos)} auto rounds): intra {auto['intra_alpha_s'] * 1e6:.1f} us, {1e-9 / auto['intra_beta_s']:.3g} GB/s; "
              f"inter {auto['inter_alpha_s'] * 1e6:.1f} us, {1e-9 / auto['inter_beta_s']:.3g} GB/s")
        print("# model: the engine's (auto's); predict: tf_mpi.predict's, both with the links above")
        print(f"{'bytes':>10} {'K':>4} {'flat ms':>9} {'model':>9} {'predict':>9} {'hier ms':>9} {'model':>9} "
              f"{'predict':>9} {'hier/flat (min-max)':>20} {'model':>6} {'auto ms':>9} {'auto/best':>9}")
        rows = []
        for b in SIZES:
            flat, hier = times[("0", b)], times[("1", b)]
            ratios = sorted(h / f for h, f in zip(hier, flat))
            model = model_row(b, nodes, per_node, auto)
            auto_over_best = med[("auto", b)] / min(med[("0", b)], med[("1", b)])
            rows.append({"bytes": b, "k": ks[b], "flat_s": flat, "hierarchical_s": hier, "auto_s": times[("auto", b)],
                         "flat_median_s": med[("0", b)], "hierarchical_median_s": med[("1", b)],
                         "auto_median_s": med[("auto", b)], "auto_over_best": auto_over_best,
                         "auto_hierarchical": predict.goes_hierarchical(auto, b),
                         "model_flat_s": model["flat_s"], "model_hierarchical_s": model["hierarchical_s"],
                         "predict_flat_s": model["predict_flat_s"],
                         "predict_hierarchical_s": model["predict_hierarchical_s"]})
            print(f"{b:>10} {ks[b]:>4} {med[('0', b)] * 1e3:>9.3f} {model['flat_s'] * 1e3:>9.3f} "
                  f"{model['predict_flat_s'] * 1e3:>9.3f} {med[('1', b)] * 1e3:>9.3f} "
                  f"{model['hierarchical_s'] * 1e3:>9.3f} {model['predict_hierarchical_s'] * 1e3:>9.3f} "
                  f"{f'{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})':>20} "
                  f"{model['hierarchical_s'] / model['flat_s']:>6.2f} {med[('auto', b)] * 1e3:>9.3f} "
                  f"{auto_over_best:>9.2f}")
        if args.json:
            record.write(nodes=nodes, ranks_per_node=per_node, rounds=args.rounds, auto=auto, auto_rounds=autos,
                         cpus=os.cpu_count(), rows=rows)
    _core.shutdown()

if __name__ == "__main__":
    main()
