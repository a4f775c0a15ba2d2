"""Helpers built on the collectives: variables, Python objects, barrier.

Python objects are serialized with cloudpickle. Unpickling runs code chosen by
the sender: use these helpers only among the ranks of one trusted job.
"""
import io

import cloudpickle
import numpy as np

from tf_mpi import basics
from tf_mpi.ops import grouped_broadcast


def broadcast_variables(variables, root_rank, name="tfmpi.broadcast_variables"):
    """Assigns root_rank's values to `variables` on every rank (one collective).

    Example::

        hvd.broadcast_variables(model.variables, root_rank=0)
    """
    variables = list(variables)
    if not variables:
        return
    values = grouped_broadcast(variables, root_rank, name=name)
    for v, value in zip(variables, values):
        v.assign(value)


def broadcast_(variables, root_rank, name="tfmpi.broadcast_"):
    """In-place broadcast (Horovod's ``hvd.broadcast_``): like broadcast_variables; returns the variables."""
    broadcast_variables(variables, root_rank, name)
    return variables


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
    """Returns once every rank has called barrier()."""
    basics._core.allreduce(np.zeros(1, np.int32), basics.Sum, name)
