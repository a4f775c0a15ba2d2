// Online tuning (TF_MPI_AUTOTUNE), run by rank 0 only.
//
// Training repeats the same collectives every step, so steps are found
// without help from the framework: a step begins whenever some collective
// name is decided for the (k+1)-th time while no name had been decided more
// than k times. Counting starts over at every name never seen before, until
// tuning begins: start-up collectives and the first (tracing) step are not
// the loop, and a step must begin at its first collective, not in its middle. The tuner then measures step times under one candidate
// setting after another and keeps the fastest, one stage at a time
// (coordinate descent):
//   0. merge: which of the step's allreduces rank 0 holds back to send with
//      later ones (Holdback runs). Candidates are built from the order in
//      which the allreduces were decided in a recorded step (the same set in
//      two steps in a row): each as it comes (the framework's grouping plan),
//      all in one, and merges between.
//   1-3. (TF_MPI_AUTOTUNE=1 only) which tensors skip the fusion buffer (not
//      where that cannot matter: every host allreduce over shared memory), the
//      fusion threshold, the MPI chunk size.
// Each visit of a candidate has one settling step and then timed steps; a
// candidate's score is the median of its timed steps. The merge stage visits
// its candidates in rounds (A B C A B C ...), because the differences it
// looks for (a few %) are smaller than the drift of a shared machine over a
// few seconds. Rank 0 sends every tunables change as a settings decision, so
// all ranks switch at the same point; runs act on rank 0 alone.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/env.h"
#include "common/tunables.h"
#include "negotiation/holdback.h"

namespace tfmpi {

struct TuneSetting {
  Tunables tunables;
  Holdback::Runs runs;  // a partition of the step's allreduces; empty: hold nothing
  std::string RunsString() const;
  // The plan on the wire under this setting, as report lines laid out like the Python
  // grouping plan's describe() ("effective plan: N groups ...", then "  group k: ..."),
  // given the step's holdable allreduces in the order they were decided. Each
  // allreduce is named as the framework named it (a Keras DistributedOptimizer's
  // plan group k is "<name>.group<k>"), so the lines map onto describe()'s groups.
  std::vector<std::string> EffectivePlan(const std::vector<std::string>& order) const;
};

class Autotuner {
 public:
  using Clock = std::chrono::steady_clock;
  // `tune_direct_bytes`: false skips stage 1 (Executor::direct_bytes_inert).
  Autotuner(const Tunables& start, int64_t steps_per_candidate, AutotuneScope scope, bool tune_direct_bytes);

  // Rank 0 calls this for every collective it sends, in order. `may_hold`:
  // an allreduce the holdback could hold (Holdback::MayHold). Returns the
  // setting to apply when the tuner moves to another candidate or, at the
  // end, to its choice.
  std::optional<TuneSetting> Observe(const std::string& name, bool may_hold, Clock::time_point now);
  // The holdback gave up (a run was not complete in time): the merge stage
  // ends with nothing held. Returns the setting to apply.
  std::optional<TuneSetting> HoldingFailed();

  bool finished() const { return stage_ >= last_stage_ + 1; }
  // The names decided so far in the running step.
  std::unordered_set<std::string> DecidedThisStep() const;
  // How long a run may wait for its last member: generous against the step time.
  Clock::duration hold_limit() const;
  // One line per candidate (setting, median step time) and the choice.
  std::string Report() const;

 private:
  static constexpr int kRecordStage = -1;
  static constexpr int kMergeStage = 0;
  static constexpr int64_t kWarmupSteps = 5;  // tracing, first broadcasts: not representative
  static constexpr int kMergeRounds = 3;
  static constexpr int64_t kMaxRecordings = 20;

  std::optional<TuneSetting> NewStep(double last_ms);
  // Enters the next stage that has candidates; returns its first visit, or the choice when done.
  std::optional<TuneSetting> NextStage();
  TuneSetting BeginVisit();
  void EndStage();

  int64_t steps_per_candidate_;
  int last_stage_;
  bool tune_direct_bytes_;
  std::unordered_set<std::string> known_;          // every name decided so far (until tuning begins)
  std::unordered_map<std::string, int64_t> seen_;  // decisions per name since counting (re)started
  int64_t step_ = 0;                               // steps begun so far
  Clock::time_point step_start_{};
  std::vector<double> warm_ms_;                    // warm-up step times, for hold_limit()
  bool recording_ = false;                         // the running step is recorded into recorded_[1]
  int64_t recordings_ = 0;                         // steps recorded since counting (re)started
  std::vector<std::string> recorded_[2];           // the last two, holdable allreduces in decision order

  int stage_ = kRecordStage;
  TuneSetting best_;                     // best so far (the base of the current stage)
  std::vector<TuneSetting> candidates_;  // of the current stage
  std::vector<size_t> visits_;           // candidate indices, in visiting order
  size_t visit_ = 0;
  int64_t timed_per_visit_ = 1;
  std::vector<std::vector<double>> times_ms_;  // per candidate, settling steps excluded
  int64_t settle_ = 1, timed_ = 0;
  std::vector<std::string> report_;
};

// Rank 0, once per batch while tuning: shows the tuner the batch's
// collectives; when it picks a new setting, releases what the old runs hold,
// gives the holdback the new runs and appends the kSettings decision.
void TuneBatch(Autotuner& tuner, Holdback& holdback, const ResponseCache& cache, Autotuner::Clock::time_point now,
               std::vector<Decision>* decisions);

}  // namespace tfmpi
