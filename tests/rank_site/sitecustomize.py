"""Run at start-up by every Python process the test harness launches (tests/mpi_harness.py puts
this folder first on PYTHONPATH), and by the pytest process itself (tests/conftest.py loads it
before the test modules): makes a process that imports TensorFlow cheaper to start and to end.
Nothing here changes what a rank computes.

Most of the test suite's CPU time is ranks starting and ending (some 200 of them per run, each a
few seconds of work), and most of that is TensorFlow's import and the interpreter's exit:

- TensorFlow's import pulls in optional packages for helpers no rank calls, each imported inside
  `try: ... except ImportError` by the module that wants it: Keras' plotting helpers import
  matplotlib.pyplot (installed for tf_mpi's timeline plot; ~0.3 s of CPU), Keras' notebook
  detection IPython (~0.16 s where IPython is installed), the legacy tf.keras engine scipy.sparse
  (~0.09 s). An import of one of these made directly by the module named in _OPTIONAL below is
  refused, which that module handles (it sets the name to None); every other import of the same
  package, by tf_mpi's tools, a test or an example, goes through as usual.
- Python's cyclic garbage collector walks the ~500,000 objects the import creates, several times
  while it runs and again at exit: about 1.2 s of CPU per process (measured: `import tensorflow`
  then exit, 3.2-3.8 s of CPU with only the plotting refusal, 2.0-2.3 s with this too). The
  collector is paused while `tensorflow` is imported, and what the import created is then frozen
  (gc.freeze: left out of later collections; reference counting still frees it); the collector
  then runs as usual for everything created afterwards.
- TensorFlow's generated op modules declare ~18,000 TypeVar constraints as strings naming a few
  dtypes ("_atypes.Float32", ...), and typing compiles each string anew: ~0.1 s of CPU. While
  `tensorflow` is imported, typing's ForwardRef reuses the code object of a string compiled before
  (code objects are immutable); afterwards typing uses the builtin compile again.
"""
import functools
import gc
import sys

# package -> the modules (or module prefixes) whose own `import package` is refused
_OPTIONAL = {
    "matplotlib": ("keras.src.visualization",),
    "IPython": ("keras.src.saving.file_editor",),
    "scipy": ("tensorflow.python.keras.engine.training_v1", "tensorflow.python.keras.engine.training_arrays_v1"),
}


@functools.lru_cache(maxsize=None)
def _compile_once(source, filename, mode):
    """compile() for typing.ForwardRef while TensorFlow is imported: its generated op modules name
    the same few dtypes as strings in ~18,000 TypeVar constraints, each compiled on its own."""
    return compile(source, filename, mode)


class _StartUpFinder:
    """A meta path finder that sees imports before the standard ones do."""

    def __init__(self):
        self._finding_tensorflow = False

    def find_spec(self, name, path=None, target=None):
        refused_for = _OPTIONAL.get(name.partition(".")[0])
        if refused_for:
            self._refuse_if_imported_by(refused_for, name)
            return None
        if name == "tensorflow" and not self._finding_tensorflow:
            return self._tensorflow_spec()
        return None

    @staticmethod
    def _refuse_if_imported_by(importers, name):
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith(importers):
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
            import typing
            was_enabled = gc.isenabled()
            gc.disable()
            typing.compile = _compile_once  # found before the builtin by typing.ForwardRef
            try:
                run_module(module)
            finally:
                del typing.compile
                gc.freeze()
                if was_enabled:
                    gc.enable()
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _StartUpFinder())
