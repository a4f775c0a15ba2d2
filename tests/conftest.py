"""Starts the launches the selected tests need before the first test runs.

A test module that defines prefetch(items) gets its selected items (in run order) and starts its
launches in the background there (mpi_harness.shared_launch(..., start=True)); its tests then take
the shared results. Modules are asked in run order, so the launches start in the order the tests
need them, except those marked long (sections launches first, then the Keras worker, compression at
np=5), which are queued first so that they do not end the session alone; a test whose launch no pool
thread has taken yet runs it itself. Nothing is launched for --collect-only.
"""
import mpi_harness


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
