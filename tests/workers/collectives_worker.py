"""allgather, broadcast, alltoall, reducescatter, object helpers and data
sharding, run on every rank by tests/test_collectives.py (np=2 and np=3).
Expected values are computed from the same rank-dependent formulas."""
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402
from _expect import raises  # noqa: E402

import tf_mpi as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
DTYPES = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64,
          tf.bool]


def rows(rank, n, cols=3, dtype=tf.float32):
    """n rows whose values encode (rank, row, col)."""
    a = (rank * 100 + np.arange(n * cols).reshape(n, cols)) % 120
    return tf.cast(tf.constant(a % 2 == 1 if dtype == tf.bool else a), dtype)


def check_allgather_uneven_every_dtype():
    for dtype in DTYPES:
        got = hvd.allgather(rows(R, R + 1, dtype=dtype), name=f"ag.{dtype.name}")
        want = tf.concat([rows(r, r + 1, dtype=dtype) for r in range(N)], 0)
        assert got.dtype == dtype and np.array_equal(got.numpy(), want.numpy()), dtype.name
    # A rank with nothing to contribute, and 3-d tensors.
    got = hvd.allgather(tf.zeros([0 if R == 0 else 2, 2, 2]), name="ag.empty")
    assert got.shape == (2 * (N - 1), 2, 2)


def check_grouped_allgather_and_in_tf_function():
    @tf.function
    def f(a, b):
        return hvd.grouped_allgather([a, b])

    a, b = f(rows(R, 2), rows(R, R + 1, cols=1, dtype=tf.int64))
    assert np.array_equal(a.numpy(), tf.concat([rows(r, 2) for r in range(N)], 0).numpy())
    assert b.shape == (sum(r + 1 for r in range(N)), 1)


def check_allgather_errors():
    raises(lambda: hvd.allgather(tf.zeros([2, 3 + R]), name="ag.bad"), tf.errors.OpError, "mismatched allgather",
           "shape")
    raises(lambda: hvd.allgather(tf.constant(1.0), name="ag.scalar"), tf.errors.OpError, "at least one dimension")


def check_broadcast_every_dtype_and_root():
    for root in range(N):
        for dtype in DTYPES:
            got = hvd.broadcast(rows(R, 2, dtype=dtype), root_rank=root, name=f"bc.{root}.{dtype.name}")
            assert np.array_equal(got.numpy(), rows(root, 2, dtype=dtype).numpy()), (root, dtype.name)
    v = tf.Variable(rows(R, 3))
    hvd.broadcast_variables([v], root_rank=N - 1)
    assert np.array_equal(v.numpy(), rows(N - 1, 3).numpy())


def check_broadcast_errors():
    raises(lambda: hvd.broadcast(tf.ones([2]), root_rank=R, name="bc.disagree"), tf.errors.OpError, "root rank differs")
    raises(lambda: hvd.broadcast(tf.ones([2]), root_rank=N, name="bc.range"), tf.errors.OpError, "out of range")


def check_alltoall_with_splits_including_zeros():
    # Rank r sends (j + r) % 3 rows to rank j: some zero, and rank 0 sends nothing to rank 0 when r == 0.
    splits = [(j + R) % 3 for j in range(N)]
    data = tf.concat([tf.fill([s, 2], float(100 * R + j)) for j, s in enumerate(splits)], 0)
    out, received = hvd.alltoall(data, splits=splits, name="a2a.splits")
    want_counts = [(R + j) % 3 for j in range(N)]  # what rank j sends to me
    assert received.numpy().tolist() == want_counts, (received.numpy(), want_counts)
    want = np.concatenate([np.full([c, 2], 100 * j + R) for j, c in enumerate(want_counts)]) if sum(want_counts) \
        else np.zeros([0, 2])
    assert np.array_equal(out.numpy(), want)


def check_alltoall_where_rank_0_receives_nothing():
    splits = [0] + [1] * (N - 1)  # nobody sends to rank 0
    out, received = hvd.alltoall(tf.fill([N - 1, 2], R), splits=splits, name="a2a.none.to.0")
    assert received.numpy().tolist() == ([0] * N if R == 0 else [1] * N)
    assert out.shape == ((0, 2) if R == 0 else (N, 2))
    if R:
        assert out.numpy()[:, 0].tolist() == list(range(N))
    # Rank 0 sends nothing at all (0 rows); the others send it one row each.
    mine = tf.zeros([0, 2]) if R == 0 else tf.fill([N, 2], float(R))
    out, received = hvd.alltoall(mine, splits=[0] * N if R == 0 else [1] * N, name="a2a.rank0.sends.nothing")
    assert received.numpy().tolist() == [0] + [1] * (N - 1)
    assert out.numpy()[:, 0].tolist() == [float(j) for j in range(1, N)]
    v = tf.Variable(tf.fill([2], float(R)))
    hvd.broadcast_([v], root_rank=N - 1)
    assert np.all(v.numpy() == N - 1)


def check_alltoall_equal_split_every_dtype():
    for dtype in DTYPES:
        out = hvd.alltoall(rows(R, 2 * N, dtype=dtype), name=f"a2a.eq.{dtype.name}")  # no splits: tensor only
        want = tf.concat([rows(j, 2 * N, dtype=dtype)[2 * R:2 * R + 2] for j in range(N)], 0)
        assert np.array_equal(out.numpy(), want.numpy()), dtype.name


def check_alltoall_errors():
    raises(lambda: hvd.alltoall(tf.ones([N + 1, 2]), name="a2a.indivisible"), tf.errors.OpError, "divisible")
    raises(lambda: hvd.alltoall(tf.ones([3]), splits=[1] * (N + 1), name="a2a.len"), tf.errors.OpError, "splits has")
    raises(lambda: hvd.alltoall(tf.ones([3]), splits=[3] + [1] * (N - 1), name="a2a.sum"), tf.errors.OpError, "sum to")


def check_reducescatter_uneven_sum_and_average():
    total = 2 * N + 1  # uneven: the first rank gets one more row
    x = tf.cast(tf.reshape(tf.range(total * 2) + R, [total, 2]), tf.float32)
    full = sum(np.arange(total * 2).reshape(total, 2) + r for r in range(N)).astype(np.float32)
    q, m = divmod(total, N)
    start = R * q + min(R, m)
    mine = full[start:start + q + (1 if R < m else 0)]
    got = hvd.reducescatter(x, op=hvd.Sum, name="rs.sum")
    assert np.array_equal(got.numpy(), mine), (got.numpy(), mine)
    got = hvd.reducescatter(x, op=hvd.Average, name="rs.avg")
    assert np.allclose(got.numpy(), mine / N)
    got = hvd.reducescatter(tf.cast(x, tf.float16), op=hvd.Sum, prescale_factor=2.0, name="rs.f16")
    assert np.allclose(got.numpy().astype(np.float32), 2 * mine, rtol=1e-3)
    a, b = hvd.grouped_reducescatter([x, tf.cast(x, tf.int64)], op=hvd.Sum, name="rs.group")
    assert np.array_equal(b.numpy(), mine.astype(np.int64))
    small = tf.cast(tf.reshape(tf.range(total * 2) % 5 + R, [total, 2]), tf.float64)
    small_mine = sum(np.arange(total * 2).reshape(total, 2) % 5 + r for r in range(N))[start:start + len(mine)]
    for dtype in DTYPES[:-1]:  # every reducible dtype (not bool)
        got = hvd.reducescatter(tf.cast(small, dtype), op=hvd.Sum, name=f"rs.{dtype.name}")
        assert got.dtype == dtype and np.allclose(tf.cast(got, tf.float64).numpy(), small_mine), dtype.name
    raises(lambda: hvd.reducescatter(tf.constant(1.0), name="rs.scalar"), tf.errors.OpError, "at least one dimension")


def check_gradients_of_gather_broadcast_alltoall_reducescatter():
    # Horovod's definitions (tests/workers/horovod_compat_worker.py checks them in every mode).
    x = tf.Variable(tf.fill([R + 1, 2], 1.0))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allgather(x, name="g.ag") * float(R + 1))
    g = tape.gradient(loss, x)
    assert np.allclose(g.numpy(), sum(r + 1 for r in range(N)) / N), g.numpy()  # averaged, then my rows
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.broadcast(x[:1], root_rank=0, name="g.bc") * float(R + 1))
    g = tape.gradient(loss, x)
    assert np.allclose(g.numpy()[0], sum(r + 1 for r in range(N)) / N if R == 0 else 0.0), g.numpy()
    y = tf.Variable(tf.ones([N, 2]))
    with tf.GradientTape() as tape:
        out = hvd.alltoall(y, name="g.a2a")
        loss = tf.reduce_sum(out * float(R + 1))
    g = tape.gradient(loss, y)
    assert np.allclose(g.numpy()[:, 0], [j + 1 for j in range(N)]), g.numpy()  # row j went to rank j
    z = tf.Variable(tf.ones([N, 2]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.reducescatter(z, op=hvd.Sum, name="g.rs") * float(R + 1))
    g = tape.gradient(loss, z)
    assert np.allclose(g.numpy()[:, 0], [N * (j + 1) for j in range(N)]), g.numpy()  # row j reduced on rank j


def check_object_helpers_and_barrier():
    obj = {"rank": R, "nested": [R, (R, "x" * R)], "fn": (lambda v: v + R)}
    got = hvd.broadcast_object(obj, root_rank=N - 1)
    assert got["rank"] == N - 1 and got["nested"][1][1] == "x" * (N - 1) and got["fn"](1) == N
    gathered = hvd.allgather_object({"r": R, "payload": list(range(R))})
    assert [g["r"] for g in gathered] == list(range(N)) and gathered[-1]["payload"] == list(range(N - 1))

    @hvd.broadcast_object_fn(root_rank=0)
    def only_root():
        return f"computed on {R}"

    assert only_root() == "computed on 0"
    hvd.barrier()


def check_data_shard_by_rank():
    ds = hvd.data.shard(tf.data.Dataset.range(10))
    assert list(ds.as_numpy_iterator()) == list(range(R, 10, N))
    a, b = hvd.data.shard_arrays(np.arange(10), np.arange(10) * 2)
    per = 10 // N
    assert a.tolist() == list(range(R * per, (R + 1) * per)) and b.tolist() == [2 * v for v in a]
    assert hvd.data.rank_seed(5) != hvd.allgather_object(hvd.data.rank_seed(5))[(R + 1) % N] or N == 1


def check_join_with_uneven_batches():
    # Rank r has 2 + r batches. Ranks that run out call join() and stand in
    # with zeros; Average divides by the ranks still contributing.
    steps = 2 + R
    for s in range(steps):
        active = sum(1 for r in range(N) if s < 2 + r)
        x = tf.fill([3], float(R + 1))
        total = hvd.allreduce(x, op=hvd.Sum, name=f"join.sum.{s}")
        mean = hvd.allreduce(x, op=hvd.Average, name=f"join.avg.{s}")
        want = sum(r + 1 for r in range(N) if s < 2 + r)
        assert np.allclose(total.numpy(), want), (s, total.numpy(), want)
        assert np.allclose(mean.numpy(), want / active), (s, mean.numpy(), want / active)
        grouped = hvd.grouped_allreduce([x, tf.cast(x, tf.int32)], op=hvd.Sum, name=f"join.group.{s}")
        assert int(grouped[1][0]) == want
        gathered = hvd.allgather(tf.fill([R + 1], R), name=f"join.gather.{s}")
        assert gathered.numpy().tolist() == [r for r in range(N) if s < 2 + r for _ in range(r + 1)], gathered
    assert hvd.join() == N - 1  # the rank with the most batches joins last
    # Everything is back to normal afterwards.
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="after.join")) == N


def check_join_refuses_collectives_that_cannot_stand_in():
    if R == N - 1:
        raises(lambda: hvd.broadcast(tf.ones([1]), root_rank=R, name="join.bcast"), tf.errors.OpError,
               "have called join()")
    assert hvd.join() == N - 1  # rank N-1 joins after its failed broadcast


def check_timeline_records_a_known_sequence():
    import json
    import tempfile
    # A folder that does not exist yet: the engine creates it.
    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "new", "dir", "trace.json") if R == 0 else None)
    hvd.start_timeline(path)
    # Rank 0 records a peer's READY only once its timeline runs: no rank announces before that.
    hvd.barrier()
    hvd.grouped_allreduce([tf.ones([4]), tf.ones([8]), tf.ones([2])], op=hvd.Sum, name="tl.group")
    hvd.allreduce(tf.ones([3, 3]), op=hvd.Sum, name="tl.single")
    hvd.allgather(tf.ones([R + 1]), name="tl.gather")
    hvd.stop_timeline()
    if R != 0:
        return
    with open(path) as f:
        events = json.load(f)["traceEvents"]  # valid JSON after stop_timeline()
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"tl.group", "tl.single", "tl.gather"} <= set(tracks.values()), tracks

    def on(track, name):
        return [e for e in events if e["ph"] in "Xi" and tracks[e["tid"]] == track and e["name"] == name]

    for track in ("tl.group", "tl.single", "tl.gather"):
        assert len(on(track, "NEGOTIATE")) == 1, track
        assert sorted(e["args"]["rank"] for e in on(track, "READY")) == list(range(N)), track
    # The reduction itself: over MPI, or over shared memory when every rank shares the node (the
    # default), which reduces the fused tensors where they lie (no fusion-buffer copies).
    reduce_phase = "SHM_ALLREDUCE" if on("tl.group", "SHM_ALLREDUCE") else "MPI_ALLREDUCE"
    mpi = on("tl.group", reduce_phase)[0]
    assert mpi["ts"] >= on("tl.group", "NEGOTIATE")[0]["ts"] + on("tl.group", "NEGOTIATE")[0]["dur"] - 1
    fused = on("tl.group", "MEMCPY_IN_FUSION_BUFFER")
    if reduce_phase == "SHM_ALLREDUCE":
        assert not fused and mpi["args"]["tensors"] == 3 and mpi["args"]["bytes"] == 56, (fused, mpi)
    else:
        assert fused and fused[0]["args"]["tensors"] == 3 and fused[0]["args"]["bytes"] == 56, fused
        assert on("tl.group", "MEMCPY_OUT_FUSION_BUFFER")[0]["ts"] >= mpi["ts"] + mpi["dur"] - 1
    single = on("tl.single", reduce_phase)
    assert single and single[0]["args"]["tensors"] == 1 and not on("tl.single", "MEMCPY_IN_FUSION_BUFFER")
    assert on("tl.gather", "MPI_ALLGATHER")
    from tf_mpi import timeline_plot
    steps = timeline_plot.plot(path, path + ".png")
    assert os.path.getsize(path + ".png") > 1000 and steps and steps[0]["mpi"] > 0


if __name__ == "__main__":
    run_checks(globals(), R)
