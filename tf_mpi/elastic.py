"""Elastic training (Horovod's ``hvd.elastic``): keep training when ranks are lost or added.

A state object remembers the training state in host memory at each ``commit()``;
``hvd.elastic.run`` calls the training function and, when the set of ranks changes, brings every
rank back to a common state and calls it again:

- **A rank or host is lost** (it died, or stopped responding: Open MPI's heartbeat detector
  declares it dead). Every survivor's pending and next collective fails
  (``HorovodInternalError`` inside ``run``); ``run`` restores the last commit, the engine
  restarts on the ranks that remain (``tf_mpi.membership.shrink``: rank order is kept, the lowest
  survivor becomes rank 0), the reset callbacks run, ``sync()`` gives every rank rank 0's state,
  and the function is called again. The steps since the last commit are lost and redone. Fewer
  ranks than ``--min-np`` end the job (``tf_mpi.membership.MembershipError``).
- **Capacity is added** (the launcher's ``--host-discovery-script`` lists free slots, up to
  ``--max-np``). At the next ``commit()`` every rank raises ``HostsUpdatedInterrupt`` (no
  rollback: the state was just committed); ``run`` spawns the new ranks, restarts the engine with
  them, runs the reset callbacks, syncs and calls the function again. The new processes run the
  same program; their ``run`` starts with the same ``sync()``. Open MPI spawns only onto hosts
  the job was started with: for a host listed later, every rank ends at that ``commit()``
  (persisted to ``TF_MPI_ELASTIC_CHECKPOINT_DIR``) and the launcher starts the job again with it;
  ``run`` resumes from the commit.

This needs elastic mode (``python -m tf_mpi.run --min-np ... --max-np ...``, which starts Open
MPI with ULFM; docs/elastic.md). Without it the ranks are fixed: a failure inside ``run``
restores the last commit and raises ``HorovodInternalError``, and ``commit()`` never interrupts.

Horovod's semantics: ``commit()`` is a collective in elastic mode (rank 0 tells every rank
whether hosts were added), so all ranks commit at the same points; reset callbacks run after
every restart (e.g. to scale the learning rate to the new ``size()``). Keras models retrace their
training step after a restart (``TensorFlowKerasState.reset``); a ``tf.function`` of your own
that uses ``size()`` in Python should be created inside the elastic function.

Example::

    import tensorflow as tf
    import tf_mpi as hvd

    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: optimizer.learning_rate.assign(0.01 * hvd.size())])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            train_one_epoch(model, optimizer)
            state.commit()

    train(state)
"""
import os
import pickle
import sys
import warnings

import cloudpickle
import tensorflow as tf

from tf_mpi import basics, membership
from tf_mpi._unused_arguments import warn_unused_argument
from tf_mpi.functions import broadcast_object, broadcast_variables


class HorovodInternalError(RuntimeError):
    """A collective failed because a rank was lost (Horovod's exception of the same name).

    Inside ``run`` in elastic mode the job recovers from it; elsewhere it is raised.

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
        """Horovod's driver notification; tf_mpi's rank 0 finds new hosts itself, so this does nothing."""

    def commit(self):
        """Saves the current state to host memory (``restore()`` goes back to it), then ``check_host_updates()``.

        In elastic mode a collective: every rank must commit at the same points.
        """
        self.save()
        self._persist()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises ``HostsUpdatedInterrupt`` on every rank when rank 0's discovery found ranks to add.

        In elastic mode a collective (rank 0's finding is broadcast); otherwise it does nothing.
        """
        global _pending_hosts
        if not membership.enabled():
            return
        found = relaunch_for = None
        if basics.rank() == 0:
            found = membership.pending_hosts()
            # Hosts ranks are not spawned onto (not given at launch, or running no rank of the
            # job: membership.hosts_to_relaunch_with): the launcher starts the job again with them,
            # resuming from the commit just persisted; only where there is one.
            if not found and _checkpoint_path() is not None:
                relaunch_for = membership.hosts_to_relaunch_with()
        found, relaunch_for = broadcast_object((found, relaunch_for), root_rank=0, name="tfmpi.elastic.host_updates")
        if found:
            _pending_hosts = list(found)
            raise HostsUpdatedInterrupt(skip_sync=False)
        if relaunch_for:
            raise _RelaunchForHosts(relaunch_for)

    def _persist(self):
        """Rank 0 writes the committed state to TF_MPI_ELASTIC_CHECKPOINT_DIR, if set (elastic mode).

        A job the launcher starts again (a lost host ends Open MPI's job: docs/elastic.md)
        resumes from it in ``run``."""
        path = _checkpoint_path()
        if path is None or basics.rank() != 0:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            cloudpickle.dump(self._payload(), f)
        os.replace(tmp, path)  # a reader sees the previous commit or this one, never half of one

    def _resume(self):
        """Rank 0 loads the state a previous launch committed (``run`` syncs it to the others)."""
        path = _checkpoint_path()
        if path is None or basics.rank() != 0 or not os.path.exists(path):
            return False
        with open(path, "rb") as f:
            self._load_payload(pickle.load(f))
        self.restore()
        return True

    def _payload(self):
        """What ``_persist`` writes: the last commit, as plain picklable values."""
        return {}

    def _load_payload(self, payload):
        """Makes ``payload`` (from ``_payload``) the last commit."""

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

    def _payload(self):
        return {"attributes": dict(self._saved_state)}

    def _load_payload(self, payload):
        self._saved_state = dict(payload["attributes"])

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

    def _payload(self):
        return dict(super()._payload(), variables=self._saved_values())

    def _load_payload(self, payload):
        super()._load_payload(payload)
        self._set_saved_values(payload["variables"])

    def _saved_values(self):
        raise NotImplementedError

    def _set_saved_values(self, values):
        raise NotImplementedError

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
        compiled = getattr(model, "optimizer", None)
        self.optimizer = optimizer if optimizer is not None else compiled
        if optimizer is not None and compiled is not None and optimizer is not compiled:
            # DistributedOptimizer(opt) is a new optimizer with variables of its own (as in
            # Horovod): a state given `opt` would not restore the moments model.fit updates.
            warnings.warn("tf_mpi: this elastic state holds a different optimizer than the one the model is "
                          "compiled with; after a failure inside model.fit the compiled optimizer's variables "
                          "(e.g. Adam's moments) would not be restored. Leave `optimizer` out (the state then "
                          "takes model.optimizer) or pass model.optimizer.", stacklevel=2)
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

    def reset(self):
        """After the ranks changed: the model retraces its training step at the next ``fit``
        (what it computed from ``size()`` while tracing must follow the new size)."""
        for attr in ("train_function", "test_function", "predict_function"):
            if getattr(self.model, attr, None) is not None:
                setattr(self.model, attr, None)

    def _load_model(self):
        for v, value in self._saved_variables:
            v.assign(value)

    def _saved_values(self):
        return [value for _, value in self._saved_variables]

    def _set_saved_values(self, values):
        variables = self._variables()
        if len(values) != len(variables):
            raise ValueError(f"tf_mpi: the elastic checkpoint holds {len(values)} variables but the model and "
                             f"optimizer have {len(variables)} (build the optimizer before creating the state)")
        self._saved_variables = list(zip(variables, values))


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

    def _saved_values(self):
        return list(self._values)

    def _set_saved_values(self, values):
        if len(values) != len(self.variables):
            raise ValueError(f"tf_mpi: the elastic checkpoint holds {len(values)} variables, the state {len(self.variables)}")
        self._values = list(values)


_FIXED_RANKS = ("a rank was lost or left: {}. Outside elastic mode tf_mpi runs on a fixed set of ranks (rank "
                "membership changes are not supported there): the state was restored to its last commit on this "
                "rank; restart the job (e.g. from a checkpoint), or launch it with `python -m tf_mpi.run --min-np N "
                "...` to go on with the ranks that remain (docs/elastic.md)")

def _checkpoint_path():
    directory = os.environ.get("TF_MPI_ELASTIC_CHECKPOINT_DIR", "") if membership.enabled() else ""
    return os.path.join(directory, "elastic_state.pkl") if directory else None


_pending_hosts = []  # hosts to spawn ranks on at the next reset (check_host_updates, on every rank)


class _RelaunchForHosts(HostsUpdatedInterrupt):
    """Raised by ``commit()`` on every rank when the discovery script lists hosts the job was not
    started with: ``run`` ends the process for the launcher to start the job again with them."""

    def __init__(self, hosts):
        super().__init__(skip_sync=False)
        self.hosts = list(hosts)


# The engine's words for a lost rank (transports/peer_failure.cc), whatever wraps them.
_LOST_RANK_TEXT = "a rank of this job failed or stopped responding"


def _is_lost_rank(error):
    """Whether `error` means a rank was lost: TensorFlow ops' UnavailableError, the binding's
    PeerLostError, or either wrapped by autograph while a function was being traced."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, (tf.errors.UnavailableError, basics._core.PeerLostError, HorovodInternalError)):
            return True
        if _LOST_RANK_TEXT in str(error):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def _restart_after_loss():
    """Stops the engine and starts it again on the ranks that remain (retried if another rank is lost meanwhile)."""
    for _ in range(_RESTART_ATTEMPTS):
        basics.shutdown()
        comm = membership.shrink()  # raises MembershipError below --min-np
        try:
            basics.init(comm=comm)
            return
        except basics._core.PeerLostError:
            continue
    raise HorovodInternalError(f"tf_mpi: ranks kept failing while restarting ({_RESTART_ATTEMPTS} attempts)")


def _restart_with_new_hosts():
    """Stops the engine, spawns ranks on the hosts rank 0 found, and starts it again with them."""
    global _pending_hosts
    hosts, _pending_hosts = _pending_hosts, []
    if not hosts:
        return
    basics.shutdown()
    basics.init(comm=membership.grow(hosts))


_RESTART_ATTEMPTS = 10


def _share_measurements():
    """Gives every rank rank 0's measured cost model and verified plan fingerprints (tf_mpi.grouping).

    Both come from collectives the first time a gradient reduction is traced, and are cached; a rank
    spawned into a running job would otherwise run them alone when it traces (collectives the
    others never join: their functions were traced already)."""
    if not membership.enabled():
        return
    from tf_mpi.policy import grouping
    cost_model, fingerprints = broadcast_object(grouping.measurements(), root_rank=0,
                                                name="tfmpi.elastic.measurements")
    grouping.adopt_measurements(cost_model, fingerprints, joining=membership.spawned())


def run(func):
    """Decorator for the elastic training function ``func(state, *args, **kwargs)``.

    Syncs ``state`` from rank 0, then calls ``func``. In elastic mode, when a rank is lost
    (``HorovodInternalError``) it restores the last commit, restarts on the ranks that remain,
    runs the reset callbacks, syncs and calls ``func`` again; when ``commit()`` raises
    ``HostsUpdatedInterrupt`` it adds the new ranks, runs the reset callbacks, syncs (unless
    ``skip_sync``) and calls ``func`` again. Outside elastic mode a lost rank restores the last
    commit and raises ``HorovodInternalError``. Returns ``func``'s result.

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
        state._resume()  # a relaunched job goes on from the last commit of the one before
        while True:
            try:
                if not skip_sync:
                    _share_measurements()
                    state.sync()
                return func(state, *args, **kwargs)
            except _RelaunchForHosts as e:
                if basics.rank() == 0:
                    sys.stderr.write(f"[tf_mpi] the host discovery script lists {','.join(e.hosts)}, which this job "
                                     "was not started with: ending at this commit for the launcher to start the job "
                                     "again with them (it resumes from this commit)\n")
                membership.request_relaunch()
                sys.stdout.flush()
                sys.stderr.flush()
                raise SystemExit(0)  # tf_mpi's exit handler marks this rank and leaves together with the others
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
                _restart_with_new_hosts()
            except Exception as e:  # noqa: BLE001 - anything else is raised again below
                if not _is_lost_rank(e):
                    if isinstance(e, tf.errors.AbortedError):
                        # Outside elastic mode a rank that left or stalled (shutdown, stall limit) aborts collectives.
                        state.restore()
                        raise HorovodInternalError(_FIXED_RANKS.format(getattr(e, "message", str(e)))) from e
                    raise
                state.restore()
                if not membership.enabled():
                    message = getattr(e, "message", None) or str(e)
                    raise HorovodInternalError(_FIXED_RANKS.format(message)) from e
                skip_sync = False
                _restart_after_loss()
            state.on_reset()

    return wrapper
