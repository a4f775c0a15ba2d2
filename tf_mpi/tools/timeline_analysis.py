"""Communication overlap and exposed tail of training steps, read from a tf_mpi timeline.

A timeline (``TF_MPI_TIMELINE=trace.json`` or ``tf_mpi.start_timeline``) has
one track per collective. Every time a rank submits a tensor it records a
READY instant, and the NEGOTIATE span runs from the first rank's READY to
the last one's, so its end is the moment the tensor was ready everywhere.
Work on the tensor (QUEUE, fusion copies, MPI_* or SHM_ALLREDUCE) follows.

Steps are found without any step marker: a training step submits the same
named collectives every time, so the k-th occurrence of each such name
belongs to step k. Names that do not occur in every step (broadcasts,
cost-model probes, plan checks) are ignored. Per step:

- ``last_ready``: when the last gradient of the step was ready on every rank
  (backprop is over everywhere);
- ``comm_ms``: wall time of the step's communication (union of the spans, so a
  fused bucket drawn on several tracks counts once);
- ``overlap_share``: the part of ``comm_ms`` that ran before ``last_ready``,
  i.e. while backprop was still computing somewhere;
- ``tail_ms``: from ``last_ready`` to the end of the step's last collective,
  the communication the optimizer update had to wait for (the exposed tail);
- ``step_ms``: from the step's first READY to the next step's first READY.

    python -m tf_mpi.timeline_analysis trace.json
"""
import json
import statistics
import sys
from collections import defaultdict

WORK_SPANS = ("QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER", "SHM_ALLREDUCE")


def _union(intervals):
    """Merged (start, end) intervals, sorted."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _length(intervals):
    return sum(e - s for s, e in intervals)


def union_length(intervals):
    """Wall time covered by (start, end) intervals, overlaps counted once."""
    return _length(_union(intervals))


def _occurrences(events):
    """{name: [ {"ready": t, "first": t, "work": [(s, e), ...]}, ... ]} in time order, per track name."""
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            spans[tracks.get(e["tid"], e["tid"])].append(e)
    out = {}
    for name, evs in spans.items():
        evs.sort(key=lambda e: e["ts"])
        occ = []
        for e in evs:
            if e["name"] == "NEGOTIATE":
                occ.append({"first": e["ts"], "ready": e["ts"] + e["dur"], "work": []})
            elif occ and (e["name"] in WORK_SPANS or e["name"].startswith("MPI_")):
                occ[-1]["work"].append((e["ts"], e["ts"] + e["dur"]))
        out[name] = occ
    return out


def step_breakdown(trace):
    """Per-step dicts (times in ms): step_ms, comm_ms, overlap_share, tail_ms, tail_share.

    ``trace`` is a parsed timeline (dict with traceEvents, or the event list).

    Example::

        import json, tf_mpi.timeline_analysis as ta
        steps = ta.step_breakdown(json.load(open("trace.json")))
        print(steps[-1]["tail_ms"])
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    occ = _occurrences(events)
    if not occ:
        return []
    n_steps = max(len(v) for v in occ.values())
    per_step = [v for v in occ.values() if len(v) == n_steps]
    steps = []
    for k in range(n_steps):
        first = min(o[k]["first"] for o in per_step)
        last_ready = max(o[k]["ready"] for o in per_step)
        work = _union([iv for o in per_step for iv in o[k]["work"]])
        comm = _length(work)
        before = _length([(s, min(e, last_ready)) for s, e in work if s < last_ready])
        end = max((e for _, e in work), default=last_ready)
        steps.append({"first": first, "comm_ms": comm / 1e3,
                      "overlap_share": before / comm if comm > 0 else 0.0,
                      "tail_ms": max(0.0, end - last_ready) / 1e3})
    for k, s in enumerate(steps):
        nxt = steps[k + 1]["first"] if k + 1 < len(steps) else None
        s["step_ms"] = (nxt - s["first"]) / 1e3 if nxt is not None else None
        s["tail_share"] = s["tail_ms"] / s["step_ms"] if s["step_ms"] else None
    return steps


def analyze(path, skip=2):
    """Medians over the steps of the timeline at ``path`` (the first ``skip`` steps are warm-up).

    Returns a dict with ``steps`` (how many were used), ``step_ms``, ``comm_ms``,
    ``overlap_share``, ``tail_ms``, ``tail_share`` (medians) and ``tail_share_max``.

    Example::

        from tf_mpi.timeline_analysis import analyze
        print(analyze("trace.json"))   # {'steps': 38, 'tail_share': 0.01, ...}
    """
    with open(path) as f:
        steps = step_breakdown(json.load(f))
    used = [s for s in steps[skip:] if s["step_ms"]]  # the last step has no successor
    if not used:
        return {"steps": 0}
    med = {key: statistics.median(s[key] for s in used)
           for key in ("step_ms", "comm_ms", "overlap_share", "tail_ms", "tail_share")}
    med["steps"] = len(used)
    med["tail_share_max"] = max(s["tail_share"] for s in used)
    return med


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m tf_mpi.timeline_analysis trace.json"
    if len(argv) == 1 and argv[0] in ("-h", "--help"):
        print(usage + "\n\nPrints the medians over the steps of a tf_mpi timeline (TF_MPI_TIMELINE): "
              "step_ms, comm_ms, overlap_share, tail_ms, tail_share, and tail_share_max.")
        return 0
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return 2
    try:
        result = analyze(argv[0])
    except (OSError, ValueError) as e:  # a missing or unreadable file: say which, not a traceback
        print(f"tf_mpi.timeline_analysis: cannot read {argv[0]}: {e}", file=sys.stderr)
        return 1
    for key, value in result.items():
        print(f"{key:>15}: {value:.4g}" if isinstance(value, float) else f"{key:>15}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
