"""Statistics of the benchmark: samples/s over a launch's timed windows, efficiencies against the
same round's baselines, and medians with their spread over rounds."""
import statistics


def summarize_windows(seconds, samples_per_window):
    """samples/s median, min, max and the raw window times."""
    rates = [samples_per_window / s for s in seconds]
    return {"samples_per_sec": statistics.median(rates), "samples_per_sec_min": min(rates),
            "samples_per_sec_max": max(rates), "window_seconds": [round(s, 4) for s in seconds]}


def add_efficiencies(results):
    """Per launch, against the same round's launches of the same model and precision:
    efficiency = samples/s at N processes / (N x samples/s of `single`), and
    of_pair = samples/s / samples/s of `pair` (the share of the no-communication ceiling)."""
    def rates(mode):
        return {(e.get("round", 0), e["model"], e["precision"]): e["samples_per_sec"]
                for e in results if e["mode"] == mode and e["status"] == "ok"}
    single, pair = rates("single"), rates("pair")
    for e in results:
        key = (e.get("round", 0), e["model"], e["precision"])
        if e["status"] != "ok" or e["mode"] == "single":
            continue
        if key in single:
            e["efficiency"] = e["samples_per_sec"] / (e["processes"] * single[key])
        if key in pair and e["mode"] != "pair":
            e["of_pair"] = e["samples_per_sec"] / pair[key]


def spread(values):
    """{median, min, max} of a non-empty list."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_rounds(results):
    """One entry per (precision, model, variant): medians over the rounds and their spread.

    With one round, the min/max of samples/s are those of the timed windows
    inside the launch; with several rounds they are the lowest and highest
    round medians (launch-to-launch spread, the larger and more honest one).
    """
    keys = []
    for e in results:
        key = (e["precision"], e["model"], e["label"])
        if key not in keys:
            keys.append(key)
    summary = []
    for key in keys:
        runs = [e for e in results if (e["precision"], e["model"], e["label"]) == key]
        ok = [e for e in runs if e["status"] == "ok"]
        if not ok:
            summary.append(dict(runs[-1], rounds=len(runs), rounds_ok=0))
            continue
        entry = dict(ok[-1], rounds=len(runs), rounds_ok=len(ok))
        rates = spread([e["samples_per_sec"] for e in ok])
        entry["samples_per_sec"] = rates["median"]
        if len(ok) > 1:
            entry["samples_per_sec_min"], entry["samples_per_sec_max"] = rates["min"], rates["max"]
        entry["step_ms"] = statistics.median(e["step_ms"] for e in ok)
        steals = [e["cpu_steal_share"] for e in ok if e.get("cpu_steal_share") is not None]
        if steals:
            entry["cpu_steal_share"] = spread(steals)
        # cost_us: a callcost launch's 1 KiB allreduce cost per tf.function call (median of its samples);
        # raw_mpi_cost_us: a raw MPI_Allreduce's in the same loop; cost_over_raw_mpi_us: tf_mpi's beyond it;
        # async_op_cost_us: TensorFlow's own asynchronous kernel's; async_raw_mpi_cost_us: that kernel's and
        # the raw MPI_Allreduce's together; cost_over_async_raw_mpi_us: tf_mpi's beyond both.
        for metric in ("efficiency", "of_pair", "cost_us", "raw_mpi_cost_us", "cost_over_raw_mpi_us",
                       "async_op_cost_us", "async_raw_mpi_cost_us", "cost_over_async_raw_mpi_us"):
            values = [e[metric] for e in ok if metric in e]
            if values:
                entry[metric] = statistics.median(values)
                entry[metric + "_spread"] = spread(values)
        tails = [e["timeline_analysis"] for e in ok if "tail_ms" in e.get("timeline_analysis", {})]
        if tails:
            entry["timeline_analysis"] = {k: statistics.median(t[k] for t in tails)
                                          for k in ("step_ms", "comm_ms", "overlap_share", "tail_ms", "tail_share")
                                          if all(k in t for t in tails)}
        summary.append(entry)
    return summary
