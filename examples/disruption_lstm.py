"""Disruption prediction from multi-modal plasma time series with a stacked LSTM, data-parallel over MPI.

An FRNN-style example (after Svyatkovskiy, Kates-Harbeck and Tang (2019) and
Kates-Harbeck, Svyatkovskiy and Tang (2019)): each "shot" is a multi-channel
time series of plasma diagnostics; some shots end in a disruption. A stacked
LSTM reads a shot step by step and predicts, at every step, whether a
disruption will happen within the next --horizon steps. A shot raises an
alarm when its highest per-step prediction passes a threshold, so the shot's
score is the maximum over time of the per-step prediction, and the model is
judged by the area under the ROC curve of those scores over held-out shots
(shot-level AUC: every threshold at once).

Unlike examples/imdb_lstm.py (model.fit), this one trains with a custom loop:
a ``tf.function`` step whose gradients go through
``hvd.DistributedGradientTape`` (averaged over the ranks before they are
applied), an initial ``hvd.broadcast_variables`` of the model and optimizer
state, and a learning rate scaled with the number of ranks N as in the
paper, lr_N = lr0 * N / (1 + N / 100), with linear warm-up and per-epoch
decay (tf_mpi.keras.schedules.WorkerScaledSchedule). --batch-size is per rank.

Mixed precision (--precision mixed_float16): the model computes in float16
(its output layer in float32), and the optimizer is a Keras
LossScaleOptimizer. The step scales the loss with ``opt.scale_loss``,
reduces the *scaled* gradients across ranks first, then calls
``opt.apply``, which unscales them, checks they are finite and skips the
update and lowers the scale if not. Since the gradients were reduced first,
every rank sees the same gradients and takes the same branch. (Do not wrap
that optimizer in tf_mpi.keras.DistributedOptimizer as well: the gradients
would be reduced twice.)

Run (from the repository root; ``python -m tf_mpi.run -np N`` is ``mpirun -np N``
with the right mpirun and flags):

    # Synthetic shots, nothing to download (about a minute on 2 CPU cores):
    python -m tf_mpi.run -np 2 python examples/disruption_lstm.py

    # Mixed precision, fp16 gradients on the wire:
    mpirun -np 2 python examples/disruption_lstm.py --precision mixed_float16 --compression fp16

    # Checkpoint every epoch and plot the curves; run it again with a larger
    # --epochs to resume where it stopped:
    mpirun -np 2 python examples/disruption_lstm.py --epochs 2 --checkpoint-dir ckpt --plot curves.png
    mpirun -np 2 python examples/disruption_lstm.py --epochs 4 --checkpoint-dir ckpt --plot curves.png

Data (see synthetic_shots): every rank generates the same shots from --seed
and keeps an equal share of them (shots, not windows, are split, so no shot
is seen by two ranks). Training reads windows of --window steps cut from
the shots (one ending at the end of the shot, the others at random places
drawn anew every epoch); evaluation reads whole shots.

Output: one line per epoch on rank 0 (every rank with --verbose) and, at the
end, one line ``RESULT {...json...}`` with the final shot-level AUC and losses
(over all ranks' shots), the time taken, and whether all ranks ended with
identical weights and optimizer state.
"""
import time

START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402
from example_utils import import_tensorflow_quietly  # noqa: E402

tf = import_tensorflow_quietly()

# One compute thread per rank: with N ranks on a machine, N threads keep the
# cores busy; more would compete for them. (Set it before TensorFlow runs any
# op; raise it when a rank has several cores to itself.)
tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # noqa: E402

import tf_mpi as hvd  # noqa: E402
from tf_mpi.keras.schedules import WorkerScaledSchedule, worker_scaled_lr  # noqa: E402

from example_utils import (add_training_arguments, agreed_checkpoint_state, new_figure, rank_logger,  # noqa: E402
                           read_checkpoint_state, replica_check, save_figure, write_json_atomic,
                           compression_from_args)

# The diagnostics of the synthetic shots: (name, sampling period in steps).
# Fast magnetics every step, slow equilibrium reconstruction every 10 steps.
CHANNELS = [
    ("plasma_current", 1),
    ("locked_mode", 2),
    ("radiated_fraction", 4),
    ("internal_inductance", 10),
    ("greenwald_fraction", 5),
    ("q95", 10),
    ("beta_n", 3),
    ("stored_energy", 8),
]
# Disruption types: the channels whose precursors grow before the disruption,
# with their signs and relative strengths.
DISRUPTION_TYPES = [
    {"locked_mode": 1.0, "internal_inductance": 0.5, "beta_n": -0.4},
    {"greenwald_fraction": 1.0, "radiated_fraction": 0.7},
    {"radiated_fraction": 1.0, "beta_n": -0.6, "plasma_current": -0.3},
    {"internal_inductance": 1.0, "locked_mode": 0.6, "q95": -0.4},
]
# Channels in which harmless transients (false alarms) also appear.
TRANSIENT_CHANNELS = ["locked_mode", "radiated_fraction", "greenwald_fraction", "internal_inductance"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train-shots", type=int, default=800, help="training shots in all (split over ranks)")
    p.add_argument("--test-shots", type=int, default=400, help="held-out shots in all (split over ranks)")
    p.add_argument("--min-length", type=int, default=100, help="shortest shot, in steps")
    p.add_argument("--max-length", type=int, default=200, help="longest shot, in steps")
    p.add_argument("--disruptive-fraction", type=float, default=0.35, help="fraction of shots that disrupt")
    p.add_argument("--horizon", type=int, default=30,
                   help="a step's target is 1 if the shot disrupts within this many steps")
    p.add_argument("--noise", type=float, default=0.5, help="measurement noise (std, in signal units)")
    p.add_argument("--window", type=int, default=64, help="training window length in steps")
    p.add_argument("--windows-per-shot", type=int, default=2,
                   help="training windows per shot and epoch (the first ends with the shot)")
    p.add_argument("--epochs", type=int, default=6, help="total epochs (a resumed run continues up to this)")
    p.add_argument("--batch-size", type=int, default=32, help="windows per batch, per rank")
    p.add_argument("--units", type=int, default=32, help="units of each LSTM layer")
    p.add_argument("--layers", type=int, default=2, help="number of stacked LSTM layers")
    add_training_arguments(p, lr=3e-3, plot_help="rank 0 writes a PNG of loss and AUC per epoch here",
                           seed_help="seed of the shots and of the training")
    args = p.parse_args()
    if not 0 < args.window <= args.min_length:
        p.error("--window must be between 1 and --min-length")
    if args.horizon >= args.min_length:
        p.error("--horizon must be shorter than --min-length")
    return args


# ----------------------------------------------------------------------------- data

def _smooth_noise(rng, length, channels, scale, corr):
    """Slowly varying random signals, (length, channels): AR(1) noise with correlation `corr` per step."""
    e = rng.normal(0.0, scale * np.sqrt(1 - corr ** 2), (length, channels))
    out = np.empty((length, channels))
    acc = rng.normal(0.0, scale, channels)
    for t in range(length):
        acc = corr * acc + e[t]
        out[t] = acc
    return out


def synthetic_shots(num_shots, seed, min_length=100, max_length=200, disruptive_fraction=0.35,
                    noise=0.5, horizon=30):
    """Shots of len(CHANNELS) diagnostics on a common time base, some ending in a disruption.

    Each shot has a random length in [min_length, max_length] steps. Every
    channel is an operating level that differs from shot to shot, plus slow
    drifts (AR(1)), plus measurement noise (std `noise`); it is sampled every
    `period` steps (CHANNELS) and held until the next sample, as slow
    diagnostics are when resampled onto a fast common time base.

    A `disruptive_fraction` of the shots end in a disruption at their last
    step. Over its last 30 to 80 steps, precursors grow (roughly
    exponentially) in the channels of one of four disruption types
    (DISRUPTION_TYPES: locked mode, density limit, radiative collapse, high
    internal inductance), with a strength that varies from shot to shot (some
    are barely above the noise). Harmless transients, rising and decaying in
    one channel, appear in about half of all shots: a precursor-like bump that
    does not end in a disruption, so a high value alone is not an alarm.

    Returns (signals, disruptive, targets): a list of float32 arrays of shape
    (length, channels), a 0/1 array per shot, and a list of per-step 0/1
    targets (1 on the last `horizon` steps of disruptive shots). The same
    seed gives the same shots on every rank.
    """
    rng = np.random.default_rng(seed)
    names = [name for name, _ in CHANNELS]
    index = {name: i for i, name in enumerate(names)}
    signals, disruptive, targets = [], [], []
    for _ in range(num_shots):
        length = int(rng.integers(min_length, max_length + 1))
        t = np.arange(length)
        levels = rng.normal(0.0, 0.3, len(CHANNELS))
        clean = levels + _smooth_noise(rng, length, len(CHANNELS), 0.3, 0.97)
        # Harmless transients: up and down again, well before the end of the shot.
        if rng.random() < 0.5:
            c = index[TRANSIENT_CHANNELS[rng.integers(len(TRANSIENT_CHANNELS))]]
            width = rng.uniform(4, 12)
            center = rng.uniform(0.1 * length, length - 3 * width)
            clean[:, c] += rng.uniform(0.5, 2.5) * np.exp(-0.5 * ((t - center) / width) ** 2)
        is_disruptive = rng.random() < disruptive_fraction
        if is_disruptive:
            kind = DISRUPTION_TYPES[rng.integers(len(DISRUPTION_TYPES))]
            duration = rng.uniform(30, 80)
            strength = rng.uniform(1.0, 3.0)
            growth = rng.uniform(1.0, 2.5)
            u = np.clip((t - (length - 1 - duration)) / duration, 0.0, 1.0)
            shape = np.expm1(growth * u) / np.expm1(growth)          # 0 before onset, 1 at the disruption
            for name, weight in kind.items():
                clean[:, index[name]] += strength * weight * shape
        # Sample each channel at its own rate (with a random phase), hold in between, add noise.
        sig = np.empty((length, len(CHANNELS)), np.float32)
        for c, (_, period) in enumerate(CHANNELS):
            sample_at = np.arange(int(rng.integers(period)), length, period)
            measured = clean[sample_at, c] + rng.normal(0.0, noise, len(sample_at))
            held = np.searchsorted(sample_at, t, side="right") - 1        # last sample at or before t
            sig[:, c] = np.where(held >= 0, measured[np.maximum(held, 0)], measured[0])
        target = np.zeros(length, np.float32)
        if is_disruptive:
            target[-horizon:] = 1.0
        signals.append(sig)
        disruptive.append(int(is_disruptive))
        targets.append(target)
    return signals, np.array(disruptive, np.int32), targets


def normalize(shots, mean, std):
    return [((s - mean) / std).astype(np.float32) for s in shots]


def shard_shots(num_shots, rank, size, seed):
    """Indices of this rank's equal share of the shots, after a shuffle that is the same on every rank.

    Equal shares matter: every rank must run the same number of steps, since
    each step's gradient averaging waits for all ranks.
    """
    order = np.random.default_rng(seed).permutation(num_shots)
    per_rank = num_shots // size
    return order[rank * per_rank:(rank + 1) * per_rank]


def training_windows(signals, targets, window, per_shot, seed):
    """`per_shot` windows of `window` steps from each shot: the first ends with the shot, the others are random.

    Returns (x, y) of shapes (windows, window, channels) and (windows, window),
    shuffled. Same count for every shot, hence on every rank.
    """
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for sig, tgt in zip(signals, targets):
        length = len(sig)
        starts = [length - window] + list(rng.integers(0, length - window + 1, per_shot - 1))
        for s in starts:
            xs.append(sig[s:s + window])
            ys.append(tgt[s:s + window])
    order = rng.permutation(len(xs))
    return np.stack(xs)[order], np.stack(ys)[order]


def pad_shots(signals, targets):
    """Whole shots padded at the end to the longest: (x, y, mask). The LSTM is causal, so padding at the
    end leaves the predictions at the real steps unchanged."""
    n, longest, channels = len(signals), max(len(s) for s in signals), signals[0].shape[1]
    x = np.zeros((n, longest, channels), np.float32)
    y = np.zeros((n, longest), np.float32)
    mask = np.zeros((n, longest), bool)
    for i, (sig, tgt) in enumerate(zip(signals, targets)):
        x[i, :len(sig)], y[i, :len(sig)], mask[i, :len(sig)] = sig, tgt, True
    return x, y, mask


# ----------------------------------------------------------------------------- metrics

def roc_auc(labels, scores):
    """Area under the ROC curve: P(score of a random positive > score of a random negative), ties count 1/2.

    The Mann-Whitney U statistic from the ranks of the scores (tied scores get
    their average rank). NaN unless there are both positives and negatives.
    """
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, np.float64)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores))
    # Average rank (1-based) over each run of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = 0.5 * (s + 1 + e)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def weighted_bce(logits, targets, positive_weight, negative_weight):
    """Per-step binary cross-entropy with class weights (positive steps are rare)."""
    per_step = tf.nn.sigmoid_cross_entropy_with_logits(labels=targets, logits=logits)
    return per_step * (targets * positive_weight + (1.0 - targets) * negative_weight)


# ----------------------------------------------------------------------------- model

def build_model(args):
    """(steps, channels) -> stacked LSTM -> per-step logit. Any number of steps (windows or whole shots)."""
    inputs = keras.Input((None, len(CHANNELS)), name="signals")
    x = inputs
    for i in range(args.layers):
        x = keras.layers.LSTM(args.units, return_sequences=True, name=f"lstm{i + 1}")(x)
    # The output stays float32 under mixed_float16 for a numerically stable loss.
    logits = keras.layers.Dense(1, dtype="float32", name="logit")(x)
    return keras.Model(inputs, logits, name="disruption_lstm")


def build_optimizer(args, steps_per_epoch, num_workers):
    schedule = WorkerScaledSchedule(args.lr, num_workers, steps_per_epoch, decay=args.lr_decay,
                                    warmup_epochs=args.warmup_epochs, max_lr=args.max_lr)
    opt = keras.optimizers.Adam(schedule)
    if args.precision == "mixed_float16":
        # Dynamic loss scaling. Not wrapped in tf_mpi's DistributedOptimizer:
        # the training step reduces the gradients itself.
        opt = keras.optimizers.LossScaleOptimizer(opt)
    return opt


def current_lr(opt):
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(directory, epoch, model, opt, history, args):
    """Rank 0: the model weights and optimizer variables (with its step count, hence the learning
    rate schedule's position, and the loss scale) in ckpt-epochNNN.npz, then state.json naming it,
    then the previous file deleted: a crash at any point leaves a state.json naming a complete file."""
    name = f"ckpt-epoch{epoch:03d}.npz"
    arrays = {f"model_{i:04d}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"opt_{i:04d}": keras.ops.convert_to_numpy(v) for i, v in enumerate(opt.variables)})
    tmp = os.path.join(directory, name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, os.path.join(directory, name))
    previous = read_checkpoint_state(directory)
    write_json_atomic(os.path.join(directory, "state.json"),
                      {"epoch": epoch, "file": name, "history": history, "precision": args.precision,
                       "optimizer_variables": [v.path for v in opt.variables]})
    if previous and previous["file"] != name:
        try:
            os.remove(os.path.join(directory, previous["file"]))
        except FileNotFoundError:
            pass


def load_checkpoint(directory, state, model, opt):
    """Every rank: restores the model weights and the (already built) optimizer's variables."""
    with np.load(os.path.join(directory, state["file"])) as f:
        model_keys = sorted(k for k in f.files if k.startswith("model_"))
        opt_keys = sorted(k for k in f.files if k.startswith("opt_"))
        if len(opt_keys) != len(opt.variables):
            raise ValueError(f"checkpoint has {len(opt_keys)} optimizer variables, this optimizer "
                             f"{len(opt.variables)} (saved with --precision {state.get('precision')}?)")
        model.set_weights([f[k] for k in model_keys])
        for v, k in zip(opt.variables, opt_keys):
            v.assign(f[k])


# ----------------------------------------------------------------------------- reporting

def plot_history(history, path, title):
    epochs = np.arange(1, len(history) + 1)
    fig, axes = new_figure(2, (10, 4))
    for key, style, label in [("loss", "o-", "loss (training windows)"),
                              ("val_loss", "s--", "val_loss (held-out shots)")]:
        axes[0].plot(epochs, [h.get(key, np.nan) for h in history], style, label=label)
    axes[0].set_ylabel("weighted per-step cross-entropy")
    for key, style in [("auc", "o-"), ("train_auc", "s--")]:
        axes[1].plot(epochs, [h.get(key, np.nan) for h in history], style,
                     label={"auc": "held-out shots", "train_auc": "training shots"}[key])
    axes[1].set_ylabel("shot-level ROC AUC")
    save_figure(fig, axes, path, title, "epoch")


# ----------------------------------------------------------------------------- main

def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    log = rank_logger(rank, args.verbose)

    # Data: every rank generates the same shots and keeps its share. The
    # normalization uses all training shots, so it is the same everywhere.
    gen = dict(min_length=args.min_length, max_length=args.max_length, horizon=args.horizon,
               disruptive_fraction=args.disruptive_fraction, noise=args.noise)
    train_sig, train_dis, train_tgt = synthetic_shots(args.train_shots, args.seed, **gen)
    test_sig, test_dis, test_tgt = synthetic_shots(args.test_shots, args.seed + 1, **gen)
    all_steps = np.concatenate(train_sig)
    mean, std = all_steps.mean(axis=0), all_steps.std(axis=0) + 1e-6
    train_sig, test_sig = normalize(train_sig, mean, std), normalize(test_sig, mean, std)
    mine = shard_shots(args.train_shots, rank, size, args.seed)
    train_sig, train_dis, train_tgt = [train_sig[i] for i in mine], train_dis[mine], [train_tgt[i] for i in mine]
    mine = shard_shots(args.test_shots, rank, size, args.seed + 1)
    test_sig, test_dis, test_tgt = [test_sig[i] for i in mine], test_dis[mine], [test_tgt[i] for i in mine]
    if len(train_sig) == 0 or len(test_sig) == 0:
        raise SystemExit(f"disruption_lstm: too few shots for {size} ranks")

    windows_per_rank = len(train_sig) * args.windows_per_shot
    # Full batches only (the few windows left over change every epoch): the
    # training step is traced once, for a fixed batch shape.
    steps_per_epoch = windows_per_rank // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"disruption_lstm: fewer than --batch-size {args.batch_size} windows per rank")
    # Class weights that balance the positive and negative steps of the
    # training windows (over all ranks: one allreduce), each class then
    # weighs half of the loss.
    _, y0 = training_windows(train_sig, train_tgt, args.window, args.windows_per_shot, seed=0)
    counts = hvd.allreduce(tf.constant([y0.sum(), y0.size], tf.float64), op=hvd.Sum,
                           name="disruption.class_counts").numpy()
    positive_fraction = float(counts[0] / counts[1])
    pos_w, neg_w = 0.5 / positive_fraction, 0.5 / (1 - positive_fraction)
    log(f"disruption_lstm: {size} ranks, {len(train_sig)} training and {len(test_sig)} held-out shots per rank "
        f"({train_dis.mean():.0%} disruptive), {windows_per_rank} windows of {args.window} steps per epoch and rank, "
        f"{steps_per_epoch} steps per epoch, global batch {args.batch_size * size}, "
        f"base learning rate {worker_scaled_lr(args.lr, size, args.max_lr):.3g}, "
        f"positive steps {positive_fraction:.1%}")

    keras.mixed_precision.set_global_policy(args.precision)
    # Different seeds per rank: the initial weights differ until rank 0's are broadcast.
    keras.utils.set_random_seed(args.seed + rank)
    compression = compression_from_args(hvd, args)  # topk / gtopk residuals start at zero, also on resume

    model = build_model(args)
    opt = build_optimizer(args, steps_per_epoch, size)
    # Create the optimizer's variables now (outside tf.function), so they
    # can be restored and broadcast before the first step.
    opt.build(model.trainable_variables)

    # Resume: rank 0 reads the checkpoint state and tells the others, so every
    # rank agrees on the epoch to start from; every rank loads the file; then
    # rank 0's state is broadcast anyway (as after a fresh start).
    history, initial_epoch = [], 0
    if args.checkpoint_dir:
        state = agreed_checkpoint_state(args.checkpoint_dir)
        if state:
            load_checkpoint(args.checkpoint_dir, state, model, opt)
            history, initial_epoch = state["history"], state["epoch"]
            log(f"resuming from {args.checkpoint_dir}/{state['file']}: "
                + (f"epoch {initial_epoch + 1} of {args.epochs}" if initial_epoch < args.epochs
                   else f"{initial_epoch} epochs done, nothing left to train (evaluating)"))
    # Rank 0's weights and optimizer state (step count, moments, loss scale) to every rank.
    hvd.broadcast_variables(model.variables + list(opt.variables), root_rank=0)

    channels = len(CHANNELS)
    pos_w_t, neg_w_t = tf.constant(pos_w, tf.float32), tf.constant(neg_w, tf.float32)

    # A fully static input shape: with an unknown batch size, the gradient of
    # the Dense kernel (applied to a 3-D tensor) has an unknown static shape,
    # which tf_mpi's gradient grouping cannot size.
    @tf.function(input_signature=[tf.TensorSpec([args.batch_size, args.window, channels], tf.float32),
                                  tf.TensorSpec([args.batch_size, args.window], tf.float32)])
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = tf.squeeze(model(x, training=True), -1)
            loss = tf.reduce_mean(weighted_bce(logits, y, pos_w_t, neg_w_t))
            scaled = opt.scale_loss(loss)          # loss * dynamic scale under mixed_float16, else loss
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(scaled, model.trainable_variables)   # averaged over the ranks
        opt.apply(grads, model.trainable_variables)  # LossScaleOptimizer: unscale, check finite, apply or skip
        return loss

    @tf.function(input_signature=[tf.TensorSpec([None, None, channels], tf.float32)])
    def predict_logits(x):
        return tf.squeeze(model(x, training=False), -1)

    def evaluate(signals, targets, disruptive, tag):
        """Weighted per-step loss and shot-level AUC over every rank's shots (identical on all ranks)."""
        x, y, mask = pad_shots(signals, targets)
        logits = np.concatenate([predict_logits(x[i:i + 128]).numpy() for i in range(0, len(x), 128)])
        per_step = weighted_bce(logits, y, pos_w, neg_w).numpy()
        scores = np.where(mask, 1 / (1 + np.exp(-logits)), -np.inf).max(axis=1)  # shot score: max over time
        loss_sum = hvd.allreduce(tf.constant([per_step[mask].sum(), mask.sum()], tf.float64), op=hvd.Sum,
                                 name=f"disruption.{tag}_loss").numpy()
        all_scores = hvd.allgather(tf.constant(scores, tf.float64), name=f"disruption.{tag}_scores").numpy()
        all_labels = hvd.allgather(tf.constant(disruptive, tf.int32), name=f"disruption.{tag}_labels").numpy()
        return float(loss_sum[0] / loss_sum[1]), roc_auc(all_labels, all_scores)

    train_start = time.time()
    for epoch in range(initial_epoch, args.epochs):
        epoch_start = time.time()
        # New random windows and order every epoch; the same on a resumed run.
        x, y = training_windows(train_sig, train_tgt, args.window, args.windows_per_shot,
                                seed=args.seed * 1000003 + epoch * 1009 + rank)
        losses = [train_step(x[i:i + args.batch_size], y[i:i + args.batch_size]).numpy()
                  for i in range(0, steps_per_epoch * args.batch_size, args.batch_size)]
        train_loss = float(hvd.allreduce(tf.constant(np.mean(losses), tf.float64), op=hvd.Average,
                                         name="disruption.train_loss").numpy())
        val_loss, auc = evaluate(test_sig, test_tgt, test_dis, "val")
        _, train_auc = evaluate(train_sig, train_tgt, train_dis, "train")
        entry = {"loss": train_loss, "val_loss": val_loss, "auc": auc, "train_auc": train_auc,
                 "learning_rate": current_lr(opt), "seconds": time.time() - epoch_start}
        if args.precision == "mixed_float16":
            entry["loss_scale"] = float(keras.ops.convert_to_numpy(opt.dynamic_scale))
        history.append(entry)
        log(f"epoch {epoch + 1}/{args.epochs}: loss {train_loss:.4f}, val_loss {val_loss:.4f}, "
            f"auc {auc:.4f}, train_auc {train_auc:.4f}, lr {entry['learning_rate']:.3g}"
            + (f", loss scale {entry['loss_scale']:g}" if "loss_scale" in entry else "")
            + f" ({entry['seconds']:.1f} s)")
        if args.checkpoint_dir and rank == 0:
            save_checkpoint(args.checkpoint_dir, epoch + 1, model, opt, history, args)
    train_seconds = time.time() - train_start
    epochs_run = max(0, args.epochs - initial_epoch)

    if epochs_run:
        final = history[-1]
    else:  # nothing left to train: evaluate the checkpoint
        val_loss, auc = evaluate(test_sig, test_tgt, test_dis, "val")
        final = {"loss": history[-1]["loss"] if history else None, "val_loss": val_loss, "auc": auc}

    # Data parallelism keeps the replicas identical: check it.
    replicas = replica_check(model.get_weights(), opt.variables)

    if rank == 0:
        if args.plot and history:
            plot_history(history, args.plot, f"Disruption LSTM, {size} ranks, {args.precision}")
            log(f"wrote {args.plot}")
        result = {
            "example": "disruption_lstm", "ranks": size, "precision": args.precision,
            "compression": args.compression, "train_shots_per_rank": len(train_sig),
            "test_shots": len(test_sig) * size, "batch_size": args.batch_size, "window": args.window,
            "auc": round(final["auc"], 4), "val_loss": round(final["val_loss"], 4),
            "loss": None if final.get("loss") is None else round(final["loss"], 4),
            "learning_rate": current_lr(opt),
            "epochs": args.epochs, "initial_epoch": initial_epoch, "epochs_run": epochs_run,
            "seconds": round(time.time() - START, 1), "train_seconds": round(train_seconds, 1),
            **replicas,
        }
        if args.precision == "mixed_float16":
            result["loss_scale"] = float(keras.ops.convert_to_numpy(opt.dynamic_scale))
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
