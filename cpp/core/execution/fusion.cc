#include "execution/fusion.h"

#include <map>
#include <tuple>

namespace tfmpi {

std::vector<FusionBucket> PlanFusion(const std::vector<FusionItem>& items, int64_t threshold, int64_t direct_bytes) {
  std::vector<FusionBucket> out;
  // Open bucket per (dtype, op, memory); buckets are emitted in order of their first item.
  std::map<std::tuple<DataType, ReduceOp, bool>, size_t> open;
  for (size_t i = 0; i < items.size(); ++i) {
    const FusionItem& it = items[i];
    // GPU tensors are fused whatever their size: the copies into the buffer
    // run at device-memory speed, far above the transfer's, and each bucket
    // costs a round trip to the host (staged) or a stream synchronisation.
    const bool large = direct_bytes > 0 && it.bytes >= direct_bytes && !it.gpu;
    if (threshold <= 0 || it.bytes >= threshold || large) {
      FusionBucket b;
      b.items = {i};
      b.direct = true;
      b.bytes = it.bytes;
      out.push_back(std::move(b));
      continue;
    }
    const ReduceOp op = it.op == ReduceOp::kAverage ? ReduceOp::kSum : it.op;
    auto key = std::make_tuple(it.dtype, op, it.gpu);
    auto found = open.find(key);
    if (found == open.end() || out[found->second].bytes + it.bytes > threshold) {
      out.emplace_back();
      found = open.insert_or_assign(key, out.size() - 1).first;
    }
    FusionBucket& b = out[found->second];
    b.items.push_back(i);
    b.bytes += it.bytes;
  }
  // A bucket that ended up with one tensor needs no copies either.
  for (auto& b : out) if (b.items.size() == 1) b.direct = true;
  return out;
}

}  // namespace tfmpi
