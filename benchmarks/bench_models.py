"""Models and synthetic data of benchmarks/training_bench/ (and of examples/benchmark_lstm.py).

Each benchmark model is a ``ModelSpec`` in ``MODELS``: how to build it, its
loss, how to draw a synthetic batch, and how many steps to time by default
(chosen per model so that every launch takes a similar wall time on a
2-core machine). Nothing here imports tf_mpi: the single-process baseline
must run plain Keras.

The builders follow the global Keras dtype policy, so under
``mixed_float16`` the layers compute in float16; every model's last layer
is kept float32 so that the loss is computed in float32.
"""
import os
import sys
from dataclasses import dataclass
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

# The LSTM text classifier is the examples' (examples/example_utils.py), at benchmark size.
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.append(_EXAMPLES)
from example_utils import lstm_text_classifier  # noqa: E402


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model.

    build: () -> an uncompiled keras.Model (built, so its variables exist).
    loss: the Keras loss name for model.compile.
    make_inputs: (rng, n) -> (x, y) numpy arrays of n synthetic samples.
    timed_steps: default number of timed steps per repeat.
    description: one line for tables and reports.
    warmup, repeats: default untimed steps and timed windows (None: the command line's defaults).
    user: trained with a new user's settings: DistributedOptimizer with every tf_mpi default
      (sparse gradients allgathered, as in Horovod), instead of the benchmark's tuned choices.
    """
    name: str
    build: Callable[[], keras.Model]
    loss: object  # a Keras loss name or loss object, for model.compile
    make_inputs: Callable[[np.random.Generator, int], tuple]
    timed_steps: int
    description: str
    warmup: int = None
    repeats: int = None
    user: bool = False


# ----------------------------------------------------------------------------- lstm

LSTM_VOCAB, LSTM_SEQ_LEN, LSTM_EMBEDDING, LSTM_UNITS = 20000, 100, 128, 128


def build_lstm():
    """Embedding(20000x128) -> LSTM(128) -> LSTM(128) -> Dense(1, sigmoid): the IMDB text classifier
    (examples/imdb_lstm.py's model, at benchmark size)."""
    return lstm_text_classifier(LSTM_SEQ_LEN, LSTM_VOCAB, LSTM_EMBEDDING, LSTM_UNITS, name="lstm")


def lstm_inputs(rng, n, vocab=LSTM_VOCAB, seq_len=LSTM_SEQ_LEN):
    """Random token ids (0 is left out, as padding would be) and binary labels."""
    x = rng.integers(1, vocab, (n, seq_len), dtype=np.int32)
    y = rng.integers(0, 2, (n, 1)).astype(np.float32)
    return x, y


# ----------------------------------------------------------------------------- mlp

MLP_INPUT, MLP_HIDDEN, MLP_CLASSES = 784, 512, 10


def build_mlp():
    """784-512-512-10 MLP: little compute per byte of gradient, so communication dominates."""
    inputs = keras.Input((MLP_INPUT,))
    x = keras.layers.Dense(MLP_HIDDEN, activation="relu")(inputs)
    x = keras.layers.Dense(MLP_HIDDEN, activation="relu")(x)
    outputs = keras.layers.Dense(MLP_CLASSES, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="mlp")


def build_mlp_logits():
    """784-512-512-10 MLP whose last layer gives logits (no softmax): a new user's MNIST MLP,
    trained with SparseCategoricalCrossentropy(from_logits=True)."""
    inputs = keras.Input((MLP_INPUT,))
    x = keras.layers.Dense(MLP_HIDDEN, activation="relu")(inputs)
    x = keras.layers.Dense(MLP_HIDDEN, activation="relu")(x)
    outputs = keras.layers.Dense(MLP_CLASSES, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="mlp_user")


def build_tiny():
    """32-16-10 MLP (about 700 parameters): a step is almost all framework, for per-step overhead."""
    inputs = keras.Input((TINY_INPUT,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(MLP_CLASSES, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="tiny")


TINY_INPUT = 32


def classification_inputs(shape, classes):
    """A make_inputs function for uniform random features of `shape` and integer labels."""
    def make(rng, n):
        x = rng.random((n, *shape), dtype=np.float32)
        y = rng.integers(0, classes, (n,), dtype=np.int32)
        return x, y
    return make


# ----------------------------------------------------------------------------- cnn

CNN_INPUT, CNN_CLASSES = (32, 32, 3), 10
# Channels of each residual block; a block that widens also halves the resolution.
CNN_BLOCK_CHANNELS = (16, 32, 64)


def conv_bn_relu(x, channels, strides=1, relu=True):
    """3x3 convolution (no bias: BatchNorm has one) -> BatchNorm -> optional ReLU."""
    x = keras.layers.Conv2D(channels, 3, strides=strides, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x) if relu else x


def residual_block(x, channels):
    """Basic ResNet block; a 1x1 strided projection on the shortcut when the shape changes."""
    strides = 1 if x.shape[-1] == channels else 2
    shortcut = x
    if strides != 1:
        shortcut = keras.layers.Conv2D(channels, 1, strides=strides, use_bias=False)(x)
        shortcut = keras.layers.BatchNormalization()(shortcut)
    y = conv_bn_relu(x, channels, strides)
    y = conv_bn_relu(y, channels, relu=False)
    return keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))


def build_cnn():
    """Small ResNet: conv stem (16) + residual blocks of 16, 32, 64 channels, global pooling, Dense 10."""
    inputs = keras.Input(CNN_INPUT)
    x = conv_bn_relu(inputs, CNN_BLOCK_CHANNELS[0])
    for channels in CNN_BLOCK_CHANNELS:
        x = residual_block(x, channels)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(CNN_CLASSES, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="cnn")


# ----------------------------------------------------------------------------- registry

MODELS = {spec.name: spec for spec in [
    ModelSpec("lstm", build_lstm, "binary_crossentropy", lstm_inputs, timed_steps=8,
              description="Embedding 20000x128 -> LSTM 128 -> LSTM 128 -> Dense 1, seq 100"),
    ModelSpec("mlp", build_mlp, "sparse_categorical_crossentropy",
              classification_inputs((MLP_INPUT,), MLP_CLASSES), timed_steps=100,
              description="784-512-512-10 MLP"),
    ModelSpec("cnn", build_cnn, "sparse_categorical_crossentropy",
              classification_inputs(CNN_INPUT, CNN_CLASSES), timed_steps=12,
              description="ResNet-style CNN, 32x32x3, blocks of 16/32/64 channels"),
    ModelSpec("tiny", build_tiny, "sparse_categorical_crossentropy",
              classification_inputs((TINY_INPUT,), MLP_CLASSES), timed_steps=200,
              description="32-16-10 MLP: per-step framework overhead"),
    # The two configurations a new user writes: every tf_mpi default (the LSTM's Embedding gradient
    # allgathered), 15 / 100 warm-up steps, then 100 / 1000 timed steps in 4 windows.
    ModelSpec("lstm_user", build_lstm, "binary_crossentropy", lstm_inputs, timed_steps=25,
              description="the LSTM, tf_mpi defaults (sparse allgather), 100 steps after 15", warmup=15,
              repeats=4, user=True),
    ModelSpec("mlp_user", build_mlp_logits, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              classification_inputs((MLP_INPUT,), MLP_CLASSES), timed_steps=250,
              description="784-512-512-10 MLP, logits, tf_mpi defaults, 1000 steps after 100", warmup=100,
              repeats=4, user=True),
]}

# Distinct synthetic batches per process; the dataset cycles through them, so
# the input pipeline costs next to nothing against a training step.
POOL_BATCHES = 4


def synthetic_dataset(spec, batch_size, seed):
    """An endless tf.data.Dataset of batches of `batch_size` random samples for `spec`."""
    rng = np.random.default_rng(seed)
    x, y = spec.make_inputs(rng, POOL_BATCHES * batch_size)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder=True)
    return dataset.cache().repeat().prefetch(2)


def count_parameters(model):
    """Number of trainable scalars of `model`."""
    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


# ----------------------------------------------------------------------------- wide mlp

WIDE_INPUT, WIDE_HIDDEN, WIDE_LAYERS = 1024, 1024, 3
TEACHER_SEED = 1234


def build_wide_mlp():
    """1024-1024-1024-1024-10 MLP (3.16 million parameters, 12.6 MB of float32 gradient, all dense):
    a model whose step is dominated by moving its gradient over a slow link."""
    inputs = keras.Input((WIDE_INPUT,))
    x = inputs
    for _ in range(WIDE_LAYERS):
        x = keras.layers.Dense(WIDE_HIDDEN, activation="relu")(x)
    outputs = keras.layers.Dense(MLP_CLASSES, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="wide_mlp")


def teacher_inputs(shape, classes, seed=TEACHER_SEED):
    """A make_inputs function for uniform random features whose labels a fixed random linear
    teacher assigns (argmax of (x - 0.5) @ W): learnable, so held-out accuracy measures quality.
    The teacher is the same for every caller (its own seed); the samples come from `rng`."""
    dim = int(np.prod(shape))
    w = np.random.default_rng(seed).standard_normal((dim, classes)).astype(np.float32)

    def make(rng, n):
        x = rng.random((n, *shape), dtype=np.float32)
        y = np.argmax((x.reshape(n, dim) - 0.5) @ w, axis=1).astype(np.int32)
        return x, y
    return make


MODELS["wide_mlp"] = ModelSpec(
    "wide_mlp", build_wide_mlp, "sparse_categorical_crossentropy",
    teacher_inputs((WIDE_INPUT,), MLP_CLASSES), timed_steps=40,
    description="1024-1024-1024-1024-10 MLP, 12.6 MB of dense gradient, labels from a linear teacher")
