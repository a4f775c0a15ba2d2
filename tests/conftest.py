"""Starts the launches the selected tests need before the first test runs.

A test module that defines prefetch(items) gets its selected items (in run order) and starts its
launches in the background there (mpi_harness.shared_launch(..., start=True)); its tests then take
the shared results. Modules are asked in run order (EARLY_MODULES first, then file order), so the
launches start in the order the tests need them, except those marked long (sections launches, the
Keras worker, compression at np=5), which are queued first so that they do not end the session
alone; a test whose launch no pool thread has taken yet runs it itself. Nothing is launched for --collect-only.
"""
import mpi_harness


# Modules run first, before the others in their usual order. Their launches are examples trained
# end to end: CPU-bound and run one after the other by the test thread, while the pool runs the
# joint launches (minutes, mostly waiting: np=3 on 2 cores kept ~0.6 of a core busy), which the
# first module in file order (test_allreduce) would otherwise wait for with the test thread idle.
# Only these: the modules that kill ranks, hosts or links (cluster, faults, elastic) assert on
# detection and recovery times, and keep their place after the joint launches rather than share
# the cores with their five ranks.
EARLY_MODULES = ("test_examples", "test_examples_disruption", "test_examples_horovod_migration")


def pytest_collection_modifyitems(session, config, items):
    items[:] = sorted(items, key=lambda item: getattr(item.module, "__name__", None) not in EARLY_MODULES)


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
