"""Small helpers the example programs share: rank-aware logging, the common command-line
flags, TensorFlow's import without its start-up notices, checkpoint state files, the replica check (weight digests), the LSTM text classifier
and figure boilerplate. The benchmarks (benchmarks/) use some of them too.

The examples import it as a sibling module (``python examples/<name>.py``
puts examples/ on sys.path); copy it along when you copy an example. It
imports Keras, matplotlib and tf_mpi only inside the helpers that need them,
so a process that must stay without TensorFlow (the benchmark driver) can
use the others.
"""
import hashlib
import json
import os
import sys
import tempfile


# What TensorFlow's C++ runtime prints on every rank while `import tensorflow` runs (oneDNN, absl's
# pre-initialisation warning, the CPU-feature notice). It is written before TF_CPP_MIN_LOG_LEVEL
# applies to it, so setting that variable does not hide it.
_TENSORFLOW_STARTUP_NOTICES = ("All log messages before absl::InitializeLog()", "oneDNN custom operations are on",
                               "cpu_feature_guard", "To enable the following instructions:")


def import_tensorflow_quietly():
    """``import tensorflow`` without TensorFlow's start-up notices on stderr; returns the module.

    Everything else written to stderr during the import (warnings, errors, a
    traceback) is passed on unchanged. ``TF_CPP_MIN_LOG_LEVEL=0`` asks for
    TensorFlow's whole log, notices included: nothing is filtered then.

    Example::

        tf = import_tensorflow_quietly()
    """
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0" or "tensorflow" in sys.modules:
        import tensorflow
        return tensorflow
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)   # the C++ runtime writes to file descriptor 2, not sys.stderr
        try:
            import tensorflow
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines
                                     if not any(n in line for n in _TENSORFLOW_STARTUP_NOTICES)))
            sys.stderr.flush()
    return tensorflow


def rank_logger(rank, verbose):
    """print() for rank 0 only, or for every rank (prefixed) when verbose."""
    def log(msg):
        if rank == 0 or verbose:
            print(f"[rank {rank}] {msg}" if verbose else msg, flush=True)
    return log


def add_training_arguments(parser, lr, plot_help, seed_help=None):
    """The flags the training examples share, in this order: --lr (default `lr`), --max-lr,
    --lr-decay, --warmup-epochs, --precision, --compression, --compression-ratio, --checkpoint-dir, --plot
    (`plot_help`), --seed and --verbose."""
    p = parser
    p.add_argument("--lr", type=float, default=lr, help="single-worker learning rate lr0 (Adam)")
    p.add_argument("--max-lr", type=float, default=None, help="cap on the worker-scaled learning rate")
    p.add_argument("--lr-decay", type=float, default=0.9, help="learning rate factor per epoch")
    p.add_argument("--warmup-epochs", type=float, default=0.5, help="linear warm-up length in epochs")
    p.add_argument("--precision", choices=["float32", "mixed_float16"], default="float32")
    p.add_argument("--compression", choices=["none", "fp16", "topk", "gtopk"], default="none",
                   help="gradient compression on the wire (topk / gtopk: sparsified with error feedback)")
    p.add_argument("--compression-ratio", type=float, default=0.01,
                   help="with --compression topk or gtopk: the fraction of each gradient's entries sent")
    p.add_argument("--checkpoint-dir", default=None,
                   help="rank 0 saves here after every epoch; a later run resumes from it "
                        "(must be readable by every rank, e.g. a shared filesystem)")
    p.add_argument("--plot", default=None, help=plot_help)
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--verbose", action="store_true", help="every rank prints (default: rank 0 only)")


def compression_from_args(hvd, args):
    """The compressor --compression and --compression-ratio name."""
    if args.compression in ("topk", "gtopk"):
        return getattr(hvd.Compression, args.compression)(args.compression_ratio)
    return hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none


def write_json_atomic(path, obj, indent=None):
    """Writes `obj` as JSON to `path` through a temporary file: a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=indent)
    os.replace(path + ".tmp", path)


def read_checkpoint_state(directory):
    """The ``state.json`` of a checkpoint directory, or None if there is none."""
    path = os.path.join(directory, "state.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def agreed_checkpoint_state(directory):
    """Rank 0 creates `directory` if needed and reads its state.json; every rank gets rank 0's
    answer (a collective), so all ranks resume from the same epoch, or all start afresh."""
    import tf_mpi
    state = None
    if tf_mpi.rank() == 0:
        os.makedirs(directory, exist_ok=True)
        state = read_checkpoint_state(directory)
    return tf_mpi.broadcast_object(state, root_rank=0, name="example.checkpoint_state")


def sha256_of(arrays):
    """Hex digest of a list of arrays or variables (bit-exact replica check)."""
    import keras
    import numpy as np
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(keras.ops.convert_to_numpy(a)).tobytes())
    return h.hexdigest()


def replica_check(weights, optimizer_variables):
    """Whether every rank holds the same weights and optimizer state, bit for bit (a collective):
    {"weights_sha256", "weights_identical", "optimizer_state_identical"} for the RESULT line."""
    import tf_mpi
    mine = (sha256_of(weights), sha256_of(optimizer_variables))
    digests = tf_mpi.allgather_object(mine, name="example.digests")
    return {"weights_sha256": mine[0],
            "weights_identical": all(d[0] == mine[0] for d in digests),
            "optimizer_state_identical": all(d[1] == mine[1] for d in digests)}


def lstm_text_classifier(seq_len, vocab, embedding_dim, units, name):
    """Embedding -> LSTM -> LSTM -> Dense(1, sigmoid), uncompiled: the text classifier of
    imdb_lstm.py (and, at benchmark size, of benchmark_lstm.py and benchmarks/bench_models.py).
    The output layer stays float32 under mixed_float16, for a numerically stable loss."""
    import keras
    inputs = keras.Input((seq_len,), dtype="int32")
    x = keras.layers.Embedding(vocab, embedding_dim)(inputs)
    x = keras.layers.LSTM(units, return_sequences=True)(x)
    x = keras.layers.LSTM(units)(x)
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32")(x)
    return keras.Model(inputs, outputs, name=name)


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
