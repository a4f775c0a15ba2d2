// Runs rank 0's decisions on this rank: updates the response cache, performs
// the MPI collectives (fused where possible) and completes the callers'
// requests. Every rank runs the same decisions in the same order.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "collectives.h"
#include "env.h"
#include "request.h"
#include "response_cache.h"
#include "timeline.h"
#include "wire.h"

namespace tfmpi {

using InFlight = std::unordered_map<std::string, std::unique_ptr<Request>>;

// Counters since process start, read from other threads: requests completed,
// requests failed, allreduce buckets (one fused buffer or direct tensor each)
// and, on rank 0, allreduces held back to go with later ones (holdback.h).
struct ExecutorStats {
  std::atomic<int64_t> requests{0}, errors{0}, allreduce_buckets{0}, held_back{0};
};

class Executor {
 public:
  Executor(const MpiContext* mpi, const EngineConfig& config, ExecutorStats* stats, Timeline* timeline)
      : mpi_(mpi), collectives_(mpi, config.tunables.chunk_bytes, config.yield_bytes), tunables_(config.tunables),
        stats_(stats), timeline_(timeline) {}

  // Executes `decisions`; requests they name are completed and removed from
  // `in_flight`. Returns false if a decision names a request this rank does
  // not have (a protocol error: the caller must abort rather than hang).
  bool Run(const std::vector<Decision>& decisions, InFlight* in_flight, ResponseCache* cache);
  const Tunables& tunables() const { return tunables_; }


 private:
  struct Work { Request* request; const Response* response; };
  // A stand-in for a collective this rank did not submit because it called
  // join(): zeros (the reduce op's identity) in, results discarded.
  static std::unique_ptr<Request> JoinedStandIn(const Response& r);
  void RunAllreduces(const std::vector<Work>& work);
  void RunAllgather(const Work& w);
  void RunBroadcast(const Work& w);
  void RunAlltoall(const Work& w);
  void RunReducescatter(const Work& w);
  // Average divides by the ranks that contributed (not those that joined).
  double PostScale(const RequestMeta& m, int contributors) const;

  const MpiContext* mpi_;
  Collectives collectives_;
  Tunables tunables_;  // changed only by kSettings decisions, so identical on all ranks
  std::vector<char> fusion_buffer_;  // reused across steps; grows to the threshold
  ExecutorStats* stats_;
  Timeline* timeline_;
  std::chrono::steady_clock::time_point decided_;  // when the running batch was decided/received
  int64_t bucket_id_ = 0;
};

}  // namespace tfmpi
