// The engine's side of its CUDA part: loading libtfmpi_cuda.so (cuda_api.h)
// on the first GPU request, and CudaDevice, the Device (device.h) of one GPU:
// the engine's own streams, events and pinned staging buffers.
//
// Threads: a CudaDevice is used only by whoever runs the executor, which
// holds the engine's progress lock (engine.h); the loader and
// RecordReadyEvent are safe from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transports/cuda_api.h"
#include "transports/device.h"

namespace tfmpi {

// True when libtfmpi_cuda.so was built and installed beside libtfmpi_core.so.
bool CudaPartInstalled();
// The CUDA part's function table, loaded once; nullptr with `why` set when it
// is missing or unusable (the message says how to build it).
const TfMpiCudaApi* CudaApi(std::string* why);

// Records an event on `stream` (a caller's cudaStream_t) for device
// `device`, so the engine's stream can wait for the work queued there so far.
// Leaves the calling thread's current device as it found it.
Status RecordReadyEvent(int device, void* stream, void** event);
// The device ordinal owning `ptr`, or -1 for host memory.
Status PointerDevice(const void* ptr, int* device);

// Makes `device` current on this thread for the guard's lifetime.
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device);
  ~ScopedCudaDevice();
 private:
  int previous_ = -1;
};

class CudaDevice : public Device {
 public:
  // The engine stream carries fusion copies, scaling and device-to-host
  // copies; the upload stream carries host-to-device copies, so that a staged
  // pipeline moves data both ways at once.
  enum StreamId { kEngine = 0, kUpload = 1 };
  static constexpr int kPipelineDepth = 3;  // pinned chunk buffers in flight

  // `managed_scratch`: the fusion buffer is managed memory (see executor.h).
  CudaDevice(const TfMpiCudaApi* api, int ordinal, bool managed_scratch);
  ~CudaDevice() override;

  int ordinal() const { return ordinal_; }
  bool is_host() const override { return false; }
  void* Scratch(int64_t bytes) override;
  void ScaleCopy(const std::vector<ScaleCopyItem>& items, DataType dtype) override;
  void FillIdentity(void* dst, int64_t count, DataType dtype, ReduceOp op) override;
  void Synchronize() override;
  Status TakeError() override;

  // The engine stream waits for `event` (a ready event from RecordReadyEvent),
  // which is then released.
  void WaitAndRelease(void* event);
  // Queues an asynchronous copy (any direction) on `stream`.
  void Copy(StreamId stream, void* dst, const void* src, int64_t bytes);
  // Pinned host buffer `slot` of at least `bytes`, reused across calls.
  // Slots 0..kPipelineDepth-1 are the pipeline's chunks; kSendSlot and
  // kRecvSlot stage whole buffers for the other collectives.
  static constexpr int kSendSlot = kPipelineDepth, kRecvSlot = kPipelineDepth + 1;
  void* Pinned(int slot, int64_t bytes);
  // Event `slot` (0 .. 2*kPipelineDepth-1) is recorded on `stream`; the host
  // or another stream can wait for it. The staged pipeline uses slot s for
  // "chunk buffer s reached the host" and kPipelineDepth + s for "chunk
  // buffer s went back to the device" (gpu_transport.cc).
  void Record(StreamId stream, int slot);
  void HostWait(int slot);
  void StreamWait(StreamId stream, int slot);
  bool failed() const { return !error_.ok(); }

 private:
  // Records the first failure; returns whether `code` is success.
  bool Check(int code, const char* what);

  const TfMpiCudaApi* api_;
  int ordinal_;
  bool managed_scratch_;
  std::array<void*, 2> streams_{};
  std::array<void*, 2 * kPipelineDepth> events_{};  // see Record()
  struct Buffer { void* ptr = nullptr; int64_t bytes = 0; };
  Buffer scratch_;
  std::array<Buffer, kPipelineDepth + 2> pinned_{};
  Status error_;
};

}  // namespace tfmpi
