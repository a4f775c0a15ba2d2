"""Negotiation messages and bytes per steady-state training step, tree vs star.

For each np, one mpirun launch runs a 20-step loop (one grouped allreduce of
three tensors per step, every step answered from the response cache after a
warm-up) with TF_MPI_NEGOTIATION=tree, then re-initialises with =star and
runs it again. The engine counts the negotiation's own messages and bytes
(tf_mpi._core.stats(): negotiation_msgs_sent/received, negotiation_bytes_sent/
received); nothing is timed, so the table does not depend on the machine's
load. Prints the busiest rank's and rank 0's messages and bytes per step and
writes a plot.

    python benchmarks/negotiation_bench.py            # np = 2..16
    python benchmarks/negotiation_bench.py --sizes 2 4 8 --plot out.png

Each launch goes through benchmarks/harness.py (``python -m tf_mpi.run``); the JSON carries the
machine it ran on.
"""
import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402
STEPS, WARMUP = 20, 3
KEYS = ["negotiation_msgs_sent", "negotiation_msgs_received", "negotiation_bytes_sent", "negotiation_bytes_received"]


def worker(out_dir):
    """On every rank: the loop with the tree, then with the star; per-step counts to out_dir."""
    import numpy as np
    from tf_mpi import _core  # the pybind module alone: no TensorFlow import, so np=16 starts in seconds
    result = {}
    for mode in ("tree", "star"):
        os.environ["TF_MPI_NEGOTIATION"] = mode
        _core.init()
        from mpi4py import MPI  # adopts the MPI tf_mpi initialised
        r = _core.rank()
        grads = [np.full(1000, r, np.float32), np.full(10, r, np.float64), np.full(100, r, np.int32)]
        for _ in range(WARMUP):
            _core.grouped_allreduce(grads, 1, "grads")
        # A barrier outside the engine after each snapshot: no rank's next
        # messages reach a rank before its snapshot, so each counts exactly these steps.
        before = _core.stats()
        MPI.COMM_WORLD.Barrier()
        for _ in range(STEPS):
            out = _core.grouped_allreduce(grads, 1, "grads")
        after = _core.stats()
        MPI.COMM_WORLD.Barrier()
        n = _core.size()
        assert out[0][0] == n * (n - 1) // 2, out[0][0]
        result[mode] = {k: (after[k] - before[k]) / STEPS for k in KEYS}
        _core.shutdown()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(result, f)


def measure(n):
    out = tempfile.mkdtemp(prefix=f"negotiation_bench_{n}_")
    harness.launch(n, [os.path.abspath(__file__), "--worker", out], expect=None)
    ranks = {}
    for name in os.listdir(out):
        with open(os.path.join(out, name)) as f:
            ranks[int(name[4:-5])] = json.load(f)
    assert sorted(ranks) == list(range(n)), sorted(ranks)
    row = {"np": n}
    for mode in ("tree", "star"):
        msgs = {r: c[mode]["negotiation_msgs_sent"] + c[mode]["negotiation_msgs_received"] for r, c in ranks.items()}
        nbytes = {r: c[mode]["negotiation_bytes_sent"] + c[mode]["negotiation_bytes_received"]
                  for r, c in ranks.items()}
        top = max(msgs, key=lambda r: (msgs[r], nbytes[r]))
        row[mode] = {"busiest_rank": top, "busiest_msgs": msgs[top], "busiest_bytes": nbytes[top],
                     "rank0_msgs": msgs[0], "rank0_bytes": nbytes[0]}
    return row


def table(rows):
    head = (f"{'np':>3} | {'tree: busiest msgs':>18} {'bytes':>7} {'rank0 msgs':>10} {'bytes':>7} | "
            f"{'star: busiest msgs':>18} {'bytes':>7} {'rank0 msgs':>10} {'bytes':>7}")
    lines = [head, "-" * len(head)]
    for row in rows:
        t, s = row["tree"], row["star"]
        lines.append(f"{row['np']:>3} | {t['busiest_msgs']:>18.1f} {t['busiest_bytes']:>7.0f} {t['rank0_msgs']:>10.1f} "
                     f"{t['rank0_bytes']:>7.0f} | {s['busiest_msgs']:>18.1f} {s['busiest_bytes']:>7.0f} "
                     f"{s['rank0_msgs']:>10.1f} {s['rank0_bytes']:>7.0f}")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = [r["np"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for mode, style in (("tree", "o-"), ("star", "s--")):
        ax.plot(sizes, [r[mode]["busiest_msgs"] for r in rows], style, label=f"{mode}: busiest rank")
    ax.set_xlabel("ranks (np)")
    ax.set_ylabel("negotiation messages per step\n(sent + received)")
    ax.set_title("Steady-state negotiation cost of the busiest rank")
    ax.set_xticks(sizes)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=list(range(2, 17)))
    p.add_argument("--json", default=os.path.join(HERE, "results", "negotiation_bench.json"))
    p.add_argument("--table", default=os.path.join(HERE, "results", "negotiation_bench.txt"))
    p.add_argument("--plot", default=os.path.join(HERE, "results", "negotiation_bench.png"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    record = harness.Record("negotiation_bench", path=args.json)
    rows = []
    for n in args.sizes:
        rows.append(measure(n))
        print(f"np={n} done", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    with open(args.table, "w") as f:
        f.write(f"# python benchmarks/negotiation_bench.py --sizes {' '.join(map(str, args.sizes))}\n"
                f"# per steady-state step ({STEPS} steps of one grouped allreduce, after {WARMUP} warm-up steps);"
                " messages and bytes sent + received by the negotiation\n" + text + "\n")
    record.write(steps=STEPS, warmup=WARMUP, rows=rows)
    plot(rows, args.plot)


if __name__ == "__main__":
    main()
