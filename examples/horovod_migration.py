"""A Horovod TF2 training script, migrated by changing its import line only.

Written the way Horovod's TensorFlow 2 examples are (``tensorflow2_mnist.py``):
``hvd.init()``, a ``tf.function`` step with ``hvd.DistributedGradientTape``,
``hvd.broadcast_variables`` of the model and optimizer after the first step,
``hvd.allreduce`` to average metrics, and a checkpoint saved by rank 0 only. It
uses no Keras (a ``tf.Module`` MLP and a momentum optimizer written out), so it
does not depend on what changed between Keras 2 and Keras 3. The data are
synthetic (nothing to download): a 10-class problem whose labels come from a
fixed random linear map.

    python -m tf_mpi.run -np 2 python examples/horovod_migration.py --checkpoint-dir /tmp/ckpt

Rank 0 prints progress and one ``RESULT {...}`` line (JSON).
"""
import argparse
import json
import os

import numpy as np
import tensorflow as tf

import tf_mpi as hvd  # was: import horovod.tensorflow as hvd


class MLP(tf.Module):
    def __init__(self, sizes, seed):
        super().__init__()
        init = tf.random.stateless_normal
        self.layers = [(tf.Variable(init([n_in, n_out], seed=[seed, i]) * (2.0 / n_in) ** 0.5, name=f"w{i}"),
                        tf.Variable(tf.zeros([n_out]), name=f"b{i}"))
                       for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:]))]

    def __call__(self, x):
        for i, (w, b) in enumerate(self.layers):
            x = tf.matmul(x, w) + b
            if i < len(self.layers) - 1:
                x = tf.nn.relu(x)
        return x


class Momentum(tf.Module):
    """SGD with momentum; its slots exist from the start so they can be broadcast."""

    def __init__(self, variables, learning_rate, momentum=0.9):
        super().__init__()
        self.learning_rate, self.momentum = learning_rate, momentum
        self.slots = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False)

    def apply_gradients(self, grads_and_vars):
        for slot, (g, v) in zip(self.slots, grads_and_vars):
            slot.assign(self.momentum * slot + g)
            v.assign_sub(self.learning_rate * slot)
        self.iterations.assign_add(1)


def synthetic_data(n, features, classes, seed):
    rng = np.random.default_rng(seed)
    truth = np.random.default_rng(1234).normal(size=(features, classes))  # the same map on every rank
    x = rng.normal(size=(n, features)).astype(np.float32)
    return x, np.argmax(x @ truth, axis=1).astype(np.int64)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="total steps over all ranks")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02, help="per-rank rate; scaled by hvd.size()")
    p.add_argument("--checkpoint-dir", default="./checkpoints")
    args = p.parse_args()

    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process).
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    features, classes = 20, 10
    x, y = synthetic_data(20000, features, classes, seed=0)
    x_test, y_test = synthetic_data(4000, features, classes, seed=1)
    # Horovod: each rank trains on its own part of the data.
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank())
    dataset = dataset.repeat().shuffle(5000, seed=hvd.rank()).batch(args.batch_size)

    # Different initial weights on every rank: the broadcast below must fix that.
    model = MLP([features, 64, classes], seed=hvd.rank())
    # Horovod: adjust learning rate based on number of workers.
    opt = Momentum(model.trainable_variables, args.lr * hvd.size())
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)

    def loss_fn(labels, logits):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(labels, model(images))

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes,
        # after the first step so that the optimizer state exists.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

        return loss_value

    losses = []
    # Horovod: adjust number of steps based on number of workers.
    for batch, (images, labels) in enumerate(dataset.take(args.steps // hvd.size())):
        loss_value = training_step(images, labels, batch == 0)
        # Horovod: average the metric over workers.
        losses.append(float(hvd.allreduce(loss_value, op=hvd.Average)))
        if batch % 20 == 0 and hvd.rank() == 0:
            print("Step #%d\tLoss: %.6f" % (batch, losses[-1]), flush=True)

    # Each rank evaluates its part of the test set; the accuracies are averaged.
    part = slice(hvd.rank(), None, hvd.size())
    correct = tf.reduce_mean(tf.cast(tf.argmax(model(x_test[part]), 1) == y_test[part], tf.float64))
    accuracy = float(hvd.allreduce(correct, op=hvd.Average))

    # Every rank must hold the same weights: compare a checksum of each rank's.
    checksum = tf.add_n([tf.reduce_sum(tf.cast(v, tf.float64) * (i + 1.0)) for i, v in enumerate(model.variables)])
    checksums = hvd.allgather(tf.reshape(checksum, [1])).numpy().tolist()

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting it.
    saved = None
    if hvd.rank() == 0:
        saved = checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))
        print("RESULT " + json.dumps({"ranks": hvd.size(), "first_loss": losses[0], "final_loss": losses[-1],
                                      "accuracy": accuracy, "weight_checksums": checksums,
                                      "steps": len(losses), "checkpoint": saved}), flush=True)


if __name__ == "__main__":
    main()
