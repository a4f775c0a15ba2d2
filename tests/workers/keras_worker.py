"""Keras / custom-loop training checks, run on every rank by tests/test_keras.py.

Equivalence checks train the distributed model (N ranks x batch B) and, on
every rank, a plain single-process reference on the global batch (N*B) from
the same initial weights and data, then compare weights. Tolerance: float32,
rtol 1e-4 / atol 1e-5 (the reduction sums in a different order than the
reference's batch mean).
"""
import hashlib
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi.keras as hvd  # noqa: E402
from tf_mpi.basics import _core  # noqa: E402
from tf_mpi.keras.optimizer import _DistributedMixin  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
B = 8
RTOL, ATOL = 1e-4, 1e-5


def make_model(seed, input_dim=6, units=(16, 8), out=1, frozen=None):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,))
    x = inputs
    for i, u in enumerate(units):
        x = keras.layers.Dense(u, activation="tanh", name=f"d{i}", trainable=(frozen != f"d{i}"))(x)
    return keras.Model(inputs, keras.layers.Dense(out, name="out")(x))


def global_data(steps, batch=B, seed=0, input_dim=6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * N * batch, input_dim)).astype(np.float32)
    y = (np.sin(x.sum(1, keepdims=True)) + 0.1 * rng.normal(size=(len(x), 1))).astype(np.float32)
    return x, y


def shard(a, batch=B):
    """This rank's part of every global batch, in step order."""
    steps = len(a) // (N * batch)
    return np.concatenate([a[s * N * batch + R * batch: s * N * batch + (R + 1) * batch] for s in range(steps)])


def weights_close(a, b, what):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        assert np.allclose(wa, wb, rtol=RTOL, atol=ATOL), f"{what}: max diff {np.max(np.abs(wa - wb))}"


def weights_digest(model):
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return np.frombuffer(h.digest(), np.uint8).copy()


def assert_identical_across_ranks(model, what):
    digests = _core.allgather(weights_digest(model)[None, :], f"digest.{what}")
    assert all(np.array_equal(digests[0], d) for d in digests), f"{what}: weights differ across ranks"


def fit_pair(make_opt, steps=5, batch=B, dist_kwargs=None, ref_batch=None, model_fn=make_model, data=None,
             reference=True):
    """(distributed model, reference model) after one epoch of `steps` global batches (reference=False:
    no reference is trained, None in its place)."""
    x, y = data or global_data(steps, batch)
    model = model_fn(1)
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt(), **(dist_kwargs or {})), loss="mse",
                  jit_compile=False)
    model.fit(shard(x, batch), shard(y, batch), batch_size=batch, epochs=1, shuffle=False, verbose=0)
    if not reference:
        return model, None
    ref = model_fn(1)
    # The one-process reference runs eagerly: the same arithmetic, without tracing a graph for a few
    # steps (about a third of such a check's CPU time).
    ref.compile(optimizer=make_opt(), loss="mse", jit_compile=False, run_eagerly=True)
    ref.fit(x, y, batch_size=ref_batch or N * batch, epochs=1, shuffle=False, verbose=0)
    return model, ref


def check_fit_matches_single_process_sgd_and_adam():
    for name, make_opt in (("sgd", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
                           ("adam", lambda: keras.optimizers.Adam(0.01)),
                           ("adamw", lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01)),
                           ("rmsprop", lambda: keras.optimizers.RMSprop(0.01))):
        model, ref = fit_pair(make_opt)
        weights_close(model, ref, name)
        assert_identical_across_ranks(model, name)
        assert not all(np.allclose(a, b) for a, b in zip(model.get_weights(), make_model(1).get_weights())), \
            f"{name}: training did not change the weights"


def check_custom_loop_with_distributed_gradient_tape_matches():
    x, y = global_data(4)
    xs, ys = shard(x), shard(y)
    loss_fn = keras.losses.MeanSquaredError()
    for name, make_opt in (("sgd", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
                           ("adam", lambda: keras.optimizers.Adam(0.01))):
        model, ref = make_model(1), make_model(1)
        opt, ref_opt = make_opt(), make_opt()

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            tape = hvd.DistributedGradientTape(tape, name=f"tape.{name}")
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        def ref_step(xb, yb):  # eagerly: the reference needs no graph
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, ref(xb, training=True))
            ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))

        for s in range(4):
            step(xs[s * B:(s + 1) * B], ys[s * B:(s + 1) * B])
            ref_step(x[s * N * B:(s + 1) * N * B], y[s * N * B:(s + 1) * N * B])
            assert_identical_across_ranks(model, f"tape.{name}.step{s}")
        weights_close(model, ref, f"custom loop {name}")


def check_weights_bit_identical_after_every_epoch_from_different_starts():
    # Every rank starts from different weights (seed = rank) and sees different
    # data; the broadcast callback makes rank 1 the common start.
    class DigestEachEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            assert_identical_across_ranks(self.model, f"epoch{epoch}")

    x, y = global_data(3, seed=5)
    model = make_model(seed=100 + R)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse", jit_compile=False)
    # Optimizer state differs too (as if restored from different checkpoints):
    # the callback must broadcast it, or the ranks' updates would differ.
    model.optimizer.build(model.trainable_variables)
    for v in model.optimizer.variables:
        if "momentum" in v.path:
            v.assign(tf.fill(v.shape, 0.01 * (R + 1)))
    model.fit(shard(x), shard(y), batch_size=B, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=1), DigestEachEpoch()])
    ref = make_model(seed=101)  # rank 1's start
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False, run_eagerly=True)
    ref.optimizer.build(ref.trainable_variables)
    for v in ref.optimizer.variables:
        if "momentum" in v.path:
            v.assign(tf.fill(v.shape, 0.02))  # rank 1's optimizer state
    ref.fit(x, y, batch_size=N * B, epochs=3, shuffle=False, verbose=0)
    weights_close(model, ref, "broadcast from rank 1")


def check_ordered_backprop_trains_to_the_same_weights_bit_for_bit():
    # order_backprop only adds control edges (which kernel runs first); with
    # several groups the weights after training equal those of the plain plan
    # exactly, equal the single-process reference, and agree across ranks.
    x, y = global_data(4, seed=9)
    plain, ref = fit_pair(lambda: keras.optimizers.Adam(0.01), steps=4, data=(x, y),
                          dist_kwargs={"groups": 3}, model_fn=lambda s: make_model(s, units=(32, 16, 8)))
    ordered, _ = fit_pair(lambda: keras.optimizers.Adam(0.01), steps=4, data=(x, y),
                          dist_kwargs={"groups": 3, "order_backprop": True},
                          model_fn=lambda s: make_model(s, units=(32, 16, 8)), reference=False)  # the same ref
    assert len(ordered.optimizer.grouping_plan.groups) == 3
    for a, b in zip(plain.get_weights(), ordered.get_weights()):
        assert np.array_equal(a, b)
    weights_close(ordered, ref, "ordered backprop vs single process")
    assert_identical_across_ranks(ordered, "ordered_backprop")


def check_grouping_plan_follows_backprop_and_byte_bound():
    model = make_model(1, units=(64, 32, 16))
    x, y = global_data(1)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=B, verbose=0)
    plan = opt.grouping_plan
    names = [n for g in plan.groups for n in g.names]
    assert plan.groups[0].names[0].startswith("out/"), plan.describe()  # last layer's gradient is produced first
    assert names.index("out/kernel") < names.index("d2/kernel") < names.index("d0/kernel"), plan.describe()
    # A tight byte bound cuts the plan into several groups, none above it unless one of its tensors is
    # (such a tensor takes the latency-bound ones just before it along).
    variables = model.trainable_variables

    @tf.function
    def planned():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[:B]) - y[:B]))
        grads = tape.gradient(loss, variables)
        p = hvd.grouping.make_plan(grads, variables, threshold_bytes=2048)
        planned.plan = p
        return loss

    planned()
    p = planned.plan
    assert len(p.groups) >= 3, p.describe()
    nbytes = [int(np.prod(v.shape)) * 4 for v in variables]
    for g in p.groups:
        assert g.nbytes <= 2048 or max(nbytes[i] for i in g.indices) > 2048, p.describe()
    assert sorted(i for g in p.groups for i in g.indices) == list(range(len(variables)))
    fingerprints = _core.allgather(np.frombuffer(bytes.fromhex(p.fingerprint), np.uint8)[None, :].copy(), "plan.fp")
    assert all(np.array_equal(fingerprints[0], f) for f in fingerprints)
    # num_groups and explicit groups override the default plan.
    p2 = hvd.grouping.make_plan([tf.zeros(v.shape) for v in variables], variables, num_groups=2)
    assert len(p2.groups) == 2
    last_layer = [v for v in variables if v.path.startswith("out/")]
    p3 = hvd.grouping.make_plan([tf.zeros(v.shape) for v in variables], variables, groups=[last_layer])
    assert sorted(p3.groups[0].names) == ["out/bias", "out/kernel"] and len(p3.groups) == 2


def check_overlap_probe_tells_background_communication_from_a_shared_core():
    import threading
    from tf_mpi.policy.overlap_probe import measure_overlap
    # A "computation" that leaves the CPU free (as a GPU would): the allreduce hides behind it.
    # Best of 3 probes (a fixed count, so every rank runs the same collectives): on a machine
    # busy with other work one probe in several read ~0.4; a broken probe reads ~0 every time.
    readings = [measure_overlap(lambda k: time.sleep(0.001 * k)) for _ in range(3)]
    background = max(readings)
    assert 0.5 < background <= 1.0, readings

    # The same computation, but it cannot start before the probe's allreduce (run by a thread
    # beside it) has finished: together they take as long as one after the other, by
    # construction. A probe that reported overlap here (threads not run together, a wrong
    # formula or clip) could not tell a shared core from a free one.
    def after_the_allreduce(k):
        for t in threading.enumerate():
            if "comm_thread" in t.name:  # measure_overlap's allreduce thread, only while both run
                t.join()
        time.sleep(0.001 * k)
    none = measure_overlap(after_the_allreduce)
    assert none < 0.5, none
    # The TensorFlow kernel's reading, which the default plans use, is printed, not asserted: on a
    # machine shared with other work it is noise-bound (all threads of both ranks on one core:
    # 0, 0.96, 0, 0, 0 in five launches).
    tf_kernel = measure_overlap()  # collective: every rank
    if R == 0:
        print(f"overlap probe: sleep {background:.2f}, after the allreduce {none:.2f}, tf kernel {tf_kernel:.2f}",
              flush=True)
    # An override skips the probe (the kernel would raise).
    os.environ["TF_MPI_OVERLAP"] = "0.25"
    try:
        assert measure_overlap(lambda k: 1 / 0) == 0.25
    finally:
        del os.environ["TF_MPI_OVERLAP"]


def check_clipping_happens_after_reduction():
    for clip in ({"global_clipnorm": 0.05}, {"clipnorm": 0.02}):
        model, ref = fit_pair(lambda: keras.optimizers.SGD(0.5, **clip), steps=3)
        weights_close(model, ref, f"clip {clip}")


def check_mixed_precision_overflow_on_one_rank_skips_everywhere():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model(3)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
        assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        assert model.optimizer is opt  # compile did not wrap it again
        x = np.ones((B, 6), np.float32)
        y = np.ones((B, 1), np.float32)
        model.train_on_batch(x, y)  # builds everything; a normal step
        before = model.get_weights()
        scale_before = float(opt.dynamic_scale)
        bad = x * (3e4 if R == 1 else 1.0)  # float16 overflow on rank 1 only
        model.train_on_batch(bad, y)
        assert float(opt.dynamic_scale) == scale_before / 2, (float(opt.dynamic_scale), scale_before)
        for a, b in zip(before, model.get_weights()):
            assert np.array_equal(a, b), "a step with inf gradients on one rank changed weights"
        assert_identical_across_ranks(model, "after.overflow")
        scales = _core.allgather(np.array([float(opt.dynamic_scale)]), "scales")
        assert np.all(scales == scales[0])
        model.train_on_batch(x + R, y)
        assert not all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        assert_identical_across_ranks(model, "after.recovery")
    finally:
        keras.mixed_precision.set_global_policy("float32")


def check_backward_passes_per_step_communicates_once_per_k():
    x, y = global_data(4)
    make_opt = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    model = make_model(1)
    opt = hvd.DistributedOptimizer(make_opt(), backward_passes_per_step=2, average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(shard(x)[:B], shard(y)[:B], batch_size=B, verbose=0)  # trace + first pass (no apply yet)
    before = _core.stats()["requests"]
    model.fit(shard(x)[B:], shard(y)[B:], batch_size=B, verbose=0, shuffle=False)  # 3 more passes
    groups = len(opt.grouping_plan.groups)
    assert _core.stats()["requests"] - before == 2 * groups, (_core.stats()["requests"] - before, groups)
    # Two averaged passes of batch N*B == one step of batch 2*N*B.
    ref = make_model(1)
    ref.compile(optimizer=make_opt(), loss="mse", jit_compile=False, run_eagerly=True)
    ref.fit(x, y, batch_size=2 * N * B, shuffle=False, verbose=0)
    weights_close(model, ref, "backward_passes_per_step=2")
    assert_identical_across_ranks(model, "bpps")


def check_keras_gradient_accumulation_communicates_once_per_k():
    x, y = global_data(4)
    make_opt = lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)  # noqa: E731
    model, ref = fit_pair(make_opt, steps=1)  # traces, accumulates
    before = _core.stats()["requests"]
    model.fit(shard(x), shard(y), batch_size=B, verbose=0, shuffle=False)  # 4 steps -> 2 updates
    groups = len(model.optimizer.grouping_plan.groups)
    assert _core.stats()["requests"] - before == 2 * groups, (_core.stats()["requests"] - before, groups)
    ref.fit(x, y, batch_size=N * B, shuffle=False, verbose=0)
    weights_close(model, ref, "gradient_accumulation_steps=2")


def check_jit_compile_fails_with_a_clear_message():
    model = make_model(1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    try:
        model.fit(np.ones((B, 6)), np.ones((B, 1)), batch_size=B, verbose=0)
        raise AssertionError("XLA compilation did not fail")
    except ValueError as e:
        assert "jit_compile=False" in str(e), str(e)


def embedding_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,), dtype="int32")
    x = keras.layers.Embedding(40, 4, name="emb")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(x)))


def check_sparse_embedding_gradients_gathered_or_densified():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 40, size=(3 * N * B, 3)).astype(np.int32)
    y = rng.normal(size=(3 * N * B, 1)).astype(np.float32)
    for kwargs in ({}, {"sparse_as_dense": True}):
        model, ref = fit_pair(lambda: keras.optimizers.SGD(0.5), dist_kwargs=kwargs, model_fn=embedding_model,
                              data=(x, y))
        weights_close(model, ref, f"embedding {kwargs}")
        assert_identical_across_ranks(model, f"emb{kwargs}")


def check_tape_with_unknown_gradient_shapes_in_tf_function():
    # Dense on a [batch, time, features] input traced with an unknown batch
    # size gives a kernel gradient of static shape [None, 1].
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(1)])

    @tf.function(input_signature=[tf.TensorSpec([None, 5, 3], tf.float32)])
    def grads(xb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(xb))
        return hvd.DistributedGradientTape(tape, name="unknown.shapes").gradient(loss, model.trainable_variables)

    g = grads(tf.ones([R + 2, 5, 3]))  # a different batch size on each rank
    mean_batch = sum(r + 2 for r in range(N)) / N
    assert np.allclose(g[0].numpy(), 5 * mean_batch) and np.allclose(g[1].numpy(), 5 * mean_batch), g


def check_device_arguments_place_the_gradient_collectives():
    # Horovod's device_dense / device_sparse: the collectives of dense gradients and of
    # IndexedSlices (an Embedding's, allgathered) run under tf.device, as tf_mpi.allreduce's do.
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 2),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    xb = tf.constant((np.arange(3 * B).reshape(B, 3) + R) % 10, tf.int32)

    def traced(name, **devices):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(xb))
            tape = hvd.DistributedGradientTape(tape, name=name, groups=1, **devices)
            return [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        values = step()
        graph = step.get_concrete_function().graph
        placed = {t: {op.device for op in graph.get_operations() if op.type == t}
                  for t in ("TfMpiGroupedAllreduce", "TfMpiAllgather")}
        return values, placed

    plain, unplaced = traced("devices.default")
    placed_values, placed = traced("devices.cpu", device_dense="/cpu:0", device_sparse="/cpu:0")
    assert unplaced == {"TfMpiGroupedAllreduce": {""}, "TfMpiAllgather": {""}}, unplaced
    assert placed == {"TfMpiGroupedAllreduce": {"/device:CPU:0"}, "TfMpiAllgather": {"/device:CPU:0"}}, placed
    for a, b in zip(plain, placed_values):
        assert np.array_equal(a.numpy(), b.numpy())
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), device_dense="/cpu:0", device_sparse="/cpu:1")
    assert (opt._tfmpi_reducer.device_dense, opt._tfmpi_reducer.device_sparse) == ("/cpu:0", "/cpu:1")


def check_frozen_layers_and_missing_gradients():
    model, ref = fit_pair(lambda: keras.optimizers.SGD(0.1), model_fn=lambda s: make_model(s, frozen="d0"))
    weights_close(model, ref, "frozen d0")
    # A variable that does not affect the loss has no gradient: skipped on every rank.
    extra = tf.Variable(tf.ones([3]))
    xb = tf.constant(np.ones((B, 6), np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(xb))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables + [extra])
    assert grads[-1] is None and all(g is not None for g in grads[:-1])


def check_partial_tape_leaves_local_layers_alone():
    model = make_model(1)
    xb = tf.constant(np.full((B, 6), R + 1.0, np.float32))
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(xb))
    local = tape.gradient(loss, model.trainable_variables)
    grads = hvd.PartialDistributedGradientTape(tape, local_layers=[model.get_layer("d0")]).gradient(
        loss, model.trainable_variables)
    d0 = [i for i, v in enumerate(model.trainable_variables) if v.path.startswith("d0/")]
    for i, (g, lg) in enumerate(zip(grads, local)):
        if i in d0:
            assert np.allclose(g.numpy(), lg.numpy() / N)  # not reduced; divided by size() as in Horovod
        else:
            avg = _core.allreduce(lg.numpy(), hvd.Average, f"partial.{i}")
            assert np.allclose(g.numpy(), avg, rtol=1e-5, atol=1e-6)


def check_warmup_callback_sets_the_documented_rate_every_batch():
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate))

    steps, lr0, warmup = 4, 0.2, 2
    x, y = global_data(steps)
    model = make_model(1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr0)), loss="mse", jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=B, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(lr0, warmup_epochs=warmup, steps_per_epoch=steps),
                         Record()])
    expected = []
    for epoch in range(3):
        for batch in range(steps):
            e = epoch + (batch + 1) / steps
            expected.append(lr0 / N * (e * (N - 1) / warmup + 1) if epoch < warmup else expected[-1])
    assert np.allclose(seen, expected, rtol=1e-6), (seen, expected)
    assert abs(seen[warmup * steps - 1] - lr0) < 1e-7  # the last warm-up batch runs at the full rate


def check_schedule_callback_multiplies_per_epoch():
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate))

    x, y = global_data(1)
    model = make_model(1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mse", jit_compile=False)
    sched = hvd.callbacks.LearningRateScheduleCallback(0.4, lambda e: 0.5 ** e, start_epoch=1)
    model.fit(shard(x), shard(y), batch_size=B, epochs=3, verbose=0, callbacks=[sched, Record()])
    assert np.allclose(seen, [1.0, 0.2, 0.1]), seen


def check_metric_average_callback_averages_before_others():
    raw, averaged = [], []

    class Grab(keras.callbacks.Callback):
        def __init__(self, into):
            super().__init__()
            self.into = into

        def on_epoch_end(self, epoch, logs=None):
            self.into.append(float(logs["loss"]))

    x, y = global_data(2, seed=9)
    x = x + R  # different data, different loss per rank
    model = make_model(1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=B, epochs=2, verbose=0,
              callbacks=[Grab(raw), hvd.callbacks.MetricAverageCallback(), Grab(averaged)])
    all_raw = _core.allgather(np.array([raw]), "raw.losses")
    assert not np.allclose(all_raw[0], all_raw[-1])  # ranks really differ
    assert np.allclose(averaged, all_raw.mean(0), rtol=1e-6), (averaged, all_raw)


def check_config_learning_rate_and_save_load_round_trip():
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.02, beta_1=0.8))
    cfg = opt.get_config()
    assert abs(cfg["learning_rate"] - 0.02) < 1e-8 and cfg["beta_1"] == 0.8, cfg
    clone = type(opt).from_config(cfg)
    assert isinstance(clone, _DistributedMixin) and isinstance(clone, keras.optimizers.Adam)
    opt.learning_rate = 0.05
    assert abs(float(opt.learning_rate) - 0.05) < 1e-8
    x, y = global_data(2)
    model = make_model(1)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=B, verbose=0, shuffle=False)
    path = os.path.join(tempfile.mkdtemp(), f"model{R}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, _DistributedMixin) and isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert abs(float(loaded.optimizer.learning_rate) - 0.05) < 1e-8
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        assert np.array_equal(a, b)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert np.array_equal(np.asarray(a), np.asarray(b)), a.path
    model.fit(shard(x), shard(y), batch_size=B, verbose=0, shuffle=False)
    loaded.fit(shard(x), shard(y), batch_size=B, verbose=0, shuffle=False)
    weights_close(model, loaded, "continued after load")
    assert_identical_across_ranks(loaded, "loaded")


def check_best_model_checkpoint_saves_on_rank_0_only():
    path = os.path.join(tempfile.mkdtemp(), "best.keras")  # a different directory on each rank
    x, y = global_data(2)
    model = make_model(1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse", jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=B, epochs=2, verbose=0, callbacks=[
        hvd.callbacks.MetricAverageCallback(), hvd.callbacks.BestModelCheckpoint(filepath=path, monitor="loss", mode="min")])
    assert os.path.exists(path) == (R == 0), f"rank {R}: saved={os.path.exists(path)}"
    if R == 0:
        saved = keras.models.load_model(path)
        assert np.allclose(saved.get_weights()[0], model.get_weights()[0])


def check_sync_batch_norm_uses_global_batch_statistics():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    bn = hvd.SyncBatchNormalization(momentum=0.0)
    model = keras.Model(inputs, keras.layers.Dense(1)(bn(inputs)))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse", jit_compile=False)
    rng = np.random.default_rng(0)
    global_x = rng.normal(size=(N * B, 3)).astype(np.float32) * np.arange(1, 4) + np.arange(3)
    model.train_on_batch(global_x[R * B:(R + 1) * B], np.zeros((B, 1), np.float32))
    assert np.allclose(bn.moving_mean.numpy(), global_x.mean(0), rtol=1e-5, atol=1e-5)
    assert np.allclose(bn.moving_variance.numpy(), global_x.var(0), rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    run_checks(globals(), R)
