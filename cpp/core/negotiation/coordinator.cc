#include "negotiation/coordinator.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>

#include "common/logging.h"

namespace tfmpi {

namespace {
std::string RankList(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

void Coordinator::AnnounceCached(const RankRanges& ranks, uint32_t cache_id, Clock::time_point now) {
  if (ranks.empty()) return;
  if (!cache_->Has(cache_id))
    throw std::runtime_error(RankList({ranks.ranges().front().first}) + " announced response-cache entry " +
                             std::to_string(cache_id) + ", which rank 0 does not have");
  const std::string& name = cache_->Get(cache_id).meta.name;
  if (departed_count_ > 0) {
    Announce(ranks.ranges().front().first, cache_->Get(cache_id).meta, now);  // fails it, as a full one would
    return;
  }
  Pending& p = Entry(name, now);
  RankRanges fresh = ranks.Minus(p.cached);
  for (const auto& [rank, meta] : p.full) fresh = fresh.Minus(RankRanges::Of(rank, rank + 1));
  if (fresh.count() != ranks.count())
    // The workers refuse duplicates locally, so this means a protocol bug.
    LogError("a rank in " + std::to_string(ranks.ranges().front().first) + ".." +
             std::to_string(ranks.ranges().back().second - 1) + " announced '" + name + "' twice");
  if (!p.cached.empty() && p.cache_id != cache_id) {
    LogError("'" + name + "' announced under two cache ids");
    return;
  }
  p.cache_id = cache_id;
  p.cached.Add(fresh);
  p.count += fresh.count();
  if (timeline_->active())
    for (const auto& [lo, hi] : fresh.ranges())
      for (int r = lo; r < hi; ++r) timeline_->Instant(name, "READY", now, "{\"rank\": " + std::to_string(r) + "}");
  Counted(name, p, now);
}

Coordinator::Pending& Coordinator::Entry(const std::string& name, Clock::time_point now) {
  auto [it, fresh] = pending_.try_emplace(name);
  if (fresh) it->second.first_seen = it->second.last_warned = now;
  return it->second;
}

void Coordinator::Announce(int rank, RequestMeta meta, Clock::time_point now) {
  const std::string name = meta.name;
  if (departed_count_ > 0) {
    Fail(name, "tf_mpi: collective '" + name + "' cannot complete: " + Gone(), StatusCode::kAborted);
    return;
  }
  if (meta.type == CollectiveType::kJoin) {
    Join(rank, now);
    return;
  }
  Pending& p = Entry(name, now);
  if (p.full.count(rank) || p.cached.Contains(rank)) {
    // The worker refuses duplicates locally, so this means a protocol bug.
    LogError("rank " + std::to_string(rank) + " announced '" + name + "' twice");
    return;
  }
  p.full.emplace(rank, std::move(meta));
  if (timeline_->active())
    timeline_->Instant(name, "READY", now, "{\"rank\": " + std::to_string(rank) + "}");
  ++p.count;
  Counted(name, p, now);
}

void Coordinator::Counted(const std::string& name, Pending& p, Clock::time_point now) {
  if (Complete(p)) {
    Decide(name, p, now);
    pending_.erase(name);
  }
}

std::vector<std::optional<RequestMeta>> Coordinator::ByRank(const Pending& p) const {
  std::vector<std::optional<RequestMeta>> by_rank(size_);
  for (const auto& [rank, meta] : p.full) by_rank[rank] = meta;
  if (p.cached.empty()) return by_rank;
  const Response& r = cache_->Get(p.cache_id);
  for (const auto& [lo, hi] : p.cached.ranges())
    for (int rank = lo; rank < hi; ++rank) {
      by_rank[rank] = r.meta;
      // Allgather: this rank's own first dimensions, as recorded in the cache.
      for (size_t t = 0; t < r.dim0.size(); ++t) by_rank[rank]->tensors[t].shape[0] = r.dim0[t][rank];
    }
  return by_rank;
}

const RequestMeta& Coordinator::AnyMeta(const Pending& p) const {
  if (!p.full.empty()) return p.full.begin()->second;
  return cache_->Get(p.cache_id).meta;
}

bool Coordinator::Complete(const Pending& p) const {
  if (joined_count_ == 0) return p.count == size_;
  int64_t stand_ins = 0;  // joined ranks that did not announce it
  for (int r = 0; r < size_; ++r)
    if (joined_[r] && !p.full.count(r) && !p.cached.Contains(r)) ++stand_ins;
  return p.count + stand_ins == size_;
}

void Coordinator::Join(int rank, Clock::time_point now) {
  if (!joined_[rank]) {
    joined_[rank] = true;
    ++joined_count_;
    last_joiner_ = rank;
  }
  if (timeline_->active()) timeline_->Instant(kJoinName, "READY", now, "{\"rank\": " + std::to_string(rank) + "}");
  // Collectives that only waited for this rank can run now, with its zeros.
  std::vector<std::string> ready;
  for (const auto& [name, p] : pending_)
    if (Complete(p)) ready.push_back(name);
  std::sort(ready.begin(), ready.end());  // deterministic order
  for (const std::string& name : ready) {
    Decide(name, pending_.at(name), now);
    pending_.erase(name);
  }
  if (joined_count_ < size_) return;
  Decision d;
  d.response.meta.name = kJoinName;
  d.response.meta.type = CollectiveType::kJoin;
  d.response.meta.root = last_joiner_;  // join() returns the last rank to join
  decisions_.push_back(std::move(d));
  joined_.assign(size_, false);
  joined_count_ = 0;
}

void Coordinator::Decide(const std::string& name, Pending& pending, Clock::time_point now) {
  if (pending.full.empty() && joined_count_ == 0) {
    // Every rank announced the cached response itself: it is decided as it is
    // (the ranks' own entries matched it, so the checks below all pass).
    if (timeline_->active())
      timeline_->Span(name, "NEGOTIATE", pending.first_seen, now, "{\"collective\": \"" +
                      std::string(CollectiveName(cache_->Get(pending.cache_id).meta.type)) +
                      "\", \"ranks\": " + std::to_string(size_) + "}");
    Decision d;
    d.kind = Decision::Kind::kExecuteCached;
    d.cache_id = pending.cache_id;
    decisions_.push_back(std::move(d));
    return;
  }
  // A rank announced in full or has joined: every rank's announcement, to compare.
  const std::vector<std::optional<RequestMeta>> by_rank = ByRank(pending);
  std::vector<int> announced;
  std::vector<int32_t> joined;
  for (int r = 0; r < size_; ++r) {
    if (by_rank[r]) announced.push_back(r);
    else joined.push_back(r);
  }
  const RequestMeta& ref = *by_rank[announced[0]];
  if (timeline_->active())
    timeline_->Span(name, "NEGOTIATE", pending.first_seen, now, "{\"collective\": \"" +
                    std::string(CollectiveName(ref.type)) + "\", \"ranks\": " + std::to_string(size_) + "}");
  // Agreement: report the first field on which any rank differs from rank 0,
  // with every rank's value, grouped.
  for (int r : announced) {
    std::string field = FirstDifference(ref, *by_rank[r]);
    if (field.empty()) continue;
    std::map<std::string, std::vector<int>> groups;
    for (int q : announced) groups[FieldValue(*by_rank[q], field)].push_back(q);
    std::ostringstream os;
    os << "tf_mpi: mismatched " << CollectiveName(ref.type) << " '" << name << "' across ranks: " << field
       << " differs:";
    for (const auto& [value, ranks] : groups) os << " " << RankList(ranks) << ": " << value << ";";
    Fail(name, os.str());
    return;
  }
  if (ref.type == CollectiveType::kBroadcast && (ref.root < 0 || ref.root >= size_)) {
    Fail(name, "tf_mpi: broadcast '" + name + "': root rank " + std::to_string(ref.root) +
                   " is out of range for " + std::to_string(size_) + " ranks");
    return;
  }
  if (!joined.empty() && ref.type != CollectiveType::kAllreduce && ref.type != CollectiveType::kAllgather) {
    Fail(name, "tf_mpi: " + std::string(CollectiveName(ref.type)) + " '" + name + "' cannot run while " +
                   RankList(std::vector<int>(joined.begin(), joined.end())) +
                   " have called join(); only allreduce and allgather can");
    return;
  }
  Decision d;
  d.response.meta = ref;
  d.response.joined = joined;
  if (ref.type == CollectiveType::kAllgather) {
    d.response.dim0.assign(ref.tensors.size(), std::vector<int64_t>(size_, 0));  // joined ranks: 0 rows
    for (size_t t = 0; t < ref.tensors.size(); ++t)
      for (int r : announced) d.response.dim0[t][r] = by_rank[r]->tensors[t].shape[0];
  }
  if (ref.type == CollectiveType::kAlltoall) {
    for (int r = 0; r < size_; ++r) d.response.splits.push_back(by_rank[r]->splits);
  }
  if (auto id = joined.empty() ? cache_->Find(d.response) : std::nullopt) {
    d.kind = Decision::Kind::kExecuteCached;
    d.cache_id = *id;
  } else {
    d.kind = Decision::Kind::kExecute;
  }
  decisions_.push_back(std::move(d));
}

void Coordinator::Fail(const std::string& name, const std::string& why, StatusCode code) {
  Decision d;
  d.kind = Decision::Kind::kError;
  d.error_code = code;
  d.response.kind = Response::Kind::kError;
  d.response.meta.name = name;
  d.response.error = why;
  decisions_.push_back(std::move(d));
}

void Coordinator::Departed(int rank) { Leave(rank, "called shutdown()"); }

void Coordinator::Unreachable(int rank, const std::string& detail) {
  Leave(rank, "is unreachable (" + detail + ")");
}

std::string Coordinator::Gone() const {
  std::map<std::string, std::vector<int>> groups;  // why -> ranks
  for (int r = 0; r < size_; ++r)
    if (departed_[r]) groups[gone_why_[r]].push_back(r);
  std::string out;
  for (const auto& [why, ranks] : groups) {
    std::string w = why;
    if (ranks.size() > 1 && w.compare(0, 3, "is ") == 0) w = "are " + w.substr(3);
    out += (out.empty() ? "" : "; ") + RankList(ranks) + " " + w;
  }
  return out;
}

void Coordinator::Leave(int rank, const std::string& why) {
  if (departed_[rank]) return;
  departed_[rank] = true;
  gone_why_[rank] = why;
  ++departed_count_;
  for (auto& [name, p] : pending_)
    Fail(name, "tf_mpi: collective '" + name + "' cannot complete: rank " + std::to_string(rank) + " " + why,
         StatusCode::kAborted);
  pending_.clear();
  Decision ack;
  ack.kind = Decision::Kind::kShutdownAck;
  ack.rank = rank;
  decisions_.push_back(std::move(ack));
}

std::vector<Decision> Coordinator::TakeDecisions() {
  std::vector<Decision> out;
  out.swap(decisions_);
  return out;
}

std::string Coordinator::Ranks(const Pending& p, bool announced) const {
  std::vector<int> ranks;
  for (int r = 0; r < size_; ++r)
    if ((p.full.count(r) || p.cached.Contains(r)) == announced) ranks.push_back(r);
  return RankList(ranks);
}

void Coordinator::CheckStalls(Clock::time_point now) {
  if (stall_warn_s_ <= 0 && stall_shutdown_s_ <= 0) return;
  std::ostringstream warn;
  std::vector<std::string> expired;
  for (auto& [name, p] : pending_) {
    const double waited = Seconds(now - p.first_seen);
    if (stall_shutdown_s_ > 0 && waited >= stall_shutdown_s_) {
      expired.push_back(name);
    } else if (stall_warn_s_ > 0 && Seconds(now - p.last_warned) >= stall_warn_s_) {
      p.last_warned = now;
      warn << "\n  '" << name << "' (" << CollectiveName(AnyMeta(p).type)
           << "): ready on " << Ranks(p, true) << ", waiting on " << Ranks(p, false) << " for "
           << static_cast<int>(waited) << " s";
    }
  }
  if (!warn.str().empty())
    LogWarning("stalled collectives: some ranks submitted these and others did not." + warn.str() +
               "\n  This usually means ranks run different code paths or different numbers of steps."
               " Set TF_MPI_STALL_SHUTDOWN_TIME_SECONDS to fail such ops instead of waiting.");
  for (const std::string& name : expired) {
    const Pending& p = pending_.at(name);
    Fail(name, "tf_mpi: collective '" + name + "' stalled for " +
                   std::to_string(static_cast<int>(Seconds(now - p.first_seen))) + " s: ready on " + Ranks(p, true) +
                   ", never submitted by " + Ranks(p, false) + " (TF_MPI_STALL_SHUTDOWN_TIME_SECONDS)",
         StatusCode::kAborted);
    LogError(decisions_.back().response.error);
    pending_.erase(name);
  }
}

}  // namespace tfmpi
