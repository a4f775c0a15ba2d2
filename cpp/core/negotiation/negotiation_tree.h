// The negotiation tree: how announcements reach rank 0 and decisions reach
// every rank without rank 0 exchanging a message with every rank per batch.
//
// Star (TF_MPI_NEGOTIATION=star): every worker sends its announcements to
// rank 0, rank 0 sends each batch of decisions to every worker: per batch rank
// 0 handles 2(N-1) messages.
//
// Tree (the default): a binomial tree rooted at rank 0. The children of rank
// r > 0 are r + 2^j for every 2^j < lowbit(r); rank 0's are every 2^j < N; the
// parent of r is r - lowbit(r). Every subtree is the contiguous rank range
// [r, r + lowbit(r)) (clipped to N), depth and fan-out are log2 N, and at
// np = 2 and 3 the tree is the star.
//  - Decisions flow down: a rank forwards each batch to its children as it
//    receives it, before executing it. Messages between two ranks with one tag
//    are not overtaken (MPI), and each rank takes batches from one source at a
//    time, so every rank sees the batches in rank 0's order.
//  - Announcements by cache id (the steady state: every collective of a step
//    was negotiated before) flow up aggregated (CachedAnnouncements below): a
//    rank reports "ranks [lo, hi) announced cache id X" to its parent once its
//    whole subtree has, several ids per message. Rank 0 counts these ranges
//    (coordinator.h): O(log N) messages and O(log N) work per tensor.
//  - Everything else (full announcements, join, shutdown) travels up
//    unchanged with its origin rank, each rank relaying it on, so rank 0's
//    Coordinator sees exactly what the star gives it and its first-time,
//    mismatch, join and shutdown logic and messages are the same. Independent
//    tensors need no mutual order, so mixing relayed and aggregated items is
//    safe. A relayed full announcement of a cached name (a changed shape, a
//    mismatch) also counts its rank as accounted for in that id's aggregate,
//    so the other ranks' cached announcements go on to rank 0, which then
//    reports the mismatch naming ranks exactly as with the star.
//  - Join: a rank that called join() counts as having announced everything
//    in every aggregate containing it until the join completes (the join's
//    decision, which every rank executes). Its join announcement passes
//    through all its ancestors, which are exactly the ranks aggregating it.
//  - Stalls: an aggregate still partial after `flush_after` (a fraction of the
//    stall-check time) is sent on as it is, and then whatever arrives later,
//    so that rank 0 names the missing ranks as with the star.
//  - Departure: once a rank has shut down early, the tree has a hole. Its
//    ShutdownAck is in the decision stream, so every rank learns it at the same
//    batch; from then on the engine uses the star (protocol.cc): decisions from
//    rank 0 directly, announcements to rank 0 directly, and each rank
//    re-announces directly what it announced through the tree and is still
//    undecided. Rank 0 ignores tree messages from the moment it has seen a
//    departure, so nothing is counted twice.
#pragma once

#include <chrono>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "negotiation/rank_ranges.h"
#include "negotiation/wire.h"

namespace tfmpi {

struct NegotiationTree {
  NegotiationTree(int rank, int size);
  int parent = -1;            // -1 on rank 0
  std::vector<int> children;  // ascending
  int32_t lo = 0, hi = 0;     // this rank's subtree: ranks [lo, hi)
};

// A worker's aggregation of the cached announcements of its subtree (the
// ranks [tree.lo, tree.hi)). Used only by the protocol's holder.
class CachedAnnouncements {
 public:
  using Clock = std::chrono::steady_clock;
  CachedAnnouncements(const NegotiationTree& tree, Clock::duration flush_after)
      : lo_(tree.lo), hi_(tree.hi), flush_after_(flush_after) {}

  // `ranks` announced cache id `id`.
  void AddCached(uint32_t id, const RankRanges& ranks, Clock::time_point now);
  // `rank` announced the name of cache id `id` in full (its entry did not fit).
  void AddFull(uint32_t id, int32_t rank, Clock::time_point now);
  // `rank` called join(); JoinCompleted: the join's decision ran.
  void Joined(int32_t rank);
  void JoinCompleted() { joined_.clear(); }
  // `id` was decided (executed or failed): its next announcements are the next step's.
  void Decided(uint32_t id) { pending_.erase(id); }
  void Clear() { pending_.clear(); joined_.clear(); dirty_.clear(); }

  // The ranges to report to the parent now: for each id whose subtree is
  // accounted for, or whose aggregate is older than flush_after, the ranks
  // not reported yet.
  std::vector<Announcement> TakeReports(Clock::time_point now);

 private:
  struct Aggregate {
    RankRanges cached;    // announced by this id
    RankRanges full;      // announced the same name in full
    RankRanges reported;  // sent on already (a flushed, partial aggregate)
    Clock::time_point first_seen;
    bool flushed = false;
  };
  Aggregate& At(uint32_t id, Clock::time_point now);
  bool Complete(const Aggregate& a) const;

  int32_t lo_, hi_;
  Clock::duration flush_after_;
  std::unordered_map<uint32_t, Aggregate> pending_;
  RankRanges joined_;
  std::vector<uint32_t> dirty_;  // ids changed since the last TakeReports
  bool all_dirty_ = false;
  Clock::time_point last_overdue_check_{};
};

}  // namespace tfmpi
