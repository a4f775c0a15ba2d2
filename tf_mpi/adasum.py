"""Adasum: the adaptive summation of gradients (Maleki et al., 2021), as Horovod reduces with it.

Two gradients ``a`` and ``b`` combine into::

    (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

which is their sum when they are orthogonal and their average when they are
equal: it adds what is new in each and averages what they share. ``N`` ranks
(a power of two) combine in a binary tree, in rank order: ranks 0 and 1, 2
and 3, ... first, then the pairs' results, and so on (the order of Horovod's
vector-halving, distance-doubling exchange, whose level ``k`` combines blocks
of ``2**k`` consecutive ranks). Each tensor has its own coefficients, also
when several are reduced together. Dot products and norms are computed in
float64; each level's result is rounded to the tensor's dtype, as a buffer of
that dtype holds it between levels. A coefficient is 1 where a norm is below
sqrt(DBL_MIN) (a zero gradient).

This module computes the combination from every rank's tensors; the caller
(``tf_mpi.ops``) brings them with one grouped allgather, so every rank
computes the same tree on the same inputs and gets the same result. That
moves ``N`` times a tensor's bytes to each rank (a ring allreduce moves
about 2x): meant for the small rank counts of one or a few nodes, not a
replacement for Horovod's bandwidth-optimal exchange at scale.

Example::

    combine([tf.constant([1.0, 0.0]), tf.constant([0.0, 2.0])])   # orthogonal: the sum, [1.0, 2.0]
    combine([tf.constant([1.0, 2.0]), tf.constant([1.0, 2.0])])   # equal: the average, [1.0, 2.0]
"""
import math

import numpy as np
import tensorflow as tf

__all__ = ["check_size", "check_dtype", "combine"]

DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
# Below this squared norm a gradient counts as zero and keeps coefficient 1 (Horovod's threshold).
_TINY_NORM_SQ = math.sqrt(np.finfo(np.float64).tiny)


def check_size(size):
    """Adasum reduces over a power-of-two number of ranks (Horovod's rule for CPU tensors)."""
    if size < 1 or size & (size - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")


def check_dtype(dtype):
    if tf.as_dtype(dtype) not in DTYPES:
        raise ValueError(f"tf_mpi: Adasum reduces float16, bfloat16, float32 and float64 tensors; got {dtype!r}")


def _coefficient(dot, norm_sq):
    return tf.where(norm_sq >= _TINY_NORM_SQ, 1.0 - 0.5 * dot / tf.maximum(norm_sq, _TINY_NORM_SQ),
                    tf.ones_like(dot))


def _combine_pair(a, b):
    a64, b64 = tf.cast(a, tf.float64), tf.cast(b, tf.float64)
    dot = tf.reduce_sum(a64 * b64)
    out = _coefficient(dot, tf.reduce_sum(a64 * a64)) * a64 + _coefficient(dot, tf.reduce_sum(b64 * b64)) * b64
    return tf.cast(out, a.dtype)


def combine(per_rank):
    """The Adasum of ``per_rank`` (one tensor per rank, in rank order; a power of two of them)."""
    check_size(len(per_rank))
    level = list(per_rank)
    while len(level) > 1:
        level = [_combine_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]
