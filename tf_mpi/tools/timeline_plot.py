"""Draws a tf_mpi timeline as a one-page summary of its training steps.

    python -m tf_mpi.timeline_plot trace.json summary.png [--skip 2]

The figure (1200 x 700 pixels) has four panels:

- **Time per step, by phase**: the distribution over steps of the wall time
  spent negotiating (from the first rank's READY to the last one's: how long
  ranks waited for each other), queued, copying into and out of fusion
  buffers, and in MPI calls; boxes are the quartiles, whiskers the 5th and
  95th percentiles, dots the steps beyond them.
- **Step time**: every step's duration and its communication time, the
  slowest steps marked with their number.
- **Overlap and exposed tail**: per step, the share of communication that ran
  while backprop was still computing somewhere, and the exposed tail (last
  gradient ready everywhere -> last collective done) as a share of the step.
- **Slowest steps**: a table of the five slowest steps, phase by phase.

Steps are found as in tf_mpi.timeline_analysis (the k-th occurrence of each
collective name that recurs every step belongs to step k); a step runs from
its first negotiation to the next step's, so one-off work before the first
step (the initial variable broadcast) is left out. The first ``--skip`` steps
(default 2, as in ``timeline_analysis``) are left out of the distributions as
warm-up. Phases recorded on several tracks (a fused bucket appears on each
member's track) are counted once, and overlapping spans are merged, so every
figure is wall time.
"""
import argparse
import json
import statistics
import sys

from tf_mpi.tools.timeline_analysis import step_breakdown, union_length

PHASES = {
    "NEGOTIATE": "negotiate",
    "QUEUE": "queue",
    "MEMCPY_IN_FUSION_BUFFER": "copy",
    "MEMCPY_OUT_FUSION_BUFFER": "copy",
}
COLORS = {"negotiate": "#8da0cb", "queue": "#e5c494", "copy": "#fc8d62", "mpi": "#66c2a5"}
SLOWEST = 5
TABLE_KEYS = ("step_ms", "negotiate", "queue", "copy", "mpi", "tail_ms")  # the slowest-steps table's columns
WARMUP_STEPS = 2


def summarize(trace):
    """Per-step wall time (ms) of each phase: a list of dicts with keys negotiate, queue, copy, mpi.

    Each dict also carries the step's ``step_ms`` (None for the last step),
    ``comm_ms``, ``overlap_share``, ``tail_ms`` and ``tail_share`` from
    tf_mpi.timeline_analysis.step_breakdown; the first has ``tracks``, the
    number of tracks in the trace.
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [e for e in events if e.get("ph") == "X"]
    # Step boundaries come from timeline_analysis, so both tools agree on what a step is.
    breakdown = step_breakdown(events)
    if not breakdown:
        return []
    starts = [s["first"] for s in breakdown] + [float("inf")]
    steps = []
    for k, (begin, end) in enumerate(zip(starts, starts[1:])):
        phases = {p: set() for p in COLORS}
        for e in spans:
            if begin <= e["ts"] < end:
                phase = PHASES.get(e["name"], "mpi" if e["name"].startswith(("MPI_", "SHM_")) else None)
                if phase:
                    phases[phase].add((e["ts"], e["ts"] + e["dur"]))
        step = {p: union_length(v) / 1000.0 for p, v in phases.items()}
        step.update({key: breakdown[k][key] for key in ("step_ms", "comm_ms", "overlap_share", "tail_ms", "tail_share")})
        steps.append(step)
    steps[0]["tracks"] = len(tracks)
    return steps


def _measured(steps, skip):
    """Indices of the steps the distributions use: complete ones (with a successor) after `skip` warm-up steps."""
    complete = [k for k, s in enumerate(steps) if s["step_ms"]]
    return complete[skip:] if len(complete) > skip else complete


def slowest_steps(steps, n=SLOWEST, skip=WARMUP_STEPS):
    """Indices of the `n` slowest of summarize()'s steps (warm-up steps left out), slowest first."""
    return sorted(_measured(steps, skip), key=lambda k: steps[k]["step_ms"], reverse=True)[:n]


def _fmt(ms):
    """A time for a label: whole numbers from 100 up, 3 significant digits below, '<0.01' for crumbs."""
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 0.01 or ms == 0:
        return f"{ms:.3g}"
    return "<0.01"


def _median(values):
    return statistics.median(values) if values else 0.0


def _boxes(ax, rows, unit):
    """Horizontal box plots, one per (label, values, color), top to bottom, each labelled with its median."""
    rows = rows[::-1]
    data = [values or [0.0] for _, values, _ in rows]
    style = dict(whis=(5, 95), widths=0.6, patch_artist=True,
                 medianprops={"color": "black"}, flierprops={"markersize": 3, "alpha": 0.5})
    try:
        parts = ax.boxplot(data, orientation="horizontal", **style)  # matplotlib >= 3.10
    except TypeError:
        parts = ax.boxplot(data, vert=False, **style)
    for patch, (_, _, color) in zip(parts["boxes"], rows):
        patch.set_facecolor(color)
    ax.set_yticks(range(1, len(rows) + 1),
                  [f"{label}\nmedian {_fmt(_median(d))} {unit}" for (label, _, _), d in zip(rows, data)])
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)


def plot(trace_path, png_path, skip=WARMUP_STEPS):
    """Writes the summary figure of `trace_path` to `png_path`; returns summarize()'s per-step list."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(trace_path) as f:
        steps = summarize(json.load(f))
    indices = _measured(steps, skip)
    used = [steps[k] for k in indices]

    fig, axes = plt.subplots(2, 2, figsize=(12, 7), gridspec_kw={"width_ratios": [1, 1.15]})
    (ax_phase, ax_time), (ax_share, ax_table) = axes
    median_step = _median([s["step_ms"] for s in used])
    fig.suptitle(f"tf_mpi timeline {trace_path}: {len(steps)} steps"
                 + (f", median step {_fmt(median_step)} ms (steps {indices[0]}-{indices[-1]})"
                    if used else " (no complete step)"), fontsize=12)

    pool = used or steps
    _boxes(ax_phase, [(p if p != "mpi" else "MPI", [s[p] for s in pool], c) for p, c in COLORS.items()], "ms")
    ax_phase.set_title("Time per step, by phase (wall time, ms)", fontsize=10)
    ax_phase.set_xlabel("ms per step (box: quartiles, whiskers: 5th-95th percentile)")

    ax_time.plot(indices, [s["step_ms"] for s in used], color="#555555", lw=1, label="step")
    ax_time.fill_between(indices, [s["comm_ms"] for s in used], color=COLORS["mpi"], alpha=0.6,
                         label="communication")
    ax_time.fill_between(indices, [s["tail_ms"] for s in used], color="#d62728", alpha=0.6, label="exposed tail")
    slowest = slowest_steps(steps, skip=skip)
    for rank, k in enumerate(slowest):
        ax_time.plot([k], [steps[k]["step_ms"]], "o", color="#d62728", ms=5)
        ax_time.annotate(f"#{k}", (k, steps[k]["step_ms"]), textcoords="offset points",
                         xytext=(5, 4 if rank % 2 == 0 else -10), fontsize=8)
    if used:
        ax_time.axhline(median_step, color="#555555", ls="--", lw=0.8)
        ax_time.set_ylim(0, max(s["step_ms"] for s in used) * 1.15)
    ax_time.set_title("Step time; the slowest steps marked", fontsize=10)
    ax_time.set_xlabel("step")
    ax_time.set_ylabel("ms")
    ax_time.legend(fontsize=8, loc="best")
    ax_time.grid(alpha=0.3)

    _boxes(ax_share, [("overlapping backprop\n(% of communication)",
                       [100 * s["overlap_share"] for s in pool], COLORS["mpi"]),
                      ("exposed tail\n(% of the step)", [100 * (s["tail_share"] or 0) for s in pool], "#d62728")], "%")
    ax_share.set_xlim(0, 100)
    ax_share.set_title("Overlap and exposed tail, per step", fontsize=10)
    ax_share.set_xlabel("% (the tail: last gradient ready everywhere -> last collective done)")

    ax_table.axis("off")
    ax_table.set_title(f"The {len(slowest)} slowest steps (ms)", fontsize=10)
    if slowest:
        columns = ["step", "total", "negotiate", "queue", "copy", "MPI", "tail"]
        cells = [[f"#{k}"] + [_fmt(steps[k][key]) for key in TABLE_KEYS] for k in slowest]
        cells.append(["median"] + [_fmt(_median([s[key] for s in used])) for key in TABLE_KEYS])
        table = ax_table.table(cellText=cells, colLabels=columns, loc="center", cellLoc="right")
        table.auto_set_font_size(False)
        table.set_fontsize(9)
        table.scale(1, 1.5)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return steps


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tf_mpi.timeline_plot",
                                     description="One-page PNG summary of a tf_mpi timeline's training steps.")
    parser.add_argument("trace", help="timeline JSON (TF_MPI_TIMELINE or hvd.start_timeline)")
    parser.add_argument("png", help="where to write the figure")
    parser.add_argument("--skip", type=int, default=WARMUP_STEPS,
                        help="warm-up steps left out of the distributions (default %(default)s)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    steps = plot(args.trace, args.png, skip=args.skip)
    used = [steps[k] for k in _measured(steps, args.skip)]
    print(f"{len(steps)} steps; medians over {len(used)}, ms per step: " + ", ".join(
        f"{k} {_median([s[k] for s in used]):.3g}" for k in TABLE_KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
