"""Runs several workers, one after the other, in one launch (one TensorFlow import per rank).

argv[1] is a JSON list of sections, {"name", "worker", "args", "env"}: for each one, on every
rank, this sets the section's environment (all of os.environ is restored afterwards), points TF_MPI_TEST_OUT at
<out>/<name>/ and runs tests/workers/<worker> as __main__ with sys.argv = [worker, *args], so the
worker's run_checks writes that section's rank<N>.json there, exactly as if it had been launched
alone. Between sections every rank shuts the engine down if it is up, meets the others (a
nonblocking mpi4py barrier tested between naps), and rank 0 writes a marker line to stderr (where
the engine logs too), so that the launch's output can be cut into sections
(mpi_harness.MpiRun.section).

A section that raises (at import, or SystemExit with a non-zero code) is reported on stderr and the
next one still runs; the launch then exits 1, so its clean-exit tests fail. When any section's
worker sets TensorFlow's intra-op threads to 1, the launch does so before the first section
(TensorFlow refuses a change once started), so the sections can run in any order. Each check's result
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


def _meet_the_others():
    """A barrier that sleeps while it waits: ranks end a section seconds apart on a loaded machine,
    and a blocking MPI barrier polls (Open MPI spins when ranks share cores), taking CPU from the
    ranks still at work."""
    request = _world().Ibarrier()
    nap = 20e-6
    while not request.Test():
        time.sleep(nap)
        nap = min(2 * nap, 2e-3)


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
    # What a fresh process would not have: the grouping plan's cost model measured (and cached) by an
    # earlier section under its settings, and Keras's layer-name counters.
    if "tf_mpi.policy.grouping" in sys.modules:
        sys.modules["tf_mpi.policy.grouping"]._cost_model = None
    if "keras" in sys.modules:
        sys.modules["keras"].backend.clear_session()
    _meet_the_others()
    time.sleep(0.2)  # lets the launcher forward every rank's last lines before the next marker
    _count_stats_from_here()


# Fields of _core.stats() that are not counters (a largest value): left as they are.
_NOT_COUNTERS = {"inline_max_batch_bytes"}


def _count_stats_from_here():
    """The engine's counters (_core.stats()) count since process start, and a shutdown does not reset
    them; from here on _core.stats() gives what each counter added since this call, as it would in a
    process that started now."""
    core = sys.modules.get("tf_mpi._core")
    if core is None:
        return
    stats = getattr(core.stats, "since_process_start", core.stats)
    base = stats()

    def since_section_start():
        now = stats()
        return {k: v if k in _NOT_COUNTERS else v - base.get(k, 0) for k, v in now.items()}
    since_section_start.since_process_start = stats
    since_section_start.__doc__ = stats.__doc__
    core.stats = since_section_start


def main():
    sections = json.loads(sys.argv[1])
    out = os.environ.get("TF_MPI_TEST_OUT")
    rank, failed = _rank(), []
    # TensorFlow refuses another intra-op thread count once it has started: when a section's worker
    # asks for 1 (most do, for repeatable timings), the whole launch runs with 1 from the start.
    if any("set_intra_op_parallelism_threads(1)" in open(os.path.join(HERE, s["worker"])).read() for s in sections):
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
    spent = {}  # section -> [seconds, CPU seconds of this process], from the end of the one before
    for k, section in enumerate(sections):
        name = section["name"]
        start, start_cpu = time.time(), time.process_time()
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
        spent[name] = [round(time.time() - start, 3), round(time.process_time() - start_cpu, 3)]
    if out:
        with open(os.path.join(out, f"sections.rank{rank}.json"), "w") as f:
            json.dump(spent, f)  # where the launch's time went (mpi_harness: TF_MPI_TEST_LAUNCH_LOG)
    sys.stdout.flush()
    sys.stderr.flush()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
