"""The scaling-efficiency figure (matplotlib, headless), from a report or a saved --json file."""
from training_bench import MODEL_NAMES, PRECISIONS


def plot_efficiency(report, path):
    """Grouped bars of scaling efficiency per model (one panel per precision), with a line at 1.0."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    results = report.get("summary") or report["results"]  # files from before --rounds have no summary
    # Variants in the order they were run (round 1 is not rotated); timeline launches are not throughput.
    labels = list(dict.fromkeys(e["label"] for e in results if e["mode"] != "single" and not e.get("timeline")))
    precisions = [p for p in PRECISIONS if any(e["precision"] == p for e in results)]
    models = [m for m in MODEL_NAMES if any(e["model"] == m for e in results)]
    fig, axes = plt.subplots(1, len(precisions), figsize=(4.5 + 2.5 * len(models), 4.5) if len(precisions) == 1
                             else (11, 4.5), squeeze=False)
    width = 0.8 / len(labels)
    for ax, precision in zip(axes[0], precisions):
        by_key = {(e["model"], e["label"]): e for e in results if e["precision"] == precision}
        for k, label in enumerate(labels):
            xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(models))]
            entries = [by_key.get((m, label)) for m in models]
            heights = [e.get("efficiency", 0.0) if e else 0.0 for e in entries]
            # Error bars: the lowest and highest round's efficiency (none with one round).
            spreads = [(e or {}).get("efficiency_spread") for e in entries]
            errors = [[h - s["min"] if s else 0.0 for h, s in zip(heights, spreads)],
                      [s["max"] - h if s else 0.0 for h, s in zip(heights, spreads)]]
            ax.bar(xs, heights, width, label=label, yerr=errors, capsize=2)
            for x, e in zip(xs, entries):
                if e is not None and "efficiency" not in e:  # ran but failed, or no baseline
                    ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel("scaling efficiency at 2 processes")
        ax.set_title(precision)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Training throughput at 2 processes / (2 x one process)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
