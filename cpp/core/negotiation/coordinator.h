// Rank 0's bookkeeping: which rank has announced which collective, when a
// collective is ready on every rank, whether the ranks agree on it, and which
// collectives are stalled (announced by some ranks, not by others).
//
// Rank 0 alone decides the order in which ready collectives run; every rank
// then executes the same decisions in the same order, so MPI calls match even
// though TensorFlow schedules ops differently on each rank.
//
// Announcements by cache id arrive as rank ranges (negotiation_tree.h) and are
// counted as ranges: a steady-state collective costs O(number of ranges) here,
// not O(N). Per-rank detail (every rank's metadata) is built only on the rare
// paths: a rank announced in full, a rank has joined, a stall is reported.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/request.h"
#include "common/timeline.h"
#include "execution/response_cache.h"
#include "negotiation/rank_ranges.h"
#include "negotiation/wire.h"

namespace tfmpi {

using Clock = std::chrono::steady_clock;

class Coordinator {
 public:
  Coordinator(int size, const ResponseCache* cache, double stall_warn_s, double stall_shutdown_s,
              Timeline* timeline)
      : size_(size), cache_(cache), departed_(size, false), gone_why_(size),
        stall_warn_s_(stall_warn_s), stall_shutdown_s_(stall_shutdown_s), timeline_(timeline),
        joined_(size, false) {}

  // `rank` announced `meta`.
  void Announce(int rank, RequestMeta meta, Clock::time_point now);
  // `ranks` announced a request by cache id. Throws if rank 0 has no such entry
  // (the ranks disagree on the protocol): the engine then stops (Protocol::Fail).
  void AnnounceCached(const RankRanges& ranks, uint32_t cache_id, Clock::time_point now);
  // `rank` is shutting down: what waits on it fails, it gets an acknowledgement
  // (once: a repeated shutdown announcement of the same rank is ignored).
  void Departed(int rank);
  // `rank` cannot be reached (transports/liveness.h; `detail` says how that was
  // found): as Departed, with errors naming it so. Its acknowledgement is
  // never sent to it, but every other rank executes it (and leaves the tree).
  void Unreachable(int rank, const std::string& detail);
  bool any_departed() const { return departed_count_ > 0; }

  // Decisions made since the last call, in execution order.
  std::vector<Decision> TakeDecisions();
  // Warns about (and past the shutdown time, fails) collectives that some
  // ranks announced long ago and others not at all.
  void CheckStalls(Clock::time_point now);

 private:
  struct Pending {
    std::map<int, RequestMeta> full;  // ranks that announced in full, with what they announced
    RankRanges cached;                // ranks that announced by cache_id
    uint32_t cache_id = 0;
    int64_t count = 0;                // full.size() + cached.count()
    Clock::time_point first_seen;
    Clock::time_point last_warned;
  };
  Pending& Entry(const std::string& name, Clock::time_point now);
  // Every rank's announcement (empty: not announced); the rare paths only.
  std::vector<std::optional<RequestMeta>> ByRank(const Pending& p) const;
  const RequestMeta& AnyMeta(const Pending& p) const;
  // Counts an announcement into `name`'s entry; decides it once complete.
  void Counted(const std::string& name, Pending& p, Clock::time_point now);
  void Decide(const std::string& name, Pending& p, Clock::time_point now);
  // Fails `name` on every rank with `why`; `code` says how (see Decision::error_code).
  void Fail(const std::string& name, const std::string& why, StatusCode code = StatusCode::kPrecondition);
  // `rank` called join(): it counts as ready for every collective until all have joined.
  void Join(int rank, Clock::time_point now);
  // Departed and Unreachable: what waits on `rank` fails with `why` ("rank R " + why).
  void Leave(int rank, const std::string& why);
  // The ranks gone so far, grouped by why ("rank 2 called shutdown()").
  std::string Gone() const;
  bool Complete(const Pending& p) const;
  std::string Ranks(const Pending& p, bool announced) const;

  int size_;
  const ResponseCache* cache_;
  std::vector<bool> departed_;
  std::vector<std::string> gone_why_;  // per departed rank: "called shutdown()" or why it is unreachable
  int departed_count_ = 0;
  double stall_warn_s_, stall_shutdown_s_;
  Timeline* timeline_;
  std::vector<bool> joined_;
  int joined_count_ = 0;
  int last_joiner_ = -1;
  std::unordered_map<std::string, Pending> pending_;
  std::vector<Decision> decisions_;
};

}  // namespace tfmpi
