"""IMDB sentiment classification with a stacked LSTM, trained data-parallel over MPI with tf_mpi.

Every rank trains on its own slice of the training set. DistributedOptimizer
averages the gradients over the ranks at every step, so all ranks apply the
same update and hold the same model. --batch-size is per rank: the global
batch is N times larger, and the learning rate is scaled with N as in
Svyatkovskiy, Kates-Harbeck and Tang (2019), lr_N = lr0 * N / (1 + N / 100),
with a linear warm-up and a per-epoch exponential decay
(tf_mpi.keras.schedules.WorkerScaledSchedule).

Run (from the repository root; ``python -m tf_mpi.run -np N`` is ``mpirun -np N``
with the right mpirun and flags):

    # Synthetic sentiment corpus, nothing to download (about a minute on 2 CPU cores):
    python -m tf_mpi.run -np 2 python examples/imdb_lstm.py --synthetic

    # The real IMDB reviews (Keras' imdb.npz, see "Data" below):
    mpirun -np 4 python examples/imdb_lstm.py --data /data/imdb.npz --epochs 5

    # Mixed precision, fp16 gradients on the wire:
    mpirun -np 2 python examples/imdb_lstm.py --synthetic --precision mixed_float16 --compression fp16

    # Checkpoint every epoch and plot the curves; run it again with a larger
    # --epochs to resume where it stopped:
    mpirun -np 2 python examples/imdb_lstm.py --synthetic --epochs 2 --checkpoint-dir ckpt --plot curves.png
    mpirun -np 2 python examples/imdb_lstm.py --synthetic --epochs 4 --checkpoint-dir ckpt --plot curves.png

Data: --data reads Keras' ``imdb.npz`` (arrays x_train, y_train, x_test,
y_test; each review a list of word ranks, 1 = most frequent word). This
program never downloads: on a machine with internet access, fetch
https://storage.googleapis.com/tensorflow/tf-keras-datasets/imdb.npz (or run
``python -c "import keras; keras.datasets.imdb.load_data()"``, which stores it
as ~/.keras/datasets/imdb.npz, the default --data) and copy it over.
--synthetic generates a corpus of the same shape instead (see synthetic_imdb).

Output: Keras' per-epoch progress on rank 0 (every rank with --verbose), and
at the end rank 0 prints one line ``RESULT {...json...}`` with the final
validation accuracy and loss (averaged over the ranks), the time taken and
whether all ranks ended with identical weights.
"""
import time

START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
from example_utils import import_tensorflow_quietly  # noqa: E402

tf = import_tensorflow_quietly()

# One compute thread per rank: with N ranks on a machine, N threads keep the
# cores busy; more would compete for them. (Set it before TensorFlow runs any
# op; raise it when a rank has several cores to itself.)
tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # noqa: E402

import tf_mpi.keras as hvd  # noqa: E402
from tf_mpi.functions import allgather_object  # noqa: E402

from example_utils import (add_training_arguments, agreed_checkpoint_state, lstm_text_classifier,  # noqa: E402
                           new_figure, rank_logger, read_checkpoint_state, replica_check, save_figure,
                           write_json_atomic, compression_from_args)
from tf_mpi.keras.schedules import WorkerScaledSchedule, worker_scaled_lr  # noqa: E402

IMDB_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/imdb.npz"
# Keras' imdb conventions: 0 pads, 1 starts a review, 2 replaces words outside
# the vocabulary, and word rank r becomes index r + 3.
PAD, START_CHAR, OOV, INDEX_FROM = 0, 1, 2, 3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=os.path.expanduser("~/.keras/datasets/imdb.npz"),
                   help="path of Keras' imdb.npz (never downloaded by this program)")
    p.add_argument("--synthetic", action="store_true", help="generate a sentiment-like corpus instead of --data")
    p.add_argument("--train-samples", type=int, default=None,
                   help="use at most this many training reviews in all (default: all; 6000 with --synthetic)")
    p.add_argument("--test-samples", type=int, default=None,
                   help="use at most this many validation reviews in all (default: all; 2000 with --synthetic)")
    p.add_argument("--epochs", type=int, default=3, help="total epochs (a resumed run continues up to this)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank")
    p.add_argument("--maxlen", type=int, default=100, help="reviews are cut or padded to this many words")
    p.add_argument("--vocab", type=int, default=10000, help="vocabulary size (rarer words become OOV)")
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--units", type=int, default=32, help="units of each of the two LSTM layers")
    add_training_arguments(p, lr=2e-3, plot_help="rank 0 writes a PNG of loss and accuracy per epoch here")
    return p.parse_args()


# ----------------------------------------------------------------------------- data

def missing_data_message(path):
    return (f"imdb_lstm: no IMDB data at {path}\n"
            "This example never downloads anything. On a machine with internet access, get Keras' imdb.npz:\n"
            f"    curl -O {IMDB_URL}\n"
            "  or python -c \"import keras; keras.datasets.imdb.load_data()\"  (saves ~/.keras/datasets/imdb.npz)\n"
            "copy it to this machine and pass --data /path/to/imdb.npz; or run with --synthetic.")


def load_imdb_npz(path):
    """(x_train, y_train, x_test, y_test) from Keras' imdb.npz; reviews are arrays of word ranks."""
    # The reviews are stored as a pickled object array (as Keras stores them):
    # only load files you trust.
    with np.load(path, allow_pickle=True) as f:
        return f["x_train"], f["y_train"], f["x_test"], f["y_test"]


def synthetic_imdb(num_train, num_test, seed=1234, mean_length=120, raw_vocab=20000):
    """A corpus in imdb.npz's format with a learnable sentiment signal.

    Reviews of 60-180 words drawn with Zipf-like frequencies from 20000 word
    ranks. 100 of the frequent ranks carry sentiment (50 positive, 50
    negative); about 1 word in 8 is one of them, and each such word agrees
    with the review's label with probability 0.75 (so single words mislead,
    and only the balance over the review tells the label: the best possible
    accuracy is about 0.90 for reviews cut to 50 words, 0.96 for 100). The
    many rare neutral words let a model overfit, as on real reviews. Same
    seed, same corpus on every rank.
    """
    rng = np.random.default_rng(seed)
    n = num_train + num_test
    polar = rng.choice(np.arange(20, 1000), size=100, replace=False)
    positive, negative = polar[:50], polar[50:]
    neutral = np.setdiff1d(np.arange(1, raw_vocab), polar)
    freq = 1.0 / np.arange(1, len(neutral) + 1)
    labels = rng.integers(0, 2, n)
    lengths = rng.integers(mean_length // 2, mean_length * 3 // 2 + 1, n)
    owner = np.repeat(np.arange(n), lengths)          # review of each word
    words = rng.choice(neutral, size=len(owner), p=freq / freq.sum())
    polar_slot = rng.random(len(owner)) < 1 / 8
    positive_word = np.where(rng.random(len(owner)) < 0.75, labels[owner] == 1, labels[owner] == 0)
    sentiment = np.where(positive_word, rng.choice(positive, len(owner)), rng.choice(negative, len(owner)))
    words = np.where(polar_slot, sentiment, words)
    reviews = np.empty(n, dtype=object)
    reviews[:] = np.split(words, np.cumsum(lengths)[:-1])
    return reviews[:num_train], labels[:num_train], reviews[num_train:], labels[num_train:]


def to_padded_indices(reviews, vocab, maxlen):
    """Word ranks -> Keras imdb indices (start mark, offset, OOV), then keep the last maxlen, pre-padded."""
    out = np.full((len(reviews), maxlen), PAD, np.int32)
    for i, ranks in enumerate(reviews):
        ids = np.asarray(ranks, np.int64) + INDEX_FROM
        ids = np.concatenate([[START_CHAR], np.where(ids < vocab, ids, OOV)])[-maxlen:]
        out[i, maxlen - len(ids):] = ids
    return out


def shard(x, y, limit, rank, size, seed):
    """This rank's equal share of (x, y), after a shuffle that is the same on every rank.

    Equal shares matter: every rank must run the same number of steps, since
    each step's gradient averaging waits for all ranks.
    """
    order = np.random.default_rng(seed).permutation(len(x))[:limit]
    per_rank = len(order) // size
    mine = order[rank * per_rank:(rank + 1) * per_rank]
    return x[mine], np.asarray(y, np.float32)[mine]


# ----------------------------------------------------------------------------- model

def build_model(args, steps_per_epoch, compression):
    """Embedding -> LSTM -> LSTM -> Dense(1, sigmoid), compiled with a DistributedOptimizer."""
    model = lstm_text_classifier(args.maxlen, args.vocab, args.embedding_dim, args.units, name="imdb_lstm")

    schedule = WorkerScaledSchedule(args.lr, hvd.size(), steps_per_epoch, decay=args.lr_decay,
                                    warmup_epochs=args.warmup_epochs, max_lr=args.max_lr)
    # Averages gradients over ranks; under mixed_float16 it is also the
    # LossScaleOptimizer (the ranks reduce before checking for inf/nan).
    # sparse_as_dense: Adam densifies the Embedding's gradient anyway, and the
    # rows of all ranks together (N x batch x maxlen) outnumber the table's, so
    # each rank densifies its own rows and allreduces rather than allgathering.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(schedule), compression=compression,
                                   sparse_as_dense=True)
    # jit_compile=False: tf_mpi's collectives cannot run inside XLA.
    model.compile(optimizer=opt, loss="binary_crossentropy", metrics=["accuracy"], jit_compile=False)
    return model


# ----------------------------------------------------------------------------- callbacks

class LogLearningRate(keras.callbacks.Callback):
    """Adds the learning rate (the schedule's value for the next step) to the epoch's logs."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class RecordHistory(keras.callbacks.Callback):
    """Appends each epoch's (rank-averaged) logs to `history`, a list shared with the caller."""

    def __init__(self, history):
        super().__init__()
        self.history = history

    def on_epoch_end(self, epoch, logs=None):
        self.history.append({k: float(v) for k, v in (logs or {}).items()})


class SaveCheckpoint(keras.callbacks.Callback):
    """Rank 0 saves the model (weights, optimizer state, schedule) after every epoch.

    Writes model-epochNNN.keras, then state.json naming it (with the epoch
    count and the metrics history), then deletes the previous model file: a
    crash at any point leaves a state.json that names a complete model.
    """

    def __init__(self, directory, history):
        super().__init__()
        self.directory, self.history = directory, history

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() != 0:
            return
        name = f"model-epoch{epoch + 1:03d}.keras"
        self.model.save(os.path.join(self.directory, name))
        previous = read_checkpoint_state(self.directory)
        write_json_atomic(os.path.join(self.directory, "state.json"),
                          {"epoch": epoch + 1, "model": name, "history": self.history})
        if previous and previous["model"] != name:
            try:
                os.remove(os.path.join(self.directory, previous["model"]))
            except FileNotFoundError:
                pass


# ----------------------------------------------------------------------------- reporting

def plot_history(history, path, title):
    epochs = np.arange(1, len(history) + 1)
    fig, axes = new_figure(2, (10, 4))
    for ax, metric in zip(axes, ["loss", "accuracy"]):
        for key, style in [(metric, "o-"), ("val_" + metric, "s--")]:
            values = [h.get(key, np.nan) for h in history]
            ax.plot(epochs, values, style, label=key)
        ax.set_ylabel(metric)
    save_figure(fig, axes, path, title, "epoch")


# ----------------------------------------------------------------------------- main

def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    log = rank_logger(rank, args.verbose)

    # Data: every rank reads (or generates) the same corpus and keeps its shard.
    if args.synthetic:
        train_limit, test_limit = args.train_samples or 6000, args.test_samples or 2000
        x_train, y_train, x_test, y_test = synthetic_imdb(train_limit, test_limit)
        source = "synthetic"
    else:
        if not os.path.exists(args.data):
            # Each rank checks its own filesystem; a rank exiting non-zero ends the job.
            print(missing_data_message(args.data) if rank == 0 else f"[rank {rank}] no IMDB data at {args.data}",
                  file=sys.stderr, flush=True)
            sys.exit(2)
        x_train, y_train, x_test, y_test = load_imdb_npz(args.data)
        train_limit, test_limit = args.train_samples, args.test_samples
        source = args.data
    x_train, y_train = shard(to_padded_indices(x_train, args.vocab, args.maxlen), y_train, train_limit,
                             rank, size, seed=args.seed)
    x_test, y_test = shard(to_padded_indices(x_test, args.vocab, args.maxlen), y_test, test_limit,
                           rank, size, seed=args.seed + 1)
    steps_per_epoch = -(-len(x_train) // args.batch_size)
    log(f"imdb_lstm: {size} ranks, {len(x_train)} training and {len(x_test)} validation reviews per rank "
        f"({source}), {steps_per_epoch} steps per epoch, global batch {args.batch_size * size}, "
        f"base learning rate {worker_scaled_lr(args.lr, size, args.max_lr):.3g}")

    keras.mixed_precision.set_global_policy(args.precision)
    # Different seeds per rank shuffle each rank's shard differently; the
    # initial weights also differ, until rank 0's are broadcast at the start of fit.
    keras.utils.set_random_seed(args.seed + rank)
    compression = compression_from_args(hvd, args)

    # Resume: rank 0 reads the checkpoint state and tells the others, so every
    # rank agrees on the epoch to start from. Every rank then loads the model
    # (its optimizer comes back distributed, with its step count, so the
    # learning-rate schedule continues where it was; the learning-rate flags
    # of this run are not used), and the broadcast callback makes sure all
    # ranks start from rank 0's copy.
    model, history, initial_epoch = None, [], 0
    if args.checkpoint_dir:
        state = agreed_checkpoint_state(args.checkpoint_dir)
        if state:
            model = hvd.load_model(os.path.join(args.checkpoint_dir, state["model"]), compression=compression)
            for r in model.optimizer.residual_variables:
                # topk / gtopk: the file holds rank 0's residuals, which are not this rank's own.
                r.assign(tf.zeros_like(r))
            history, initial_epoch = state["history"], state["epoch"]
            log(f"resuming from {args.checkpoint_dir}/{state['model']}: epoch {initial_epoch + 1} of {args.epochs}")
    if model is None:
        model = build_model(args, steps_per_epoch, compression)

    callbacks = [
        # Rank 0's initial weights and optimizer state to every rank.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        LogLearningRate(),
        # Average the epoch's metrics over ranks before anything reads them.
        hvd.callbacks.MetricAverageCallback(),
        RecordHistory(history),
    ]
    if args.checkpoint_dir:
        callbacks.append(SaveCheckpoint(args.checkpoint_dir, history))

    train_start = time.time()
    epochs_before = len(history)
    if initial_epoch < args.epochs:
        model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, initial_epoch=initial_epoch,
                  validation_data=(x_test, y_test), callbacks=callbacks, shuffle=True,
                  verbose=2 if (rank == 0 or args.verbose) else 0)
    train_seconds = time.time() - train_start

    if len(history) > epochs_before:
        final = history[-1]
    else:  # nothing left to train: evaluate the checkpoint, averaged over ranks
        scores = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0, return_dict=True)
        gathered = allgather_object(scores)
        final = {"val_" + k: float(np.mean([g[k] for g in gathered])) for k in scores}

    # Data parallelism keeps the replicas identical: check it.
    residuals = {id(r) for r in model.optimizer.residual_variables}  # each rank's own (topk / gtopk)
    replicas = replica_check(model.get_weights(), [v for v in model.optimizer.variables if id(v) not in residuals])

    if rank == 0:
        if args.plot and history:
            plot_history(history, args.plot, f"IMDB LSTM, {size} ranks, {args.precision}")
            log(f"wrote {args.plot}")
        result = {
            "example": "imdb_lstm", "ranks": size, "precision": args.precision, "compression": args.compression,
            "data": source, "train_samples_per_rank": len(x_train), "batch_size": args.batch_size,
            "val_accuracy": round(final["val_accuracy"], 4), "val_loss": round(final["val_loss"], 4),
            "accuracy": round(final["accuracy"], 4) if "accuracy" in final else None,
            "loss": round(final["loss"], 4) if "loss" in final else None,
            "learning_rate": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
            "epochs": args.epochs, "initial_epoch": initial_epoch, "epochs_run": len(history) - epochs_before,
            "seconds": round(time.time() - START, 1), "train_seconds": round(train_seconds, 1),
            **replicas,
        }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
