// Where a collective's buffers live, and the few operations the executor
// needs on that memory: scratch space, scaled copies (fusion in and out,
// pre/postscale), identity fill, plain copies and a synchronisation point.
// The executor's fusion and scaling are written once against this
// interface. HostDevice does the work with the CPU, as the engine always has;
// CudaDevice (cuda_device.h) queues it on the engine's own CUDA stream.
//
// Errors are sticky, like CUDA's own: a failed operation records the first
// error and later operations of the same collective become no-ops, while the
// executor still runs every MPI step, so ranks stay in lockstep. The
// executor collects the error with TakeError() and fails the affected
// requests.
#pragma once

#include <cstdint>
#include <vector>

#include "common/types.h"

namespace tfmpi {

struct ScaleCopyItem {
  void* dst;
  const void* src;
  int64_t count;
  double factor;  // 1.0: plain copy (nothing when dst == src)
};

class Device {
 public:
  virtual ~Device() = default;
  virtual bool is_host() const = 0;
  // A buffer of at least `bytes` on this device, reused by later calls (and
  // invalidated by them): the fusion buffer.
  virtual void* Scratch(int64_t bytes) = 0;
  // dst = src * factor for every item, in order.
  virtual void ScaleCopy(const std::vector<ScaleCopyItem>& items, DataType dtype) = 0;
  virtual void FillIdentity(void* dst, int64_t count, DataType dtype, ReduceOp op) = 0;
  // Host code may touch the results of everything queued so far.
  virtual void Synchronize() = 0;
  // The first error since the last call, or OK.
  virtual Status TakeError() = 0;
};

// The CPU: every operation completes before it returns.
class HostDevice : public Device {
 public:
  bool is_host() const override { return true; }
  void* Scratch(int64_t bytes) override;
  void ScaleCopy(const std::vector<ScaleCopyItem>& items, DataType dtype) override;
  void FillIdentity(void* dst, int64_t count, DataType dtype, ReduceOp op) override;
  void Synchronize() override {}
  Status TakeError() override { return Status::OK(); }

 private:
  std::vector<char> scratch_;  // grows to the fusion threshold, then stays
};

}  // namespace tfmpi
