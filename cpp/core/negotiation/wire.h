// The two negotiation messages and their byte encoding.
//   towards rank 0 : a batch of Announcements (new or cached requests, control),
//                    sent to rank 0 (star) or to the parent in the tree, which
//                    relays them (negotiation_tree.h)
//   from rank 0    : a batch of Decisions (execution/decision.h), executed by every rank in order
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/request.h"
#include "execution/decision.h"
#include "negotiation/rank_ranges.h"

namespace tfmpi {

struct Announcement {
  // kCachedRanges: the ranks `ranks` announced `cache_id` (the tree's aggregate).
  enum class Kind : uint8_t { kFull = 0, kCached = 1, kShutdown = 2, kCachedRanges = 3 };
  Kind kind = Kind::kFull;
  RequestMeta meta;       // kFull
  uint32_t cache_id = 0;  // kCached, kCachedRanges
  int32_t origin = -1;    // kFull, kShutdown: the rank that announced it (a relay keeps it)
  RankRanges ranks;       // kCachedRanges
};

std::vector<char> Encode(const std::vector<Announcement>& items);
std::vector<char> Encode(const std::vector<Decision>& items);
void Decode(const std::vector<char>& bytes, std::vector<Announcement>* out);
void Decode(const std::vector<char>& bytes, std::vector<Decision>* out);

}  // namespace tfmpi
