#include "execution/response_cache.h"

namespace tfmpi {

std::optional<uint32_t> ResponseCache::Lookup(const RequestMeta& submitted, int rank) const {
  if (submitted.type == CollectiveType::kAlltoall) return std::nullopt;  // never cached (see Put)
  auto it = ids_.find(submitted.name);
  if (it == ids_.end()) return std::nullopt;
  const Response& r = entries_[it->second];
  if (!FirstDifference(r.meta, submitted).empty()) return std::nullopt;
  for (size_t t = 0; t < r.dim0.size(); ++t)
    if (r.dim0[t].at(rank) != submitted.tensors[t].shape[0]) return std::nullopt;
  return it->second;
}

std::optional<uint32_t> ResponseCache::Find(const Response& r) const {
  auto it = ids_.find(r.meta.name);
  if (it == ids_.end()) return std::nullopt;
  const Response& c = entries_[it->second];
  if (!FirstDifference(c.meta, r.meta).empty() || c.dim0 != r.dim0) return std::nullopt;
  return it->second;
}

void ResponseCache::Put(const Response& r) {
  // Alltoall splits usually change from call to call; caching them would
  // only churn entries.
  if (r.meta.type == CollectiveType::kAlltoall) return;
  // Responses shaped by joined ranks (zeros, 0 rows) or join itself are one-offs.
  if (r.meta.type == CollectiveType::kJoin || !r.joined.empty()) return;
  auto it = ids_.find(r.meta.name);
  if (it != ids_.end()) {
    entries_[it->second] = r;
    return;
  }
  if (entries_.size() >= capacity_) return;
  ids_.emplace(r.meta.name, static_cast<uint32_t>(entries_.size()));
  entries_.push_back(r);
}

}  // namespace tfmpi
