"""Small helpers the example programs share: rank-aware logging, weight
digests (to check that replicas are identical) and figure boilerplate.

The examples import it as a sibling module (``python examples/<name>.py``
puts examples/ on sys.path); copy it along when you copy an example.
"""
import hashlib

import keras
import numpy as np


def rank_logger(rank, verbose):
    """print() for rank 0 only, or for every rank (prefixed) when verbose."""
    def log(msg):
        if rank == 0 or verbose:
            print(f"[rank {rank}] {msg}" if verbose else msg, flush=True)
    return log


def sha256_of(arrays):
    """Hex digest of a list of arrays or variables (bit-exact replica check)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(keras.ops.convert_to_numpy(a)).tobytes())
    return h.hexdigest()


def new_figure(ncols, figsize):
    """A headless (Agg) matplotlib figure with `ncols` axes side by side."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    return plt.subplots(1, ncols, figsize=figsize)


def save_figure(fig, axes, path, title, xlabel, legend_fontsize=None):
    """Integer x ticks, grid and legend on every axis; title; writes PNG `path`."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_fontsize)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
