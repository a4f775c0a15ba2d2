// A Chrome-trace / Perfetto JSON timeline of the engine's work, written by
// rank 0 (which sees every rank's announcements). One track per tensor name:
//   NEGOTIATE   first announcement of the name -> rank 0's decision
//               (instant READY events mark when each rank's announcement arrived)
//   QUEUE       decision -> the start of its MPI work (waiting behind earlier buckets)
//   MEMCPY_IN_FUSION_BUFFER / MPI_ALLREDUCE / MEMCPY_OUT_FUSION_BUFFER
//               the fused bucket's phases, on every member's track, with the
//               bucket id and its member count in args (so fusion is visible)
//   MPI_NODE_REDUCESCATTER / MPI_CROSS_ALLREDUCE / MPI_NODE_ALLGATHER (SHM_NODE_*
//               when the node stage runs over shared memory)
//               inside MPI_ALLREDUCE when the buffer went hierarchical (hierarchical.h)
//               (SHM_ALLREDUCE instead of MPI_ALLREDUCE when the bucket ran
//               over shared memory, shm_allreduce.h, with the microseconds it
//               waited on its peers in args)
//   MPI_ALLGATHER, MPI_BROADCAST, ... for the other collectives
// The file is a complete JSON document after Stop() (also called at shutdown).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

namespace tfmpi {

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  // Starts writing to `path` (replacing a running timeline). False if the file cannot be opened.
  bool Start(const std::string& path);
  void Stop();
  bool active() const { return active_.load(std::memory_order_relaxed); }

  void Span(const std::string& track, const char* name, Clock::time_point start, Clock::time_point end,
            const std::string& args_json = "");
  void Instant(const std::string& track, const char* name, Clock::time_point at, const std::string& args_json = "");

 private:
  // One event; duration_us < 0 for instants.
  void Emit(const std::string& track, const char* name, const char* phase_fields, Clock::time_point at,
            double duration_us, const std::string& args_json);
  int TrackId(const std::string& track);  // with mu_ held
  void Write(const std::string& event);   // with mu_ held
  double Micros(Clock::time_point t) const;

  std::atomic<bool> active_{false};
  std::mutex mu_;
  FILE* file_ = nullptr;
  bool first_ = true;
  Clock::time_point origin_;
  std::unordered_map<std::string, int> tracks_;
};

// JSON string literal for `s` (quotes included).
std::string JsonString(const std::string& s);

}  // namespace tfmpi
