"""The MPI watchdog's cost on the smallest collectives (docs/reliability.md, "The MPI watchdog").

    python benchmarks/watchdog_cost.py [--launches 10]

Launches np=2 jobs alternately with TF_MPI_MPI_TIMEOUT_SECONDS=0 (watchdog
off) and the default (on), the order swapped every pair so that a drift in the
machine's load does not favour one side. Each job times 7 blocks of 300
back-to-back 1 KiB allreduces through tf_mpi._core (numpy, no TensorFlow)
after 300 warm-up calls, and checks every result. Prints, per setting, the
median over launches of each launch's median block and of its best block
(microseconds per call).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


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
        print(f"BLOCKS {statistics.median(blocks)} {min(blocks)}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--rank-loop", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_loop:
        return rank_loop()
    from mpi_harness import launch_env, mpirun_command, run_bounded
    results = {"off": [], "on": []}
    for i in range(a.launches):
        for setting in (("off", "on") if i % 2 else ("on", "off")):
            env = launch_env()
            env.pop("TF_MPI_MPI_TIMEOUT_SECONDS", None)
            if setting == "off":
                env["TF_MPI_MPI_TIMEOUT_SECONDS"] = "0"
            rc, out, _, timed_out = run_bounded(mpirun_command(2, [sys.executable, __file__, "--rank-loop"]), 120, env)
            line = [l for l in out.splitlines() if l.startswith("BLOCKS ")]
            if rc != 0 or timed_out or not line:
                sys.exit(f"launch failed (rc={rc}):\n{out[-3000:]}")
            results[setting].append(tuple(map(float, line[0].split()[1:])))
    for setting, rows in results.items():
        print(f"watchdog {setting}: median block {statistics.median(r[0] for r in rows):.2f} us, "
              f"best block {statistics.median(r[1] for r in rows):.2f} us per 1 KiB allreduce "
              f"({len(rows)} launches)")


if __name__ == "__main__":
    main()
