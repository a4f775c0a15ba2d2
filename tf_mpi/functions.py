"""Helpers built on the collectives: variables, Python objects, barrier.

Python objects are serialized with cloudpickle. Unpickling runs code chosen by
the sender: use these helpers only among the ranks of one trusted job.
"""
import io

import cloudpickle
import numpy as np
import tensorflow as tf

from tf_mpi import basics
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


def _assign_broadcast(variables, root_rank, name):
    """Broadcasts `variables` from root_rank (one collective) and assigns; returns the assignments."""
    if name is None and tf.executing_eagerly():
        name = "tfmpi.broadcast_variables"  # graphs use the op's (unique) node name
    values = grouped_broadcast([_read(v) for v in variables], root_rank, name=name)
    return [v.assign(value) for v, value in zip(variables, values)]


def broadcast_variables(variables, root_rank, name=None):
    """Assigns root_rank's values to `variables` on every rank (one collective).

    As in Horovod, eagerly this assigns at once and returns None; in graph
    mode (a TF1 Session, or inside ``tf.function``) it returns the op that
    does it.

    Example::

        hvd.broadcast_variables(model.variables, root_rank=0)
    """
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    assigned = _assign_broadcast(variables, root_rank, name)
    if tf.executing_eagerly():
        return None
    return tf.group(*[_as_op(a) for a in assigned])


def broadcast_(variables, root_rank, name=None):
    """In-place broadcast (Horovod's ``hvd.broadcast_``): assigns root_rank's values to
    ``variables`` and returns those values (tensors, one per variable).

    Works eagerly, inside ``tf.function`` and in a TF1 graph (resource and
    ref variables), for every dtype the collectives support.

    Example::

        values = hvd.broadcast_([w, b], root_rank=0)   # w and b now hold rank 0's values
    """
    variables = list(variables)
    if not variables:
        return []
    assigned = _assign_broadcast(variables, root_rank, name)
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


def broadcast_object(obj, root_rank=0, name=None):
    """Returns root_rank's `obj` on every rank (any picklable Python object).

    Example::

        config = hvd.broadcast_object(config if hvd.rank() == 0 else None, root_rank=0)
    """
    name = name or "tfmpi.broadcast_object"
    payload = _dumps(obj) if basics.rank() == root_rank else np.zeros(0, np.uint8)
    length = basics._core.broadcast(np.array([payload.size], np.int64), root_rank, name + ".len")
    if basics.rank() != root_rank:
        payload = np.zeros(int(length[0]), np.uint8)
    data = basics._core.broadcast(payload, root_rank, name + ".data")
    return cloudpickle.loads(data.tobytes())


def broadcast_object_fn(root_rank=0, name=None):
    """Decorator: run the function on root_rank only and broadcast its result.

    Example::

        @hvd.broadcast_object_fn(root_rank=0)
        def read_vocabulary():
            return open("vocab.txt").read().split()
    """
    def decorator(fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs) if basics.rank() == root_rank else None
            return broadcast_object(result, root_rank, name or f"tfmpi.broadcast_object_fn.{fn.__name__}")
        return wrapped
    return decorator


def allgather_object(obj, name=None):
    """Returns the list of every rank's `obj`, in rank order.

    Example::

        counts = hvd.allgather_object(len(my_shard))   # [n0, n1, ...]
    """
    name = name or "tfmpi.allgather_object"
    payload = _dumps(obj)
    lengths = basics._core.allgather(np.array([payload.size], np.int64), name + ".len")
    data = basics._core.allgather(payload, name + ".data")
    out, offset = [], 0
    for n in lengths:
        out.append(cloudpickle.loads(data[offset:offset + int(n)].tobytes()))
        offset += int(n)
    return out


def barrier(name="tfmpi.barrier"):
    """Returns once every rank has called barrier().

    Example::

        if hvd.rank() == 0:
            prepare_shared_files()
        hvd.barrier()   # the others wait until rank 0 is done
    """
    basics._core.allreduce(np.zeros(1, np.int32), basics.Sum, name)
