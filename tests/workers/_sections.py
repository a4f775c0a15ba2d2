"""Runs several workers, one after the other, in one launch (one TensorFlow import per rank).

argv[1] is a JSON list of sections, {"name", "worker", "args", "env"}: for each one, on every
rank, this sets the section's environment (all of os.environ is restored afterwards), points TF_MPI_TEST_OUT at
<out>/<name>/ and runs tests/workers/<worker> as __main__ with sys.argv = [worker, *args], so the
worker's run_checks writes that section's rank<N>.json there, exactly as if it had been launched
alone. Between sections every rank meets the others (mpi4py barrier), shuts the engine down if it
is up, and rank 0 writes a marker line to stderr (where the engine logs too), so that the launch's
output can be cut into sections (mpi_harness.MpiRun.section).

A section that raises (at import, or SystemExit with a non-zero code) is reported on stderr and the
next one still runs; the launch then exits 1, so its clean-exit tests fail. Each check's result
stays its own: a check that breaks fails in its section's results whatever the other sections do.
"""
import json
import os
import runpy
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
MARKER = "TF_MPI_TEST_SECTION "


def _world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _rank():
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def _between_sections():
    """Every rank has finished the section, the engine is down, and the others' output is out."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "tf_mpi" in sys.modules:
        from tf_mpi import basics
        if basics.is_initialized():
            basics.shutdown()
    _world().Barrier()
    time.sleep(0.2)  # lets the launcher forward every rank's last lines before the next marker


def main():
    sections = json.loads(sys.argv[1])
    out = os.environ.get("TF_MPI_TEST_OUT")
    rank, failed = _rank(), []
    for k, section in enumerate(sections):
        name = section["name"]
        if k:
            _between_sections()
        if rank == 0:
            sys.stderr.write(f"{MARKER}{name}\n")
            sys.stderr.flush()
        saved = dict(os.environ)  # put back after the section, whatever it changed
        for key, value in section.get("env", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = str(value)
        if out:
            os.makedirs(os.path.join(out, name), exist_ok=True)
            os.environ["TF_MPI_TEST_OUT"] = os.path.join(out, name)
        path = os.path.join(HERE, section["worker"])
        sys.argv = [path, *section.get("args", [])]
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                failed.append(name)
                sys.stderr.write(f"[rank {rank}] section {name} exited with {e.code}\n")
        except BaseException:  # noqa: BLE001  (report it; the next section still runs)
            failed.append(name)
            sys.stderr.write(f"[rank {rank}] section {name} raised:\n{traceback.format_exc()}")
        os.environ.clear()
        os.environ.update(saved)
    sys.stdout.flush()
    sys.stderr.flush()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
