#include "negotiation/autotune.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "common/logging.h"

namespace tfmpi {

namespace {
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The values tried for each size stage (1-3). Sizes that matter on
// shared-memory and on network transports alike; the start value is added.
std::vector<int64_t> SizeValues(int stage, const Tunables& start) {
  std::vector<int64_t> v;
  int64_t current = 0;
  switch (stage) {
    case 1: v = {0, 64ll << 10, 256ll << 10, 1ll << 20, 4ll << 20}; current = start.direct_bytes; break;
    case 2: v = {0, 1ll << 20, 8ll << 20, 64ll << 20}; current = start.fusion_threshold; break;
    default: v = {256ll << 10, 1ll << 20, 4ll << 20}; current = start.chunk_bytes; break;
  }
  if (std::find(v.begin(), v.end(), current) == v.end()) v.push_back(current);
  return v;
}

Tunables WithSize(Tunables t, int stage, int64_t value) {
  (stage == 1 ? t.direct_bytes : stage == 2 ? t.fusion_threshold : t.chunk_bytes) = value;
  return t;
}

// Cuts `order` into contiguous runs; bit i of `cuts` set: a run ends after order[i].
Holdback::Runs Partition(const std::vector<std::string>& order, uint32_t cuts) {
  Holdback::Runs runs(1);
  for (size_t i = 0; i < order.size(); ++i) {
    runs.back().push_back(order[i]);
    if (i + 1 < order.size() && (cuts >> i & 1u)) runs.emplace_back();
  }
  return runs;
}

// Every allreduce alone up to order[from], then one run of the rest.
Holdback::Runs TailRun(const std::vector<std::string>& order, size_t from) {
  Holdback::Runs runs;
  for (size_t i = 0; i < from; ++i) runs.push_back({order[i]});
  runs.emplace_back(order.begin() + from, order.end());
  return runs;
}

// The merge stage's candidates, the framework's plan (every allreduce alone)
// first. Up to 4 allreduces per step: every way to merge neighbours (8 at
// most). More (a per-tensor plan): all alone, the last two merged, the second
// half merged, all in one.
std::vector<Holdback::Runs> MergeCandidates(const std::vector<std::string>& order) {
  const size_t n = order.size();
  std::vector<Holdback::Runs> out;
  if (n <= 4) {
    for (uint32_t cuts = (1u << (n - 1)); cuts-- > 0;) out.push_back(Partition(order, cuts));
  } else {
    for (size_t from : {n - 1, n - 2, n / 2, size_t{0}}) out.push_back(TailRun(order, from));
  }
  return out;
}
}  // namespace

std::vector<std::string> TuneSetting::EffectivePlan(const std::vector<std::string>& order) const {
  // Every allreduce alone when nothing is held; else the runs (a partition of `order`).
  Holdback::Runs groups = runs;
  if (groups.empty())
    for (const std::string& name : order) groups.push_back({name});
  std::vector<std::string> lines;
  lines.push_back("effective plan: " + std::to_string(groups.size()) + " groups on the wire, from the " +
                  std::to_string(order.size()) + " allreduces of a step in the order they were sent" +
                  (runs.empty() ? " (nothing held back)" : " (rank 0's holdback sends each group as one message)"));
  for (size_t g = 0; g < groups.size(); ++g) {
    std::ostringstream line;
    line << "  group " << g << ": " << groups[g].size() << (groups[g].size() == 1 ? " allreduce: " : " allreduces: ");
    for (size_t i = 0; i < groups[g].size(); ++i) line << (i ? " + " : "") << groups[g][i];
    lines.push_back(line.str());
  }
  return lines;
}

std::string TuneSetting::RunsString() const {
  if (runs.empty()) return "every allreduce as it comes";
  std::ostringstream os;
  for (size_t r = 0; r < runs.size(); ++r) {
    os << (r ? " " : "") << "[";
    for (size_t i = 0; i < runs[r].size(); ++i) os << (i ? " + " : "") << runs[r][i];
    os << "]";
  }
  return os.str();
}

Autotuner::Autotuner(const Tunables& start, int64_t steps_per_candidate, AutotuneScope scope, bool tune_direct_bytes)
    : steps_per_candidate_(steps_per_candidate),
      last_stage_(scope == AutotuneScope::kAll ? 3 : kMergeStage),
      tune_direct_bytes_(tune_direct_bytes) {
  best_.tunables = start;
}

Autotuner::Clock::duration Autotuner::hold_limit() const {
  // Only a safety valve (holdback.h): a run waits for its last member less
  // than one step, so this is far above it, and above a descheduled rank.
  const double ms = std::max(500.0, 10 * Median(warm_ms_));
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms));
}

std::optional<TuneSetting> Autotuner::Observe(const std::string& name, bool may_hold, Clock::time_point now) {
  if (finished()) return std::nullopt;
  if (stage_ == kRecordStage && known_.insert(name).second) {
    // A name never seen before: whatever repeated so far (a start-up probe,
    // the first step, which traces) was not the training loop. Steps are
    // counted again from the next repeated name, which is where a step of
    // the new pattern begins.
    seen_.clear();
    step_ = 0;
    warm_ms_.clear();
    recording_ = false;
    recordings_ = 0;
    return std::nullopt;
  }
  std::optional<TuneSetting> change;
  const int64_t count = ++seen_[name];
  if (count > step_) {  // a new step begins now
    const double last_ms = std::chrono::duration<double, std::milli>(now - step_start_).count();
    step_ = count;
    step_start_ = now;
    change = NewStep(last_ms);
  }
  if (recording_ && may_hold) recorded_[1].push_back(name);
  return change;
}

std::optional<TuneSetting> Autotuner::NewStep(double last_ms) {
  if (step_ >= 3 && step_ <= kWarmupSteps + 1) warm_ms_.push_back(last_ms);  // steps 2..5: traced already
  if (step_ <= kWarmupSteps) return std::nullopt;
  if (stage_ == kRecordStage) {
    // The merge stage needs two recorded steps in a row with the same (two or
    // more) allreduces. Until then, or until kMaxRecordings steps show that
    // the loop has no such pattern, keep recording.
    // (A name decided twice starts a new step, so a recorded step has no duplicates.)
    if (recording_ && ++recordings_ >= 2) {
      const std::set<std::string> a(recorded_[0].begin(), recorded_[0].end()),
          b(recorded_[1].begin(), recorded_[1].end());
      const bool steady = a == b && b.size() >= 2;
      if (steady || recordings_ >= kMaxRecordings) {
        if (!steady) {
          report_.push_back("groups: not tuned (no steady step with two or more allreduces in " +
                            std::to_string(kMaxRecordings) + " steps)");
          recorded_[1].clear();
        }
        recording_ = false;
        return NextStage();
      }
    }
    recording_ = true;
    recorded_[0] = std::move(recorded_[1]);
    recorded_[1].clear();
    return std::nullopt;
  }
  if (settle_ > 0) {
    --settle_;
    return std::nullopt;
  }
  times_ms_[visits_[visit_]].push_back(last_ms);
  if (++timed_ < timed_per_visit_) return std::nullopt;
  if (++visit_ < visits_.size()) return BeginVisit();
  EndStage();
  return NextStage();
}

TuneSetting Autotuner::BeginVisit() {
  settle_ = 1;
  timed_ = 0;
  return candidates_[visits_[visit_]];
}

void Autotuner::EndStage() {
  std::vector<double> ms;
  for (size_t c = 0; c < candidates_.size(); ++c) {
    ms.push_back(Median(times_ms_[c]));
    std::ostringstream line;
    line << (stage_ == kMergeStage ? "groups " + candidates_[c].RunsString() : candidates_[c].tunables.ToString())
         << ": median step " << ms.back() << " ms";
    report_.push_back(line.str());
  }
  // The stage's winner; the base itself was one of the candidates, measured
  // in this stage, so times from different stages are never compared.
  best_ = candidates_[std::min_element(ms.begin(), ms.end()) - ms.begin()];
}

std::optional<TuneSetting> Autotuner::NextStage() {
  while (!finished()) {
    ++stage_;
    candidates_.clear();
    if (finished()) break;
    int rounds = 1;
    if (stage_ == kMergeStage) {
      if (recorded_[1].size() < 2) continue;  // nothing to merge
      for (Holdback::Runs& runs : MergeCandidates(recorded_[1])) candidates_.push_back({best_.tunables, runs});
      candidates_.front().runs.clear();  // every allreduce alone is the same as holding nothing
      rounds = kMergeRounds;
    } else if (stage_ == 1 && !tune_direct_bytes_) {
      report_.push_back("direct_bytes: not tuned (every host allreduce goes over shared memory, without a fusion "
                        "buffer to skip)");
      continue;
    } else {
      for (int64_t v : SizeValues(stage_, best_.tunables))
        candidates_.push_back({WithSize(best_.tunables, stage_, v), best_.runs});
    }
    visits_.clear();
    for (int r = 0; r < rounds; ++r)
      for (size_t c = 0; c < candidates_.size(); ++c) visits_.push_back(c);
    visit_ = 0;
    timed_per_visit_ = std::max<int64_t>(1, (steps_per_candidate_ + rounds - 1) / rounds);
    times_ms_.assign(candidates_.size(), {});
    return BeginVisit();
  }
  report_.push_back("chosen: " + best_.tunables.ToString() + " groups " + best_.RunsString());
  if (recorded_[1].empty()) {
    report_.push_back("effective plan: as the framework sends it (no steady step to merge in; nothing held back)");
  } else {
    for (std::string& line : best_.EffectivePlan(recorded_[1])) report_.push_back(std::move(line));
  }
  return best_;
}

std::optional<TuneSetting> Autotuner::HoldingFailed() {
  if (stage_ != kMergeStage || finished()) return std::nullopt;
  report_.push_back("groups: not tuned (a held allreduce waited too long for the rest of its group)");
  best_.runs.clear();
  return NextStage();
}

std::unordered_set<std::string> Autotuner::DecidedThisStep() const {
  std::unordered_set<std::string> names;
  for (const auto& [name, count] : seen_)
    if (count == step_) names.insert(name);
  return names;
}

std::string Autotuner::Report() const {
  std::ostringstream os;
  for (const std::string& line : report_) os << "\n  " << line;
  return os.str();
}

void TuneBatch(Autotuner& tuner, Holdback& holdback, const ResponseCache& cache, Autotuner::Clock::time_point now,
               std::vector<Decision>* decisions) {
  auto observe = [&](const std::vector<Decision>& batch, size_t from) {
    std::optional<TuneSetting> change;
    for (size_t i = from; i < batch.size(); ++i) {
      if (const Response* r = Holdback::Executed(batch[i], cache))
        if (auto s = tuner.Observe(r->meta.name, Holdback::MayHold(batch[i], cache), now)) change = s;
    }
    return change;
  };
  std::optional<TuneSetting> change = holdback.gave_up() ? tuner.HoldingFailed() : std::nullopt;
  if (auto s = observe(*decisions, 0)) change = s;
  if (!change) return;
  // New runs replace the old ones: what the old ones hold goes now (and is
  // shown to the tuner, so its counts of each name stay right).
  const size_t released_from = decisions->size();
  for (Decision& d : holdback.Release(now, true)) decisions->push_back(std::move(d));
  observe(*decisions, released_from);
  holdback.SetRuns(change->runs, tuner.hold_limit(), tuner.DecidedThisStep());
  Decision settings;
  settings.kind = Decision::Kind::kSettings;
  settings.tunables = change->tunables;
  decisions->push_back(settings);
  if (tuner.finished()) LogInfo("autotune finished (TF_MPI_AUTOTUNE), median step time per setting:" + tuner.Report());
}

}  // namespace tfmpi
