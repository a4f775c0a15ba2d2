"""Which variable a Keras weight or a tf.Variable is, for bookkeeping keyed by variable."""
import tensorflow as tf


def variable_key(variable):
    """Identity of a variable for local-variable bookkeeping: a Keras 3 Variable
    and the tf.Variable it wraps count as the same variable."""
    inner = getattr(variable, "_value", None)
    return id(inner) if isinstance(inner, tf.Variable) else id(variable)
