"""Run at start-up by every Python process the test harness launches (tests/mpi_harness.py puts
this folder first on PYTHONPATH): makes a short-lived process that imports TensorFlow cheaper to
start and to end. Nothing here changes what a rank computes.

Most of the test suite's CPU time is ranks starting and ending (some 200 of them per run, each a
few seconds of work), and most of that is TensorFlow's import and the interpreter's exit:

- TensorFlow imports Keras, and Keras' plotting helpers import matplotlib.pyplot when matplotlib
  is installed (tf_mpi's timeline plot needs it): about 0.3 s of CPU for helpers no rank calls.
  An import of matplotlib made directly by a module of keras.src.visualization is refused, which
  Keras handles (its plotting module becomes None); every other import of matplotlib, by tf_mpi's
  tools or an example, goes through as usual.
- Python's cyclic garbage collector walks the ~500,000 objects the import creates, several times
  while it runs and again at exit: about 1.2 s of CPU per process (measured: `import tensorflow`
  then exit, 3.2-3.8 s of CPU with only the refusal above, 2.0-2.3 s with this too). The collector is paused while
  `tensorflow` is imported, and what the import created is then frozen (gc.freeze: left out of
  later collections; reference counting still frees it); the collector then runs as usual for
  everything created afterwards.
"""
import gc
import sys

_PLOTTING = "keras.src.visualization"


class _StartUpFinder:
    """A meta path finder that sees imports before the standard ones do."""

    def __init__(self):
        self._finding_tensorflow = False

    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            self._refuse_for_keras_plotting(name)
            return None
        if name == "tensorflow" and not self._finding_tensorflow:
            return self._tensorflow_spec()
        return None

    @staticmethod
    def _refuse_for_keras_plotting(name):
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith(_PLOTTING):
            raise ImportError(f"{name} is not imported for {importer} in test ranks (tests/rank_site)")

    def _tensorflow_spec(self):
        import importlib.util
        self._finding_tensorflow = True  # find the real spec without coming back here
        try:
            spec = importlib.util.find_spec("tensorflow")
        finally:
            self._finding_tensorflow = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                run_module(module)
            finally:
                gc.freeze()
                if was_enabled:
                    gc.enable()
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _StartUpFinder())
