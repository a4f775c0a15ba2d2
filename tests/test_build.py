"""The build fails at once, with a message that says what to install, when
TensorFlow or an MPI compiler is missing."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(env_updates, tmp_path):
    env = dict(os.environ, **env_updates)
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_missing_mpi_compiler_is_reported(tmp_path):
    r = build({"TF_MPI_MPICXX": "/nonexistent/mpicxx"}, tmp_path)
    assert r.returncode != 0
    assert "TF_MPI_MPICXX=/nonexistent/mpicxx is not an executable MPI C++ compiler wrapper" in r.stderr


def test_missing_tensorflow_is_reported(tmp_path):
    # A package named tensorflow that fails to import shadows the real one.
    fake = tmp_path / "fake"
    (fake / "tensorflow").mkdir(parents=True)
    (fake / "tensorflow" / "__init__.py").write_text("raise ImportError('No module named tensorflow')\n")
    r = build({"PYTHONPATH": str(fake)}, tmp_path)
    assert r.returncode != 0
    assert "TensorFlow is not importable" in r.stderr and "pip install tensorflow-cpu==2.21.0" in r.stderr
