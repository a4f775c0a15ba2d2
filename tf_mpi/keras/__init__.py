"""Keras 3 integration: ``import tf_mpi.keras as hvd`` is all a training script needs.

It offers everything ``tf_mpi`` exports (``init``, ``rank``, ...) plus
Horovod's Keras names: ``DistributedOptimizer``, ``PartialDistributedOptimizer``, ``load_model``,
``SyncBatchNormalization``, ``callbacks`` and ``elastic`` (the Keras elastic
state and callbacks). As in ``horovod.tensorflow.keras``,
``DistributedOptimizer``, ``allreduce``, ``allgather``, ``broadcast`` and
``reducescatter`` here take Horovod's Keras parameters: ``name`` second, the
value any tensor-like (numpy array, list, number, tensor), the result a
``tf.Tensor``. The other collectives are ``tf_mpi``'s.

Example (``mpirun -np 2 python train.py``)::

    import keras
    import tf_mpi.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)
"""
import importlib as _importlib

import tensorflow as _tf

import tf_mpi as _tf_mpi
from tf_mpi import *  # noqa: F401,F403  (init, rank, size, ... as in tf_mpi)
from tf_mpi import ops as _ops
from tf_mpi.basics import Average as _Average
from tf_mpi.basics import Sum as _Sum
from tf_mpi.policy.compression import Compression as _Compression
from tf_mpi.keras import callbacks  # noqa: F401
# The Keras elastic module (KerasState and callbacks), not tf_mpi.elastic that the * import bound.
elastic = _importlib.import_module("tf_mpi.keras.elastic")
from tf_mpi.keras import optimizer as _optimizer  # noqa: E402
from tf_mpi.keras.optimizer import load_model  # noqa: F401,E402
from tf_mpi.keras.sync_batch_norm import SyncBatchNormalization  # noqa: F401,E402
from tf_mpi.basics import _check_process_set  # noqa: E402
from tf_mpi.policy.reducer import check_groups as _check_groups  # noqa: E402

__all__ = [*_tf_mpi.__all__, "callbacks", "load_model", "PartialDistributedOptimizer"]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=_Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=_Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=None, scale_local_gradients=True, *,
                         order_backprop=None, sparse=None):
    """Wraps a Keras 3 optimizer so that gradients are averaged across ranks before they are applied.

    Returns a new optimizer of a subclass of ``type(optimizer)`` with the same
    configuration: use it wherever the original was (``model.compile``,
    ``get_config``/``from_config``, ``optimizer.learning_rate``, saving).
    The positional parameters are those of
    ``horovod.tensorflow.keras.DistributedOptimizer``, in its order; the
    tf_mpi-only ones are keyword-only. ``tf_mpi.DistributedOptimizer`` takes
    ``horovod.tensorflow``'s order instead.

    Args:
      optimizer: any Keras 3 optimizer (SGD, Adam, AdamW, RMSprop, ...) or a LossScaleOptimizer.
      name: prefix of the collectives' names; default "Distributed<Class>".
      device_dense / device_sparse: where the collectives of dense / IndexedSlices gradients run
        (``tf.device``, as in Horovod, e.g. "/cpu:0"); '' leaves them where TensorFlow puts them.
      compression: Compression.none, Compression.fp16, or Compression.topk(ratio) /
        Compression.gtopk(ratio) (sparsified with error feedback; docs/compression.md).
      sparse_as_dense: densify IndexedSlices gradients (e.g. of Embedding) and allreduce them, instead
        of allgathering their rows. Worth it when the optimizer densifies the gradient anyway (Keras 3's
        Adam, AdamW, RMSprop and SGD with momentum do) and the rows of all ranks together are a sizeable
        part of the table: each rank then densifies its own rows instead of everyone's. The LSTM
        benchmark (20000x128 table, 6400 rows per rank) trains 7-13 % faster with it on 2 ranks.
        The same as ``sparse="dense"``.
      gradient_predivide_factor: with op=Average, split the averaging into a division by this factor
        before the sum and by size()/factor after it; ignored with op=Sum (as in Horovod).
      op: Average (default) or Sum; anything else is a ValueError (as in Horovod's Keras optimizer).
      backward_passes_per_step: reduce and apply once every this many passes, accumulating in between;
        ``iterations`` counts every pass (as in Horovod).
      average_aggregated_gradients: with backward_passes_per_step > 1, average instead of sum the passes.
      num_groups: deprecated (DeprecationWarning, as in Horovod): ``groups=num_groups``.
      groups: an integer > 0, reduce the gradients in that many groups of about equal bytes; or a list
        of lists of variables reduced together (the others form one more group). 0 or a negative
        number is a ValueError. None: tf_mpi's grouping by backprop order (tf_mpi.grouping).
      process_set: a registered tf_mpi.ProcessSet: gradients are reduced among its ranks only
        (Average divides by its size); None or global_process_set: all ranks.
      scale_local_gradients: divide the gradients of variables registered with
        ``register_local_var`` by size() (Horovod's default), or leave them as they are.
      order_backprop: make backprop produce each group's gradients before it starts on the layers
        below, so that early groups reach the engine early even when TensorFlow has one inter-op
        thread (its queue would otherwise hold them back to the end of backprop). Default: the
        TF_MPI_ORDER_BACKPROP environment variable, off unless "1".
      sparse: how IndexedSlices gradients travel: "allgather" (every rank's rows, Horovod's
        default), "dense" (= ``sparse_as_dense=True``), "dedup" (each rank sums its duplicate rows,
        the ranks exchange only the touched rows, the optimizer gets each touched row once as
        IndexedSlices) or "auto" (per tensor and step, dedup's exchange or a dense allreduce by
        measured cost; the optimizer gets a dense gradient). None: "dense" with
        ``sparse_as_dense=True``, else "allgather". See tf_mpi.policy.sparse and docs/sparse-gradients.md.

    Gradients that ``DistributedGradientTape`` returned, given unchanged to
    ``apply_gradients`` / ``apply``, are applied without a second reduction.

    Example::

        import keras, tf_mpi.keras as hvd
        hvd.init()
        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """
    if op not in (_Average, _Sum):   # Horovod's Keras entry refuses every other op first, Adasum included
        raise ValueError(f"tf_mpi: DistributedOptimizer reduces with op=Average or op=Sum; got {op!r}")
    _check_process_set(process_set, "DistributedOptimizer")
    groups = _check_groups(num_groups, groups)
    return _optimizer._distributed_optimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor,
        op, backward_passes_per_step, average_aggregated_gradients, groups, scale_local_gradients,
        order_backprop, sparse, process_set)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=_Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=_Average, groups=None, process_set=None, local_layers=None,
                                scale_local_gradients=True):
    """A DistributedOptimizer that keeps the gradients of ``local_layers`` on each rank (model parallelism).

    Horovod's ``horovod.keras.PartialDistributedOptimizer``, parameters in its
    order: every trainable weight of the given layers is registered with
    ``register_local_var``, so its gradient is not reduced across ranks and,
    with ``scale_local_gradients=True`` (the default), is divided by size().
    The other gradients are reduced as by ``DistributedOptimizer``. The
    layers' weights are read when this is called: build the model first.
    ``local_layers`` is a layer, a list of layers or None (then this is
    ``DistributedOptimizer``); anything that is not a Keras layer is a
    ValueError.

    Example::

        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="shared"),
                                  keras.layers.Dense(1, name="head")])
        opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.01), local_layers=[model.get_layer("head")])
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
    """
    import keras as _keras
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, _keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, _keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


# Horovod's Keras collectives take a tensor-like value and return a tensor (eagerly, as in Horovod on
# TensorFlow 2; inside tf.function too, where Horovod's tf.constant(value) would fail on a symbolic
# tensor). `name` names the collective.

def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=_Compression.none):
    """Reduces a tensor-like `value` over all ranks (Average unless `op` or the deprecated `average` says
    otherwise); returns a ``tf.Tensor``. Horovod's Keras ``allreduce``, parameters in its order.

    Example: ``hvd.allreduce(np.array([1.0, 2.0]) * (hvd.rank() + 1), "metric")`` (on 2 ranks: [1.5, 3.0])
    """
    return _ops.allreduce(_tf.convert_to_tensor(value), op=op, average=average, name=name,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          compression=compression)


def allgather(value, name=None):
    """Concatenates every rank's tensor-like `value` along the first dimension; returns a ``tf.Tensor``.

    Example: ``hvd.allgather([[hvd.rank()]], "ranks")`` (on 2 ranks: [[0], [1]])
    """
    return _ops.allgather(_tf.convert_to_tensor(value), name=name)


def broadcast(value, root_rank, name=None):
    """Rank `root_rank`'s tensor-like `value` on every rank, as a ``tf.Tensor``.

    Example: ``hvd.broadcast(np.full([2], hvd.rank()), 0, "seed")`` (everywhere: [0, 0])
    """
    return _ops.broadcast(_tf.convert_to_tensor(value), root_rank, name=name)


def reducescatter(value, name=None, op=_Average):
    """Reduces a tensor-like `value` over all ranks (Average by default) and returns this rank's block of
    the first dimension, as a ``tf.Tensor``.

    Example: ``hvd.reducescatter(np.ones([4, 3]), "rs", hvd.Sum)`` (on 2 ranks: a [2, 3] block of 2.0)
    """
    return _ops.reducescatter(_tf.convert_to_tensor(value), op=op, name=name)
