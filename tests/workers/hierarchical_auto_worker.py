"""Ranks of tests/test_hierarchical_auto.py: TF_MPI_HIERARCHICAL=auto across hosts.

Phase "probe": no TF_MPI_INTER_NODE_LINK, so init() measures the inter-node link.
Phase "given": TF_MPI_INTER_NODE_LINK set, so the probe is skipped and the figures are the user's.
In each, one float32 allreduce per size, recording whether it went hierarchical (the engine's
counter) and its result. Each rank writes rank<R>.json into TF_MPI_TEST_OUT; the test compares.
"""
import json
import os
import time

import numpy as np

from tf_mpi import basics
from tf_mpi.basics import _core

SIZES = [1 << 10, 4 << 10, 64 << 10, 1 << 20, 4 << 20]
GIVEN = "7,3.5"  # TF_MPI_INTER_NODE_LINK for phase "given"


def phase(name):
    t0 = time.perf_counter()
    basics.init()
    init_s = time.perf_counter() - t0
    h = _core.hierarchical()
    rank, size = _core.rank(), _core.size()
    calibrated = None
    if name == "probe":  # what `python -m tf_mpi.predict --measure` calibrates on across these hosts
        from tf_mpi import predict
        c = predict.measure_cluster(repeats=11)
        calibrated = {"intra_alpha_s": c.intra.alpha, "intra_beta_s": c.intra.beta, "inter_alpha_s": c.inter.alpha,
                      "inter_beta_s": c.inter.beta, "collective_s": c.collective_s,
                      "nodes": c.nodes, "ranks_per_node": c.ranks_per_node}
    rows = []
    for b in SIZES:
        before = _core.stats()["hierarchical_allreduces"]
        y = _core.allreduce(np.full(b // 4, rank + 1, np.float32), int(basics.Sum), f"{name}.{b}")
        rows.append({"bytes": b, "hierarchical": _core.stats()["hierarchical_allreduces"] - before,
                     "right": bool(np.all(y == size * (size + 1) / 2))})
    _core.shutdown()
    return {"init_s": init_s, "hierarchical": h, "rows": rows, "cross_size": None, "calibrated": calibrated}


def main():
    os.environ.pop("TF_MPI_INTER_NODE_LINK", None)
    os.environ["TF_MPI_HIERARCHICAL"] = "auto"
    probe = phase("probe")
    os.environ["TF_MPI_INTER_NODE_LINK"] = GIVEN
    given = phase("given")
    basics.init()
    out = {"rank": _core.rank(), "cross_size": _core.cross_size(), "local_size": _core.local_size(),
           "probe": probe, "given": given}
    _core.shutdown()
    with open(os.path.join(os.environ["TF_MPI_TEST_OUT"], f"rank{out['rank']}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
