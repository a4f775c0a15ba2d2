"""tf_mpi.timeline_analysis on a hand-made timeline whose answers are known."""
from tf_mpi.timeline_analysis import analyze, step_breakdown


def _trace(steps=4, step_us=10_000):
    """Per step: 'g.late' ready everywhere at +8000 us, 'g.early' at +3000 us.

    g.early is reduced 3000-5000 (fully during backprop); g.late 8000-9000
    (after the last gradient), with fusion copies drawn on both tracks (must
    count once). The named one-off broadcast is not a step collective.
    """
    events = [{"ph": "M", "tid": t, "name": "thread_name", "args": {"name": n}}
              for t, n in ((1, "g.early"), (2, "g.late"), (3, "tfmpi.broadcast_variables"))]
    x = lambda tid, name, ts, dur: {"ph": "X", "tid": tid, "name": name, "ts": ts, "dur": dur}
    events.append(x(3, "NEGOTIATE", 0, 10))
    for k in range(steps):
        t0 = 1_000 + k * step_us
        events += [x(1, "NEGOTIATE", t0 + 2000, 1000), x(1, "MPI_ALLREDUCE", t0 + 3000, 2000),
                   x(2, "NEGOTIATE", t0 + 1000, 7000),
                   x(2, "MEMCPY_IN_FUSION_BUFFER", t0 + 8000, 200), x(1, "MEMCPY_IN_FUSION_BUFFER", t0 + 8000, 200),
                   x(2, "MPI_ALLREDUCE", t0 + 8200, 800)]
    return {"traceEvents": events}


def test_step_breakdown_numbers():
    steps = step_breakdown(_trace())
    assert len(steps) == 4
    for s in steps:
        assert abs(s["comm_ms"] - 3.0) < 1e-9          # 2 ms + 0.2 ms (once) + 0.8 ms
        assert abs(s["overlap_share"] - 2 / 3) < 1e-9  # the 2 ms of g.early ran before 8000
        assert abs(s["tail_ms"] - 1.0) < 1e-9          # 8000 -> 9000
    assert [s["step_ms"] for s in steps] == [10.0, 10.0, 10.0, None]
    assert abs(steps[0]["tail_share"] - 0.1) < 1e-9


def test_analyze_skips_warmup_and_reports_medians(tmp_path):
    import json
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace(steps=6)))
    result = analyze(str(path), skip=2)
    assert result["steps"] == 3  # steps 2, 3, 4 (the last has no successor)
    assert abs(result["tail_share"] - 0.1) < 1e-9 and abs(result["overlap_share"] - 2 / 3) < 1e-9


def test_timeline_plot_steps_skip_one_off_first_tensor():
    # The trace starts with a one-off broadcast; timeline_plot must still find
    # the 3 training steps (it used to start a step only at that broadcast).
    from tf_mpi.timeline_plot import summarize
    steps = summarize(_trace(steps=3))
    assert len(steps) == 3
    for s in steps:
        assert abs(s["negotiate"] - 7.0) < 1e-9  # g.late 1000-8000 covers g.early 2000-3000
        assert s["queue"] == 0.0
        assert abs(s["copy"] - 0.2) < 1e-9       # drawn on both tracks, counted once
        assert abs(s["mpi"] - 2.8) < 1e-9        # 2 ms (g.early) + 0.8 ms (g.late)
