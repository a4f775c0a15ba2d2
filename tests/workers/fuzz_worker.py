"""Fuzz: a few hundred random API calls per rank through the TensorFlow ops
and the numpy binding (tf_mpi._core): random collectives, dtypes, shapes,
names, ops and scale factors, of which about a third are wrong on purpose
(mismatched shapes / dtypes / ops / roots across ranks, roots out of range,
wrong splits, unsupported dtypes and ops, scalars where a dimension is needed,
a broadcast while the other rank has joined, calls after shutdown, and a few
bad only on one rank, which the other sees as a stall). Every good call's
result is checked against a reference computed from both ranks' inputs; every
bad call must raise a Python or TensorFlow error on the ranks concerned within
seconds; no process may crash.

Run by tests/test_fuzz.py at np=2 with TF_MPI_STALL_CHECK_TIME_SECONDS=1 and
TF_MPI_STALL_SHUTDOWN_TIME_SECONDS=3. Each call is generated from a shared
seed, so both ranks know what the other submits; an mpi4py barrier before
each call keeps the ranks within milliseconds of each other.
"""
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import run_checks  # noqa: E402

import tf_mpi as hvd  # noqa: E402
from tf_mpi import _core  # noqa: E402

hvd.init()
from mpi4py import MPI  # noqa: E402

R, N = hvd.rank(), hvd.size()
SEED = int(os.environ.get("TF_MPI_FUZZ_SEED", "1818"))
CALLS = int(os.environ.get("TF_MPI_FUZZ_CALLS", "300"))
STALL_S = float(os.environ.get("TF_MPI_STALL_SHUTDOWN_TIME_SECONDS", "3"))
QUICK_S = 5.0  # a bad call refused locally or by rank 0's negotiation errs within this
ERRORS = (tf.errors.OpError, ValueError, TypeError, NotImplementedError, RuntimeError)
OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
CORE_OP = {"Average": 0, "Sum": 1, "Min": 2, "Max": 3, "Product": 4, "Adasum": 5}
NP_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64"]
TF_DTYPES = NP_DTYPES + ["bfloat16"]
FLOATS = ("float16", "bfloat16", "float32", "float64")
NAMES = ["plain", "with space", "slash/and.dots", "ünïcödé-名前", "x" * 5000, "tab\tnewline\n", "0"]


def values(call, rank, shape, dtype):
    """Rank `rank`'s input for `call` (a numpy array; bfloat16 as float32 values)."""
    rng = np.random.default_rng([SEED, call["k"], rank, len(shape)])
    if call.get("op") == "Product":
        v = rng.choice([1, 2] if dtype.startswith("u") else [1, 2, -1], size=shape)
    elif dtype == "bool":
        return rng.random(shape) < 0.5
    elif dtype.startswith("u"):
        v = rng.integers(0, 9, size=shape)
    else:
        v = rng.integers(-8, 9, size=shape)
    return v.astype("float32" if dtype == "bfloat16" else dtype)


def to_api(call, x, dtype):
    if call["api"] == "np":
        return x
    t = tf.constant(x)
    return tf.cast(t, tf.bfloat16) if dtype == "bfloat16" else t


def as_numpy(y):
    if isinstance(y, tf.Tensor):
        y = tf.cast(y, tf.float32) if y.dtype == tf.bfloat16 else y
        return y.numpy()
    return np.asarray(y)


def reduce(op, stack):
    stack = np.stack([s.astype(np.float64) for s in stack])
    return {"Sum": stack.sum(0), "Average": stack.mean(0), "Min": stack.min(0), "Max": stack.max(0),
            "Product": stack.prod(0)}[op]


# ---- the calls ------------------------------------------------------------

def good_call(k, rng):
    api = "tf" if rng.random() < 0.6 else "np"
    kinds = ["allreduce", "grouped", "allgather", "broadcast", "reducescatter"] + (["alltoall"] if api == "tf" else [])
    kind = kinds[int(rng.integers(len(kinds)))]
    dtypes = TF_DTYPES if api == "tf" else NP_DTYPES
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    if kind in ("allgather", "broadcast") and rng.random() < 0.15:
        dtype = "bool"
    op = ["Sum", "Average", "Min", "Max", "Product"][int(rng.integers(5))]
    if kind == "reducescatter":
        op = ["Sum", "Average"][int(rng.integers(2))]
    if op == "Average" and dtype not in FLOATS:
        dtype = "float32"
    if dtype in ("float16", "bfloat16") and op == "Product":
        op = "Sum"
    ndim = int(rng.integers(0 if kind in ("allreduce", "grouped", "broadcast") else 1, 4))
    shape = tuple(int(rng.integers(0, 5)) for _ in range(ndim))
    pre = post = 1.0
    if kind in ("allreduce", "grouped", "reducescatter") and dtype in ("float32", "float64") and rng.random() < 0.3:
        pre, post = float(rng.choice([0.5, 2.0, 1.0])), float(rng.choice([0.25, 4.0, 1.0]))
    call = {"k": k, "good": True, "api": api, "kind": kind, "dtype": dtype, "op": op, "shape": shape,
            "pre": pre, "post": post, "name": f"fz{k}.{NAMES[int(rng.integers(len(NAMES)))]}",
            "root": int(rng.integers(N)), "ntensors": int(rng.integers(1, 4)),
            "rows": [int(rng.integers(0, 4)) for _ in range(N)],
            "splits": [[int(rng.integers(0, 3)) for _ in range(N)] for _ in range(N)]}
    if kind == "alltoall" and not shape:
        call["shape"] = (0,)
    return call


BAD = ["shape_mismatch", "dtype_mismatch", "op_mismatch", "scale_mismatch", "root_out_of_range", "root_mismatch",
       "bool_allreduce", "complex_dtype", "scalar_allgather", "scalar_reducescatter", "splits_wrong_length",
       "splits_negative", "splits_sum", "adasum", "invalid_op", "group_size_mismatch", "trailing_mismatch",
       "reducescatter_min", "empty_name", "broadcast_while_joined", "kind_mismatch"]


def bad_call(k, rng):
    call = good_call(k, rng)
    call["good"] = False
    call["bad"] = bad = BAD[int(rng.integers(len(BAD)))]
    needs = {"splits_wrong_length": "alltoall", "splits_negative": "alltoall", "splits_sum": "alltoall",
             "scalar_allgather": "allgather", "scalar_reducescatter": "reducescatter", "bool_allreduce": "allreduce",
             "root_out_of_range": "broadcast", "root_mismatch": "broadcast", "group_size_mismatch": "grouped",
             "trailing_mismatch": "allgather", "reducescatter_min": "reducescatter", "adasum": "allreduce",
             "invalid_op": "allreduce", "op_mismatch": "allreduce", "scale_mismatch": "allreduce",
             "broadcast_while_joined": "broadcast"}
    needs.update({"complex_dtype": "allreduce", "empty_name": "allreduce"})
    if bad in needs:
        call["kind"] = needs[bad]
    if bad == "shape_mismatch" and call["kind"] in ("allgather", "alltoall"):
        call["kind"] = "allreduce"  # their first dimensions may differ by design
    if call["kind"] == "alltoall" or bad in ("splits_wrong_length", "splits_negative", "splits_sum",
                                             "reducescatter_min"):
        call["api"] = "tf"
    if bad in ("invalid_op", "complex_dtype") and rng.random() < 0.5:
        call["api"] = "np"
    if bad == "empty_name":
        call["api"] = "np"  # a TensorFlow op without a name takes its node's name
    if bad == "adasum":
        call["api"] = "np"  # the engine has no Adasum op (tf_mpi.allreduce builds it from an allgather)
    if bad == "bool_allreduce":
        call["dtype"] = "bool"
    if bad in ("scale_mismatch",):
        call["dtype"] = "float32"
    if call["kind"] in ("allgather", "reducescatter", "alltoall") and not call["shape"]:
        call["shape"] = (2,)
    if call["dtype"] == "bool" and call["kind"] not in ("allgather", "broadcast") and bad != "bool_allreduce":
        call["dtype"] = "int32"
    if call["op"] in ("Average",) and call["dtype"] not in FLOATS:
        call["dtype"] = "float32"
    if bad in ("trailing_mismatch", "shape_mismatch") and len(call["shape"]) < 2:
        call["shape"] = (2, 3)
    if bad == "bool_allreduce":
        call.update(dtype="bool", op="Sum")
    call["victim"] = int(rng.integers(N))  # the rank that differs, where one does
    return call


def local_bad_call(k, rng, which):
    """Wrong on one rank only, refused there before negotiation: the other rank waits for it (a stall)."""
    call = good_call(k, rng)
    call.update(good=False, bad=["local_splits", "local_root", "local_invalid_op"][which % 3], victim=1 % N)
    if call["bad"] == "local_splits":
        call.update(api="tf", kind="alltoall", shape=(3,), dtype="float32")
    elif call["bad"] == "local_root":
        call.update(api=["tf", "np"][k % 2], kind="broadcast", dtype="float32")
    else:
        call.update(api="np", kind="allreduce", dtype="float32", op="Sum")
    return call


def submit(call):
    """Submits this rank's part of `call`; returns the results as numpy arrays."""
    api, kind, dtype, name, bad = call["api"], call["kind"], call["dtype"], call["name"], call.get("bad")
    me_differs = bad is not None and R == call.get("victim")
    shape = call["shape"]
    if kind == "allgather":
        shape = (call["rows"][R],) + tuple(shape[1:])
    if kind == "alltoall":
        shape = (sum(call["splits"][R]),) + tuple(shape[1:])
    if bad == "shape_mismatch" and me_differs:
        shape = (shape[0] + 1,) + tuple(shape[1:])
    if bad == "trailing_mismatch" and me_differs:
        shape = tuple(shape[:-1]) + (shape[-1] + 1,)
    if bad in ("scalar_allgather", "scalar_reducescatter"):
        shape = ()
    if bad == "dtype_mismatch" and me_differs:
        dtype = "float64" if dtype != "float64" else "float32"
    op = call["op"]
    if bad == "op_mismatch" and me_differs:
        op = "Max" if op != "Max" else "Min"
    pre = call["pre"] * (2.0 if bad == "scale_mismatch" and me_differs else 1.0)
    if bad == "kind_mismatch" and me_differs:
        kind = "broadcast" if kind != "broadcast" else "allgather"
        if kind == "allgather" and not shape:
            shape = (1,)
    if bad == "empty_name":
        name = ""
    x = values(call, R, shape, "int32" if dtype in ("complex64", "bool") and bad == "complex_dtype" else dtype)
    if bad == "complex_dtype":
        x = x.astype(np.complex64)
    t = to_api(call, x, dtype)
    if kind == "grouped":
        count = call["ntensors"] + (1 if bad == "group_size_mismatch" and me_differs else 0)
        xs = [to_api(call, values(call, R, shape, dtype) * (i + 1), dtype) for i in range(count)]
    opv = OPS.get(op)
    if bad == "adasum":
        opv = hvd.Adasum
    if bad == "invalid_op" or (bad == "local_invalid_op" and me_differs):
        opv = 7
    if api == "np":
        cop = opv if isinstance(opv, int) and opv == 7 else CORE_OP["Adasum" if bad == "adasum" else op]
        if kind == "allreduce":
            return [_core.allreduce(t, cop, name, pre, call["post"])]
        if kind == "grouped":
            return _core.grouped_allreduce(xs, cop, name, pre, call["post"])
        if kind == "allgather":
            return [_core.allgather(t, name)]
        if kind == "broadcast":
            return [_core.broadcast(t, root_of(call), name)]
        return [_core.reducescatter(t, cop, name, pre, call["post"])]
    if kind == "allreduce":
        return [as_numpy(hvd.allreduce(t, op=opv, name=name, prescale_factor=pre, postscale_factor=call["post"]))]
    if kind == "grouped":
        return [as_numpy(y) for y in hvd.grouped_allreduce(xs, op=opv, name=name, prescale_factor=pre,
                                                             postscale_factor=call["post"])]
    if kind == "allgather":
        return [as_numpy(hvd.allgather(t, name=name))]
    if kind == "broadcast":
        return [as_numpy(hvd.broadcast(t, root_rank=root_of(call), name=name))]
    if kind == "alltoall":
        splits = list(call["splits"][R])
        if bad == "splits_wrong_length":
            splits = splits + [0]
        if bad == "splits_negative":
            splits = [-1] + splits[1:]
        if bad == "splits_sum" or (bad == "local_splits" and me_differs):
            splits = [s + 1 for s in splits]
        out, received = hvd.alltoall(t, splits=splits, name=name)
        return [as_numpy(out), as_numpy(received)]
    if bad == "reducescatter_min":
        opv = hvd.Min
    return [as_numpy(hvd.reducescatter(t, op=opv, name=name, prescale_factor=pre, postscale_factor=call["post"]))]


def root_of(call):
    bad, me_differs = call.get("bad"), R == call.get("victim")
    if bad == "root_out_of_range":
        return [N, -1, 100][call["k"] % 3]
    if bad == "root_mismatch":
        return R
    if bad == "local_root" and me_differs:
        return N + 3
    return call["root"]


def reference(call):
    """What a good call returns on this rank."""
    kind, dtype, shape = call["kind"], call["dtype"], call["shape"]
    if kind == "allgather":
        return [np.concatenate([values(call, r, (call["rows"][r],) + tuple(shape[1:]), dtype) for r in range(N)])]
    if kind == "broadcast":
        return [values(call, call["root"], shape, dtype)]
    if kind == "alltoall":
        parts, recv = [], []
        for r in range(N):
            x = values(call, r, (sum(call["splits"][r]),) + tuple(shape[1:]), dtype)
            start = sum(call["splits"][r][:R])
            parts.append(x[start:start + call["splits"][r][R]])
            recv.append(call["splits"][r][R])
        return [np.concatenate(parts), np.array(recv)]
    count = call["ntensors"] if kind == "grouped" else 1
    out = []
    for i in range(count):
        stack = [values(call, r, shape, dtype) * (i + 1) * call["pre"] for r in range(N)]
        out.append(reduce(call["op"], stack) * call["post"])
    if kind == "reducescatter":
        rows = shape[0]
        counts = [rows // N + (1 if q < rows % N else 0) for q in range(N)]
        start = sum(counts[:R])
        out = [out[0][start:start + counts[R]]]
    return out


def matches(got, want, dtype):
    got = np.asarray(got)
    if got.shape != want.shape:
        return False
    if dtype in ("float16", "bfloat16"):
        return np.allclose(got.astype(np.float64), want, rtol=1e-2, atol=1e-2)
    if dtype in ("float32", "float64"):
        return np.allclose(got.astype(np.float64), want, rtol=1e-6, atol=1e-6)
    return np.array_equal(got.astype(np.float64), np.asarray(want, np.float64))


# ---- the run --------------------------------------------------------------

def run_one(call, tally):
    MPI.COMM_WORLD.Barrier()
    local = call.get("bad", "").startswith("local_")
    joined = call.get("bad") == "broadcast_while_joined"
    expect_error = not call["good"] and (not local or R == call["victim"]) and not (joined and R == call["victim"])
    start = time.time()
    try:
        if joined and R == call["victim"]:
            last = hvd.join()  # returns once the other rank joins too (after its broadcast failed)
            got = None
            assert last in range(N), last
        else:
            got = submit(call)
        elapsed = time.time() - start
    except ERRORS as e:
        elapsed = time.time() - start
        stalled = local and R != call["victim"]
        assert not call["good"], f"good call {call} failed: {type(e).__name__}: {e}"
        assert expect_error or stalled, f"{call} failed on rank {R}: {e}"
        if stalled:
            assert "stalled" in str(e), (call, str(e))
            assert elapsed < STALL_S + 3, (call, elapsed)
            tally["stall_s"].append(elapsed)
        else:
            assert elapsed < QUICK_S, (call, elapsed, str(e))
            tally["error_s"].append(elapsed)
        tally["errors"][call["bad"]] = tally["errors"].get(call["bad"], 0) + 1
        if joined:
            hvd.join()
        return
    assert not expect_error, f"bad call {call} ({call.get('bad')}) returned on rank {R}"
    assert not local, f"{call} returned on rank {R}"
    if got is None:
        return
    want = reference(call)
    assert len(got) == len(want), call
    for g, w in zip(got, want):
        assert matches(g, w, call["dtype"]), (call, np.asarray(g).ravel()[:6], w.ravel()[:6])
    tally["good"] += 1
    tally["good_s"].append(elapsed)


def check_fuzz_good_calls_right_bad_calls_errors_within_seconds_no_crash():
    rng = np.random.default_rng(SEED)
    tally = {"good": 0, "errors": {}, "error_s": [], "stall_s": [], "good_s": []}
    local_at = [CALLS // 4, CALLS // 2, 3 * CALLS // 4]
    for k in range(CALLS):
        if k in local_at:
            call = local_bad_call(k, rng, local_at.index(k))
        elif rng.random() < 0.35:
            call = bad_call(k, rng)
        else:
            call = good_call(k, rng)
        run_one(call, tally)
    # Calls after shutdown: errors at once, then init() works again.
    hvd.shutdown()
    after = [lambda: hvd.allreduce(tf.ones([2]), name="after.down"),
             lambda: hvd.allgather(tf.ones([2]), name="after.down.ag"),
             lambda: hvd.broadcast(tf.ones([2]), 0, name="after.down.bc"),
             lambda: _core.allreduce(np.ones(2, np.float32), 1, "after.down.np"),
             lambda: hvd.join()]
    try:
        for fn in after:
            start = time.time()
            try:
                fn()
                raise AssertionError("a call after shutdown() returned")
            except ERRORS as e:
                assert "not been initialized" in str(e) or "shut down" in str(e), str(e)
                tally["error_s"].append(time.time() - start)
                tally["errors"]["after_shutdown"] = tally["errors"].get("after_shutdown", 0) + 1
    finally:  # every rank starts again, also where an assertion failed: no rank waits alone in init
        hvd.init()
    y = hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum, name="after.reinit")
    assert float(y[0]) == sum(range(N))
    summary = {"rank": R, "calls": CALLS + len(after), "good": tally["good"],
               "bad": sum(tally["errors"].values()), "kinds_of_bad": len(tally["errors"]),
               "max_error_s": round(max(tally["error_s"]), 3),
               "median_error_s": round(float(np.median(tally["error_s"])), 4),
               "stalls": len(tally["stall_s"]), "max_stall_s": round(max(tally["stall_s"], default=0), 2),
               "by_kind": tally["errors"]}
    print("FUZZ " + json.dumps(summary), flush=True)
    assert tally["good"] > CALLS // 2 and len(tally["errors"]) >= 15, summary


if __name__ == "__main__":
    run_checks(globals(), R)
