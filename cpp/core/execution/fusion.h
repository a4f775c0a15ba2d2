// Tensor fusion: which allreduce tensors share one MPI call.
//
// Ready tensors with the same dtype, MPI op and memory (host or GPU) are packed, in decision order,
// into buffers of at most `threshold` bytes. A tensor of `direct_bytes` or more
// (or one that alone reaches the threshold) is reduced from its own buffers:
// fusing it would save one MPI call's latency (tens of microseconds) but cost
// two copies of its bytes, which for large tensors costs more. On a GPU the
// copies are cheap beside the transfer, so only the threshold applies there. The plan is a
// pure function of the decisions and settings, so every rank computes the same one.
#pragma once

#include <cstdint>
#include <vector>

#include "common/types.h"

namespace tfmpi {

struct FusionItem {
  DataType dtype;
  ReduceOp op;      // Average and Sum share a bucket (both reduce with a sum)
  int64_t bytes;
  bool gpu = false; // GPU and host tensors never share a bucket (negotiated, so the same on every rank)
};

struct FusionBucket {
  std::vector<size_t> items;  // indices into the input, in order
  bool direct = false;        // a single tensor reduced without the fusion buffer
  int64_t bytes = 0;
};

std::vector<FusionBucket> PlanFusion(const std::vector<FusionItem>& items, int64_t threshold, int64_t direct_bytes);

}  // namespace tfmpi
