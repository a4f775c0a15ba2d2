"""Renders a tf_mpi timeline into a PNG: one stacked bar per step showing
time spent negotiating, queued, copying into/out of fusion buffers, and in MPI.

    python -m tf_mpi.timeline_plot trace.json summary.png

Steps are found as in tf_mpi.timeline_analysis (the k-th occurrence of each
collective name that recurs every step belongs to step k); a step's bar covers
everything from its first negotiation to the next step's, so one-off work
before the first step (the initial variable broadcast) is left out. Phases
recorded on several tracks (a fused bucket appears on each member's track) are
counted once; overlapping negotiations are merged, so the bars show wall time
per phase.
"""
import json
import sys

from tf_mpi.timeline_analysis import step_breakdown, union_length

PHASES = {
    "NEGOTIATE": "negotiate",
    "QUEUE": "queue",
    "MEMCPY_IN_FUSION_BUFFER": "copy",
    "MEMCPY_OUT_FUSION_BUFFER": "copy",
}
COLORS = {"negotiate": "#8da0cb", "queue": "#e5c494", "copy": "#fc8d62", "mpi": "#66c2a5"}


def summarize(trace):
    """Per-step wall time (ms) of each phase: a list of dicts with keys negotiate, queue, copy, mpi."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [e for e in events if e.get("ph") == "X"]
    # Step boundaries come from timeline_analysis, so both tools agree on what a step is.
    starts = [s["first"] for s in step_breakdown(events)]
    if not starts:
        return []
    starts.append(float("inf"))
    steps = []
    for begin, end in zip(starts, starts[1:]):
        phases = {k: set() for k in COLORS}
        for e in spans:
            if begin <= e["ts"] < end:
                phase = PHASES.get(e["name"], "mpi" if e["name"].startswith("MPI_") else None)
                if phase:
                    phases[phase].add((e["ts"], e["ts"] + e["dur"]))
        steps.append({k: union_length(v) / 1000.0 for k, v in phases.items()})
    steps[0]["tracks"] = len(tracks)
    return steps


def plot(trace_path, png_path):
    """Writes the per-step bar chart of `trace_path` to `png_path`; returns the summary."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(trace_path) as f:
        steps = summarize(json.load(f))
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(steps) + 3), 4))
    bottom = [0.0] * len(steps)
    for phase, color in COLORS.items():
        values = [s[phase] for s in steps]
        ax.bar(range(len(steps)), values, bottom=bottom, color=color, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("step")
    ax.set_ylabel("wall time (ms)")
    ax.set_title(f"tf_mpi timeline: {trace_path}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return steps


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.stderr.write("usage: python -m tf_mpi.timeline_plot trace.json out.png\n")
        return 2
    steps = plot(argv[0], argv[1])
    print(f"{len(steps)} steps; mean ms per step: " + ", ".join(
        f"{k} {sum(s[k] for s in steps) / max(1, len(steps)):.2f}" for k in COLORS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
