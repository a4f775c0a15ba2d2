"""Top-k and global top-k (gTop-k) gradient sparsification with error feedback.

Each rank adds its residual (what it did not get reduced before) to its
gradient, keeps the k = ceil(ratio * n) entries of largest magnitude and
sends them as (index, value) pairs:

- ``TopKCompressor``: the pairs of all ranks are allgathered in one
  collective and summed; the result has up to size() * k nonzeros.
- ``GTopKCompressor``: pairs are merged pairwise in log2(size()) rounds of
  recursive doubling (each round one alltoall that sends only to the round's
  partner): both partners sum their two sets and keep the k largest, so after
  the last round every rank holds the same global k entries (Shi et al.,
  "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification
  for Low Bandwidth Networks", 2019). With a size() that is not a power of
  two, P = 2**floor(log2(size())): ranks r >= P first hand their pairs to
  rank r - P, sit out the doubling rounds and get the result back from it.

Error feedback: a rank's residual becomes its accumulated gradient minus the
part of it that made it into the result (for gTop-k, an entry of this rank
that a merge dropped stays in its residual even if the index is selected
later through other ranks). Residuals are variables: DistributedOptimizer
keeps them as optimizer variables (saved by ``model.save`` and
``tf.train.Checkpoint``); with DistributedGradientTape the compressor keeps
them (track the compressor in your ``tf.train.Checkpoint``).

Why these collectives: one allgather of k pairs per rank is one message per
rank per step and (N-1)*8k bytes received per rank with a ring, which beats
log2(N) pairwise rounds of 8k bytes for small N and keeps every rank's
contribution; gTop-k's rounds move 8k*log2(N) bytes per rank however large N
is, which is what makes it the choice for many ranks. Both use tf_mpi's
existing collectives (an alltoall whose splits name only the partner moves
bytes to the partner alone).

All ranks sum the same pairs in the same order (the allgathered buffer is
identical everywhere; a gTop-k merge adds exactly two values, which is
commutative), so the reduced gradient is bitwise identical on every rank.
The sums run on the CPU, whose segment sum adds in input order.

The selection (fused with the residual add), the gTop-k merge and the
residual update are CPU kernels of cpp/tf/topk_select.cc: an exact O(n)
selection (a sampled threshold, one pass collecting candidates, nth_element
on them; tf.math.top_k over |acc| is O(n log k)), and a few passes over
the gradient instead of a dozen. Sets of pairs travel by ascending index; the
merge bookkeeping (which of this rank's entries survived) is kept as index
sets, not dense masks.
"""
import math

import numpy as np
import tensorflow as tf

from tf_mpi import basics, ops
from tf_mpi.basics import Average, Sum
from tf_mpi.policy.variable_identity import variable_key

_INDEX_DTYPE = tf.int32
_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)  # what cpp/tf/topk_select.cc selects from


def _check_ratio(ratio):
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)):
        raise ValueError(f"tf_mpi: compression ratio must be a number in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0) or math.isnan(ratio):
        raise ValueError(f"tf_mpi: compression ratio must be in (0, 1] (the fraction of entries sent), got {ratio}")
    return ratio


def select_topk(acc, k):
    """Indices (int32, ascending) and values of the k entries of `acc` (flattened) with the largest magnitude.

    Ties go to the lower index, so every rank and the numpy reference pick the
    same entries; NaN counts as larger than any magnitude, infinity included
    (a rank holding a non-finite entry sends it: the step's result is then
    non-finite on every rank and the step is skipped). O(n), on the CPU
    (cpp/tf/topk_select.cc).
    """
    with tf.device("/cpu:0"):
        return ops._lib.tf_mpi_topk_select(acc, k=k)


def accumulate_and_select(grad, residual, k):
    """(acc, indices, values): acc = flat(grad + residual) and select_topk(acc, k), in one pass over the data."""
    with tf.device("/cpu:0"):
        return ops._lib.tf_mpi_topk_accumulate(grad, tf.cast(residual, grad.dtype), k=k)


def residual_after(acc, sent):
    """acc with the entries at the indices `sent` and the non-finite entries set to zero."""
    with tf.device("/cpu:0"):
        return ops._lib.tf_mpi_topk_residual(acc, sent)


def merge_topk(a, b, k):
    """Sums two sets of (indices, values) pairs (distinct, ascending indices each) and keeps the k
    largest magnitudes (select_topk's order and ties): the pairs, by ascending index."""
    with tf.device("/cpu:0"):
        return ops._lib.tf_mpi_topk_merge(a[0], a[1], b[0], b[1], k=k)


def _members(a, b):
    """Per entry of the index vector `a`: is it in the ascending index vector `b`?"""
    padded = tf.concat([b, [-1]], 0)  # searchsorted may point one past the end; -1 is no index
    return tf.equal(tf.gather(padded, tf.searchsorted(b, a)), a)


def _intersect(a, b):
    """The entries of the index vector `a` that are also in the ascending index vector `b`, in a's order."""
    return tf.boolean_mask(a, _members(a, b))


_PAIRS = (0, 1)  # fields of a (indices, values) pair that _pack / _unpack carry: both
_INDICES = (0,)
_VALUES = (1,)


def _pack(parts, fields=_PAIRS):
    """Concatenates the chosen fields of (indices, values) pairs of several tensors into one flat uint8 buffer."""
    chunks = [tf.reshape(tf.bitcast(part[f], tf.uint8), [-1]) for part in parts for f in fields]
    return tf.concat(chunks, 0)


def _packed_bytes(layout, fields=_PAIRS):
    """Bytes _pack produces for one set of pairs of `layout`."""
    return sum(k * (_INDEX_DTYPE if f == 0 else dtype).size for k, dtype in layout for f in fields)


def _unpack(buf, layout, fields=_PAIRS):
    """Inverse of _pack for a [rows, bytes] buffer: per tensor, a tuple of [rows * k] tensors, one per field."""
    rows = tf.shape(buf)[0]
    out, offset = [], 0
    for k, dtype in layout:
        parts = []
        for dt in ((_INDEX_DTYPE, dtype)[f] for f in fields):
            width = dt.size
            piece = tf.reshape(buf[:, offset:offset + k * width], [rows * k, width])
            parts.append(tf.bitcast(piece, dt))
            offset += k * width
        out.append(tuple(parts))
    return out


class SparsifyingCompressor(tf.Module):
    """Base of Compression.topk / Compression.gtopk: keeps the k = ceil(ratio * n)
    largest-magnitude entries of each gradient, with error feedback.

    Not a Horovod compress/decompress pair: the reduction itself changes, so
    these work through ``DistributedOptimizer`` and ``DistributedGradientTape``
    only (``allreduce(compression=...)`` raises).

    Example::

        compression = hvd.Compression.topk(0.01)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression)
    """

    sparsifies = True  # the reducer hands whole gradient groups to reduce()

    def __init__(self, ratio, name):
        super().__init__(name=name)
        self.ratio = _check_ratio(ratio)
        # Residuals of the variables this compressor reduced (DistributedGradientTape);
        # a tracked list, so tf.train.Checkpoint(compression=...) saves it.
        self.residuals = []
        self._residual_of = {}  # variable key -> position in self.residuals (not tracked)

    def __repr__(self):
        return f"Compression.{self._kind}({self.ratio})"

    @staticmethod
    def compress(tensor):
        raise ValueError("tf_mpi: top-k / gTop-k compression changes the reduction itself and keeps per-variable "
                         "residuals: use it through DistributedOptimizer(compression=...) or "
                         "DistributedGradientTape(compression=...), not allreduce(compression=...)")

    decompress = compress

    def k(self, num_elements):
        """Entries sent for a tensor of `num_elements`: ceil(ratio * n), at least 1."""
        return max(1, min(int(num_elements), math.ceil(self.ratio * int(num_elements))))

    def build(self, variables):
        """Creates the residuals of `variables` now (outside tf.function), e.g. before restoring a checkpoint.

        Example::

            compression = hvd.Compression.topk(0.01)
            compression.build(model.trainable_variables)
            tf.train.Checkpoint(model=model, compression=compression).restore(path)
        """
        for v in variables:
            self.residual_for(v)

    def residual_for(self, variable):
        """The residual variable kept for `variable` (created zero on first use)."""
        key = variable_key(variable)
        if key not in self._residual_of:
            shape = variable.shape
            with tf.init_scope():
                name = getattr(variable, "path", None) or getattr(variable, "name", "var")
                r = tf.Variable(tf.zeros(shape, tf.as_dtype(variable.dtype)), trainable=False,
                                name="tfmpi_residual/" + str(name).replace(":", "_"))
            self._residual_of[key] = len(self.residuals)
            self.residuals.append(r)
        return self.residuals[self._residual_of[key]]

    def reduce(self, grads, residuals, op=Average, prescale_factor=1.0, postscale_factor=1.0, name="topk"):
        """Sparsified reduction of dense `grads` with error feedback through `residuals` (variables).

        Returns the reduced gradients (dense, the same on every rank) and
        updates each residual to what this rank's contribution left out
        (non-finite entries dropped); a step whose reduced gradients are not
        all finite leaves the residuals unchanged.
        """
        if op not in (Average, Sum):
            raise ValueError("tf_mpi: top-k compression reduces with op=Average or op=Sum")
        with tf.name_scope(self._kind):
            flat, shapes, parts, layout = [], [], [], []
            for g, r in zip(grads, residuals):
                g = tf.convert_to_tensor(g)
                if g.dtype not in _FLOAT_DTYPES:
                    raise ValueError("tf_mpi: top-k compression needs float16, bfloat16, float32 or float64 "
                                     f"gradients, got {g.dtype.name}")
                n = g.shape.num_elements()
                if n is None:
                    raise ValueError("tf_mpi: top-k compression needs gradients of a fully known static shape, "
                                     f"got {g.shape}")
                if n >= 2 ** 31:
                    raise ValueError(f"tf_mpi: top-k compression indexes with int32; a gradient of {n} entries is "
                                     "too large")
                acc, idx, val = accumulate_and_select(g, r, self.k(n))
                if prescale_factor != 1.0:
                    val = val * tf.cast(prescale_factor, val.dtype)
                flat.append(acc)
                shapes.append(g.shape)
                parts.append((idx, val))
                layout.append((self.k(n), g.dtype))
            if not parts:
                return []
            scale = postscale_factor / basics.size() if op == Average else postscale_factor
            with tf.device("/cpu:0"):
                results, finite, included = self._exchange(parts, layout, [a.shape[0] for a in flat], name, scale)
                # A step whose reduced gradients are not all finite (a loss-scale
                # overflow: LossScaleOptimizer skips it) leaves every residual as it
                # was; the results are identical on every rank, so every rank agrees.
                # A non-finite entry this rank did not send is dropped, never carried.
                unsent = [residual_after(acc, keep) for acc, keep in zip(flat, included)]

            def update():
                for res, new, shape in zip(residuals, unsent, shapes):
                    res.assign(tf.cast(tf.reshape(new, shape), res.dtype))

            tf.cond(finite, update, lambda: None)
            return [tf.reshape(dense, shape) for dense, shape in zip(results, shapes)]

    def _exchange(self, parts, layout, sizes, name, scale):
        """(per tensor the reduced dense flat tensor times `scale`, whether every reduced entry is finite
        (before the scale), per tensor the indices of this rank's sent entries that the result includes)."""
        raise NotImplementedError


class TopKCompressor(SparsifyingCompressor):
    """Each rank sends its k largest-magnitude entries; the result is the sum of all ranks' entries.

    One allgather per gradient group; k = ceil(ratio * n) (index, value)
    pairs per rank and tensor, i.e. 8k bytes for float32 instead of 4n.

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.topk(0.01))
    """

    _kind = "topk"

    def _exchange(self, parts, layout, sizes, name, scale):
        gathered = tf.reshape(_mpi().allgather(_pack(parts), name=f"{name}.topk"), [basics.size(), -1])
        results = [tf.math.unsorted_segment_sum(all_val, all_idx, n)
                   for (all_idx, all_val), n in zip(_unpack(gathered, layout), sizes)]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(d)) for d in results])
        if scale != 1.0:
            results = [d * tf.cast(scale, d.dtype) for d in results]
        return results, finite, [idx for idx, _ in parts]  # everything a rank sends is in the sum


class GTopKCompressor(SparsifyingCompressor):
    """Global top-k: every rank ends with the same k entries of the summed sparse gradients.

    log2(size()) rounds of pairwise merges (recursive doubling, each an
    alltoall that sends only to the partner): 8k bytes per rank and round for
    float32. A size() that is not a power of two adds a round before (the
    ranks past the largest power of two hand their pairs to a partner) and one
    after (they get the result back, indices from one rank and values from
    another: 4k bytes more for the senders).

    Example::

        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.gtopk(0.01))
    """

    _kind = "gtopk"

    def _exchange(self, parts, layout, sizes, name, scale):
        n_ranks, me = basics.size(), basics.rank()
        pow2 = 1 << (n_ranks.bit_length() - 1)
        ks = [k for k, _ in layout]
        sets = list(parts)
        # path[t]: the indices (ascending) that survived every merge on this rank's
        # path; None before the first merge (every index).
        path = [None] * len(parts)

        def round_trip(payload, partner, tag, recv_layout):
            """One alltoall in which this rank sends `payload` to `partner` only (or nothing)."""
            splits = [0] * n_ranks
            if partner is not None:
                splits[partner] = payload.shape[0]
            else:
                payload = tf.zeros([0], tf.uint8)
            received, _ = _mpi().alltoall(payload, splits=splits, name=f"{name}.gtopk.{tag}")
            return None if recv_layout is None else _unpack(tf.reshape(received, [1, -1]), recv_layout)

        # Before: ranks past the power of two hand their pairs to rank - pow2.
        if n_ranks > pow2:
            if me >= pow2:
                round_trip(_pack(sets), me - pow2, "pre", None)
            elif me + pow2 < n_ranks:
                other = round_trip(None, None, "pre", layout)
                sets, path = self._merge(sets, other, ks, path)
            else:
                round_trip(None, None, "pre", None)
        # Recursive doubling among the first pow2 ranks.
        for j in range(pow2.bit_length() - 1):
            if me < pow2:
                other = round_trip(_pack(sets), me ^ (1 << j), f"round{j}", layout)
                sets, path = self._merge(sets, other, ks, path)
            else:
                round_trip(None, None, f"round{j}", None)
        # After: the result back to the ranks past the power of two, indices
        # from one rank and values from another, so that a sender pays half a
        # set on top of the doubling rounds instead of a whole one (see
        # _result_senders).
        if n_ranks > pow2:
            sets, path = self._hand_back(sets, path, layout, pow2, f"{name}.gtopk.post")
        # The result has only the k pairs: its finiteness and its scale are theirs.
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for _, v in sets])
        if scale != 1.0:
            sets = [(i, v * tf.cast(scale, v.dtype)) for i, v in sets]
        results = [tf.scatter_nd(i[:, None], v, [n]) for (i, v), n in zip(sets, sizes)]
        included = [idx if p is None else _intersect(idx, p) for (idx, _), p in zip(parts, path)]
        return results, finite, included

    @staticmethod
    def _result_senders(extra, n_ranks, pow2):
        """(index sender, value sender) of the result for rank `extra` >= pow2.

        The index sender is `extra`'s partner (extra - pow2), whose path
        `extra` shares: it sends the k indices, each complemented where that
        path dropped it. Every rank below pow2 holds the same k pairs after
        the doubling rounds, so the values can come from another one: with
        r = n_ranks - pow2 extra ranks, rank (extra - pow2 + r) mod pow2,
        which is not a partner while r <= pow2 / 2 and never `extra`'s own.
        """
        r = n_ranks - pow2
        return extra - pow2, (extra - pow2 + r) % pow2

    def _hand_back(self, sets, path, layout, pow2, name):
        """The final alltoall: ranks past pow2 receive indices and values from their two senders."""
        n_ranks, me = basics.size(), basics.rank()
        splits, payload = [0] * n_ranks, []
        for extra in range(pow2, n_ranks):  # destinations in rank order, as alltoall concatenates them
            index_sender, value_sender = self._result_senders(extra, n_ranks, pow2)
            if me == index_sender:
                marked = [(i if p is None else tf.where(_members(i, p), i, tf.bitwise.invert(i)), v)
                          for (i, v), p in zip(sets, path)]
                payload.append(_pack(marked, _INDICES))
                splits[extra] += _packed_bytes(layout, _INDICES)
            if me == value_sender:
                payload.append(_pack(sets, _VALUES))
                splits[extra] += _packed_bytes(layout, _VALUES)
        payload = tf.concat(payload, 0) if payload else tf.zeros([0], tf.uint8)
        received, _ = _mpi().alltoall(payload, splits=splits, name=name)
        if me < pow2:
            return sets, path
        # Received in source rank order: the index half and the value half.
        index_sender, value_sender = self._result_senders(me, n_ranks, pow2)
        cut = _packed_bytes(layout, _INDICES if index_sender < value_sender else _VALUES)
        first, second = received[:cut], received[cut:]
        index_bytes, value_bytes = (first, second) if index_sender < value_sender else (second, first)
        marked = _unpack(tf.reshape(index_bytes, [1, -1]), layout, _INDICES)
        values = _unpack(tf.reshape(value_bytes, [1, -1]), layout, _VALUES)
        sets = [(tf.where(i < 0, tf.bitwise.invert(i), i), v) for (i,), (v,) in zip(marked, values)]
        path = [tf.boolean_mask(j, i >= 0) for (i,), (j, _) in zip(marked, sets)]
        return sets, path

    @staticmethod
    def _merge(mine, other, ks, path):
        """Sums two sets of pairs per tensor and keeps the k largest; the same on both partners."""
        merged = [merge_topk(a, b, k) for a, b, k in zip(mine, other, ks)]
        new_path = [i if p is None else _intersect(p, i) for (i, _), p in zip(merged, path)]
        return merged, new_path


def _mpi():
    return ops
