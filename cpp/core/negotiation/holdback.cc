#include "negotiation/holdback.h"

#include <algorithm>

#include "common/logging.h"

namespace tfmpi {

namespace {
// Gradient groups: allreduces every rank takes part in, which the executor fuses.
bool AllreduceOfAll(const Response& r) { return r.meta.type == CollectiveType::kAllreduce && r.joined.empty(); }
}  // namespace

void Holdback::SetRuns(const Runs& runs, Clock::duration limit,
                       const std::unordered_set<std::string>& decided_this_step) {
  run_of_.clear();
  runs_.clear();
  held_count_ = 0;
  limit_ = limit;
  if (gave_up_) return;
  for (const auto& names : runs) {
    if (names.size() < 2) continue;  // a run of one never waits for anything
    const int id = static_cast<int>(runs_.size());
    Run run{names.size(), {}, {}, {}};
    bool started = false;
    for (const std::string& name : names) started = started || decided_this_step.count(name);
    for (const std::string& name : names) {
      run_of_[name] = id;
      if (started && !decided_this_step.count(name)) run.pass_once.insert(name);
    }
    runs_.push_back(std::move(run));
  }
}

const Response* Holdback::Executed(const Decision& d, const ResponseCache& cache) {
  return d.kind == Decision::Kind::kExecute         ? &d.response
         : d.kind == Decision::Kind::kExecuteCached ? &cache.Get(d.cache_id)
                                                    : nullptr;
}

bool Holdback::MayHold(const Decision& d, const ResponseCache& cache) {
  const Response* r = Executed(d, cache);
  return r && AllreduceOfAll(*r);
}

int Holdback::RunOf(const Response& r) const {
  if (!AllreduceOfAll(r)) return -1;
  auto it = run_of_.find(r.meta.name);
  return it == run_of_.end() ? -1 : it->second;
}

void Holdback::Flush(Run& run, std::vector<Decision>* out) {
  held_count_ -= run.held.size();
  for (Decision& d : run.held) out->push_back(std::move(d));
  run.held.clear();
}

std::vector<Decision> Holdback::Admit(std::vector<Decision> decided, const ResponseCache& cache,
                                      Clock::time_point now) {
  if (run_of_.empty() && held_count_ == 0) return decided;
  std::vector<Decision> out;
  for (Decision& d : decided) {
    const bool leaving = d.kind == Decision::Kind::kShutdownAck || d.kind == Decision::Kind::kCoordinatorGone;
    if (leaving) {
      // Everything held must run while the departing rank still executes decisions.
      for (Decision& h : Release(now, true)) out.push_back(std::move(h));
      out.push_back(std::move(d));
      continue;
    }
    const Response* r = run_of_.empty() ? nullptr : Executed(d, cache);
    const int id = r ? RunOf(*r) : -1;
    if (id < 0) {
      out.push_back(std::move(d));
      continue;
    }
    Run& run = runs_[id];
    if (run.pass_once.erase(r->meta.name)) {
      out.push_back(std::move(d));
      continue;
    }
    if (run.held.empty()) run.since = now;
    run.held.push_back(std::move(d));
    ++held_count_;
    ++total_held_;
    if (run.held.size() == run.members) {
      // The run's last member: it rides in the same batch, it is not "held".
      --total_held_;
      timeouts_in_a_row_ = 0;
      Flush(run, &out);
    }
  }
  return out;
}

std::vector<Decision> Holdback::Release(Clock::time_point now, bool all) {
  std::vector<Decision> out;
  if (held_count_ == 0) return out;
  bool overdue = false;
  for (const Run& run : runs_) overdue = overdue || (!run.held.empty() && now - run.since > limit_);
  if (!all && !overdue) return out;
  if (overdue && !all && ++timeouts_in_a_row_ >= kTimeoutsToGiveUp) {
    gave_up_ = true;
    run_of_.clear();
  }
  // Oldest run first, the order in which they were decided.
  std::vector<Run*> order;
  for (Run& run : runs_) if (!run.held.empty()) order.push_back(&run);
  std::sort(order.begin(), order.end(), [](const Run* a, const Run* b) { return a->since < b->since; });
  for (Run* run : order) Flush(*run, &out);
  return out;
}

std::vector<Decision> HoldBackBatch(Holdback& holdback, const ResponseCache& cache, std::vector<Decision> decided,
                                    Holdback::Clock::time_point now, bool stopping, bool* gave_up_reported) {
  std::vector<Decision> out = holdback.Admit(std::move(decided), cache, now);
  for (Decision& d : holdback.Release(now, stopping)) out.push_back(std::move(d));
  if (holdback.gave_up() && !*gave_up_reported) {
    *gave_up_reported = true;
    LogWarning("autotune: a held-back allreduce waited longer than the step-time limit for the rest of its group;"
               " every allreduce is sent as soon as it is ready from now on");
  }
  return out;
}

}  // namespace tfmpi
