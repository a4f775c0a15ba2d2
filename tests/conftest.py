"""Starts the launches the selected tests need before the first test runs.

A test module that defines prefetch(items) gets its selected items (in run order) and starts its
launches in the background there (mpi_harness.shared_launch(..., start=True)); its tests then take
the shared results. Modules are asked in run order, so the launches start in the order the tests
need them, except those marked long (sections launches first, then the Keras worker, compression at
np=5), which are queued first so that they do not end the session alone; a test whose launch no pool
thread has taken yet runs it itself. Nothing is launched for --collect-only.

Every temporary file and folder of the session (the tests', the launched ranks', Open MPI's session
folders) goes under one folder, removed when the session ends, so that a run leaves nothing in /tmp.
"""
import os
import shutil
import tempfile

_SESSION_TMP = tempfile.mkdtemp(prefix="tfmpi-suite-")
os.chmod(_SESSION_TMP, 0o755)        # a check run as another user reads a copy placed inside it
tempfile.tempdir = _SESSION_TMP      # this process: tempfile.mkdtemp and friends
os.environ["TMPDIR"] = _SESSION_TMP  # what it launches (mpirun, ranks, examples)

import mpi_harness  # noqa: E402  (after TMPDIR: the harness and what it starts use it)


# This process imports TensorFlow too (collecting the modules that test tf_mpi's Python layers
# in-process, before any launch can start): with tests/rank_site, as every launched rank.
mpi_harness.start_up_as_the_ranks_do()


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    by_module = {}
    for item in session.items:
        by_module.setdefault(getattr(item, "module", None), []).append(item)
    mpi_harness.hold_starts()
    try:
        for module, items in by_module.items():
            prefetch = getattr(module, "prefetch", None)
            if prefetch is not None:
                prefetch(items)
    finally:
        mpi_harness.release_starts()


def pytest_sessionfinish(session):
    mpi_harness.stop_background_launches()


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)
