"""Elastic training state (Horovod's ``hvd.elastic``) on a fixed set of ranks.

What is here is the state-keeping half of Horovod elastic: a state object
that can ``commit()`` (remember the current model, optimizer and attributes in
host memory), ``restore()`` (go back to the last commit) and ``sync()``
(make every rank equal to rank 0), and ``hvd.elastic.run``, which syncs the
state before calling the training function and syncs and retries when the
function raises ``HostsUpdatedInterrupt``.

Not here: changes of rank membership. tf_mpi runs on the ranks ``mpirun``
started; it does not add workers, and a rank that dies ends the job (MPI
aborts it). When a collective inside ``run`` fails because a rank left or
stalled, ``run`` restores the last committed state and raises
``HorovodInternalError`` saying so, instead of waiting for new ranks as
Horovod's elastic driver would. ``commit()`` therefore never raises
``HostsUpdatedInterrupt`` by itself and, unlike Horovod's, is not a
collective (ranks may commit at different points).

Example::

    import tensorflow as tf
    import tf_mpi as hvd

    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            train_one_epoch(model, optimizer)
            state.commit()

    train(state)
"""
import tensorflow as tf

from tf_mpi import basics
from tf_mpi._compat import warn_unused_argument
from tf_mpi.functions import broadcast_object, broadcast_variables


class HorovodInternalError(RuntimeError):
    """A collective failed inside ``run`` (Horovod's exception of the same name).

    Example::

        try:
            train(state)
        except hvd.elastic.HorovodInternalError as e:
            print("restart the job:", e)
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Raised inside ``run``'s function to make every rank sync the state and start the function again.

    ``skip_sync=True`` restarts without syncing.

    Example::

        @hvd.elastic.run
        def train(state):
            if state.epoch == 0 and must_restart:
                raise hvd.elastic.HostsUpdatedInterrupt(skip_sync=False)
    """

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class State:
    """Base of the elastic states: ``commit``, ``restore``, ``sync`` and reset callbacks.

    Subclasses implement ``save`` (to host memory), ``restore`` and ``sync``.

    Example::

        state.register_reset_callbacks([lambda: print("state was reset")])
    """

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called (without arguments) after ``run`` restarts the training function."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Calls ``reset()`` and the registered reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Horovod's driver notification; tf_mpi's set of ranks never changes, so this does nothing."""

    def commit(self):
        """Saves the current state to host memory (``restore()`` goes back to it).

        Local to this rank: on a fixed set of ranks there are no host updates to check.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Horovod raises ``HostsUpdatedInterrupt`` here when workers came or went; tf_mpi's never do."""

    def save(self):
        """Saves the state to host memory."""
        raise NotImplementedError

    def restore(self):
        """Restores the last committed state, undoing uncommitted changes."""
        raise NotImplementedError

    def sync(self):
        """Makes every rank's state equal to rank 0's (a collective)."""
        raise NotImplementedError

    def reset(self):
        """Hook run after a restart, before the next sync."""


class ObjectState(State):
    """State of plain Python values, given as keyword arguments and exposed as attributes.

    Example::

        state = hvd.elastic.ObjectState(epoch=0, best=None)
        state.epoch += 1
        state.commit()
    """

    def __init__(self, bcast_object=broadcast_object, get_rank=basics.rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def _optimizer_variables(optimizer):
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class _VariablesState(ObjectState):
    """An ObjectState that also keeps variables in host memory: subclasses define
    ``_save_model`` (copy them out) and ``_load_model`` (assign the copies back).

    Example: ``class MyState(_VariablesState): ...`` with both methods defined
    """

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()


class TensorFlowKerasState(_VariablesState):
    """Elastic state of a Keras model, its optimizer and extra attributes.

    ``sync()`` broadcasts the model's and the optimizer's variables and the
    attributes from rank 0; ``commit()`` copies them to host memory;
    ``restore()`` assigns the copies back (optimizer variables created after
    the last commit keep their values).

    Args:
      model: a built Keras model.
      optimizer: its optimizer (default: ``model.optimizer``).
      backend: Horovod's Keras backend module (for TF1 sessions); accepted and,
        when given, warns once: tf_mpi reads and assigns the variables directly.
      kwargs: attributes to keep and sync (e.g. ``epoch=0, batch=0``).

    Example::

        state = hvd.elastic.TensorFlowKerasState(model, optimizer=opt, epoch=0)
        state.sync(); state.epoch = 3; state.commit()
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if hasattr(model, "built") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if backend is not None:
            warn_unused_argument("TensorFlowKerasState", "backend",
                                 "tf_mpi reads and assigns the model's and optimizer's variables directly, "
                                 "without a Keras backend session")
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **kwargs)

    def _variables(self):
        return list(self.model.variables) + _optimizer_variables(self.optimizer)

    def sync(self):
        broadcast_variables(self._variables(), root_rank=0, name="tfmpi.elastic.keras_state")
        self._save_model()
        super().sync()

    def _save_model(self):
        self._saved_variables = [(v, tf.identity(v).numpy()) for v in self._variables()]

    def _load_model(self):
        for v, value in self._saved_variables:
            v.assign(value)


class TensorFlowState(_VariablesState):
    """Elastic state of a list of TensorFlow variables and extra attributes.

    Eagerly, or in a TF1 graph with ``session`` (default: the default session).

    Args:
      variables: the ``tf.Variable`` objects to keep (default: ``tf.compat.v1.global_variables()``).
      session: TF1 session that evaluates and assigns them (graph mode only).
      kwargs: attributes to keep and sync.

    Example::

        state = hvd.elastic.TensorFlowState(variables=[w, b], step=0)
        state.sync()            # rank 0's w, b and step everywhere
    """

    def __init__(self, variables=None, session=None, **kwargs):
        self.variables = list(variables) if variables is not None else tf.compat.v1.global_variables()
        self.session = session
        if not tf.executing_eagerly():
            self.session = session or tf.compat.v1.get_default_session()
            if self.session is None:
                raise ValueError("tf_mpi: TensorFlowState in graph mode needs a session")
            self._bcast_op = broadcast_variables(self.variables, root_rank=0)
            self._read_ops = [tf.identity(v) for v in self.variables]
            self._value_ph = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in self.variables]
            self._load_op = tf.group(*[v.assign(p) for v, p in zip(self.variables, self._value_ph)])
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **kwargs)

    def sync(self):
        if self.session is not None:
            self.session.run(self._bcast_op)
        else:
            broadcast_variables(self.variables, root_rank=0, name="tfmpi.elastic.tf_state")
        self._save_model()
        super().sync()

    def _save_model(self):
        if self.session is not None:
            self._values = self.session.run(self._read_ops)
        else:
            self._values = [v.numpy() for v in self.variables]

    def _load_model(self):
        if self.session is not None:
            self.session.run(self._load_op, feed_dict=dict(zip(self._value_ph, self._values)))
        else:
            for v, value in zip(self.variables, self._values):
                v.assign(value)


_MEMBERSHIP = ("tf_mpi.elastic keeps training state on a fixed set of ranks and cannot continue with "
               "different ones (rank membership changes are not supported): {}. The state was restored to its "
               "last commit on this rank; restart the job, e.g. from a checkpoint.")


def run(func):
    """Decorator for the elastic training function ``func(state, *args, **kwargs)``.

    Syncs ``state`` from rank 0, then calls ``func``. If ``func`` raises
    ``HostsUpdatedInterrupt``, every rank calls the state's reset callbacks,
    syncs again (unless ``skip_sync``) and calls ``func`` again. If a
    collective fails because a rank left or stalled, the state is restored to
    its last commit and ``HorovodInternalError`` is raised: tf_mpi does not
    change the set of ranks (see the module docstring).

    Example::

        @hvd.elastic.run
        def train(state):
            ...

        train(state)
    """
    import functools

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            except tf.errors.AbortedError as e:
                state.restore()
                raise HorovodInternalError(_MEMBERSHIP.format(getattr(e, "message", str(e)))) from e
            state.on_reset()

    return wrapper
