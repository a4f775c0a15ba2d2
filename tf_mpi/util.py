"""Helpers at Horovod's module path ``horovod.tensorflow.util``.

Horovod's own scripts and tests import ``_executing_eagerly`` from there.

Example::

    from tf_mpi.util import _executing_eagerly
    _executing_eagerly()   # True in TF2 eager code, False inside tf.function or a tf.Graph
"""
import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly():
    """Whether TensorFlow runs eagerly here (False while a graph is being built)."""
    return tf.executing_eagerly()
