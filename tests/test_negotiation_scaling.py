"""Negotiation that stays flat as ranks grow (tests/workers/negotiation_worker.py).

One launch per np in (2, 4, 8), oversubscribed on this machine: the same
20-step loop (one grouped allreduce per step, all from the response cache)
with the tree and then the star (TF_MPI_NEGOTIATION), messages counted by the
engine. The busiest rank's messages per steady-state step must grow at most
like log2(N) with the tree; the star, measured in the same launch, grows like
N, so the comparison fails if the tree stops working. The same launches check
results, mismatch errors, join, a stall report and an early shutdown at np=4
and np=8, where the tree differs from the star."""
import json
import math
import os
import tempfile

import pytest

from mpi_harness import assert_check, check_names, shared_launch

WORKER = "negotiation_worker.py"
SIZES = (2, 4, 8)
COUNTS = {n: tempfile.mkdtemp(prefix=f"tfmpi_negotiation_{n}_") for n in SIZES}  # where each launch counts
SOAK_ENV = {"TF_MPI_CACHE_CAPACITY": "4", "TF_MPI_FUSION_THRESHOLD": "65536", "TF_MPI_FUSION_DIRECT_BYTES": "16384",
            "TF_MPI_CHUNK_BYTES": "32768", "TF_MPI_STALL_CHECK_TIME_SECONDS": "20",
            "TF_MPI_STALL_SHUTDOWN_TIME_SECONDS": "60"}


def run_at(n, start=False):
    # Mostly waiting (a stopped rank's peer time-out, stall reports): in the lane of waiting launches.
    return shared_launch(n, WORKER, timeout=300, env={"TF_MPI_NEGOTIATION_COUNTS": COUNTS[n]}, start=start,
                         waiting=True)


def soak_launch(start=False):
    return shared_launch(6, "soak_worker.py", timeout=240, env=SOAK_ENV, args=["--rounds", "40"], start=start)


def prefetch(items):
    # The log2 comparison needs every size; the soak has its own launch.
    for n in SIZES:
        run_at(n, start=True)
    if "test_soak_through_the_tree_at_np6" in {item.originalname for item in items}:
        soak_launch(start=True)


def launch(n):
    """(the run, {mode: {rank: its counters}}) of the launch at np=n."""
    run = run_at(n)
    per_rank = {}
    for name in os.listdir(COUNTS[n]):
        mode, rank = name.split(".rank")
        with open(os.path.join(COUNTS[n], name)) as f:
            per_rank.setdefault(mode, {})[int(rank.split(".")[0])] = json.load(f)
    return run, per_rank


def tree_children(r, n):
    """The binomial tree of cpp/core/negotiation/negotiation_tree.h: r + 2^j for 2^j < lowbit(r) (rank 0: 2^j < n)."""
    span = n if r == 0 else r & -r
    return [r + 2**j for j in range(span.bit_length()) if 2**j < span and r + 2**j < n]


def per_rank_msgs(n, mode):
    run, per_rank = launch(n)
    ranks = per_rank.get(mode, {})
    assert sorted(ranks) == list(range(n)), (mode, sorted(ranks), run.describe())
    return {r: c["negotiation_msgs_sent"] + c["negotiation_msgs_received"] for r, c in ranks.items()}


def busiest(n, mode):
    """Messages (sent + received) per step of the busiest rank, and of rank 0."""
    run, per_rank = launch(n)
    ranks = per_rank.get(mode, {})
    assert sorted(ranks) == list(range(n)), (mode, sorted(ranks), run.describe())
    msgs = {r: c["negotiation_msgs_sent"] + c["negotiation_msgs_received"] for r, c in ranks.items()}
    return max(msgs.values()), msgs[0]


@pytest.mark.parametrize("n", SIZES)
def test_every_check_passes(n):
    run, _ = launch(n)
    for name in check_names(WORKER):
        assert_check(run, n, name)


def test_busiest_rank_messages_grow_like_log2_n_with_the_tree_and_like_n_with_the_star():
    tree = {n: busiest(n, "tree") for n in SIZES}
    star = {n: busiest(n, "star") for n in SIZES}
    assert tree[2][0] > 0 and star[2][0] > 0, (tree, star)
    for n in SIZES[1:]:
        assert tree[n][0] / tree[2][0] <= math.log2(n), (n, tree)
        # Rank 0 takes one report from each child: ceil(log2 N), not N - 1.
        assert tree[n][1] <= 2 * math.ceil(math.log2(n)), (n, tree)
    # Exactly the tree's messages: per step each rank takes one batch from its parent and one
    # report from each child, and sends one report up and one batch to each child.
    for n in SIZES:
        want = {r: 2 * len(tree_children(r, n)) + (2 if r else 0) for r in range(n)}
        assert per_rank_msgs(n, "tree") == want, (n, per_rank_msgs(n, "tree"), want)
    # The contrast: with the star, rank 0 exchanges a message with every rank per step.
    assert star[8][0] / star[2][0] >= 8 - 1, star
    assert star[8][0] / star[2][0] > math.log2(8), star
    assert tree[8][0] < star[8][0], (tree, star)


@pytest.mark.parametrize("n", SIZES[1:])
def test_stall_warning_names_the_missing_rank(n):
    run, _ = launch(n)
    assert_check(run, n, "check_stall_names_the_missing_rank")
    assert f"waiting on rank {n - 1}" in run.output, run.describe()


def test_soak_through_the_tree_at_np6():
    """tests/workers/soak_worker.py (threads, orders that differ per rank, a 4-entry cache so that
    names keep moving between cached and full announcements, join at random points) at np=6,
    where the tree has two levels and an uneven shape: every result exact and identical."""
    run = soak_launch()
    assert_check(run, 6, "check_soak_results_are_exact_and_identical_on_every_rank")
    assert "soak: " in run.output and "stalled" not in run.output, run.describe()
