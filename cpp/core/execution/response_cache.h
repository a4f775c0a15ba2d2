// Negotiated responses remembered by every rank under the same ids, so that a
// steady-state step announces and decides tensors by small integer ids instead
// of names and shapes (Horovod's response cache idea).
//
// Every rank mutates its cache only while executing rank 0's decisions, in the
// same order, so ids agree everywhere. Entries are never evicted: an id, once
// given to a name, stays that name's (a changed shape updates it in place),
// which keeps in-flight announcements unambiguous. When full, new names simply
// negotiate in full.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/request.h"

namespace tfmpi {

class ResponseCache {
 public:
  explicit ResponseCache(size_t capacity) : capacity_(capacity) {}

  // Id of `name` if the cached response fits what `rank` submitted.
  std::optional<uint32_t> Lookup(const RequestMeta& submitted, int rank) const;
  // Id of `name` if its cached response equals `r` exactly.
  std::optional<uint32_t> Find(const Response& r) const;
  // Id of `name`, whatever its entry holds.
  std::optional<uint32_t> IdOf(const std::string& name) const {
    auto it = ids_.find(name);
    return it == ids_.end() ? std::nullopt : std::optional<uint32_t>(it->second);
  }
  const Response& Get(uint32_t id) const { return entries_.at(id); }
  bool Has(uint32_t id) const { return id < entries_.size(); }
  void Put(const Response& r);
  size_t size() const { return entries_.size(); }

 private:
  size_t capacity_;
  std::vector<Response> entries_;
  std::unordered_map<std::string, uint32_t> ids_;
};

}  // namespace tfmpi
