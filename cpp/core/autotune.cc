#include "autotune.h"

#include <algorithm>
#include <sstream>

namespace tfmpi {

namespace {
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The values tried for each field, one stage per field. Sizes that matter on
// shared-memory and on network transports alike; the start value is added.
std::vector<int64_t> StageValues(int stage, const Tunables& start) {
  std::vector<int64_t> v;
  int64_t current = 0;
  switch (stage) {
    case 0: v = {0, 64ll << 10, 256ll << 10, 1ll << 20, 4ll << 20}; current = start.direct_bytes; break;
    case 1: v = {0, 1ll << 20, 8ll << 20, 64ll << 20}; current = start.fusion_threshold; break;
    default: v = {256ll << 10, 1ll << 20, 4ll << 20}; current = start.chunk_bytes; break;
  }
  if (std::find(v.begin(), v.end(), current) == v.end()) v.push_back(current);
  return v;
}

Tunables With(Tunables t, int stage, int64_t value) {
  (stage == 0 ? t.direct_bytes : stage == 1 ? t.fusion_threshold : t.chunk_bytes) = value;
  return t;
}
}  // namespace

Autotuner::Autotuner(const Tunables& start, int64_t steps_per_candidate)
    : steps_per_candidate_(steps_per_candidate), best_(start) {}

void Autotuner::StartStage() {
  ++stage_;
  candidates_.clear();
  stage_ms_.clear();
  candidate_ = 0;
  if (finished()) return;
  for (int64_t v : StageValues(stage_, best_)) candidates_.push_back(With(best_, stage_, v));
}

std::optional<Tunables> Autotuner::NextCandidate() {
  while (!finished() && candidate_ >= candidates_.size()) StartStage();
  if (finished()) return std::nullopt;
  times_ms_.clear();
  settle_ = 1;
  return candidates_[candidate_];
}

std::optional<Tunables> Autotuner::Observe(const std::string& name, Clock::time_point now) {
  if (finished()) return std::nullopt;
  const int64_t count = ++seen_[name];
  if (count <= step_) return std::nullopt;  // still inside the current step
  // A new step begins now.
  const double last_ms = std::chrono::duration<double, std::milli>(now - step_start_).count();
  step_ = count;
  step_start_ = now;
  if (step_ <= kWarmupSteps) return std::nullopt;
  if (stage_ < 0) return NextCandidate();  // first candidate starts with this step
  if (settle_ > 0) {
    --settle_;
    return std::nullopt;
  }
  times_ms_.push_back(last_ms);
  if (static_cast<int64_t>(times_ms_.size()) < steps_per_candidate_) return std::nullopt;

  const double ms = Median(times_ms_);
  std::ostringstream line;
  line << candidates_[candidate_].ToString() << ": median step " << ms << " ms";
  report_.push_back(line.str());
  stage_ms_.push_back(ms);
  if (++candidate_ == candidates_.size()) {
    // The stage's winner; the base itself was one of the candidates, measured
    // in this stage, so times from different stages are never compared.
    best_ = candidates_[std::min_element(stage_ms_.begin(), stage_ms_.end()) - stage_ms_.begin()];
  }
  if (auto next = NextCandidate()) return next;
  report_.push_back("chosen: " + best_.ToString());
  return best_;
}

std::string Autotuner::Report() const {
  std::ostringstream os;
  for (const std::string& line : report_) os << "\n  " << line;
  return os.str();
}

}  // namespace tfmpi
