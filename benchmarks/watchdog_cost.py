"""The MPI watchdog's cost on the smallest collectives (docs/reliability.md, "The MPI watchdog").

    python benchmarks/watchdog_cost.py [--launches 10]

Launches np=2 jobs alternately with TF_MPI_MPI_TIMEOUT_SECONDS=0 (watchdog
off) and the default (on), the order swapped every pair so that a drift in the
machine's load does not favour one side. Each job times 7 blocks of 300
back-to-back 1 KiB allreduces through tf_mpi._core (numpy, no TensorFlow)
after 300 warm-up calls, and checks every result. Prints, per setting, the
median over launches of each launch's median block and of its best block
(microseconds per call). Launches, the alternation and the statistics: benchmarks/harness.py;
``--json PATH`` writes them with the machine they ran on.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def rank_loop():
    import numpy as np
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
        harness.emit({"median_block_us": statistics.median(blocks), "best_block_us": min(blocks)})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--json", default=None, help="write every launch's figures to this file")
    p.add_argument("--rank-loop", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_loop:
        return rank_loop()
    record = harness.Record("watchdog_cost", path=a.json)

    def one_launch(setting):
        # TF_MPI_MPI_TIMEOUT_SECONDS unset: the default (on); 0: off.
        env = {"TF_MPI_MPI_TIMEOUT_SECONDS": "0" if setting == "off" else None}
        try:
            return harness.launch(2, [os.path.abspath(__file__), "--rank-loop"], env=env, timeout=120)[0]
        except harness.LaunchError as e:
            sys.exit(f"launch failed: {e}")

    # The order alternates every pair (on, off / off, on): a drift in the load favours neither.
    results = harness.interleave({"on": lambda: one_launch("on"), "off": lambda: one_launch("off")}, a.launches)
    for setting in ("off", "on"):
        rows = results[setting]
        print(f"watchdog {setting}: median block {statistics.median(r['median_block_us'] for r in rows):.2f} us, "
              f"best block {statistics.median(r['best_block_us'] for r in rows):.2f} us per 1 KiB allreduce "
              f"({len(rows)} launches)")
    if a.json:
        record.write(launches=results,
                     median_block_us={k: harness.summarize(r["median_block_us"] for r in v) for k, v in results.items()},
                     best_block_us={k: harness.summarize(r["best_block_us"] for r in v) for k, v in results.items()})

if __name__ == "__main__":
    main()
