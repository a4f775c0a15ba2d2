"""Run at start-up by every Python process the test harness launches (tests/mpi_harness.py puts
this folder first on PYTHONPATH): keeps Keras' optional plotting import out of the ranks.

`import tensorflow` imports Keras, and Keras' plotting helpers import matplotlib.pyplot when
matplotlib is installed (tf_mpi's timeline plot needs it): about 0.3 s of CPU in every process,
some 200 of them per test run, for helpers no rank calls. The finder below refuses an import of
matplotlib made directly by a module of keras.src.visualization, which Keras handles (it sets
its plotting module to None); every other import of matplotlib, by tf_mpi's tools or an example,
goes through as usual.
"""
import sys

_REFUSED_FOR = "keras.src.visualization"


class _RefuseKerasPlotting:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "matplotlib" and not name.startswith("matplotlib."):
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith(_REFUSED_FOR):
            raise ImportError(f"matplotlib is not imported for {importer} in test ranks (tests/rank_site)")
        return None


sys.meta_path.insert(0, _RefuseKerasPlotting())
