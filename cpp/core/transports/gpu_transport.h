// How GPU buffers reach MPI. The transport is chosen once, at init:
//
//   direct  device pointers go to MPI; only when the MPI says at run time that
//           it is CUDA-aware (Open MPI's MPIX_Query_cuda_support, MPICH's
//           MPIX_GPU_query_support), or TF_MPI_CUDA_AWARE=1 says so.
//   staged  through the engine's pinned host buffers. An allreduce is
//           pipelined by chunk: the device-to-host copy of chunk k+1 and the
//           host-to-device copy of chunk k-1 run while MPI reduces chunk k.
//           Other collectives stage their whole buffers once.
//
// Fusion and scaling happen on the device either way (executor.cc), so each
// collective crosses to the host once, not once per tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transports/collectives.h"
#include "transports/cuda_device.h"

namespace tfmpi {

enum class GpuTransport : uint8_t { kStaged = 0, kDirect = 1 };
const char* GpuTransportName(GpuTransport t);

struct GpuTransportChoice {
  GpuTransport transport = GpuTransport::kStaged;
  int mpi_cuda_aware = -1;  // the MPI's own answer: 1, 0, or -1 (it has no query)
  std::string reason;       // one line for the log and tf_mpi.gpu_transport()
};

// `setting` is TF_MPI_CUDA_AWARE: "auto", "0" or "1". Needs MPI initialised.
GpuTransportChoice ChooseGpuTransport(const std::string& setting);
// The MPI library's run-time answer (see above), resolved with dlsym so one
// build serves Open MPI and MPICH.
int MpiCudaAware();

// Counters for users and tests: bytes the staged transport copied between
// device and host, and bytes the direct transport handed to MPI in place.
struct GpuCounters {
  int64_t staged_bytes = 0;
  int64_t direct_bytes = 0;
};

class GpuCollectives {
 public:
  GpuCollectives(const Collectives* mpi, GpuTransport transport, int64_t chunk_bytes)
      : mpi_(mpi), transport_(transport), chunk_bytes_(chunk_bytes) {}
  GpuTransport transport() const { return transport_; }

  // Reduces `buf` (device memory of `dev`) across ranks, in place.
  void Allreduce(CudaDevice& dev, void* buf, int64_t count, DataType dtype, ReduceOp op, GpuCounters* counters);
  // A buffer MPI may use for `bytes` of device memory at `ptr`: `ptr` itself
  // (direct) or pinned slot `slot`, filled from `ptr` when `copy_in`. Returns
  // after everything queued on the device so far has finished.
  void* Stage(CudaDevice& dev, int slot, void* ptr, int64_t bytes, bool copy_in, GpuCounters* counters);
  // Queues the copy of `view` (from Stage) back to `ptr`; a no-op when direct.
  void Unstage(CudaDevice& dev, void* ptr, void* view, int64_t bytes, GpuCounters* counters);

 private:
  // Host memory that stands in for a staging buffer that could not be
  // allocated, so this rank still takes part in MPI (the collective then
  // fails with the device's error).
  void* Fallback(int64_t bytes);

  const Collectives* mpi_;
  GpuTransport transport_;
  int64_t chunk_bytes_;
  std::vector<char> fallback_;
};

}  // namespace tfmpi
