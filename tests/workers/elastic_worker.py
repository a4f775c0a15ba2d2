"""Elastic training under failures and growth, checked against a replay of the same schedule.

Launched by tests/test_elastic.py with `python -m tf_mpi.run --min-np ... --max-np ...` (elastic
mode). The scenario comes from the environment:

  ELASTIC_MODE      tape (a tf.function loop with DistributedGradientTape) or fit (model.fit with
                    the Keras elastic callbacks)
  ELASTIC_FAULTS    "R@S[:SIG],...": the rank that started as world rank R sends itself SIG (KILL
                    or STOP; default KILL) when the step count reaches S (tape: before step S+1;
                    fit: inside model.fit, at the end of step S, before its commit); "R@reset"
                    while the job recovers from the first loss (in a reset callback)
  ELASTIC_GROW_AT   step at which rank 0 creates ELASTIC_OUT/grow (the test's discovery script
                    then lists more slots) and waits until its discovery has seen them
  ELASTIC_STEPS     total optimizer steps
  ELASTIC_OUT       directory for rank 0's result.json and the failing ranks' kill times
  ELASTIC_START_CRASH "R@WHERE": the rank started as world rank R crashes (SIGSEGV, as Open MPI's
                    start-up crash does) while the job starts, once: WHERE is before-init (before
                    hvd.init(), MPI not started yet), mpi-init (MPI started, the other ranks inside
                    their first collective: elastic mode's duplicate of MPI_COMM_WORLD), engine-init
                    (the other ranks inside the engine's start-up collectives) or after-init (right
                    after hvd.init())
  ELASTIC_STEP_SLEEP  seconds each rank sleeps after each step (tape mode; default 0), and rank 0
                    writes ELASTIC_OUT/progress.json ({"step", "size"}) after each commit: lets a
                    test act while the job trains (tests/test_elastic_hosts.py kills a host)

Data: the job consumes the rows in order (tf_mpi.data.shard_arrays with batch_size, skip=rows
committed so far): a step on n ranks trains on the next n*B rows, rank r on its B of them, so the
average of the ranks' gradients is the gradient of the mean loss over those n*B rows. Every
committed step records n; rank 0 then replays the committed schedule in one process (no
collectives) from the same initial weights and compares: the elastic run must give the same
weights to float tolerance, and every rank the same weights bit for bit. A step redone after a
loss trains on the rows of that step again (the lost attempt was rolled back), shared among the
ranks that remain; no row is trained on twice in the committed schedule.
"""
import json
import os
import signal
import sys
import time

import numpy as np

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi as hvd  # noqa: E402
import tf_mpi.keras as hvd_keras  # noqa: E402
from tf_mpi import membership  # noqa: E402

B = 8              # rows per rank per step
ROWS = 512         # the data set
FEATURES = 6
COMMIT_EVERY = 2


def data():
    rng = np.random.RandomState(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(ROWS, 1))).astype(np.float32)
    return x, y




def make_model():
    keras.utils.set_random_seed(1234)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    return model


def make_optimizer():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def parse_faults():
    out = {}
    for item in filter(None, os.environ.get("ELASTIC_FAULTS", "").split(",")):
        who, _, rest = item.partition("@")
        step, _, sig = rest.partition(":")
        out[int(who)] = (step if step == "reset" else int(step), sig or "KILL")
    return out


def weights_vector(model):
    return np.concatenate([v.numpy().ravel() for v in model.weights])


def replay(sizes):
    """One process, no collectives: the committed schedule on the global rows."""
    x, y = data()
    model, opt = make_model(), make_optimizer()
    done = 0
    for n in sizes:
        idx = np.arange(done, done + n * B)
        done += n * B
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[idx], training=True) - y[idx]))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
    return weights_vector(model)


START_CRASH_POINTS = ("before-init", "mpi-init", "engine-init", "after-init")


def arm_start_crash():
    """ELASTIC_START_CRASH: makes this process crash with SIGSEGV at a point of the job's start-up
    (test-only fault injection, standing for Open MPI's crash of a rank inside MPI_Init).

    Returns the point where this process crashes (None: it does not). The rank is the launch's
    world rank (OMPI_COMM_WORLD_RANK, known before MPI starts); a process spawned later to grow the
    job is never the one (the crash is marked in ELASTIC_OUT, once)."""
    spec = os.environ.get("ELASTIC_START_CRASH", "")
    if not spec:
        return None
    who, _, where = spec.partition("@")
    assert where in START_CRASH_POINTS, spec
    out = os.environ["ELASTIC_OUT"]
    if os.environ.get("OMPI_COMM_WORLD_RANK") != who or os.path.exists(os.path.join(out, "start_crash.json")):
        return None
    if where == "mpi-init":
        # Right after MPI_Init, before this rank joins the first collective the others are in.
        original = membership._dup_of_survivors

        def dup_of_survivors(MPI, world):
            crash(where, delay=1.0)
            return original(MPI, world)
        membership._dup_of_survivors = dup_of_survivors
    elif where == "engine-init":
        # Once elastic mode's communicator exists, before the engine starts on it: the others are
        # in the engine's start-up collectives by then.
        original_start = membership.start

        def start():
            comm = original_start()
            crash(where, delay=1.0)
            return comm
        membership.start = start
    return where


def crash(where, delay=0.0):
    out = os.environ["ELASTIC_OUT"]
    with open(os.path.join(out, "start_crash.json"), "w") as f:
        json.dump({"time": time.time(), "where": where, "pid": os.getpid()}, f)
    time.sleep(delay)  # the other ranks are inside the collective by then
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)


def main():
    start_crash = arm_start_crash()
    if start_crash == "before-init":
        crash(start_crash)
    hvd.init()
    if start_crash == "after-init":
        crash(start_crash)
    out = os.environ["ELASTIC_OUT"]
    mode = os.environ.get("ELASTIC_MODE", "tape")
    steps = int(os.environ.get("ELASTIC_STEPS", "12"))
    faults = parse_faults()
    # Ranks spawned to grow the job have no world rank among the first ones.
    me = -1 if membership.spawned() else hvd.rank()
    x, y = data()
    model, opt = make_model(), make_optimizer()
    model(x[:1])
    opt.build(model.trainable_variables)
    events = {"resets": [], "first_step_after_reset": [], "sizes_seen": []}

    def on_reset():
        events["resets"].append((time.time(), hvd.size()))
        events["pending_first_step"] = True
        if faults.get(me, (None,))[0] == "reset":
            kill_self("reset", "KILL")

    def kill_self(step, sig):
        with open(os.path.join(out, f"fault{me}.json"), "w") as f:
            json.dump({"time": time.time(), "signal": sig, "step": step}, f)
        os.kill(os.getpid(), getattr(signal, "SIG" + sig))
        time.sleep(60)  # a stopped process resumes here only if continued

    grow_at = int(os.environ.get("ELASTIC_GROW_AT", "-1"))

    def maybe_grow(state):
        if state.step != grow_at or hvd.rank() != 0 or os.path.exists(os.path.join(out, "grow")):
            return
        open(os.path.join(out, "grow"), "w").close()
        deadline = time.time() + 20
        while not membership.pending_hosts() and time.time() < deadline:
            time.sleep(0.1)

    def note_step():
        if events.pop("pending_first_step", False):
            events["first_step_after_reset"].append(time.time())

    def maybe_fail(state):
        maybe_grow(state)
        if me in faults and state.step == faults[me][0]:
            kill_self(state.step, faults[me][1])

    step_sleep = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))

    def note_progress(state):
        if step_sleep and hvd.rank() == 0:
            with open(os.path.join(out, "progress.json.tmp"), "w") as f:
                json.dump({"step": state.step, "size": hvd.size()}, f)
            os.replace(os.path.join(out, "progress.json.tmp"), os.path.join(out, "progress.json"))

    if mode == "tape":
        state = hvd.elastic.TensorFlowKerasState(model, opt, step=0, sizes=(), samples=0)

        @tf.function
        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss

        @hvd.elastic.run
        def train(state):
            while state.step < steps:
                maybe_fail(state)
                xs, ys = hvd.data.shard_arrays(x, y, batch_size=B, skip=state.samples)
                train_step(tf.constant(xs[:B]), tf.constant(ys[:B]))
                note_step()
                state.sizes = state.sizes + (hvd.size(),)
                state.samples += hvd.size() * B
                state.step += 1
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
                    note_progress(state)
                time.sleep(step_sleep)
    else:
        model.compile(optimizer=hvd_keras.DistributedOptimizer(opt), loss="mse")
        # The state takes the compiled (distributed) optimizer: DistributedOptimizer(opt) has
        # variables of its own, which model.fit updates.
        state = hvd_keras.elastic.KerasState(model, step=0, sizes=(), samples=0, epoch=0, batch=0)

        class Schedule(keras.callbacks.Callback):
            """Notes each finished step in the state (before the commit callback saves it)."""

            def on_train_batch_end(self, batch, logs=None):
                note_step()
                state.sizes = state.sizes + (hvd.size(),)
                state.samples += hvd.size() * B
                state.step += 1
                if me in faults and state.step == faults[me][0]:
                    kill_self(state.step, faults[me][1])   # inside fit, before this step's commit

        @hvd.elastic.run
        def train(state):
            while state.step < steps:
                maybe_grow(state)
                # One fit per commit interval, so that a fault fires at a step boundary.
                todo = min(COMMIT_EVERY - state.step % COMMIT_EVERY, steps - state.step)
                xs, ys = hvd.data.shard_arrays(x, y, batch_size=B, skip=state.samples)
                model.fit(xs[:todo * B], ys[:todo * B], batch_size=B, epochs=1, shuffle=False, verbose=0,
                          callbacks=[Schedule(), hvd_keras.elastic.UpdateBatchStateCallback(state),
                                     hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY)])

    state.register_reset_callbacks([on_reset])
    train(state)

    final = weights_vector(model)
    gathered = hvd.allgather_object(final)
    # Re-sharding at the final size: the rows after a skip, shared without overlap and in order.
    skip = 3 * B
    mine = hvd.data.shard_arrays(np.arange(ROWS), batch_size=B, skip=skip)
    shards = hvd.allgather_object(mine.tolist())
    steps = (ROWS - skip) // (hvd.size() * B)
    expected = list(range(skip, skip + steps * hvd.size() * B))
    interleaved = [row for k in range(steps) for shard in shards for row in shard[k * B:(k + 1) * B]]
    result = {"size": hvd.size(), "sizes": list(state.sizes), "events": events,
              "identical_on_every_rank": all(np.array_equal(g, final) for g in gathered),
              "reshard_covers_rest_once": interleaved == expected}
    if hvd.rank() == 0:
        reference = replay(state.sizes)
        result["max_abs_diff_vs_replay"] = float(np.max(np.abs(reference - final)))
        result["allclose_vs_replay"] = bool(np.allclose(reference, final, rtol=1e-5, atol=1e-6))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)
    with open(os.path.join(out, f"done{hvd.rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
