"""Horovod 0.28.1's Keras elastic callbacks, run on every rank by
tests/test_horovod_api_compat.py at np=2.

Expected counts come from the rules of Horovod's ``horovod/_keras/elastic.py``,
written out below as a formula (``horovod_commits``), never from tf_mpi's
output. With the callbacks in the order of Horovod's TF2 elastic example
(UpdateEpochStateCallback, UpdateBatchStateCallback, CommitStateCallback):

- CommitStateCallback commits after every ``k``-th batch, counting across
  epochs from the start of each ``fit`` (``on_train_begin`` resets the count),
  and at every epoch end;
- UpdateBatchStateCallback sets ``state.batch`` to the finished batch's index,
  to 0 at epoch end, and at each epoch start sets ``params['steps']`` to the
  fit's epoch length minus ``state.batch``;
- UpdateEpochStateCallback sets ``state.epoch`` to (``state.epoch`` when fit
  began) + Keras's epoch index + 1 at epoch end.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi.keras as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()

from mpi4py import MPI  # noqa: E402  (after init: tf_mpi initialised MPI)

WORLD = MPI.COMM_WORLD
BATCH = 2


def horovod_commits(start_epoch, epochs, steps, per_commit):
    """[(position, (state.epoch, state.batch))] of every commit of one fit, by Horovod's rules.

    position is (epoch index, batch index) for a commit at a batch end and
    (epoch index, steps) for the one at the epoch end, so positions sort in
    the order the commits happen.
    """
    log = []
    for e in range(epochs):
        for b in range(steps):
            if (e * steps + b + 1) % per_commit == 0:  # the count runs across epochs
                log.append(((e, b), (start_epoch + e, b)))
        log.append(((e, steps), (start_epoch + e + 1, 0)))
    return log


class CountingState(hvd.elastic.KerasState):
    """A KerasState that also notes (epoch, batch) at each commit (the commit itself is the real one)."""

    def __init__(self, *args, **kwargs):
        self.commits = []
        super().__init__(*args, **kwargs)

    def commit(self):
        self.commits.append((self.epoch, self.batch))
        super().commit()


class Recorder(keras.callbacks.Callback):
    """Placed after the elastic callbacks: notes what they left in the state and in params."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_param, self.batches_run, self.at_batch_end, self.at_epoch_end = [], [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps_param.append(self.params["steps"])
        self.batches_run.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.batches_run[-1] += 1
        self.at_batch_end.append((self.state.epoch, self.state.batch))

    def on_epoch_end(self, epoch, logs=None):
        self.at_epoch_end.append((self.state.epoch, self.state.batch))

    def on_train_end(self, logs=None):
        self.final_weights = [w.numpy().copy() for w in self.model.weights]


def make_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="d")(keras.layers.Dense(3)(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    return model


def data(steps):
    rng = np.random.default_rng(R)
    return (rng.normal(size=(steps * BATCH, 4)).astype(np.float32),
            rng.normal(size=(steps * BATCH, 2)).astype(np.float32))


def elastic_callbacks(state, per_commit):
    return [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=per_commit)]


def fit(model, state, callbacks, epochs, steps, extra=()):
    rec = Recorder(state)
    x, y = data(steps)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[*callbacks, *extra, rec])
    return rec


def same_on_every_rank(value):
    assert all(v == value for v in WORLD.allgather(value)), WORLD.allgather(value)


def check_horovod_formula_matches_the_counts_of_the_audit():
    """The reference itself: 2 epochs x 4 batches, a commit every 3 batches -> 4 commits in Horovod."""
    log = horovod_commits(0, 2, 4, 3)
    assert [pos for pos, _ in log] == [(0, 2), (0, 4), (1, 1), (1, 4)], log
    assert [s for _, s in log] == [(0, 2), (1, 0), (1, 1), (2, 0)], log


def check_commits_epoch_and_batch_follow_horovod():
    for epochs, steps, per_commit in [(2, 4, 3), (3, 5, 2), (2, 3, 1)]:
        model = make_model(7)
        state = CountingState(model, epoch=0, batch=0)
        rec = fit(model, state, elastic_callbacks(state, per_commit), epochs, steps)
        expected = horovod_commits(0, epochs, steps, per_commit)
        case = (epochs, steps, per_commit)
        assert len(state.commits) == epochs + epochs * steps // per_commit, (case, state.commits)
        assert state.commits == [s for _, s in expected], (case, state.commits, expected)
        assert rec.at_batch_end == [(e, b) for e in range(epochs) for b in range(steps)], (case, rec.at_batch_end)
        assert rec.at_epoch_end == [(e + 1, 0) for e in range(epochs)], (case, rec.at_epoch_end)
        assert rec.steps_param == [steps] * epochs and rec.batches_run == [steps] * epochs, case
        assert (state.epoch, state.batch) == (epochs, 0), case
        # The epoch-end commit saved the trained weights with epoch and batch; restore() returns to it.
        model.weights[0].assign(tf.zeros(model.weights[0].shape))
        state.epoch, state.batch = 99, 99
        state.restore()
        assert (state.epoch, state.batch) == (epochs, 0), case
        for w, saved in zip(model.weights, rec.final_weights):
            assert np.array_equal(w.numpy(), saved), (case, w.path)
        same_on_every_rank(state.commits)


def check_each_fit_restarts_the_commit_count_and_reads_the_epoch_again():
    steps, per_commit = 4, 3
    model = make_model(8)
    state = CountingState(model, epoch=0, batch=0)
    callbacks = elastic_callbacks(state, per_commit)  # the same callback objects for both fits
    fit(model, state, callbacks, 1, steps)
    assert state.commits == [s for _, s in horovod_commits(0, 1, steps, per_commit)], state.commits
    assert (state.epoch, state.batch) == (1, 0)
    # As after a restore or a sync: a different epoch than the one the callback was built with.
    state.epoch = 4
    state.commits.clear()
    fit(model, state, callbacks, 1, steps)
    # Without the restart the count would go on from the first fit (a commit after the 2nd batch);
    # without reading state.epoch again, the epoch would end at 0 + 0 + 1.
    assert state.commits == [s for _, s in horovod_commits(4, 1, steps, per_commit)], state.commits
    assert (state.epoch, state.batch) == (5, 0)


def check_a_restart_resumes_from_the_last_commit():
    total, steps, per_commit, stop_at = 3, 4, 3, (1, 1)  # interrupt the first try at epoch 1, batch 1
    model = make_model(20 + R)  # different weights on each rank: run() syncs rank 0's
    state = CountingState(model, epoch=5 * R, batch=R)  # rank 0: (0, 0); run() syncs them too
    callbacks = elastic_callbacks(state, per_commit)
    tries, recorders = [], []

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if len(tries) == 1 and (state.epoch, batch) == stop_at:
                state.epoch = 77 + R  # never committed: the retry syncs rank 0's last commit instead
                raise hvd.elastic.HostsUpdatedInterrupt(skip_sync=False)

    @hvd.elastic.run
    def train(state):
        tries.append((state.epoch, state.batch))
        for w in model.weights:
            assert np.array_equal(w.numpy(), WORLD.bcast(w.numpy(), root=0)), w.path
        rec = Recorder(state)
        recorders.append(rec)
        x, y = data(steps)
        model.fit(x, y, batch_size=BATCH, epochs=total - state.epoch, shuffle=False, verbose=0,
                  callbacks=[*callbacks, Interrupt(), rec])
        return state.epoch, state.batch

    result = train(state)
    assert result == (total, 0), result
    first = [s for pos, s in horovod_commits(0, total, steps, per_commit) if pos <= stop_at]
    resumed_epoch, resumed_batch = first[-1]
    assert (resumed_epoch, resumed_batch) == (1, 1), first  # by hand: the commit after global batch 6 of 12
    assert tries == [(0, 0), (resumed_epoch, resumed_batch)], tries
    retry = horovod_commits(resumed_epoch, total - resumed_epoch, steps, per_commit)
    assert state.commits == first + [s for _, s in retry], state.commits
    assert recorders[0].steps_param == [steps, steps], recorders[0].steps_param
    rec = recorders[1]
    # Horovod's params['steps']: the epoch length minus state.batch, then the full length again.
    assert rec.steps_param == [steps - resumed_batch, steps], rec.steps_param
    # Keras 3 runs the epoch length fixed when fit began, whatever params['steps'] says.
    assert rec.batches_run == [steps] * (total - resumed_epoch), rec.batches_run
    assert rec.at_epoch_end == [(e, 0) for e in range(resumed_epoch + 1, total + 1)], rec.at_epoch_end
    same_on_every_rank(state.commits)


def check_data_of_unknown_length_leaves_params_steps_unset():
    epochs, steps, per_commit = 2, 3, 2
    model = make_model(9)
    state = CountingState(model, epoch=0, batch=0)
    x, y = data(steps)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(BATCH)
    assert int(ds.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    rec = Recorder(state)
    model.fit(ds, epochs=epochs, verbose=0, callbacks=[*elastic_callbacks(state, per_commit), rec])
    assert rec.steps_param == [None] * epochs, rec.steps_param
    assert rec.batches_run == [steps] * epochs, rec.batches_run
    assert state.commits == [s for _, s in horovod_commits(0, epochs, steps, per_commit)], state.commits
    assert (state.epoch, state.batch) == (epochs, 0)


if __name__ == "__main__":
    run_checks(globals(), R)
