"""Faults in the middle of model.fit (tests/test_faults.py, np=3): on rank 1,
at batch 30 of a long epoch, argv[1] says what happens:

  kill   SIGKILL (the process vanishes; nothing of it runs again)
  raise  an uncaught exception (tf_mpi's excepthook aborts the job)
  exit   sys.exit(1) (the process exits; its engine tells the others it left)
  exit0  sys.exit(0): the same with a successful exit code

Every rank writes its pid to $TF_MPI_TEST_OUT/pid.<rank> once training is
under way; rank 1 writes the time of the fault to $TF_MPI_TEST_OUT/fault before
causing it. The test checks when the last of them exited, the exit code and
that the output names rank 1.
"""
import os
import signal
import sys
import time

import numpy as np

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_mpi.keras as hvd  # noqa: E402

FAULT = sys.argv[1]
OUT = os.environ["TF_MPI_TEST_OUT"]
AT_BATCH = 30

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R = hvd.rank()


class Fault(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 2:
            with open(os.path.join(OUT, f"pid.{R}"), "w") as f:
                f.write(str(os.getpid()))
        if R != 1 or batch != AT_BATCH:
            return
        with open(os.path.join(OUT, "fault"), "w") as f:
            f.write(repr(time.time()))
        print(f"rank 1: {FAULT} at batch {batch}", flush=True)
        if FAULT == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif FAULT == "raise":
            raise RuntimeError("injected failure on rank 1")
        elif FAULT == "exit":
            sys.exit(1)
        elif FAULT == "exit0":
            sys.exit(0)


keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
rng = np.random.default_rng(R)
x = rng.normal(size=(100_000, 8)).astype(np.float32)
y = x.sum(axis=1, keepdims=True)
model.fit(x, y, batch_size=8, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Fault()])
print(f"rank {R}: fit returned, which it must not", flush=True)
