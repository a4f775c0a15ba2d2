"""Keras 3 integration: ``import tf_mpi.keras as hvd`` is all a training script needs.

It offers everything ``tf_mpi`` exports (``init``, ``rank``, ``allreduce``, ...)
plus Horovod's Keras names: ``DistributedOptimizer``, ``load_model``,
``SyncBatchNormalization``, ``callbacks`` and ``elastic`` (the Keras elastic
state and callbacks).

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

import tf_mpi as _tf_mpi
from tf_mpi import *  # noqa: F401,F403  (init, rank, size, allreduce, ... as in tf_mpi)
from tf_mpi.keras import callbacks  # noqa: F401
# The Keras elastic module (KerasState and callbacks), not tf_mpi.elastic that the * import bound.
elastic = _importlib.import_module("tf_mpi.keras.elastic")
from tf_mpi.keras.optimizer import DistributedOptimizer, load_model  # noqa: F401,E402
from tf_mpi.keras.sync_batch_norm import SyncBatchNormalization  # noqa: F401,E402

__all__ = [*_tf_mpi.__all__, "callbacks", "load_model"]
