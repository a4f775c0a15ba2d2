"""Which ranks the job has, in elastic mode: start, shrink after a loss, grow by spawning.

Elastic mode (``TF_MPI_ELASTIC=1``, set by ``python -m tf_mpi.run --min-np ...``) runs the engine
on a communicator this module owns (an mpi4py duplicate of ``MPI_COMM_WORLD``, or, in a process
spawned to grow the job, the merge with its parents). Membership changes only here, and only
while the engine is stopped (``tf_mpi.elastic.run`` stops it, calls these functions and starts
it again on the communicator they return):

- :func:`shrink`: after a rank was lost, the survivors agree on who is left (ULFM's
  ``MPI_Comm_shrink``, which tolerates further failures while it runs). Ranks keep their order:
  the lowest surviving rank becomes rank 0.
- :func:`grow`: when rank 0's discovery (:class:`Discovery`) found free slots, every rank spawns
  the new processes together (``MPI_Comm_spawn``, the same program and arguments) and merges them
  in after the current ranks.

It knows nothing of the engine (``tf_mpi.basics`` calls :func:`start` and :func:`after_start`).

The limits come from the launcher: ``TF_MPI_ELASTIC_MIN_NP`` (fewer ranks end the job with
:class:`MembershipError`) and ``TF_MPI_ELASTIC_MAX_NP`` (never grown past). The discovery
script (``TF_MPI_ELASTIC_DISCOVERY``) prints ``host:slots`` lines, as Horovod's does; it is read
with the launcher's parser (``tf_mpi.run.parse_discovery_output``), and the launcher's side of
the other contracts (spawn settings, finished marks) comes from ``tf_mpi.run`` too.

This module does not import TensorFlow.

Example::

    from tf_mpi import membership
    if membership.enabled():
        comm = membership.start()         # what tf_mpi.init() runs on
"""
import os
import socket
import subprocess
import sys
import threading

__all__ = ["MembershipError", "enabled", "min_np", "max_np", "start", "start_timeout", "Deadline",
           "comm", "spawned", "shrink", "grow",
           "hosts_to_relaunch_with", "request_relaunch",
           "finish", "Discovery"]

# How often rank 0 runs the discovery script (Horovod's driver checks about once a second).
DISCOVERY_INTERVAL_S = float(os.environ.get("TF_MPI_ELASTIC_DISCOVERY_INTERVAL", "1"))
# The longest a rank waits for the job to start (MPI_Init, the first communicator, the engine) or
# for ranks it spawns to join (grow): a rank lost inside MPI_Init leaves the others waiting there
# forever (Open MPI has no time limit on it), so they end instead (TF_MPI_ELASTIC_START_TIMEOUT_SECONDS).
START_TIMEOUT_S = 120.0


class MembershipError(RuntimeError):
    """The job cannot go on: fewer ranks than ``--min-np`` remain, or elastic mode is not available.

    Example::

        except tf_mpi.membership.MembershipError as e:
            sys.exit(str(e))
    """


_comm = None          # the communicator the engine runs on (mpi4py), elastic mode only
_hosts = []           # the host name of each rank of _comm, in rank order
_discovery = None     # rank 0's Discovery thread
_spawned = False      # this process was started by grow()
_relaunch = False     # finish() asks the launcher to start the job again (request_relaunch)
_RESTART_ATTEMPTS = 10  # duplicates tried while ranks are lost at start


def enabled():
    """Whether this process runs in elastic mode (``TF_MPI_ELASTIC=1``).

    Example: ``if tf_mpi.membership.enabled(): ...``
    """
    return os.environ.get("TF_MPI_ELASTIC", "0") == "1"


def min_np():
    """The fewest ranks the job may go on with (``--min-np``; 1 when not given).

    Example: ``tf_mpi.membership.min_np()``
    """
    return int(os.environ.get("TF_MPI_ELASTIC_MIN_NP", "1") or 1)


def max_np():
    """The most ranks the job may grow to (``--max-np``; None: never grows).

    Example: ``tf_mpi.membership.max_np()``
    """
    value = os.environ.get("TF_MPI_ELASTIC_MAX_NP", "")
    return int(value) if value else None


def _mpi():
    try:
        import mpi4py
        if "mpi4py.MPI" not in sys.modules:
            # No MPI_Finalize at exit: with ULFM's heartbeat thread it does not return (engine.cc, Finalize).
            mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise MembershipError("tf_mpi elastic mode needs mpi4py (pip install mpi4py)") from e
    if not hasattr(MPI.Comm, "Shrink"):
        raise MembershipError("tf_mpi elastic mode needs mpi4py >= 4 with ULFM (Comm.Shrink)")
    return MPI


def start():
    """The communicator elastic mode starts the engine on (collective; called by ``tf_mpi.init()``).

    A process spawned by :func:`grow` merges with its parents here, after them in rank order.

    Example::

        tf_mpi.init()    # in elastic mode: init(comm=membership.start())
    """
    global _comm, _spawned
    MPI = _mpi()
    parent = MPI.Comm.Get_parent()
    _spawned = parent != MPI.COMM_NULL
    if _spawned:
        parent.Set_errhandler(MPI.ERRORS_RETURN)
        comm = parent.Merge(high=True)
    else:
        comm = _dup_of_survivors(MPI, MPI.COMM_WORLD)
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    _comm = comm
    return comm


def start_timeout():
    """Seconds a rank waits for the job to start or for spawned ranks to join
    (``TF_MPI_ELASTIC_START_TIMEOUT_SECONDS``, default 120; 0 or less: no limit).

    Example: ``membership.start_timeout()  # 120.0``
    """
    value = os.environ.get("TF_MPI_ELASTIC_START_TIMEOUT_SECONDS", "")
    try:
        return float(value) if value else START_TIMEOUT_S
    except ValueError:
        return START_TIMEOUT_S


class Deadline:
    """Ends this process (exit status 1, marked failed for the launcher) unless cancelled within
    ``seconds``: for waits inside MPI that no failure interrupts (a rank lost inside MPI_Init
    leaves the others in it forever; a spawned rank lost before it joins leaves its parents in
    MPI_Comm_spawn). ``seconds`` <= 0: no limit.

    A small watcher process keeps the time (this one may hold Python's interpreter lock while it
    waits in MPI: mpi4py starts MPI while it is imported), says why on stderr, leaves the mark and
    kills this process. It ends when the deadline is cancelled or this process ends.

    Example::

        deadline = Deadline(120, "the spawned ranks did not join")
        try:
            inter = comm.Spawn(...)
        finally:
            deadline.cancel()
    """

    def __init__(self, seconds, what):
        self._watcher = None
        if seconds <= 0:
            return
        message = (f"[tf_mpi] elastic mode: {what} within {seconds:g} s (TF_MPI_ELASTIC_START_TIMEOUT_SECONDS): a "
                   "rank was lost while MPI started it (Open MPI then waits for it forever), or a rank did not reach "
                   "tf_mpi.init(); this rank ends (exit status 1)")
        run_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
        self._watcher = subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, str(os.getpid()), str(seconds), message,
                                          run_py], stdin=subprocess.PIPE)

    def cancel(self):
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        try:
            watcher.stdin.close()  # the watcher reads the end of its input and exits
            watcher.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            watcher.kill()


# The watcher of a Deadline: argv = pid, seconds, message, path of tf_mpi/run.py.
_WATCHER = """
import importlib.util, os, select, signal, sys
pid, seconds, message, run_py = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
if select.select([sys.stdin], [], [], seconds)[0]:
    sys.exit(0)  # cancelled, or the process ended
sys.stderr.write(message + "\\n"); sys.stderr.flush()
try:
    spec = importlib.util.spec_from_file_location("tf_mpi_launcher", run_py)
    launcher = importlib.util.module_from_spec(spec); spec.loader.exec_module(launcher)
    launcher.mark_worker_finished(ok=False, stage="start", pid=pid)
finally:
    os.kill(pid, signal.SIGKILL)
"""


def _dup_of_survivors(MPI, world):
    """A duplicate of `world`, or of its surviving ranks where some died while the job started
    (Open MPI 5.0.11 with ULFM's heartbeat thread now and then crashes a rank in MPI_Init).
    Every rank gets the same: a rank lost during the duplicate can make it fail on some ranks
    only, so the ranks agree on whether all have it. Raises MembershipError when fewer than
    ``min_np()`` ranks remain."""
    world.Set_errhandler(MPI.ERRORS_RETURN)
    lost = False
    for _ in range(_RESTART_ATTEMPTS):
        dup = None
        try:
            dup = world.Dup()
        except MPI.Exception:
            pass
        try:
            everyone = world.Agree(1 if dup is not None else 0)
        except MPI.Exception:  # a failure not acknowledged yet: the same on every rank
            everyone = 0
        if everyone:
            return dup
        lost = True
        world = _survivors(MPI, world, "while the job started")
    raise MembershipError(f"tf_mpi: ranks kept failing while the job started ({_RESTART_ATTEMPTS} attempts"
                          f"{', ranks were lost' if lost else ''}): the job ends")



def spawned():
    """Whether this process was started to grow the job (it joined a running job in ``start()``).

    Example: ``if not tf_mpi.membership.spawned(): load_data_cache()``
    """
    return _spawned


def comm():
    """The communicator the engine runs on in elastic mode (None otherwise).

    Example: ``tf_mpi.membership.comm().Get_size()``
    """
    return _comm


def hosts_to_relaunch_with():
    """Rank 0: hosts with free slots the discovery script lists that ranks are not spawned onto,
    while the job is below ``--max-np``: hosts not given to ``mpirun`` at launch (Open MPI cannot
    spawn there) and given hosts where no rank of the job runs (Open MPI 5.0.11's daemon crashed
    serving such spawns); the launcher can start the job again with them. Other ranks, and jobs
    without a discovery script: ``[]``.

    Example: ``if membership.hosts_to_relaunch_with(): ...``
    """
    return _discovery.hosts_to_relaunch_with() if _discovery is not None else []


def request_relaunch():
    """Makes :func:`finish` ask the launcher to start the job again (``relaunch`` in this rank's
    mark) instead of reporting it done.

    Example: ``membership.request_relaunch(); sys.exit(0)``
    """
    global _relaunch
    _relaunch = True


def finish(ok):
    """Tells the launcher this rank is done (``ok``: without an error), then waits until every rank
    of the job is done with MPI (a fault-tolerant agreement), so that none leaves while another
    still needs it. Called at exit in elastic mode (``tf_mpi.init`` registers it).

    Example: ``membership.finish(ok=True)``
    """
    from tf_mpi import run as launcher
    if _comm is None:
        return
    MPI = _mpi()
    launcher.mark_worker_finished(ok=ok, rank=_comm.Get_rank(), size=_comm.Get_size(), relaunch=ok and _relaunch)
    try:
        _comm.Agree(1)
    except MPI.Exception:
        pass  # a rank lost at the very end changes nothing for this one


def after_start():
    """Learns every rank's host and starts rank 0's discovery (collective over :func:`comm`).

    Example: called by ``tf_mpi.init()`` in elastic mode, once the engine runs.
    """
    global _hosts, _discovery
    _hosts = _comm.allgather(socket.gethostname())
    script = os.environ.get("TF_MPI_ELASTIC_DISCOVERY", "")
    if _discovery is not None:
        _discovery.stop()
        _discovery = None
    if script and _comm.Get_rank() == 0:
        _discovery = Discovery(script, list(_hosts), max_np())
        _discovery.start()


def shrink():
    """The communicator of the ranks that remain after a loss (collective over the survivors).

    Raises MembershipError when fewer than ``min_np()`` remain.

    Example::

        comm = membership.shrink()      # then tf_mpi.init(comm=comm)
    """
    global _comm
    _comm = _survivors(_mpi(), _comm)
    return _comm


def _survivors(MPI, comm, when=""):
    """`comm` revoked (so that every rank still in it stops waiting on it) and shrunk to the ranks
    that remain; MembershipError when fewer than ``min_np()`` remain (`when`: for the message)."""
    try:
        comm.Revoke()
    except MPI.Exception:
        pass  # revoked already (by a peer)
    left = comm.Shrink()
    left.Set_errhandler(MPI.ERRORS_RETURN)
    if left.Get_size() < min_np():
        raise MembershipError(
            f"tf_mpi: {left.Get_size()} rank(s) remain after losing rank(s){' ' + when if when else ''}, fewer than "
            f"the minimum of {min_np()} (--min-np): the job ends")
    return left


def pending_hosts():
    """Rank 0: one host name per rank the discovery found a free slot for ([] elsewhere or without a script).

    Example: ``hosts = membership.pending_hosts()``
    """
    return _discovery.new_hosts() if _discovery is not None else []


def grow(hosts):
    """The communicator with ``len(hosts)`` new ranks (one per entry, on that host) after the current ones.

    Collective over the current ranks; ``hosts`` must be the same list on all (rank 0's, broadcast).
    The new processes run this program with the same arguments and join in ``tf_mpi.init()``.

    Example::

        comm = membership.grow(["h3", "h3"])   # then tf_mpi.init(comm=comm)
    """
    global _comm
    MPI = _mpi()
    if not hosts:
        return _comm
    from tf_mpi import run as launcher  # the launcher's side of the contract: what a spawn needs
    counts = {}
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    info = MPI.Info.Create()
    for key, value in launcher.elastic_spawn_info(",".join(f"{h}:{n}" for h, n in counts.items())):
        info.Set(key, value)
    command, args = launcher.elastic_spawn_command(sys.argv)
    # A spawned rank lost before it joins (e.g. inside its MPI_Init) can leave this one in the
    # spawn forever: end instead, after the start-up time limit.
    deadline = Deadline(start_timeout(), f"the {len(hosts)} rank(s) spawned to grow the job did not join")
    try:
        inter = _comm.Spawn(command, args=args, maxprocs=len(hosts), info=info, root=0)
        info.Free()
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        merged = inter.Merge(high=False)
    finally:
        deadline.cancel()
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    _comm = merged
    return _comm


class Discovery(threading.Thread):
    """Rank 0's background check for free slots: runs the discovery script every
    ``TF_MPI_ELASTIC_DISCOVERY_INTERVAL`` seconds (default 1).

    A slot is free when the script lists more slots on a host than the job has ranks there.
    ``new_hosts()`` gives one host name per rank to add (up to the maximum size).

    Example::

        d = Discovery("./discover.sh", current_hosts=["h1", "h1"], max_np=4)
        d.start(); ...; d.new_hosts()   # e.g. ["h2", "h2"]
    """

    def __init__(self, script, current_hosts, max_np):
        super().__init__(daemon=True, name="tf_mpi-discovery")
        self.script = script
        self.current = list(current_hosts)
        self.max_np = max_np
        self._listed = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._warned = set()

    def run(self):
        while not self._stop.is_set():
            try:
                from tf_mpi import run as launcher  # reads the script's lines as the launcher did
                output = subprocess.run([self.script], capture_output=True, text=True, timeout=30, check=True).stdout
                listed = dict(launcher.parse_discovery_output(output, int(os.environ.get("TF_MPI_ELASTIC_SLOTS", "1") or 1)))
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                sys.stderr.write(f"[tf_mpi] host discovery script {self.script} failed: {e}\n")
                listed = None
            if listed is not None:
                with self._lock:
                    self._listed = listed
            self._stop.wait(DISCOVERY_INTERVAL_S)

    def stop(self):
        self._stop.set()

    def new_hosts(self):
        with self._lock:
            listed = dict(self._listed)
        used = {}
        for h in self.current:
            used[h] = used.get(h, 0) + 1
        out = []
        for host, slots in listed.items():
            if not self._declared(host) or not self._running(host):
                continue
            out += [host] * max(0, slots - used.get(host, 0))
        if self.max_np is not None:
            out = out[:max(0, self.max_np - len(self.current))]
        else:
            out = []
        return out

    def hosts_to_relaunch_with(self):
        with self._lock:
            listed = dict(self._listed)
        if self.max_np is None or len(self.current) >= self.max_np:
            return []
        return [h for h, slots in listed.items()
                if slots > 0 and not (self._declared(h, warn=False) and self._running(h, warn=False))]

    def _running(self, host, warn=True):
        """Whether a rank of the job runs on `host`. Ranks are spawned only onto such hosts: onto a
        host given at launch that has none (never had, or lost them all), Open MPI 5.0.11's
        daemon crashed serving the spawn in 3 of 10 tries (a PMIx unpack error, then a malloc
        assertion: the whole job ends), and 3 of 4 after a failure; such a host joins when the
        launcher starts the job again."""
        if host in self.current:
            return True
        if warn and host not in self._warned:
            self._warned.add(host)
            sys.stderr.write(f"[tf_mpi] host {host} (host discovery) runs no rank of this job: ranks are not spawned "
                             "there (Open MPI's daemon can crash serving it; hvd.elastic ends the job at its next "
                             "commit for the launcher to start it again with that host, when a checkpoint directory "
                             "is set)\n")
        return False

    def _declared(self, host, warn=True):
        """Whether Open MPI was given `host` at launch (TF_MPI_ELASTIC_HOSTS; empty: the job's own
        hosts). A spawn onto any other host ends the whole job (Open MPI 5.0), so such a host is
        left out, with one warning: it joins when the launcher starts the job again."""
        declared = os.environ.get("TF_MPI_ELASTIC_HOSTS", "")
        names = {item.rpartition(":")[0] or item for item in declared.split(",") if item} or set(self.current)
        if host in names:
            return True
        if warn and host not in self._warned:
            self._warned.add(host)
            sys.stderr.write(f"[tf_mpi] host {host} (host discovery) was not given to mpirun at launch: ranks cannot "
                             "be started there while this job runs (hvd.elastic ends the job at its next commit "
                             "for the launcher to start it again with that host, when a checkpoint directory is set)\n")
        return False

    def new_slots(self):
        return len(self.new_hosts())
