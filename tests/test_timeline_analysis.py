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


def test_timeline_plot_summary_figure_and_slowest_steps(tmp_path, capsys):
    # 12 steps of 10 ms, except step 7 (25 ms) and step 4 (18 ms): the figure is
    # laptop-sized whatever the step count, and the slowest steps are found.
    import json
    from tf_mpi import timeline_plot
    starts, t = [], 1_000
    for k in range(12):
        starts.append(t)
        t += {7: 25_000, 4: 18_000}.get(k, 10_000)
    x = lambda tid, name, ts, dur: {"ph": "X", "tid": tid, "name": name, "ts": ts, "dur": dur}
    events = [{"ph": "M", "tid": 1, "name": "thread_name", "args": {"name": "g"}}]
    for t0 in starts:
        events += [x(1, "NEGOTIATE", t0, 6000), x(1, "MPI_ALLREDUCE", t0 + 6000, 1500)]
    path, png = tmp_path / "trace.json", tmp_path / "summary.png"
    path.write_text(json.dumps({"traceEvents": events}))

    steps = timeline_plot.summarize(json.loads(path.read_text()))
    assert [round(s["step_ms"]) for s in steps[:-1]] == [10, 10, 10, 10, 18, 10, 10, 25, 10, 10, 10]
    assert all(abs(s["mpi"] - 1.5) < 1e-9 and abs(s["tail_ms"] - 1.5) < 1e-9 for s in steps)
    assert timeline_plot.slowest_steps(steps, n=2) == [7, 4]
    assert set(timeline_plot.slowest_steps(steps, n=3, skip=8)) == {8, 9, 10}  # warm-up left out

    assert timeline_plot.main([str(path), str(png)]) == 0
    assert "12 steps" in capsys.readouterr().out
    import matplotlib.image
    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert (width, height) == (1200, 700)
