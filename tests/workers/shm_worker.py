"""Shared-memory allreduce checks, run on every rank by tests/test_shm.py.

Launched with TF_MPI_SHM=1 and a small TF_MPI_SHM_CHUNK_BYTES (so small
arrays already take many pipeline steps), TF_MPI_SHM_MIN_BYTES (the
switch-over size) and TF_MPI_FUSION_DIRECT_BYTES=1024 (arrays of 1 KiB and
more skip the fusion buffer, smaller ones are fused). Every shared-memory
result is compared with the same collective over MPI in the same process
(_core.set_shm_paused between synchronous calls: a collective runs only once
every rank has submitted it, so every rank has switched by then) and with
numpy; the engine's counters prove which path ran.

SHM_SCENARIO=die: rank 1 exits (os._exit) from another thread while the
ranks stream shared-memory allreduces; the launch must end, not hang.
"""
import hashlib
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import SkipCheck, run_checks  # noqa: E402

import tf_mpi as hvd  # noqa: E402
from tf_mpi.basics import _core  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
SHM = os.environ.get("TF_MPI_SHM", "auto")
CHUNK = int(os.environ.get("TF_MPI_SHM_CHUNK_BYTES", 256 << 10))
MIN_BYTES = int(os.environ.get("TF_MPI_SHM_MIN_BYTES", 0))
SLOT = max(64, CHUNK // N // 64 * 64)  # bytes one block advances per pipeline step (shm_allreduce.cc)
SLOT_WRITES = os.environ.get("TF_MPI_SHM_SLOT_WRITES", "auto")  # how this rank writes its slots
PROGRESS_STEPS = 300  # check_stream_of_gradient_storms_keeps_mpi_progressing

DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
RTOL = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-6, "float64": 1e-12}


def np_dtype(name):
    return tf.as_dtype(name).as_numpy_dtype


def values(rank, count, dtype, seed=0):
    """Small positive numbers, so that products and int8 sums cannot overflow."""
    return (((np.arange(count) + rank + seed) % 3) + 1).astype(np_dtype(dtype))


def reference(op, count, dtype, seed=0):
    stack = np.stack([values(r, count, dtype, seed).astype(np.float64) for r in range(N)])
    out = {"Sum": stack.sum(0), "Average": stack.sum(0) / N, "Min": stack.min(0), "Max": stack.max(0),
           "Product": stack.prod(0)}[op]
    return np.trunc(out) if not dtype.startswith(("float", "bfloat")) else out


def shm_count():
    return _core.stats()["shm_allreduces"]


def on_both_paths(fn):
    """(result over shared memory, result over MPI, shared-memory buckets that ran) of fn()."""
    before = shm_count()
    shm = fn()
    ran = shm_count() - before
    _core.set_shm_paused(True)
    try:
        before = shm_count()
        mpi = fn()
        assert shm_count() == before, "the MPI path was asked for, but shared memory ran"
    finally:
        _core.set_shm_paused(False)
    return shm, mpi, ran


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same_on_every_rank(arrays, what):
    digest = hashlib.sha1()
    for a in arrays:
        digest.update(bits(a).tobytes())
    mine = np.frombuffer(digest.digest(), np.uint8).copy()
    every = _core.allgather(mine.reshape(1, -1), f"digest.{what}")
    assert all(np.array_equal(row, every[0]) for row in every), f"{what}: results differ between ranks"


def assert_matches(shm, mpi, want, dtype, what):
    """Integers (and anything at np=2) bit for bit equal to the MPI path; all close to numpy."""
    exact = not dtype.startswith(("float", "bfloat")) or N == 2
    if exact:
        assert np.array_equal(bits(shm), bits(mpi)), f"{what}: shm {shm[:6]} != mpi {mpi[:6]} (bitwise)"
    got = np.asarray(shm).astype(np.float64)
    if dtype.startswith(("float", "bfloat")):
        assert np.allclose(got, want, rtol=RTOL[dtype], atol=0), f"{what}: got {got[:6]} want {want[:6]}"
    else:
        assert np.array_equal(got, want), f"{what}: got {got[:6]} want {want[:6]}"


def sizes_for(dtype):
    """Element counts around one pipeline step, the block split and many steps."""
    per_step = SLOT // np.dtype(np_dtype(dtype)).itemsize
    return [1, N - 1, N + 1, N * per_step - 1, N * per_step, N * per_step + 1, 3 * N * per_step + 2]


if os.environ.get("SHM_SCENARIO") == "die":
    x = np.ones(1 << 20, np.float32)  # 4 MiB: many pipeline steps each
    if R == 1:
        threading.Timer(1.5, lambda: os._exit(3)).start()
    try:
        for i in range(100000):
            _core.allreduce(x, hvd.Sum, "stream")
    except Exception as e:  # the survivor's view; the launcher may end it first
        print(f"[rank {R}] SURVIVOR ERROR: {e}", flush=True)
        sys.exit(4)
    sys.exit(0)


def check_path_taken_matches_setting():
    # Shared memory runs when enabled (every rank of this job shares the node),
    # and never with TF_MPI_SHM=0.
    assert hvd.local_size() == N
    before = shm_count()
    big = max(MIN_BYTES, 4096) // 4 + 3
    out = _core.allreduce(np.full(big, R + 1, np.float32), hvd.Sum, "path.taken")
    assert np.all(out == N * (N + 1) / 2)
    ran = shm_count() - before
    assert ran == (0 if SHM == "0" else 1), f"TF_MPI_SHM={SHM}: {ran} shared-memory allreduces ran"
    stats = _core.stats()
    if SHM == "0":
        assert stats["shm_allreduces"] == 0 and stats["shm_bytes"] == 0
    else:
        assert stats["shm_bytes"] >= big * 4


def check_every_dtype_op_and_size_direct():
    if SHM == "0":
        raise SkipCheck("shared memory is off in this launch")
    results = []
    for dtype in DTYPES:
        for op_name, op in OPS.items():
            for count in sizes_for(dtype):
                name = f"direct.{dtype}.{op_name}.{count}"
                x = values(R, count, dtype)
                shm, mpi, ran = on_both_paths(lambda: _core.allreduce(x, op, name))
                nbytes = count * x.itemsize
                assert ran == (1 if nbytes >= MIN_BYTES else 0), f"{name}: {ran} shm buckets for {nbytes} bytes"
                assert_matches(shm, mpi, reference(op_name, count, dtype), dtype, name)
                results.append(shm)
    assert_same_on_every_rank(results, "direct")


def check_every_dtype_op_fused():
    # Arrays below 1 KiB share a fusion buffer; together they take several steps.
    if SHM == "0":
        raise SkipCheck("shared memory is off in this launch")
    results = []
    for dtype in DTYPES:
        item = np.dtype(np_dtype(dtype)).itemsize
        counts = [1, 1000 // item - 1, 7, 1000 // item, 3 * N + 1]
        for op_name, op in OPS.items():
            name = f"fused.{dtype}.{op_name}"
            xs = [values(R, c, dtype, seed=i) for i, c in enumerate(counts)]
            shm, mpi, ran = on_both_paths(lambda: _core.grouped_allreduce(xs, op, name))
            assert ran == 1, f"{name}: {ran} shared-memory buckets for one fused group"
            for i, c in enumerate(counts):
                assert_matches(shm[i], mpi[i], reference(op_name, c, dtype, seed=i), dtype, f"{name}[{i}]")
            results += list(shm)
    assert_same_on_every_rank(results, "fused")


def fused_counters():
    stats = _core.stats()
    return stats["shm_fused_buckets"], stats["shm_fused_pieces"], stats["allreduce_buckets"]


def piece_counts(dtype):
    """Element counts of one fused group: empty tensors, pieces shorter than, equal to
    and longer than a pipeline step, and pieces crossing steps and the blocks' edges."""
    per_step = SLOT // np.dtype(np_dtype(dtype)).itemsize
    return [0, 1, per_step - 1, 3, 0, per_step + 1, 2 * per_step, 5, N * per_step + 3, 7, 0, 2]


def check_fused_pieces_without_fusion_buffer():
    # One grouped allreduce of tensors of mixed sizes (the large ones would
    # skip the fusion buffer on the MPI path) is one shared-memory bucket
    # whose tensors are read and written where they lie: equal, bit for bit
    # for integers (and floats at np=2), to the MPI path's fusion buffer.
    if SHM == "0":
        raise SkipCheck("shared memory is off in this launch")
    results = []
    for dtype in DTYPES:
        counts = piece_counts(dtype)
        nonempty = sum(1 for c in counts if c)
        for op_name, op in OPS.items():
            scales = {"prescale_factor": 0.5, "postscale_factor": 3.0} if op_name in ("Sum", "Average") else {}
            name = f"pieces.{dtype}.{op_name}"
            xs = [values(R, c, dtype, seed=i) for i, c in enumerate(counts)]
            fused0, pieces0, buckets0 = fused_counters()
            shm, mpi, ran = on_both_paths(lambda: _core.grouped_allreduce(xs, op, name, **scales))
            fused1, pieces1, buckets1 = fused_counters()
            assert ran == 1, f"{name}: {ran} shared-memory buckets for one group"
            assert (fused1 - fused0, pieces1 - pieces0) == (1, nonempty), \
                f"{name}: {fused1 - fused0} fused buckets with {pieces1 - pieces0} pieces, want 1 with {nonempty}"
            # The MPI path (paused) keeps its plan: tensors of 1 KiB and more go alone.
            large = sum(1 for c in counts if c * xs[0].itemsize >= 1024)
            assert buckets1 - buckets0 >= 1 + large, f"{name}: {buckets1 - buckets0} buckets in all"
            for i, c in enumerate(counts):
                assert shm[i].shape == (c,), f"{name}[{i}]: shape {shm[i].shape}"
                if scales and not dtype.startswith(("float", "bfloat")):
                    # Integers: prescale and postscale truncate, as on the MPI path.
                    assert np.array_equal(bits(shm[i]), bits(mpi[i])), f"{name}[{i}]: {shm[i][:6]} vs {mpi[i][:6]}"
                    continue
                want = reference(op_name, c, dtype, seed=i) * (1.5 if scales else 1.0)
                assert_matches(shm[i], mpi[i], want, dtype, f"{name}[{i}]")
            results += list(shm)
    assert_same_on_every_rank(results, "pieces")


def check_large_bucket_of_odd_pieces():
    # Over 4 MiB a collective writes its outputs with non-temporal stores
    # (shm_allreduce.cc StreamCopy), and its slots either way (SlotWrites:
    # TF_MPI_SHM_SLOT_WRITES, measured when auto); odd piece sizes make every
    # copy start and end off alignment. Bit for bit equal to the MPI path.
    large_bucket_of_odd_pieces(SLOT_WRITES)


def large_bucket_of_odd_pieces(slot_writes):
    if SHM == "0":
        raise SkipCheck("shared memory is off in this launch")
    streamed_before, large_runs = _core.stats()["shm_streamed_slots"], 0
    for dtype, op in (("int32", hvd.Sum), ("float32", hvd.Sum), ("float32", hvd.Average), ("int8", hvd.Max),
                      ("float64", hvd.Min)):
        counts = [3, (4 << 20) // np.dtype(np_dtype(dtype)).itemsize + 1, 17, 777777, 1, 300001, 0, 5]
        xs = [values(R, c, dtype, seed=i) for i, c in enumerate(counts)]
        op_name = {hvd.Sum: "Sum", hvd.Average: "Average", hvd.Max: "Max", hvd.Min: "Min"}[op]
        name = f"large.{dtype}.{op_name}"
        shm, mpi, ran = on_both_paths(lambda: _core.grouped_allreduce(xs, op, name))
        assert ran == 1, f"{name}: {ran} shared-memory buckets"
        large_runs += ran
        assert sum(x.nbytes for x in xs) >= 4 << 20
        for i, c in enumerate(counts):
            assert_matches(shm[i], mpi[i], reference(op_name, c, dtype, seed=i), dtype, f"{name}[{i}]")
        assert_same_on_every_rank(shm, name)
    streamed = _core.stats()["shm_streamed_slots"] - streamed_before
    expected = {"streamed": large_runs, "cached": 0}.get(slot_writes)
    if expected is not None:
        assert streamed == expected, f"TF_MPI_SHM_SLOT_WRITES={slot_writes}: {streamed} of {large_runs} streamed"
    assert 0 <= streamed <= large_runs, (streamed, large_runs)


def check_requests_with_different_scales_fused_in_one_bucket():
    # Separate allreduce ops of one tf.function reach the engine together
    # most of the time and then share a bucket although their prescale,
    # postscale and op (Sum, Average) differ: each tensor keeps its own.
    if SHM == "0":
        raise SkipCheck("shared memory is off in this launch")
    path = os.path.join(tempfile.gettempdir(), f"shm_pieces_timeline_{os.getpid()}.json")
    path = hvd.broadcast_object(path, root_rank=0)
    specs = [(700, hvd.Sum, 1.0, 1.0), (3 * SLOT // 4 + 1, hvd.Average, 1.0, 1.0), (5, hvd.Sum, 0.25, 1.0),
             (SLOT // 4 * N + 9, hvd.Sum, 1.0, 2.0), (2 * SLOT, hvd.Average, 4.0, 0.5), (33, hvd.Sum, 2.0, 0.125)]

    def late_on_rank_0():
        """Rank 0 submits its six ops 30 ms after the others, so theirs are all announced by then."""
        if R == 0:
            time.sleep(0.03)
        return np.float32(0)

    @tf.function
    def step(k):
        # Every op waits for late_on_rank_0: on rank 0 the six are submitted together, and its
        # engine thread (not the submitting thread: TF_MPI_INLINE_BYTES=0 below) takes them at once.
        with tf.control_dependencies([tf.numpy_function(late_on_rank_0, [], tf.float32)]):
            return [hvd.allreduce(tf.fill([c], tf.cast(k + R + i, tf.float32)), op=op, prescale_factor=pre,
                                  postscale_factor=post, name=f"scaled.piece.{i}")
                    for i, (c, op, pre, post) in enumerate(specs)]

    def want(k, i):
        # Sums of small integers times powers of two are exact in float32;
        # the engine multiplies by the postscale (over N for Average) in float32.
        c, op, pre, post = specs[i]
        total = np.float32(sum(float(k + r + i) * pre for r in range(N)))
        return total * np.float32(post / (N if op == hvd.Average else 1))

    def shared_buckets(first_round):
        """12 rounds under a timeline: results checked, then how many shm buckets held several ops."""
        hvd.start_timeline(path)
        outs_by_round = []
        for k in range(first_round, first_round + 12):
            outs = step(tf.constant(k))
            for i, o in enumerate(outs):
                assert o.shape == (specs[i][0],) and np.all(o.numpy() == want(k, i)), \
                    f"round {k}, tensor {i}: {o.numpy()[:4]} want {want(k, i)}"
            outs_by_round += [o.numpy() for o in outs]
        hvd.stop_timeline()
        assert_same_on_every_rank(outs_by_round, f"scaled.pieces.{first_round}")
        shared = 0
        if R == 0:
            with open(path) as f:
                events = json.load(f)["traceEvents"]
            tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
            members = {}
            for e in events:
                if e.get("name") == "SHM_ALLREDUCE":
                    members.setdefault(e["args"]["bucket"], set()).add(tracks[e["tid"]])
            shared = sum(1 for m in members.values() if len(m) > 1)
        return hvd.broadcast_object(shared, root_rank=0)

    # Requests handed to the engine thread (not driven by the caller): rank 0's thread wakes after
    # its six ops are queued. Whether they share a bucket is still up to timing: up to 5 tries.
    inline = os.environ.get("TF_MPI_INLINE_BYTES")
    hvd.shutdown()
    os.environ["TF_MPI_INLINE_BYTES"] = "0"
    hvd.init()
    try:
        for attempt in range(5):
            shared = shared_buckets(12 * attempt)
            if shared:
                break
    finally:
        hvd.shutdown()
        if inline is None:
            os.environ.pop("TF_MPI_INLINE_BYTES")
        else:
            os.environ["TF_MPI_INLINE_BYTES"] = inline
        hvd.init()
    if shared == 0:
        raise SkipCheck("in 60 rounds the ops never reached the engine together (results were checked)")


def check_switch_over_size():
    if SHM == "0" or MIN_BYTES < 8:
        raise SkipCheck("needs shared memory on and TF_MPI_SHM_MIN_BYTES >= 8")
    for nbytes, expected in ((MIN_BYTES - 4, 0), (MIN_BYTES, 1), (MIN_BYTES + 4, 1)):
        x = np.full(nbytes // 4, R + 1, np.int32)
        before = shm_count()
        out = _core.allreduce(x, hvd.Sum, f"switch.{nbytes}")
        assert shm_count() - before == expected, f"{nbytes} bytes (threshold {MIN_BYTES}): path not as expected"
        assert np.all(out == N * (N + 1) // 2)


def check_prescale_postscale_and_integer_wraparound():
    if SHM == "0":
        raise SkipCheck("shared memory is off in this launch")
    count = 3 * SLOT // 4 * N + 5
    for dtype in DTYPES:
        for op_name in ("Sum", "Average"):
            x = values(R, count, dtype)
            name = f"scaled.{dtype}.{op_name}"
            shm, mpi, ran = on_both_paths(lambda: _core.allreduce(x, OPS[op_name], name, prescale_factor=0.5,
                                                                    postscale_factor=3.0))
            assert ran == 1
            assert np.array_equal(bits(shm), bits(mpi)) or (N > 2 and dtype.startswith(("float", "bfloat"))), \
                f"{name}: scaled results differ from the MPI path: {shm[:6]} vs {mpi[:6]}"
            if dtype in ("float32", "float64"):
                want = reference(op_name, count, dtype) * 1.5
                assert np.allclose(shm, want, rtol=1e-6), f"{name}: {shm[:6]} want {want[:6]}"
    # Sums that overflow wrap around (as TensorFlow's own integer adds do).
    # 32- and 64-bit sums equal the MPI path's bit for bit; Open MPI's
    # vectorised 8- and 16-bit sums saturate instead, so there the MPI path
    # is not the reference.
    for dtype, start in (("uint8", 200), ("int8", 100), ("int16", 30000), ("uint16", 60000),
                         ("int32", 2**31 - 10), ("int64", 2**63 - 10)):
        x = (np.arange(count) % 7 + start).astype(np_dtype(dtype))
        shm, mpi, _ = on_both_paths(lambda: _core.allreduce(x, hvd.Sum, f"wrap.{dtype}"))
        if dtype in ("int32", "int64"):
            assert np.array_equal(shm, mpi), f"wrap {dtype}: {shm[:4]} vs {mpi[:4]}"
        want = (sum((np.arange(count) % 7 + start).astype(object) for _ in range(N)))
        bits_ = np.dtype(np_dtype(dtype)).itemsize * 8
        want = np.array([int(v) % (1 << bits_) for v in want], dtype=np.uint64 if bits_ == 64 else np.int64)
        assert np.array_equal(shm.view(f"u{bits_ // 8}").astype(np.uint64), want.astype(np.uint64)), f"wrap {dtype}"


def check_stream_with_response_cache():
    # The same names again and again: later rounds run from the response cache.
    count = 5 * SLOT // 4 + 3
    before = shm_count()
    for step in range(30):
        a = _core.allreduce(np.full(count, R + step, np.float32), hvd.Sum, "stream.a")
        b = _core.grouped_allreduce([np.full(17, R, np.int32), np.full(9, step, np.int64)], hvd.Sum, "stream.g")
        assert np.all(a == sum(r + step for r in range(N))), f"step {step}"
        assert np.all(b[0] == N * (N - 1) // 2) and np.all(b[1] == N * step), f"step {step}"
    if SHM != "0":
        assert shm_count() - before == 30 + (30 if 17 * 4 + 9 * 8 >= MIN_BYTES else 0)


def check_join_contributes_identity():
    # Rank r has 2 + r rounds; ranks that finish join and stand in with the identity.
    if SHM == "0":
        raise SkipCheck("shared memory is off in this launch")
    count = 2 * SLOT // 4 * N + 1
    before = shm_count()
    for s in range(2 + R):
        x = np.full(count, float(R + 1), np.float32)
        total = _core.allreduce(x, hvd.Sum, f"join.sum.{s}")
        mean = _core.allreduce(x, hvd.Average, f"join.avg.{s}")
        low = _core.allreduce(x, hvd.Min, f"join.min.{s}")
        active = [r for r in range(N) if 2 + r > s]
        assert np.all(total == sum(r + 1 for r in active)), f"round {s}: {total[:3]}"
        assert np.allclose(mean, sum(r + 1 for r in active) / len(active)), f"round {s}: {mean[:3]}"
        assert np.all(low == min(r + 1 for r in active)), f"round {s}: {low[:3]}"
    assert _core.join() == N - 1
    # Every rank ran the stand-ins of the rounds it had joined for, over shared memory too.
    assert shm_count() - before == 3 * (2 + N - 1), f"{shm_count() - before} shared-memory buckets"


def check_stream_of_gradient_storms_keeps_mpi_progressing():
    # Rank 0 sends its decisions by MPI_Isend, and Open MPI moves a message
    # only while its sender calls into MPI: a rank waiting on shared memory
    # must keep MPI progressing, or its peer may never learn what to run. The
    # launch ("progress") keeps the default pipeline and fusion settings and
    # turns the peer liveness check off: its thread calls into MPI every second,
    # which would free such a stall after a second (a slow stream that passes)
    # instead of leaving it to the stall shutdown (an error naming the step).
    # Without the progress in the wait, this stream stalled within its first
    # steps in 4 runs of 4 (2 cores); with the liveness thread on, 2 of 3 runs
    # of 1000 steps passed, only slowly.
    sizes = [int(64 * 1.37 ** (i % 24)) + i for i in range(200)]  # 64 B to ~200 KiB
    tensors = [tf.fill([n], float(R + 1)) for n in sizes]
    expected = N * (N + 1) / 2

    @tf.function
    def storm(ts):
        return [hvd.allreduce(t, op=hvd.Sum, name=f"progress.{i}") for i, t in enumerate(ts)]

    before = shm_count()
    for step in range(PROGRESS_STEPS):
        try:
            outs = storm(tensors)
        except tf.errors.OpError as e:
            raise AssertionError(f"step {step} of {PROGRESS_STEPS} did not complete: {e.message[:300]}") from None
        bad = [i for i, o in enumerate(outs) if not np.all(o.numpy() == expected)]
        assert not bad, f"step {step}: tensors {bad[:5]} are wrong"
    assert shm_count() > before


def check_many_tensors_with_long_names_in_one_function():
    # A batch this large makes rank 0's decision message long enough that MPI
    # moves it only while rank 0 calls into MPI: a rank waiting on shared
    # memory must keep MPI progressing, or its peer never learns what to run.
    names = [f"many.{i:03d}." + "x" * 300 for i in range(60)]

    @tf.function
    def many(k):
        return [hvd.allreduce(tf.fill([300 + i], tf.cast(k + R, tf.float32)), op=hvd.Sum, name=n)
                for i, n in enumerate(names)]

    before = shm_count()
    for k in range(3):
        outs = many(tf.constant(k))
        for i, o in enumerate(outs):
            assert o.shape == (300 + i,) and np.all(o.numpy() == sum(k + r for r in range(N))), f"tensor {i}"
    if SHM != "0":
        assert shm_count() > before


def check_tensorflow_ops_fused_and_timeline():
    # A grouped allreduce is one fused bucket whatever the timing (separate
    # allreduce ops fuse only when they reach the engine together); the
    # timeline shows the shared-memory phase with its fusion copies around it.
    path = os.path.join(tempfile.gettempdir(), f"shm_timeline_{os.getpid()}.json")
    path = hvd.broadcast_object(path, root_rank=0)
    shapes = [(33,), (5, 7), (1000,), (2, 300)]

    @tf.function
    def step(k):
        return hvd.grouped_allreduce([tf.fill(s, tf.cast(k + R, tf.float32)) for s in shapes], op=hvd.Sum,
                                     name="tf.grouped")

    before = shm_count()
    hvd.start_timeline(path)
    for k in range(3):
        outs = step(tf.constant(k))
        for o, s in zip(outs, shapes):
            assert o.shape == s and np.all(o.numpy() == sum(k + r for r in range(N)))
    hvd.stop_timeline()
    ran = shm_count() - before
    if SHM == "0":
        assert ran == 0
        if R == 0:
            with open(path) as f:
                assert any(e.get("name") == "MEMCPY_IN_FUSION_BUFFER" for e in json.load(f)["traceEvents"])
        return
    assert ran >= 3, f"{ran} shared-memory buckets for 3 steps"
    if R == 0:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        shm_spans = [e for e in events if e.get("name") == "SHM_ALLREDUCE"]
        assert shm_spans and all(e["args"]["transport"] == "shm" and "wait_us" in e["args"] for e in shm_spans)
        # The group is one bucket of its 4 tensors, reduced without the fusion buffer.
        assert all(e["args"]["tensors"] == len(shapes) for e in shm_spans), [e["args"] for e in shm_spans]
        assert not any(e.get("name", "").startswith("MEMCPY_") for e in events), "fusion-buffer copies on shm"
        small = [e["args"]["bytes"] for e in events if e.get("name") == "MPI_ALLREDUCE"]
        assert all(b < MIN_BYTES for b in small), f"buckets of {small} bytes took the MPI path"


# Each way of writing the slots, fixed. The engine reads TF_MPI_SHM_SLOT_WRITES at init(), so these
# restart it with the setting instead of a launch each; they come last, and put the launch's own
# setting back after.
def large_bucket_with_slot_writes(how):
    if SHM == "0":
        raise SkipCheck("shared memory is off in this launch")
    hvd.shutdown()
    os.environ["TF_MPI_SHM_SLOT_WRITES"] = how
    try:
        hvd.init()
        large_bucket_of_odd_pieces(how)
    finally:
        if hvd.is_initialized():
            hvd.shutdown()
        os.environ["TF_MPI_SHM_SLOT_WRITES"] = SLOT_WRITES
        hvd.init()


def check_large_bucket_with_slots_streamed():
    large_bucket_with_slot_writes("streamed")


def check_large_bucket_with_slots_cached():
    large_bucket_with_slot_writes("cached")


run_checks(globals(), R)
