#include "transports/device.h"

#include "common/scale.h"

namespace tfmpi {

void* HostDevice::Scratch(int64_t bytes) {
  if (static_cast<int64_t>(scratch_.size()) < bytes) scratch_.resize(bytes);
  return scratch_.data();
}

void HostDevice::ScaleCopy(const std::vector<ScaleCopyItem>& items, DataType dtype) {
  for (const ScaleCopyItem& it : items) tfmpi::ScaleCopy(it.dst, it.src, it.count, dtype, it.factor);
}

void HostDevice::FillIdentity(void* dst, int64_t count, DataType dtype, ReduceOp op) {
  tfmpi::FillIdentity(dst, count, dtype, op);
}

}  // namespace tfmpi
