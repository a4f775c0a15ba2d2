"""Allreduce family checks, run on every rank by tests/test_allreduce.py.

Inputs depend on the rank in known ways, so every expected value is computed
here from the same formula with numpy and compared with what the engine
returned. Runs at np=2 (default fusion) and np=3 (fusion off, tiny MPI chunks).
"""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import SkipCheck, run_checks  # noqa: E402

import tf_mpi as hvd  # noqa: E402
from tf_mpi.basics import _core  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)

# ---- what happens before init() (recorded now, asserted by a check below)
BEFORE_INIT = {}
try:
    hvd.rank()
except ValueError as e:
    BEFORE_INIT["rank"] = str(e)
try:
    hvd.allreduce(tf.constant([1.0]))
except tf.errors.FailedPreconditionError as e:
    BEFORE_INIT["allreduce"] = e.message
try:
    hvd.rank_op()
except tf.errors.FailedPreconditionError as e:
    BEFORE_INIT["rank_op"] = e.message

hvd.init()
R, N = hvd.rank(), hvd.size()

DTYPES = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]
OPS = {hvd.Sum: "Sum", hvd.Average: "Average", hvd.Min: "Min", hvd.Max: "Max", hvd.Product: "Product"}
RTOL = {tf.float16: 2e-3, tf.bfloat16: 2e-2, tf.float32: 1e-6, tf.float64: 1e-12}


def values(rank, shape, seed=0):
    """Small positive numbers (so products and int8 sums cannot overflow)."""
    n = int(np.prod(shape))
    return (((np.arange(n) + rank + seed) % 3) + 1).reshape(shape).astype(np.float64)


def reference(op, shape, seed=0):
    stack = np.stack([values(r, shape, seed) for r in range(N)])
    if op == hvd.Sum:
        return stack.sum(0)
    if op == hvd.Average:
        return stack.sum(0) / N
    if op == hvd.Min:
        return stack.min(0)
    if op == hvd.Max:
        return stack.max(0)
    return stack.prod(0)


def assert_close(got, want, dtype, what):
    got = np.asarray(got).astype(np.float64)
    if dtype.is_integer:
        want = np.trunc(want)  # integer averages truncate toward zero
        assert np.array_equal(got, want), f"{what}: got {got.ravel()[:8]} want {want.ravel()[:8]}"
    else:
        assert np.allclose(got, want, rtol=RTOL[dtype], atol=0), f"{what}: got {got.ravel()[:8]} want {want.ravel()[:8]}"


def all_cases():
    for dtype in DTYPES:
        for op in OPS:
            yield dtype, op


def check_errors_before_init():
    assert "not been initialized" in BEFORE_INIT.get("rank", ""), BEFORE_INIT
    assert "not been initialized" in BEFORE_INIT.get("allreduce", ""), BEFORE_INIT
    assert "not been initialized" in BEFORE_INIT.get("rank_op", ""), BEFORE_INIT


def check_runtime_queries():
    assert (R, N) == (int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    assert hvd.local_size() == N and hvd.local_rank() == R  # one node
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert int(hvd.rank_op()) == R and int(hvd.size_op()) == N
    assert int(hvd.local_rank_op()) == R and int(hvd.local_size_op()) == N
    assert hvd.mpi_threads_supported() is True
    assert hvd.mpi_built() and not hvd.nccl_built() and not hvd.gloo_built()
    # Built when the install found a CUDA compiler; no GPU needed (tests/test_gpu_path.py).
    assert hvd.cuda_built() == os.path.exists(os.path.join(os.path.dirname(hvd.__file__), "libtfmpi_cuda.so"))
    assert hvd.is_initialized()


def check_allreduce_every_dtype_and_op_eager():
    shape = (2, 3)
    for dtype, op in all_cases():
        x = tf.constant(values(R, shape), dtype=dtype)
        y = hvd.allreduce(x, op=op, name=f"eager.{dtype.name}.{op}")
        assert y.dtype == dtype and y.shape == shape
        assert_close(y.numpy(), reference(op, shape), dtype, f"eager {dtype.name} {OPS[op]}")


def check_allreduce_every_dtype_and_op_in_tf_function():
    shape = (7,)
    xs = [tf.constant(values(R, shape, seed=1), dtype=d) for d, _ in all_cases()]

    @tf.function
    def step(tensors):
        # Names default to the op's node name: unique in this graph, equal on all ranks.
        return [hvd.allreduce(t, op=op) for t, (_, op) in zip(tensors, all_cases())]

    for _ in range(3):  # later steps hit the response cache
        outs = step(xs)
        for y, (dtype, op) in zip(outs, all_cases()):
            assert_close(y.numpy(), reference(op, shape, seed=1), dtype, f"tf.function {dtype.name} {OPS[op]}")


def check_grouped_allreduce_mixed_dtypes_fused():
    rng = np.random.default_rng(7)  # same shapes on every rank
    shapes = [tuple(rng.integers(1, 40, size=rng.integers(1, 4))) for _ in range(60)]
    dtypes = [DTYPES[i % len(DTYPES)] for i in range(len(shapes))]
    xs = [tf.constant(values(R, s, seed=i), dtype=d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    for op in (hvd.Sum, hvd.Average, hvd.Max):
        outs = hvd.grouped_allreduce(xs, op=op, name=f"group.{op}")
        assert len(outs) == len(xs)
        for i, (y, s, d) in enumerate(zip(outs, shapes, dtypes)):
            assert y.dtype == d and tuple(y.shape) == s
            assert_close(y.numpy(), reference(op, s, seed=i), d, f"group member {i} {d.name} {OPS[op]}")


def check_large_group_members_skip_the_fusion_buffer():
    # np=2 runs the defaults (fusion on, tensors >= 256 KiB reduced from their
    # own buffers); np=3 runs with fusion off. Bucket counts show the plan of
    # the MPI path (shared memory paused). Over shared memory a bucket costs
    # no copies, so there the group is one bucket whenever fusion is on.
    shapes = [(256, 1024), (3,), (4, 5), (70000,)]  # 1 MiB, two small, 273 KiB
    xs = [tf.constant(values(R, s, seed=i), tf.float32) for i, s in enumerate(shapes)]
    fusion_on = os.environ.get("TF_MPI_FUSION_THRESHOLD") != "0"
    for shm_paused in (True, False):
        _core.set_shm_paused(shm_paused)  # between synchronous calls: alike on every rank
        try:
            before = _core.stats()
            outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="direct.mix")
            after = _core.stats()
        finally:
            _core.set_shm_paused(False)
        buckets = after["allreduce_buckets"] - before["allreduce_buckets"]
        for i, (y, s) in enumerate(zip(outs, shapes)):
            assert_close(y.numpy(), reference(hvd.Sum, s, seed=i), tf.float32, f"member {i}")
        on_shm = after["shm_allreduces"] > before["shm_allreduces"]
        assert not (shm_paused and on_shm)
        want = 4 if not fusion_on else 1 if on_shm else 3  # one each, all fused, or 2 direct + 1 fused pair
        assert buckets == want, (shm_paused, on_shm, buckets)


def check_grouped_allreduce_in_tf_function():
    xs = [tf.constant(values(R, (5,), seed=i), dtype=tf.float32) for i in range(10)]
    step = tf.function(lambda ts: hvd.grouped_allreduce(ts, op=hvd.Sum))
    for _ in range(3):
        for i, y in enumerate(step(xs)):
            assert_close(y.numpy(), reference(hvd.Sum, (5,), seed=i), tf.float32, f"group {i}")


def check_submission_order_differs_per_rank():
    # 40 collectives submitted from threads in a rank-dependent order: the
    # engine must still pair them by name.
    names = [f"order.{i}" for i in range(40)]
    order = names if R % 2 == 0 else names[::-1]
    if R == 2:
        order = names[20:] + names[:20]
    inputs = {n: tf.constant(values(R, (16,), seed=i), tf.float32) for i, n in enumerate(names)}

    def submit(n):
        time.sleep(0.001 * (order.index(n) % 5))
        return n, hvd.allreduce(inputs[n], op=hvd.Sum, name=n).numpy()

    with ThreadPoolExecutor(len(names)) as pool:  # every collective must be submitted: each thread blocks
        results = dict(pool.map(submit, order))
    for i, n in enumerate(names):
        assert_close(results[n], reference(hvd.Sum, (16,), seed=i), tf.float32, n)


def check_tf_function_does_not_chain_collectives_in_program_order():
    # tf.function runs stateful ops in program order unless told otherwise.
    # Chained, this rank-dependent program order would deadlock (rank 0 waits
    # in 'prog.0', rank 1 in 'prog.9'), and no collectives could fuse.
    names = [f"prog.{i}" for i in range(10)]
    order = names if R % 2 == 0 else names[::-1]
    inputs = [tf.constant(values(R, (8,), seed=i), tf.float32) for i in range(len(names))]

    @tf.function
    def step(ts):
        return {n: hvd.allreduce(ts[names.index(n)], op=hvd.Sum, name=n) for n in order}

    graph = step.get_concrete_function(inputs).graph
    collectives = [op for op in graph.get_operations() if op.type == "TfMpiAllreduce"]
    assert len(collectives) == len(names)
    chained = [(op.name, c.name) for op in collectives for c in op.control_inputs if c.type == "TfMpiAllreduce"]
    assert not chained, f"collectives chained by control edges: {chained}"
    out = step(inputs)
    for i, n in enumerate(names):
        assert_close(out[n].numpy(), reference(hvd.Sum, (8,), seed=i), tf.float32, n)


def check_empty_and_scalar_tensors():
    for dtype in (tf.float32, tf.int32, tf.float16):
        for shape in [(0,), (3, 0), ()]:
            x = tf.constant(values(R, shape), dtype=dtype) if shape != () else tf.cast(R + 1, dtype)
            y = hvd.allreduce(x, op=hvd.Sum, name=f"edge.{dtype.name}.{shape}")
            assert tuple(y.shape) == shape
            if shape == ():
                assert_close(y.numpy(), np.float64(sum(r + 1 for r in range(N))), dtype, "scalar")
    outs = hvd.grouped_allreduce([tf.zeros([0]), tf.constant(2.0), tf.ones([4])], op=hvd.Sum, name="edge.group")
    assert outs[0].shape == (0,) and float(outs[1]) == 2.0 * N and np.all(outs[2].numpy() == N)


def check_prescale_and_postscale():
    x = tf.constant(values(R, (6,)), tf.float32)
    y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="scale.f32")
    assert_close(y.numpy(), reference(hvd.Sum, (6,)) * 1.5, tf.float32, "scaled sum")
    y = hvd.allreduce(x, op=hvd.Average, postscale_factor=2.0, name="scale.avg")
    assert_close(y.numpy(), reference(hvd.Average, (6,)) * 2.0, tf.float32, "scaled average")
    g = hvd.grouped_allreduce([x, tf.cast(x, tf.float16)], op=hvd.Sum, prescale_factor=2.0, name="scale.group")
    assert_close(g[1].numpy(), reference(hvd.Sum, (6,)) * 2.0, tf.float16, "scaled fp16 group")


def check_16bit_float_sums_are_accurate():
    # Random values over a wide range: a byte-wise or integer reduction of
    # the 16-bit patterns would give garbage; a float accumulation gives the
    # correctly rounded sum (exactly so with 2 ranks).
    def draw(rank):
        return np.random.default_rng(100 + rank).uniform(-50, 50, size=1000)

    for dtype in (tf.float16, tf.bfloat16):
        x = tf.cast(tf.constant(draw(R)), dtype)
        all_x = [tf.cast(tf.constant(draw(r)), dtype).numpy().astype(np.float64) for r in range(N)]
        y = hvd.allreduce(x, op=hvd.Sum, name=f"acc.{dtype.name}").numpy().astype(np.float64)
        want = tf.cast(tf.constant(np.sum(all_x, 0)), dtype).numpy().astype(np.float64)
        if N == 2:
            assert np.array_equal(y, want), f"{dtype.name}: max diff {np.max(np.abs(y - want))}"
        else:
            # Each of the N-1 additions rounds once: allow one unit in the last
            # place at the partial sums' magnitude (|sum| < 256).
            ulp = {tf.float16: 0.125, tf.bfloat16: 1.0}[dtype]
            assert np.max(np.abs(y - want)) <= ulp, f"{dtype.name}: max diff {np.max(np.abs(y - want))}"


def check_fp16_compression():
    x = tf.constant(values(R, (100,)) / 4, tf.float32)
    y = hvd.allreduce(x, op=hvd.Average, compression=hvd.Compression.fp16, name="compress.fp16")
    assert y.dtype == tf.float32
    assert_close(y.numpy(), reference(hvd.Average, (100,)) / 4, tf.float16, "fp16-compressed average")
    i = hvd.allreduce(tf.constant([R], tf.int32), op=hvd.Sum, compression=hvd.Compression.fp16, name="compress.int")
    assert i.dtype == tf.int32 and int(i[0]) == sum(range(N))


def check_gradients_through_allreduce():
    coef = float(R + 1)
    x = tf.Variable(tf.ones([3]))
    for op, expect in ((hvd.Sum, N * coef), (hvd.Average, coef)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allreduce(coef * x, op=op, name=f"grad.fwd.{op}"))
        g = tape.gradient(loss, x)
        assert np.allclose(g.numpy(), expect), (OPS[op], g.numpy(), expect)

    @tf.function
    def grouped_grad():
        with tf.GradientTape() as tape:
            a, b = hvd.grouped_allreduce([coef * x, 2.0 * coef * x], op=hvd.Sum)
            loss = tf.reduce_sum(a) + tf.reduce_sum(b)
        return tape.gradient(loss, x)

    assert np.allclose(grouped_grad().numpy(), 3 * N * coef)


def check_indexed_slices_are_gathered():
    sl = tf.IndexedSlices(tf.constant([[float(R)] * 2] * (R + 1)), tf.constant(list(range(R + 1)), tf.int64),
                          dense_shape=tf.constant([10, 2], tf.int64))
    out = hvd.allreduce(sl, op=hvd.Average, name="slices")
    assert isinstance(out, tf.IndexedSlices)
    want_vals = np.concatenate([np.full((r + 1, 2), r / N) for r in range(N)])
    want_idx = np.concatenate([np.arange(r + 1) for r in range(N)])
    assert np.allclose(out.values.numpy(), want_vals) and np.array_equal(out.indices.numpy(), want_idx)
    dense = tf.convert_to_tensor(out).numpy()
    assert np.allclose(dense[0], sum(r for r in range(N)) / N)
    # An embedding lookup's gradient is IndexedSlices too.
    emb = tf.Variable(tf.ones([10, 2]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(emb, [R]))
    g = hvd.allreduce(tape.gradient(loss, emb), op=hvd.Sum, name="slices.grad")
    assert np.allclose(tf.convert_to_tensor(g).numpy()[:N], 1.0)


def check_mismatched_inputs_fail_on_every_rank():
    cases = {
        "mm.shape": dict(x=tf.ones([R + 1]), op=hvd.Sum, want=["shape differs", "rank 0: [1]", "rank 1: [2]"]),
        "mm.dtype": dict(x=tf.ones([2], tf.float32 if R == 0 else tf.float64), op=hvd.Sum,
                         want=["dtype differs", "float32", "float64"]),
        "mm.op": dict(x=tf.ones([2]), op=hvd.Sum if R == 0 else hvd.Max, want=["reduce op differs", "Sum", "Max"]),
        "mm.scale": dict(x=tf.ones([2]), op=hvd.Sum, pre=1.0 + R, want=["prescale_factor differs"]),
    }
    for name, c in cases.items():
        start = time.time()
        try:
            hvd.allreduce(c["x"], op=c["op"], name=name, prescale_factor=c.get("pre", 1.0))
        except tf.errors.FailedPreconditionError as e:  # Horovod's class for ranks that disagree
            for w in c["want"] + [f"'{name}'"]:
                assert w in e.message, f"{name}: {w!r} not in {e.message!r}"
        else:
            raise AssertionError(f"{name}: no error raised")
        assert time.time() - start < 10, f"{name}: error took {time.time() - start:.1f}s"
    # The engine keeps working afterwards.
    y = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="after.mismatch")
    assert np.all(y.numpy() == N)


def check_bad_arguments_raise_clear_errors():
    for bad_op in (99, "sum"):
        try:
            hvd.allreduce(tf.ones([1]), op=bad_op)
            raise AssertionError("no error for bad op")
        except ValueError as e:
            assert "op must be one of" in str(e)
    try:
        hvd.allreduce(tf.ones([1], tf.int32), op=hvd.Adasum)   # Adasum reduces floating-point tensors only
        raise AssertionError("no error for an int32 Adasum")
    except ValueError as e:
        assert "Adasum" in str(e)
    try:
        hvd.allreduce(tf.constant([True]), op=hvd.Sum)
        raise AssertionError("no error for bool")
    except (TypeError, tf.errors.InvalidArgumentError) as e:
        assert "bool" in str(e)
    try:
        hvd.allreduce(tf.constant([1 + 2j]), op=hvd.Sum)
        raise AssertionError("no error for complex")
    except (TypeError, tf.errors.InvalidArgumentError) as e:
        assert "complex" in str(e)
    try:
        hvd.broadcast(tf.ones([1]), root_rank=N + 5, name="bad.root")
        raise AssertionError("no error for root out of range")
    except tf.errors.InvalidArgumentError as e:
        assert "out of range" in e.message
    try:
        hvd.init(comm="world")
        raise AssertionError("no error for bad comm")
    except TypeError as e:
        assert "mpi4py communicator" in str(e)


def check_numpy_collectives_through_the_binding():
    import ml_dtypes
    for dt in (np.float32, np.float64, np.int32, np.int64, np.uint8, np.int8, np.float16, ml_dtypes.bfloat16):
        x = values(R, (4, 3)).astype(dt)
        y = _core.allreduce(x, hvd.Sum, f"np.{np.dtype(dt).name}")
        assert y.dtype == x.dtype and y.shape == x.shape
        assert np.array_equal(y.astype(np.float64), reference(hvd.Sum, (4, 3))), np.dtype(dt).name
    # Other spellings of the same types: int64 as C long long, and the non-native byte order
    # (reduced in the native one, its result native).
    for spelling in ("q", ">f4", ">i8", ">f2"):
        x = values(R, (4, 3)).astype(spelling)
        y = _core.allreduce(x, hvd.Sum, f"np.{spelling}")
        assert y.dtype == x.dtype.newbyteorder("=") and y.dtype.isnative, (spelling, y.dtype)
        assert np.array_equal(y.astype(np.float64), reference(hvd.Sum, (4, 3))), spelling
    g = _core.allgather(np.full((R + 1, 2), R, np.int64), "np.gather")
    assert np.array_equal(g[:, 0], np.concatenate([np.full(r + 1, r) for r in range(N)]))
    b = _core.broadcast(np.array([R, R], np.float32), N - 1, "np.bcast")
    assert np.all(b == N - 1)
    try:
        _core.allreduce(np.ones(2, np.complex64), hvd.Sum, "np.bad")
        raise AssertionError("no error for complex")
    except TypeError as e:
        assert "unsupported dtype" in str(e)
    try:
        _core.allreduce(np.ones(2, np.uint32), hvd.Sum, "np.bad.uint32")
        raise AssertionError("no error for uint32")
    except TypeError as e:
        assert "unsupported dtype uint32" in str(e)


def check_large_tensors_and_many_chunks():
    # 9 MB: above the np=3 run's 4 KiB chunks (thousands of MPI calls) and,
    # grouped with small ones, a fused bucket mixing sizes.
    big = tf.constant(values(R, (2_250_000,)), tf.float32)
    y = hvd.allreduce(big, op=hvd.Sum, name="big.single")
    assert_close(y.numpy(), reference(hvd.Sum, (2_250_000,)), tf.float32, "big")
    ys = hvd.grouped_allreduce([big, tf.ones([3]), tf.cast(big, tf.float64)], op=hvd.Average, name="big.group")
    assert_close(ys[2].numpy(), reference(hvd.Average, (2_250_000,)), tf.float64, "big group f64")
    assert np.allclose(ys[1].numpy(), 1.0)


def check_count_above_int_max():
    # 2^31 + 5 int8 elements: more than an MPI int count can hold in one call.
    if os.environ.get("TF_MPI_TEST_BIG") != "1":
        raise SkipCheck("needs TF_MPI_TEST_BIG=1 (2 x 4 GiB of memory): only the np=2 launch sets it")
    n = 2**31 + 5
    x = tf.ones([n], tf.int8)
    y = hvd.allreduce(x, op=hvd.Sum, name="bigcount")
    del x
    assert y.shape == (n,)
    lo, hi = int(tf.reduce_min(y)), int(tf.reduce_max(y))
    assert lo == hi == N, (lo, hi)
    tail = y[-5:].numpy()
    assert np.all(tail == N), tail


if __name__ == "__main__":
    run_checks(globals(), R)
