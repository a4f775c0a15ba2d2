"""The collectives' GPU kernels are built and registered next to the CPU ones.

These GPU kernels cannot run on any machine this project has: every one runs
tensorflow-cpu, a TensorFlow built without GPU support, which creates no GPU
device to place them on. So they are build- and registration-tested only:
this checks that libtfmpi_tf.so, compiled against tensorflow-cpu's headers,
registers a GPU kernel for every collective op with the right host-memory
arguments, and that the CPU kernels are unchanged. Nothing here launches MPI.
"""
import pytest

import tf_mpi.ops  # noqa: F401  (loads libtfmpi_tf.so, registering the kernels)
from tensorflow.python.framework import kernels

COLLECTIVE_OPS = ("TfMpiAllreduce", "TfMpiGroupedAllreduce", "TfMpiAllgather", "TfMpiBroadcast",
                  "TfMpiAlltoall", "TfMpiReducescatter")


def _kernel(op, device):
    found = [k for k in kernels.get_registered_kernels_for_op(op).kernel if k.device_type == device]
    assert len(found) == 1, f"{op}: expected one {device} kernel, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("op", COLLECTIVE_OPS)
def test_gpu_kernel_registered(op):
    k = _kernel(op, "GPU")
    # The ops' T attributes restrict the types; the kernels add no constraint.
    assert not k.constraint, f"{op}: unexpected GPU type constraints {k.constraint}"


@pytest.mark.parametrize("op", COLLECTIVE_OPS)
def test_cpu_kernel_unchanged(op):
    k = _kernel(op, "CPU")
    assert not k.constraint
    assert list(k.host_memory_arg) == (["splits"] if op == "TfMpiAlltoall" else [])


def test_alltoall_gpu_splits_in_host_memory():
    # The engine reads splits and writes received_splits on the host.
    assert set(_kernel("TfMpiAlltoall", "GPU").host_memory_arg) == {"splits", "received_splits"}


@pytest.mark.parametrize("op", [o for o in COLLECTIVE_OPS if o != "TfMpiAlltoall"])
def test_other_gpu_kernels_keep_all_tensors_on_device(op):
    assert not _kernel(op, "GPU").host_memory_arg
