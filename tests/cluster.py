"""A cluster of pretend hosts on one machine, for running tf_mpi across a real network.

Each pretend host is a Linux network namespace with its own loopback, its own
TCP/IP stack, its own ``/etc/hosts`` and (for the processes launched on it) its
own hostname. The hosts are joined by veth links to a bridge that lives in a
namespace of its own (the "switch"), so traffic between two hosts crosses two
virtual NICs and a bridge, as between machines on one LAN segment, and an
optional token-bucket rate limit per host (``tc ... tbf``) caps each link in
both directions. Open MPI launches onto these hosts exactly as onto real ones:
``mpirun --host h1:2,h2:2`` or ``--hostfile``, with a stand-in for ``ssh``
(:data:`AGENT`) that runs the remote command inside the named host's namespace.
``mpirun`` itself runs inside the first host.

Nothing leaves the namespaces this module creates: addresses live in
10.231.<net>.0/24 on interfaces inside them, and the root namespace is not
touched (no interface, no route). :meth:`Cluster.down` removes everything a
cluster of that prefix made (processes in its namespaces, the namespaces and
their links, the hosts files); :meth:`Cluster.up` first does the same, so it is
safe to rerun after a crash.

By hand (as root)::

    python tests/cluster.py up --hosts 2 --slots 2 --rate 1gbit
    python tests/cluster.py run -- python -m tf_mpi.run -np 4 --host tfmpi-h1:2,tfmpi-h2:2 \\
        python examples/imdb_lstm.py --synthetic
    python tests/cluster.py down

In code::

    with Cluster(hosts=2, slots=2) as c:
        subprocess.run(c.command([sys.executable, "-m", "tf_mpi.run", "-np", "4", "--host", c.host_list(),
                                  "hostname"]), env=c.env(clean_remote_env=True))

docs/pretend-hosts.md describes the test bed for users.

What the kernel does not offer here: added latency (``netem`` is not in this
kernel), so links differ only in rate. Requirements: root (CAP_SYS_ADMIN and
CAP_NET_ADMIN), ``ip`` (iproute2), ``unshare`` (util-linux) and, for a rate,
``tc``. Where any is missing, :func:`unavailable_reason` says which, and
:class:`Cluster` raises :class:`ClusterUnavailable` with that text.
"""
import argparse
import fcntl
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "cluster_agent.sh")
"""The ssh stand-in: ``cluster_agent.sh [ssh options] HOST COMMAND...`` runs COMMAND in HOST's namespace."""

DEFAULT_PREFIX = "tfmpi"
LOCK_WAIT_S = 900
"""How long up() and down() wait for another process using the same prefix to let it go."""
SHARED_MEMORY_DIR = "/dev/shm"
"""Where Open MPI's shared-memory transport keeps its files (its btl_sm_backing_directory)."""

_held = {}   # prefix -> open lock file, for the prefixes this process owns


class ClusterUnavailable(RuntimeError):
    """This machine (or user) cannot create pretend hosts; the message says why."""


def _run(argv, check=True):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stdout.strip()}")
    return r


def unavailable_reason(need_rate=False):
    """None when pretend hosts can be made here, else a one-line reason (for a skip or an error)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "pretend hosts need root (network namespaces, veth links)"
    tools = ["ip", "unshare"] + (["tc"] if need_rate else [])
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return f"pretend hosts need {', '.join(missing)} (iproute2 / util-linux) on PATH"
    with _probe_lock:  # the probe namespace is named after the process: one probe at a time in it
        _remove_stale_probes()
        probe = f"{PROBE_PREFIX}{os.getpid()}"
        r = _run(["ip", "netns", "add", probe], check=False)
        if r.returncode != 0:
            return f"cannot create a network namespace ({r.stdout.strip()}): needs CAP_SYS_ADMIN"
        try:
            r = _run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"], check=False)
            if r.returncode != 0:
                return f"cannot give a namespace its own hostname (unshare --uts: {r.stdout.strip()})"
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    return None


PROBE_PREFIX = f"{DEFAULT_PREFIX}-probe"
_probe_lock = threading.Lock()


def _remove_stale_probes():
    """Probe namespaces of processes that died between creating and removing them."""
    for ns in _namespaces():
        m = re.fullmatch(re.escape(PROBE_PREFIX) + r"(\d+)", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run(["ip", "netns", "del", ns], check=False)


def _cpus_variable(host):
    return "TF_MPI_CLUSTER_CPUS_" + host.replace("-", "_")


def _namespaces():
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


class Cluster:
    """``hosts`` pretend hosts named ``<prefix>-h1..hN``, each with ``slots`` rank slots.

    rate: a tc rate ("1gbit", "100mbit") for every host's link, both ways; None: unlimited.
    net: the third octet of the hosts' 10.231.<net>.0/24 addresses (distinct per concurrent cluster).
    """

    def __init__(self, hosts=2, slots=2, rate=None, prefix=DEFAULT_PREFIX, net=0):
        if not 1 <= hosts <= 16:
            raise ValueError("hosts must be 1..16")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,31}", prefix):
            # Names become files (/run/netns, /etc/netns) and, with '-' as '_', environment
            # variable names (TF_MPI_CLUSTER_CPUS_<host>).
            raise ValueError(f"prefix must be a letter then up to 31 letters, digits, '_' or '-': {prefix!r}")
        if not 0 <= net <= 255:
            raise ValueError("net must be 0..255")
        self.prefix, self.slots, self.rate, self.net = prefix, slots, rate, net
        self.hosts = [f"{prefix}-h{i + 1}" for i in range(hosts)]
        self.switch = f"{prefix}-sw"

    # -- life cycle ---------------------------------------------------------
    def up(self, wait=LOCK_WAIT_S):
        """Creates the hosts (after removing any left by an earlier cluster of this prefix).

        This process owns the prefix until down() (by any object of that prefix): another
        process's up() or down() of the same prefix waits up to ``wait`` seconds, then raises
        ClusterUnavailable naming the owner, instead of tearing down hosts in use. A crashed owner
        lets go by exiting.
        """
        reason = unavailable_reason(need_rate=self.rate is not None)
        if reason:
            raise ClusterUnavailable(reason)
        self._acquire(wait)
        try:
            self._remove()
            self._create()
        except BaseException:
            self.down()
            raise
        return self

    @property
    def _lock_path(self):
        return f"/run/{self.prefix}-cluster.lock"

    def _acquire(self, wait):
        """Takes the prefix's lock (flock: released by the kernel if the owner dies)."""
        if self.prefix in _held:
            return
        deadline, said = time.time() + wait, False
        while True:
            f = open(self._lock_path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # The previous owner removes the file as it lets go: a lock on a removed file
                # is not the prefix's lock; take the new file's.
                if os.path.exists(self._lock_path) and os.path.samestat(os.fstat(f.fileno()),
                                                                        os.stat(self._lock_path)):
                    break
            except BlockingIOError:
                f.seek(0)
                owner = f.read().strip() or "?"
                if time.time() >= deadline:
                    f.close()
                    raise ClusterUnavailable(f"pretend hosts '{self.prefix}' are in use by process {owner} "
                                             f"(waited {wait:.0f} s); use another prefix") from None
                if not said:
                    print(f"cluster: waiting for process {owner}, which uses the prefix '{self.prefix}'",
                          file=sys.stderr, flush=True)
                    said = True
            f.close()
            time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        _held[self.prefix] = f

    def _release(self):
        f = _held.pop(self.prefix, None)
        if f is not None:
            os.unlink(self._lock_path)   # before unlocking: a waiter then sees a removed file
            f.close()

    @property
    def _state_file(self):
        return f"/run/{self.prefix}-cluster.json"

    @classmethod
    def existing(cls, prefix=DEFAULT_PREFIX):
        """The cluster of this prefix that ``up`` made (None if none is up)."""
        try:
            with open(f"/run/{prefix}-cluster.json") as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            return None
        return cls(cfg["hosts"], cfg["slots"], cfg["rate"], prefix, cfg.get("net", 0))

    def _create(self):
        with open(self._state_file, "w") as f:
            json.dump({"hosts": len(self.hosts), "slots": self.slots, "rate": self.rate, "net": self.net}, f)
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{self.address(h)} {h}\n" for h in self.hosts)
        for i, h in enumerate(self.hosts):
            _run(["ip", "netns", "add", h])
            os.makedirs(f"/etc/netns/{h}", exist_ok=True)
            with open(f"/etc/netns/{h}/hosts", "w") as f:
                f.write(hosts_file)
            port = f"p{i + 1}"
            # Created inside the switch namespace, one end then moved to the host:
            # no interface ever appears in the root namespace.
            _run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0"])
            _run(["ip", "-n", sw, "link", "set", "eth0", "netns", h])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", h, "addr", "add", f"{self.address(h)}/24", "dev", "eth0"])
            _run(["ip", "-n", h, "link", "set", "eth0", "up"])
            _run(["ip", "-n", h, "link", "set", "lo", "up"])
            if self.rate:
                self._limit(h, "eth0")      # host -> switch
                self._limit(sw, port)       # switch -> host

    def _limit(self, ns, dev):
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
              "rate", self.rate, "burst", "256kb", "latency", "10ms"])

    def set_rate(self, rate):
        """Changes every link's rate (None: unlimited) on a running cluster."""
        self.rate = rate
        for i, h in enumerate(self.hosts):
            for ns, dev in ((h, "eth0"), (self.switch, f"p{i + 1}")):
                if rate:
                    self._limit(ns, dev)
                else:
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)

    def set_link(self, host, up):
        """Cuts (up=False) or restores a host's link: its cable pulled at the switch."""
        port = f"p{self.hosts.index(host) + 1}"
        _run(["ip", "-n", self.switch, "link", "set", port, "up" if up else "down"])

    def _is_mine(self, name):
        """A namespace or /etc/netns entry of this prefix: "<prefix>-sw" or "<prefix>-h<N>", any N
        (an earlier cluster of this prefix may have had more hosts)."""
        return name == self.switch or re.fullmatch(re.escape(self.prefix) + r"-h\d+", name) is not None

    def down(self, wait=LOCK_WAIT_S):
        """Removes every namespace, link, hosts file and process of this prefix, and nothing of
        another prefix. Idempotent. Waits (up to ``wait`` s) while another owner uses the prefix."""
        self._acquire(wait)
        try:
            self._remove()
        finally:
            self._release()

    def _remove(self):
        mine = [ns for ns in _namespaces() if self._is_mine(ns)]
        for ns in mine:
            self.kill_host(ns)
        for ns in mine:
            _run(["ip", "netns", "del", ns], check=False)   # deletes its veth ends with it
        if os.path.isdir("/etc/netns"):
            for name in os.listdir("/etc/netns"):
                if self._is_mine(name):
                    shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
        if os.path.exists(self._state_file):
            os.remove(self._state_file)
        self._remove_open_mpi_session_folders()
        self._remove_open_mpi_shared_memory_files()

    def _remove_open_mpi_session_folders(self):
        """Open MPI's daemons keep their session folder (prted.<pid>, holding pmix.<hostname>.*
        files) in the host's /tmp; one killed (a lost host, or down() itself) leaves it behind."""
        for tmp in {"/tmp", tempfile.gettempdir()}:
            for folder in glob.glob(os.path.join(tmp, "prted.*")):
                try:
                    names = os.listdir(folder)
                except OSError:
                    continue
                if any(n.startswith("pmix.") and self._is_mine(n.split(".")[1]) for n in names):
                    shutil.rmtree(folder, ignore_errors=True)

    def _remove_open_mpi_shared_memory_files(self):
        """Open MPI's shared-memory transport keeps a file per rank in /dev/shm
        (sm_segment.<hostname>.<uid>.<job>.<rank>), removed by its launcher when the job ends; ranks
        of a host that was killed, or whose launcher crashed, leave theirs behind (the pretend hosts
        share the machine's /dev/shm)."""
        for path in glob.glob(os.path.join(SHARED_MEMORY_DIR, "sm_segment.*")):
            if self._is_mine(os.path.basename(path).split(".")[1]):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def kill_host(self, host, signal_name="KILL"):
        """Sends a signal (default SIGKILL) to every process running in a host's namespace."""
        pids = self.pids(host)
        if pids:
            subprocess.run(["kill", f"-{signal_name}", *map(str, pids)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return pids

    def pids(self, host):
        """Processes running in a host's namespace now."""
        r = _run(["ip", "netns", "pids", host], check=False)
        return [int(p) for p in r.stdout.split() if p.isdigit()] if r.returncode == 0 else []

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    # -- launching ----------------------------------------------------------
    def address(self, host):
        return f"10.231.{self.net}.{self.hosts.index(host) + 1}"

    def host_list(self, slots=None, hosts=None):
        """``h1:S,h2:S,...`` for ``mpirun --host``: every host, or the first ``hosts`` of them."""
        return ",".join(f"{h}:{slots or self.slots}" for h in self.hosts[:hosts])

    def write_hostfile(self, path, slots=None, hosts=None):
        """An Open MPI hostfile (``h1 slots=S`` per line) for ``mpirun --hostfile``: every host,
        or the first ``hosts`` of them."""
        with open(path, "w") as f:
            f.writelines(f"{h} slots={slots or self.slots}\n" for h in self.hosts[:hosts])
        return path

    def command(self, argv, host=None):
        """argv run on ``host`` (default the first), with that hostname, and with Open MPI's
        launcher pointed at the ssh stand-in, so ``mpirun --host ...`` reaches the other hosts."""
        host = host or self.hosts[0]
        cpus = ",".join(map(str, self.cpus(host)))
        return ["ip", "netns", "exec", host, "unshare", "--uts", "taskset", "-c", cpus, "sh", "-c",
                f'hostname {host} && exec "$@"', "sh", *argv]

    def cpus(self, host):
        """The CPUs a host's processes may run on: a share of this machine's, as its own cores.

        Real hosts do not share cores. Without this, every pretend host's Open MPI binds its
        first rank to core 0 of the same machine, and two busy-polling ranks on one core
        alternate at the scheduler tick (4 ms round trips).
        """
        allowed = sorted(os.sched_getaffinity(0))
        i, n = self.hosts.index(host), len(self.hosts)
        if len(allowed) >= n:
            per = len(allowed) // n
            return allowed[i * per:(i + 1) * per]
        return [allowed[i % len(allowed)]]       # more hosts than cores: hosts share a core

    def env(self, base=None, clean_remote_env=False):
        """The environment for :meth:`command`: Open MPI's ssh agent set to :data:`AGENT`,
        and each host's CPU share for the agent (TF_MPI_CLUSTER_CPUS_<host>).

        clean_remote_env: processes started on the other hosts get a login's environment, as
        through a real ssh, rather than a copy of the launcher's: what the ranks need must be
        passed with ``mpirun -x NAME``. (Ranks on the first host share mpirun's, as on a real
        cluster.) The login's TMPDIR is the launcher's: the hosts share one file system, and
        temporary files stay under the test session's folder."""
        env = dict(os.environ if base is None else base)
        env["PRTE_MCA_plm_ssh_agent"] = AGENT
        env["TF_MPI_CLUSTER_CLEAN_ENV"] = "1" if clean_remote_env else "0"
        for h in self.hosts:
            env[_cpus_variable(h)] = ",".join(map(str, self.cpus(h)))
        # Open MPI takes every host to have the launching host's topology and binds each
        # host's first rank to "core 0": on pretend hosts that is one physical core for all
        # of them. Each host's CPU share (taskset) is its binding instead.
        env.setdefault("PRTE_MCA_hwloc_default_binding_policy", "none")
        # More ranks than a host has cores: let idle ranks yield, as Open MPI does when it
        # sees oversubscription itself (it cannot here: the slots were declared).
        if any(self.slots > len(self.cpus(h)) for h in self.hosts):
            env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        return env


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["up", "down", "run", "check"])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--rate", default=None, help="tc rate per link, e.g. 1gbit (default unlimited)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--net", type=int, default=0, help="third octet of the hosts' 10.231.NET.0/24 addresses")
    p.add_argument("--host", default=None, help="run: the host to run on (default the first)")
    p.epilog = "run: python tests/cluster.py run [--host H] -- COMMAND..."
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    c = Cluster(a.hosts, a.slots, a.rate, a.prefix, a.net)
    if a.action == "run":
        c = Cluster.existing(a.prefix)
        if c is None:
            p.error(f"no cluster '{a.prefix}' is up: run `python tests/cluster.py up` first")
    if a.action == "check":
        reason = unavailable_reason(need_rate=a.rate is not None)
        print(reason or "pretend hosts can be made here")
        return 1 if reason else 0
    if a.action == "up":
        c.up()
        again = "" if a.prefix == DEFAULT_PREFIX else f" --prefix {a.prefix}"
        print(f"hosts: {c.host_list()}  (python tests/cluster.py run{again} -- CMD runs CMD on {c.hosts[0]})")
        return 0
    if a.action == "down":
        c.down()
        return 0
    cmd = command
    if not cmd:
        p.error("run needs a command")
    if cmd[0] == "python":
        cmd[0] = sys.executable
    return subprocess.call(c.command(cmd, a.host), env=c.env())


if __name__ == "__main__":
    sys.exit(main())
