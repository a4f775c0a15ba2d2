"""TensorFlow collectives backed by the tf_mpi engine (custom C++ ops).

Every function works in eager mode, inside ``tf.function`` and in a TF1 graph.
Collectives are matched across ranks by name: give concurrent collectives
distinct names (the default, the op's node name inside a graph, is unique per
graph). The signatures are Horovod's (names, order and defaults of
``horovod.tensorflow`` 0.28.1); ``process_set`` accepts only the global set
(``None``, the default), as tf_mpi has no process sets.
"""
import contextlib
import os

import numpy as np
import tensorflow as tf

from tf_mpi import adasum, basics, process_sets
from tf_mpi.basics import Average, Sum, Min, Max, Product, Adasum, ReduceOp, _check_process_set
from tf_mpi.codecs import NoneCompressor

_lib = tf.load_op_library(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtfmpi_tf.so"))

# Op types whose order inside a tf.function only their data inputs decide.
_ORDER_FREE_OPS = ("TfMpiAllreduce", "TfMpiGroupedAllreduce", "TfMpiAllgather", "TfMpiBroadcast",
                   "TfMpiAlltoall", "TfMpiReducescatter")


def _let_collectives_run_in_dependency_order():
    """Stops tf.function from chaining our collectives in program order.

    The ops are stateful (so grappler never constant-folds, merges or prunes a
    collective on one rank only), and tf.function's automatic control
    dependencies run every stateful op without resource inputs after the
    previous one. For collectives that is a serial chain: a gradient's
    allreduce waits for the one written before it, nothing fuses, nothing
    overlaps (a 214-tensor ResNet-50 step ran as 214 one-tensor MPI calls).
    The engine negotiates the order across ranks itself, so the chain buys no
    safety. TensorFlow's own collectives avoid the chain through the lists in
    auto_control_deps; we join MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS, whose
    ops still always run (control outputs of the function) but in any order.
    """
    from tensorflow.python.framework import auto_control_deps as acd  # no public API for this
    current = getattr(acd, "MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS", None)
    if not isinstance(current, frozenset):
        tf.get_logger().warning(
            "tf_mpi: this TensorFlow has no auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS; "
            "collectives inside tf.function will run one after another (correct, but without fusion or overlap)")
        return
    acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = current | frozenset(_ORDER_FREE_OPS)


_let_collectives_run_in_dependency_order()


def _keep_autograph_out_of_tf_mpi():
    """Tells AutoGraph to call tf_mpi's Python code as it is, as it does for TensorFlow's and Keras'.

    A user's ``tf.function`` is converted by AutoGraph, and by default so is every function it
    calls from a package AutoGraph does not know: the tape's gradient, the reducer, the sparse
    handling and the compression codecs, about 240 functions parsed and rewritten per trace (three
    tape steps, dense, top-k and gTop-k, traced and run twice each: 8.7 s at np=2 on a loaded
    2-core machine, 0.7 s with tf_mpi left alone). tf_mpi's code needs no conversion: it decides in Python only on static facts
    (shapes, dtypes, settings) and builds its graph-side conditions with tf.cond itself.
    Functions of the user's own that tf_mpi calls (a custom compressor) are then called as they
    are too, as inside Keras. There is no public API for a package-wide rule (only a decorator per
    function), so this adds to AutoGraph's list of packages it does not convert.
    """
    try:
        from tensorflow.python.autograph.core import config  # no public API for this
        rule = config.DoNotConvert("tf_mpi")
        if not any(isinstance(r, config.DoNotConvert) and r.matches("tf_mpi") for r in config.CONVERSION_RULES):
            config.CONVERSION_RULES = (rule,) + tuple(config.CONVERSION_RULES)
    except (ImportError, AttributeError, TypeError) as e:
        tf.get_logger().warning(f"tf_mpi: cannot keep AutoGraph from converting tf_mpi's code ({e}); "
                                "tf.functions that call tf_mpi will take longer to trace (correct all the same)")


_keep_autograph_out_of_tf_mpi()

_VALID_OPS = (Average, Sum, Min, Max, Product, Adasum)


def _check_op(op):
    # A bool is an int (True == Sum): refuse it rather than reduce with the op it happens to equal.
    if isinstance(op, bool) or op not in _VALID_OPS:
        raise ValueError(f"tf_mpi: op must be one of Average, Sum, Min, Max, Product, Adasum; got {op!r} "
                         "(the deprecated flag is average=True / False)")


def _name(name):
    return "" if name is None else str(name)


def _check_not_xla():
    """tf_mpi's kernels have no XLA implementation; say so at trace time."""
    from tensorflow.python.ops import control_flow_util
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "tf_mpi collectives cannot run inside an XLA-compiled function (jit_compile=True). Keras 3 "
            "compiles train_step with XLA by default when a GPU is visible: pass jit_compile=False to "
            "model.compile(), or drop jit_compile=True from your tf.function.")


def _allreduce(tensor, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None, process_set_id=0):
    """The raw op: one dense tensor, no compression."""
    _check_not_xla()
    return _lib.tf_mpi_allreduce(tensor, reduce_op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, tensor_name=_name(name),
                                 process_set_id=process_set_id)


def _resolve_op(op, average):
    """The op of an allreduce: Horovod's rule for its deprecated ``average`` flag (second
    parameter), except that a ReduceOp there is tf_mpi's earlier ``allreduce(x, hvd.Sum)``
    (op second), kept working. Horovod would read it as a truthy or falsy ``average``; no
    Horovod script relies on that, as its Average is 0 and its Sum 1."""
    if isinstance(average, ReduceOp):
        if op is not None:
            raise ValueError("tf_mpi: the op is given twice (second positional argument and op=)")
        op, average = average, None
    return basics._resolve_average(op, average, stacklevel=4)


def _op_in_device_slot(device_dense, op):
    """reducescatter's second parameter is Horovod's ``device_dense``; a ReduceOp there is
    tf_mpi's earlier ``reducescatter(x, hvd.Sum)`` (op second). Returns (device_dense, op)."""
    if isinstance(device_dense, ReduceOp):
        if op not in (Average, device_dense):
            raise ValueError("tf_mpi: the op is given twice (second positional argument and op=)")
        return "", device_dense
    return device_dense, op


def _on_device(device):
    """``tf.device(device)`` for Horovod's device_dense / device_sparse arguments ('' places nothing)."""
    return tf.device(device) if device else contextlib.nullcontext()


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=NoneCompressor, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=None, ignore_name_scope=False):
    """Reduces ``tensor`` over all ranks; every rank gets the result.

    The parameters are Horovod's, in Horovod's order; tf_mpi's earlier
    ``allreduce(x, hvd.Sum)`` (a reduce op in second place) still means ``op``.

    Args:
      tensor: a ``tf.Tensor`` (uint8, int8, uint16, int16, int32, int64,
        float16, bfloat16, float32, float64) or ``tf.IndexedSlices`` (then
        values and indices are allgathered, as Horovod does; op must be
        Average or Sum, and Average divides the values by size() with true
        division, so integer values come back as floats).
      average: deprecated Horovod flag; ``True`` means ``op=Average``, ``False``
        ``op=Sum`` (an error together with ``op``).
      device_dense / device_sparse: devices for dense / IndexedSlices inputs
        (Horovod's arguments; '' leaves placement to TensorFlow).
      compression: ``Compression.none`` or ``Compression.fp16``.
      op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or
        ``Adasum`` (floating-point tensors, a power-of-two number of ranks;
        see tf_mpi.adasum). Integer averages are truncated toward zero.
      prescale_factor / postscale_factor: multiply before / after the reduction.
      name: matches this collective across ranks; defaults to the op's name.
      process_set: ``None`` or ``global_process_set`` (all ranks), or a registered
        ``ProcessSet`` (tf_mpi.process_sets): the ranks of that set reduce among
        themselves and Average divides by its size. Adasum takes the global set
        only (NotImplementedError otherwise, as Horovod).
      ignore_name_scope: accepted for Horovod compatibility (``name`` is used as given).

    Example::

        hvd.init()
        x = tf.constant([1.0, 2.0]) * (hvd.rank() + 1)
        hvd.allreduce(x, op=hvd.Sum)   # on 2 ranks: [3.0, 6.0] everywhere
    """
    op = _resolve_op(op, average)
    _check_op(op)
    set_id = _check_process_set(process_set, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        with _on_device(device_sparse):
            return _allreduce_indexed_slices(tensor, op, name, prescale_factor, postscale_factor, set_id)
    with _on_device(device_dense):
        tensor = tf.convert_to_tensor(tensor)
        compressed, ctx = compression.compress(tensor)
        if op == Adasum:
            reduced = _adasum_allreduce([compressed], prescale_factor, postscale_factor, name, set_id)[0]
        else:
            reduced = _allreduce(compressed, op, prescale_factor, postscale_factor, name, set_id)
        return compression.decompress(reduced, ctx)


def _adasum_allreduce(tensors, prescale_factor, postscale_factor, name, process_set_id=0):
    """Adasum of each tensor over all ranks (tf_mpi.adasum), from one grouped allgather of them.

    Its gradient is the Adasum of the incoming gradients, as Horovod's allreduce gradient is
    the same reduction of the gradient."""
    if process_set_id != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    for t in tensors:
        adasum.check_dtype(t.dtype)
    n = basics.size()
    adasum.check_size(n)

    @tf.custom_gradient
    def reduce(*xs):
        scaled = [_scale(x, prescale_factor) for x in xs]
        if n == 1:
            combined = scaled
        else:
            gathered = grouped_allgather([tf.expand_dims(x, 0) for x in scaled],
                                         name=None if name is None else f"{name}.adasum")
            combined = [adasum.combine(tf.unstack(g, num=n)) for g in gathered]
        out = [_scale(c, postscale_factor) for c in combined]

        def grad(*upstream):
            return _adasum_allreduce(list(upstream), prescale_factor, postscale_factor,
                                     None if name is None else f"{name}.grad")
        return out, grad
    return reduce(*tensors)


def _scale(x, factor):
    """x * factor; integers are scaled in float64 and truncated, as the engine does."""
    if factor == 1.0:
        return x
    if x.dtype.is_floating:
        return x * tf.cast(factor, x.dtype)
    return tf.cast(tf.cast(x, tf.float64) * factor, x.dtype)


def _allreduce_indexed_slices(slices, op, name, prescale_factor, postscale_factor, process_set_id=0):
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a workaround "
                                  "please pass sparse_as_dense=True to DistributedOptimizer")
    if op not in (Average, Sum):
        raise NotImplementedError("tf_mpi: IndexedSlices can only be reduced with op=Average or op=Sum")
    # Scale factors on IndexedSlices are a tf_mpi extension (Horovod raises NotImplementedError).
    # Both scalings act element by element, so each rank applies them to its own rows before the
    # allgather: the same bits as scaling the gathered rows, with 1/size() of the work per rank.
    values = _scale(slices.values, prescale_factor * postscale_factor)
    if op == Average:
        # Horovod: true division by size(), so integer values become floating point. The size is
        # read when the step runs (an op), not when it is traced: elastic jobs change it.
        values = values / tf.cast(size_op(process_set_id), values.dtype)
    # Values and indices travel as one grouped allgather: one negotiation and one collective per
    # gradient instead of two (the indices come from the input ids; gathered on their own they were
    # negotiated early in the step, while the ranks still computed the forward pass).
    values, indices = _allgather([values, slices.indices],
                                 name=None if name is None else f"{name}.slices", process_set_id=process_set_id)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=NoneCompressor,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None, ignore_name_scope=False,
                      name=None):
    """Reduces a list of tensors as one unit: negotiated together, fused per
    dtype, completed together. Dtypes may be mixed (Horovod needs one dtype).

    Arguments are those of ``allreduce`` (in Horovod's order for
    ``grouped_allreduce``: ``name`` last); IndexedSlices members are
    allgathered, dense members reduced together.

    Example::

        grads = hvd.grouped_allreduce([g1, g2, g3], op=hvd.Average)
    """
    op = _resolve_op(op, average)
    _check_op(op)
    set_id = _check_process_set(process_set, "grouped_allreduce")
    tensors = list(tensors)
    if not tensors:
        return []
    dense_idx = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out = [None] * len(tensors)
    with _on_device(device_sparse):
        for i, t in enumerate(tensors):
            if isinstance(t, tf.IndexedSlices):
                out[i] = _allreduce_indexed_slices(t, op, None if name is None else f"{name}.{i}",
                                                   prescale_factor, postscale_factor, set_id)
    if dense_idx and op == Adasum:
        with _on_device(device_dense):
            pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense_idx]
            reduced = _adasum_allreduce([p[0] for p in pairs], prescale_factor, postscale_factor, name, set_id)
            for i, r, (_, ctx) in zip(dense_idx, reduced, pairs):
                out[i] = compression.decompress(r, ctx)
    elif dense_idx:
        _check_not_xla()
        with _on_device(device_dense):
            pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense_idx]
            reduced = _lib.tf_mpi_grouped_allreduce([p[0] for p in pairs], reduce_op=op,
                                                    prescale_factor=prescale_factor,
                                                    postscale_factor=postscale_factor, tensor_name=_name(name),
                                                    process_set_id=set_id)
            for i, r, (_, ctx) in zip(dense_idx, reduced, pairs):
                out[i] = compression.decompress(r, ctx)
    return out


def allgather(tensor, name=None, ignore_name_scope=False, process_set=None):
    """Concatenates each rank's ``tensor`` along dimension 0 (which may differ per rank).

    Example::

        hvd.allgather(tf.fill([hvd.rank() + 1], hvd.rank()))  # 2 ranks: [0, 1, 1]
    """
    set_id = _check_process_set(process_set, "allgather")
    return _allgather([tf.convert_to_tensor(tensor)], name, set_id)[0]


def _allgather(tensors, name=None, process_set_id=0):
    """The raw op."""
    _check_not_xla()
    return _lib.tf_mpi_allgather(tensors, tensor_name=_name(name), process_set_id=process_set_id)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=None):
    """Returns root_rank's ``tensor`` on every rank.

    Example::

        w = hvd.broadcast(w, root_rank=0)
    """
    set_id = _check_process_set(process_set, "broadcast")
    return _broadcast([tf.convert_to_tensor(tensor)], root_rank, name, set_id)[0]


def _broadcast(tensors, root_rank, name=None, process_set_id=0):
    """The raw op; ``root_rank`` is a global rank (Horovod's rule, also in process sets)."""
    _check_not_xla()
    return _lib.tf_mpi_broadcast(tensors, root_rank=process_sets.set_rank_of(process_set_id, root_rank),
                                 tensor_name=_name(name), process_set_id=process_set_id)


def grouped_broadcast(tensors, root_rank, name=None, ignore_name_scope=False, process_set=None):
    """Broadcasts a list of tensors (any dtypes) from root_rank as one collective
    (a tf_mpi addition; its parameters are those of ``broadcast``).

    Example::

        values = hvd.grouped_broadcast([w.value() for w in model.weights], root_rank=0)
    """
    set_id = _check_process_set(process_set, "grouped_broadcast")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    return _broadcast(tensors, root_rank, name, set_id)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=None):
    """Sends ``splits[j]`` rows of ``tensor`` (in order) to rank j and returns what the others sent here.

    As in Horovod, the result is the received tensor alone when ``splits`` is
    None (dim 0 is then divided equally and must divide evenly), and the pair
    ``(received, received_splits)`` when ``splits`` is given. ``received``
    concatenates what each rank sent to this one, in rank order;
    ``received_splits[j]`` (int32, as Horovod's) is the number of rows that
    came from rank j.

    Example::

        # 2 ranks, rank r sends [r, r] to rank 0 and [10 + r] to rank 1
        out, counts = hvd.alltoall(tf.constant([r, r, 10 + r]), splits=[2, 1])
        # rank 0: [0, 0, 1, 1], counts [2, 2];  rank 1: [10, 11], counts [1, 1]
        same = hvd.alltoall(tf.constant([r, r]))  # equal split, tensor only: [0, 1] on both ranks
    """
    set_id = _check_process_set(process_set, "alltoall")
    _check_not_xla()
    if splits is None:
        splits_t = tf.zeros([0], tf.int64)
    else:
        splits_t = tf.convert_to_tensor(splits)
        if not splits_t.dtype.is_integer:
            raise ValueError(f"tf_mpi: alltoall splits must be integers, got {splits_t.dtype.name}")
        splits_t = tf.cast(splits_t, tf.int64)
    out, received = _lib.tf_mpi_alltoall(tf.convert_to_tensor(tensor), splits_t, tensor_name=_name(name),
                                         process_set_id=set_id)
    # The kernel counts rows in int64; Horovod's op outputs int32 received splits.
    return out if splits is None else (out, tf.cast(received, tf.int32))


def reducescatter(tensor, device_dense="", compression=NoneCompressor, op=Average, name=None, process_set=None,
                  ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` over ranks and gives each rank a slice of the result along dim 0.

    Rank r gets rows [r*q + min(r, m), ...) of q = rows // size, the first m = rows % size ranks
    one row more. ``op`` is Average or Sum. The parameters are Horovod's, in Horovod's order;
    tf_mpi's earlier ``reducescatter(x, hvd.Sum)`` (a reduce op in second place) still means ``op``.

    Example::

        part = hvd.reducescatter(tf.ones([4, 2]), op=hvd.Sum)  # 2 ranks: a [2, 2] tensor of 2.0 each
    """
    device_dense, op = _op_in_device_slot(device_dense, op)
    _check_process_set(process_set, "reducescatter")
    return grouped_reducescatter([tensor], device_dense=device_dense, compression=compression, op=op,
                                 process_set=process_set, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, name=name)[0]


def grouped_reducescatter(tensors, device_dense="", compression=NoneCompressor, op=Average, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0, name=None):
    """reducescatter of several tensors (dtypes may differ) negotiated as one unit.

    Horovod's parameters in Horovod's order, then tf_mpi's ``name`` (Horovod's
    ``grouped_reducescatter`` has none).

    Example::

        a, b = hvd.grouped_reducescatter([tf.ones([4, 2]), tf.ones([2])], op=hvd.Sum)
    """
    device_dense, op = _op_in_device_slot(device_dense, op)
    set_id = _check_process_set(process_set, "grouped_reducescatter")
    if isinstance(op, bool) or op not in (Average, Sum):
        raise ValueError("tf_mpi: reducescatter supports op=Average or op=Sum")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    _check_not_xla()
    with _on_device(device_dense):
        pairs = [compression.compress(t) for t in tensors]
        reduced = _lib.tf_mpi_reducescatter([p[0] for p in pairs], reduce_op=op, prescale_factor=prescale_factor,
                                            postscale_factor=postscale_factor, tensor_name=_name(name),
                                            process_set_id=set_id)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=None):
    """allgather of several tensors negotiated as one unit.

    Example::

        a, b = hvd.grouped_allgather([tf.ones([hvd.rank() + 1, 2]), tf.zeros([1])])
    """
    set_id = _check_process_set(process_set, "grouped_allgather")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    return _allgather(tensors, name, set_id)


def join():
    """Waits until every rank has called join(), meanwhile standing in for this
    rank in the others' collectives: zeros into their allreduces (Average then
    divides by the ranks that contributed) and no rows into their allgathers.
    Returns the last rank to join, as an int32 scalar tensor (Horovod's op).

    Use it when ranks have different numbers of batches, so that the ranks
    with more data do not wait forever for the ones that ran out. It is an op:
    it waits each time it runs, eagerly, inside ``tf.function`` (every call of
    the function) and in a TF1 graph (every ``Session.run`` that fetches it).
    Inside ``tf.function`` it runs after the collectives written before it.

    Example::

        for batch in my_shard:          # shards of different lengths
            train_step(batch)
        last = int(hvd.join())
    """
    _check_not_xla()
    # A numpy_function runs _join_now when the op runs: eagerly in the caller's thread, in a graph
    # on one of TensorFlow's threads. The binding releases the GIL while the engine's join waits,
    # so this process's other Python threads and TensorFlow's kernels go on, and the engine's own
    # thread keeps serving the other ranks' collectives.
    if tf.executing_eagerly():
        return tf.numpy_function(_join_now, [], tf.int32, stateful=True, name="TfMpiJoin")
    # In a graph, a TfMpiSize op runs first: it fails with FailedPreconditionError before init(),
    # as Horovod's join op does (an exception of _join_now would reach the caller as UnknownError).
    before = [_lib.tf_mpi_size()]
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "building_function", False):
        # tf.function runs its stateful ops in program order, except our collectives (they run in
        # dependency order, see above). A join that overtook a collective written before it would
        # leave that collective to be matched after the other ranks had completed it without this
        # one; Horovod's join runs in program order, so it waits for them.
        before += [op for op in graph.get_operations() if op.type in _ORDER_FREE_OPS]
    with tf.control_dependencies(before):
        last = tf.numpy_function(_join_now, [], tf.int32, stateful=True, name="TfMpiJoin")
    last.set_shape([])
    return last


def _join_now():
    if not basics.is_initialized():  # the error class a collective raises before init()
        raise tf.errors.FailedPreconditionError(None, None,
                                                "tf_mpi has not been initialized; call tf_mpi.init() first")
    return np.int32(basics._core.join())


def rank_op(name=None):
    """This rank as an int32 scalar op (for graphs).

    Example: ``is_root = tf.equal(hvd.rank_op(), 0)`` (inside a TF1 graph or ``tf.function``)
    """
    return _lib.tf_mpi_rank(name=name)


def _for_process_set(global_value, value, name):
    """``value`` (a Python int) as an int32 op that, like ``global_value``, fails at run time before
    ``init()`` (FailedPreconditionError), as Horovod's op does."""
    return tf.add(tf.zeros_like(global_value), value, name=name)


def size_op(process_set_id=0, name=None):
    """Number of ranks (of process set ``process_set_id``) as an int32 scalar op, evaluated when the graph runs.

    ``process_set_id`` is Horovod's: 0 is the global set (all ranks); a
    registered set answers its size (also on ranks outside it), an unknown id
    Horovod's code -3.

    Example: ``mean = hvd.allreduce(x, op=hvd.Sum) / tf.cast(hvd.size_op(), x.dtype)``
    """
    if isinstance(process_set_id, str):  # tf_mpi's earlier size_op(name): ids are ints, so no clash
        process_set_id, name = 0, process_set_id
    if process_set_id == 0:
        return _lib.tf_mpi_size(name=name)
    if process_sets.included(process_set_id) == process_sets.UNKNOWN_SET:
        return _for_process_set(_lib.tf_mpi_size(), process_sets.UNKNOWN_SET, name)
    return _for_process_set(_lib.tf_mpi_size(), process_sets.set_size(process_set_id), name)


def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank belongs to process set ``process_set_id``, else 0, as an int32 scalar op.

    As Horovod's: 1 for the global set (id 0); Horovod's unknown-set code -3
    for an id that is not registered; a FailedPreconditionError when run before
    ``init()``.

    Example: ``included = hvd.process_set_included_op()  # 1 on every rank``
    """
    return _for_process_set(_lib.tf_mpi_size(), process_sets.included(process_set_id), name)


def local_rank_op(name=None):
    """Local rank (rank among this node's processes) as an int32 scalar op.

    Example: ``first_on_node = tf.equal(hvd.local_rank_op(), 0)``
    """
    return _lib.tf_mpi_local_rank(name=name)


def local_size_op(name=None):
    """Local size (processes on this node) as an int32 scalar op.

    Example: ``per_node = tf.cast(hvd.local_size_op(), tf.float32)``
    """
    return _lib.tf_mpi_local_size(name=name)


# ---- gradients: reduce the incoming gradient the way the forward op reduced its input.
# As Horovod defines it for every op: for Min, Max and Product too, the upstream gradient is
# reduced with the forward op (not the derivative of a min / max / product; Horovod's choice).

@tf.RegisterGradient("TfMpiAllreduce")
def _allreduce_grad(op, grad):
    return _allreduce(grad, op.get_attr("reduce_op"), op.get_attr("prescale_factor"),
                      op.get_attr("postscale_factor"), process_set_id=op.get_attr("process_set_id"))


@tf.RegisterGradient("TfMpiGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    grads = [tf.zeros_like(x) if g is None else g for g, x in zip(grads, op.inputs)]
    return _lib.tf_mpi_grouped_allreduce(grads, reduce_op=op.get_attr("reduce_op"),
                                         prescale_factor=op.get_attr("prescale_factor"),
                                         postscale_factor=op.get_attr("postscale_factor"),
                                         process_set_id=op.get_attr("process_set_id"))


def _differentiable(t):
    return t.dtype.is_floating or t.dtype.is_complex


def _upstream(grads, outputs):
    """The incoming gradients as dense tensors (zeros where TensorFlow passed None)."""
    return [tf.zeros_like(y) if g is None else tf.convert_to_tensor(g) for g, y in zip(grads, outputs)]


# The gradients below follow Horovod's definitions (horovod/tensorflow/mpi_ops.py),
# which are not all the plain derivative of the sum of every rank's loss:
#   broadcast:     allreduce(Average) of the upstream gradient on root_rank, zeros elsewhere;
#   allgather:     allreduce(Average) of the upstream gradient, then this rank's rows;
#   reducescatter: allgather of the upstream gradient, times size() for op=Sum.
# Every rank submits the same collectives, whatever its rank (no rank-dependent branches).
# Each runs in the process set of the forward op (size() and rank() are the set's).

def _averaged_upstream(op, grads):
    """(indices of op's differentiable inputs, the Average over the process set of their upstream
    gradients, one grouped allreduce): the first step of the broadcast and allgather gradients."""
    idx = [i for i, x in enumerate(op.inputs) if _differentiable(x)]
    if not idx:
        return idx, []
    upstream = _upstream([grads[i] for i in idx], [op.outputs[i] for i in idx])
    return idx, _lib.tf_mpi_grouped_allreduce(upstream, reduce_op=Average,
                                              process_set_id=op.get_attr("process_set_id"))


@tf.RegisterGradient("TfMpiAllgather")
def _allgather_grad(op, *grads):
    xs = list(op.inputs)
    out = [None] * len(xs)
    idx, averaged = _averaged_upstream(op, grads)
    if not idx:
        return out
    set_id = op.get_attr("process_set_id")
    rows = _lib.tf_mpi_allgather([tf.shape(xs[i], out_type=tf.int64)[:1] for i in idx], process_set_id=set_id)
    me = rank_op() if set_id == 0 else process_sets.set_rank_of(set_id, basics.rank(), "rank")
    for i, g, r in zip(idx, averaged, rows):
        begin = tf.concat([[tf.reduce_sum(r[:me])], tf.zeros([tf.rank(g) - 1], tf.int64)], 0)
        out[i] = tf.slice(g, begin, tf.shape(xs[i], out_type=tf.int64))
    return out


@tf.RegisterGradient("TfMpiAlltoall")
def _alltoall_grad(op, grad, _):
    # Send each gradient row back to where its forward row came from.
    if grad is None:
        grad = tf.zeros_like(op.outputs[0])
    back, _ = _lib.tf_mpi_alltoall(grad, op.outputs[1], process_set_id=op.get_attr("process_set_id"))
    return back, None


@tf.RegisterGradient("TfMpiReducescatter")
def _reducescatter_grad(op, *grads):
    reduce_op, set_id = op.get_attr("reduce_op"), op.get_attr("process_set_id")
    scale = op.get_attr("prescale_factor") * op.get_attr("postscale_factor")
    if reduce_op == Sum:
        scale *= process_sets.set_size(set_id)
    gathered = _lib.tf_mpi_allgather(_upstream(grads, op.outputs), process_set_id=set_id)
    return [_scale(g, scale) for g in gathered]


@tf.RegisterGradient("TfMpiBroadcast")
def _broadcast_grad(op, *grads):
    out = [None] * len(op.inputs)
    idx, averaged = _averaged_upstream(op, grads)
    if not idx:
        return out
    set_id = op.get_attr("process_set_id")
    root = op.get_attr("root_rank")   # the set's own rank of the root
    keep = (basics.rank() == root) if set_id == 0 else process_sets.set_rank_of(set_id, basics.rank(), "rank") == root
    for i, g in zip(idx, averaged):
        # Multiplying (as Horovod does) keeps the allreduce a data input of what
        # the caller fetches, so graph optimisation cannot drop it on non-root ranks.
        out[i] = g if keep else g * tf.zeros([], g.dtype)
    return out
