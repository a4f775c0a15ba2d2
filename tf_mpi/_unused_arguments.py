"""Horovod parameters that tf_mpi accepts but has no use for: one warning each, once per process.

A script written for Horovod may pass arguments that only mean something
there (a timeline's cycle markers, the Keras 2 momentum correction, a device
for a host-side collective). tf_mpi accepts them, so the script runs, but
does not ignore them silently: the first time a call asks for something
tf_mpi does not do, a ``UserWarning`` says so and what tf_mpi does instead.
Plain Python (no TensorFlow), so tf_mpi.basics can use it.

Example::

    from tf_mpi._unused_arguments import warn_unused_argument

    def start_timeline(file_path, mark_cycles=False):
        if mark_cycles:
            warn_unused_argument("start_timeline", "mark_cycles", "tf_mpi's timeline has no cycle markers")
"""
import warnings

_warned = set()


def warn_unused_argument(function, parameter, instead, stacklevel=3):
    """Warns once per process that ``function(parameter=...)`` has no effect in tf_mpi.

    ``instead`` says what tf_mpi does (a sentence without the final period).
    ``stacklevel`` 3 points the warning at the caller of ``function``.
    Returns True if this call warned.

    Example: ``warn_unused_argument("MetricAverageCallback", "device", "metrics are averaged in host memory")``
    """
    key = (function, parameter)
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(f"tf_mpi: {function}({parameter}=...) is accepted for Horovod compatibility and has no effect: "
                  f"{instead}.", UserWarning, stacklevel=stacklevel)
    return True
