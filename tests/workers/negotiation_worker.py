"""The negotiation at np = 2, 4, 8 (tests/test_negotiation_scaling.py):
messages per steady-state step, counted by the engine, with the tree and with
the star (TF_MPI_NEGOTIATION) in one launch; and with the tree: results,
a first-time and a cached mismatch (FailedPrecondition naming the ranks),
an allgather whose rows change on one rank, join by an inner and a leaf rank,
a stall naming the missing rank, one rank shutting down early, and an inner
rank of the tree stopped (SIGSTOP) while the others wait for it: declared
unreachable by the peer liveness check, its subtree told by rank 0 directly.
numpy and the pybind module only (no TensorFlow: each launch starts in about
a second). Per-step counts go to $TF_MPI_NEGOTIATION_COUNTS/<mode>.rank<r>.json.
"""
import json
import os
import signal
import sys
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import run_checks, set_environ  # noqa: E402

# The pybind module alone (tf_mpi/__init__.py imports TensorFlow).
_pkg = types.ModuleType("tf_mpi")
_pkg.__path__ = [os.path.join(os.path.dirname(os.path.dirname(HERE)), "tf_mpi")]
sys.modules.setdefault("tf_mpi", _pkg)
from tf_mpi import _core  # noqa: E402

SUM = 1
STEPS = 20
COUNTS = os.environ.get("TF_MPI_NEGOTIATION_COUNTS")
# Stall settings for the stall check only: elsewhere a descheduled rank on
# this oversubscribed machine must not turn into partial reports.
STALL = {"TF_MPI_STALL_CHECK_TIME_SECONDS": "1", "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "4"}


def reinit(**env):
    """shutdown() + init() with `env` set (the engine reads its settings at init)."""
    _core.shutdown()
    set_environ(env)
    _core.init()


def rank_list(ranks):
    """As the engine's messages name ranks: "rank 3", "ranks 0, 1, 2"."""
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def expect_error(fn, *words):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        text = str(e)
        assert all(w in text for w in words), (words, text)
        return text
    raise AssertionError(f"no error (expected one mentioning {words})")


def step(name="step.grads"):
    """One training step's gradients as one grouped allreduce: one request, one batch."""
    r, n = _core.rank(), _core.size()
    grads = [np.full(4, r, np.float32), np.arange(3, dtype=np.int64) * (r + 1), np.full((2, 2), 1.0, np.float64)]
    out = _core.grouped_allreduce(grads, SUM, name)
    total = n * (n - 1) // 2
    assert np.all(out[0] == total) and np.all(out[1] == np.arange(3) * (total + n)) and np.all(out[2] == n), out


def count_steps(mode):
    """Messages and bytes of the negotiation per steady-state step on this rank."""
    for _ in range(3):  # warm-up: negotiated in full once, then by cache id
        step()
    # Each snapshot is followed by a barrier outside the engine, so that no
    # rank's next messages (the next step's, a shutdown's) reach a rank that
    # has not taken its snapshot yet: every rank counts exactly these steps.
    before = _core.stats()
    MPI.COMM_WORLD.Barrier()
    for _ in range(STEPS):
        step()
    after = _core.stats()
    MPI.COMM_WORLD.Barrier()
    keys = ["negotiation_msgs_sent", "negotiation_msgs_received", "negotiation_bytes_sent",
            "negotiation_bytes_received"]
    per_step = {k: (after[k] - before[k]) / STEPS for k in keys}
    if COUNTS:
        with open(os.path.join(COUNTS, f"{mode}.rank{_core.rank()}.json"), "w") as f:
            json.dump({"rank": _core.rank(), "size": _core.size(), **per_step}, f)
    return per_step


_core.init()
from mpi4py import MPI  # noqa: E402  (adopts the MPI tf_mpi initialised)
R, N = _core.rank(), _core.size()


def check_tree_messages_per_step():
    assert "negotiation=tree" in _core.config(), _core.config()
    c = count_steps("tree")
    assert c["negotiation_msgs_sent"] > 0 and c["negotiation_msgs_received"] > 0, c


def check_star_messages_per_step():
    reinit(TF_MPI_NEGOTIATION="star")
    try:
        assert "negotiation=star" in _core.config(), _core.config()
        count_steps("star")
    finally:
        reinit(TF_MPI_NEGOTIATION=None)
    assert "negotiation=tree" in _core.config(), _core.config()


def check_results_of_every_collective_through_the_tree():
    for i in range(3):  # first time, then from the cache
        x = np.arange(5, dtype=np.float32) + R
        y = _core.allreduce(x, SUM, "tree.ar")
        assert np.array_equal(y, N * np.arange(5, dtype=np.float32) + N * (N - 1) / 2), y
        g = _core.allgather(np.full((R + 1, 2), R, np.int32), "tree.ag")
        assert np.array_equal(g[:, 0], np.repeat(np.arange(N), np.arange(N) + 1)), g
        b = _core.broadcast(np.full(3, R + i, np.int64), N - 1, "tree.bc")
        assert np.array_equal(b, np.full(3, N - 1 + i)), b


def check_an_allgather_whose_rows_change_on_one_rank():
    # Cached on every rank but the last, which announces in full: the others'
    # cached announcements must still reach rank 0 (a new response).
    for i in range(3):
        rows = R + 1 + (i if R == N - 1 else 0)
        g = _core.allgather(np.full((rows, 1), R, np.int32), "tree.ag.rows")
        want = np.repeat(np.arange(N), [q + 1 + (i if q == N - 1 else 0) for q in range(N)])
        assert np.array_equal(g[:, 0], want), (i, g[:, 0], want)


def check_first_time_mismatch_names_the_ranks():
    shape = 3 if R == N - 1 else 2
    text = expect_error(lambda: _core.allreduce(np.zeros(shape, np.float32), SUM, "tree.mismatch"),
                        "mismatched allreduce 'tree.mismatch'", "shape differs")
    assert f"{rank_list(range(N - 1))}: [2]" in text and f"rank {N - 1}: [3]" in text, text


def check_cached_mismatch_names_the_ranks():
    # Every rank has the entry cached; one deep rank changes its dtype: it
    # announces in full, the others by cache id through the tree.
    for _ in range(2):
        _core.allreduce(np.zeros(2, np.float32), SUM, "tree.cached.mismatch")
    x = np.zeros(2, np.float64 if R == N - 1 else np.float32)
    text = expect_error(lambda: _core.allreduce(x, SUM, "tree.cached.mismatch"), "dtype differs")
    assert f"rank {N - 1}: float64" in text and f"{rank_list(range(N - 1))}: float32" in text, text
    step()


def check_join_by_an_inner_and_a_leaf_rank():
    # Rank N/2 has children (at N >= 4), rank N-1 is a leaf. Both join first;
    # the others run cached allreduces, to which the joined ranks add zeros.
    joiners = {N // 2, N - 1}
    for _ in range(2):
        _core.allreduce(np.ones(3, np.float32) * R, SUM, "tree.join.step")
    if R in joiners:
        last = _core.join()
    else:
        for i in range(3):
            y = _core.allreduce(np.ones(3, np.float32) * R, SUM, "tree.join.step")
            want = sum(q for q in range(N) if q not in joiners)
            assert np.all(y == want), (i, y, want)
        last = _core.join()
    assert last in range(N) and last not in joiners, last
    y = _core.allreduce(np.ones(3, np.float32) * R, SUM, "tree.join.step")
    assert np.all(y == N * (N - 1) / 2), y


def check_stall_names_the_missing_rank():
    reinit(**STALL)
    try:
        _core.allreduce(np.ones(1, np.float32), SUM, "tree.stalled")  # cached from here on
        if R != N - 1:
            start = time.time()
            text = expect_error(lambda: _core.allreduce(np.ones(1, np.float32), SUM, "tree.stalled"),
                                "stalled", f"never submitted by rank {N - 1}")
            assert time.time() - start < 30, (time.time() - start, text)
        else:
            time.sleep(6)
        step("after.stall")
    finally:
        reinit(**{k: None for k in STALL})


def check_one_rank_shutting_down_early():
    # Rank 2 (with a child at N >= 4) leaves; a cached collective it never
    # joins fails on the others, by name of the departed rank, then all start again.
    early = 2 if N > 2 else 1
    _core.allreduce(np.ones(1, np.float32), SUM, "needs.early")
    text = None
    try:
        if R == early:
            _core.shutdown()
        else:
            text = expect_error(lambda: _core.allreduce(np.ones(1, np.float32), SUM, "needs.early"),
                                f"rank {early} called shutdown()")
    finally:
        # Rank 0 stays until every rank has its error: once it shuts down
        # itself, a late announcement would fail with "rank 0 called shutdown()".
        # Every rank starts again, also where the check failed: no rank waits alone in init.
        MPI.COMM_WORLD.Barrier()
        if R != early:
            _core.shutdown()
        _core.init()
    assert R == early or text
    step("after.early.shutdown")


def check_a_stopped_inner_rank_is_declared_unreachable_through_the_tree():
    # Rank 4 (subtree 4..7 at N = 8: children 5 and 6, grandchild 7) or rank 2 (child 3 at N = 4)
    # stops itself while the others wait for it in a cached collective. Rank 0 declares it
    # unreachable; its subtree, which waits for decisions from it, gets that batch from rank 0.
    victim = 4 if N >= 8 else 2 if N > 2 else 1
    timeout_s = 2
    reinit(TF_MPI_PEER_TIMEOUT_SECONDS=timeout_s)
    pids = MPI.COMM_WORLD.allgather(os.getpid())
    world = MPI.COMM_WORLD
    others = world.Create_group(world.Get_group().Excl([victim]))  # collective over the others only
    try:
        _core.allreduce(np.ones(1, np.float32), SUM, "needs.stopped")  # cached from here on
        if R == victim:
            os.kill(os.getpid(), signal.SIGSTOP)
            # Resumed: rank 0 sends it nothing any more, so it finds rank 0 unreachable in turn.
            expect_error(lambda: _core.allreduce(np.ones(1, np.float32), SUM, "needs.stopped.resumed"),
                         "rank 0 is unreachable")
        else:
            start = time.time()
            expect_error(lambda: _core.allreduce(np.ones(1, np.float32), SUM, "needs.stopped"),
                         f"rank {victim} is unreachable")
            assert time.time() - start < timeout_s + 3, time.time() - start
    finally:
        if R != victim:
            others.Barrier()  # rank 0 leaves (below) only once every other rank has its error
            if R == 0:
                os.kill(pids[victim], signal.SIGCONT)
        others.Free() if others != MPI.COMM_NULL else None
        reinit(TF_MPI_PEER_TIMEOUT_SECONDS=None)
    step("after.stopped")


run_checks(globals(), R)
_core.shutdown()
