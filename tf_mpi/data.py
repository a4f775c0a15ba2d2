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
from tf_mpi import basics


def shard(dataset, num_shards=None, index=None):
    """``dataset.shard(size(), rank())``: every rank keeps every size()-th element, starting at its rank.

    Example::

        ds = tf_mpi.data.shard(tf.data.TFRecordDataset(files)).shuffle(10_000).batch(64)
    """
    return dataset.shard(num_shards if num_shards is not None else basics.size(),
                         index if index is not None else basics.rank())


def rank_seed(seed):
    """A per-rank seed derived from a common one (seed * 1000003 + rank).

    Example::

        ds = ds.shuffle(10_000, seed=tf_mpi.data.rank_seed(42))
    """
    return seed * 1000003 + basics.rank()


def shard_arrays(*arrays):
    """This rank's contiguous slice of each array: len // size() rows each.

    The remainder rows are dropped so that all ranks run the same number of
    steps (a rank with one more batch would wait forever in its last step).

    Example::

        x_train, y_train = tf_mpi.data.shard_arrays(x_train, y_train)
    """
    n = len(arrays[0])
    per_rank = n // basics.size()
    start = basics.rank() * per_rank
    out = tuple(a[start:start + per_rank] for a in arrays)
    return out if len(out) > 1 else out[0]
