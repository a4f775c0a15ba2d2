#include "negotiation/rank_ranges.h"

#include <algorithm>

namespace tfmpi {

void RankRanges::Add(int32_t lo, int32_t hi) {
  if (lo >= hi) return;
  // The ranges that touch or overlap [lo, hi) merge into one.
  auto first = std::lower_bound(ranges_.begin(), ranges_.end(), lo,
                                [](const Range& r, int32_t x) { return r.second < x; });
  auto last = first;
  while (last != ranges_.end() && last->first <= hi) {
    lo = std::min(lo, last->first);
    hi = std::max(hi, last->second);
    count_ -= last->second - last->first;
    ++last;
  }
  first = ranges_.erase(first, last);
  ranges_.insert(first, {lo, hi});
  count_ += hi - lo;
}

bool RankRanges::Contains(int32_t rank) const { return Overlaps(rank, rank + 1); }

bool RankRanges::Overlaps(int32_t lo, int32_t hi) const {
  auto it = std::lower_bound(ranges_.begin(), ranges_.end(), lo,
                             [](const Range& r, int32_t x) { return r.second <= x; });
  return it != ranges_.end() && it->first < hi;
}

RankRanges RankRanges::Minus(const RankRanges& other) const {
  RankRanges out;
  for (const Range& r : ranges_) {
    int32_t lo = r.first;
    for (const Range& o : other.ranges_) {
      if (o.second <= lo || o.first >= r.second) continue;
      if (o.first > lo) out.Add(lo, o.first);
      lo = std::max(lo, o.second);
    }
    if (lo < r.second) out.Add(lo, r.second);
  }
  return out;
}

}  // namespace tfmpi
