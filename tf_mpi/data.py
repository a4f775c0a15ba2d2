"""Sharding input pipelines by rank.

Each rank should see a different part of the data. Shard *before* shuffling
and augmenting, so that every sample is read by exactly one rank; shuffle with
a seed that differs per rank (or the same seed after sharding: the shards
already differ) and reshuffle each epoch.

Example::

    ds = tf.data.TFRecordDataset(files)
    ds = tf_mpi.data.shard(ds)                     # this rank's 1/size of the records
    ds = ds.shuffle(10_000, seed=tf_mpi.data.rank_seed(42), reshuffle_each_iteration=True)
    ds = ds.batch(per_rank_batch).prefetch(tf.data.AUTOTUNE)
"""
import numpy as np

from tf_mpi import basics


def shard(dataset, num_shards=None, index=None, skip=0):
    """``dataset.skip(skip).shard(size(), rank())``: every rank keeps every size()-th element, starting at its rank.

    ``size()`` and ``rank()`` are read when it is called: after the ranks changed (elastic
    training) call it again. ``skip``: elements of this epoch the job has trained on already
    (e.g. an elastic state's count of samples since the epoch began): the remaining ones are
    shared among the ranks there are now, so no sample is seen twice in the epoch. Element ``i``
    of the rest goes to rank ``i % size()``, so with equal per-rank batches a job that has taken
    ``k`` steps has consumed exactly the first ``k * size() * batch`` elements.

    Example::

        ds = tf_mpi.data.shard(tf.data.TFRecordDataset(files)).shuffle(10_000).batch(64)
        ds = tf_mpi.data.shard(ds_in_epoch_order, skip=state.samples_done).batch(64)   # elastic
    """
    if skip:
        dataset = dataset.skip(skip)
    return dataset.shard(num_shards if num_shards is not None else basics.size(),
                         index if index is not None else basics.rank())


def rank_seed(seed):
    """A per-rank seed derived from a common one (seed * 1000003 + rank).

    Example::

        ds = ds.shuffle(10_000, seed=tf_mpi.data.rank_seed(42))
    """
    return seed * 1000003 + basics.rank()


def shard_arrays(*arrays, batch_size=None, skip=0):
    """This rank's share of each array's rows, the same number of rows on every rank.

    By default a contiguous slice: len // size() rows each. The remainder rows are dropped so that
    all ranks run the same number of steps (a rank with one more batch would wait forever in its
    last step).

    With ``batch_size`` (the per-rank batch of ``fit``), rows are dealt out a global batch at a
    time instead: step ``k`` of every rank trains on rows ``[k*size()*batch_size, (k+1)*size()*batch_size)``
    of the arrays (rank ``r`` on its ``batch_size`` of them), so the job consumes the rows in
    order and, after ``k`` steps, has trained on exactly the first ``k*size()*batch_size``. That is
    what elastic training needs: after the ranks changed call it again with ``skip`` = the rows of
    this epoch already trained on, and the rest is shared among the ranks there are now (no row
    twice in the epoch). Only whole global batches are kept.

    ``size()`` and ``rank()`` are read when it is called.

    Example::

        x_train, y_train = tf_mpi.data.shard_arrays(x_train, y_train)
        xs, ys = tf_mpi.data.shard_arrays(x, y, batch_size=64, skip=state.samples_done)   # elastic
        model.fit(xs, ys, batch_size=64, shuffle=False)
    """
    size, rank = basics.size(), basics.rank()
    rest = tuple(a[skip:] for a in arrays)
    n = len(rest[0])
    if batch_size is None:
        per_rank = n // size
        start = rank * per_rank
        out = tuple(a[start:start + per_rank] for a in rest)
    else:
        if batch_size <= 0:
            raise ValueError(f"shard_arrays: batch_size must be positive, not {batch_size}")
        steps = n // (size * batch_size)
        rows = (np.arange(steps)[:, None] * size * batch_size + rank * batch_size
                + np.arange(batch_size)[None, :]).reshape(-1)
        out = tuple(a[rows] for a in rest)
    return out if len(out) > 1 else out[0]
