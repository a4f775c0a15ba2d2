"""Process sets as Horovod 0.28.1 defines them (horovod/common/process_sets.py, basics.py,
horovod/tensorflow/mpi_ops.py), run on every rank by tests/test_horovod_api_compat.py at np=2 and 4.

Static sets (init(process_sets=[...])): even and odd ranks, a set of one rank, overlapping sets,
a set equal to the global one; every collective on them against values computed here from every
rank's inputs (mpi4py allgather, never tf_mpi); root ranks are global ranks; ranks outside a set
get InvalidArgumentError ("not a member"); gradients stay in the set; the tape and the Keras
DistributedOptimizer average within the set; disjoint sets do not wait on each other. Dynamic sets
(a second init with process_sets="dynamic"): add / remove while another set is busy, and the
registration errors.
"""
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402
from _expect import raises  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi as hvd  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
from mpi4py import MPI  # noqa: E402

N = MPI.COMM_WORLD.Get_size()
R = MPI.COMM_WORLD.Get_rank()
WORLD = MPI.COMM_WORLD

EVEN = hvd.ProcessSet(range(0, N, 2))
ODD = hvd.ProcessSet(range(1, N, 2))
LAST = hvd.ProcessSet([N - 1]) if N > 2 else None   # a set of one rank (at np=2 EVEN and ODD are)
FIRST_TWO = hvd.ProcessSet([0, 1]) if N > 2 else None        # overlaps EVEN and ODD at np=4
LAST_ALL_BUT_ONE = hvd.ProcessSet(range(1, N)) if N > 2 else None
TAIL = hvd.ProcessSet([N - 2, N - 1]) if N > 3 else None    # disjoint from FIRST_TWO at np=4
STATIC = [s for s in (EVEN, ODD, LAST, FIRST_TWO, LAST_ALL_BUT_ONE, TAIL) if s is not None]
# Horovod 0.28.1 (basics.init, process_sets._init_process_sets): an entry with the ranks of an earlier
# entry, or of the global set, is invalidated and init() raises ValueError naming it; tf_mpi is
# initialized all the same, with the other sets registered.
ALL = hvd.ProcessSet(range(N))
DUPLICATE = hvd.ProcessSet(ODD.ranks)
try:
    hvd.init(process_sets=STATIC + [ALL, DUPLICATE])
    INIT_ERROR = None
except ValueError as e:
    INIT_ERROR = str(e)
STATIC.append(hvd.global_process_set)


def mine_of(*sets):
    return [s for s in sets if s is not None and R in s.ranks]


def values(seed, shape=(3,), dtype=np.float32, rank=None):
    """Rank `rank`'s input for `seed` (this rank's by default). Every rank can compute every other
    rank's inputs, so expected results need no communication (a collective of all ranks inside a
    loop over a rank's own sets would pair up differently on each rank)."""
    rank = R if rank is None else rank
    return (np.random.default_rng(seed * 10 + rank).integers(-5, 6, size=shape)).astype(dtype)


def inputs_of(seed, ranks, shape=(3,), dtype=np.float32):
    """The inputs of `ranks` for `seed`, in their order."""
    return [values(seed, shape, dtype, r) for r in ranks]


def check_registration_gives_ids_ranks_sizes_and_membership():
    ids = [s.process_set_id for s in STATIC[:-1]]
    assert ids == list(range(1, len(ids) + 1)), ids           # registration order
    assert INIT_ERROR is not None and f"process_sets entry number {len(STATIC) - 1} is a duplicate" in INIT_ERROR, \
        INIT_ERROR                                            # ALL, the first duplicate entry
    assert ALL.process_set_id is None and DUPLICATE.process_set_id is None
    assert hvd.is_initialized()
    assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.ranks == list(range(N))
    for s in STATIC:
        assert s.included() == (R in s.ranks)
        assert s.size() == len(s.ranks)
        if R in s.ranks:
            assert s.rank() == s.ranks.index(R)
        else:
            raises(s.rank, ValueError, "not part of")
        assert int(hvd.size_op(process_set_id=s.process_set_id).numpy()) == len(s.ranks)
        assert int(hvd.process_set_included_op(s.process_set_id).numpy()) == int(R in s.ranks)
    assert int(hvd.process_set_included_op(99).numpy()) == -3 and int(hvd.size_op(99).numpy()) == -3


def check_a_second_init_registers_nothing_and_maps_objects():
    """Horovod 0.28.1 (operations.cc InitializeHorovodOnce, process_sets._init_process_sets): init()
    registers its sets once per start; a later init() only gives the listed objects the ids of the
    registered sets with their ranks (KeyError for ranks never registered), duplicates as at first."""
    table = {0: list(range(N)), **{s.process_set_id: s.ranks for s in STATIC[:-1]}}
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == table
    again = hvd.ProcessSet(list(reversed(EVEN.ranks)))
    hvd.init(process_sets=[again])
    assert again.process_set_id == EVEN.process_set_id
    twice = [hvd.ProcessSet(ODD.ranks), hvd.ProcessSet(ODD.ranks)]
    raises(lambda: hvd.init(process_sets=twice), ValueError, "entry number 1 is a duplicate")
    assert twice[0].process_set_id == ODD.process_set_id and twice[1].process_set_id is None
    if N > 2:   # [0, N-1] is none of the registered sets at np=4
        raises(lambda: hvd.init(process_sets=[hvd.ProcessSet([0, N - 1])]), KeyError)
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == table
    s = mine_of(EVEN, ODD)[0]
    got = hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum, name=f"ps.again.{s.process_set_id}", process_set=s)
    assert got.numpy()[0] == sum(s.ranks)


def check_allreduce_ops_and_grouped_within_each_set():
    for s in mine_of(*STATIC):
        k = 100 * s.process_set_id   # the same seeds on every rank of the set
        a, b = values(k), values(k + 50, (2, 2), np.int32)
        xs, ys = inputs_of(k, s.ranks), inputs_of(k + 50, s.ranks, (2, 2), np.int32)
        for op, ref in ((hvd.Sum, np.sum), (hvd.Min, np.min), (hvd.Max, np.max), (hvd.Average, np.mean)):
            got = hvd.allreduce(tf.constant(a), op=op, name=f"ps.ar.{s.process_set_id}.{int(op)}", process_set=s)
            assert np.allclose(got.numpy(), ref(xs, axis=0)), (s, op, got.numpy())
        g1, g2 = hvd.grouped_allreduce([tf.constant(a), tf.constant(b)], op=hvd.Sum,
                                       name=f"ps.gar.{s.process_set_id}", process_set=s)
        assert np.allclose(g1.numpy(), np.sum(xs, 0)) and np.array_equal(g2.numpy(), np.sum(ys, 0))


def check_allgather_broadcast_alltoall_reducescatter_within_each_set():
    for s in mine_of(*STATIC):
        k = 100 * s.process_set_id
        n, me = len(s.ranks), s.ranks.index(R)
        rows = np.full((R + 1, 2), R, np.float32)                      # uneven first dimension
        got = hvd.allgather(tf.constant(rows), name=f"ps.ag.{s.process_set_id}", process_set=s).numpy()
        assert np.array_equal(got, np.concatenate([np.full((r + 1, 2), r, np.float32) for r in s.ranks])), (s, got)
        a, b = hvd.grouped_allgather([tf.constant(rows), tf.constant([R])], name=f"ps.gag.{s.process_set_id}",
                                     process_set=s)
        assert np.array_equal(b.numpy(), np.array(s.ranks))
        root = s.ranks[-1]                                             # a global rank
        x = values(k + 10)
        got = hvd.broadcast(tf.constant(x), root_rank=root, name=f"ps.bc.{s.process_set_id}", process_set=s)
        assert np.array_equal(got.numpy(), values(k + 10, rank=root))
        if n < N:   # a root outside the set
            outside = [r for r in range(N) if r not in s.ranks][0]
            raises(lambda: hvd.broadcast(tf.constant(x), root_rank=outside, process_set=s), ValueError, "root_rank")
        splits = [j + 1 for j in range(n)]                             # j+1 rows to the set's j-th rank
        send = np.concatenate([np.full((j + 1,), 100 * R + j, np.int32) for j in range(n)])
        out, received = hvd.alltoall(tf.constant(send), splits=splits, name=f"ps.a2a.{s.process_set_id}",
                                     process_set=s)
        want = np.concatenate([np.full((me + 1,), 100 * r + me, np.int32) for r in s.ranks])
        assert np.array_equal(out.numpy(), want) and list(received.numpy()) == [me + 1] * n
        t = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3) * (R + 1)
        part = hvd.reducescatter(tf.constant(t), op=hvd.Sum, name=f"ps.rs.{s.process_set_id}", process_set=s)
        total = np.sum([np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3) * (r + 1) for r in s.ranks], 0)
        assert np.allclose(part.numpy(), total[2 * me:2 * me + 2]), (s, part.numpy())
        assert hvd.allgather_object(("r", R), name=f"ps.ago.{s.process_set_id}", process_set=s) == \
            [("r", r) for r in s.ranks]
        assert hvd.broadcast_object({"from": R}, root_rank=root, name=f"ps.bo.{s.process_set_id}",
                                    process_set=s) == {"from": root}
        hvd.barrier(name=f"ps.barrier.{s.process_set_id}", process_set=s)
        v = tf.Variable(values(k + 20))
        hvd.broadcast_variables([v], root_rank=root, process_set=s)
        assert np.array_equal(v.numpy(), values(k + 20, rank=root))


def check_ranks_outside_a_set_get_horovods_error():
    for s in STATIC:
        if R in s.ranks:
            continue
        for fn in (lambda: hvd.allreduce(tf.ones([2]), process_set=s),
                   lambda: hvd.allgather(tf.ones([2]), process_set=s),
                   lambda: hvd.alltoall(tf.ones([2 * len(s.ranks)]), process_set=s)):
            raises(fn, tf.errors.InvalidArgumentError, "is not a member of the provided process set")
        raises(lambda: hvd.allgather_object(1, process_set=s), ValueError, "not part of")
    unregistered = hvd.ProcessSet([0])
    raises(lambda: hvd.allreduce(tf.ones([1]), process_set=unregistered), ValueError, "not registered")
    raises(lambda: hvd.add_process_set([0]), ValueError, "HOROVOD_DYNAMIC_PROCESS_SETS")


def check_adasum_takes_the_global_set_only():
    """Horovod 0.28.1 (tensorflow/__init__.py allreduce): Adasum with another set is NotImplementedError
    (raised here before any communication)."""
    for s in mine_of(EVEN, ODD):
        raises(lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum, process_set=s), NotImplementedError,
               "non-global process sets")


def check_gradients_stay_in_the_set():
    for s in mine_of(EVEN, ODD):
        k = 100 * s.process_set_id
        x, up = values(k + 30), values(k + 31)

        @tf.function
        def grads(v, op):
            with tf.GradientTape() as tape:
                tape.watch(v)
                y = hvd.allreduce(v, op=op, process_set=s)
            return tape.gradient(y, v, output_gradients=tf.constant(up))
        for op, ref in ((hvd.Sum, np.sum), (hvd.Average, np.mean)):
            assert np.allclose(grads(tf.constant(x), op).numpy(), ref(inputs_of(k + 31, s.ranks), 0))

        with tf.GradientTape() as tape:
            v = tf.constant(np.full((2,), float(R + 1), np.float32))
            tape.watch(v)
            g = hvd.allgather(v, process_set=s)
        dv = tape.gradient(g, v, output_gradients=tf.ones([2 * len(s.ranks)]))
        assert np.allclose(dv.numpy(), 1.0), dv.numpy()          # Average of ones, this rank's rows


def check_tape_and_keras_optimizer_average_within_the_set():
    for s in mine_of(EVEN, ODD):
        k = 100 * s.process_set_id
        c = values(k + 40)
        w = tf.Variable(np.ones(3, np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * c)
        g = hvd.DistributedGradientTape(tape, process_set=s).gradient(loss, [w])[0]
        assert np.allclose(g.numpy(), np.mean(inputs_of(k + 40, s.ranks), 0))
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), name=f"ps.opt.{s.process_set_id}", process_set=s)
        v = keras.Variable(np.zeros(3, np.float32))
        opt.apply_gradients([(tf.constant(c), v)])
        assert np.allclose(v.numpy(), -np.mean(inputs_of(k + 40, s.ranks), 0))


def check_disjoint_sets_do_not_wait_on_each_other():
    if N < 4:
        WORLD.Barrier()
        return
    # Ranks 2 and 3 start 3 s late; FIRST_TWO ({0, 1}) must not wait for them: its collectives
    # finish before ranks 2 and 3 begin theirs on TAIL ({2, 3}).
    WORLD.Barrier()
    if R in (0, 1):
        for i in range(20):
            hvd.allreduce(tf.ones([16]), name=f"ps.busy.{i}", process_set=FIRST_TWO)
        finished = time.time()
    else:
        time.sleep(3.0)
        finished = time.time()
        for i in range(20):
            hvd.allreduce(tf.ones([16]), name=f"ps.late.{i}", process_set=TAIL)
    # Through the engine, whose wait for the late ranks sleeps (mpi4py's allgather would poll for 3 s).
    times = hvd.allgather_object(finished)
    assert max(times[0], times[1]) < min(times[2], times[3]), times


def check_sets_from_communicators_are_registered_first():
    """Horovod 0.28.1 (operations.cc horovod_init_multi_comm, basics._comm_process_set_id): the sets
    the communicator entries form (each one's distinct sets over all ranks, sorted) get ids before
    the entries given as ranks; a communicator finds its set's id, a duplicate of the global
    communicator 0; init(comm=...) makes it global_process_set.mpi_comm."""
    hvd.shutdown()
    sub = WORLD.Split(color=R % 2, key=R)
    listed = [hvd.ProcessSet([0, N - 1])] if N > 2 else []
    from_comm = hvd.ProcessSet(sub)
    hvd.init(comm=WORLD, process_sets=listed + [from_comm])
    table = {0: list(range(N)), 1: list(range(0, N, 2)), 2: list(range(1, N, 2))}
    if N > 2:
        table[3] = [0, N - 1]
        assert listed[0].process_set_id == 3
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == table
    mine = 1 + R % 2
    assert from_comm.process_set_id == mine and from_comm.ranks == table[mine]
    assert hvd.mpi_ops._basics._comm_process_set_id(sub) == mine
    dup = WORLD.Dup()
    assert hvd.mpi_ops._basics._comm_process_set_id(dup) == 0
    assert hvd.global_process_set.mpi_comm is WORLD
    got = hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum, name="ps.comm", process_set=from_comm)
    assert got.numpy()[0] == sum(table[mine])
    dup.Free()
    sub.Free()


def check_dynamic_sets_added_and_removed_while_another_set_is_busy():
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    raises(lambda: hvd.add_process_set(range(N)), ValueError, "duplicate")   # the global set's ranks
    pair = hvd.add_process_set(hvd.ProcessSet([0, N - 1] if N > 2 else [1]))
    assert pair.process_set_id == 1 and pair.size() == len(pair.ranks)
    raises(lambda: hvd.add_process_set(list(pair.ranks)), ValueError, "duplicate")
    raises(lambda: hvd.add_process_set([0, N]), ValueError, "ranks")
    errors, first_done = [], threading.Event()
    BUSY = 60   # the same count on every member: each allreduce needs all of them

    def busy():   # collectives on `pair` keep running while every rank adds and removes sets
        try:
            for i in range(BUSY):
                got = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name=f"ps.dyn.busy.{i}", process_set=pair)
                assert got.numpy()[0] == len(pair.ranks)
                first_done.set()
        except Exception as e:   # reported below
            errors.append(e)
            first_done.set()
    thread = None
    if R in pair.ranks:
        thread = threading.Thread(target=busy)
        thread.start()
        assert first_done.wait(60)   # the set is busy before the others are added
    for round_ in range(3):
        single = hvd.add_process_set([0])
        assert single.process_set_id == 2   # Horovod reuses a removed set's id
        if R == 0:
            assert hvd.allreduce(tf.constant([5.0]), op=hvd.Sum, process_set=single).numpy()[0] == 5.0
        assert hvd.remove_process_set(single) and single.process_set_id is None
        assert not hvd.remove_process_set(single)
    assert not hvd.remove_process_set(hvd.global_process_set)
    if thread:
        thread.join(60)
        assert not thread.is_alive() and not errors, errors
    assert hvd.remove_process_set(pair)
    assert hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="ps.dyn.global").numpy()[0] == N


if __name__ == "__main__":
    run_checks(globals(), R)
