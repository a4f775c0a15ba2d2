"""The peer liveness check's cost on the smallest collectives (docs/reliability.md, "The peer liveness check").

    python benchmarks/liveness_cost.py [--launches 10] [--baseline DIR]

Launches np=2 jobs in rotation with TF_MPI_PEER_TIMEOUT_SECONDS=0 (check off)
and the default (on), and with --baseline also with DIR first on PYTHONPATH
(a checkout of another commit with its libraries built in place, e.g. one
without the check: ``git worktree add /tmp/base <commit>`` and
``python setup.py build_ext --inplace`` there). The rotation changes every
round, so that a drift in the machine's load favours no variant. Each job
times 7 blocks of 300 back-to-back 1 KiB allreduces through tf_mpi._core
(numpy, no TensorFlow) after 300 warm-up calls, and checks every result.
Prints, per variant, the median over launches of each launch's median block
and of its best block (microseconds per call), and which tf_mpi each variant
imported. Launches, the rotation and the statistics: benchmarks/harness.py;
``--json PATH`` writes them with the machine they ran on.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_loop():
    import numpy as np
    import tf_mpi
    from tf_mpi.basics import _core
    _core.init()
    x = np.ones(256, np.float32)
    blocks = []
    for b in range(8):
        t = time.perf_counter()
        for _ in range(300):
            y = _core.allreduce(x, 1, "w")  # op 1: Sum
        if b:
            blocks.append((time.perf_counter() - t) / 300 * 1e6)
        assert np.all(y == _core.size()), y[:4]
    if _core.rank() == 0:
        harness.emit({"median_block_us": statistics.median(blocks), "best_block_us": min(blocks),
                      "tf_mpi": os.path.dirname(tf_mpi.__file__)})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--baseline", default=None, help="a checkout with its libraries built in place, to compare with")
    p.add_argument("--json", default=None, help="write every launch's figures to this file")
    p.add_argument("--rank-loop", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_loop:
        return rank_loop()
    record = harness.Record("liveness_cost", path=a.json)

    def one_launch(variant):
        # This checkout's tf_mpi, the check on (the default) or off (0); or the baseline's.
        env = {"PYTHONPATH": os.path.abspath(a.baseline) if variant == "baseline" else REPO,
               "TF_MPI_PEER_TIMEOUT_SECONDS": "0" if variant == "off" else None}
        try:
            return harness.launch(2, [os.path.abspath(__file__), "--rank-loop"], env=env, timeout=120)[0]
        except harness.LaunchError as e:
            sys.exit(f"launch failed: {e}")

    variants = ["on", "off"] + (["baseline"] if a.baseline else [])
    results = harness.interleave({v: (lambda v=v: one_launch(v)) for v in variants}, a.launches)
    for v in variants:
        rows = results[v]
        print(f"{v:>8}: median block {statistics.median(r['median_block_us'] for r in rows):.2f} us, "
              f"best block {statistics.median(r['best_block_us'] for r in rows):.2f} us per 1 KiB allreduce "
              f"({len(rows)} launches; tf_mpi from {sorted({r['tf_mpi'] for r in rows})})")
    if a.json:
        record.write(launches=results,
                     median_block_us={k: harness.summarize(r["median_block_us"] for r in v) for k, v in results.items()},
                     best_block_us={k: harness.summarize(r["best_block_us"] for r in v) for k, v in results.items()})


if __name__ == "__main__":
    main()
