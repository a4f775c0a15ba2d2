"""Soak: thousands of collectives from several threads per rank, in orders that
differ from rank to rank, with random sizes (fused and direct), a tiny response
cache and join() at random points. Every result is checked against a reference
computed on each rank from every rank's (deterministic) inputs, and a digest of
all replicated results must be identical on every rank. numpy and the pybind
module only.

CI (tests/test_soak.py) runs a short count; a longer one is a benchmark:

    python -m tf_mpi.run -np 3 python tests/workers/soak_worker.py --rounds 1000

with the settings the test uses (a tiny cache, small fusion sizes)::

    TF_MPI_CACHE_CAPACITY=4 TF_MPI_FUSION_THRESHOLD=65536 TF_MPI_FUSION_DIRECT_BYTES=16384 \
    TF_MPI_CHUNK_BYTES=32768

Deadlock freedom of the test itself: each round's collectives have one global
order (shared seed); each rank deals them to its threads at random (its own
seed) and every thread submits its share in the global order. The earliest
unfinished collective is then submitted on every rank, so the round always
completes, while the order in which each rank's engine sees the submissions
differs from rank to rank and from run to run.
"""
import argparse
import hashlib
import os
import sys
import threading
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import run_checks  # noqa: E402

_pkg = types.ModuleType("tf_mpi")
_pkg.__path__ = [os.path.join(os.path.dirname(os.path.dirname(HERE)), "tf_mpi")]
sys.modules.setdefault("tf_mpi", _pkg)
from tf_mpi import _core  # noqa: E402

AVERAGE, SUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.int8, np.uint8, np.int16, np.uint16]
FLOATS = (np.float32, np.float64, np.float16)
NAMES = 24  # the name pool: names come back with other shapes, types and kinds

parser = argparse.ArgumentParser(description="tf_mpi soak")
parser.add_argument("--rounds", type=int, default=int(os.environ.get("TF_MPI_SOAK_ROUNDS", "60")))
parser.add_argument("--ops", type=int, default=40, help="collectives per round")
parser.add_argument("--threads", type=int, default=4, help="submitting threads per rank")
parser.add_argument("--seed", type=int, default=int(os.environ.get("TF_MPI_SOAK_SEED", "18")))
ARGS, _ = parser.parse_known_args()


def inputs(spec, rank):
    """Rank `rank`'s input arrays for op `spec` (identical wherever computed)."""
    rng = np.random.default_rng([ARGS.seed, spec["round"], spec["index"], rank])
    out = []
    for shape, dtype in zip(spec["shapes"][rank], spec["dtypes"]):
        if spec["op"] == PRODUCT:
            values = rng.choice([1, 2] if np.dtype(dtype).kind == "u" else [1, 2, -1], size=shape)
        elif np.dtype(dtype).kind == "u":
            values = rng.integers(0, 9, size=shape)
        else:
            values = rng.integers(-8, 9, size=shape)
        out.append(values.astype(dtype))
    return out


def reference(spec, n, me, joined=()):
    """What op `spec` returns on rank `me` of n, computed from every rank's inputs."""
    kind, op = spec["kind"], spec["op"]
    live = [r for r in range(n) if r not in joined]
    per_rank = {r: inputs(spec, r) for r in live}
    if kind == "broadcast":
        return per_rank[spec["root"]]
    if kind == "allgather":
        return [np.concatenate([per_rank[r][0] for r in live], axis=0)]
    results = []
    for t, dtype in enumerate(spec["dtypes"]):
        stack = np.stack([per_rank[r][t].astype(np.float64) for r in live])
        if op in (SUM, AVERAGE):
            v = stack.sum(axis=0) / (len(live) if op == AVERAGE else 1)
        elif op == MIN:
            v = stack.min(axis=0)
        elif op == MAX:
            v = stack.max(axis=0)
        else:
            v = stack.prod(axis=0)
        results.append(v)
    if kind == "reducescatter":
        rows = results[0].shape[0]
        counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
        start = sum(counts[:me])
        return [results[0][start:start + counts[me]]]
    return results


def make_round(rnd, n, joining):
    """The round's collectives (the same list on every rank)."""
    rng = np.random.default_rng([ARGS.seed, rnd])
    specs = []
    names = rng.permutation(NAMES)
    count = ARGS.ops if not joining else int(rng.integers(1, 5))
    for i in range(count):
        kinds = ["allreduce", "grouped", "allgather"] if joining else \
            ["allreduce", "allreduce", "grouped", "allgather", "broadcast", "reducescatter"]
        kind = kinds[int(rng.integers(len(kinds)))]
        ntensors = int(rng.integers(2, 5)) if kind == "grouped" else 1
        dtypes = [DTYPES[int(rng.integers(len(DTYPES)))] for _ in range(ntensors)]
        ops = [SUM, AVERAGE] if joining else [SUM, SUM, AVERAGE, MIN, MAX, PRODUCT]
        op = ops[int(rng.integers(len(ops)))] if kind in ("allreduce", "grouped", "reducescatter") else SUM
        if op == AVERAGE:
            dtypes = [d if d in FLOATS else np.float32 for d in dtypes]
        if op == PRODUCT or np.float16 in dtypes:
            big = False  # keeps products and float16 sums exact
        else:
            big = rng.random() < 0.2
        shapes = []
        for _ in range(ntensors):
            elems = int(rng.integers(4000, 12000)) if big else int(rng.integers(0, 600))
            shapes.append((elems,) if rng.random() < 0.5 else (max(1, elems // 8), 8))
        per_rank = {r: list(shapes) for r in range(n)}
        if kind == "allgather":  # first dimensions differ by rank
            per_rank = {r: [(int(rng.integers(0, 6)),) + shapes[0][1:]] for r in range(n)}
        if kind == "reducescatter":  # rows not always a multiple of n (uneven blocks, some empty)
            rows = int(rng.integers(0, 3 * n + 2)) if not big else int(rng.integers(800, 2400))
            per_rank = {r: [(rows, 5)] for r in range(n)}
        specs.append({"round": rnd, "index": i, "kind": kind, "op": op, "dtypes": dtypes, "shapes": per_rank,
                      "root": int(rng.integers(n)), "name": f"soak.{int(names[i % NAMES])}.{i // NAMES}"})
    joiners = []
    if joining:
        joiners = [int(r) for r in rng.permutation(n)[:int(rng.integers(1, n))]]
    return specs, joiners


def submit(spec):
    me = _core.rank()
    xs = inputs(spec, me)
    kind, name = spec["kind"], spec["name"]
    if kind == "allreduce":
        return [_core.allreduce(xs[0], spec["op"], name)]
    if kind == "grouped":
        return _core.grouped_allreduce(xs, spec["op"], name)
    if kind == "allgather":
        return [_core.allgather(xs[0], name)]
    if kind == "broadcast":
        return [_core.broadcast(xs[0], spec["root"], name)]
    return [_core.reducescatter(xs[0], spec["op"], name)]


def run_round(rnd, digest, stats):
    n, me = _core.size(), _core.rank()
    joining = rnd % 5 == 4  # every 5th round: some ranks run out of data and join
    specs, joiners = make_round(rnd, n, joining)
    dealer = np.random.default_rng([ARGS.seed, rnd, me, 7])
    shares = [[] for _ in range(ARGS.threads)]
    for spec in specs:
        shares[int(dealer.integers(ARGS.threads))].append(spec)
    results, errors = {}, []

    def work(share, jitter_seed):
        jitter = np.random.default_rng(jitter_seed)
        try:
            for spec in share:  # the global order, within this thread
                if jitter.random() < 0.2:
                    time.sleep(float(jitter.random()) * 3e-4)
                results[spec["index"]] = submit(spec)
        except Exception as e:  # reported below
            errors.append(f"{type(e).__name__}: {e}")

    if me in joiners:
        last = _core.join()
    else:
        threads = [threading.Thread(target=work, args=(share, [ARGS.seed, rnd, me, k]))
                   for k, share in enumerate(shares)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        last = _core.join() if joining else None
    digest.update(f"{rnd}:{last};".encode())
    for spec in specs:
        if me in joiners:
            continue
        want = reference(spec, n, me, joined=joiners)
        got = results[spec["index"]]
        assert len(got) == len(want), (spec["name"], len(got))
        for t, (g, w) in enumerate(zip(got, want)):
            exact = spec["op"] != AVERAGE
            assert g.shape == w.shape, (spec["kind"], spec["name"], t, g.shape, w.shape)
            ok = np.array_equal(g.astype(np.float64), w) if exact else \
                np.allclose(g.astype(np.float64), w, rtol=2e-3 if g.dtype == np.float16 else 1e-6, atol=1e-6)
            assert ok, (spec["kind"], spec["name"], spec["op"], str(g.dtype), t, g.ravel()[:5], w.ravel()[:5])
            if spec["kind"] != "reducescatter" and not joining:  # replicated: identical everywhere
                digest.update(spec["name"].encode() + g.tobytes())
        stats["ops"] += 1
    stats["joins"] += int(joining)


def check_soak_results_are_exact_and_identical_on_every_rank():
    _core.init()
    digest, stats = hashlib.sha256(), {"ops": 0, "joins": 0}
    start = time.time()
    for rnd in range(ARGS.rounds):
        run_round(rnd, digest, stats)
    elapsed = time.time() - start
    mine = np.frombuffer(digest.digest(), np.uint8)[None, :].copy()
    everyone = _core.allgather(mine, "soak.digest")
    assert all(np.array_equal(everyone[0], row) for row in everyone), "ranks' results differ"
    s = _core.stats()
    assert s["callbacks_under_lock"] == 0, s
    assert s["inline_max_batch_bytes"] <= int(os.environ.get("TF_MPI_INLINE_BYTES", 64 << 10)), s
    if _core.rank() == 0:
        print(f"soak: {stats['ops']} collectives checked on rank 0 ({ARGS.rounds} rounds, {stats['joins']} with "
              f"join, {ARGS.threads} threads per rank, {_core.size()} ranks) in {elapsed:.1f} s, "
              f"{stats['ops'] / elapsed:.0f}/s; engine: {s['requests']} requests, {s['allreduce_buckets']} "
              f"allreduce buckets, {s['inline_batches']} batches inline, {s['deferred_batches']} handed to the "
              f"engine thread", flush=True)


if __name__ == "__main__":
    run_checks(globals(), int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))))
