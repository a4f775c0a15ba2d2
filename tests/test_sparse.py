"""Sparse (IndexedSlices) gradients, tf_mpi.policy.sparse: the deduplicated exchange against the dense
reduction and a numpy reference ("dedup"'s IndexedSlices: each touched row once, in rank order;
duplicates inside and across ranks, an empty rank, every row touched;
float32/float16/bfloat16; Sum and Average), bit-identical results on every rank, the
cost-based choice identical on every rank with both branches forced, Keras model.fit and
DistributedGradientTape with an Embedding against one-rank training on the global batch, and
clear errors for bad arguments. One launch per world size runs every check of
tests/workers/sparse_worker.py, as a section of the launch of that size that other modules' workers
join (mpi_harness.joint_launch). The exchange's numbers and the tape's one-rank match are checked at
every world size; model.fit over the same exchange, at np=2 only.
"""
import pytest

from mpi_harness import BOUNDED_STALL_ENV, assert_check, joint_launches_by_np, prefetch_by_np

WORKER = "sparse_worker.py"
# Keras fit over the exchange: the tape check covers the world sizes the fit would repeat.
launch = joint_launches_by_np("sparse", WORKER, (2, 3), env=BOUNDED_STALL_ENV,
                              only_at={"check_fit_with_embedding_matches_one_rank_on_the_global_batch": (2,)})

prefetch = prefetch_by_np(launch)


@pytest.mark.parametrize("np", [2, 3])
def test_launch_exits_cleanly(np):
    launch(np).assert_clean_exit()


@pytest.mark.parametrize("np,check", launch.cases)
def test_sparse(np, check):
    assert_check(launch(np), np, check)
