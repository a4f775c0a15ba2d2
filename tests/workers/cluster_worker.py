"""tf_mpi across pretend hosts (tests/cluster.py), run on every rank by tests/test_cluster.py.

Each rank is on its own host's network stack and hostname; every cross-host
byte goes over TCP through the test bed's bridge. Expected values come from
sources other than tf_mpi: the launch's host list (TF_MPI_TEST_HOSTS, as given
to ``--host``), hostnames gathered with mpi4py, numpy on the rank-dependent
inputs, the binomial tree's definition, and a plain Keras model trained on
every rank's data at once.

With TF_MPI_TEST_TF=1 the ``check_tf_*`` checks run too (TensorFlow ops,
object helpers, model.fit, the timeline); without it only the array API runs
(no TensorFlow import, so 6 ranks start quickly on a small machine).
"""
import json
import os
import socket
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import SkipCheck, run_checks, set_environ  # noqa: E402

from tf_mpi import basics  # noqa: E402
from tf_mpi.basics import _core  # noqa: E402

WITH_TF = os.environ.get("TF_MPI_TEST_TF") == "1"
if WITH_TF:
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras
    import tf_mpi as hvd
    import tf_mpi.keras as hvd_keras

basics.init()
from mpi4py import MPI  # noqa: E402  (adopts the MPI tf_mpi initialised)

COMM = MPI.COMM_WORLD
R, N = _core.rank(), _core.size()
SUM, AVERAGE, MIN, MAX, PRODUCT = (int(basics.Sum), int(basics.Average), int(basics.Min), int(basics.Max),
                                   int(basics.Product))
NUMPY_OPS = {SUM: lambda s: s.sum(0), MIN: lambda s: s.min(0), MAX: lambda s: s.max(0), PRODUCT: lambda s: s.prod(0)}
DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)
STEPS = 20  # steady-state steps counted for the negotiation messages


def host_of_each_rank():
    """Rank -> host, from the launch's ``--host h1:S1,h2:S2`` list: Open MPI fills each host's slots in turn."""
    out = []
    for item in os.environ["TF_MPI_TEST_HOSTS"].split(","):
        host, slots = item.split(":")
        out += [host] * int(slots)
    assert len(out) == N, (out, N)
    return out


HOSTS = host_of_each_rank()
NODES = list(dict.fromkeys(HOSTS))  # in order of first rank


def values(rank, count, dtype, seed=0):
    """Small integers 1..3 (exact in every dtype; a product over 6 ranks fits float16)."""
    return (((np.arange(count) * 7 + rank * 3 + seed) % 3) + 1).astype(dtype)


def expected(op, count, dtype, seed=0):
    stack = np.stack([values(r, count, dtype, seed).astype(np.float64) for r in range(N)])
    if op == AVERAGE:
        avg = stack.sum(0) / N
        return np.trunc(avg) if np.dtype(dtype).kind == "i" else avg
    return NUMPY_OPS[op](stack)


# Averages of floats: the engine divides (or scales by 1/N) in the dtype, numpy in float64.
AVERAGE_RTOL = {np.float16: 1e-3, np.float32: 1e-6, np.float64: 1e-13}


def assert_reduced(got, op, count, dtype, seed=0, what=""):
    want = expected(op, count, dtype, seed)
    got = np.asarray(got).astype(np.float64)
    if op == AVERAGE and np.dtype(dtype).kind == "f":
        ok = np.allclose(got, want, rtol=AVERAGE_RTOL[np.dtype(dtype).type], atol=0)
    else:
        ok = np.array_equal(got, want)
    assert ok, (what, np.dtype(dtype).name, op, count, got[:5], want[:5])


def need_tf():
    if not WITH_TF:
        raise SkipCheck("TensorFlow checks run in the launch with TF_MPI_TEST_TF=1")


# -- where each rank runs ------------------------------------------------------
def check_each_rank_runs_on_its_host():
    names = COMM.allgather(socket.gethostname())
    assert names == HOSTS, (names, HOSTS)


def check_local_and_cross_ranks_follow_the_hosts():
    # From the hostnames alone. Local: a rank's index among the ranks on its host. Cross (as
    # Horovod's cross communicator): the ranks with this rank's local rank, one per host that has
    # it, so on hosts of unequal size cross_size differs between local ranks.
    names = COMM.allgather(socket.gethostname())
    local = [names[:r].count(names[r]) for r in range(N)]
    peers = [r for r in range(N) if local[r] == local[R]]
    want = {"local_rank": local[R], "local_size": names.count(names[R]),
            "cross_rank": peers.index(R), "cross_size": len(peers)}
    got = {"local_rank": _core.local_rank(), "local_size": _core.local_size(),
           "cross_rank": _core.cross_rank(), "cross_size": _core.cross_size()}
    assert got == want, (got, want)
    assert len(set(names)) == len(NODES) > 1, names
    counts = {h: names.count(h) for h in names}
    assert basics.is_homogeneous() == (len(set(counts.values())) == 1), counts


# -- collectives across hosts (array API) --------------------------------------
def check_allreduce_every_op_and_dtype():
    for dtype in DTYPES:
        for op in (SUM, AVERAGE, MIN, MAX, PRODUCT):
            for count in (1, 7, 70_001):   # 70,001 float64: over half a MiB through TCP
                got = _core.allreduce(values(R, count, dtype), op, f"ar.{np.dtype(dtype).name}.{op}.{count}")
                assert got.dtype == dtype, (got.dtype, dtype)
                assert_reduced(got, op, count, dtype)


def check_grouped_allreduce_mixed_dtypes():
    group = [values(R, 5 + i, dtype, seed=i) for i, dtype in enumerate(DTYPES)]
    got = _core.grouped_allreduce(group, SUM, "grouped.mixed")
    for i, (dtype, y) in enumerate(zip(DTYPES, got)):
        assert y.dtype == dtype and np.array_equal(y.astype(np.float64), expected(SUM, 5 + i, dtype, seed=i)), i


def check_allgather_uneven_first_dims():
    for dtype in DTYPES:
        got = _core.allgather(np.full((R + 1, 3), R, dtype), f"ag.{np.dtype(dtype).name}")
        want = np.repeat(np.arange(N), np.arange(N) + 1)
        assert got.dtype == dtype and got.shape == (N * (N + 1) // 2, 3), got.shape
        assert np.array_equal(got[:, 0], want) and np.array_equal(got[:, 2], want)


def check_broadcast_from_a_rank_on_another_host():
    for root in (0, N - 1):   # first rank of the first host, last rank of the last
        got = _core.broadcast(values(R, 9, np.int64, seed=R), root, f"bc.{root}")
        assert np.array_equal(got, values(root, 9, np.int64, seed=root)), (root, got)


def check_hierarchical_and_flat_integers_bit_identical():
    """TF_MPI_HIERARCHICAL=1 (node reduce-scatter, cross-host allreduce, node allgather) and =0 (one
    flat allreduce) give the same bits for integers, equal to numpy's sums; the engine's counters
    show which ran. On hosts with unequal numbers of ranks =1 falls back to the flat path."""
    cases = [(np.int32, 1), (np.int32, 1001), (np.int64, 400_003), (np.int32, 5)]
    names = COMM.allgather(socket.gethostname())
    usable = len(set(names)) > 1 and len(set(names.count(h) for h in names)) == 1 and names.count(names[0]) > 1

    def run(mode):
        reinit(TF_MPI_HIERARCHICAL=mode)
        assert _core.hierarchical()["usable"] == usable, (_core.hierarchical(), names)
        before = _core.stats()
        out = [_core.allreduce(values(R, n, dt, seed=i), SUM, f"hier.{mode}.{i}") for i, (dt, n) in enumerate(cases)]
        out += _core.grouped_allreduce([values(R, n, dt, seed=i) for i, (dt, n) in enumerate(cases)], SUM,
                                       f"hier.{mode}.grouped")
        return out, _core.stats()["hierarchical_allreduces"] - before["hierarchical_allreduces"]

    try:
        hier, n_hier = run("1")
        flat, n_flat = run("0")
    finally:
        reinit(TF_MPI_HIERARCHICAL=None)
    # Each single allreduce is one buffer; the grouped one is one or more fused buffers.
    assert (n_hier >= len(cases) + 1 if usable else n_hier == 0) and n_flat == 0, (usable, n_hier, n_flat)
    for i, (h, f) in enumerate(zip(hier, flat)):
        dt, n = cases[i % len(cases)]
        assert h.dtype == f.dtype == dt and h.tobytes() == f.tobytes(), i
        assert np.array_equal(h, expected(SUM, n, dt, seed=i % len(cases)).astype(dt)), i


def reinit(**settings):
    """Shuts the engine down and initialises it again with these TF_MPI_* settings (None: unset)."""
    COMM.Barrier()
    _core.shutdown()
    set_environ(settings)
    basics.init()


# -- negotiation ---------------------------------------------------------------
def tree_children(r, n):
    """The binomial tree rooted at rank 0 (cpp/core/negotiation/negotiation_tree.h): r + 2^j for 2^j < lowbit(r);
    rank 0's children are every 2^j < n."""
    span = n if r == 0 else r & -r
    return [r + 2 ** j for j in range(span.bit_length()) if 2 ** j < span and r + 2 ** j < n]


def check_negotiation_messages_follow_the_tree():
    """Per steady-state step (one grouped allreduce from the response cache) a rank takes one batch of
    decisions from its parent and one report from each child, and sends one report up and one batch to
    each child: 2 * children + 2 messages (rank 0: 2 * children), whatever host each rank is on."""
    assert "negotiation=tree" in _core.config(), _core.config()
    grads = [np.full(4, R, np.float32), np.arange(3, dtype=np.int64) * (R + 1)]

    def step():
        out = _core.grouped_allreduce(grads, SUM, "negotiation.step")
        assert np.all(out[0] == N * (N - 1) // 2) and np.all(out[1] == np.arange(3) * (N * (N + 1) // 2)), out

    for _ in range(3):   # negotiated in full once, then by cache id
        step()
    # A barrier outside the engine after each snapshot: no rank's later messages reach a rank
    # that has not taken its snapshot yet, so every rank counts exactly these steps.
    before = _core.stats()
    COMM.Barrier()
    for _ in range(STEPS):
        step()
    after = _core.stats()
    COMM.Barrier()
    got = sum(after[k] - before[k] for k in ("negotiation_msgs_sent", "negotiation_msgs_received")) / STEPS
    want = 2 * len(tree_children(R, N)) + (2 if R else 0)
    assert got == want, (R, got, want, tree_children(R, N))


# -- TensorFlow across hosts ---------------------------------------------------
def check_tf_allreduce_every_op_and_dtype():
    need_tf()
    for dtype in (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64):
        for op, tf_op in ((SUM, hvd.Sum), (AVERAGE, hvd.Average), (MIN, hvd.Min), (MAX, hvd.Max),
                          (PRODUCT, hvd.Product)):
            np_dtype = dtype.as_numpy_dtype
            got = hvd.allreduce(tf.constant(values(R, 11, np_dtype)), op=tf_op, name=f"tf.ar.{dtype.name}.{op}")
            assert got.dtype == dtype, (got.dtype, dtype)
            assert_reduced(got.numpy(), op, 11, np_dtype, what="tf")


def check_tf_grouped_allreduce():
    need_tf()
    got = hvd.grouped_allreduce([tf.constant(values(R, 4, np.float32)), tf.constant(values(R, 6, np.int64, 1))],
                                op=hvd.Sum, name="tf.grouped")
    assert np.array_equal(got[0].numpy(), expected(SUM, 4, np.float32).astype(np.float32))
    assert np.array_equal(got[1].numpy(), expected(SUM, 6, np.int64, 1).astype(np.int64))


def check_tf_allgather_uneven_first_dims():
    need_tf()
    for dtype in (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64):
        got = hvd.allgather(tf.fill([R + 1, 2], tf.cast(R, dtype)), name=f"tf.ag.{dtype.name}")
        assert got.dtype == dtype and got.shape == (N * (N + 1) // 2, 2), (dtype.name, got.shape)
        assert np.array_equal(got.numpy()[:, 1], np.repeat(np.arange(N), np.arange(N) + 1)), dtype.name


def check_tf_broadcast_alltoall_reducescatter():
    need_tf()
    got = hvd.broadcast(tf.constant(values(R, 5, np.float64, seed=R)), root_rank=N - 1, name="tf.bc")
    assert np.array_equal(got.numpy(), values(N - 1, 5, np.float64, seed=N - 1))
    # alltoall: rank r sends j + 1 rows of value 100 r + j to rank j.
    splits = [j + 1 for j in range(N)]
    data = tf.concat([tf.fill([s, 2], 100 * R + j) for j, s in enumerate(splits)], 0)
    out, received = hvd.alltoall(data, splits=splits, name="tf.a2a")
    assert received.numpy().tolist() == [R + 1] * N, received.numpy()
    assert np.array_equal(out.numpy()[:, 0], np.repeat(100 * np.arange(N) + R, R + 1)), out.numpy()
    # reducescatter of 2N + 1 rows: the first rank gets the extra row.
    total = 2 * N + 1
    x = np.arange(total * 2, dtype=np.float32).reshape(total, 2)
    got = hvd.reducescatter(tf.constant(x + R), op=hvd.Sum, name="tf.rs")
    full = sum(x + r for r in range(N))
    q, m = divmod(total, N)
    start = R * q + min(R, m)
    assert np.array_equal(got.numpy(), full[start:start + q + (1 if R < m else 0)]), got.numpy()


def check_tf_object_helpers():
    need_tf()
    mine = {"rank": R, "host": socket.gethostname(), "pad": "x" * (1000 * R)}   # sizes differ per rank
    everyone = hvd.allgather_object(mine)
    assert [o["rank"] for o in everyone] == list(range(N)) and [o["host"] for o in everyone] == HOSTS, everyone
    assert [len(o["pad"]) for o in everyone] == [1000 * r for r in range(N)]
    assert hvd.broadcast_object(mine if R == N - 1 else None, root_rank=N - 1)["host"] == HOSTS[-1]


def check_tf_model_fit_matches_one_model_on_all_the_data():
    """model.fit with DistributedOptimizer on rank-dependent batches: every rank ends with the same
    weights and optimizer state (momentum), the weights equal to a plain Keras model (no tf_mpi)
    trained on all ranks' batches at once (SGD with momentum on the average of equal-size batches'
    mean gradients = the same on their union's mean gradient)."""
    need_tf()
    batch, steps, lr = 8, 5, 0.05

    def data(r):
        rng = np.random.default_rng(100 + r)
        x = rng.standard_normal((batch * steps, 3)).astype(np.float32)
        return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)

    def model():
        keras.utils.set_random_seed(7)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])

    m = model()
    initial = [w.copy() for w in m.get_weights()]
    m.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)), loss="mse")
    x, y = data(R)
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
          callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    weights = m.get_weights()
    gathered = COMM.allgather([w.tobytes() for w in weights])
    assert all(g == gathered[0] for g in gathered), "weights differ between ranks"
    state = [v.numpy() for v in m.optimizer.variables]
    assert any(np.any(v != 0) for v in state[1:]), "no momentum was built up"
    gathered = COMM.allgather([v.tobytes() for v in state])
    assert all(g == gathered[0] for g in gathered), "optimizer state differs between ranks"
    assert not np.allclose(weights[0], initial[0]), "training did not change the weights"

    # Step s of the reference sees every rank's batch s, in rank order.
    parts = [data(r) for r in range(N)]
    xs = np.concatenate([p[0][s * batch:(s + 1) * batch] for s in range(steps) for p in parts])
    ys = np.concatenate([p[1][s * batch:(s + 1) * batch] for s in range(steps) for p in parts])
    ref = model()
    ref.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss="mse", run_eagerly=True)  # no tracing
    ref.fit(xs, ys, batch_size=batch * N, epochs=1, shuffle=False, verbose=0)
    for w, v in zip(weights, ref.get_weights()):
        assert np.allclose(w, v, rtol=1e-5, atol=1e-6), np.abs(w - v).max()


def check_tf_timeline_has_every_hosts_ranks():
    need_tf()
    out = os.environ["TF_MPI_TEST_OUT"]   # shared by every pretend host (one file system)
    path = os.path.join(out, "timeline.json")
    hvd.start_timeline(path)
    hvd.barrier()   # rank 0 records a peer's READY only once its timeline runs
    hvd.allreduce(tf.ones([5]), op=hvd.Sum, name="tl.allreduce")
    hvd.allgather(tf.ones([R + 1]), name="tl.allgather")
    hvd.stop_timeline()
    hvd.barrier()
    if R != 0:
        return
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    for track in ("tl.allreduce", "tl.allgather"):
        ready = sorted(e["args"]["rank"] for e in events
                       if e["ph"] == "i" and e["name"] == "READY" and tracks.get(e["tid"]) == track)
        assert ready == list(range(N)), (track, ready)


if __name__ == "__main__":
    run_checks(globals(), R)
    _core.shutdown()
