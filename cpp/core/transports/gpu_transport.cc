#include "transports/gpu_transport.h"

#include <dlfcn.h>
#include <mpi.h>

#include <algorithm>

namespace tfmpi {

const char* GpuTransportName(GpuTransport t) { return t == GpuTransport::kDirect ? "direct" : "staged"; }

int MpiCudaAware() {
  // The MPI library is a dependency of this one, loaded with local scope, so
  // look its query functions up in the very library that defines MPI_Init.
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&MPI_Init), &info) || !info.dli_fname) return -1;
  void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) return -1;
  int answer = -1;
  using OmpiQuery = int (*)();
  using MpichQuery = int (*)(int, int*);
  if (auto q = reinterpret_cast<OmpiQuery>(dlsym(lib, "MPIX_Query_cuda_support"))) {
    answer = q() ? 1 : 0;
  } else if (auto q = reinterpret_cast<MpichQuery>(dlsym(lib, "MPIX_GPU_query_support"))) {
    int supported = 0;
    const int kMpixGpuSupportCuda = 0;  // MPIX_GPU_SUPPORT_CUDA in MPICH's mpi.h
    if (q(kMpixGpuSupportCuda, &supported) == MPI_SUCCESS) answer = supported ? 1 : 0;
  }
  dlclose(lib);
  return answer;
}

GpuTransportChoice ChooseGpuTransport(const std::string& setting) {
  GpuTransportChoice c;
  c.mpi_cuda_aware = MpiCudaAware();
  const char* said = c.mpi_cuda_aware == 1 ? "the MPI reports CUDA support"
                     : c.mpi_cuda_aware == 0 ? "the MPI reports no CUDA support"
                                             : "the MPI has no CUDA query";
  if (setting == "1") {
    c.transport = GpuTransport::kDirect;
    c.reason = std::string("direct: TF_MPI_CUDA_AWARE=1 (") + said + ")";
  } else if (setting == "0") {
    c.reason = std::string("staged: TF_MPI_CUDA_AWARE=0 (") + said + ")";
  } else {
    c.transport = c.mpi_cuda_aware == 1 ? GpuTransport::kDirect : GpuTransport::kStaged;
    c.reason = std::string(GpuTransportName(c.transport)) + ": " + said;
  }
  return c;
}

void* GpuCollectives::Fallback(int64_t bytes) {
  if (static_cast<int64_t>(fallback_.size()) < bytes) fallback_.resize(bytes);
  return fallback_.data();
}

void GpuCollectives::Allreduce(CudaDevice& dev, void* buf, int64_t count, DataType dtype, ReduceOp op,
                               GpuCounters* counters) {
  const int64_t elem = DataTypeSize(dtype);
  if (transport_ == GpuTransport::kDirect) {
    dev.Synchronize();  // fusion and scaling kernels have written `buf`
    mpi_->Allreduce(nullptr, buf, count, dtype, op);
    counters->direct_bytes += count * elem;
    return;
  }
  // Staged, pipelined: chunk k lives in pinned buffer k % D. Events (see
  // CudaDevice::Record): slot s = "buffer s holds its chunk on the host",
  // D + s = "buffer s's chunk is back on the device, the buffer is free".
  constexpr int D = CudaDevice::kPipelineDepth;
  const int64_t per_chunk = std::max<int64_t>(1, chunk_bytes_ / elem);
  const int64_t chunks = (count + per_chunk - 1) / per_chunk;
  char* dev_buf = static_cast<char*>(buf);
  void* host[D];
  for (int s = 0; s < D; ++s) {
    host[s] = dev.Pinned(s, std::min(count, per_chunk) * elem);
    if (!host[s]) host[s] = static_cast<char*>(Fallback(D * per_chunk * elem)) + s * per_chunk * elem;
  }
  auto elems = [&](int64_t k) { return std::min(per_chunk, count - k * per_chunk); };
  auto download = [&](int64_t k) {
    dev.Copy(CudaDevice::kEngine, host[k % D], dev_buf + k * per_chunk * elem, elems(k) * elem);
    dev.Record(CudaDevice::kEngine, static_cast<int>(k % D));
  };
  for (int64_t k = 0; k < std::min<int64_t>(D - 1, chunks); ++k) download(k);
  for (int64_t k = 0; k < chunks; ++k) {
    const int s = static_cast<int>(k % D);
    dev.HostWait(s);
    mpi_->Allreduce(nullptr, host[s], elems(k), dtype, op);
    dev.Copy(CudaDevice::kUpload, dev_buf + k * per_chunk * elem, host[s], elems(k) * elem);
    dev.Record(CudaDevice::kUpload, D + s);
    const int64_t next = k + D - 1;  // goes into the buffer chunk k-1 used
    if (next < chunks) {
      if (k >= 1) dev.StreamWait(CudaDevice::kEngine, D + static_cast<int>(next % D));
      download(next);
    }
  }
  // Later work on the engine stream (fusion copy-out, scaling) follows the last upload.
  if (chunks > 0) dev.StreamWait(CudaDevice::kEngine, D + static_cast<int>((chunks - 1) % D));
  counters->staged_bytes += 2 * count * elem;
}

void* GpuCollectives::Stage(CudaDevice& dev, int slot, void* ptr, int64_t bytes, bool copy_in,
                            GpuCounters* counters) {
  if (transport_ == GpuTransport::kDirect) {
    dev.Synchronize();
    counters->direct_bytes += bytes;
    return ptr;
  }
  void* view = dev.Pinned(slot, std::max<int64_t>(1, bytes));
  if (!view) view = Fallback(bytes);
  if (copy_in) {
    dev.Copy(CudaDevice::kEngine, view, ptr, bytes);
    counters->staged_bytes += bytes;
  }
  dev.Synchronize();
  return view;
}

void GpuCollectives::Unstage(CudaDevice& dev, void* ptr, void* view, int64_t bytes, GpuCounters* counters) {
  if (view == ptr) return;
  dev.Copy(CudaDevice::kEngine, ptr, view, bytes);
  counters->staged_bytes += bytes;
}

}  // namespace tfmpi
