"""Process sets: collectives on a subset of the ranks, as in Horovod.

A ``ProcessSet`` names some ranks of the global set (the ranks ``init()``
started). Registered, it has a ``process_set_id`` (1, 2, ... in registration
order; 0 is ``global_process_set``), and every collective takes it as
``process_set=``: the collective then runs among those ranks only, with its
own negotiation, fusion, response cache and stall checks, and Average divides
by the set's size. Each set a rank belongs to has an engine of its own (its
own communicator and thread), so collectives on disjoint sets never wait on
each other. Ranks are always global ranks, also ``root_rank`` of a
broadcast; ``process_set.rank()`` is the rank within the set (the position
of this rank's part in an allgather's result).

Sets are registered collectively, by every rank of the global set in the
same order: at ``init(process_sets=[...])``, or later with
``add_process_set`` when dynamic sets are on (``init(process_sets="dynamic")``
or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``). A rank outside a set that calls a
collective on it gets Horovod's error (``tf.errors.InvalidArgumentError``:
"... is not a member of the provided process set.").

Example (``mpirun -np 4 python train.py``)::

    import tensorflow as tf, tf_mpi as hvd

    even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[even, odd])
    mine = even if even.included() else odd
    total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, process_set=mine)   # [2.0]
"""
import collections
import os
import threading

from tf_mpi import _core
from tf_mpi.reduce_ops import Max, Min

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]

# Horovod's code, in its ops, for a set id it does not know.
UNKNOWN_SET = -3


class ProcessSet:
    """A set of global ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Args:
      ranks_or_comm: a list of global ranks, or an mpi4py communicator whose
        ranks form the set (each rank passes its own communicator, e.g. from
        ``comm.Split``; only at ``init()``).

    Example::

        ps = hvd.ProcessSet([0, 1])
        hvd.init(process_sets=[ps])
        ps.process_set_id, ps.size(), ps.rank(), ps.included()
    """
    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if hasattr(ranks_or_comm, "Get_rank") and hasattr(ranks_or_comm, "py2f"):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                             "object") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                             "object")
        self.ranks = ranks

    def _invalidate(self):
        self.process_set_id = None

    def size(self):
        """Number of ranks in the set; None if it is not registered."""
        if self.process_set_id is None:
            return None
        return _core.size() if self.process_set_id == 0 else len(_registry.ranks(self.process_set_id))

    def rank(self):
        """This rank's rank within the set; None if the set is not registered.
        ValueError if this rank is not in it."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return _core.rank()
        ranks = _registry.ranks(self.process_set_id)
        if _core.rank() not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(_core.rank())

    def included(self):
        """Whether this rank belongs to the set; None while its ranks are unknown."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return _core.rank() in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _Registry:
    """This rank's view of the registered sets: id -> global ranks (same on every rank).

    Changed only by init(), add_process_set, remove_process_set and shutdown(), which
    every rank calls in the same order; the lock keeps concurrent readers consistent."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sets = {}
        self._next_id = 1
        self._free_ids = collections.deque()   # removed ids, reused first-in first-out (as Horovod)
        self.dynamic = False
        self.started = False   # init() registered its sets (Horovod registers them once per start)
        self._base = None

    def reset(self):
        with self._lock:
            self._sets.clear()
            self._next_id = 1
            self._free_ids.clear()
            self.dynamic = False
            self.started = False
            self._base = None

    def table(self):
        with self._lock:
            return {set_id: list(ranks) for set_id, ranks in sorted(self._sets.items())}

    def ranks(self, set_id):
        with self._lock:
            if set_id not in self._sets:
                raise ValueError("Process set does not exist or has not been registered.")
            return self._sets[set_id]

    def known(self, set_id):
        with self._lock:
            return set_id == 0 or set_id in self._sets

    def id_of(self, ranks):
        with self._lock:
            for set_id, r in self._sets.items():
                if r == ranks:
                    return set_id
        return None

    def base_comm(self):
        """The mpi4py communicator of the global set: MPI_COMM_WORLD, whose ranks are tf_mpi's."""
        if self._base is None:
            from mpi4py import MPI
            world = MPI.COMM_WORLD
            if world.Get_size() != _core.size():
                raise NotImplementedError(
                    f"tf_mpi: process sets need init() on all of MPI_COMM_WORLD (it has {world.Get_size()} ranks, "
                    f"tf_mpi runs on {_core.size()})")
            if world.allreduce(int(world.Get_rank() != _core.rank())):
                raise NotImplementedError("tf_mpi: process sets need tf_mpi's ranks in MPI_COMM_WORLD's order")
            self._base = world
        return self._base

    def add(self, ranks, agree=True):
        """Registers `ranks` (sorted global ranks) collectively; returns the id, None if a duplicate.
        ``agree=False``: the caller has checked that every rank registers the same sets."""
        size = _core.size()
        if not ranks or ranks[0] < 0 or ranks[-1] >= size or len(set(ranks)) != len(ranks):
            raise ValueError(f"tf_mpi: a process set lists distinct ranks of 0..{size - 1}; got {ranks}")
        if agree:
            _agree_everywhere(ranks)
        if self.id_of(ranks) is not None or ranks == list(range(size)):
            return None
        with self._lock:
            if self._free_ids:
                set_id = self._free_ids.popleft()
            else:
                set_id = self._next_id
                self._next_id += 1
        base = self.base_comm()   # on every rank: its first call is a collective of all
        member = _core.rank() in ranks
        comm = None
        if member:   # MPI_Comm_create_group: collective over the members only
            comm = base.Create_group(base.Get_group().Incl(ranks), tag=set_id)
        _core.add_process_set(set_id, None if comm is None else comm.py2f())
        if comm is not None:
            comm.Free()   # the engine runs on its own duplicate
        with self._lock:
            self._sets[set_id] = list(ranks)
        return set_id

    def remove(self, set_id):
        with self._lock:
            if set_id not in self._sets:
                return False
            del self._sets[set_id]
        _core.remove_process_set(set_id)
        with self._lock:
            self._free_ids.append(set_id)
        return True


_registry = _Registry()


def _agree_everywhere(ranks):
    """ValueError on every rank unless every rank registers the same set now (collective over all)."""
    import zlib
    import numpy as np
    h = np.array([zlib.crc32(repr(list(ranks)).encode())], np.int64)
    lo = _core.allreduce(h, Min, "tfmpi.process_sets.agree.min")
    hi = _core.allreduce(h, Max, "tfmpi.process_sets.agree.max")
    if lo[0] != hi[0]:
        raise ValueError(f"tf_mpi: ranks register different process sets at the same time (this rank: {ranks}); "
                         "every rank must register the same sets in the same order")


def _dynamic_from_env():
    return os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") not in ("", "0")


def _comm_ranks(comm):
    """The global ranks of mpi4py communicator ``comm``, sorted (local: no communication)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD.Get_group()
    group = comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    return sorted(ranks)


def _sets_to_register(process_sets):
    """The rank lists init() registers, in Horovod's order: first every set the communicators of
    the entries built from one form (for each such entry, the distinct sets of all ranks, sorted),
    then the entries built from ranks, in list order."""
    via_comm = [ps for ps in process_sets if ps.ranks is None and ps.mpi_comm is not None]
    result = []
    if via_comm:
        base = _registry.base_comm()   # collective over all ranks, as is the allgather below
        for ps in via_comm:
            result += sorted({tuple(r) for r in base.allgather(_comm_ranks(ps.mpi_comm))})
    result += [tuple(ps.ranks) for ps in process_sets if ps.ranks is not None]
    return [list(r) for r in result]


def init_process_sets(process_sets, comm=None):
    """Called by init(): registers the sets of ``init(process_sets=...)`` (a list, None or "dynamic").

    As Horovod's init(), the sets are registered once per start of tf_mpi: a later init() without
    a shutdown() in between registers nothing and only gives the listed objects the ids of the
    registered sets with their ranks. An entry whose set another entry (or the global set) has
    already is invalidated and makes init() raise ValueError, after the others got their ids."""
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"init(process_sets=...) takes a list of ProcessSet or 'dynamic'; got {process_sets!r}")
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"   # as Horovod, which reads it at its first init()
        process_sets = []
    process_sets = list(process_sets or [])
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"init(process_sets=...) takes ProcessSet objects; got {ps!r}")
    if comm is not None and not isinstance(comm, (list, tuple)):
        global_process_set.mpi_comm = comm
    if not _registry.started:
        _registry.reset()
        _registry.dynamic = _dynamic_from_env()
        wanted = _sets_to_register(process_sets)
        _agree_everywhere(wanted)   # also the number of sets: Horovod fails init() when ranks differ
        everyone = list(range(_core.size()))
        for ranks in wanted:
            if ranks != everyone and _registry.id_of(ranks) is None:
                _registry.add(ranks, agree=False)
        _registry.started = True
    table = ids_and_ranks()
    ids = {tuple(ranks): set_id for set_id, ranks in table.items()}
    seen = {0}
    for ps in process_sets:
        if ps.ranks is not None:
            if tuple(ps.ranks) not in ids:
                raise KeyError(f"tf_mpi: init() was already called; the process set {ps} was not registered then "
                               "(shutdown() first, or add it with add_process_set)")
            ps.process_set_id = ids[tuple(ps.ranks)]
        else:
            ps.process_set_id = comm_set_id(ps.mpi_comm)
            ps.ranks = list(table[ps.process_set_id])
        if ps.process_set_id in seen:   # a second entry for registered ranks (also the global set's)
            ps._invalidate()
        else:
            seen.add(ps.process_set_id)
    global_process_set.ranks = table[0]
    for i, ps in enumerate(process_sets):
        if ps.process_set_id is None:
            raise ValueError(f"Horovod could not be initialized because process_sets entry number {i} is a "
                             f"duplicate: {ps}")


def ids_and_ranks():
    """``{process_set_id: [global ranks]}`` of every registered set, the global set (0) included."""
    return {0: list(range(_core.size())), **_registry.table()}


def comm_set_id(comm):
    """The id of the registered set with the ranks of mpi4py communicator ``comm``; ValueError if none."""
    ranks = _comm_ranks(comm)
    if ranks == list(range(_core.size())):
        return 0
    set_id = _registry.id_of(ranks)
    if set_id is None:
        raise ValueError("MPI communicator does not correspond to any registered process set.")
    return set_id


def add_process_set(process_set):
    """Registers a process set after ``init()``; returns it (with its ``process_set_id``).

    Collective: every rank of the global set calls it, in the same order.
    Needs dynamic process sets (``init(process_sets="dynamic")`` or
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``). A set with the same ranks as an
    existing one is a ValueError.

    Example::

        hvd.init(process_sets="dynamic")
        pair = hvd.add_process_set([0, 1])
        hvd.allreduce(tf.ones([2]), process_set=pair)   # on ranks 0 and 1 only
    """
    if not _core.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    if not _registry.dynamic:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod "
                         "initialization.")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator is not "
                                  "implemented. Please build the process set via a list of ranks.")
    set_id = _registry.add(process_set.ranks)
    if set_id is None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    process_set.process_set_id = set_id
    return process_set


def remove_process_set(process_set):
    """Removes a registered process set (collective, like add_process_set); returns whether it was removed.

    The global set is never removed (False). The object is invalidated.

    Example: ``hvd.remove_process_set(pair)  # True``
    """
    if not _core.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    if not _registry.dynamic:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after Horovod "
                         "initialization.")
    process_set._invalidate()
    return _registry.remove(set_id)


def resolve(process_set, function):
    """The id of ``process_set`` for a collective called ``function`` (None: the global set).

    A set that is not registered is a ValueError, as is anything that is not a
    ProcessSet (Horovod's ``process_set`` parameters take ProcessSet objects)."""
    if process_set is None:
        return 0
    set_id = getattr(process_set, "process_set_id", None)
    if set_id is None:
        raise ValueError(f"tf_mpi: {function}(process_set=...) got a process set that is not registered "
                         f"({process_set}); pass it to init(process_sets=[...]) or add_process_set()")
    if not isinstance(set_id, int) or not _registry.known(set_id):
        raise ValueError(f"tf_mpi: {function}: process set {set_id} does not exist or has not been registered")
    return set_id


def set_size(set_id):
    """Number of ranks of a registered set."""
    return _core.size() if set_id == 0 else len(_registry.ranks(set_id))


def set_rank_of(set_id, global_rank, what="root_rank"):
    """The set's own rank of ``global_rank`` (collectives take global ranks, as in Horovod)."""
    if set_id == 0:
        return global_rank
    ranks = _registry.ranks(set_id)
    if global_rank not in ranks:
        raise ValueError(f"tf_mpi: {what} {global_rank} is not in process set {set_id} (ranks {ranks})")
    return ranks.index(global_rank)


def included(set_id):
    """1 if this rank is in set ``set_id``, 0 if not, UNKNOWN_SET (-3) if the id is not registered."""
    if set_id == 0:
        return 1
    if not _registry.known(set_id):
        return UNKNOWN_SET
    return int(_core.rank() in _registry.ranks(set_id))


def reset():
    """Forgets every set (shutdown()); the objects handed out keep their ids but are unusable."""
    _registry.reset()
