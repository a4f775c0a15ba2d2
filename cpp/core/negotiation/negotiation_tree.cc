#include "negotiation/negotiation_tree.h"

#include <algorithm>

namespace tfmpi {

namespace {
int LowBit(int r) { return r & -r; }
}  // namespace

NegotiationTree::NegotiationTree(int rank, int size) {
  const int span = rank == 0 ? size : LowBit(rank);
  parent = rank == 0 ? -1 : rank - LowBit(rank);
  lo = rank;
  hi = static_cast<int32_t>(std::min<int64_t>(int64_t{rank} + span, size));
  for (int64_t step = 1; step < span && rank + step < size; step *= 2) children.push_back(static_cast<int>(rank + step));
}

CachedAnnouncements::Aggregate& CachedAnnouncements::At(uint32_t id, Clock::time_point now) {
  auto [it, fresh] = pending_.try_emplace(id);
  if (fresh) it->second.first_seen = now;
  dirty_.push_back(id);
  return it->second;
}

void CachedAnnouncements::AddCached(uint32_t id, const RankRanges& ranks, Clock::time_point now) {
  At(id, now).cached.Add(ranks);
}

void CachedAnnouncements::AddFull(uint32_t id, int32_t rank, Clock::time_point now) {
  At(id, now).full.Add(rank, rank + 1);
}

void CachedAnnouncements::Joined(int32_t rank) {
  joined_.Add(rank, rank + 1);
  all_dirty_ = true;
}

bool CachedAnnouncements::Complete(const Aggregate& a) const {
  int64_t accounted = a.cached.count() + a.full.count();
  if (!joined_.empty()) accounted += joined_.Minus(a.cached).Minus(a.full).count();
  return accounted >= hi_ - lo_;
}

std::vector<Announcement> CachedAnnouncements::TakeReports(Clock::time_point now) {
  // Aggregates are looked at when they change, and all of them every few
  // milliseconds for the flush time; in steady state only the changed ones.
  std::vector<uint32_t> look;
  const bool overdue_check = !pending_.empty() && now - last_overdue_check_ > std::chrono::milliseconds(10);
  if (all_dirty_ || overdue_check) {
    for (const auto& [id, a] : pending_) look.push_back(id);
    last_overdue_check_ = now;
  } else {
    look.swap(dirty_);
  }
  dirty_.clear();
  all_dirty_ = false;
  std::sort(look.begin(), look.end());
  look.erase(std::unique(look.begin(), look.end()), look.end());
  std::vector<Announcement> out;
  for (uint32_t id : look) {
    auto it = pending_.find(id);
    if (it == pending_.end()) continue;
    Aggregate& a = it->second;
    const bool complete = Complete(a);
    if (!complete && !a.flushed && now - a.first_seen < flush_after_) continue;
    RankRanges news = a.cached.Minus(a.reported);
    if (!news.empty()) {
      Announcement report;
      report.kind = Announcement::Kind::kCachedRanges;
      report.cache_id = id;
      report.ranks = news;
      out.push_back(std::move(report));
    }
    if (complete) {
      pending_.erase(it);
    } else {
      a.flushed = true;
      a.reported.Add(news);
    }
  }
  return out;
}

}  // namespace tfmpi
