"""Horovod 0.28.1's API as `import tf_mpi as hvd` must offer it: join as an op,
the signatures (names, order, defaults) of horovod.tensorflow, int32 alltoall
splits, the root's own object from broadcast_object, gradients of Min / Max /
Product allreduces, the process-set parameters and ops, and the small helpers
(is_homogeneous, gloo_enabled, nccl_built, ...). Run on every rank by
tests/test_horovod_api_compat.py at np=2 and np=3.

Expected values come from numpy, from mpi4py on MPI_COMM_WORLD (not from
tf_mpi) for reductions across ranks, and from Horovod's source for the
signatures and formulas (transcribed below, with the file they come from).
"""
import inspect
import os
import socket
import sys
import threading
import time
import warnings

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402
from _expect import raises  # noqa: E402
# The Session and gradient helpers (eager, tf.function and TF1 graph) of the Horovod-semantics worker.
from horovod_compat_worker import MODES, gradients, tf1_session  # noqa: E402

import tf_mpi as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()

from mpi4py import MPI  # noqa: E402  (after init: tf_mpi initialised MPI with MPI_THREAD_MULTIPLE)

WORLD = MPI.COMM_WORLD
LATE_S = 0.5  # how long the last rank keeps the others waiting in join()


def mpi_reduce(a, op=MPI.SUM):
    """Elementwise reduction of `a` over ranks by mpi4py (independent of tf_mpi)."""
    a = np.ascontiguousarray(a, np.float64)
    out = np.empty_like(a)
    WORLD.Allreduce(a, out, op=op)
    return out


# ---- join: an int32 op that waits each time it runs ------------------------

class Ticker(threading.Thread):
    """A Python thread that notes the time every 5 ms: it only advances while nobody holds the GIL."""

    def __init__(self):
        super().__init__(daemon=True)
        self.ticks, self.stop = [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.ticks.append(time.monotonic())
            time.sleep(0.005)


def join_round(call, late, tag):
    """Every rank runs `call` (a join); rank `late` first sleeps, then runs an allreduce that only it
    submits (it completes once all the others have joined and stand in with zeros), then joins.
    Returns what `call` returned; asserts that the waiting ranks' Python threads kept running."""
    WORLD.Barrier()
    if R == late:
        time.sleep(LATE_S)
        alone = hvd.allreduce(tf.constant([float(late + 1)]), op=hvd.Sum, name=f"join.late.{tag}")
        assert float(alone[0]) == late + 1, (tag, alone)  # the others contributed zeros: they were joined
        return call()
    ticker = Ticker()
    ticker.start()
    start = time.monotonic()
    got = call()
    end = time.monotonic()
    ticker.stop.set()
    ticker.join()
    assert end - start >= LATE_S - 0.05, (tag, end - start)  # it did wait for the late rank
    during = [t for t in ticker.ticks if start + 0.05 < t < end - 0.05]
    assert len(during) >= 5, (tag, len(during), end - start)  # the GIL was free while join() waited
    return got


def assert_last_rank(got, late, tag):
    assert isinstance(got, (tf.Tensor, np.ndarray, np.integer)), (tag, type(got))
    assert tf.as_dtype(got.dtype) == tf.int32 and tuple(got.shape) == (), (tag, got.dtype, got.shape)
    assert int(got) == late, (tag, int(got), late)
    assert WORLD.allgather(int(got)) == [late] * N, tag


def check_join_is_an_int32_op_that_waits_each_time_it_runs():
    """Horovod (mpi_ops.py join, mpi_ops.cc HorovodJoin): an op with an int32 scalar output, the last
    rank to join. Each run waits again and returns that run's last rank: eagerly, on each call of one
    traced tf.function, and on each Session.run of one graph."""
    for k, late in enumerate((N - 1, 0)):
        assert_last_rank(join_round(hvd.join, late, f"eager.{k}"), late, f"eager.{k}")
    fn = tf.function(lambda: hvd.join())
    for k, late in enumerate((N - 1, 0)):
        assert_last_rank(join_round(fn, late, f"function.{k}"), late, f"function.{k}")
    assert fn.experimental_get_tracing_count() == 1  # one graph, two different answers
    graph = tf.Graph()
    with graph.as_default():
        last = hvd.join()
    assert last.dtype == tf.int32 and last.shape.rank == 0
    # The Session runs the graph; join_round's own allreduce stays eager (`with sess:` would make the
    # graph the default one).
    sess = tf.compat.v1.Session(graph=graph)
    try:
        for k, late in enumerate((0, N - 1)):
            assert_last_rank(join_round(lambda: sess.run(last), late, f"graph.{k}"), late, f"graph.{k}")
    finally:
        sess.close()


def check_join_in_tf_function_runs_after_the_collectives_written_before_it():
    """Horovod's ops run in program order inside tf.function; a join that overtook an allreduce written
    before it would leave that allreduce to be matched after the others completed it without this rank."""
    @tf.function
    def step(x):
        total = hvd.allreduce(x, op=hvd.Sum, name="join.order.sum")
        return total, hvd.join()

    graph = step.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph
    (join_op,) = [op for op in graph.get_operations() if op.type == "PyFunc"]
    assert any(op.type == "TfMpiAllreduce" for op in join_op.control_inputs), join_op.control_inputs
    total, last = step(tf.fill([3], float(R + 1)))
    assert np.array_equal(total.numpy(), np.full(3, N * (N + 1) / 2)), total
    assert int(last) in range(N) and WORLD.allgather(int(last)) == [int(last)] * N


# ---- alltoall: int32 received splits -----------------------------------------

def check_alltoall_received_splits_are_int32():
    """Horovod (mpi_ops.cc HorovodAlltoall): Output("received_splits: int32")."""
    splits = [R + j + 1 for j in range(N)]  # rows this rank sends to rank j
    sent = np.concatenate([np.full(n, 100 * j + R, np.int64) for j, n in enumerate(splits)])
    want_rows = np.concatenate([np.full(j + R + 1, 100 * R + j, np.int64) for j in range(N)])
    want_splits = np.array([j + R + 1 for j in range(N)], np.int32)

    def check(rows, received, how):
        assert received.dtype == np.int32, (how, received.dtype)
        assert np.array_equal(received, want_splits), (how, received)
        assert np.array_equal(rows, want_rows), (how, rows)

    for how, s in (("list", splits), ("int32", tf.constant(splits, tf.int32)),
                   ("int64", tf.constant(splits, tf.int64))):
        rows, received = hvd.alltoall(tf.constant(sent), s, name=f"a2a.eager.{how}")
        check(rows.numpy(), received.numpy(), how)
    rows, received = tf.function(lambda: hvd.alltoall(tf.constant(sent), splits=splits, name="a2a.fn"))()
    check(rows.numpy(), received.numpy(), "function")
    with tf1_session() as sess:
        out = hvd.alltoall(tf.constant(sent), splits=tf.constant(splits, tf.int32), name="a2a.graph")
        assert out[1].dtype == tf.int32
        check(*sess.run(out), "graph")


# ---- the object helpers: Horovod's session argument, the root's own object ---

def check_object_helpers_take_a_session_and_give_the_root_its_own_object():
    """Horovod (functions.py): broadcast_object(obj, root_rank=0, session=None, name=None, process_set)
    returns `obj` itself on the root (it only unpickles on the others); allgather_object(obj,
    session=None, name=None, process_set) unpickles every element, this rank's too."""
    root = N - 1

    def obj(r):
        return {"rank": r, "items": list(range(r + 2))}

    mine = obj(R)
    got = hvd.broadcast_object(mine, root, None, "obj.eager")  # Horovod's positions: session third
    assert got == obj(root) and (got is mine) == (R == root), got
    got = hvd.broadcast_object(mine, root_rank=root, session=None, name="obj.kw", process_set=None)
    assert got == obj(root) and (got is mine) == (R == root), got
    gathered = hvd.allgather_object(mine, None, "gather.eager")
    assert gathered == [obj(r) for r in range(N)] and all(g is not mine for g in gathered), gathered
    with tf1_session() as sess:  # TF1 graph mode with the Session passed, as Horovod's scripts do
        got = hvd.broadcast_object(mine, root, sess, "obj.graph")
        assert got == obj(root) and (got is mine) == (R == root), got
        assert hvd.allgather_object(mine, sess, "gather.graph") == [obj(r) for r in range(N)]
    read = hvd.broadcast_object_fn(root, None, "objfn")(lambda: obj(R))  # Horovod's parameter order
    assert read() == obj(root)


# ---- broadcast_variables(variables, root_rank, process_set, inplace) -----------

def check_broadcast_variables_takes_horovods_parameters():
    """Horovod (functions.py): broadcast_variables(variables, root_rank, process_set=global_process_set,
    inplace=False); eagerly it assigns and returns None, in a graph it returns the op."""
    root = N - 1

    def values(r, k):
        return np.arange(3, dtype=np.float32) + 10 * r + k

    from tf_mpi import _unused_arguments
    _unused_arguments._warned.clear()
    for k, inplace in enumerate((False, True, True)):
        v = tf.Variable(values(R, k))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert hvd.broadcast_variables([v], root, None, inplace) is None
        assert np.array_equal(v.numpy(), values(root, k)), (inplace, v.numpy())
        # tf_mpi always broadcasts into a temporary: the first inplace=True says so, once per process.
        said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert len(said) == (k == 1) and all("broadcast_variables(inplace=...)" in m for m in said), (k, said)
    v = tf.Variable(values(R, 5))
    hvd.broadcast_variables([v], root_rank=root, process_set=None, inplace=True, name="bv.named")
    assert np.array_equal(v.numpy(), values(root, 5))
    with tf1_session() as sess:
        g = tf.compat.v1.Variable(values(R, 7))
        sess.run(g.initializer)
        op = hvd.broadcast_variables([g], root, None, True)
        assert isinstance(op, tf.Operation), type(op)
        sess.run(op)
        assert np.array_equal(sess.run(g), values(root, 7))


# ---- gradients of Min / Max / Product allreduces --------------------------------

def check_min_max_product_allreduce_gradients_reduce_the_upstream_gradient_with_the_op():
    """Horovod (mpi_ops.py _allreduce_grad, _grouped_allreduce_grad): the gradient is the allreduce of
    the upstream gradient with the forward op and scale factors, whatever the op."""
    x0 = np.array([1.0, -2.0, 3.0]) * (R + 1)
    w = np.array([0.5, 1.5, -1.0]) * (R + 2)  # this rank's upstream gradient: d loss / d output
    mpi_op = {hvd.Min: MPI.MIN, hvd.Max: MPI.MAX, hvd.Product: MPI.PROD}
    for op, pre, post in ((hvd.Min, 1.0, 1.0), (hvd.Max, 2.0, 1.0), (hvd.Product, 2.0, 0.25)):
        want = mpi_reduce(w * pre, mpi_op[op]) * post  # Horovod: allreduce(grad, op, pre, post)

        def single(xs):
            return tf.reduce_sum(hvd.allreduce(xs[0], op=op, prescale_factor=pre, postscale_factor=post) * w)

        def grouped(xs):
            ys = hvd.grouped_allreduce(xs, op=op, prescale_factor=pre, postscale_factor=post)
            return tf.reduce_sum(ys[0] * w) + tf.reduce_sum(ys[1] * w)

        for mode in MODES:
            (g,) = gradients(mode, [x0], single)
            assert np.allclose(g, want), (op, mode, g, want)
            ga, gb = gradients(mode, [x0, x0 * 2], grouped)
            assert np.allclose(ga, want) and np.allclose(gb, want), (op, mode, ga, gb, want)
    # IndexedSlices are reduced by allgather, which only Sum and Average can use (as in Horovod).
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), dense_shape=tf.constant([3, 2]))
    for op in (hvd.Min, hvd.Max, hvd.Product):
        raises(lambda: hvd.allreduce(slices, op=op), NotImplementedError, "Average", "Sum")


# ---- signatures: Horovod's names, order and defaults ---------------------------

GLOBAL_SET = object()  # Horovod's default `global_process_set`; tf_mpi's default for it is None
NO_DEFAULT = inspect.Parameter.empty
# horovod/tensorflow/__init__.py, mpi_ops.py, functions.py and common/basics.py of Horovod 0.28.1,
# parameter by parameter: (name, default). Then the parameters tf_mpi adds after Horovod's.
HOROVOD_SIGNATURES = {
    "allreduce": [("tensor", NO_DEFAULT), ("average", None), ("device_dense", ""), ("device_sparse", ""),
                  ("compression", "none"), ("op", None), ("prescale_factor", 1.0), ("postscale_factor", 1.0),
                  ("name", None), ("process_set", GLOBAL_SET), ("ignore_name_scope", False)],
    "grouped_allreduce": [("tensors", NO_DEFAULT), ("average", None), ("device_dense", ""), ("device_sparse", ""),
                          ("compression", "none"), ("op", None), ("prescale_factor", 1.0),
                          ("postscale_factor", 1.0), ("process_set", GLOBAL_SET), ("ignore_name_scope", False),
                          ("name", None)],
    "reducescatter": [("tensor", NO_DEFAULT), ("device_dense", ""), ("compression", "none"), ("op", "Average"),
                      ("name", None), ("process_set", GLOBAL_SET), ("ignore_name_scope", False),
                      ("prescale_factor", 1.0), ("postscale_factor", 1.0)],
    "grouped_reducescatter": [("tensors", NO_DEFAULT), ("device_dense", ""), ("compression", "none"),
                              ("op", "Average"), ("process_set", GLOBAL_SET), ("prescale_factor", 1.0),
                              ("postscale_factor", 1.0)],
    "allgather": [("tensor", NO_DEFAULT), ("name", None), ("ignore_name_scope", False), ("process_set", GLOBAL_SET)],
    "grouped_allgather": [("tensors", NO_DEFAULT), ("name", None), ("ignore_name_scope", False),
                          ("process_set", GLOBAL_SET)],
    "broadcast": [("tensor", NO_DEFAULT), ("root_rank", NO_DEFAULT), ("name", None), ("ignore_name_scope", False),
                  ("process_set", GLOBAL_SET)],
    "broadcast_": [("variables", NO_DEFAULT), ("root_rank", NO_DEFAULT), ("name", None), ("process_set", GLOBAL_SET)],
    "alltoall": [("tensor", NO_DEFAULT), ("splits", None), ("name", None), ("ignore_name_scope", False),
                 ("process_set", GLOBAL_SET)],
    "join": [],
    "size_op": [("process_set_id", 0), ("name", None)],
    "process_set_included_op": [("process_set_id", 0), ("name", None)],
    "rank_op": [("name", None)], "local_rank_op": [("name", None)], "local_size_op": [("name", None)],
    "broadcast_variables": [("variables", NO_DEFAULT), ("root_rank", NO_DEFAULT), ("process_set", GLOBAL_SET),
                            ("inplace", False)],
    "broadcast_object": [("obj", NO_DEFAULT), ("root_rank", 0), ("session", None), ("name", None),
                         ("process_set", GLOBAL_SET)],
    "broadcast_object_fn": [("root_rank", 0), ("session", None), ("name", None), ("process_set", GLOBAL_SET)],
    "allgather_object": [("obj", NO_DEFAULT), ("session", None), ("name", None), ("process_set", GLOBAL_SET)],
    "broadcast_global_variables": [("root_rank", NO_DEFAULT)],
    "init": [("comm", None), ("process_sets", None)],
    "start_timeline": [("file_path", NO_DEFAULT), ("mark_cycles", False)],
    "stop_timeline": [],
    "handle_average_backwards_compatibility": [("op", NO_DEFAULT), ("average", NO_DEFAULT)],
    "check_num_rank_power_of_2": [("num_rank", NO_DEFAULT)],
}
TF_MPI_EXTRAS = {"grouped_reducescatter": [("name", None, inspect.Parameter.POSITIONAL_OR_KEYWORD)],
                 "broadcast_variables": [("name", None, inspect.Parameter.KEYWORD_ONLY)]}


def _expected_default(default):
    if default is GLOBAL_SET:
        return None
    if default == "none":
        return hvd.Compression.none
    if default == "Average":
        return hvd.Average
    return default


def check_signatures_are_horovods():
    for fn_name, horovod in HOROVOD_SIGNATURES.items():
        params = list(inspect.signature(getattr(hvd, fn_name)).parameters.values())
        want = [(n, _expected_default(d), inspect.Parameter.POSITIONAL_OR_KEYWORD) for n, d in horovod]
        want += TF_MPI_EXTRAS.get(fn_name, [])
        got = [(p.name, p.default, p.kind) for p in params]
        assert got == want, (fn_name, got, want)


def check_collectives_take_horovods_positional_order():
    x = np.array([1.0, -2.0, 4.0]) * (R + 1)
    t = tf.constant(x)
    # allreduce(tensor, average, device_dense, device_sparse, compression, op, prescale, postscale, name,
    #           process_set, ignore_name_scope)
    got = hvd.allreduce(t, None, "", "", hvd.Compression.none, hvd.Sum, 2.0, 0.5, "pos.ar", None, False)
    assert np.allclose(got, mpi_reduce(x * 2.0, MPI.SUM) * 0.5), got
    # grouped_allreduce(tensors, average, device_dense, device_sparse, compression, op, prescale, postscale,
    #                   process_set, ignore_name_scope, name)
    (got,) = hvd.grouped_allreduce([t], None, "", "", hvd.Compression.none, hvd.Max, 1.0, 3.0, None, True, "pos.gar")
    assert np.allclose(got, mpi_reduce(x, MPI.MAX) * 3.0), got
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        averaged = hvd.allreduce(t, True, "", "", hvd.Compression.none, None, 1.0, 1.0, "pos.avg")
        summed = hvd.grouped_allreduce([t], False, name="pos.gsum")[0]
    assert np.allclose(averaged, mpi_reduce(x, MPI.SUM) / N) and np.allclose(summed, mpi_reduce(x))
    assert sum(issubclass(w.category, DeprecationWarning) for w in caught) == 2, [str(w.message) for w in caught]
    # reducescatter(tensor, device_dense, compression, op, name, process_set, ignore_name_scope, prescale, postscale)
    rows = tf.constant(np.arange(2 * N, dtype=np.float64) * (R + 1))
    total = mpi_reduce(np.arange(2 * N) * (R + 1))
    got = hvd.reducescatter(rows, "", hvd.Compression.none, hvd.Sum, "pos.rs", None, False, 2.0, 1.0)
    assert np.allclose(got, (total * 2.0)[2 * R:2 * R + 2]), got
    # grouped_reducescatter(tensors, device_dense, compression, op, process_set, prescale, postscale)
    (got,) = hvd.grouped_reducescatter([rows], "", hvd.Compression.none, hvd.Average, None, 1.0, 3.0)
    assert np.allclose(got, (total / N * 3.0)[2 * R:2 * R + 2]), got
    # allgather / grouped_allgather(tensor(s), name, ignore_name_scope, process_set)
    want = np.concatenate(WORLD.allgather(x))
    assert np.allclose(hvd.allgather(t, "pos.ag", False, None), want)
    assert np.allclose(hvd.grouped_allgather([t], "pos.gag", True, None)[0], want)
    assert np.allclose(hvd.grouped_allgather([t], ignore_name_scope=True)[0], want)
    # broadcast(tensor, root_rank, name, ignore_name_scope, process_set)
    assert np.allclose(hvd.broadcast(t, N - 1, "pos.bc", False, None), x / (R + 1) * N)
    # alltoall(tensor, splits, name, ignore_name_scope, process_set)
    rows_out, counts = hvd.alltoall(tf.constant(np.full(N, float(R))), [1] * N, "pos.a2a", False, None)
    assert np.allclose(rows_out, np.arange(N)) and counts.numpy().tolist() == [1] * N
    # tf_mpi's earlier op-second forms (a ReduceOp there: no Horovod script passes one, see ops._resolve_op).
    assert np.allclose(hvd.allreduce(t, hvd.Min, name="old.ar"), mpi_reduce(x, MPI.MIN))
    assert np.allclose(hvd.grouped_allreduce([t], hvd.Max, name="old.gar")[0], mpi_reduce(x, MPI.MAX))
    assert np.allclose(hvd.reducescatter(rows, hvd.Sum, name="old.rs"), total[2 * R:2 * R + 2])
    assert np.allclose(hvd.grouped_reducescatter([rows], hvd.Sum, name="old.grs")[0], total[2 * R:2 * R + 2])
    raises(lambda: hvd.allreduce(t, hvd.Sum, op=hvd.Max), ValueError, "op")
    raises(lambda: hvd.reducescatter(rows, hvd.Sum, op=hvd.Max), ValueError, "op")
    raises(lambda: hvd.allreduce(t, op=True), ValueError, "average=")


# ---- process-set parameters: the global set by default, unknown sets refused --------

class HorovodGlobalSet:
    process_set_id = 0  # what Horovod's hvd.global_process_set carries


class OtherSet:
    process_set_id = 1   # no set was registered by this worker's init()


def check_process_set_parameters_take_the_global_set_and_refuse_unregistered_ones():
    """Horovod: process_set defaults to global_process_set (id 0); an id the core does not know is
    "Process set provided does not exist, or has not been registered." (checked before any
    communication, so every rank gets it)."""
    t = tf.constant([float(R)])
    calls = {
        "allreduce": lambda ps: hvd.allreduce(t, op=hvd.Sum, name="ps.ar", process_set=ps),
        "grouped_allreduce": lambda ps: hvd.grouped_allreduce([t], op=hvd.Sum, name="ps.gar", process_set=ps)[0],
        "allgather": lambda ps: hvd.allgather(t, name="ps.ag", process_set=ps),
        "grouped_allgather": lambda ps: hvd.grouped_allgather([t], name="ps.gag", process_set=ps)[0],
        "broadcast": lambda ps: hvd.broadcast(t, 0, name="ps.bc", process_set=ps),
        "grouped_broadcast": lambda ps: hvd.grouped_broadcast([t], 0, name="ps.gbc", process_set=ps)[0],
        "alltoall": lambda ps: hvd.alltoall(tf.fill([N], float(R)), name="ps.a2a", process_set=ps),
        "reducescatter": lambda ps: hvd.reducescatter(tf.fill([N], float(R)), op=hvd.Sum, name="ps.rs",
                                                      process_set=ps),
        "grouped_reducescatter": lambda ps: hvd.grouped_reducescatter([tf.fill([N], float(R))], op=hvd.Sum,
                                                                      process_set=ps, name="ps.grs")[0],
        "broadcast_variables": lambda ps: hvd.broadcast_variables([tf.Variable(t)], 0, ps),
        "broadcast_": lambda ps: hvd.broadcast_([tf.Variable(t)], 0, name="ps.b_", process_set=ps)[0],
        "broadcast_object": lambda ps: hvd.broadcast_object(R, 0, name="ps.bo", process_set=ps),
        "allgather_object": lambda ps: hvd.allgather_object(R, name="ps.go", process_set=ps),
        "broadcast_object_fn": lambda ps: hvd.broadcast_object_fn(0, name="ps.bof", process_set=ps)(lambda: R)(),
    }
    want = {"allreduce": [N * (N - 1) / 2], "grouped_allreduce": [N * (N - 1) / 2],
            "allgather": list(range(N)), "grouped_allgather": list(range(N)), "broadcast": [0.0],
            "grouped_broadcast": [0.0], "alltoall": list(range(N)), "reducescatter": [N * (N - 1) / 2],
            "grouped_reducescatter": [N * (N - 1) / 2], "broadcast_variables": None, "broadcast_": [0.0],
            "broadcast_object": 0, "allgather_object": list(range(N)), "broadcast_object_fn": 0}
    for name, call in calls.items():
        for ps in (None, HorovodGlobalSet()):
            got = call(ps)
            got = got if got is None or isinstance(got, (int, list)) else np.asarray(got).tolist()
            assert got == want[name], (name, got, want[name])
        raises(lambda: call(OtherSet()), ValueError, "does not exist or has not been registered")
    raises(lambda: hvd.init(process_sets=[OtherSet()]), ValueError, "ProcessSet")


def check_process_set_ops_answer_as_horovods_for_the_global_set_only():
    """Horovod (mpi_ops.cc, common/operations.cc): size_op(0) is the size, process_set_included_op(0)
    is 1; an id it does not know gives HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET (-3) when the op runs."""
    unknown = -3

    def values():
        return [hvd.size_op(), hvd.size_op(0), hvd.size_op(process_set_id=4), hvd.process_set_included_op(),
                hvd.process_set_included_op(process_set_id=2, name="included2")]

    want = [N, N, unknown, 1, unknown]
    for how, got in (("eager", values()), ("function", tf.function(values)())):
        assert all(v.dtype == tf.int32 and v.shape.rank == 0 for v in got), how
        assert [int(v) for v in got] == want, (how, [int(v) for v in got])
    with tf1_session() as sess:
        assert sess.run(values()) == want
        named = hvd.size_op("tf_mpi_earlier_name")  # tf_mpi's earlier size_op(name): a str is no set id
        assert named.op.name == "tf_mpi_earlier_name" and sess.run(named) == N


# ---- small helpers ------------------------------------------------------------------

def check_small_helpers_answer_as_horovods():
    # is_homogeneous: every node runs the same number of ranks (node = host name, by mpi4py).
    hosts = WORLD.allgather(socket.gethostname())
    per_node = {h: hosts.count(h) for h in hosts}
    assert hvd.is_homogeneous() is (len(set(per_node.values())) == 1)
    assert hvd.gloo_enabled() is False and hvd.gloo_built() is False
    assert type(hvd.nccl_built()) is int and hvd.nccl_built() == 0  # Horovod: 0, or NCCL's version code
    # common/util.py num_rank_is_power_2: num_rank != 0 and num_rank & (num_rank - 1) == 0
    assert [n for n in range(130) if hvd.check_num_rank_power_of_2(n)] == [1, 2, 4, 8, 16, 32, 64, 128]
    # common/util.py get_average_backwards_compatibility_fun
    handle = hvd.handle_average_backwards_compatibility
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert handle(None, None) == hvd.Average and handle(hvd.Max, None) == hvd.Max
        assert not caught
        assert handle(None, True) == hvd.Average and handle(None, False) == hvd.Sum
    assert [w.category for w in caught] == [DeprecationWarning] * 2
    raises(lambda: handle(hvd.Sum, True), ValueError, "supersedes")


def check_before_init_timeline_raises_value_error_and_join_fails_in_every_mode():
    """Horovod (common/basics.py): start_timeline / stop_timeline raise ValueError before init()
    (tf_mpi's error is a RuntimeError too, as it was); its join op fails with FailedPrecondition."""
    WORLD.Barrier()
    hvd.shutdown()
    try:
        for fn in (lambda: hvd.start_timeline("/tmp/never.json"), hvd.stop_timeline):
            raises(fn, ValueError, "init()")
            raises(fn, RuntimeError, "init()")
        raises(hvd.join, tf.errors.FailedPreconditionError, "init()")
        raises(tf.function(lambda: hvd.join()), tf.errors.FailedPreconditionError, "init()")
        raises(lambda: hvd.size_op(process_set_id=3), tf.errors.FailedPreconditionError, "init()")
        raises(hvd.process_set_included_op, tf.errors.FailedPreconditionError, "init()")
    finally:
        hvd.init()
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="api.reinit")) == N


if __name__ == "__main__":
    run_checks(globals(), R)
