"""Hierarchical allreduce checks, run on every rank by tests/test_hierarchical.py.

One launch covers several pretend topologies (TF_MPI_TOPOLOGY, listed in
TF_MPI_TEST_TOPOLOGIES): the worker shuts the engine down and initialises it
again with other settings, so the hierarchical path (TF_MPI_HIERARCHICAL=1)
and the flat path (=0) run the same collectives in the same launch and their
results are compared. With TF_MPI_TEST_TF=1 the TensorFlow ops and a Keras
training step run too; without it only the array API runs (no TensorFlow
import, so np=6 stays quick on a small machine).
"""
import hashlib
import os
import sys

import ml_dtypes
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

TOPOLOGIES = os.environ["TF_MPI_TEST_TOPOLOGIES"].split(",")
SETTINGS = ("TF_MPI_TOPOLOGY", "TF_MPI_HIERARCHICAL", "TF_MPI_HIERARCHICAL_THRESHOLD", "TF_MPI_INTER_NODE_LINK",
            "TF_MPI_SHM")
SUM, AVERAGE, MIN, MAX, PRODUCT = (int(basics.Sum), int(basics.Average), int(basics.Min), int(basics.Max),
                                   int(basics.Product))
OPS = {SUM: "Sum", AVERAGE: "Average", MIN: "Min", MAX: "Max", PRODUCT: "Product"}
DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16, ml_dtypes.bfloat16, np.float32,
          np.float64]  # allreduce takes no bool
FLOATS = (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)
# Element counts: fewer than the ranks of a node (empty shards), and counts
# that 2 and 3 do not divide (uneven shards).
COUNTS = (1, 5, 1001)
# Hierarchical and flat add in different orders: a few roundings of sums of ~6 normal numbers apart.
ATOL = {np.float16: 0.05, ml_dtypes.bfloat16: 0.3, np.float32: 1e-5, np.float64: 1e-12}

basics.init()
WORLD_RANK, N = _core.rank(), _core.size()
_calls = [0]


def reinit(**settings):
    """Shuts the engine down (if up) and initialises it with these TF_MPI_* settings (None: unset)."""
    if _core.is_initialized():
        _core.shutdown()
    set_environ({**{name: None for name in SETTINGS}, **settings})
    basics.init()


def name(prefix):
    _calls[0] += 1
    return f"{prefix}.{_calls[0]}"


def values(rank, count, dtype, seed=0):
    """1s and 2s (exact in every dtype; products of 6 ranks fit int8)."""
    v = ((np.arange(count) + rank + seed) % 2) + 1
    return v.astype(dtype)


def random_values(rank, count, dtype, seed=0):
    """Floats whose sum depends on the order of the additions."""
    return np.random.default_rng(1000 * seed + rank).standard_normal(count).astype(dtype)


def run_cases():
    """Every dtype x op, one array at a time and several in one request (fused),
    with scaling and with order-dependent floats. Returns [(case, result array)]."""
    out = []
    for dtype in DTYPES:
        for op in OPS:
            tag = f"{np.dtype(dtype).name}.{OPS[op]}"
            for count in COUNTS:
                out.append((f"{tag}.n{count}", _core.allreduce(values(WORLD_RANK, count, dtype), op, name(tag))))
            group = [values(WORLD_RANK, c, dtype, seed=i) for i, c in enumerate(COUNTS)]
            for i, y in enumerate(_core.grouped_allreduce(group, op, name(tag + ".grouped"))):
                out.append((f"{tag}.grouped{i}", y))
    for dtype in FLOATS:
        tag = f"{np.dtype(dtype).name}.random"
        for op in (SUM, AVERAGE):
            x = random_values(WORLD_RANK, 3001, dtype, seed=op)
            out.append((f"{tag}.{OPS[op]}", _core.allreduce(x, op, name(tag))))
        out.append((f"{tag}.scaled", _core.allreduce(random_values(WORLD_RANK, 777, dtype), AVERAGE, name(tag),
                                                     prescale_factor=0.5, postscale_factor=3.0)))
    for dtype in (np.int32, np.int64):
        x = values(WORLD_RANK, 999, dtype)
        out.append((f"{np.dtype(dtype).name}.scaled",
                    _core.allreduce(x, SUM, name("int.scaled"), prescale_factor=3.0, postscale_factor=2.0)))
    # Larger than one 1 MiB MPI call: the node reduce-scatter is cut into slices.
    big = random_values(WORLD_RANK, 400_000, np.float32, seed=7)
    out.append(("float32.big", _core.allreduce(big, SUM, name("big"))))
    out.append(("int32.big", _core.allreduce(values(WORLD_RANK, 400_003, np.int32), SUM, name("bigint"))))
    return out


def expected(dtype, op, count):
    """What every rank must get, from numpy."""
    stack = np.stack([values(r, count, dtype).astype(np.float64) for r in range(N)])
    average = stack.sum(0) / N
    if np.dtype(dtype).kind in "iu":
        average = np.trunc(average)  # integer averages truncate toward zero
    return {SUM: stack.sum(0), AVERAGE: average, MIN: stack.min(0), MAX: stack.max(0), PRODUCT: stack.prod(0)}[op]


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return np.frombuffer(h.digest(), np.uint8).copy()


def assert_same_on_every_rank(arrays, what):
    d = _core.allgather(digest(arrays)[None, :], name("digest"))
    assert all(np.array_equal(d[0], row) for row in d), f"{what}: results differ between ranks"


def stats_delta(fn):
    before = _core.stats()
    result = fn()
    after = _core.stats()
    return result, {k: after[k] - before[k] for k in ("hierarchical_allreduces", "hierarchical_bytes",
                                                         "allreduce_buckets")}


def parse(topology):
    nodes, per_node = (int(x) for x in topology.split("x"))
    return nodes, per_node


def check_topology_queries_follow_the_pretend_topology():
    for topology in TOPOLOGIES:
        nodes, per_node = parse(topology)
        reinit(TF_MPI_TOPOLOGY=topology)
        got = (_core.local_rank(), _core.local_size(), _core.cross_rank(), _core.cross_size())
        want = (WORLD_RANK % per_node, per_node, WORLD_RANK // per_node, nodes)
        assert got == want, f"{topology}: (local_rank, local_size, cross_rank, cross_size) {got}, want {want}"
        if WITH_TF:
            assert (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == want
            assert int(hvd.local_rank_op()) == want[0] and int(hvd.local_size_op()) == want[1]
        assert _core.hierarchical()["homogeneous"]
    reinit()  # the real topology: every rank of this launch is on one machine
    got = (_core.local_rank(), _core.local_size(), _core.cross_rank(), _core.cross_size())
    assert got == (WORLD_RANK, N, 0, 1), f"real topology: {got}"


def check_hierarchical_matches_flat_for_every_dtype_and_op():
    for topology in TOPOLOGIES:
        reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_HIERARCHICAL=1, TF_MPI_SHM=0)
        info = _core.hierarchical()
        assert info["usable"] and info["min_bytes"] == 0 and info["max_bytes"] is None, info
        hier, d = stats_delta(run_cases)
        # Every allreduce bucket went the hierarchical way.
        assert d["hierarchical_allreduces"] == d["allreduce_buckets"] > len(hier) // 4, (topology, d)
        assert_same_on_every_rank([y for _, y in hier], f"{topology} hierarchical")

        reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_HIERARCHICAL=0)
        flat, d = stats_delta(run_cases)
        assert d["hierarchical_allreduces"] == 0 and d["allreduce_buckets"] > 0, (topology, d)
        assert [c for c, _ in hier] == [c for c, _ in flat]
        for (case, h), (_, f) in zip(hier, flat):
            assert h.dtype == f.dtype and h.shape == f.shape, case
            what = f"{topology} {case}: hierarchical {h.ravel()[:6]} flat {f.ravel()[:6]}"
            if "random" in case or "float32.big" == case:
                assert np.allclose(h.astype(np.float64), f.astype(np.float64), rtol=0, atol=ATOL[h.dtype.type]), what
            else:  # integers of every op, and floats whose every partial sum is exact: the same bits
                assert h.tobytes() == f.tobytes(), what


def check_hierarchical_results_are_right():
    """Against numpy, not only against the flat path."""
    topology = TOPOLOGIES[0]
    reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_HIERARCHICAL=1)
    for dtype in DTYPES:
        for op in OPS:
            for count in COUNTS:
                y = _core.allreduce(values(WORLD_RANK, count, dtype), op, name("right"))
                want = expected(dtype, op, count)
                assert np.array_equal(y.astype(np.float64), want), \
                    f"{topology} {np.dtype(dtype).name} {OPS[op]} n={count}: {y[:6]} want {want[:6]}"


def check_auto_uses_the_cost_model_window():
    for topology in TOPOLOGIES:
        nodes, per_node = parse(topology)
        reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_HIERARCHICAL="auto")
        info = _core.hierarchical()
        model = _core.hierarchical_model(1.0, nodes, per_node, flat="single-level")  # pretend nodes: one host
        assert info["usable"] and (info["min_bytes"], info["max_bytes"]) == (model["auto_min_bytes"],
                                                                             model["auto_max_bytes"]), (info, model)
        lo, hi = info["min_bytes"], info["max_bytes"]
        assert 0 < lo < hi, f"{topology}: the default links give a window with both ends: {info}"
        # One float32 buffer below, inside and above the window.
        for count, inside in ((lo // 8, False), (lo // 4, True), (hi // 4, False)):
            x = np.ones(count, np.float32)
            y, d = stats_delta(lambda: _core.allreduce(x, SUM, name("auto")))
            assert d["hierarchical_allreduces"] == (1 if inside else 0), (topology, count * 4, info, d)
            assert np.array_equal(y, np.full(count, N, np.float32)), topology


def check_threshold_and_link_settings_move_the_window():
    topology = TOPOLOGIES[0]
    nodes, per_node = parse(topology)
    reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_HIERARCHICAL_THRESHOLD=4096)
    info = _core.hierarchical()
    assert (info["min_bytes"], info["max_bytes"]) == (4096, None), info
    for count, inside in ((1023, False), (1024, True), (1 << 18, True)):
        _, d = stats_delta(lambda: _core.allreduce(np.ones(count, np.float32), SUM, name("thr")))
        assert d["hierarchical_allreduces"] == (1 if inside else 0), (count, d)
    # A slow network (1 Gb/s, 50 us): hierarchical pays for every size from small messages up.
    reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_INTER_NODE_LINK="50,0.125")
    info = _core.hierarchical()
    assert info["max_bytes"] is None and "TF_MPI_INTER_NODE_LINK" in info["summary"], info


def check_forced_on_without_several_nodes_is_a_logged_no_op():
    for topology in (f"1x{N}", f"{N}x1"):
        reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_HIERARCHICAL=1)
        info = _core.hierarchical()
        assert not info["usable"] and "not used" in info["summary"], info
        y, d = stats_delta(lambda: _core.allreduce(np.ones(5000, np.float32), SUM, name("noop")))
        assert d["hierarchical_allreduces"] == 0 and np.array_equal(y, np.full(5000, N, np.float32)), d


def check_timeline_shows_the_three_phases():
    assert_phases_nested(node_transport="MPI")


def check_node_stage_over_shared_memory_matches_the_mpi_node_stage():
    """TF_MPI_SHM=1: the node stage reduces through the node's shared-memory window (pretend nodes
    share one machine's memory), with the same results as the MPI node stage."""
    for topology in TOPOLOGIES:
        reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_HIERARCHICAL=1, TF_MPI_SHM=1)
        shm, d = stats_delta(run_cases)
        assert d["hierarchical_allreduces"] == d["allreduce_buckets"] > len(shm) // 4, (topology, d)
        assert_same_on_every_rank([y for _, y in shm], f"{topology} shared-memory node stage")
        reinit(TF_MPI_TOPOLOGY=topology, TF_MPI_HIERARCHICAL=1, TF_MPI_SHM=0)
        mpi, _ = stats_delta(run_cases)
        for (case, a), (_, b) in zip(shm, mpi):
            what = f"{topology} {case}: shared memory {a.ravel()[:6]} MPI {b.ravel()[:6]}"
            if "random" in case or "float32.big" == case:  # the node's additions may run in another order
                assert np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=0, atol=ATOL[a.dtype.type]), what
            else:
                assert a.tobytes() == b.tobytes(), what
    assert_phases_nested(node_transport="SHM")


def assert_phases_nested(node_transport):
    """The timeline shows the node stage (over `node_transport`), the cross-node allreduce and the node
    allgather inside the buffer's MPI_ALLREDUCE."""
    reinit(TF_MPI_TOPOLOGY=TOPOLOGIES[0], TF_MPI_HIERARCHICAL=1, TF_MPI_SHM=1 if node_transport == "SHM" else 0)
    path = os.path.join(os.environ["TF_MPI_TEST_OUT"], f"hierarchical_trace_{node_transport}.json")
    _core.start_timeline(path)  # rank 0 writes it
    _core.allreduce(np.ones(1000, np.float32), SUM, f"traced.hierarchical.{node_transport}")
    _core.stop_timeline()
    _core.allreduce(np.ones(1, np.float32), SUM, name("after.trace"))  # rank 0 has written the file
    if WORLD_RANK != 0:
        return
    import json
    with open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and tracks.get(e["tid"]) == f"traced.hierarchical.{node_transport}"]
    names = [n for n, _, _ in spans]
    phases = [f"{node_transport}_NODE_REDUCESCATTER", "MPI_CROSS_ALLREDUCE", f"{node_transport}_NODE_ALLGATHER"]
    assert [n for n in names if n in phases] == phases, names
    outer = [(s, e) for n, s, e in spans if n == "MPI_ALLREDUCE"]
    assert len(outer) == 1, names
    slack = 0.002  # microseconds: ts and dur are printed with 3 decimals
    assert all(outer[0][0] - slack <= s and e <= outer[0][1] + slack for n, s, e in spans if n in phases), spans


def expect_init_error(settings, *fragments):
    try:
        reinit(**settings)
    except ValueError as e:
        msg = str(e)
        for fragment in fragments:
            assert fragment in msg, f"{settings}: {msg!r} lacks {fragment!r}"
        assert not _core.is_initialized()
        return msg
    raise AssertionError(f"init() with {settings} did not raise")


def check_invalid_settings_fail_init_on_every_rank():
    bad = f"{N + 1}x1"
    expect_init_error({"TF_MPI_TOPOLOGY": bad}, f"TF_MPI_TOPOLOGY={bad} describes {N + 1} ranks",
                      f"this job has {N} ranks")
    expect_init_error({"TF_MPI_TOPOLOGY": "2by2"}, "is not NODESxRANKS")
    expect_init_error({"TF_MPI_TOPOLOGY": "0x4"}, "is not NODESxRANKS")
    # Valid on each rank, but not the same everywhere.
    mine = TOPOLOGIES[0] if WORLD_RANK == 0 else f"{N}x1"
    expect_init_error({"TF_MPI_TOPOLOGY": mine}, "differs between ranks", f"this rank has '{mine}'")
    expect_init_error({"TF_MPI_HIERARCHICAL": "yes"}, "TF_MPI_HIERARCHICAL=yes is not auto, 0 or 1")
    expect_init_error({"TF_MPI_INTER_NODE_LINK": "fast"}, "TF_MPI_INTER_NODE_LINK=fast is not ALPHA_US,GB_PER_S")
    # The ranks disagree on where hierarchical is used.
    expect_init_error({"TF_MPI_TOPOLOGY": TOPOLOGIES[0], "TF_MPI_HIERARCHICAL": 1 if WORLD_RANK == 0 else 0},
                      "the ranks disagree on the hierarchical allreduce")
    # And the engine starts normally afterwards.
    reinit(TF_MPI_TOPOLOGY=TOPOLOGIES[0])
    assert np.array_equal(_core.allreduce(np.ones(3, np.int32), SUM, name("after")), np.full(3, N, np.int32))


# ---- TensorFlow ops and Keras (TF_MPI_TEST_TF=1) --------------------------------------------


def tf_cases():
    out = []
    for dtype in (tf.int32, tf.float16, tf.bfloat16, tf.float32, tf.float64):
        xs = [tf.constant(values(WORLD_RANK, c, np.float64, seed=i), dtype=dtype) for i, c in enumerate(COUNTS)]
        for op in (hvd.Sum, hvd.Average, hvd.Max):
            out += [hvd.allreduce(x, op=op, name=name("tf")).numpy() for x in xs]
            out += [y.numpy() for y in hvd.grouped_allreduce(xs, op=op, name=name("tfg"))]
    return out


def check_tf_ops_match_flat():
    if not WITH_TF:
        raise SkipCheck("TensorFlow ops run in the TF_MPI_TEST_TF=1 launch")
    reinit(TF_MPI_TOPOLOGY=TOPOLOGIES[0], TF_MPI_HIERARCHICAL=1)
    hier, d = stats_delta(tf_cases)
    assert d["hierarchical_allreduces"] == d["allreduce_buckets"] > 0, d
    reinit(TF_MPI_TOPOLOGY=TOPOLOGIES[0], TF_MPI_HIERARCHICAL=0)
    flat = tf_cases()
    for h, f in zip(hier, flat):
        assert h.tobytes() == f.tobytes(), (h, f)  # exact values: the same bits


def check_keras_training_through_the_hierarchical_path():
    if not WITH_TF:
        raise SkipCheck("Keras runs in the TF_MPI_TEST_TF=1 launch")
    reinit(TF_MPI_TOPOLOGY=TOPOLOGIES[0], TF_MPI_HIERARCHICAL=1)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((13,))
    hidden = keras.layers.Dense(37, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    initial = model.get_weights()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse",
                  jit_compile=False)
    rng = np.random.default_rng(WORLD_RANK)  # different data on every rank
    x, y = rng.standard_normal((32, 13)).astype(np.float32), rng.standard_normal((32, 3)).astype(np.float32)
    _, d = stats_delta(lambda: model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0))
    assert d["hierarchical_allreduces"] >= 4, d  # the gradients of each of the 4 steps
    weights = model.get_weights()
    assert not any(np.allclose(a, b) for a, b in zip(weights, initial)), "training did not change the weights"
    assert_same_on_every_rank(weights, "keras weights")


run_checks(globals(), WORLD_RANK)
