"""Makes backprop produce a gradient group before it starts on the layers below.

Why: with one inter-op thread, TensorFlow's executor queues the kernels it
rates expensive (a MatMul making a dense layer's gradient, the end of a
backward loop) and serves that queue newest first, so the kernels producing an
early gradient group can wait until all of backprop is done. Every group then
reaches the engine at the end of the step and nothing overlaps (measured in
docs/how-it-works.md, "When gradient groups reach the engine").

The fix is a scheduling hint inside the traced step: the first ops of the
backprop that only later groups need get control inputs on the ops that
produce the earlier group's gradients. The math and the results are unchanged;
only the order in which a single thread runs independent kernels is fixed.
"""
import tensorflow as tf


def _ancestors(ops):
    """`ops` and every op they depend on (data and control inputs)."""
    seen = set()
    stack = list(ops)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def _producers(tensors):
    return [t.op for t in tensors if isinstance(t, tf.Tensor) and hasattr(t, "op")]


def order_backprop(grouped_grads):
    """Adds control edges so that group k's gradients are computed before the
    backprop work that only groups k+1, k+2, ... need begins.

    Args:
      grouped_grads: lists of gradient tensors (symbolic, inside a
        tf.function), in the order the groups are sent.

    Returns the number of control edges added (0 outside a graph).

    Example::

        # inside a tf.function, before the groups' allreduces
        order_backprop([[g_dense, g_lstm_1], [g_lstm], [g_embedding]])
    """
    if tf.executing_eagerly() or len(grouped_grads) < 2:
        return 0
    added = 0
    done = _ancestors(_producers(grouped_grads[0]))
    for k in range(1, len(grouped_grads)):
        before = _producers(grouped_grads[k - 1])
        if not before:
            done |= _ancestors(_producers(grouped_grads[k]))
            continue
        later = _ancestors(_producers(grouped_grads[k])) - done
        for op in later:
            data_inputs = [t.op for t in op.inputs]
            # A root of the later-only work: it computes something (has inputs)
            # and none of its inputs is itself later-only work.
            if not data_inputs or any(i in later and i.inputs for i in data_inputs):
                continue
            for b in before:
                if b is not op and b not in op.control_inputs:
                    op._add_control_input(b)  # no public API for adding an edge to an existing op
                    added += 1
        done |= later
    return added
