"""Sparse (``tf.IndexedSlices``) gradients: how an Embedding's gradient crosses the ranks.

A gradient of a table of ``V`` rows (an Embedding's, a ``tf.gather``'s) comes
as ``tf.IndexedSlices``: one row per looked-up id, so an id that occurs k
times in a batch is k rows. Four ways to reduce it (``sparse=`` of
``DistributedOptimizer`` / ``DistributedGradientTape``):

``"allgather"``
    Every rank's rows, duplicates included, are allgathered; the result is an
    ``IndexedSlices`` of all of them (Horovod's behaviour). Bytes received per
    rank: ``(N - 1) * n * (row + index)`` for ``n`` rows per rank.
``"dense"``
    Each rank densifies its rows into a ``V``-row tensor, which is allreduced
    with the other dense gradients (Horovod's ``sparse_as_dense=True``). Bytes:
    those of a ``V * row`` allreduce, whatever the batch.
``"dedup"``
    Each rank first sums its duplicate rows (``tf.unique`` +
    ``unsorted_segment_sum``: ``u <= n`` unique rows), the ranks allgather the
    ``u`` unique indices (early: they depend on the input ids only, not on
    backprop) and then the ``u`` summed rows, and every rank adds the
    ``T = sum of u over ranks`` rows into one row per touched index. The
    result is an ``IndexedSlices`` with each touched row once (``U <= T``
    rows), in the order the rows first occur in rank 0's, then rank 1's, ...
    indices. Bytes received per rank: ``(T - u) * (row + index)``. An
    optimizer that applies ``IndexedSlices`` as a sparse update (Keras' SGD
    without momentum, Adagrad, ...) then touches ``U`` rows; one that keeps
    moments (Adam, ...) densifies it (Keras' Adam: twice).
``"auto"``
    Per tensor and per step, ``"dedup"``'s exchange or a dense allreduce,
    whichever the cost model (``choose_dedup``, ``dedup_threshold``) says is
    faster for this step's ``T``; the result is dense either way (the
    deduplicated rows are written into the table with one ``scatter_nd``),
    which is what optimizers with moments want. ``T`` is the length of the
    allgathered index list, the same number on every rank, so every rank
    takes the same branch without another collective.

Exactness: ``"dedup"``, ``"auto"`` and ``"dense"`` give the same sums up to
the order of the additions (and, for Average, where the division by ``N``
happens: on each rank's summed rows before the exchange, instead of on the
sum). The result is bit-identical on every rank: each rank adds the same
gathered rows in the same order (rank 0's first), with one scatter per rank
whose positions are unique, so no two updates of one scatter touch the same
element. Because each row occurs once, an optimizer that squares the
gradient (Adam) sees ``(g1 + g2)**2`` as with a dense gradient, where
``"allgather"``'s duplicates give ``g1**2 + g2**2``.

Example::

    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3), sparse="auto")
"""
import os
import time
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

MODES = ("allgather", "dense", "dedup", "auto")
# What DistributedOptimizer / DistributedGradientTape do when neither sparse=
# nor sparse_as_dense is given. "allgather" is Horovod's behaviour;
# docs/sparse-gradients.md has the measurements behind keeping it.
DEFAULT_MODE = "allgather"


def resolve_mode(sparse, sparse_as_dense):
    """The sparse-gradient mode from the ``sparse=`` and Horovod's ``sparse_as_dense=`` arguments.

    ``sparse=None`` means ``"dense"`` with ``sparse_as_dense=True`` (as in
    Horovod) and ``DEFAULT_MODE`` otherwise; ``sparse_as_dense=True`` together
    with another ``sparse=`` is an error.

    Example: ``resolve_mode(None, True)`` is ``"dense"``; ``resolve_mode("auto", False)`` is ``"auto"``
    """
    if sparse is None:
        return "dense" if sparse_as_dense else DEFAULT_MODE
    if not isinstance(sparse, str) or sparse not in MODES:
        raise ValueError(f"tf_mpi: sparse= must be one of {', '.join(repr(m) for m in MODES)}; got {sparse!r}")
    if sparse_as_dense and sparse != "dense":
        raise ValueError(f"tf_mpi: sparse_as_dense=True asks for sparse='dense', but sparse={sparse!r} was given; "
                         "pass only one of them")
    return sparse


@dataclass
class SparseCostModel:
    """Costs that decide between a dense allreduce and the deduplicated exchange, in seconds per byte.

    ``allreduce_beta``: an allreduce, per byte of the tensor;
    ``allgather_beta``: an allgather, per byte of the gathered result;
    ``scatter_gamma``: what the deduplicated exchange does with the gathered
    rows on this rank (add them into one row per index, write those into the
    table), per byte of gathered rows. Every rank holds rank 0's values.

    Example::

        costs = SparseCostModel(allreduce_beta=1e-9, allgather_beta=0.5e-9, scatter_gamma=0.2e-9)
        costs.dedup_threshold        # 1.43: dedup while T < 1.43 * V
    """
    allreduce_beta: float
    allgather_beta: float
    scatter_gamma: float

    @property
    def dedup_threshold(self):
        """``T / V`` below which the deduplicated exchange is expected to be faster (see ``choose_dedup``)."""
        return self.allreduce_beta / (self.allgather_beta + self.scatter_gamma)


# (rows, width, table_rows) -> SparseCostModel, the latest used last. No `global` rebinding:
# measure_costs runs while AutoGraph traces a training step.
_costs = {}


def _fastest(fn, repeats):
    """The fastest of `repeats` timed calls of fn, after one warm-up call: on a shared machine the
    slow samples measure the neighbours."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def measure_costs(rows=4096, width=128, repeats=7, table_rows=None):
    """Measures the SparseCostModel (collective: call on every rank, e.g. while tracing).

    Each cost is timed through the TensorFlow ops the two branches of
    ``"auto"`` run, eagerly, fastest of `repeats`: an allreduce of a
    ``table_rows x width`` float32 tensor (default ``2 * rows`` rows) against
    a small one; an allgather of ``rows x width`` per rank against a small
    one; adding ``rows`` gathered rows into one row each and writing those
    into the table, less the table's zero fill (which the dense branch's
    densification pays too). Rank 0's values are broadcast so that every
    rank decides alike. Cached per process and arguments.

    Example::

        costs = tf_mpi.policy.sparse.measure_costs()   # on every rank
        print(f"dedup pays while touched rows < {costs.dedup_threshold:.2f} x table rows")
    """
    table_rows = 2 * rows if table_rows is None else max(int(table_rows), rows)
    key = (rows, width, table_rows)
    if key in _costs:
        _costs[key] = _costs.pop(key)  # now the latest
        return _costs[key]
    from tf_mpi import ops
    from tf_mpi.basics import Sum, _core
    size = _core.size()
    with tf.init_scope():  # measured eagerly, also when called while a tf.function is traced
        def timed(fn, *args):
            fn = tf.function(fn)
            return _fastest(lambda: fn(*args).numpy(), repeats)

        small = tf.ones([1, width], tf.float32)
        gathered, table = tf.ones([rows, width], tf.float32), tf.ones([table_rows, width], tf.float32)
        t_reduce = {n: timed(lambda x: ops.allreduce(x, op=Sum, name=f"tfmpi.sparsecost.reduce{n}")[0, 0], x)
                    for n, x in (("small", small), ("table", table))}
        t_gather = {n: timed(lambda x: ops.allgather(x, name=f"tfmpi.sparsecost.gather{n}")[0, 0], x)
                    for n, x in (("small", small), ("rows", gathered))}
        rng = np.random.default_rng(0)
        positions = tf.constant(rng.permutation(rows)[:, None], tf.int32)
        where = tf.constant(rng.permutation(table_rows)[:rows, None], tf.int64)
        shape = tf.constant([table_rows, width], tf.int64)
        # The shape is an argument, so that grappler cannot fold the zero fill into a constant.
        t_fill = timed(lambda s: tf.zeros(s, tf.float32)[0, 0], shape)
        t_rows = timed(lambda v, s: tf.scatter_nd(
            where, tf.tensor_scatter_nd_add(tf.zeros_like(v), positions, v), s)[0, 0], gathered, shape)
    row_bytes = 4.0 * width
    allreduce_beta = max((t_reduce["table"] - t_reduce["small"]) / (max(table_rows - 1, 1) * row_bytes), 1e-13)
    allgather_beta = max((t_gather["rows"] - t_gather["small"]) / (max(rows - 1, 1) * row_bytes * size), 1e-13)
    scatter_gamma = max((t_rows - t_fill) / (rows * row_bytes), 1e-13)
    shared = _core.broadcast(np.array([allreduce_beta, allgather_beta, scatter_gamma], np.float64), 0,
                             "tfmpi.sparsecost.share")
    _costs[key] = SparseCostModel(*(float(v) for v in shared))
    return _costs[key]


def measured_costs():
    """The SparseCostModel this process measured last, or None before ``measure_costs`` ran (no collective).

    Example: ``costs = tf_mpi.policy.sparse.measured_costs()`` after a training step with ``sparse="auto"``
    """
    return next(reversed(_costs.values()), None)


def dedup_threshold(table_shape=None):
    """``T / V`` below which ``"auto"`` deduplicates, the same on every rank (collective: call on every rank).

    ``TF_MPI_SPARSE_DEDUP_THRESHOLD`` if set (e.g. ``0`` always allreduces
    dense, ``1e9`` always deduplicates; read at every trace), else
    ``measure_costs(...).dedup_threshold``, measured with a table of
    ``table_shape`` (rows, width) where given (the costs per byte depend on
    the sizes: caches). Rank 0's value is used everywhere.

    Example: ``TF_MPI_SPARSE_DEDUP_THRESHOLD=0.5 python -m tf_mpi.run -np 4 python train.py``
    """
    from tf_mpi.basics import _core
    env = os.environ.get("TF_MPI_SPARSE_DEDUP_THRESHOLD", "").strip()
    if not env:
        if table_shape is None or len(table_shape) != 2:
            return measure_costs().dedup_threshold
        table_rows, width = (int(d) for d in table_shape)
        return measure_costs(rows=max(table_rows // 4, 1), width=width, table_rows=table_rows).dedup_threshold
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"tf_mpi: TF_MPI_SPARSE_DEDUP_THRESHOLD must be a number (touched rows / table rows), "
                         f"got {env!r}") from None
    return float(_core.broadcast(np.array([value], np.float64), 0, "tfmpi.sparse.threshold")[0])


def choose_dedup(total_rows, table_rows, threshold):
    """A scalar bool tensor: whether the deduplicated exchange is expected to beat a dense allreduce.

    Both branches add this rank's ``n`` rows once (into ``V`` rows, or into
    its ``u`` unique rows), fill one table-sized tensor (the dense branch's
    densification, the dedup branch's final ``scatter_nd``) and pay one
    collective start-up, so those terms cancel. What differs, per byte
    of a row: the dense branch allreduces ``V`` rows (``allreduce_beta * V``);
    the dedup branch allgathers ``T`` rows and adds them into the result
    (``(allgather_beta + scatter_gamma) * T``). Deduplicate while
    ``T < threshold * V`` (``threshold``: ``dedup_threshold()``). ``total_rows``
    (T) and ``table_rows`` (V) are the same on every rank, so is the choice.

    Example: ``tf.cond(choose_dedup(T, 20000, dedup_threshold()), exchange, allreduce)``
    """
    return tf.cast(total_rows, tf.float64) < tf.constant(threshold, tf.float64) * tf.cast(table_rows, tf.float64)


def _sum_in_rank_order(gathered_rows, positions, counts, unique_count, size):
    """The rows of every rank added into ``unique_count`` rows at ``positions``, rank 0's first.

    One scatter per rank: a rank's positions are unique (its indices were
    deduplicated before the exchange), so no two updates of one scatter meet,
    and every row receives its additions in rank order, on every rank and
    device (a single segment sum over all ranks' rows would let a GPU add
    colliding rows in any order)."""
    rows = tf.split(gathered_rows, counts, num=size)
    where = tf.split(positions, counts, num=size)
    width = tf.shape(gathered_rows, out_type=tf.int64)[1:]
    summed = tf.zeros(tf.concat([tf.reshape(unique_count, [1]), width], 0), gathered_rows.dtype)
    for r, p in zip(rows, where):
        summed = tf.tensor_scatter_nd_add(summed, p[:, None], r)
    return summed


def _check_slices(grad, mode):
    if grad.values.dtype not in (tf.float32, tf.float16, tf.bfloat16, tf.float64):
        raise TypeError(f"tf_mpi: sparse={mode!r} reduces float gradients; got {grad.values.dtype.name} IndexedSlices")
    if grad.dense_shape is None:
        raise ValueError(f"tf_mpi: sparse={mode!r} needs the IndexedSlices' dense_shape (the table's shape)")


def reduce_indexed_slices(grad, mode, name, size, scale=1.0, dense_allreduce=None, threshold=None):
    """Reduces one IndexedSlices gradient with mode "dedup" or "auto".

    "dedup" returns a ``tf.IndexedSlices`` whose indices are the touched rows,
    each once, in the order they first occur in rank 0's, then rank 1's, ...
    indices, and whose values are the rows summed over ranks in rank order:
    the same on every rank. "auto" returns a dense tensor (the dense
    allreduce, or the deduplicated rows written into a table-sized tensor).

    Args:
      grad: the tf.IndexedSlices (float32, float16 or bfloat16 values).
      mode: "dedup" (always the deduplicated exchange) or "auto" (dedup or
        ``dense_allreduce``, by ``choose_dedup``).
      name: prefix of the collectives' names (equal on every rank).
      size: number of ranks.
      scale: multiplies each rank's summed rows before the exchange (1/size
        for Average, times any pre/postscale factors).
      dense_allreduce: (dense tensor, name) -> reduced tensor, the dense
        branch of "auto" (it applies its own averaging and scaling).
      threshold: ``choose_dedup``'s threshold for "auto" (default:
        ``dedup_threshold`` of the table's static shape, a collective on
        first use).

    Example::

        reduced = reduce_indexed_slices(grad, "dedup", "emb", hvd.size(), scale=1.0 / hvd.size())
    """
    from tf_mpi import ops
    if mode not in ("dedup", "auto"):
        raise ValueError(f"tf_mpi: reduce_indexed_slices takes mode 'dedup' or 'auto', got {mode!r}")
    _check_slices(grad, mode)
    values = grad.values
    dense_shape = tf.cast(grad.dense_shape, tf.int64)
    # Indices first: they depend on the input ids only, so their exchange (and
    # the global deduplication) can run while backprop is still computing the rows.
    unique, position = tf.unique(tf.cast(grad.indices, tf.int64))
    count = tf.shape(unique, out_type=tf.int64)[:1]
    gathered_indices, counts = ops.grouped_allgather([unique, count], name=f"{name}.indices")

    def exchange():
        """(each touched index once, in rank order; its row summed over ranks)."""
        touched, touched_position = tf.unique(gathered_indices)
        rows = tf.math.unsorted_segment_sum(values, position, count[0])
        if scale != 1.0:
            rows = rows * tf.cast(scale, rows.dtype)
        gathered_rows = ops.allgather(rows, name=f"{name}.rows")
        touched_count = tf.shape(touched, out_type=tf.int64)[0]
        return touched, _sum_in_rank_order(gathered_rows, touched_position, counts, touched_count, size)

    if mode == "dedup":
        touched, summed = exchange()
        return tf.IndexedSlices(summed, touched, grad.dense_shape)

    def exchange_dense():
        touched, summed = exchange()
        # touched holds each row once: the scatter is a plain write, no two updates meet.
        return tf.scatter_nd(touched[:, None], summed, dense_shape)

    def allreduce():
        dense = tf.math.unsorted_segment_sum(values, tf.cast(grad.indices, tf.int64), dense_shape[0])
        return dense_allreduce(dense, f"{name}.dense")

    if threshold is None:
        threshold = dedup_threshold(tf.get_static_value(grad.dense_shape))
    decide = choose_dedup(tf.shape(gathered_indices)[0], dense_shape[0], threshold)
    return _with_static_shape(tf.cond(decide, exchange_dense, allreduce), grad)


def _with_static_shape(result, grad):
    """`result` with the table's shape where tracing knows it (tf.cond and a dense_shape tensor hide it)."""
    static = tf.get_static_value(grad.dense_shape)
    if static is not None:
        result.set_shape(static)
    return result
