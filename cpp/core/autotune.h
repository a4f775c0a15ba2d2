// Online tuning of the Tunables (TF_MPI_AUTOTUNE=1), run by rank 0 only.
//
// Training repeats the same collectives every step, so steps are found
// without help from the framework: a step begins whenever some collective
// name is decided for the (k+1)-th time while no name had been decided more
// than k times. The tuner then measures step times under one candidate
// setting after another and keeps the fastest (coordinate descent: first
// which tensors skip the fusion buffer, then the fusion threshold, then the
// MPI chunk size). Each candidate gets one settling step and then
// `steps_per_candidate` timed steps; its score is their median. Rank 0 sends
// every change as a settings decision, so all ranks switch at the same point.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tunables.h"

namespace tfmpi {

class Autotuner {
 public:
  using Clock = std::chrono::steady_clock;
  Autotuner(const Tunables& start, int64_t steps_per_candidate);

  // Rank 0 calls this for every collective it decides, in decision order.
  // Returns the settings to send when the tuner moves to the next candidate
  // or, at the end, to its choice.
  std::optional<Tunables> Observe(const std::string& name, Clock::time_point now);

  bool finished() const { return stage_ >= kStages; }
  // One line per candidate (setting, median step time) and the choice.
  std::string Report() const;

 private:
  static constexpr int kStages = 3;
  static constexpr int64_t kWarmupSteps = 5;  // tracing, first broadcasts: not representative
  // The next candidate of the current stage (or of the next stage); nullopt when done.
  std::optional<Tunables> NextCandidate();
  void StartStage();

  int64_t steps_per_candidate_;
  std::unordered_map<std::string, int64_t> seen_;  // decisions per name
  int64_t step_ = 0;                               // steps begun so far
  Clock::time_point step_start_{};

  int stage_ = -1;
  Tunables best_;                        // best so far (the base of the current stage)
  std::vector<Tunables> candidates_;     // of the current stage
  std::vector<double> stage_ms_;         // their median step times, in order
  size_t candidate_ = 0;
  std::vector<double> times_ms_;         // of the current candidate, settling step excluded
  int64_t settle_ = 1;
  std::vector<std::string> report_;
};

}  // namespace tfmpi
