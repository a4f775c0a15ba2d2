"""What an engine setting costs the smallest collectives: launches with the setting at its
default and turned off, and optionally another build, in one run (docs/reliability.md quotes it
for the MPI watchdog and the peer liveness check).

    python benchmarks/setting_cost.py TF_MPI_MPI_TIMEOUT_SECONDS [--launches 10]
    python benchmarks/setting_cost.py TF_MPI_PEER_TIMEOUT_SECONDS --launches 20 [--baseline DIR]

Variants, launched np=2 in an order that rotates every round (benchmarks/harness.py), so that a
drift in the machine's load favours none: ``on`` (the variable unset: its default), ``off`` (the
variable set to ``--off``, default 0) and, with ``--baseline DIR``, ``baseline``: DIR first on
PYTHONPATH (a directory holding another build's ``tf_mpi`` package, e.g. ``pip install --no-deps
--target DIR .`` in a checkout of it). Each job times 7 blocks of 300 back-to-back 1 KiB
allreduces through tf_mpi._core (numpy, no TensorFlow) after 300 warm-up calls and checks every
result. Prints, per variant, the median over launches of each launch's median block and of its
best block (microseconds per call), and which tf_mpi the variant imported; ``--json PATH`` writes
every launch's figures with the machine they ran on.
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
    import tf_mpi
    from tf_mpi.basics import _core
    _core.init()
    x = np.ones(256, np.float32)
    blocks = []
    for b in range(8):
        t = time.perf_counter()
        for _ in range(300):
            y = _core.allreduce(x, 1, "w")  # op 1: Sum
        if b:  # block 0 is the warm-up
            blocks.append((time.perf_counter() - t) / 300 * 1e6)
        assert np.all(y == _core.size()), y[:4]
    if _core.rank() == 0:
        harness.emit({"median_block_us": statistics.median(blocks), "best_block_us": min(blocks),
                      "tf_mpi": os.path.dirname(tf_mpi.__file__)})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variable", nargs="?", help="the setting, e.g. TF_MPI_MPI_TIMEOUT_SECONDS")
    p.add_argument("--off", default="0", help="the variable's value that turns the setting off (default 0)")
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--baseline", default=None, help="directory holding another build's tf_mpi package")
    p.add_argument("--json", default=None, help="write every launch's figures to this file")
    p.add_argument("--rank-loop", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_loop:
        return rank_loop()
    if not a.variable:
        p.error("name the setting's variable, e.g. TF_MPI_PEER_TIMEOUT_SECONDS")
    record = harness.Record("setting_cost", path=a.json)

    def one_launch(variant):
        env = {a.variable: a.off if variant == "off" else None}   # None: unset, the default
        if variant == "baseline":
            env["PYTHONPATH"] = os.path.abspath(a.baseline)
        try:
            return harness.launch(2, [os.path.abspath(__file__), "--rank-loop"], env=env, timeout=120)[0]
        except harness.LaunchError as e:
            sys.exit(f"launch failed: {e}")

    variants = ["on", "off"] + (["baseline"] if a.baseline else [])
    results = harness.interleave({v: (lambda v=v: one_launch(v)) for v in variants}, a.launches)
    for v in variants:
        rows = results[v]
        print(f"{a.variable} {v:>8}: median block {statistics.median(r['median_block_us'] for r in rows):.2f} us, "
              f"best block {statistics.median(r['best_block_us'] for r in rows):.2f} us per 1 KiB allreduce "
              f"({len(rows)} launches; tf_mpi from {sorted({r['tf_mpi'] for r in rows})})")
    if a.json:
        record.write(variable=a.variable, launches=results,
                     median_block_us={k: harness.summarize(r["median_block_us"] for r in v) for k, v in results.items()},
                     best_block_us={k: harness.summarize(r["best_block_us"] for r in v) for k, v in results.items()})


if __name__ == "__main__":
    main()
