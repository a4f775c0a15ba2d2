"""Prints docs/scaling.md's table of predictions for a GPU cluster (Markdown), from tf_mpi.predict.

    python benchmarks/scaling_predictions.py [--nics-per-node 1] [--chunk-bytes 1048576] [--json out.json]

The assumptions (stated in docs/scaling.md next to the table):

* 8 GPUs per node, NVLink inside the node (preset ``nvlink``: 300 GB/s, alpha 2 us), one
  InfiniBand card per node, EDR 100 Gb/s (``ib100``: alpha 2 us) or HDR 200 Gb/s (``ib200``:
  alpha 1.5 us); float32 gradients; tf_mpi's default engine settings (1 MiB chunks).
* ResNet-50 (benchmarks/data/resnet50_grad_shapes.json, 97.6 MiB): a 100 ms step per GPU.
* The LSTM example's model at benchmark size (benchmarks/data/lstm_grad_shapes.json,
  10.8 MiB): a 10 ms step per GPU.
* Backprop is 2/3 of the step (backward ~ twice the forward); "no overlap" counts all
  communication as exposed.

Each row is also one command line, e.g.
``python -m tf_mpi.predict benchmarks/data/resnet50_grad_shapes.json --step-ms 100 --backprop-ms 66.7
--intra nvlink --inter ib100 --nodes 2 64``. Nothing is measured; ``--json`` writes the rows
with the assumptions (benchmarks/harness.py's record).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import harness  # noqa: E402
from tf_mpi import predict  # noqa: E402

MODELS = [("ResNet-50", os.path.join(HERE, "data", "resnet50_grad_shapes.json"), 0.100),
          ("LSTM example", os.path.join(HERE, "data", "lstm_grad_shapes.json"), 0.010)]
NETWORKS = ["ib100", "ib200"]
NODES = [2, 64]
RANKS_PER_NODE = 8
BACKPROP_SHARE = 2 / 3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nics-per-node", type=int, default=1)
    parser.add_argument("--flat", choices=predict.FLAT_ALGORITHMS, default="node-aware",
                        help="how the MPI library's own allreduce crosses nodes (tf_mpi.predict --flat)")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="default: the engine's for the layout")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    record = harness.Record("scaling_predictions", path=args.json)
    rows = []
    print("| model | network | nodes x GPUs | allreduce | groups | communication ms | exposed ms "
          "| efficiency | efficiency, no overlap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, path, step_s in MODELS:
        overlapped = predict.Workload.from_json(path, step_s=step_s, backprop_s=step_s * BACKPROP_SHARE)
        serial = predict.Workload.from_json(path, step_s=step_s)
        for network in NETWORKS:
            for nodes in NODES:
                cluster = predict.Cluster(nodes, RANKS_PER_NODE, predict.PRESETS["nvlink"], predict.PRESETS[network],
                                          nics_per_node=args.nics_per_node, chunk_bytes=args.chunk_bytes,
                                          flat=args.flat)
                for hierarchical in (False, True):
                    p = predict.predict_step(overlapped, cluster, hierarchical)
                    q = predict.predict_step(serial, cluster, hierarchical)
                    rows.append(dict(model=label, step_ms=step_s * 1e3, network=network, nodes=nodes,
                                     ranks_per_node=RANKS_PER_NODE, hierarchical=hierarchical, groups=p.groups,
                                     comm_ms=p.comm_s * 1e3, exposed_ms=p.exposed_s * 1e3,
                                     efficiency=p.efficiency, efficiency_no_overlap=q.efficiency))
                    print(f"| {label} ({step_s * 1e3:.0f} ms step) | {network} | {nodes} x {RANKS_PER_NODE} "
                          f"| {'hierarchical' if hierarchical else 'flat'} | {p.groups} | {p.comm_s * 1e3:.1f} "
                          f"| {p.exposed_s * 1e3:.1f} | {p.efficiency:.2f} | {q.efficiency:.2f} |")
    if args.json:
        record.write(nics_per_node=args.nics_per_node, chunk_bytes=args.chunk_bytes, flat=args.flat,
                     backprop_share=BACKPROP_SHARE, rows=rows)


if __name__ == "__main__":
    main()
