"""What the driver prints: a progress line per launch, and the summary as a text table or as the
Markdown table of docs/performance.md."""


def progress_line(k, total, entry):
    """One line per finished launch, so a long driver run shows where it is."""
    what = f"[{k}/{total}] round {entry.get('round', 0) + 1}: {entry['model']} {entry['precision']} {entry['label']}"
    steal = entry.get("cpu_steal_share")
    took = f"[{entry['launch_seconds']:.0f} s" + (f", CPU steal {steal:.0%}]" if steal is not None else "]")
    if entry["status"] != "ok":
        return f"{what}: UNAVAILABLE ({entry['error']}) {took}"
    return f"{what}: {entry['samples_per_sec']:.1f} samples/s {took}"


def format_table(summary):
    """The summary (see summarize_rounds) as a fixed-width text table."""
    header = (f"{'model':<15}{'precision':<15}{'mode':<28}{'samples/s median [min-max]':>30}"
              f"{'step ms':>9}{'efficiency [min-max]':>24}{'of pair':>9}  notes")
    lines = [header, "-" * len(header)]
    for e in summary:
        if e["status"] != "ok":
            lines.append(f"{e['model']:<15}{e['precision']:<15}{e['label']:<28}{'unavailable':>30}{'':>9}{'':>24}"
                         f"{'':>9}  {e['error'][:100]}")
            continue
        rate = f"{e['samples_per_sec']:.1f} [{e['samples_per_sec_min']:.1f}-{e['samples_per_sec_max']:.1f}]"
        efficiency = "-"
        if "efficiency" in e:
            s = e["efficiency_spread"]
            efficiency = f"{e['efficiency']:.1%} [{s['min']:.0%}-{s['max']:.0%}]"
        of_pair = f"{e['of_pair']:.0%}" if "of_pair" in e else "-"
        notes = [] if e["rounds_ok"] == e["rounds"] else [f"{e['rounds_ok']}/{e['rounds']} rounds ok"]
        steal = e.get("cpu_steal_share")
        if isinstance(steal, dict) and steal["max"] >= 0.02:
            notes.append(f"CPU steal up to {steal['max']:.0%}")
        if "cost_us" in e:
            s = e["cost_us_spread"]
            notes.append(f"1 KiB allreduce: {e['cost_us']:+.1f} us per tf.function call [{s['min']:+.1f}, "
                         f"{s['max']:+.1f}] (tf.identity call {e['identity_call_us']:.0f} us)")
            if "raw_mpi_cost_us" in e:
                notes.append(f"raw MPI_Allreduce in the same loop {e['raw_mpi_cost_us']:+.1f} us "
                             f"[{e['raw_mpi_cost_us_spread']['min']:+.1f}, {e['raw_mpi_cost_us_spread']['max']:+.1f}], "
                             f"tf_mpi beyond it {e['cost_over_raw_mpi_us']:+.1f} us")
            if "async_raw_mpi_cost_us" in e:
                notes.append(f"TensorFlow's own asynchronous op (FIFOQueue dequeue) {e['async_op_cost_us']:+.1f} us, "
                             f"with the raw MPI_Allreduce after it {e['async_raw_mpi_cost_us']:+.1f} us, "
                             f"tf_mpi beyond both {e['cost_over_async_raw_mpi_us']:+.1f} us")
        per_step = e.get("engine_per_step")
        if per_step:
            notes.append(f"rank 0 per step: {per_step['requests']:g} collectives, "
                         f"{per_step['negotiation_msgs_sent'] + per_step['negotiation_msgs_received']:g} "
                         "negotiation messages")
        groups = e.get("groups")
        if groups is not None:
            notes.append(f"{groups} group{'' if groups == 1 else 's'}")
        analysis = e.get("timeline_analysis") or {}
        if "overlap_share" in analysis:
            notes.append(f"overlap {analysis['overlap_share']:.0%}, tail {analysis['tail_ms']:.1f} ms "
                         f"({analysis['tail_share']:.1%})")
        lines.append(f"{e['model']:<15}{e['precision']:<15}{e['label']:<28}{rate:>30}{e['step_ms']:>9.1f}"
                     f"{efficiency:>24}{of_pair:>9}  {', '.join(notes)}")
    return "\n".join(lines)


def format_markdown(summary):
    """The summary as a Markdown table, one row per model and precision, one column per variant:
    samples/s median [lowest-highest round], and the efficiency (median over rounds)."""
    labels = []
    for e in summary:
        if e["label"] not in labels:
            labels.append(e["label"])
    rows = []
    for key in dict.fromkeys((e["model"], e["precision"]) for e in summary):
        cells = []
        for label in labels:
            e = next((e for e in summary if (e["model"], e["precision"]) == key and e["label"] == label), None)
            if e is None:
                cells.append("")
            elif e["status"] != "ok":
                cells.append("unavailable")
            else:
                cell = f"{e['samples_per_sec']:.0f} [{e['samples_per_sec_min']:.0f}-{e['samples_per_sec_max']:.0f}]"
                if "efficiency" in e:
                    s = e["efficiency_spread"]
                    cell += f"<br>**{e['efficiency']:.0%}** [{s['min']:.0%}-{s['max']:.0%}]"
                cells.append(cell)
        rows.append(f"| {key[0]} {key[1]} | " + " | ".join(cells) + " |")
    header = "| model | " + " | ".join(labels) + " |"
    return "\n".join([header, "|" + "---|" * (len(labels) + 1)] + rows)
