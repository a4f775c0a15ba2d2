"""Helpers built on the collectives: variables, Python objects, barrier.

Python objects are serialized with cloudpickle. Unpickling runs code chosen by
the sender: use these helpers only among the ranks of one trusted job.

The object helpers talk to the engine directly (numpy buffers, no TensorFlow
op), so they work the same eagerly and in a TF1 graph; Horovod's ``session``
argument, the Session its graph-mode ops run in, is accepted and not needed.
"""
import io

import cloudpickle
import numpy as np
import tensorflow as tf

from tf_mpi import basics, process_sets
from tf_mpi._unused_arguments import warn_unused_argument
from tf_mpi.basics import _check_process_set
from tf_mpi.ops import grouped_broadcast


def _read(variable):
    """The current value of a tf.Variable (resource or ref) or Keras 3 Variable as a tensor."""
    if hasattr(variable, "read_value"):
        return variable.read_value()
    return tf.convert_to_tensor(variable)


def _as_op(assigned):
    if isinstance(assigned, tf.Operation):
        return assigned
    return getattr(assigned, "op", assigned)


def _assign_broadcast(variables, root_rank, name, process_set=None):
    """Broadcasts `variables` from root_rank (one collective) and assigns; returns the assignments."""
    if name is None and tf.executing_eagerly():
        name = "tfmpi.broadcast_variables"  # graphs use the op's (unique) node name
    values = grouped_broadcast([_read(v) for v in variables], root_rank, name=name, process_set=process_set)
    return [v.assign(value) for v, value in zip(variables, values)]


def broadcast_variables(variables, root_rank, process_set=None, inplace=False, *, name=None):
    """Assigns root_rank's values to `variables` on every rank (one collective).

    As in Horovod, eagerly this assigns at once and returns None; in graph
    mode (a TF1 Session, or inside ``tf.function``) it returns the op that
    does it. ``process_set`` is Horovod's (root_rank is a global rank);
    ``inplace=True`` gives the same result (Horovod's in-place variant saves
    a temporary copy; tf_mpi always broadcasts into one, and warns once).
    ``name`` (keyword only, a tf_mpi addition) names the collective.

    Example::

        hvd.broadcast_variables(model.variables, root_rank=0)
    """
    _check_process_set(process_set, "broadcast_variables")
    if inplace:
        warn_unused_argument("broadcast_variables", "inplace",
                             "tf_mpi broadcasts into a temporary and assigns it; the variables get root_rank's "
                             "values either way")
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    assigned = _assign_broadcast(variables, root_rank, name, process_set)
    if tf.executing_eagerly():
        return None
    return tf.group(*[_as_op(a) for a in assigned])


def broadcast_(variables, root_rank, name=None, process_set=None):
    """In-place broadcast (Horovod's ``hvd.broadcast_``): assigns root_rank's values to
    ``variables`` and returns those values (tensors, one per variable).

    Works eagerly, inside ``tf.function`` and in a TF1 graph (resource and
    ref variables), for every dtype the collectives support. ``process_set``
    as in ``broadcast_variables``.

    Example::

        values = hvd.broadcast_([w, b], root_rank=0)   # w and b now hold rank 0's values
    """
    _check_process_set(process_set, "broadcast_")
    variables = list(variables)
    if not variables:
        return []
    assigned = _assign_broadcast(variables, root_rank, name, process_set)
    if tf.executing_eagerly():
        return [_read(v) for v in variables]
    with tf.control_dependencies([_as_op(a) for a in assigned]):
        return [tf.identity(_read(v)) for v in variables]


def broadcast_global_variables(root_rank):
    """Broadcasts every global variable of the default graph from root_rank (TF1-style graph scripts).

    Returns the op to run, as Horovod does. Eagerly there are no global
    variables: use ``broadcast_variables(model.variables, root_rank)``.

    Example::

        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(hvd.broadcast_global_variables(0))
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; use "
                           "hvd.broadcast_variables(<model/optimizer variables>, root_rank) instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def _dumps(obj):
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return np.frombuffer(buf.getvalue(), np.uint8)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=None):
    """Returns root_rank's `obj` on every rank (any picklable Python object).

    As in Horovod, root_rank gets `obj` itself back, the others an unpickled
    copy. ``session`` (Horovod's TF1 Session) is accepted and not needed:
    the object goes through the engine directly, eagerly or in a graph.
    With ``process_set`` only its ranks take part (root_rank is a global rank).

    Example::

        config = hvd.broadcast_object(config if hvd.rank() == 0 else None, root_rank=0)
    """
    set_id = _check_process_set(process_set, "broadcast_object")
    root = process_sets.set_rank_of(set_id, root_rank)
    name = name or "tfmpi.broadcast_object"
    if basics.rank() == root_rank:
        payload = _dumps(obj)
        basics._core.broadcast(np.array([payload.size], np.int64), root, name + ".len", set_id)
        basics._core.broadcast(payload, root, name + ".data", set_id)
        return obj
    length = basics._core.broadcast(np.zeros(1, np.int64), root, name + ".len", set_id)
    data = basics._core.broadcast(np.zeros(int(length[0]), np.uint8), root, name + ".data", set_id)
    return cloudpickle.loads(data.tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=None):
    """Decorator: run the function on root_rank only and broadcast its result.

    Parameters as Horovod's ``broadcast_object_fn`` (``session`` is not needed,
    see ``broadcast_object``), but it decorates a function: Horovod's returns a
    function that broadcasts the object it is given.

    Example::

        @hvd.broadcast_object_fn(root_rank=0)
        def read_vocabulary():
            return open("vocab.txt").read().split()
    """
    _check_process_set(process_set, "broadcast_object_fn")

    def decorator(fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs) if basics.rank() == root_rank else None
            return broadcast_object(result, root_rank, name=name or f"tfmpi.broadcast_object_fn.{fn.__name__}",
                                    process_set=process_set)
        return wrapped
    return decorator


def allgather_object(obj, session=None, name=None, process_set=None):
    """Returns the list of every rank's `obj`, in rank order (unpickled copies, this rank's too).

    ``session`` (Horovod's TF1 Session) is accepted and not needed, as for
    ``broadcast_object``; with ``process_set``, the objects of its ranks, in their order.

    Example::

        counts = hvd.allgather_object(len(my_shard))   # [n0, n1, ...]
    """
    set_id = _check_process_set(process_set, "allgather_object")
    name = name or "tfmpi.allgather_object"
    payload = _dumps(obj)
    lengths = basics._core.allgather(np.array([payload.size], np.int64), name + ".len", set_id)
    data = basics._core.allgather(payload, name + ".data", set_id)
    out, offset = [], 0
    for n in lengths:
        out.append(cloudpickle.loads(data[offset:offset + int(n)].tobytes()))
        offset += int(n)
    return out


def barrier(name="tfmpi.barrier", process_set=None):
    """Returns once every rank (of ``process_set``, default all) has called barrier().

    Example::

        if hvd.rank() == 0:
            prepare_shared_files()
        hvd.barrier()   # the others wait until rank 0 is done
    """
    set_id = _check_process_set(process_set, "barrier")
    basics._core.allreduce(np.zeros(1, np.int32), basics.Sum, name, 1.0, 1.0, set_id)
