// Rank 0 may hold a decided allreduce back until the other members of its
// "run" are decided too, and then send the whole run in one batch. The
// executor fuses a batch, so a run goes out as one message at the moment its
// last member is ready: the same communication as if the framework had put
// those gradients into one group, without re-tracing the training step.
//
// Why: overlapping an early gradient group with backprop is not free on a
// machine whose cores all compute. MPI busy-polls while the early group is in
// flight, and on the LSTM benchmark that cost the computation more than the
// overlap saved (docs/how-it-works.md, "The grouping plan"). Which
// allreduces form runs is the autotuner's choice (its merge stage, measured
// on the real step); with no runs set, nothing is held.
//
// Never hang: held collectives are ready on every rank, so holding only
// delays them. A run not complete within `limit` of its first held member is
// released as it is. That happens once when a rank is descheduled; when it
// happens kTimeoutsToGiveUp times in a row, a later collective depends on an
// earlier one's result or the step's collectives changed, and from then on
// nothing is held again.
#pragma once

#include <chrono>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "execution/response_cache.h"
#include "negotiation/wire.h"

namespace tfmpi {

class Holdback {
 public:
  using Clock = std::chrono::steady_clock;
  // Each run lists collective names; a name in no run (or alone in one) is never held.
  using Runs = std::vector<std::vector<std::string>>;

  // Releases nothing: call Release(now, true) first if something is held.
  // `decided_this_step`: names already sent in the running step. A run with
  // one of them cannot be completed in this step, so its other members pass
  // unheld until the run's next step.
  void SetRuns(const Runs& runs, Clock::duration limit, const std::unordered_set<std::string>& decided_this_step);
  // Decisions just made, in decision order -> the decisions to send now, in order.
  std::vector<Decision> Admit(std::vector<Decision> decided, const ResponseCache& cache, Clock::time_point now);
  // Every held decision, in the order the runs began, if `all` or if some run
  // is older than the limit (see above).
  std::vector<Decision> Release(Clock::time_point now, bool all);

  // True once holding is switched off for good (see above).
  bool gave_up() const { return gave_up_; }
  // Decisions held back so far (a counter for tests and stats).
  int64_t total_held() const { return total_held_; }

  // The response `d` executes (nullptr for decisions that execute nothing).
  static const Response* Executed(const Decision& d, const ResponseCache& cache);
  // Whether `d` is an allreduce every rank takes part in (a gradient group,
  // which the executor fuses). Only these are ever held.
  static bool MayHold(const Decision& d, const ResponseCache& cache);

 private:
  struct Run {
    size_t members = 0;
    std::vector<Decision> held;
    Clock::time_point since;
    std::unordered_set<std::string> pass_once;  // members that go unheld this step (see SetRuns)
  };
  // The run whose member `r` is, or -1 when `r` is not held (not in a run, or
  // not an allreduce of every rank: see MayHold).
  int RunOf(const Response& r) const;
  void Flush(Run& run, std::vector<Decision>* out);

  std::unordered_map<std::string, int> run_of_;
  std::vector<Run> runs_;
  Clock::duration limit_{};
  size_t held_count_ = 0;
  int64_t total_held_ = 0;
  static constexpr int kTimeoutsToGiveUp = 3;
  int timeouts_in_a_row_ = 0;
  bool gave_up_ = false;
};

// Rank 0's holdback step for one batch: the verdict on the decisions just
// made, plus the held ones whose time has come (all of them when `stopping`).
// Warns once (through *gave_up_reported) when holding is given up.
std::vector<Decision> HoldBackBatch(Holdback& holdback, const ResponseCache& cache, std::vector<Decision> decided,
                                    Holdback::Clock::time_point now, bool stopping, bool* gave_up_reported);

}  // namespace tfmpi
