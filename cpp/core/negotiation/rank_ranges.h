// A set of ranks kept as sorted, disjoint half-open ranges [lo, hi). The
// negotiation tree (negotiation_tree.h) reports "ranks [lo, hi) announced
// cache id X" instead of one message per rank, and rank 0's Coordinator
// counts announcements by these ranges: a subtree's ranks are contiguous, so
// a whole job's announcements of one tensor are a handful of ranges, not N
// entries.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace tfmpi {

class RankRanges {
 public:
  using Range = std::pair<int32_t, int32_t>;  // [first, second)
  RankRanges() = default;
  static RankRanges Of(int32_t lo, int32_t hi) {
    RankRanges r;
    r.Add(lo, hi);
    return r;
  }

  // Adds [lo, hi); ranks already in the set stay as they are.
  void Add(int32_t lo, int32_t hi);
  void Add(const RankRanges& other) {
    for (const Range& r : other.ranges_) Add(r.first, r.second);
  }
  bool Contains(int32_t rank) const;
  // Whether any rank of [lo, hi) is in the set.
  bool Overlaps(int32_t lo, int32_t hi) const;
  // The ranks of this set that are not in `other`.
  RankRanges Minus(const RankRanges& other) const;
  int64_t count() const { return count_; }
  bool empty() const { return ranges_.empty(); }
  const std::vector<Range>& ranges() const { return ranges_; }
  void clear() { ranges_.clear(); count_ = 0; }

 private:
  std::vector<Range> ranges_;
  int64_t count_ = 0;
};

}  // namespace tfmpi
